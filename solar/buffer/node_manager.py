"""The buffer manager run in a node's shared pools (:class:`~solar.buffer.node_place.NodePlace`): one instance
per rank, the ranks of a node sharing one pool in an MPI shared-memory window, nodes sending each other blocks
as planned.  The per-step loop and the consumer interface are :class:`~solar.buffer.BufferManager`'s.

Construction and ``close`` are collective over ``comm``.  Collective readers (``mpiio`` with
``collective=True``) are refused.  ``node_plan``: a :class:`~solar.scheduler.node_plan.NodePlan` in
memory, or a :class:`~solar.schedule.schedule.NodeRankPlan` read from a schedule file (format
version 6, what :class:`~solar.loader.SolarLoader` passes).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import numpy as np

from ..memory import DEFAULT_IO_DEPTH, DEFAULT_PREFETCH
from .manager import BufferManager
from .node_pools import DEFAULT_READ_SPLIT
from .node_place import NODE_KEYS, NodePlace, NodeStepStats, NodeTotals, PeerFailed  # noqa: F401 - imported from here


class NodeBufferManager(BufferManager):
    """Executes rank ``rank``'s part of ``node_plan`` from global step ``start`` to ``stop``, its node's
    pool shared with the node's other ranks.  Same consumer interface as
    :class:`~solar.buffer.BufferManager`: :meth:`get` (steps in order), :meth:`release`,
    :meth:`close`, :meth:`fail`, ``totals`` (a :class:`NodeTotals`).

    ``demand``: ``{"sample_ptr", "sample_blocks", "block_nbytes", "block_stored"}`` (a layout's);
    ``reader``: an independent :class:`~solar.io.BlockReader`; ``assemble(step, samples, lookup)``,
    ``overlap`` and ``finish`` as for BufferManager.  ``comm``: the job's communicator (``comm.Get_size()`` =
    ``node_plan.nodes.world_size``, rank ``rank``); None only for a plan of one rank.  ``budget``:
    the per-rank residency budget the plan was made for (the node's is ``ranks_per_node`` x it);
    ``batch_bytes``: one assembled batch (0 when ``assemble`` makes nothing sizeable).  The node's
    memory (:func:`~solar.memory.node_memory`) is checked against ranks x the per-rank
    limit before anything is read.  ``read_split``: a name of
    :data:`~solar.buffer.node_pools.READ_SPLITS` (default ``need``: each rank reads what its own samples use).  ``timeout``: seconds without progress while
    waiting for other ranks before raising :class:`NodeBufferError` (None: wait as long as they
    run; a failed rank is noticed either way).  Collective over ``comm``; every rank passes the
    same plan, ``start`` and ``stop``.
    """

    def __init__(self, node_plan, rank: int, demand: Dict[str, np.ndarray], reader, assemble: Callable[..., Any], *,
                 comm=None, budget: int, prefetch: int = DEFAULT_PREFETCH, start: int = 0,
                 stop: Optional[int] = None, io_depth: int = DEFAULT_IO_DEPTH, batch_bytes: int = 0,
                 read_split: str = DEFAULT_READ_SPLIT, keep_step_stats: int = BufferManager.KEEP_STEP_STATS,
                 fence: Optional[int] = None, timeout: Optional[float] = None, overlap: bool = False,
                 finish: Optional[Callable[[int, np.ndarray, Any], Any]] = None):
        from ..mpi import agree
        err = None
        self._overlap = bool(overlap)
        self._start_threads(reader, io_depth, f"solar-node-io-r{rank}", self._overlap)
        try:
            place = NodePlace(node_plan, rank, demand, reader, comm, budget, prefetch, start, stop, io_depth,
                              batch_bytes, read_split, keep_step_stats, timeout)
            self._begin(place, assemble, keep_step_stats, fence, finish)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
            err = exc
        try:
            agree(comm, err)  # before any collective: a rank that failed here must not leave the others waiting
            place.connect()
        except BaseException:  # this rank's failure, another rank's (agree), or connecting: no thread left running
            self._stop_io()
            raise
        self.pools = place.pools
        self._start()

    @property
    def shm(self):
        """The node's window (:class:`~solar.buffer.node_pools.SharedPools`; None once closed)."""
        return self.place.shm

    @property
    def peak_resident_bytes(self) -> int:
        return self.place.peak_resident_bytes

    @property
    def warmup_bytes_read(self) -> int:
        return self.place.warmup_bytes_read
