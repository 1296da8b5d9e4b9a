"""The memory a schedule's ranks (or nodes) need when they run it: :mod:`solar.memory` applied to a
schedule file (``solar inspect plan.h5``, ``solar plan``, ``solar bench``)."""
from __future__ import annotations

import numpy as np

from ..errors import SolarError
from ..memory import (DEFAULT_IO_DEPTH, DEFAULT_PREFETCH, batch_bytes, bookkeeping_bytes, demand_batch_bytes,
                      max_local_batch, memory_need, plan_node_memory)


def schedule_memory(schedule, rank: int, layout=None, prefetch: int = DEFAULT_PREFETCH,
                    io_depth: int = DEFAULT_IO_DEPTH, keep: bool = True):
    """:class:`~solar.memory.MemoryNeed` of rank ``rank`` running ``schedule`` (a :class:`~solar.schedule.Schedule`)
    with ``prefetch`` queued batches; batches sized from ``layout`` (default: the layout the schedule
    stores, else bounded from its sample -> block map).  ``keep``: leave the rank's slice cached."""
    d, batch = _schedule_batch(schedule, layout)
    books = bookkeeping_bytes(np.shape(d["sample_ptr"])[0] - 1, np.shape(d["block_nbytes"])[0],
                              np.shape(d["sample_blocks"])[0])
    return memory_need(schedule.rank(rank, keep=keep), np.asarray(d["block_nbytes"], np.int64),
                       residency_budget=schedule.memory_budget, batch=batch, bookkeeping=books, prefetch=prefetch,
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


def schedule_node_memory(schedule, node: int, layout=None, prefetch: int = DEFAULT_PREFETCH,
                         io_depth: int = DEFAULT_IO_DEPTH, keep: bool = True):
    """:class:`~solar.memory.NodeMemory` of node ``node`` of a node plan (format version 6)
    running with ``prefetch`` queued batches per rank; batches sized as in :func:`schedule_memory`."""
    d, batch = _schedule_batch(schedule, layout)
    L = schedule.nodes.ranks_per_node
    lists = schedule.node_plan(node * L, keep=keep).node(node)
    return plan_node_memory(lists, d["block_nbytes"], np.shape(d["sample_ptr"])[0] - 1, np.shape(d["sample_blocks"])[0],
                            L=L, budget=schedule.memory_budget, batch=batch, prefetch=prefetch, io_depth=io_depth)[0]


def schedule_memory_summary(schedule) -> dict:
    """``MemoryNeed.to_dict()`` of the rank of ``schedule`` that needs most, with the default prefetch
    (``solar inspect plan.h5``, ``solar plan``); ``{"error": ...}`` if a rank's slice cannot be read."""
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
