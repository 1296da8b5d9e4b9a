"""A rank's buffer memory: :class:`MemoryNeed` and :func:`memory_need` (pure; the model is described in
:mod:`solar.memory`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .budget import DEFAULT_IO_DEPTH, DEFAULT_PREFETCH, FIXED_OVERHEAD, live_batches, memory_limit
from .slots import plan_pools, size_classes


@dataclass(frozen=True)
class MemoryNeed:
    """A rank's buffer memory in bytes (see :mod:`solar.memory`); ``total`` = the four parts."""

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


def memory_need(rank_plan, block_nbytes: np.ndarray, *, residency_budget: int, batch: int, bookkeeping: int,
                prefetch: int = DEFAULT_PREFETCH, io_depth: int = DEFAULT_IO_DEPTH):
    """``(MemoryNeed, slots int64[C], class_of, class_bytes)`` of one rank running ``rank_plan``.

    ``batch``: bytes of one assembled batch (:func:`~solar.memory.budget.batch_bytes`); the pools get what is left of
    the limit after the batches and bookkeeping, and at least the plan's residency.
    """
    class_of, class_bytes = size_classes(block_nbytes)
    limit = memory_limit(residency_budget, batch, bookkeeping)
    batches = live_batches(prefetch) * int(batch)
    base, slots = plan_pools(class_of, class_bytes, rank_plan, window=max(0, int(io_depth) - 1),
                             room=limit - batches - bookkeeping)
    resident = int((base * class_bytes).sum())
    pools = int((slots * class_bytes).sum())
    need = MemoryNeed(resident, pools - resident, batches, int(bookkeeping), limit, int(prefetch))
    return need, slots, class_of, class_bytes
