"""The per-rank buffer manager: executes a rank's plan (evict, load, verify hits) in a
background thread ahead of the training loop: the reads of up to ``io_depth`` steps in
flight, and at most ``prefetch`` assembled batches waiting (reads run up to
``prefetch + io_depth`` steps ahead; only assembled batches cost batch memory).

It consumes the schedule (its rank slice and sample -> block map) and a reader;
it never sees a dataset object.  What a step's blocks become (a torch batch, for
instance) is up to the ``assemble`` callable, called in the prefetch thread while
the step's blocks are resident::

    assemble(step, samples, lookup) -> anything      # lookup(block id) -> uint8 view

``lookup`` is a :class:`StepBlocks`: it also gives the step's blocks and their slots as
arrays, for assembly in one call per field (:mod:`solar.buffer.gather`).

Memory (:mod:`solar.memory`, the model the planner shares): the slot pools (the plan's residency, plus slots for
reads in flight as far as the limit allows), ``prefetch`` assembled batches waiting in the
queue and the one the training loop holds, and the per-block bookkeeping; checked against the
memory the plan was made for before the prefetch thread starts.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Optional

import numpy as np

from ..errors import SolarError
from ..memory import DEFAULT_IO_DEPTH, DEFAULT_PREFETCH, bookkeeping_bytes, memory_need
from .pool import SlotPools
from .warmup import resident_at, used_before_evicted


class BufferError(SolarError):
    pass


@dataclass
class StepStats:
    """What one step cost (filled by the prefetch thread, ``stall_s`` by the consumer)."""

    step: int
    samples: int = 0
    hits: int = 0                # blocks the plan said were resident, and were
    hit_bytes: int = 0           # their decoded bytes
    misses: int = 0              # blocks loaded for this step
    bytes_loaded: int = 0        # decoded bytes loaded
    bytes_read: int = 0          # storage bytes read (coalescing gaps included)
    stored_bytes: int = 0        # stored bytes of the blocks loaded (what the plan counts: no gaps)
    n_reads: int = 0
    read_s: float = 0.0
    assemble_s: float = 0.0
    stall_s: float = 0.0         # time the training loop waited for this step
    plan_violations: int = 0     # blocks the plan called hits that were not resident (read anyway)


def step_blocks(sample_ptr: np.ndarray, sample_blocks: np.ndarray, samples: np.ndarray) -> np.ndarray:
    """int64[m] ascending: the distinct blocks of ``samples`` (their CSR rows gathered)."""
    lo, hi = sample_ptr[samples], sample_ptr[samples + 1]
    counts = hi - lo
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    run_start = np.cumsum(counts) - counts  # (n,) where each sample's run begins in the output
    pos = np.arange(total, dtype=np.int64) + np.repeat(lo - run_start, counts)
    return np.unique(sample_blocks[pos])


class _Closed(Exception):
    """The consumer closed the buffer while the prefetch thread waited for room."""


@dataclass
class BufferTotals:
    """Exact sums over every step taken; ``per_step``: the :class:`StepStats` of the last
    ``keep_step_stats`` steps only (a ring: memory stays flat however long the run)."""

    steps: int = 0
    samples: int = 0
    hits: int = 0
    hit_bytes: int = 0
    misses: int = 0
    bytes_loaded: int = 0
    bytes_read: int = 0
    stored_bytes: int = 0
    n_reads: int = 0
    read_s: float = 0.0
    assemble_s: float = 0.0
    stall_s: float = 0.0
    plan_violations: int = 0
    per_step: Deque[StepStats] = field(default_factory=deque)

    def add(self, s: StepStats):
        self.steps += 1
        for k in ("samples", "hits", "hit_bytes", "misses", "bytes_loaded", "bytes_read", "stored_bytes", "n_reads",
                  "read_s", "assemble_s", "stall_s", "plan_violations"):
            setattr(self, k, getattr(self, k) + getattr(s, k))
        if self.per_step.maxlen != 0:
            self.per_step.append(s)


class StepQueue:
    """The consumer half shared by the buffer managers: assembled steps handed out in order.

    The subclass's prefetch thread fills ``_ready``/``_stats`` under ``_cv``; ``get`` waits for
    the next step (the wait is its stall time), ``release`` lifts the epoch fence.  ``_error_cls``
    is the exception class ``get`` raises once the manager is closed.
    """

    _error_cls = SolarError
    _what = "buffer"
    _waiting: Optional[int] = None  # under _cv: the step a consumer waits for in get (None: not waiting)

    def get(self, g: int):
        """The assembled step ``g`` (waits for it; the wait is the step's stall time)."""
        if g != self._next_get:
            raise self._error_cls(f"steps must be taken in order: asked for {g}, next is {self._next_get}")
        t0 = time.perf_counter()
        with self._cv:
            while g not in self._ready and self._error is None and not self._closed:
                self._waiting = g
                self._cv.wait(0.5)
            self._waiting = None
            if self._error is not None:
                raise self._error
            if self._closed:
                raise self._error_cls(f"{self._what} is closed")
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

    def _fenced(self, g: int) -> bool:
        return bool(self.fence) and g % self.fence == 0 and g > self._released


class BufferManager(StepQueue):
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
    needs; when it exceeds the memory the plan was made for, the constructor raises :class:`BufferError` naming the figures, before anything is read.

    ``place``: where the pools live: None, process memory; a torch device (``"cuda"``, or ``"cpu"`` standing in
    for one in tests), :class:`~solar.buffer.device_pools.DevicePools` there: misses are read into host staging
    rows and copied to their slots once read (before the step is assembled), and ``assemble`` gets the step's
    blocks on the device (its ``lookup.pools.on_device`` is True).
    """

    KEEP_STEP_STATS = 1024  # ~376 B each
    _error_cls = BufferError
    _what = "buffer manager"

    def __init__(self, rank_plan, demand: Dict[str, np.ndarray], reader, assemble: Callable[..., Any], *,
                 budget: int, prefetch: int = DEFAULT_PREFETCH, start: int = 0, stop: Optional[int] = None,
                 keep_step_stats: int = KEEP_STEP_STATS, verify: bool = True, fence: Optional[int] = None,
                 io_depth: int = DEFAULT_IO_DEPTH, batch_bytes: int = 0, place=None):
        if prefetch < 1:
            raise BufferError(f"prefetch must be >= 1 step, got {prefetch}")
        self.plan, self.reader, self.assemble = rank_plan, reader, assemble
        self.sample_ptr = np.asarray(demand["sample_ptr"], dtype=np.int64)
        self.sample_blocks = np.asarray(demand["sample_blocks"], dtype=np.int64)
        self.block_nbytes = np.asarray(demand["block_nbytes"], dtype=np.int64)
        self.block_stored = np.asarray(demand.get("block_stored", demand["block_nbytes"]), dtype=np.int64)
        if isinstance(keep_step_stats, bool) or not isinstance(keep_step_stats, int) or keep_step_stats < 0:
            raise BufferError(f"keep_step_stats must be an integer >= 0 (steps), got {keep_step_stats!r}")
        self.prefetch, self.verify = int(prefetch), verify
        G = rank_plan.n_steps
        self.start, self.stop = int(start), G if stop is None else int(stop)
        if not 0 <= self.start <= self.stop <= G:
            raise BufferError(f"steps [{start}, {stop}) outside the schedule's [0, {G})")
        self.budget = int(budget)
        # steps whose reads may be in flight at once (collective readers: one call per step, in order)
        self.io_depth = 1 if getattr(reader, "collective", False) else max(1, int(io_depth))
        self.memory, slots, self.class_of, class_bytes = rank_memory(
            rank_plan, demand, budget=self.budget, batch_bytes=batch_bytes, prefetch=self.prefetch,
            io_depth=self.io_depth)
        if place is None:
            self.pools = SlotPools(class_bytes, slots)
        else:
            from .device_pools import DevicePools
            self.pools = DevicePools(class_bytes, slots, place)
        self.slot_of = np.full(self.block_nbytes.shape[0], -1, dtype=np.int64)
        # blocks the plan holds resident at a resume but evicts before using them again: never read (warmup.py)
        self._ghost = np.zeros(self.block_nbytes.shape[0], dtype=bool)
        #: a resume's warm-up: blocks read, blocks skipped (evicted before any use), storage bytes read
        self.warmup = {"blocks": 0, "skipped": 0, "bytes_read": 0}
        self.totals = BufferTotals(per_step=deque(maxlen=keep_step_stats))
        self._ready: Dict[int, Any] = {}
        self._stats: Dict[int, StepStats] = {}
        self._next_get = self.start
        # with ``fence`` = S the prefetch thread does not start a step g with g % S == 0 (an epoch's
        # first) before release(g): benchmarks use it so no epoch is read ahead before its timer starts
        self.fence = fence
        # fenced from the start too: a buffer built ahead of its first batch (SolarLoader.prepare) reads nothing
        # before release(start)
        self._released = self.start - 1 if fence else self.start
        self._cv = threading.Condition()
        self._error: Optional[BaseException] = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"solar-prefetch-r{rank_plan.rank}", daemon=True)
        self._thread.start()

    # --------------------------------------------------------------- consumer: StepQueue
    def close(self):
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()
        close = getattr(self.pools, "close", None)
        if close is not None:  # device pools: the copies queued on the device done before the pools may go
            close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def resident_bytes(self) -> int:
        return self.pools.in_use()

    # --------------------------------------------------------------- prefetch
    # Step g goes through two stages in the prefetch thread: _book (evict, allocate, submit the
    # read; up to io_depth steps in flight) and _finish (wait for the read, verify, assemble).
    # A slot evicted at step q is reused only after step q-1 is assembled (_held), so a step
    # whose read is in flight never sees its blocks overwritten.
    def _run(self):
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor
        io = ThreadPoolExecutor(self.io_depth, thread_name_prefix=f"solar-io-r{self.plan.rank}")
        inflight = deque()
        self._assembled = self.start - 1
        self._held: Dict[int, tuple] = {}  # step -> (classes, slots) evicted there, freed later
        try:
            if self.start > 0:
                self._warm_up()
            for g in range(self.start, self.stop):
                while True:  # book g once the reads may run that far ahead; else assemble the oldest
                    with self._cv:
                        if self._closed:
                            return
                        book = (len(inflight) < self.io_depth and not self._fenced(g)
                                and g - self._next_get < self.prefetch + self.io_depth)
                        ready = self._may_assemble(inflight)
                        if not book and not ready:
                            self._cv.wait(0.5)
                            continue
                    if book and not (ready and inflight[0][1].done()):
                        break
                    self._finish(inflight.popleft())  # the consumer may be waiting for it
                inflight.append(self._book(g, io, inflight))
            while inflight:
                self._finish_oldest(inflight)
        except _Closed:
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            with self._cv:
                self._error = exc if isinstance(exc, SolarError) else BufferError(
                    f"prefetch of rank {self.plan.rank} failed: {type(exc).__name__}: {exc}")
                if self._error is not exc:  # a SolarError keeps its own cause
                    self._error.__cause__ = exc
                self._cv.notify_all()
        finally:
            io.shutdown(wait=True)

    def _may_assemble(self, inflight) -> bool:
        """Under ``_cv``: the oldest step in flight may be assembled (at most ``prefetch`` assembled
        batches wait for the consumer; reads run up to ``io_depth`` steps further ahead)."""
        return bool(inflight) and inflight[0][0] - self._next_get < self.prefetch

    def _finish_oldest(self, inflight):
        """Assemble the oldest step in flight once the queue has room for it."""
        with self._cv:
            while not self._may_assemble(inflight):
                if self._closed:
                    raise _Closed
                self._cv.wait(0.5)
        self._finish(inflight.popleft())

    def _warm_up(self):
        """Load what the plan holds resident when step ``start`` begins (a resume), except the blocks it evicts
        before using them again: those stay resident without bytes (``_ghost``) until the plan evicts them."""
        p, B = self.plan, self.block_nbytes.shape[0]
        blocks = resident_at(p.load, p.load_ptr, p.evict, p.evict_ptr, self.start, B)
        need = used_before_evicted(blocks, self.start, samples=p.samples, samples_ptr=p.samples_ptr, evict=p.evict,
                                   evict_ptr=p.evict_ptr, sample_ptr=self.sample_ptr,
                                   sample_blocks=self.sample_blocks, n_blocks=B)
        self._ghost[blocks[~need]] = True
        blocks = blocks[need]
        self.warmup = {"blocks": int(blocks.shape[0]), "skipped": int((~need).sum()), "bytes_read": 0}
        # device pools stage their reads on the host: in parts of at most WARMUP_STAGING bytes, not all at once
        parts = [blocks] if not getattr(self.pools, "on_device", False) else \
            _parts_of(blocks, self.block_nbytes[blocks], WARMUP_STAGING)
        for part in parts:
            views, pending = self._alloc(part)
            self.warmup["bytes_read"] += int(self.reader.read_blocks(part, views).bytes_read)
            self._commit(pending)

    def _alloc(self, blocks: np.ndarray):
        """Slots for ``blocks`` (distinct, not resident; all or nothing: MemoryError leaves
        nothing allocated); returns ``(views, pending)``: uint8 views, ``block_nbytes`` long, for the reader
        (the slots themselves; host staging rows for device pools), and what :meth:`_commit` copies into the
        device slots once the reads are done (None in process memory)."""
        cls = self.class_of[blocks]
        slots = self.pools.alloc_many(cls)
        self.slot_of[blocks] = slots
        if getattr(self.pools, "on_device", False):
            return self.pools.stage(cls, slots, self.block_nbytes[blocks])
        arrays, nb, cb = self.pools.arrays, self.block_nbytes[blocks].tolist(), self.pools.class_bytes
        return [arrays[c][i] if n == cb[c] else arrays[c][i][:n]
                for c, i, n in zip(cls.tolist(), slots.tolist(), nb)], None

    def _commit(self, pending) -> None:
        if pending:
            self.pools.commit(pending)

    def _step_blocks(self, samples: np.ndarray) -> np.ndarray:
        return step_blocks(self.sample_ptr, self.sample_blocks, samples)

    def _book(self, g: int, io, inflight):
        sp = self.plan.step(g)
        st = StepStats(g, samples=int(sp.samples.shape[0]))
        ev = np.asarray(sp.evict, np.int64)
        _check_distinct(g, ev, "evicts")
        ghost = self._ghost[ev]
        if ghost.any():  # resident at a resume but never read (not used before this eviction): nothing to free
            self._ghost[ev[ghost]] = False
            ev = ev[~ghost]
        ev_slot = self.slot_of[ev]
        if (ev_slot < 0).any():
            b = int(ev[ev_slot < 0][0])
            raise BufferError(f"step {g}: the plan evicts block {b}, which is not resident (damaged plan?)")
        freed = (self.class_of[ev].astype(np.int64), ev_slot)
        self.slot_of[ev] = -1
        if self._assembled >= g - 1:
            self.pools.free_many(*freed)
        else:
            self._held[g] = freed
        load = np.asarray(sp.load, dtype=np.int64)
        if (self.slot_of[load] >= 0).any() or self._ghost[load].any():
            b = int(load[(self.slot_of[load] >= 0) | self._ghost[load]][0])
            raise BufferError(f"step {g}: the plan loads block {b}, which is already resident (damaged plan?)")
        _check_distinct(g, load, "loads")
        while True:  # pools full: finish in-flight steps (their held slots come free); none left: it fits
            try:
                views, pending = self._alloc(load)
                break
            except MemoryError:
                if not inflight:
                    raise
                self._finish_oldest(inflight)
        st.misses, st.bytes_loaded = int(load.shape[0]), int(self.block_nbytes[load].sum())
        st.stored_bytes = int(self.block_stored[load].sum())
        samples = np.asarray(sp.samples, dtype=np.int64)
        # where each block of this step lives now (a later step may move it; the old slot stays held)
        need = self._step_blocks(samples) if samples.size else np.unique(load)
        slot = self.slot_of[need]
        missing = need[slot < 0]
        st.hits = int(need.shape[0] - load.shape[0] - missing.shape[0])
        st.hit_bytes = int(self.block_nbytes[need].sum() - st.bytes_loaded - self.block_nbytes[missing].sum())
        extra = {}
        if missing.size:  # the plan called these hits: count it, read them so nothing wrong is delivered
            st.plan_violations = int(missing.shape[0])
            bufs = [np.empty(int(self.block_nbytes[b]), np.uint8) for b in missing.tolist()]
            self.reader.read_blocks(missing, bufs)
            extra = dict(zip(missing.tolist(), bufs))
        blocks = StepBlocks(g, need, self.class_of[need].astype(np.int64), slot, self.pools, self.block_nbytes, extra)
        t0 = time.perf_counter()
        fut = io.submit(self.reader.read_blocks, load, views)
        return g, fut, samples, blocks, st, t0, pending

    def _finish(self, item):
        g, fut, samples, blocks, st, t0, pending = item
        rs = fut.result()
        st.read_s = time.perf_counter() - t0
        st.bytes_read, st.n_reads = rs.bytes_read, rs.n_reads
        self._commit(pending)  # device pools: the step's misses into their slots, queued before its gather
        t1 = time.perf_counter()
        out = self.assemble(g, samples, blocks)
        st.assemble_s = time.perf_counter() - t1
        self._assembled = g
        held = self._held.pop(g + 1, None)
        if held is not None:
            self.pools.free_many(*held)
        with self._cv:
            self._ready[g], self._stats[g] = out, st
            self._cv.notify_all()


#: Host bytes a device buffer's resume stages at once (its warm-up reads the resident blocks in parts this big).
WARMUP_STAGING = 256 << 20


def _parts_of(blocks: np.ndarray, nbytes: np.ndarray, limit: int) -> list:
    """``blocks`` in consecutive parts of at most ``limit`` bytes each (``nbytes`` per block; a larger block alone)."""
    out, start, acc = [], 0, 0
    for i, n in enumerate(nbytes.tolist()):
        if acc and acc + n > limit:
            out.append(blocks[start:i])
            start, acc = i, 0
        acc += n
    out.append(blocks[start:])
    return [p for p in out if p.shape[0]] or [blocks]


def rank_memory(rank_plan, demand: Dict[str, np.ndarray], *, budget: int, batch_bytes: int, prefetch: int,
                io_depth: int):
    """``(MemoryNeed, slots int64[C], class_of int32[B], class_bytes int64[C])`` of a rank running
    ``rank_plan`` (:func:`solar.memory.memory_need`); BufferError if it is over the limit."""
    keep = bookkeeping_bytes(np.shape(demand["sample_ptr"])[0] - 1, np.shape(demand["block_nbytes"])[0],
                             np.shape(demand["sample_blocks"])[0])
    out = memory_need(rank_plan, np.asarray(demand["block_nbytes"], np.int64), residency_budget=int(budget),
                      batch=int(batch_bytes), bookkeeping=keep, prefetch=int(prefetch), io_depth=int(io_depth))
    _check_memory(out[0], rank_plan.rank)
    return out


def _check_memory(need, rank: int) -> None:
    """BufferError when rank ``rank``'s :class:`~solar.memory.MemoryNeed` is over its limit:
    the figures, and the largest ``prefetch`` that fits (if any)."""
    if need.fits:
        return
    from ..layout.summary import human_bytes as hb
    fix = "re-plan with a smaller budget per rank (the residency is planned within it)"
    if need.batches:
        per = need.batches // (need.prefetch + 1)
        best = (need.limit - need.resident - need.bookkeeping) // per - 1 if per else 0
        if 1 <= best < need.prefetch:
            fix = f"lower prefetch to {best} (each queued batch is {hb(per)})"
        else:
            fix = f"lower the local batch or prefetch (each queued batch is {hb(per)}), or {fix}"
    raise BufferError(
        f"rank {rank} needs {hb(need.total)}: pools {hb(need.resident)} for the plan's resident blocks, "
        f"{need.prefetch} + 1 batches {hb(need.batches)}, bookkeeping {hb(need.bookkeeping)}; the plan was "
        f"made for {hb(need.limit)} per rank: {fix}")


def _check_distinct(g: int, blocks: np.ndarray, verb: str) -> None:
    """BufferError when a step's plan names a block twice in one list (a damaged plan)."""
    if blocks.shape[0] > 1:
        srt = np.sort(blocks)
        dup = np.flatnonzero(srt[1:] == srt[:-1])
        if dup.size:
            raise BufferError(f"step {g}: the plan {verb} block {int(srt[dup[0]])} twice (damaged plan?)")


class StepBlocks:
    """The blocks a step's samples need and where each lives, fixed when the step was booked.

    ``blocks`` int64[m] ascending; ``block_class``/``block_slot`` int64[m]: the slot in
    ``pools`` (slot -1: not in the pools, held in ``extra`` instead: blocks the plan
    wrongly called hits, read on the spot).  Called with a block id it returns that
    block's decoded bytes (uint8 view, ``block_nbytes`` long), as the ``lookup`` of
    :class:`BufferManager`'s ``assemble`` callable.
    """

    __slots__ = ("step", "blocks", "block_class", "block_slot", "pools", "block_nbytes", "extra")

    def __init__(self, step, blocks, block_class, block_slot, pools, block_nbytes, extra):
        self.step, self.blocks, self.block_class, self.block_slot = step, blocks, block_class, block_slot
        self.pools, self.block_nbytes, self.extra = pools, block_nbytes, extra

    @property
    def in_pools(self) -> bool:
        """Every block lives in a pool slot (none read outside the plan)."""
        return not self.extra

    def __call__(self, b: int) -> np.ndarray:
        j = int(np.searchsorted(self.blocks, b))
        if j < self.blocks.shape[0] and self.blocks[j] == b:
            if self.block_slot[j] >= 0:
                arr = self.pools.arrays[int(self.block_class[j])][int(self.block_slot[j])]
                return arr[:int(self.block_nbytes[b])]
            return self.extra[int(b)]
        raise BufferError(f"step {self.step}: block {b} is not among the step's blocks")
