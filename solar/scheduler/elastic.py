"""Elastic re-planning: a job checkpointed at global step g on P ranks with local batch b resumes on P'
ranks with local batch b' = P*b/P' (the global batch G = P*b is kept).

Pure functions (arrays and dicts in, arrays and dicts out; no I/O, no MPI, no clock).

**Which batches the resumed job trains.**  DistributedSampler's index of epoch t is ``randperm(N)``
(seeded ``seed + t``) padded by repeating its head to a multiple of the world size (or truncated
to one with ``drop_last``), and global batch k is ``index[k*G:(k+1)*G]``.  G is a multiple of
both P and P', so every global batch that is full under both world sizes is the same set of the
same permutation.  Only the epoch's end depends on the world size: without ``drop_last`` the last
global batch holds the same real samples ``perm[kG:N]`` plus ``total - N`` repeated head samples
(``total`` = N rounded up to a multiple of the world size), with ``drop_last`` the tail dropped
is ``N mod P`` vs ``N mod P'`` samples (and the epoch may have one step fewer or more).

Rule: from the checkpointed step on, the new job trains DistributedSampler's index **for the new
world size**, in the epoch in progress too.  Its remaining global batches are the old job's
except the last of the epoch in progress, which is the new world size's (same real samples,
other padding; with ``drop_last`` another tail).  So every real sample of the interrupted epoch
is trained exactly once when the old job pads, every later epoch is exactly what
``DistributedSampler(num_replicas=P')`` gives, and a resumed plan is an ordinary plan for P'
whose steps before the resume point are empty.  Old step ``g = e*S + s`` (S steps per epoch on
P ranks) becomes new step ``e*S' + min(s, S')`` (S' = S unless ``drop_last`` changes it).

**Buffers.**  A new job's ranks (a node plan's nodes) start with empty buffers, and so does its plan: the engine
starts the epoch in progress at the resume step with empty buffers (``PlanRun.advance(first_step=...)``), Belady's
next uses and the routing computed over the steps from there on, so it plans that epoch as a job whose epoch began
there; the later epochs follow as in any plan.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, fields, replace
from typing import Callable, Optional

import numpy as np

from ..errors import SpecError
from .config import PlanConfig
from .run import EpochPlan, PlanRun, PolicyResult
from .sampler import batch_bounds, epoch_indices, steps_per_epoch

#: keys of :meth:`SolarLoader.state_dict` that say which job a state belongs to (with ``step``, the cursor)
STATE_KEYS = ("fingerprint", "world_size", "config", "policy", "step")
IDENTITY_KEYS = ("fingerprint", "world_size", "config", "policy")


class ResumeError(SpecError):
    """A loader state that cannot resume this job (other global batch, dataset, sampler, ...)."""


@dataclass(frozen=True)
class ResumePoint:
    """Where the new job starts: epoch ``epoch`` (its DistributedSampler epoch), step ``step`` of it
    counted in the new job's steps, i.e. global step ``global_step`` = ``epoch * S' + step``; the
    old job's cursor was ``old_step``."""

    epoch: int
    step: int
    global_step: int
    old_step: int

    def __post_init__(self):
        for name in ("epoch", "step", "global_step", "old_step"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise SpecError(f"resume point {name} must be an integer >= 0, got {v!r}")


def global_batch_text(world_size: int, local_batch: int) -> str:
    """``"6 (2 ranks x 3)"``: a global batch size and how it is made."""
    return f"{world_size * local_batch} ({world_size} ranks x {local_batch})"


def new_local_batch(old_world: int, old_local: int, world: int, local: Optional[int] = None) -> int:
    """The local batch on ``world`` ranks that keeps the global batch ``old_world * old_local``: ``local``
    checked, or derived when None.  :class:`ResumeError` naming both global batch sizes otherwise."""
    G = old_world * old_local
    if local is None:
        if G % world:
            ok = [p for p in range(1, G + 1) if G % p == 0]
            raise ResumeError(f"the checkpointed job's global batch {global_batch_text(old_world, old_local)} cannot "
                              f"be split over {world} ranks ({G}/{world} is not an integer); resume on "
                              f"{', '.join(map(str, ok))} ranks")
        return G // world
    if world * local != G:
        raise ResumeError(f"global batch {global_batch_text(world, local)} differs from the checkpointed job's "
                          f"{global_batch_text(old_world, old_local)}: the remaining global batches would not be "
                          f"the same; keep world size x local batch = {G}")
    return int(local)


def resume_point(n: int, old_world: int, old_local: int, world: int, local: int, old_step: int,
                 drop_last: bool = False) -> ResumePoint:
    """The new job's start for old global step ``old_step`` (the old job's cursor) of a job on ``n``
    samples: same epoch, same step unless the new world size's epoch is shorter (``drop_last``), then
    the next epoch's first step (see the module docstring)."""
    new_local_batch(old_world, old_local, world, local)
    S_old = steps_per_epoch(n, old_world, old_local, drop_last)
    S_new = steps_per_epoch(n, world, local, drop_last)
    if S_old < 1 or S_new < 1:
        short = world if S_new < 1 else old_world
        raise ResumeError(f"drop_last with {n} samples leaves no sample to train on {short} ranks")
    e, s = divmod(int(old_step), S_old)
    s = min(s, S_new)
    return ResumePoint(e + s // S_new, s % S_new, e * S_new + s, int(old_step))


def remaining_batches(n: int, world: int, local: int, seed: int, epoch: int, first_step: int = 0,
                      drop_last: bool = False) -> list:
    """The global batches (int64 arrays of sample ids, in index order) that DistributedSampler on
    ``world`` ranks with local batch ``local`` gives in epoch ``epoch`` from step ``first_step`` on:
    what a job resumed there on ``world`` ranks trains."""
    idx = epoch_indices(n, world, seed, epoch, drop_last)  # int64[total]
    bounds = batch_bounds(idx.shape[0], world, local)      # int64[S+1]
    return [idx[bounds[k]:bounds[k + 1]] for k in range(first_step, bounds.shape[0] - 1)]


# ------------------------------------------------------------------------------------------- states
def check_state(state) -> dict:
    """A :meth:`SolarLoader.state_dict` (a dict) checked: its keys, a valid ``config``, ``world_size`` equal to
    the config's, an integer ``step`` >= 0.  Returns ``{"config": PlanConfig, "step": int, "policy": str,
    "fingerprint": str, "open_ended": bool}``; :class:`ResumeError` naming the bad value otherwise."""
    if not isinstance(state, dict):
        raise ResumeError(f"a loader state must be a dict (from state_dict()), got {type(state).__name__}")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise ResumeError(f"loader state lacks {', '.join(map(repr, missing))} (not from SolarLoader.state_dict()?)")
    cfg = state["config"]
    names = {f.name for f in fields(PlanConfig)}
    if not isinstance(cfg, dict) or set(cfg) != names:
        raise ResumeError(f"loader state config must be a dict with the keys {sorted(names)}, got "
                          f"{sorted(cfg) if isinstance(cfg, dict) else type(cfg).__name__}")
    try:
        config = PlanConfig(**cfg)
    except (TypeError, ValueError) as exc:
        raise ResumeError(f"loader state config: {exc}") from None
    if state["world_size"] != config.world_size:
        raise ResumeError(f"loader state world_size {state['world_size']!r} differs from its config's "
                          f"{config.world_size}")
    g = state["step"]
    if isinstance(g, bool) or not isinstance(g, numbers.Integral) or g < 0:
        raise ResumeError(f"loader state step must be an integer >= 0, got {g!r}")
    for k in ("policy", "fingerprint"):
        if not isinstance(state[k], str):
            raise ResumeError(f"loader state {k} must be text, got {state[k]!r}")
    return {"config": config, "step": int(g), "policy": state["policy"], "fingerprint": state["fingerprint"],
            "open_ended": bool(state.get("open_ended", False))}


def state_mismatch(state: dict, mine: dict) -> str:
    """Why loader state ``state`` does not belong to the job whose own state is ``mine`` (both with
    :data:`IDENTITY_KEYS`): another dataset, another global batch (both sizes named), the same global
    batch on another world size (re-plan with ``--resume-from``), or the first other value."""
    if state.get("fingerprint") != mine["fingerprint"]:
        return (f"state was saved on another dataset or another version of it (layout fingerprint "
                f"{str(state.get('fingerprint'))[:12]}, this schedule's {mine['fingerprint'][:12]})")
    theirs, ours = state.get("config"), mine["config"]
    if isinstance(theirs, dict):
        P, b = theirs.get("world_size"), theirs.get("local_batch")
        if isinstance(P, int) and isinstance(b, int):
            if P * b != ours["world_size"] * ours["local_batch"]:
                return (f"state was saved by a job with global batch {global_batch_text(P, b)}, this schedule has "
                        f"global batch {global_batch_text(ours['world_size'], ours['local_batch'])}: a resumed job "
                        f"must keep the global batch size")
            if P != ours["world_size"]:
                return (f"state was saved on {P} ranks x local batch {b}, this schedule is for {ours['world_size']} "
                        f"ranks x {ours['local_batch']}: plan the resume from it (solar plan SPEC --resume-from "
                        f"STATE -P {ours['world_size']} ...)")
    for k in IDENTITY_KEYS:
        if state.get(k) != mine[k]:
            return (f"state was saved with another schedule ({k}: {state.get(k)!r} != {mine[k]!r}); to go on from it "
                    f"with this plan's options, plan the resume from it (solar plan SPEC --resume-from STATE ...)")
    return ""


@dataclass(frozen=True)
class ResumeJob:
    """The resumed job's inputs worked out from a checkpointed loader state: the new local batch, epochs,
    seed, drop_last, epsilon and policy name, its :class:`ResumePoint`, and ``record`` (the ``resume``
    attribute of its schedule file: ``{"step": ..., "from": the state}``)."""

    local_batch: int
    epochs: int
    seed: int
    drop_last: bool
    epsilon: float
    policy: str
    point: ResumePoint
    record: dict


def resume_job(state: dict, n_samples: int, fingerprint: str, *, world_size: int, local_batch=None, epochs=None,
               seed=None, drop_last=None, epsilon=None, policy=None) -> ResumeJob:
    """The job that resumes loader state ``state`` (:meth:`SolarLoader.state_dict`) on ``world_size`` ranks, on a
    dataset of ``n_samples`` samples with layout ``fingerprint``.  None takes the checkpointed job's value
    (``local_batch``: its global batch / ``world_size``; ``epochs``: its epochs, required when it was
    open-ended); ``seed`` and ``drop_last`` must be its own (they make the batches); ``epsilon`` and
    ``policy`` may change (they only split each global batch over ranks).  :class:`ResumeError` naming the
    value otherwise."""
    old = check_state(state)
    cfg: PlanConfig = old["config"]
    if old["fingerprint"] != fingerprint:
        raise ResumeError(f"the state was saved on another dataset or another version of it (layout fingerprint "
                          f"{old['fingerprint'][:12]}, the data now has {fingerprint[:12]})")
    b = new_local_batch(cfg.world_size, cfg.local_batch, world_size, local_batch)
    for name, given in (("seed", seed), ("drop_last", drop_last)):
        if given is not None and given != getattr(cfg, name):
            raise ResumeError(f"{name} {given!r} differs from the checkpointed job's {getattr(cfg, name)!r}: the "
                              f"remaining batches would not be its own; leave {name} out")
    if epochs == "auto":
        raise ResumeError("a resumed job is planned for a fixed number of epochs: give epochs=N (the job's total)")
    if epochs is None:
        if old["open_ended"]:
            raise ResumeError("the checkpointed job was open-ended (epochs 'auto'): give the job's total epochs "
                              "(--epochs N)")
        epochs = cfg.epochs
    if isinstance(epochs, bool) or not isinstance(epochs, numbers.Integral) or epochs < 1:
        raise ResumeError(f"epochs must be a positive integer (the job's total, as before the checkpoint), "
                          f"got {epochs!r}")
    point = resume_point(n_samples, cfg.world_size, cfg.local_batch, world_size, b, old["step"], cfg.drop_last)
    if point.epoch >= epochs:
        raise ResumeError(f"the state is at step {old['step']}, after the job's {epochs} epoch{'s' * (epochs != 1)}: nothing left to "
                          f"train; give more epochs")
    from .policies import get_policy
    if get_policy(old["policy"]).epoch_order != "identity":
        raise ResumeError(f"the checkpointed job's policy {old['policy']!r} trains the epochs in its own order; "
                          f"only jobs that train them in order (solar, nopfs, torch) can resume on other ranks")
    record = {"step": point.global_step, "from": {"fingerprint": old["fingerprint"], "world_size": cfg.world_size,
                                                   "config": cfg.to_dict(), "policy": old["policy"],
                                                   "step": old["step"]}}
    return ResumeJob(b, int(epochs), cfg.seed, cfg.drop_last, cfg.epsilon if epsilon is None else epsilon,
                     old["policy"] if policy is None else policy, point, record)


# ----------------------------------------------------------------------------------------- planning
def shifted_config(cfg: PlanConfig, first_epoch: int) -> PlanConfig:
    """The job of epochs ``first_epoch .. cfg.epochs - 1`` as a job of its own: DistributedSampler seeds
    epoch t with ``seed + t``, so source epoch ``first_epoch + p`` of ``cfg`` is epoch ``p`` of this one."""
    if not 0 <= first_epoch < cfg.epochs:
        raise ResumeError(f"the job has epochs 0..{cfg.epochs - 1}, nothing to plan from epoch {first_epoch}; "
                          f"give more epochs")
    return replace(cfg, seed=cfg.seed + first_epoch, epochs=cfg.epochs - first_epoch)


def empty_epoch(position: int, S: int, P: int) -> EpochPlan:
    """Epoch position ``position`` with no sample, load or eviction (S steps, P ranks): before a resume."""
    z = np.zeros((S, P), dtype=np.int64)
    ids = np.zeros(0, dtype=np.int64)
    ptr = np.zeros(S * P + 1, dtype=np.int64)
    return EpochPlan(position, position, position * S, ids, np.zeros(S + 1, dtype=np.int64), np.zeros(0, np.int32),
                     z, z, z, z, z, z, 0, ids, ptr, ids, ptr.copy())


class ResumedRun:
    """Plans a resumed job: epoch positions ``0 .. cfg.epochs - 1`` of the job ``cfg`` (the new world size's),
    where positions before ``point.epoch`` are empty and ``point.epoch`` starts at ``point.step`` with empty
    buffers: the epochs from ``point.epoch`` on are a job of their own (:func:`shifted_config`) whose first epoch
    the engine starts at ``point.step`` (``PlanRun.advance(first_step=...)``: Belady's next uses and the routing
    see only the steps trained).  ``policy`` must train epochs in order (identity epoch order).  A node-pool
    policy plans the rest as a node plan on ``nodes`` (a :class:`~solar.scheduler.nodes.NodeMap`) with ``cost``
    (a :class:`~solar.scheduler.nodes.PeerCost`): its epochs are
    :class:`~solar.scheduler.node_plan.NodeEpochPlan` s, the empty ones included.  Made before anything is
    written: a :class:`SpecError` (a buffer too small, ...) comes first."""

    def __init__(self, demand, cfg: PlanConfig, policy, point: ResumePoint, nodes=None, cost=None):
        if policy.epoch_order != "identity":
            raise ResumeError(f"policy {policy.name!r} orders epochs {policy.epoch_order!r} over the whole job; a "
                              f"resumed job needs one that trains epochs in order (solar, nopfs, torch)")
        self.cfg, self.point, self.policy = cfg, point, policy
        self.S = steps_per_epoch(demand.n_samples, cfg.world_size, cfg.local_batch, cfg.drop_last)
        if point.global_step != point.epoch * self.S + point.step or point.step >= self.S:
            raise ResumeError(f"resume point epoch {point.epoch} step {point.step} is not global step "
                              f"{point.global_step} of a job with {self.S} steps per epoch")
        self.nodes = nodes if policy.node_pools else None
        self.run = PlanRun(demand, shifted_config(cfg, point.epoch), policy, record=True, nodes=nodes, cost=cost)

    def advance(self, on_epoch: Callable[[EpochPlan], None], progress: bool = False) -> PolicyResult:
        """Plan every epoch position, handing each (empty, or planned: the first from the resume step) to
        ``on_epoch``; returns the per-epoch totals of all ``cfg.epochs`` positions (zeros before the resume
        point)."""
        cfg, e0, S, P = self.cfg, self.point.epoch, self.S, self.cfg.world_size
        result = PolicyResult(self.policy.name, list(range(cfg.epochs)))
        nodes = self.nodes
        add = _add if nodes is None else _add_node
        for e in range(e0):
            ep = empty_epoch(e, S, P) if nodes is None else empty_node_epoch(e, S, nodes)
            add(result, ep, P)
            on_epoch(ep)

        def shifted(ep):
            pos = ep.position + e0
            ep = replace(ep, position=pos, source_epoch=pos, step0=pos * S)
            add(result, ep, P)
            on_epoch(ep)
        self.run.advance(cfg.epochs - e0, on_epoch=shifted, progress=progress, first_step=self.point.step)
        return result


def empty_node_epoch(position: int, S: int, nodes):
    """:func:`empty_epoch` of a node-pool plan (a :class:`~solar.scheduler.node_plan.NodeEpochPlan` of S steps
    on ``nodes``, a NodeMap): no sample, load, eviction, staging read or transfer."""
    from .node_plan import NODE_STATS, NodeEpochPlan
    P, Q = nodes.world_size, nodes.n_nodes
    ids = np.zeros(0, dtype=np.int64)
    ptr = np.zeros(S * Q + 1, dtype=np.int64)
    x = np.zeros(0, dtype=np.int32)
    return NodeEpochPlan(position, position, position * S, ids, np.zeros(S + 1, dtype=np.int64), nodes,
                         np.zeros(0, np.int32), np.zeros((S, P), dtype=np.int64),
                         np.zeros((S, Q, len(NODE_STATS)), dtype=np.int64), 0, ids, ptr, ids, ptr.copy(), ids,
                         ptr.copy(), x, x, ids, np.zeros(S + 1, dtype=np.int64))


def _add_node(result: PolicyResult, ep, P: int):
    """:func:`_add` of a node epoch plan (per node misses, peer and staging bytes)."""
    from .node_plan import NODE_STATS
    col = {k: i for i, k in enumerate(NODE_STATS)}
    st = ep.stats  # (S, Q, 10)
    result.hit_bytes.append(int(st[:, :, col["hit_bytes"]].sum()))
    result.miss_bytes.append(int(st[:, :, col["miss_bytes"]].sum()))
    result.stored_bytes.append(int(st[:, :, col["stored_bytes"]].sum()))
    result.demand_bytes.append(int(ep.demand_bytes))
    trained = ep.count[np.diff(ep.bounds) > 0]  # (steps that train, P)
    result.max_local_batch.append(int(trained.max()) if trained.size else 0)
    result.min_local_batch.append(int(trained.min()) if trained.size else 0)
    result.rank_miss_bytes.append(st[:, :, col["miss_bytes"]].sum(axis=0))  # (Q,) per node
    result.peer_bytes.append(int(st[:, :, col["peer_bytes"]].sum()))
    staged = st[:, :, col["peer_bytes"]] + st[:, :, col["staged_bytes"]]
    result.staging_bytes.append(int(staged.max()) if staged.size else 0)


def _add(result: PolicyResult, ep: EpochPlan, P: int):
    """Append epoch plan ``ep``'s totals to ``result`` (local batch range over the steps that train)."""
    result.hit_bytes.append(int(ep.hit_bytes.sum()))
    result.miss_bytes.append(int(ep.miss_bytes.sum()))
    result.stored_bytes.append(int(ep.stored_bytes.sum()))
    result.demand_bytes.append(int(ep.demand_bytes))
    trained = ep.count[np.diff(ep.bounds) > 0]  # (steps that train, P)
    result.max_local_batch.append(int(trained.max()) if trained.size else 0)
    result.min_local_batch.append(int(trained.min()) if trained.size else 0)
    result.rank_miss_bytes.append(ep.miss_bytes.sum(axis=0) if ep.miss_bytes.size else np.zeros(P, np.int64))

