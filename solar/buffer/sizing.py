"""How much memory a rank's buffer needs, planner and runtime alike (pure: arrays in, numbers out).

Blocks are grouped into size classes (blocks of one dataset share a size); each
class gets a pool of equal slots, so allocation is O(1) and never fragments.  The
pool sizes come from replaying the rank's plan.

**The memory model** (per rank, bytes; one function, :func:`memory_need`, used by the
buffer at start, ``solar bench`` and ``solar inspect``):

* ``resident``: the pools the plan's own residency needs: per class, the most blocks of
  that class resident at once (:func:`slots_needed`, ``window=0``), times its slot size.
  The planner keeps the resident bytes at most its budget at every step; with one block
  size (or planning units of one mix of sizes) ``resident`` is that peak exactly.
* ``staging``: extra pool slots for reads in flight.  A slot evicted at step q is
  reused only once step q-1 is assembled, so with reads of several steps in flight
  evicted slots are held for a while (``window`` steps).  ``staging`` is what the room
  left inside the limit allows, never more than the plan would hold with ``window``
  steps in flight (:func:`pool_slots`); the buffer runs fewer steps' reads at once
  when the pools are full, so it never needs more.
* ``batches``: ``prefetch`` assembled batches waiting in the queue plus the one the
  training loop holds, each :func:`batch_bytes` of the largest local batch.
* ``bookkeeping``: the per-block arrays the buffer keeps (slot and size class per block,
  the sample -> block map), which grow with the dataset.

``limit`` is the memory the plan was made for (:func:`memory_limit`): the planner's
residency budget plus :func:`reserve_bytes` (batches, one batch of reads in flight, the
bookkeeping).  ``solar.plan`` takes the reserve beyond :data:`PLAN_ALLOWANCE` from the budget
the user gave (:func:`residency_budget`), so ``limit <= budget + PLAN_ALLOWANCE``.  The buffer
refuses to start, before reading anything, when ``total > limit``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

MAX_EXACT_CLASSES = 32
#: Assembled batches waiting in the queue by default (``SolarLoader(prefetch=...)``, ``solar bench --prefetch``).
#: Reads run up to ``io_depth`` (4) steps further ahead into pool slots, so a short queue costs no
#: read depth; each queued batch is memory the residency does not get (see docs/runtime.md).
DEFAULT_PREFETCH = 2
#: Batches and bookkeeping a plan does not take from the budget (so that small budgets of small
#: datasets still plan): a rank's :func:`memory_need` is at most the budget plus this.
PLAN_ALLOWANCE = 16 << 20
#: Bytes per rank beyond the budget that do not grow with the dataset: :data:`PLAN_ALLOWANCE`, numba's
#: LLVM and the compiled gather kernels (~43 MiB measured), thread stacks and the reader's per-thread
#: scratch (one stored chunk each).  What ``solar bench`` compares the RSS growth with.
FIXED_OVERHEAD = 64 << 20
#: Bytes per block the buffer keeps: ``slot_of`` int64 + ``class_of`` int32 + ``block_nbytes`` int64.
BLOCK_BOOKKEEPING = 20


def size_classes(block_nbytes: np.ndarray):
    """``block_nbytes`` int64[B] -> ``(class_of int32[B], class_bytes int64[C])``.

    Exact sizes while there are at most 32 distinct ones; beyond that sizes are
    rounded up to powers of two (at most 2x slack for the odd-sized blocks).
    """
    nb = np.asarray(block_nbytes, dtype=np.int64)
    sizes = np.unique(nb)
    if sizes.shape[0] > MAX_EXACT_CLASSES:
        rounded = np.where(nb > 0, 1 << np.ceil(np.log2(np.maximum(nb, 1))).astype(np.int64), 0)
        sizes, class_of = np.unique(rounded, return_inverse=True)
        return class_of.astype(np.int32).reshape(-1), sizes
    class_of = np.searchsorted(sizes, nb).astype(np.int32)
    return class_of, sizes


def slots_needed(class_of: np.ndarray, n_classes: int, load: np.ndarray, load_ptr: np.ndarray,
                 evict: np.ndarray, evict_ptr: np.ndarray, window: int = 0) -> np.ndarray:
    """int64[C]: the most slots of each class in use at once over the plan's G steps.

    ``load``/``evict`` hold block ids with int64[G+1] pointers (one rank's plan).
    With reads of several steps in flight, a slot evicted at step q is reused only
    once step q-1 is assembled: ``window`` steps of evictions stay held on top of
    the resident blocks (0: the plan's own peak).
    """
    G = load_ptr.shape[0] - 1
    delta = np.zeros((G, n_classes), dtype=np.int64)  # (G, C) resident change per step
    step_of_load = np.repeat(np.arange(G), np.diff(load_ptr))
    step_of_evict = np.repeat(np.arange(G), np.diff(evict_ptr))
    np.add.at(delta, (step_of_load, class_of[load]), 1)
    np.add.at(delta, (step_of_evict, class_of[evict]), -1)
    resident = np.cumsum(delta, axis=0)  # (G, C) resident count after each step
    if not G:
        return np.zeros(n_classes, dtype=np.int64)
    if window > 0:
        ev = np.zeros((G + 1, n_classes), dtype=np.int64)  # (G+1, C) cumulative evictions
        np.add.at(ev, (step_of_evict + 1, class_of[evict]), 1)
        ev = np.cumsum(ev, axis=0)
        lag = np.maximum(np.arange(1, G + 1) - window, 0)  # evictions of steps (p - window, p] still held
        resident = resident + ev[1:] - ev[lag]
    return resident.max(axis=0, initial=0)


def pool_slots(base: np.ndarray, want: np.ndarray, class_bytes: np.ndarray, room: int) -> np.ndarray:
    """int64[C] slots per class: ``base`` (the plan's residency, always given), plus as much of
    ``want - base`` (slots held for reads in flight) as fits in ``room`` bytes of pools in all.

    The extra is shared in proportion to each class's wish (whole slots, rounded down), so
    ``(result * class_bytes).sum() <= max(room, (base * class_bytes).sum())``.
    """
    base = np.asarray(base, np.int64)
    extra = np.maximum(np.asarray(want, np.int64) - base, 0)
    cb = np.asarray(class_bytes, np.int64)
    wish = int((extra * cb).sum())
    free = int(room) - int((base * cb).sum())
    if wish <= free:
        return base + extra
    if free <= 0 or wish == 0:
        return base.copy()
    return base + (extra * free) // wish  # extra_c * cb_c * free / wish <= share of free, whole slots


def batch_bytes(layout, n: int) -> int:
    """Bytes of one assembled batch of ``n`` samples of ``layout`` (the largest sample shape;
    fields 64-byte aligned in one allocation, as :class:`~solar.loader.assemble.BatchAssembler` makes them)."""
    best = 0
    for _, shapes, dtypes in layout.sample_shape_groups():
        per = sum(-(-n * int(np.prod(shp, dtype=np.int64)) * np.dtype(dtypes[k]).itemsize // 64) * 64
                  for k, shp in shapes.items())
        best = max(best, per)
    return int(best)


def max_local_batch(cfg) -> int:
    """The most samples one rank gets in a step under ``cfg`` (a PlanConfig): floor(b (1 + epsilon))."""
    return int(np.floor(cfg.local_batch * (1 + cfg.epsilon) + 1e-9))


def demand_batch_bytes(sample_ptr: np.ndarray, sample_blocks: np.ndarray, block_nbytes: np.ndarray, n: int) -> int:
    """Upper bound of :func:`batch_bytes` when only the sample -> block map is known: ``n`` times the
    most decoded block bytes one sample needs (exact for one block per sample)."""
    sp, nb = np.asarray(sample_ptr, np.int64), np.asarray(block_nbytes, np.int64)
    if sp.shape[0] < 2:
        return 0
    csum = np.concatenate(([0], np.cumsum(nb[np.asarray(sample_blocks, np.int64)])))
    return int(n * int((csum[sp[1:]] - csum[sp[:-1]]).max()))


def bookkeeping_bytes(n_samples: int, n_blocks: int, n_refs: int) -> int:
    """Bytes of the per-block and per-sample arrays the buffer keeps (grow with the dataset)."""
    return int(BLOCK_BOOKKEEPING * n_blocks + 8 * (n_samples + 1) + 8 * n_refs)


def reserve_bytes(batch: int, bookkeeping: int, prefetch: int = DEFAULT_PREFETCH) -> int:
    """Bytes of a rank's budget that are not for resident blocks: ``prefetch`` queued batches, the
    batch the training loop holds, one batch of reads in flight (``batch`` bytes each), and the
    bookkeeping.  ``solar.plan`` plans the residency for ``budget - reserve_bytes(...)``."""
    return int((prefetch + 2) * batch + bookkeeping)


def memory_limit(residency_budget: int, batch: int, bookkeeping: int) -> int:
    """The memory per rank a plan with this residency budget was made for (:func:`reserve_bytes` added)."""
    return int(residency_budget + reserve_bytes(batch, bookkeeping))


@dataclass(frozen=True)
class MemoryNeed:
    """A rank's buffer memory in bytes (see the module docstring); ``total`` = the four parts."""

    resident: int
    staging: int
    batches: int
    bookkeeping: int
    limit: int
    prefetch: int

    @property
    def pools(self) -> int:
        return self.resident + self.staging

    @property
    def total(self) -> int:
        return self.resident + self.staging + self.batches + self.bookkeeping

    @property
    def fits(self) -> bool:
        return self.total <= self.limit

    def to_dict(self) -> dict:
        return dict(asdict(self), pools=self.pools, total=self.total, fixed_overhead=FIXED_OVERHEAD)


def plan_pools(class_of, class_bytes, rank_plan, *, window: int, room: int):
    """``(base, slots)`` int64[C] each for ``rank_plan`` (a :class:`~solar.schedule.RankPlan`): the
    plan's residency, and that plus slots held for ``window`` steps of reads in flight as far as
    ``room`` bytes of pools allow."""
    args = (class_of, class_bytes.shape[0], np.asarray(rank_plan.load, np.int64), rank_plan.load_ptr,
            np.asarray(rank_plan.evict, np.int64), rank_plan.evict_ptr)
    base = slots_needed(*args, window=0)
    want = slots_needed(*args, window=window) if window > 0 else base
    return base, pool_slots(base, want, class_bytes, room)


def memory_need(rank_plan, block_nbytes: np.ndarray, *, residency_budget: int, batch: int, bookkeeping: int,
                prefetch: int = DEFAULT_PREFETCH, io_depth: int = 4):
    """``(MemoryNeed, slots int64[C], class_of, class_bytes)`` of one rank running ``rank_plan``.

    ``batch``: bytes of one assembled batch (:func:`batch_bytes`); the pools get what is left of
    the limit after the batches and bookkeeping, and at least the plan's residency.
    """
    class_of, class_bytes = size_classes(block_nbytes)
    limit = memory_limit(residency_budget, batch, bookkeeping)
    batches = (int(prefetch) + 1) * int(batch)
    base, slots = plan_pools(class_of, class_bytes, rank_plan, window=max(0, int(io_depth) - 1),
                             room=limit - batches - bookkeeping)
    resident = int((base * class_bytes).sum())
    pools = int((slots * class_bytes).sum())
    need = MemoryNeed(resident, pools - resident, batches, int(bookkeeping), limit, int(prefetch))
    return need, slots, class_of, class_bytes


def residency_budget(budget: int, demand, local_batch: int, epsilon: float, layout=None) -> int:
    """The planner's budget for resident blocks when a rank may use ``budget`` bytes in all:
    ``budget - (reserve_bytes(...) - PLAN_ALLOWANCE)`` (batches of ``layout``, else bounded from
    ``demand``, a :class:`~solar.scheduler.Demand`).  SpecError naming the figures when nothing is left."""
    from ..errors import SpecError
    n = int(np.floor(local_batch * (1 + epsilon) + 1e-9))
    batch = batch_bytes(layout, n) if layout is not None else demand_batch_bytes(
        demand.sample_ptr, demand.sample_blocks, demand.block_nbytes, n)
    keep = bookkeeping_bytes(demand.n_samples, demand.n_blocks, int(np.shape(demand.sample_blocks)[0]))
    reserve = max(0, reserve_bytes(batch, keep) - PLAN_ALLOWANCE)
    if reserve >= budget:
        from ..layout.summary import human_bytes as hb
        raise SpecError(f"a budget of {hb(budget)} per rank leaves nothing for the buffer: "
                        f"{DEFAULT_PREFETCH} + 2 batches of {n} samples ({hb(batch)} each: queued, in "
                        f"training, read in flight) and {hb(keep)} of bookkeeping take "
                        f"{hb(reserve + PLAN_ALLOWANCE)}, {hb(PLAN_ALLOWANCE)} of it on top; "
                        f"raise the budget or lower the local batch")
    return int(budget - reserve)


def schedule_memory(schedule, rank: int, layout=None, prefetch: int = DEFAULT_PREFETCH, io_depth: int = 4,
                    keep: bool = True):
    """:class:`MemoryNeed` of rank ``rank`` running ``schedule`` (a :class:`~solar.schedule.Schedule`)
    with ``prefetch`` queued batches; batches sized from ``layout`` (default: the layout the schedule
    stores, else bounded from its sample -> block map).  ``keep``: leave the rank's slice cached."""
    d, batch = _schedule_batch(schedule, layout)
    books = bookkeeping_bytes(np.shape(d["sample_ptr"])[0] - 1, np.shape(d["block_nbytes"])[0],
                              np.shape(d["sample_blocks"])[0])
    return memory_need(schedule.rank(rank, keep=keep), np.asarray(d["block_nbytes"], np.int64),
                       residency_budget=schedule.buffer_bytes, batch=batch, bookkeeping=books, prefetch=prefetch,
                       io_depth=io_depth)[0]


def _schedule_batch(schedule, layout=None):
    """``(demand, bytes of the largest local batch)`` of ``schedule``: batches sized from ``layout`` (default:
    the layout the schedule stores), else bounded from its sample -> block map."""
    d = schedule.demand()
    if layout is None and getattr(schedule, "has_layout", False):
        layout = schedule.layout()
    n = max_local_batch(schedule.config)
    return d, (batch_bytes(layout, n) if layout is not None else demand_batch_bytes(
        d["sample_ptr"], d["sample_blocks"], d["block_nbytes"], n))


def schedule_node_memory(schedule, node: int, layout=None, prefetch: int = DEFAULT_PREFETCH, io_depth: int = 4,
                         keep: bool = True):
    """:class:`~solar.buffer.node_pools.NodeMemory` of node ``node`` of a node plan (format version 6)
    running with ``prefetch`` queued batches per rank; batches sized as in :func:`schedule_memory`."""
    from .node_pools import plan_node_memory
    d, batch = _schedule_batch(schedule, layout)
    L = schedule.nodes.ranks_per_node
    lists = schedule.node_plan(node * L, keep=keep).node(node)
    return plan_node_memory(lists, d["block_nbytes"], np.shape(d["sample_ptr"])[0] - 1, np.shape(d["sample_blocks"])[0],
                            L=L, budget=schedule.buffer_bytes, batch=batch, prefetch=prefetch, io_depth=io_depth)[0]


def format_memory(need: MemoryNeed) -> str:
    """One line: what a rank's memory is made of (``solar inspect``, ``solar bench``)."""
    from ..layout.summary import human_bytes as hb
    return (f"{hb(need.total)} (pools {hb(need.resident)} resident + {hb(need.staging)} reads in flight, "
            f"{need.prefetch} + 1 batches {hb(need.batches)}, bookkeeping {hb(need.bookkeeping)}; "
            f"planned for {hb(need.limit)})")


def schedule_memory_summary(schedule) -> dict:
    """``MemoryNeed.to_dict()`` of the rank of ``schedule`` that needs most, with the default prefetch
    (``solar inspect plan.h5``, ``solar plan``); ``{"error": ...}`` if a rank's slice cannot be read."""
    from ..errors import SolarError
    try:  # the layout decoded once; one rank's slice in memory at a time
        layout = schedule.layout() if getattr(schedule, "has_layout", False) else None
        if getattr(schedule, "nodes", None) is not None:  # a node plan: the node that needs most
            needs = [schedule_node_memory(schedule, n, layout, keep=False) for n in range(schedule.nodes.n_nodes)]
            return dict(max(needs, key=lambda m: m.total).to_dict(), per_node=True,
                        ranks_per_node=schedule.nodes.ranks_per_node)
        needs = [schedule_memory(schedule, r, layout, keep=False) for r in range(schedule.world_size)]
    except SolarError as exc:
        return {"error": str(exc)}
    return max(needs, key=lambda m: m.total).to_dict()
