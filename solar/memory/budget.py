"""The memory of a rank's budget that is not resident blocks: batches, bookkeeping, the reserve
:func:`solar.plan <solar.schedule.plan>` holds back, and the limit a plan was made for (pure)."""
from __future__ import annotations

from typing import Tuple

import numpy as np

from ..errors import SpecError

#: Assembled batches waiting in the queue by default (``SolarLoader(prefetch=...)``, ``solar bench --prefetch``).
#: Reads run up to ``io_depth`` (4) steps further ahead into pool slots, so a short queue costs no
#: read depth; each queued batch is memory the residency does not get (see docs/runtime.md).
DEFAULT_PREFETCH = 2
#: Steps whose reads a rank's buffer keeps in flight (``io_depth`` of the buffer managers): staging slots for
#: them come out of the room left in the limit; a device buffer stages that many steps' misses on the host.
DEFAULT_IO_DEPTH = 4
#: Batches and bookkeeping a plan does not take from the budget (so that small budgets of small
#: datasets still plan): a rank's :func:`~solar.memory.memory_need` is at most the budget plus this.
PLAN_ALLOWANCE = 16 << 20
#: Bytes per rank beyond the budget that do not grow with the dataset: :data:`PLAN_ALLOWANCE`, numba's
#: LLVM and the compiled gather kernels (~43 MiB measured), thread stacks and the reader's per-thread
#: scratch (one stored chunk each).  What ``solar bench`` compares the RSS growth with.
FIXED_OVERHEAD = 64 << 20
#: The most batches of reads in flight a plan may reserve (``solar plan --reads-in-flight``).
MAX_READS_IN_FLIGHT = 64
#: Bytes per block the buffer keeps: ``slot_of`` int64 + ``class_of`` int32 + ``block_nbytes`` int64.
BLOCK_BOOKKEEPING = 20


def batch_bytes(layout, n: int) -> int:
    """Bytes of one assembled batch of ``n`` samples of ``layout`` (the largest sample shape;
    fields 64-byte aligned in one allocation, as :class:`~solar.loader.assemble.BatchAssembler` makes them)."""
    best = 0
    for _, shapes, dtypes in layout.sample_shape_groups():
        per = sum(-(-n * int(np.prod(shp, dtype=np.int64)) * np.dtype(dtypes[k]).itemsize // 64) * 64
                  for k, shp in shapes.items())
        best = max(best, per)
    return int(best)


def largest_batch(local_batch: int, epsilon: float) -> int:
    """The most samples one rank gets in a step with local batch ``b`` and imbalance ``epsilon``:
    floor(b (1 + epsilon))."""
    return int(np.floor(local_batch * (1 + epsilon) + 1e-9))


def max_local_batch(cfg) -> int:
    """:func:`largest_batch` of ``cfg`` (a PlanConfig)."""
    return largest_batch(cfg.local_batch, cfg.epsilon)


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


#: Batches alive outside the queue: the one handed to the training loop and the one before it, which a ``for``
#: loop still holds while it asks for the next (measured: a loop that keeps nothing has ``prefetch + 2`` alive).
BATCHES_HANDED_OUT = 2


def live_batches(prefetch: int = DEFAULT_PREFETCH) -> int:
    """The most assembled batches alive at once for a loop that keeps none: ``prefetch`` waiting in the queue and
    :data:`BATCHES_HANDED_OUT`."""
    return int(prefetch) + BATCHES_HANDED_OUT


def reserve_bytes(batch: int, bookkeeping: int, prefetch: int = DEFAULT_PREFETCH) -> int:
    """Bytes of a rank's budget that are not for resident blocks: the :func:`live_batches` (``prefetch`` queued,
    the one the training loop holds and the one before it), one batch of reads in flight (``batch`` bytes each),
    and the bookkeeping.  ``solar.plan`` plans the residency for ``budget - reserve_bytes(...)``."""
    return int((live_batches(prefetch) + 1) * batch + bookkeeping)


def memory_limit(residency_budget: int, batch: int, bookkeeping: int) -> int:
    """The memory per rank a plan with this residency budget was made for (:func:`reserve_bytes` added)."""
    return int(residency_budget + reserve_bytes(batch, bookkeeping))


def check_reads_in_flight(value) -> int:
    """``value`` as batches of reads in flight a plan reserves (an integer 1..:data:`MAX_READS_IN_FLIGHT`);
    SpecError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or not 1 <= value <= MAX_READS_IN_FLIGHT:
        raise SpecError(f"reads_in_flight must be an integer from 1 to {MAX_READS_IN_FLIGHT} (batches of reads in "
                        f"flight the budget holds), got {value!r}")
    return int(value)


def plan_budgets(budget: int, demand, local_batch: int, epsilon: float, layout=None,
                 reads_in_flight: int = 1) -> Tuple[int, int]:
    """``(residency, read_ahead)`` when a rank may use ``budget`` bytes in all: the planner's budget for resident
    blocks, ``budget - (reserve_bytes(...) - PLAN_ALLOWANCE) - read_ahead``, and ``read_ahead``, the
    ``reads_in_flight - 1`` batches held beyond the one :func:`reserve_bytes` keeps for reads in flight (pool
    slots the buffer reads the next steps' misses into while the steps before them are still in use).  Batches
    of ``layout``, else bounded from ``demand``, a :class:`~solar.scheduler.Demand`.  SpecError naming the
    figures when nothing is left."""
    n = largest_batch(local_batch, epsilon)
    batch = batch_bytes(layout, n) if layout is not None else demand_batch_bytes(
        demand.sample_ptr, demand.sample_blocks, demand.block_nbytes, n)
    keep = bookkeeping_bytes(demand.n_samples, demand.n_blocks, int(np.shape(demand.sample_blocks)[0]))
    reads = check_reads_in_flight(reads_in_flight)
    base, ahead = reserve_bytes(batch, keep), (reads - 1) * batch
    reserve = max(0, base - PLAN_ALLOWANCE) + ahead
    if reserve >= budget:
        from ..layout.summary import human_bytes as hb
        raise SpecError(f"a budget of {hb(budget)} per rank leaves nothing for the buffer: "
                        f"{live_batches() + reads} batches of {n} samples ({hb(batch)} each: "
                        f"{DEFAULT_PREFETCH} queued, {BATCHES_HANDED_OUT} handed out, {reads} read in flight) and "
                        f"{hb(keep)} of "
                        f"bookkeeping take {hb(base + ahead)}, {hb(min(base, PLAN_ALLOWANCE))} of it on top; "
                        f"raise the budget or lower the local batch" + (" or reads_in_flight" if reads > 1 else ""))
    return int(budget - reserve), int(ahead)

