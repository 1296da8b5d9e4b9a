"""A buffer of decoded blocks that executes the schedule's plan, ahead of training.

:class:`BufferManager` consumes a plan and a reader; its memory is a set of preallocated slot pools sized by
replaying the plan, within the memory the plan was made for (:mod:`solar.memory`: the model the planner
shares).  Where the pools live is the manager's place: a rank's own, in process memory
(:mod:`solar.buffer.pool`) or on a device (:mod:`solar.buffer.device_pools`) (:mod:`solar.buffer.rank_place`),
or a node's, shared by its ranks in an MPI shared-memory window, nodes sending each other blocks as planned
(:mod:`solar.buffer.node_place`; :class:`NodeBufferManager` runs a node plan there).
"""
from .manager import BufferManager, rank_memory
from .node_manager import NodeBufferManager
from .node_pools import NodeBufferError
from .pool import SlotPools
from .steps import BufferError, BufferTotals, StepBlocks, StepStats

__all__ = ["BufferManager", "BufferError", "NodeBufferManager", "NodeBufferError", "BufferTotals", "StepBlocks",
           "StepStats", "SlotPools", "rank_memory"]
