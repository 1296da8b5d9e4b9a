"""Drive the engine epoch by epoch (streaming: memory bounded by two epochs' indices,
or by ``LOOKAHEAD_MAX_BYTES`` of future indices for a policy that looks further ahead).

``run_policy(demand, cfg, policy)`` plays one policy over the whole job and
returns per-epoch, per-rank counts; with ``on_epoch`` it also hands each epoch's
full plan (assignment, loads, evictions) to a callback, which is how the
schedule writer streams to disk.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np

from ..errors import SolarError, SpecError
from . import engine as eg
from .config import PlanConfig
from .epoch_order import get_epoch_order
from .groups import expand, group_demand
from .kernel import (COUNT, EMPTY, HIT_BYTES, HITS, INF, MISS, MISS_BYTES, N_EVICT, N_LOAD, OK, ROUTED, STORED,
                     TOO_SMALL, Buffers, Epoch, Job, outputs)
from .node_run import node_epoch
from .nodes import NodeMap, PeerCost
from .peer_engine import next_use_nodes
from .policies import Policy, admits_parts, get_policy
from .sampler import batch_bounds, epoch_indices, sampler_sizes
from .table import ht_rebuild


@dataclass(frozen=True)
class Demand:
    """What the planner needs of a layout: sample -> blocks CSR and block sizes.

    ``sample_ptr`` int64[N+1], ``sample_blocks`` int64[nnz], ``block_nbytes``
    int64[B] (decoded, what buffers hold), ``block_stored`` int64[B] (read from storage);
    ``block_extent`` int64[B] or None: blocks with the same extent are parts of one chunk
    (:mod:`solar.layout.parts`), read together: ``block_stored`` is then the chunk's, paid once per
    step and buffer that reads any of its parts.  With ``extent_runs`` the extents are runs of neighbouring
    blocks instead (:mod:`solar.layout.runs`): a block read at a step may bring its run's blocks that the plan
    uses soon, each paying its own ``block_stored``, read in the same request.
    """

    sample_ptr: np.ndarray
    sample_blocks: np.ndarray
    block_nbytes: np.ndarray
    block_stored: np.ndarray
    fingerprint: str = ""
    block_extent: Optional[np.ndarray] = None
    extent_runs: bool = False

    @property
    def n_samples(self) -> int:
        return int(self.sample_ptr.shape[0] - 1)

    @property
    def n_blocks(self) -> int:
        return int(self.block_nbytes.shape[0])

    @classmethod
    def from_layout(cls, layout, runs: bool = False) -> "Demand":
        """The demand of ``layout``: its parts' chunks as extents (a layout of parts); else, with ``runs``, its
        runs of neighbouring blocks (:func:`solar.layout.runs.neighbour_runs`; none where no two are adjacent)."""
        ext, is_runs = getattr(layout, "block_parent", None), False
        if ext is None and runs:
            from ..layout.runs import neighbour_runs
            ext = neighbour_runs(layout)
            is_runs = ext is not None
        return cls(layout.sample_ptr, layout.sample_blocks, layout.block_nbytes, layout.block_stored,
                   layout.fingerprint, ext, is_runs)

    @property
    def has_parts(self) -> bool:
        """Whether some blocks are parts of one chunk (:attr:`block_extent`)."""
        return self.block_extent is not None

    @classmethod
    def synthetic(cls, n_samples: int, sample_bytes: int, samples_per_block: int = 1,
                  blocks_per_sample: int = 1) -> "Demand":
        """``n_samples`` samples of ``blocks_per_sample`` blocks; ``samples_per_block``
        consecutive samples share their blocks (co-chunk samples)."""
        if n_samples < 1 or sample_bytes < 1 or samples_per_block < 1 or blocks_per_sample < 1:
            raise SpecError("synthetic demand needs positive samples, bytes, samples/block, blocks/sample")
        from ..layout.limits import MAX_LINKS, MAX_SAMPLES  # the limits of a layout read from files
        if n_samples > MAX_SAMPLES or n_samples * blocks_per_sample > MAX_LINKS:
            raise SpecError(f"a synthetic demand of {n_samples:,} samples x {blocks_per_sample} blocks is beyond "
                            f"the {MAX_SAMPLES:,} samples and {MAX_LINKS:,} sample->block links a layout may have")
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
    rank_miss_bytes: List[np.ndarray] = field(default_factory=list)  # per buffer: rank, or node for node pools
    peer_bytes: List[int] = field(default_factory=list)  # decoded bytes received from another node
    staging_bytes: List[int] = field(default_factory=list)  # most bytes a node stages at one step (peer policies)


    @property
    def hit_rate_per_epoch(self) -> List[float]:
        """1 - bytes loaded from storage / bytes the epoch's samples need (decoded)."""
        return [1.0 - m / d if d else 0.0 for m, d in zip(self.miss_bytes, self.demand_bytes)]

    @property
    def steady_hit_rate(self) -> float:
        """Hit rate over epochs 1 and later, numbered from 0 (epoch 0 if there is only one); a peer transfer is not a miss."""
        m, d = self.miss_bytes[1:] or self.miss_bytes, self.demand_bytes[1:] or self.demand_bytes
        return 1.0 - sum(m) / sum(d) if sum(d) else 0.0

    @property
    def peer_hit_rate_per_epoch(self) -> List[float]:
        """Decoded bytes received from another node / bytes the epoch's samples need."""
        peer = self.peer_bytes or [0] * len(self.demand_bytes)
        return [p / d if d else 0.0 for p, d in zip(peer, self.demand_bytes)]

    @property
    def steady_peer_hit_rate(self) -> float:
        """The part of :attr:`steady_hit_rate` served by peer transfers (epochs >= 1)."""
        peer = self.peer_bytes or [0] * len(self.demand_bytes)
        p, d = peer[1:] or peer, self.demand_bytes[1:] or self.demand_bytes
        return sum(p) / sum(d) if sum(d) else 0.0

    @property
    def steady_node_hit_rate(self) -> float:
        """The part of :attr:`steady_hit_rate` served from the rank's own buffer or node pool."""
        return self.steady_hit_rate - self.steady_peer_hit_rate


