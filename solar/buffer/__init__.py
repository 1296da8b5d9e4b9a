"""Per-rank buffer of decoded blocks that executes the schedule's plan, ahead of training.

:class:`BufferManager` consumes a rank's slice of the schedule and a reader; its
memory is a set of preallocated slot pools (:mod:`solar.buffer.pool`) sized by
replaying the plan (:mod:`solar.buffer.sizing`).
"""
from .manager import BufferError, BufferManager, BufferTotals, StepBlocks, StepStats
from .pool import SlotPools
from .sizing import size_classes, slots_needed

__all__ = ["BufferManager", "BufferError", "BufferTotals", "StepBlocks", "StepStats", "SlotPools", "size_classes",
           "slots_needed"]
