"""Per-rank buffer of decoded blocks that executes the schedule's plan, ahead of training.

:class:`BufferManager` consumes a rank's slice of the schedule and a reader; its
memory is a set of preallocated slot pools (:mod:`solar.buffer.pool`) sized by
replaying the plan, within the memory the plan was made for (:mod:`solar.memory`: the
model the planner shares).
:class:`NodeBufferManager` runs a node plan: the ranks of a node share one pool in an MPI
shared-memory window, and nodes send each other blocks as planned.
"""
from .manager import BufferError, BufferManager, BufferTotals, StepBlocks, StepStats, rank_memory
from .node_manager import NodeBufferManager
from .node_pools import NodeBufferError
from .pool import SlotPools

__all__ = ["BufferManager", "BufferError", "NodeBufferManager", "NodeBufferError", "BufferTotals", "StepBlocks",
           "StepStats", "SlotPools", "rank_memory"]
