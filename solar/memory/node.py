"""A node's buffer memory: the ranks of a node plan share one pool and one staging area in one shared
window (pure: arrays in, numbers out; the window itself is :class:`~solar.buffer.node_pools.SharedPools`).

:func:`plan_node_memory` sizes both from the node's lists (the planner's summary and the runtime alike):
the pool gets its plan's peak per size class, the staging area (a step's staged and received blocks,
:func:`staging_lists`) its own, and slots for reads in flight are added as far as the node's limit
(``L`` x the per-rank :func:`~solar.memory.budget.memory_limit`) allows.  The window is a header of
per-rank counters (:func:`header_bytes`) followed by the slots of each class (:func:`class_offsets`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict

import numpy as np

from .budget import bookkeeping_bytes, live_batches, memory_limit
from .slots import pool_slots, size_classes, slots_needed


@dataclass(frozen=True)
class NodeMemory:
    """One node's buffer memory in bytes: ``resident`` (pool slots for the plan's residency),
    ``staging`` (slots for one step's staged and received blocks at the plan's peak), ``ahead``
    (extra slots of both, for reads in flight), ``batches`` and ``bookkeeping`` (its ranks' own),
    ``limit`` (ranks x the memory each rank's plan was made for), ``window`` (bytes of the
    shared window: header + pools).

    ``fits``: the parts the planner reserves (residency, batches, bookkeeping) are within
    ``limit``.  The staging area is not reserved by the node planner (it plans the pool's
    residency only), so it may take the total beyond ``limit``: ``over_limit`` says by how much.
    """

    resident: int
    staging: int
    ahead: int
    batches: int
    bookkeeping: int
    limit: int
    window: int

    @property
    def total(self) -> int:
        return self.resident + self.staging + self.ahead + self.batches + self.bookkeeping

    @property
    def fits(self) -> bool:
        return self.resident + self.batches + self.bookkeeping <= self.limit

    @property
    def over_limit(self) -> int:
        return max(0, self.total - self.limit)

    def to_dict(self) -> dict:
        return dict(asdict(self), total=self.total, over_limit=self.over_limit)


#: a node buffer's own per-block arrays on each rank (solar.buffer.node_place): the pool and staging slot of each
#: block (int64 each), who read it last and when (int32, int64), a scratch mark (bool)
NODE_BLOCK_BYTES = 8 + 8 + 4 + 8 + 1

# ---------------------------------------------------------------- the window's layout
HEADER_KINDS = 5          # counters per local rank (READ, DONE, FLAG, RECV, SHARED: solar.buffer.node_pools)
LINE = 8                  # int64 per counter: one 64-byte cache line each (one writer per line)
MESSAGE_BYTES = 256       # a failed rank's one-line message, per local rank
ALIGN = 4096


def header_bytes(L: int) -> int:
    """Bytes of the window's header for ``L`` ranks: their counters and failure messages, page-aligned."""
    raw = HEADER_KINDS * L * LINE * 8 + L * MESSAGE_BYTES
    return -(-raw // ALIGN) * ALIGN


def class_offsets(class_bytes: np.ndarray, slots: np.ndarray, start: int) -> np.ndarray:
    """int64[C]: where each class's slots start in the window (64-byte aligned, after ``start``)."""
    out = np.empty(np.shape(slots)[0], dtype=np.int64)
    pos = int(start)
    for c, (sz, n) in enumerate(zip(np.asarray(class_bytes).tolist(), np.asarray(slots).tolist())):
        out[c] = pos
        pos += -(-int(sz) * int(n) // 64) * 64
    return out


def staging_lists(stage: np.ndarray, stage_ptr: np.ndarray, recv: np.ndarray, recv_ptr: np.ndarray):
    """The staging area as load/evict lists: ``(load, load_ptr, evict, evict_ptr)``, each step's
    staged then received blocks loaded at g and evicted at g + 1 (pointers int64[G+1])."""
    stage, recv = np.asarray(stage, np.int64), np.asarray(recv, np.int64)
    G = int(np.shape(stage_ptr)[0] - 1)
    ns, nr = np.diff(stage_ptr), np.diff(recv_ptr)  # (G,) each
    step = np.concatenate([np.repeat(np.arange(G), ns), np.repeat(np.arange(G), nr)])  # (s+r,) step of each
    order = np.argsort(step, kind="stable")  # staged before received inside a step
    load = np.concatenate([stage, recv])[order]
    load_ptr = np.zeros(G + 1, dtype=np.int64)
    np.cumsum(ns + nr, out=load_ptr[1:])
    evict_ptr = np.concatenate([[0], load_ptr[:-1]]).astype(np.int64) if G else np.zeros(1, np.int64)
    return load, load_ptr, load[:int(evict_ptr[-1])], evict_ptr


def node_memory(class_of: np.ndarray, class_bytes: np.ndarray, main: tuple, staging: tuple, *, L: int,
                budget: int, batch: int, bookkeeping: int, prefetch: int, io_depth: int):
    """``(NodeMemory, slots int64[2C])``: slots of the pool (classes 0..C-1) and of the staging
    area (classes C..2C-1) for a node of ``L`` ranks.

    ``main``/``staging``: the ``(load, load_ptr, evict, evict_ptr)`` lists of the pool and of the
    staging area (:func:`staging_lists`).  Both get at least their plan's peak; slots held for
    ``io_depth - 1`` steps of reads in flight are added as far as the node's limit allows
    (``L`` x :func:`~solar.memory.budget.memory_limit` of the per-rank ``budget``).
    """
    C = int(np.shape(class_bytes)[0])
    cb2 = np.concatenate([class_bytes, class_bytes]).astype(np.int64)  # (2C,)
    base, want = [], []
    for lists in (main, staging):
        args = (class_of, C, np.asarray(lists[0], np.int64), lists[1], np.asarray(lists[2], np.int64), lists[3])
        b = slots_needed(*args, window=0)
        base.append(b)
        want.append(slots_needed(*args, window=max(0, int(io_depth) - 1)) if io_depth > 1 else b)
    base2, want2 = np.concatenate(base), np.concatenate(want)  # (2C,) each
    limit = L * memory_limit(int(budget), int(batch), int(bookkeeping))
    batches = L * live_batches(prefetch) * int(batch)
    keep = L * int(bookkeeping)
    slots = pool_slots(base2, want2, cb2, limit - batches - keep)
    resident = int((base2[:C] * class_bytes).sum())
    stage = int((base2[C:] * class_bytes).sum())
    ahead = int((slots * cb2).sum()) - resident - stage
    window = int(class_offsets(cb2, slots, header_bytes(L))[-1] + -(-int(cb2[-1] * slots[-1]) // 64) * 64) \
        if C else header_bytes(L)
    return NodeMemory(resident, stage, ahead, batches, keep, limit, window), slots


def plan_node_memory(lists: Dict[str, np.ndarray], block_nbytes: np.ndarray, n_samples: int, nnz: int, *, L: int,
                     budget: int, batch: int, prefetch: int, io_depth: int):
    """What a node running its plan needs: ``(NodeMemory, slots int64[2C], class_of int[B], class_bytes
    int64[C], main, staging)`` for the node's ``lists`` (:meth:`~solar.scheduler.node_plan.NodePlan.node`),
    ``main``/``staging`` the pool's and the staging area's ``(load, load_ptr, evict, evict_ptr)``."""
    B = int(np.shape(block_nbytes)[0])
    class_of, class_bytes = size_classes(np.asarray(block_nbytes, np.int64))
    main = (lists["load"], lists["load_ptr"], lists["evict"], lists["evict_ptr"])
    stg = staging_lists(lists["stage"], lists["stage_ptr"], lists["recv"], lists["recv_ptr"])
    keep = bookkeeping_bytes(int(n_samples), B, int(nnz)) + NODE_BLOCK_BYTES * B
    mem, slots = node_memory(class_of, class_bytes, main, stg, L=L, budget=budget, batch=batch, bookkeeping=keep,
                             prefetch=prefetch, io_depth=io_depth)
    return mem, slots, class_of, class_bytes, main, stg

