"""Drive the engine epoch by epoch (streaming: memory bounded by two epochs' indices,
or by ``LOOKAHEAD_MAX_BYTES`` of future indices for a policy that looks further ahead).

``run_policy(demand, cfg, policy)`` plays one policy over the whole job and
returns per-epoch, per-rank counts; with ``on_epoch`` it also hands each epoch's
full plan (assignment, loads, evictions) to a callback, which is how the
schedule writer streams to disk.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np

from ..errors import SolarError, SpecError
from . import engine as eg
from .config import PlanConfig
from .epoch_order import get_epoch_order
from .groups import expand, group_demand
from .policies import Policy, get_policy
from .sampler import batch_bounds, epoch_indices, sampler_sizes


@dataclass(frozen=True)
class Demand:
    """What the planner needs of a layout: sample -> blocks CSR and block sizes.

    ``sample_ptr`` int64[N+1], ``sample_blocks`` int64[nnz], ``block_nbytes``
    int64[B] (decoded, what buffers hold), ``block_stored`` int64[B] (read from storage).
    """

    sample_ptr: np.ndarray
    sample_blocks: np.ndarray
    block_nbytes: np.ndarray
    block_stored: np.ndarray
    fingerprint: str = ""

    @property
    def n_samples(self) -> int:
        return int(self.sample_ptr.shape[0] - 1)

    @property
    def n_blocks(self) -> int:
        return int(self.block_nbytes.shape[0])

    @classmethod
    def from_layout(cls, layout) -> "Demand":
        return cls(layout.sample_ptr, layout.sample_blocks, layout.block_nbytes, layout.block_stored,
                   layout.fingerprint)

    @classmethod
    def synthetic(cls, n_samples: int, sample_bytes: int, samples_per_block: int = 1,
                  blocks_per_sample: int = 1) -> "Demand":
        """``n_samples`` samples of ``blocks_per_sample`` blocks; ``samples_per_block``
        consecutive samples share their blocks (co-chunk samples)."""
        if n_samples < 1 or sample_bytes < 1 or samples_per_block < 1 or blocks_per_sample < 1:
            raise SpecError("synthetic demand needs positive samples, bytes, samples/block, blocks/sample")
        group = np.arange(n_samples, dtype=np.int64) // samples_per_block  # chunk row of each sample
        blocks = (group[:, None] * blocks_per_sample + np.arange(blocks_per_sample)).reshape(-1)  # (N*k,)
        n_blocks = int(group[-1] + 1) * blocks_per_sample
        nb = np.full(n_blocks, sample_bytes * samples_per_block // blocks_per_sample, dtype=np.int64)
        ptr = np.arange(0, n_samples * blocks_per_sample + 1, blocks_per_sample, dtype=np.int64)
        return cls(ptr, blocks, nb, nb.copy(), f"synthetic:{n_samples}:{sample_bytes}:{samples_per_block}:"
                   f"{blocks_per_sample}")


@dataclass
class EpochPlan:
    """One epoch of one policy (arrays over the epoch's S steps and P ranks).

    ``indices`` int64[T] global index (positions), ``rank_of`` int32[T] rank of each
    position, ``count/hits/...`` int64[S, P]; with recording, ``load`` / ``evict``
    layout block ids with CSR pointers int64[S*P+1] over (step, rank).  Hits and
    misses count layout blocks, bytes are layout bytes, also when the engine planned
    on groups of blocks (a group's blocks then appear together, ascending).
    """

    position: int
    source_epoch: int
    step0: int
    indices: np.ndarray
    bounds: np.ndarray
    rank_of: np.ndarray
    count: np.ndarray
    hits: np.ndarray
    hit_bytes: np.ndarray
    misses: np.ndarray
    miss_bytes: np.ndarray
    stored_bytes: np.ndarray
    demand_bytes: int
    load: Optional[np.ndarray] = None
    load_ptr: Optional[np.ndarray] = None
    evict: Optional[np.ndarray] = None
    evict_ptr: Optional[np.ndarray] = None


@dataclass
class PolicyResult:
    """Per-epoch sums of one policy's run (lists over epoch positions)."""

    policy: str
    epoch_order: List[int]
    hit_bytes: List[int] = field(default_factory=list)
    miss_bytes: List[int] = field(default_factory=list)
    stored_bytes: List[int] = field(default_factory=list)
    demand_bytes: List[int] = field(default_factory=list)
    max_local_batch: List[int] = field(default_factory=list)
    min_local_batch: List[int] = field(default_factory=list)
    rank_miss_bytes: List[np.ndarray] = field(default_factory=list)

    @property
    def hit_rate_per_epoch(self) -> List[float]:
        """1 - bytes loaded from storage / bytes the epoch's samples need (decoded)."""
        return [1.0 - m / d if d else 0.0 for m, d in zip(self.miss_bytes, self.demand_bytes)]

    @property
    def steady_hit_rate(self) -> float:
        """Hit rate over epochs >= 2 (all epochs if there is only one)."""
        m, d = self.miss_bytes[1:] or self.miss_bytes, self.demand_bytes[1:] or self.demand_bytes
        return 1.0 - sum(m) / sum(d) if sum(d) else 0.0


LOOKAHEAD_MAX_BYTES = 256 << 20  # future global indices held for a policy that sees all epochs


class BufferTooSmall(SolarError):
    pass


def _next_pow2(x: int) -> int:
    return 1 << max(4, int(x - 1).bit_length())


def _planning_units(demand: Demand, group: bool):
    """``(sample_ptr, sample_blocks, nbytes, stored, count, groups or None)`` the engine plans on
    (``count``: layout blocks per unit, empty when every unit is one block).

    With ``group``, blocks used by exactly the same samples are merged (:mod:`.groups`);
    when no two blocks merge, the layout's own arrays are used unchanged.
    """
    sp = np.asarray(demand.sample_ptr, dtype=np.int64)
    sb = np.asarray(demand.sample_blocks, dtype=np.int64)
    nb = np.asarray(demand.block_nbytes, dtype=np.int64)
    st = np.asarray(demand.block_stored, dtype=np.int64)
    ones = np.zeros(0, dtype=np.int64)  # empty: one layout block per unit
    if not group or sb.size == 0 or int(np.diff(sp).max()) <= 1:  # one block per sample: nothing to merge
        return sp, sb, nb, st, ones, None
    g = group_demand(sp, sb, nb, st)
    if g.n_groups == int(np.count_nonzero(g.group_of >= 0)):
        return sp, sb, nb, st, ones, None
    return g.g_sample_ptr, g.g_sample_blocks, g.g_nbytes, g.g_stored, g.g_count, g


def run_policy(demand: Demand, cfg: PlanConfig, policy="solar", record: bool = False,
               on_epoch: Optional[Callable[[EpochPlan], None]] = None, progress: bool = False,
               epoch_order: Optional[str] = None, group_blocks: bool = True) -> PolicyResult:
    """Play ``policy`` over all epochs of the job ``cfg`` on ``demand``.

    With ``group_blocks`` (default) the engine plans on groups of blocks that the
    same samples use (:mod:`solar.scheduler.groups`); recorded load/evict lists are
    expanded back to layout block ids and all counts and bytes are in layout blocks.
    """
    pol: Policy = get_policy(policy) if isinstance(policy, str) else policy
    n = demand.n_samples
    P, b, E = cfg.world_size, cfg.local_batch, cfg.epochs
    num, total = sampler_sizes(n, P, cfg.drop_last)
    if total == 0:
        raise SpecError(f"drop_last with {n} samples and world size {P} leaves no sample to train on")
    bounds = batch_bounds(total, P, b)
    S = bounds.shape[0] - 1
    P_eng = 1 if pol.single_buffer else P
    budget = cfg.buffer_bytes * (P if pol.single_buffer else 1)

    # per-step sample-count bounds; the last batch may be partial (each rank gets num % b)
    share = np.full(S, b, dtype=np.int64)
    share[-1] = num - (S - 1) * b
    if pol.single_buffer:
        share = share * P
    eps = cfg.epsilon if pol.mode == eg.ROUTED else 0.0
    cap_lo = np.maximum(1, np.ceil(share * (1 - eps) - 1e-9)).astype(np.int64)
    cap_hi = np.floor(share * (1 + eps) + 1e-9).astype(np.int64)

    sp, sb, nb, stored_nb, unit_count, groups = _planning_units(demand, group_blocks)
    n_units = int(nb.shape[0])
    csum = np.concatenate(([0], np.cumsum(nb[sb])))
    sample_bytes = csum[sp[1:]] - csum[sp[:-1]]  # int64[N] (a sample may have no block)
    min_nb = int(nb[nb > 0].min()) if (nb > 0).any() else 1
    max_res = min(n_units, budget // min_nb + 1)
    max_blocks_sample = int(np.diff(sp).max())
    step_blocks = int(cap_hi.max()) * max_blocks_sample
    perms = [epoch_indices(n, P, cfg.seed, t, cfg.drop_last) for t in range(E)] if (
        epoch_order or pol.epoch_order) != "identity" else None
    mean_sample = float(sample_bytes.mean()) if n else 1.0
    cache_samples = int(P * cfg.buffer_bytes // max(1.0, mean_sample))
    order = get_epoch_order(epoch_order or pol.epoch_order)(perms, cache_samples) if perms is not None \
        else np.arange(E, dtype=np.int64)
    boundary_steps = cache_samples // (P * b)
    # epochs ahead whose accesses the next-use computation sees (memory: that many indices)
    lookahead = 0
    if pol.next_use != "none":
        cap = max(1, LOOKAHEAD_MAX_BYTES // max(1, 8 * total))
        lookahead = max(1, min(E - 1, cap if pol.lookahead is None else int(pol.lookahead), cap))

    # engine state
    acc_max = int(np.diff(sp).max()) * total
    live_max = min(P_eng * max_res, P_eng * n_units)
    tsize = _next_pow2(int((2 * live_max + acc_max + 64) / 0.6))
    keys = np.full(tsize, eg.EMPTY, dtype=np.int64)
    prio = np.zeros(tsize, dtype=np.int64)
    used = np.full(tsize, -1, dtype=np.int64)
    heap_cap = 2 * max_res + 2 * step_blocks + 64
    hk = np.zeros((P_eng, heap_cap), dtype=np.int64)
    hbk = np.zeros((P_eng, heap_cap), dtype=np.int64)
    hn = np.zeros(P_eng, dtype=np.int64)
    res_bytes = np.zeros(P_eng, dtype=np.int64)
    owner = np.full(n_units, -1, dtype=np.int32)
    stamp = np.full(n_units, -1, dtype=np.int64)
    n_res = np.zeros(2, dtype=np.int64)
    last = np.full(n_units, eg.INF, dtype=np.int64)
    err = np.zeros(4, dtype=np.int64)
    R = (lookahead + 1) * S + 1 if pol.mode == eg.ROUTED else 1  # next uses lie within R - 1 steps
    due = np.zeros((R, P_eng), dtype=np.int64)  # [step % R, rank]: see engine.run_epoch

    result = PolicyResult(pol.name, [int(x) for x in order])

    def source(pos: int) -> np.ndarray:  # the global index trained at epoch position pos
        return perms[order[pos]] if perms is not None else epoch_indices(n, P, cfg.seed, int(order[pos]),
                                                                         cfg.drop_last)

    window = deque([source(0)])  # indices of epoch positions e .. e + lookahead
    empty = np.zeros(0, dtype=np.int64)
    it = range(E)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc=f"plan {pol.name}", unit="epoch", leave=False)
    for e in it:
        while len(window) < lookahead + 1 and e + len(window) < E:
            window.append(source(e + len(window)))
        idx = window[0]
        future = list(window)[1:]
        idx_f = future[0] if len(future) == 1 else (np.concatenate(future) if future else empty)
        step0 = e * S
        counts = np.diff(sp)[idx]
        acc_ptr = np.zeros(total + 1, dtype=np.int64)
        np.cumsum(counts, out=acc_ptr[1:])
        nu = np.full(int(acc_ptr[-1]), eg.INF, dtype=np.int64)
        if pol.next_use != "none":
            eg.next_use(idx, bounds, step0, idx_f, len(future), acc_ptr, P, pol.next_use == "rank", sp, sb,
                        last, nu)
        rank_of = np.empty(total, dtype=np.int32)
        shape = (S, P_eng)
        st = [np.zeros(shape, dtype=np.int64) for _ in range(6)]
        if record:
            load = np.empty(int(acc_ptr[-1]), dtype=np.int64)
            evict = np.empty(int(acc_ptr[-1]) + int(n_res[0]) + 1, dtype=np.int64)
            load_ptr = np.zeros(S * P_eng + 1, dtype=np.int64)
            evict_ptr = np.zeros(S * P_eng + 1, dtype=np.int64)
        else:
            load = evict = load_ptr = evict_ptr = empty
        err[:] = 0
        n_load, n_evict = eg.run_epoch(
            idx, bounds, acc_ptr, nu, step0, P_eng, cap_lo, cap_hi, share, pol.mode, pol.evict, budget,
            boundary_steps, sp, sb, nb, stored_nb, unit_count, keys, prio, used, hk, hbk, hn, res_bytes, owner,
            stamp, n_res, rank_of, *st, record, load, load_ptr, evict, evict_ptr, err, due, max_blocks_sample)
        if err[0] == eg.TOO_SMALL:
            raise BufferTooSmall(
                f"buffer of {budget:,} bytes per rank cannot hold the {int(err[3]):,} bytes of blocks that rank "
                f"{int(err[2])} needs at step {int(err[1]) - step0} of epoch {e}: the buffer must hold at least "
                f"one local batch")
        if err[0] != eg.OK:
            raise RuntimeError(f"planner engine failed with status {int(err[0])} at step {int(err[1])}")
        count, hits, hit_bytes, misses, miss_bytes, stored = st
        demand_bytes = int(sample_bytes[idx].sum())
        result.hit_bytes.append(int(hit_bytes.sum()))
        result.miss_bytes.append(int(miss_bytes.sum()))
        result.stored_bytes.append(int(stored.sum()))
        result.demand_bytes.append(demand_bytes)
        if pol.single_buffer:  # one buffer for all ranks: report the per-rank share
            result.max_local_batch.append(int(share.max() // P))
            result.min_local_batch.append(int(share.min() // P))
        else:
            result.max_local_batch.append(int(count.max()))
            result.min_local_batch.append(int(count.min()))
        result.rank_miss_bytes.append(miss_bytes.sum(axis=0))
        if on_epoch is not None:
            lists = (None, None, None, None)
            if record:
                lists = (load[:n_load], load_ptr, evict[:n_evict], evict_ptr)
                if groups is not None:  # back to layout block ids
                    lists = (*expand(lists[0], lists[1], groups.group_ptr, groups.group_blocks),
                             *expand(lists[2], lists[3], groups.group_ptr, groups.group_blocks))
            on_epoch(EpochPlan(e, int(order[e]), step0, idx, bounds, rank_of, count, hits, hit_bytes, misses,
                               miss_bytes, stored, demand_bytes, *lists))
        # drop tombstones between epochs
        if n_res[1] > 0:
            nk = np.full(tsize, eg.EMPTY, dtype=np.int64)
            npr = np.zeros(tsize, dtype=np.int64)
            nus = np.full(tsize, -1, dtype=np.int64)
            eg.ht_rebuild(keys, prio, used, nk, npr, nus)
            keys, prio, used = nk, npr, nus
            n_res[1] = 0
        window.popleft()
        if not window and e + 1 < E:
            window.append(source(e + 1))
    return result