LOOKAHEAD_MAX_BYTES = 256 << 20  # future global indices held for a policy that sees all epochs


class BufferTooSmall(SolarError):
    pass


def _next_pow2(x: int) -> int:
    return 1 << max(4, int(x - 1).bit_length())


_TABLE_ROW = np.array([EMPTY, 0, -1, 0], dtype=np.int64)  # an empty entry: (key, priority, last use, pad)


def _table(t: Optional[np.ndarray], tsize: int):
    """The engine's hash table, emptied: ``t`` (int64[tsize, 4], allocated when None) and its three int64[tsize]
    column views ``(keys, prio, used)``: an entry's key, priority and last use share a cache line (one memory
    miss per probe, not three; the table is far larger than the CPU's caches).  Tables are reused, never
    re-allocated per epoch: first-touching 100+ MB of fresh pages costs more than planning an epoch."""
    if t is None:
        t = np.empty((tsize, 4), dtype=np.int64)  # [slot, (key, priority, last use, pad)]
    t[...] = _TABLE_ROW
    return t, t[:, 0], t[:, 1], t[:, 2]


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


_NO_EXTENTS = tuple(np.zeros(0, dtype=np.int64) for _ in range(5))


def _extents(demand: Demand, groups, n_units: int):
    """``(ext_ptr, ext_ids, ext_stored, xu_ptr, xu_units)`` of :class:`~.kernel.Job` for the planning units
    (blocks, or ``groups`` of them): the extents (chunks) each unit's blocks lie in and the units of each
    extent, extents numbered 0.. in order of their ids; all empty when no two units share an extent."""
    if demand.block_extent is None or n_units == 0:
        return _NO_EXTENTS
    ext = np.asarray(demand.block_extent, dtype=np.int64)
    stored = np.asarray(demand.block_stored, dtype=np.int64)
    if groups is None:
        unit, blk = np.arange(n_units, dtype=np.int64), np.arange(n_units, dtype=np.int64)
    else:
        blk = groups.group_blocks
        unit = np.repeat(np.arange(n_units, dtype=np.int64), np.diff(groups.group_ptr))
    ids, first, inv = np.unique(ext[blk], return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    X = ids.shape[0]
    pair = np.unique(unit * X + inv)  # (unit, extent) pairs, each once, by unit
    pu, px = pair // X, pair % X
    if X == n_units and pu.shape[0] == n_units:  # every unit its own extent: nothing is read together
        return _NO_EXTENTS
    ext_ptr = np.zeros(n_units + 1, dtype=np.int64)
    np.cumsum(np.bincount(pu, minlength=n_units), out=ext_ptr[1:])
    by_x = np.lexsort((pu, px))
    xu_ptr = np.zeros(X + 1, dtype=np.int64)
    np.cumsum(np.bincount(px, minlength=X), out=xu_ptr[1:])
    ext_stored = np.zeros(X, dtype=np.int64) if demand.extent_runs else stored[blk[first]]
    return ext_ptr, px.astype(np.int64), ext_stored, xu_ptr, pu[by_x].astype(np.int64)


def run_policy(demand: Demand, cfg: PlanConfig, policy="solar", record: bool = False,
               on_epoch: Optional[Callable[[EpochPlan], None]] = None, progress: bool = False,
               epoch_order: Optional[str] = None, group_blocks: bool = True, nodes: Optional[NodeMap] = None,
               cost: Optional[PeerCost] = None, progress_label: str = "") -> PolicyResult:
    """Play ``policy`` over all epochs of the job ``cfg`` on ``demand``.

    With ``group_blocks`` (default) the engine plans on groups of blocks that the
    same samples use (:mod:`solar.scheduler.groups`); recorded load/evict lists are
    expanded back to layout block ids and all counts and bytes are in layout blocks.
    ``nodes``/``cost``: the node layout and transfer cost model of the node-pool policies
    (``policies.NODE_POLICIES``; their ``on_epoch`` receives
    :class:`solar.scheduler.node_plan.NodeEpochPlan`); the other policies ignore them.
    """
    run = PlanRun(demand, cfg, policy, record=record, epoch_order=epoch_order, group_blocks=group_blocks,
                  nodes=nodes, cost=cost)
    return run.advance(cfg.epochs, on_epoch=on_epoch, progress=progress, progress_label=progress_label)


class PlanRun:
    """The planner as a resumable computation: engine state after the epochs planned so far.

    ``advance(stop)`` plans epoch positions ``planned .. stop - 1`` and returns their
    :class:`PolicyResult`; calling it again goes on from the same state, so planning in
    windows of K epochs gives exactly the plan of planning them in one call.

    ``open_ended=False``: the job has ``cfg.epochs`` epochs; the last epoch sees no
    future (what :func:`run_policy` plans).  ``open_ended=True``: the number of epochs
    is not known; epoch ``e`` always sees the permutations of the epochs after it
    (seeded, so known without planning them), ``cfg.epochs`` is ignored and windows
    may go on without end.  A plan of E epochs made open-ended equals the first E
    epochs of any longer plan of the same job; it differs from a plan that ends at E
    only in the last epoch (whose evictions then see the next epoch's uses).  Open-ended
    planning needs the ``identity`` epoch order (an order over all epochs needs them all)
    and a policy that looks a bounded number of epochs ahead (not ``nopfs``).

    Node-pool policies (``policies.NODE_POLICIES``) need ``nodes`` (a
    :class:`~solar.scheduler.nodes.NodeMap`): the engine then runs one buffer of L x the per-rank
    budget per node, each node's samples of a step are split over its ranks, and ``on_epoch``
    receives :class:`~solar.scheduler.node_plan.NodeEpochPlan` (:mod:`.node_run`); ``cost`` (a
    :class:`~solar.scheduler.nodes.PeerCost`, default bandwidths) decides which misses may be transfers.
    """

    def __init__(self, demand: Demand, cfg: PlanConfig, policy="solar", *, record: bool = False,
                 epoch_order: Optional[str] = None, group_blocks: bool = True, open_ended: bool = False,
                 nodes: Optional[NodeMap] = None, cost: Optional[PeerCost] = None):
        pol: Policy = get_policy(policy) if isinstance(policy, str) else policy
        if pol.node_pools:
            if nodes is None:
                raise SpecError(f"policy {pol.name!r} plans one buffer per node: pass nodes=NodeMap(world_size, "
                                f"ranks_per_node) (schedule files hold per-rank plans; node plans come from "
                                f"solar.scheduler.node_plan.plan_nodes)")
            if nodes.world_size != cfg.world_size:
                raise SpecError(f"the node map has {nodes.world_size} ranks but the job's world size is "
                                f"{cfg.world_size}")
        self.nodes = nodes if pol.node_pools else None
        self.cost = (cost or PeerCost()) if pol.peer else None
        self.pol, self.cfg, self.record, self.open_ended = pol, cfg, bool(record), bool(open_ended)
        n = self.n = demand.n_samples
        P, b = cfg.world_size, cfg.local_batch
        E = None if open_ended else cfg.epochs  # None: no last epoch
        num, total = sampler_sizes(n, P, cfg.drop_last)
        if total == 0:
            raise SpecError(f"drop_last with {n} samples and world size {P} leaves no sample to train on")
        self.total = total
        self.bounds = batch_bounds(total, P, b)
        S = self.S = self.bounds.shape[0] - 1
        # ranks sharing one engine buffer: all (ideal), a node's (node pools), or one
        pool = P if pol.single_buffer else (self.nodes.ranks_per_node if self.nodes else 1)
        self.P_eng = P // pool
        self.budget = cfg.buffer_bytes * pool

        # per-step sample-count bounds; the last batch may be partial (each rank gets num % b);
        # a buffer of `pool` ranks takes `pool` times a rank's share and bounds
        share = np.full(S, b, dtype=np.int64)
        share[-1] = num - (S - 1) * b
        eps = cfg.epsilon if pol.mode == ROUTED else 0.0
        self.cap_lo = np.maximum(1, np.ceil(share * (1 - eps) - 1e-9)).astype(np.int64) * pool
        self.cap_hi = np.floor(share * (1 + eps) + 1e-9).astype(np.int64) * pool
        self.share = share * pool

        sp, sb, nb, stored_nb, unit_count, groups = _planning_units(demand, group_blocks)
        n_units = int(nb.shape[0])
        # what the engine reads or writes of a unit, side by side: one memory miss per unit touched, not four
        units = np.empty((n_units, 4), dtype=np.int64)  # [unit, (bytes, stored bytes, owner, stamp)]
        units[:, 0] = nb
        units[:, 1] = stored_nb
        units[:, 2:] = -1
        nb, stored_nb = units[:, 0], units[:, 1]
        self.sp, self.sb, self.nb, self.stored_nb, self.unit_count, self.groups = sp, sb, nb, stored_nb, \
            unit_count, groups
        csum = np.concatenate(([0], np.cumsum(nb[sb])))
        self.sample_bytes = csum[sp[1:]] - csum[sp[:-1]]  # int64[N] (a sample may have no block)
        min_nb = int(nb[nb > 0].min()) if (nb > 0).any() else 1
        max_res = min(n_units, self.budget // min_nb + 1)
        self.max_blocks_sample = int(np.diff(sp).max())
        step_blocks = int(self.cap_hi.max()) * self.max_blocks_sample
        order_name = epoch_order or pol.epoch_order
        mean_sample = float(self.sample_bytes.mean()) if n else 1.0
        cache_samples = int(P * cfg.buffer_bytes // max(1.0, mean_sample))
        if open_ended and order_name != "identity":
            raise SpecError(f"open-ended planning needs the identity epoch order; policy {pol.name!r} orders "
                            f"epochs {order_name!r}, which needs every epoch up front")
        if open_ended and pol.next_use != "none" and pol.lookahead is None:
            raise SpecError(f"open-ended planning needs a bounded lookahead; policy {pol.name!r} looks at every "
                            f"epoch ahead")
        self.perms = [epoch_indices(n, P, cfg.seed, t, cfg.drop_last) for t in range(E)] if (
            order_name != "identity") else None
        self.order = get_epoch_order(order_name)(self.perms, cache_samples) if self.perms is not None \
            else None  # None: identity (position e trains source epoch e)
        self.boundary_steps = cache_samples // (P * b)
        # epochs ahead whose accesses the next-use computation sees (memory: that many indices)
        lookahead = 0
        if pol.next_use != "none":
            cap = max(1, LOOKAHEAD_MAX_BYTES // max(1, 8 * total))
            ahead = cap if pol.lookahead is None else min(int(pol.lookahead), cap)
            lookahead = max(1, ahead if E is None else min(E - 1, ahead))
        self.lookahead = lookahead

        # engine state, kept across epochs and windows
        acc_max = int(np.diff(sp).max()) * total
        live_max = min(self.P_eng * max_res, self.P_eng * n_units)
        self.tsize = _next_pow2(int((2 * live_max + acc_max + 64) / 0.6))
        self._table, self.keys, self.prio, self.used = _table(None, self.tsize)
        self._spare = None  # the table tombstones are dropped into between epochs (allocated at the first)
        heap_cap = 2 * max_res + 2 * step_blocks + 64
        self.hk = np.zeros((self.P_eng, heap_cap), dtype=np.int64)
        self.hbk = np.zeros((self.P_eng, heap_cap), dtype=np.int64)
        self.hn = np.zeros(self.P_eng, dtype=np.int64)
        self.res_bytes = np.zeros(self.P_eng, dtype=np.int64)
        self.owner, self.stamp = units[:, 2], units[:, 3]  # int64[units]: see kernel.Buffers
        self.n_res = np.zeros(2, dtype=np.int64)
        self.last = np.full(n_units, INF, dtype=np.int64)
        self.err = np.zeros(4, dtype=np.int64)
        R = (lookahead + 1) * S + 1 if pol.mode == ROUTED else 1  # next uses lie within R - 1 steps
        self.due = np.zeros((R, self.P_eng), dtype=np.int64)  # [step % R, rank]: see kernel.Buffers
        self.peer_ok = self.cost.peer_ok(nb, stored_nb) if self.cost else None  # bool[units]
        ext = _extents(demand, groups, n_units)
        self.admit = bool(ext[0].shape[0] > 0 and admits_parts(pol))
        self.nxt = np.full(n_units if self.admit else 0, INF, dtype=np.int64)
        self.ext_stamp = np.full(ext[2].shape[0], -1, dtype=np.int64)
        self._max_xu = int(np.diff(ext[3]).max()) if self.admit else 0  # most units of one extent
        admit_max = 0  # parts of chunks: no bound (a read keeps at most its chunk's other parts)
        if self.admit and demand.extent_runs:  # a read keeps at most RUN_ADMIT of its run's neighbours
            from ..layout.runs import RUN_ADMIT
            admit_max = RUN_ADMIT
            self._max_xu = min(self._max_xu, RUN_ADMIT + 1)
        # the job as the kernels see it: the peer kernel splits strided steps over P ranks, L per node
        L = self.nodes.ranks_per_node if pol.peer else 1
        self.job = Job(self.bounds, self.cap_lo, self.cap_hi, self.share, nb, stored_nb, unit_count,
                       self.peer_ok if pol.peer else np.zeros(0, dtype=np.bool_), int(self.P_eng),
                       int(P if pol.peer else self.P_eng), int(L), int(pol.mode), int(pol.evict), int(self.budget),
                       int(self.boundary_steps), int(self.max_blocks_sample), pol.next_use != "node", *ext,
                       self.admit, self._run_horizon(demand, nb), admit_max,
                       bool(self.admit and demand.extent_runs))
        self.planned = 0  # epoch positions planned so far
        self.first_step = 0  # step at which epoch position `planned` starts (> 0 only for position 0)
        self.window = deque()  # indices of epoch positions planned .. planned + lookahead + 1 (those known)
        # the next epoch's next-use pass runs in a second thread while the engine plans this one (both
        # release the GIL): it depends only on the permutations, never on the engine's state
        self._last_bg = np.full(n_units, INF, dtype=np.int64) if pol.next_use != "none" else None
        self._next = None  # (epoch position, future of its (acc_ptr, nu, acc_blk)) computed ahead
        self._positions = None

    def _run_horizon(self, demand: Demand, nb: np.ndarray) -> int:
        """Steps ahead within which a neighbour read beside a block is kept (runs of neighbours; else 0).

        ``0.75 f S``: ``f`` the buffers' share of the data (all buffers' budget over its decoded bytes, at most
        1), ``S`` the steps of an epoch.  Kept farther ahead, neighbours hold room that later reads need, and
        the epochs read more: on the 16,384-sample contiguous PtychoNN file, P = 2 and 8, f = 0.25-0.75, this
        keeps storage within 1.01x of a plan without neighbours while cutting the requests 1.5-3x (docs/planner.md,
        "Runs of neighbouring blocks")."""
        if not (self.admit and demand.extent_runs):
            return 0
        f = min(1.0, float(self.P_eng) * float(self.budget) / max(1.0, float(nb.sum())))
        return max(1, int(0.75 * f * self.S))

    def positions(self) -> np.ndarray:
        """int64[T] ``0 .. T-1``: the engines are handed each epoch's accesses in position order: position p as
        "sample" p of the CSR ``(acc_ptr, acc_blk)``, the same units as ``sample_blocks[sample_ptr[idx[p]]:...]``.
        The engines read a sample's units only through that CSR, so the plan is the same, and they walk arrays
        in order instead of two random reads per sample (at 1M samples the planner is bound by memory misses)."""
        if self._positions is None:
            self._positions = np.arange(self.total, dtype=np.int64)
        return self._positions

    def kernel_args(self, acc_ptr, nu, acc_blk, step0: int, record: bool, nodes: bool):
        """``(job, epoch, buffers, out)``: the structs the kernels take (:mod:`.kernel`) for the epoch whose
        accesses are ``(acc_ptr, nu, acc_blk)`` in position order (see :meth:`positions`), its outputs zeroed."""
        ep = Epoch(self.positions(), acc_ptr, nu, acc_ptr, acc_blk, int(step0), int(self.first_step))
        buf = Buffers(self.keys, self.prio, self.used, self.hk, self.hbk, self.hn, self.res_bytes, self.owner,
                      self.stamp, self.n_res, self.due, self.nxt, self.ext_stamp)
        out = outputs(self.total, self.S, self.P_eng, int(acc_ptr[-1]), int(self.n_res[0]), record, nodes, self.err,
                      int(acc_ptr[-1]) * self._max_xu)
        return self.job, ep, buf, out

    def source_epoch(self, pos: int) -> int:
        """The source epoch (seed offset) trained at epoch position ``pos``."""
        return int(self.order[pos]) if self.order is not None else int(pos)

    def _source(self, pos: int) -> np.ndarray:  # the global index trained at epoch position pos
        if self.perms is not None:
            return self.perms[self.order[pos]]
        return epoch_indices(self.n, self.cfg.world_size, self.cfg.seed, int(pos), self.cfg.drop_last)

    def _horizon(self) -> Optional[int]:
        return None if self.open_ended else self.cfg.epochs

    def advance(self, stop: int, on_epoch: Optional[Callable[[EpochPlan], None]] = None,
                progress: bool = False, first_step: int = 0, progress_label: str = "") -> PolicyResult:
        """Plan epoch positions ``self.planned .. stop - 1``; their :class:`PolicyResult`.

        ``first_step`` (only before anything is planned, so with empty buffers): epoch position 0 starts at
        that step, its steps before it untrained (a job resumed there, :mod:`.elastic`).  Its next uses are
        those of the steps from ``first_step`` on, so it is planned exactly as a job whose epoch began there:
        Belady and the routing see no access before it.  Its :class:`EpochPlan` holds the positions from
        ``bounds[first_step]`` on (``indices``, ``rank_of``; ``bounds`` shifted by as much, so the steps before
        are empty), zero counts and empty load/evict rows before ``first_step``, and the demand of the steps
        trained; the result's local batch range covers those steps.
        """
        E = self._horizon()
        if isinstance(stop, bool) or not isinstance(stop, (int, np.integer)) or stop < self.planned or (
                E is not None and stop > E):
            raise SpecError(f"cannot plan up to epoch {stop!r}: {self.planned} planned"
                            + (f", the job has {E}" if E is not None else ""))
        if isinstance(first_step, bool) or not isinstance(first_step, (int, np.integer)) or not (
                0 <= first_step < self.S):
            raise SpecError(f"first_step {first_step!r} is not a step of an epoch of {self.S} steps (0..{self.S - 1})")
        if first_step and self.planned:
            raise SpecError(f"first_step {first_step}: only the first epoch planned can start mid-epoch (from empty "
                            f"buffers); {self.planned} epochs are planned")
        self.first_step = int(first_step)
        result = PolicyResult(self.pol.name, [self.source_epoch(e) for e in range(self.planned, stop)])
        it = range(self.planned, int(stop))
        from ..progress import compile_notice, each
        if progress:
            it = each(it, len(it), f"plan {self.pol.name}{progress_label}", "epoch", progress)
        pool = ThreadPoolExecutor(1, thread_name_prefix="solar-plan-ahead") if int(stop) - self.planned > 1 else None
        first = self.planned
        try:
            for e in it:
                with compile_notice(f"plan {self.pol.name}", progress if e == first else False):
                    self._epoch(e, result, on_epoch, pool if e + 1 < int(stop) else None)
                self.planned = e + 1
                self.first_step = 0
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
            self._next = None
        return result

    def _uses(self, e: int, idx: np.ndarray, future: list, last: np.ndarray, first_step: int):
        """``(acc_ptr int64[T+1], nu int64[A], acc_blk int64[A], first int64[units] or None)`` of epoch position
        ``e`` (global index ``idx``, the indices of the epochs after it in ``future``): where each position's
        accesses start, each access's next use step and its unit, and (parts kept beside reads,
        ``Job.admit``) each unit's first use from the epoch's first step on.  ``last``: int64[units] scratch, INF on entry and on exit.  Pure in the
        permutations: no engine state is read, so it may run while the engine plans the epoch before."""
        pol, sp, sb = self.pol, self.sp, self.sb
        empty = np.zeros(0, dtype=np.int64)
        idx_f = future[0] if len(future) == 1 else (np.concatenate(future) if future else empty)
        step0 = e * self.S
        # the units of each position's sample in position order: int64[A], and where each position's start, int64[T+1]
        acc_blk, acc_ptr = expand(idx, np.arange(self.total + 1, dtype=np.int64), sp, sb)
        nu = np.full(int(acc_ptr[-1]), INF, dtype=np.int64)
        first = np.empty(last.shape[0], dtype=np.int64) if self.admit else None  # admit: global next use
        if pol.next_use == "node":
            next_use_nodes(idx, self.bounds, step0, idx_f, len(future), acc_ptr, self.cfg.world_size,
                           self.nodes.ranks_per_node, sp, sb, last, nu)
        elif pol.next_use != "none":
            eg.next_use(idx, self.bounds, step0, idx_f, len(future), acc_ptr, self.cfg.world_size,
                        pol.next_use == "rank", sp, sb, last, nu, first_step, first)
        return acc_ptr, nu, acc_blk, first

    def _epoch(self, e: int, result: PolicyResult, on_epoch, pool=None):
        """Plan epoch position ``e``; with ``pool`` (an executor), start epoch e + 1's next-use pass in it first."""
        pol, S = self.pol, self.S
        E = self._horizon()
        window = self.window
        k = self.lookahead + 1  # indices this epoch's next uses see: its own and `lookahead` after it
        want = k + (1 if pool is not None else 0)  # and, to compute ahead, those of epoch e + 1
        if not window:
            window.append(self._source(e))
        while len(window) < want and (E is None or e + len(window) < E):
            window.append(self._source(e + len(window)))
        ahead = list(window)
        idx, future = ahead[0], ahead[1:k]
        if self._next is not None and self._next[0] == e:
            acc_ptr, nu, acc_blk, first = self._next[1].result()
        else:
            acc_ptr, nu, acc_blk, first = self._uses(e, idx, future, self.last, self.first_step)
        if first is not None:
            self.nxt[:] = first  # where each unit is next used from this epoch's first step on
        self._next = None
        if pool is not None and len(ahead) > 1:
            self._next = (e + 1, pool.submit(self._uses, e + 1, ahead[1], ahead[2:k + 1], self._last_bg, 0))
        step0 = e * S
        if pol.node_pools:
            node_epoch(self, e, idx, acc_ptr, nu, acc_blk, step0, result, on_epoch)
        else:
            self._rank_epoch(e, idx, acc_ptr, nu, acc_blk, step0, result, on_epoch)
        # drop tombstones between epochs
        if self.n_res[1] > 0:
            spare, nk, npr, nus = _table(self._spare, self.tsize)
            ht_rebuild(self.keys, self.prio, self.used, nk, npr, nus)
            self._spare, self._table = self._table, spare
            self.keys, self.prio, self.used = nk, npr, nus
            self.n_res[1] = 0
        window.popleft()

    def _rank_epoch(self, e: int, idx, acc_ptr, nu, acc_blk, step0: int, result: PolicyResult, on_epoch):
        """One epoch of a policy with a buffer per rank (or one for all): the engine, then the results."""
        pol = self.pol
        job, ep, buf, out = self.kernel_args(acc_ptr, nu, acc_blk, step0, self.record, False)
        eg.run_epoch(job, ep, buf, out)  # on the epoch's accesses in position order (see positions())
        err, rank_of = out.err, out.buf_of
        if err[0] == TOO_SMALL:
            raise BufferTooSmall(
                f"buffer of {self.budget:,} bytes per rank cannot hold the {int(err[3]):,} bytes of blocks that rank "
                f"{int(err[2])} needs at step {int(err[1]) - step0} of epoch {e}: the buffer must hold at least "
                f"one local batch")
        if err[0] != OK:
            raise RuntimeError(f"planner engine failed with status {int(err[0])} at step {int(err[1])}")
        count, hits, hit_bytes, misses, miss_bytes, stored = (out.st[i] for i in (COUNT, HITS, HIT_BYTES, MISS,
                                                                                 MISS_BYTES, STORED))
        f = self.first_step
        bounds = self.bounds
        if f:  # the steps before f train nothing: keep the positions from f on
            cut = int(bounds[f])
            idx, rank_of = idx[cut:], rank_of[cut:]
            bounds = np.maximum(bounds - cut, 0)  # int64[S+1]: steps before f empty
        demand_bytes = int(self.sample_bytes[idx].sum())
        result.hit_bytes.append(int(hit_bytes.sum()))
        result.miss_bytes.append(int(miss_bytes.sum()))
        result.stored_bytes.append(int(stored.sum()))
        result.demand_bytes.append(demand_bytes)
        if pol.single_buffer:  # one buffer for all ranks: report the per-rank share
            result.max_local_batch.append(int(self.share[f:].max() // self.cfg.world_size))
            result.min_local_batch.append(int(self.share[f:].min() // self.cfg.world_size))
        else:
            result.max_local_batch.append(int(count[f:].max()))
            result.min_local_batch.append(int(count[f:].min()))
        result.rank_miss_bytes.append(miss_bytes.sum(axis=0))
        result.peer_bytes.append(0)
        if on_epoch is not None:
            lists = (None, None, None, None)
            if self.record:
                lists = (out.load[:out.n[N_LOAD]], out.load_ptr, out.evict[:out.n[N_EVICT]], out.evict_ptr)
                if self.groups is not None:  # back to layout block ids
                    g = self.groups
                    lists = (*expand(lists[0], lists[1], g.group_ptr, g.group_blocks),
                             *expand(lists[2], lists[3], g.group_ptr, g.group_blocks))
            on_epoch(EpochPlan(e, self.source_epoch(e), step0, idx, bounds, rank_of, count, hits, hit_bytes,
                               misses, miss_bytes, stored, demand_bytes, *lists))
