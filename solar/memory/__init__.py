"""How much memory a rank's (or a node's) buffer needs: the one model the planner and the runtime share.

Pure: arrays and numbers in, numbers out; no I/O, no MPI, no clock.  It sits below both layers that use
it: ``solar.schedule`` (``solar.plan`` reserves the batches and bookkeeping from the budget; ``solar inspect``
prints a plan's memory) and ``solar.buffer`` (sizes its pools, refuses to start when they do not fit), and
imports neither.

Blocks are grouped into size classes (blocks of one dataset share a size); each class gets a pool of equal
slots, so allocation is O(1) and never fragments.  The pool sizes come from replaying the rank's plan.

**The memory model** (per rank, bytes; one function, :func:`memory_need`, used by the buffer at start,
``solar bench`` and ``solar inspect``):

* ``resident``: the pools the plan's own residency needs: per class, the most blocks of that class
  resident at once (:func:`slots_needed`, ``window=0``), times its slot size.  The planner keeps the
  resident bytes at most its budget at every step; with one block size (or planning units of one mix of
  sizes) ``resident`` is that peak exactly.
* ``staging``: extra pool slots for reads in flight.  A slot evicted at step q is reused only once the last
  step that read or used its block is assembled (at the latest step q-1), so with reads of several steps in
  flight evicted slots are held for a while (at most ``window`` steps: the bound counted here).  ``staging`` is what the room left inside the limit allows, never more than the plan
  would hold with ``window`` steps in flight (:func:`pool_slots`); the buffer runs fewer steps' reads at
  once when the pools are full, so it never needs more.
* ``batches``: :func:`live_batches`: ``prefetch`` assembled batches waiting in the queue, the one handed to the
  training loop and the one before it (a ``for`` loop holds it while it asks for the next), each
  :func:`batch_bytes` of the largest local batch.
* ``bookkeeping``: the per-block arrays the buffer keeps (slot and size class per block, the sample ->
  block map), which grow with the dataset.

``limit`` is the memory the plan was made for (:func:`memory_limit`): the planner's residency budget plus
:func:`reserve_bytes` (the live batches, one batch of reads in flight, the bookkeeping).  ``solar.plan`` takes the
reserve beyond :data:`PLAN_ALLOWANCE` from the budget the user gave (:func:`plan_budgets`), so
``limit <= budget + PLAN_ALLOWANCE``.  The buffer refuses to start, before reading anything, when
``total > limit``.

A node plan's ranks share one pool (:mod:`solar.memory.node`): :func:`plan_node_memory` sizes the pool,
the staging area of staged and received blocks and the shared window they live in.

Modules: :mod:`~solar.memory.slots` (size classes, slots per class), :mod:`~solar.memory.budget` (batches,
bookkeeping, reserve, limit, residency budget), :mod:`~solar.memory.rank` (:class:`MemoryNeed` of a rank),
:mod:`~solar.memory.node` (:class:`NodeMemory` of a node).  Applied to a schedule file:
:mod:`solar.schedule.memory`.
"""
from .budget import (BATCHES_HANDED_OUT, BLOCK_BOOKKEEPING, DEFAULT_IO_DEPTH, DEFAULT_PREFETCH, FIXED_OVERHEAD,
                     MAX_READS_IN_FLIGHT, PLAN_ALLOWANCE, batch_bytes, bookkeeping_bytes, check_reads_in_flight,
                     demand_batch_bytes, largest_batch, live_batches, max_local_batch, memory_limit, plan_budgets,
                     reserve_bytes)
from .node import NodeMemory, class_offsets, header_bytes, node_memory, plan_node_memory, staging_lists
from .rank import MemoryNeed, memory_need
from .slots import MAX_EXACT_CLASSES, largest_step_load, plan_pools, pool_slots, size_classes, slots_needed

__all__ = ["BATCHES_HANDED_OUT", "BLOCK_BOOKKEEPING", "DEFAULT_IO_DEPTH", "DEFAULT_PREFETCH", "FIXED_OVERHEAD",
           "MAX_EXACT_CLASSES", "MAX_READS_IN_FLIGHT", "PLAN_ALLOWANCE", "MemoryNeed", "NodeMemory", "batch_bytes",
           "bookkeeping_bytes", "check_reads_in_flight", "class_offsets", "demand_batch_bytes", "header_bytes",
           "largest_batch", "largest_step_load", "live_batches", "max_local_batch", "memory_limit", "memory_need",
           "node_memory", "plan_budgets", "plan_node_memory", "plan_pools", "pool_slots", "reserve_bytes",
           "size_classes", "slots_needed", "staging_lists"]
