"""The buffer manager: executes a plan (evict, load, verify hits) in a background thread ahead of the
training loop: the reads of up to ``io_depth`` steps in flight, and at most ``prefetch`` assembled batches
waiting (reads run up to ``prefetch + io_depth`` steps ahead; only assembled batches cost batch memory).

It consumes the schedule (a plan and the sample -> block map) and a reader; it never sees a dataset
object.  What a step's blocks become (a torch batch, for instance) is up to the ``assemble`` callable,
called in the prefetch thread while the step's blocks are resident::

    assemble(step, samples, lookup) -> anything      # lookup(block id) -> uint8 view

``lookup`` is a :class:`StepBlocks`: it also gives the step's blocks and their slots as
arrays, for assembly in one call per field (:mod:`solar.buffer.gather`).

With ``overlap``, steps are assembled in a thread of their own (one at a time, in order), which hands each
batch to the consumer, while the prefetch thread books the next steps and queues each step for assembly as
soon as its blocks are in: a step costs the longer of its booking and its assembly instead of their sum.
``finish(step, samples, out)`` (None: ``out`` as it is) runs in the prefetch thread on what ``assemble``
made before the consumer gets it (what stays in that thread: a transform, the start of a copy to a GPU).

One manager, one per-step loop (:meth:`BufferManager._loop`); where the pools live and who loads is its
*place*: a rank's pools in process or device memory (:class:`~solar.buffer.rank_place.RankPlace`), or a
node's pools in a shared-memory window, its loads split over the node's ranks and blocks sent between nodes
(:class:`~solar.buffer.node_place.NodePlace`, run by :class:`~solar.buffer.node_manager.NodeBufferManager`).

Memory (:mod:`solar.memory`, the model the planner shares): the slot pools (the plan's residency, plus slots for
reads in flight as far as the limit allows), ``prefetch`` assembled batches waiting in the
queue, the one the training loop holds and the one before it, and the per-block bookkeeping; checked against
the memory the plan was made for before the prefetch thread starts.  ``memory_prefetch``: size the pools as if
``prefetch`` were this (a loader process, whose queue is one batch shorter and whose training process receives
one batch ahead: :mod:`solar.loader.process`).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, Optional

import numpy as np

from ..errors import SolarError
from ..memory import DEFAULT_IO_DEPTH, DEFAULT_PREFETCH
from ..threads import start_threads
from .rank_place import RankPlace, rank_memory, steps_in_flight  # noqa: F401 - rank_memory: imported from here
from .steps import Booked, BufferError, BufferTotals, Closed, StepBlocks, StepStats  # noqa: F401 - likewise

POLL_MIN_S, POLL_MAX_S = 50e-6, 2e-3  # the backoff of a place that polls (node pools: counters of other ranks)


class BufferManager:
    """Executes rank ``rank_plan.rank``'s plan from global step ``start`` to ``stop``.

    ``rank_plan``: a :class:`~solar.schedule.RankPlan`; ``demand``: the schedule's
    ``demand()`` (sample_ptr, sample_blocks, block_nbytes); ``reader``: a
    :class:`~solar.io.BlockReader`.  Call :meth:`get` for steps in order; each
    result is handed out once.  Starting after step 0 first loads what the plan
    holds resident at ``start`` (resume).  ``keep_step_stats``: how many of the latest
    steps' :class:`StepStats` ``totals.per_step`` keeps (0: none); the totals are exact.

    ``budget``: the plan's residency budget (``Schedule.buffer_bytes``); ``batch_bytes``: bytes of
    one assembled batch (:func:`~solar.memory.batch_bytes`; 0 when ``assemble`` makes
    nothing sizeable).  ``memory`` (a :class:`~solar.memory.MemoryNeed`) is what the rank
    needs; when it exceeds the memory the plan was made for, the constructor raises :class:`BufferError` naming
    the figures, before anything is read.

    ``place``: where the pools live: None, process memory; a torch device (``"cuda"``, or ``"cpu"`` standing in
    for one in tests), :class:`~solar.buffer.device_pools.DevicePools` there: misses are read into host staging
    rows (at most ``staging_limit`` bytes of them at once where it is not 0: a device plan's host budget) and
    copied to their slots once read (before the step is assembled), and ``assemble`` gets the step's
    blocks on the device (its ``lookup.pools.on_device`` is True).  A node's shared pools:
    :class:`~solar.buffer.node_manager.NodeBufferManager`.
    """

    KEEP_STEP_STATS = 1024  # ~376 B each

    def __init__(self, rank_plan, demand: Dict[str, np.ndarray], reader, assemble: Callable[..., Any], *,
                 budget: int, prefetch: int = DEFAULT_PREFETCH, start: int = 0, stop: Optional[int] = None,
                 keep_step_stats: int = KEEP_STEP_STATS, verify: bool = True, fence: Optional[int] = None,
                 io_depth: int = DEFAULT_IO_DEPTH, batch_bytes: int = 0, place=None, staging_limit: int = 0,
                 memory_prefetch: Optional[int] = None, overlap: bool = False,
                 finish: Optional[Callable[[int, np.ndarray, Any], Any]] = None):
        self.verify = verify
        self._overlap = bool(overlap) and place is None  # (a device place's gathers are queued from one thread)
        # before the place: its pools are faulted in from then on, which holds thread starts up
        self._start_threads(reader, steps_in_flight(reader, io_depth), f"solar-io-r{rank_plan.rank}",
                            self._overlap)
        try:
            place = RankPlace(rank_plan, demand, reader, budget=budget, prefetch=prefetch, start=start, stop=stop,
                              keep_step_stats=keep_step_stats, io_depth=io_depth, batch_bytes=batch_bytes,
                              device=place, staging_limit=staging_limit, memory_prefetch=memory_prefetch)
        except BaseException:
            self._stop_io()
            raise
        self._begin(place, assemble, keep_step_stats, fence, finish)
        self._start()

    def _begin(self, place, assemble, keep_step_stats: int, fence: Optional[int], finish=None):
        """The state every place shares: the plan's range, the consumer's queue, the fence."""
        self.place, self.assemble, self.finish = place, assemble, finish
        self.plan, self.reader, self.memory, self.pools = place.plan, place.reader, place.memory, place.pools
        self.start, self.stop, self.prefetch, self.io_depth = place.start, place.stop, place.prefetch, place.io_depth
        self._error_cls, self._what = place.error_cls, place.what
        self.totals = place.totals_cls(per_step=deque(maxlen=int(keep_step_stats)))
        self._ready: Dict[int, Any] = {}
        self._stats: Dict[int, StepStats] = {}
        self._next_get = self.start
        self._waiting: Optional[int] = None  # under _cv: the step a consumer waits for in get (None: not waiting)
        # with ``fence`` = S the prefetch thread does not start a step g with g % S == 0 (an epoch's
        # first) before release(g): benchmarks use it so no epoch is read ahead before its timer starts
        self.fence = fence
        # fenced from the start too: a buffer built ahead of its first batch (SolarLoader.prepare) reads nothing
        # before release(start)
        self._released = self.start - 1 if fence else self.start
        self._cv = threading.Condition()
        self._error: Optional[BaseException] = None
        self._closed = False
        self._booked: Deque[Booked] = deque()  # steps booked, not yet assembled (oldest first)
        self._making: Deque = deque()  # with overlap: (Booked, Future) of the steps queued for the assembly thread

    def _start_threads(self, reader, io_depth: int, name: str, overlap: bool):
        """Start the threads the first step uses (the reader's workers, ``io_depth`` of the I/O pool, with
        ``overlap`` the assembly thread) now, not one at a time in the middle of that step (:mod:`solar.threads`).
        A failure is kept for the prefetch thread, which raises it as any other (to the consumer; a node's other
        ranks are told)."""
        from concurrent.futures import ThreadPoolExecutor
        self._io, self._stage, self._start_error = None, None, None
        try:
            start = getattr(reader, "start", None)  # a BlockReader's; test doubles may have none
            if start is not None:
                start()
            self._io = ThreadPoolExecutor(io_depth, thread_name_prefix=name)
            start_threads(self._io, io_depth)
            if overlap:
                self._stage = ThreadPoolExecutor(1, thread_name_prefix=name.replace("-io-", "-assemble-"))
                start_threads(self._stage, 1)
        except Exception as exc:  # noqa: BLE001 - see above
            self._start_error = exc

    def _stop_io(self):
        """End the I/O pool and the assembly thread: reads in flight and the assembly under way finish, assemblies
        still queued are dropped (after an error or at close nobody takes them; their slots go with the pools)."""
        for pool in (self._io, self._stage):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._io = self._stage = None

    def _start(self):
        self._thread = threading.Thread(target=self._run, name=f"solar-{self.place.kind}prefetch-r{self.place.rank}",
                                        daemon=True)
        try:
            self._thread.start()
        except BaseException:  # no prefetch thread: none of the threads started for it is left running
            self._stop_io()
            raise

    @property
    def resident_bytes(self) -> int:
        return self.place.resident_bytes

    @property
    def warmup(self) -> dict:
        """A resume's warm-up: blocks read, blocks skipped (evicted before any use), storage bytes read."""
        return self.place.warmup

    # --------------------------------------------------------------- consumer
    def get(self, g: int):
        """The assembled step ``g`` (waits for it; the wait is the step's stall time).  A failure (a read, an
        assembly, another rank's) is raised here for the first step not assembled before it: the batches assembled
        before it are handed out first, in order."""
        if g != self._next_get:
            raise self._error_cls(f"steps must be taken in order: asked for {g}, next is {self._next_get}")
        t0 = time.perf_counter()
        with self._cv:
            while g not in self._ready and self._error is None and not self._closed:
                self._waiting = g
                self._cv.wait(0.5)
            self._waiting = None
            if self._closed:
                raise self._error_cls(f"{self._what} is closed")
            if g not in self._ready:  # (a step assembled before a later one failed is still handed out first)
                raise self._error
            out = self._ready.pop(g)
            st = self._stats.pop(g)
            self._next_get = g + 1
            self._cv.notify_all()
        st.stall_s = time.perf_counter() - t0
        self.totals.add(st)
        return out

    def release(self, g: int):
        """Let the prefetch thread go past the fence at step ``g``."""
        with self._cv:
            self._released = max(self._released, g)
            self._cv.notify_all()

    def fail(self, exc: BaseException):
        """Tell whoever waits for this buffer (the other ranks of a node) that its consumer failed (``exc``: why)."""
        self.place.fail(exc)

    def close(self):
        """Stop the prefetch thread and free the pools (node pools: collective, see :class:`NodeBufferManager`)."""
        if self.place.closed:
            return
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()
        self.place.close(self)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None:
            self.fail(exc)
        self.close()

    # --------------------------------------------------------------- prefetch thread
    def _fenced(self, g: int) -> bool:
        return bool(self.fence) and g % self.fence == 0 and g > self._released

    def _may_read_ahead(self, g: int, booked) -> bool:
        """Under ``_cv``: step ``g`` may be booked as far as the consumer goes (reads of at most ``io_depth``
        steps in flight, up to ``prefetch + io_depth`` steps ahead of it, not past the fence)."""
        return len(booked) < self.io_depth and g - self._next_get < self.prefetch + self.io_depth \
            and not self._fenced(g)

    def _run(self):
        P, io = self.place, self._io
        try:
            if self._start_error is not None:
                raise self._start_error
            if self.start > 0:
                P.warm_up()
            self._loop(io)
            P.ran_all = True  # every step booked and finished: every transfer it takes part in is matched
        except Closed:
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            err = exc if isinstance(exc, SolarError) else self._error_cls(P.failure(exc))
            if err is not exc:  # a SolarError keeps its own cause
                err.__cause__ = exc
            P.failed(exc, err)
            if self._stage is not None:  # the steps queued for assembly (their reads are in: memory copies only) are
                self._stage.shutdown(wait=True)  # made first, each handing its batch over itself without finish:
            # the error is then the first step's not made
            with self._cv:
                self._error = err
                self._cv.notify_all()
        finally:
            self._stop_io()

    def _loop(self, io):
        """Step g goes through booking (its evictions, its slots, its reads submitted: up to ``io_depth`` steps
        in flight) and assembly (its reads in, the queue has room); the place says when each may happen."""
        P, booked = self.place, self._booked
        g_book = self.start
        wait, idle_since = POLL_MIN_S, None
        refused_at = None  # when the place first refused to book g_book (no room yet): its book_wait_s
        while True:
            if self._closed:
                raise Closed
            progressed = P.poll(booked)
            while self._making and self._making[0][1].done():  # assembled in the assembly thread
                self._made()
                progressed = True
            if booked and P.ready(booked[0]):  # assemble the oldest step once its blocks are in and there is room
                with self._cv:
                    room = booked[0].g - self._next_get < self.prefetch
                if room:
                    self._assemble(booked.popleft())
                    progressed = True
            if g_book >= self.stop and not booked and not self._making and P.drained():
                return
            if g_book < self.stop:  # book the next step: reads in flight and queue bounded, the place has room
                with self._cv:
                    ahead = self._may_read_ahead(g_book, booked)
                if ahead and P.may_book(g_book, booked or self._making):  # (steps whose slots will come back)
                    item = P.book(g_book, io)
                    if refused_at is not None:
                        item.stats.book_wait_s = time.perf_counter() - refused_at
                        refused_at = None
                    for f in item.wakes:  # a place that polls wakes as soon as its own reads are in
                        f.add_done_callback(self._wake)
                    booked.append(item)
                    item = None  # (not kept past its assembly: a device buffer's staged rows go with it)
                    g_book += 1
                    progressed = True
                elif ahead and refused_at is None:
                    refused_at = time.perf_counter()
            if progressed:
                wait, idle_since = POLL_MIN_S, None
                continue
            now = time.monotonic()
            idle_since = idle_since or now
            if P.idle(self, booked, g_book, wait, now - idle_since):
                idle_since = None  # waiting for this rank's own consumer: not a stall of the others
            wait = min(POLL_MAX_S, wait * 2)

    def _wake(self, _fut=None):
        with self._cv:
            self._cv.notify_all()

    def _assemble(self, item: Booked):
        self.place.before_assemble(item)
        if self._overlap:  # queued for the assembly thread; this one goes on booking (see _made)
            fut = self._stage.submit(self._make, item, self.finish is None)
            self._making.append((item, fut))
            fut.add_done_callback(self._wake)
            return
        self._hand_over(item, self._make(item, False))
        self.place.assembled(item.g)

    def _make(self, item: Booked, hand_over: bool):
        """``assemble`` on step ``item``'s blocks (timed: its ``assemble_s``); with ``hand_over``, queued for the
        consumer at once."""
        t1 = time.perf_counter()
        out = self.assemble(item.g, item.samples, item.blocks)
        item.stats.assemble_s = time.perf_counter() - t1
        if hand_over:  # (and not kept by the future: the batch's memory goes back as soon as the consumer drops it)
            self._hand_over(item, out)
            return None
        return out

    def _made(self):
        """Prefetch thread: the oldest step queued for the assembly thread is assembled (or its assembly raised:
        raised here); ``finish`` if the consumer does not have it yet, and its slots may go."""
        item, fut = self._making.popleft()
        out = fut.result()
        if self.finish is not None:
            self._hand_over(item, out)
        self.place.assembled(item.g)

    def _hand_over(self, item: Booked, out):
        """``finish`` on the assembled step (in the prefetch thread), queued for the consumer."""
        if self.finish is not None:
            out = self.finish(item.g, item.samples, out)
        with self._cv:
            self._ready[item.g], self._stats[item.g] = out, item.stats
            self._cv.notify_all()
