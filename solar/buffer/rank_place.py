"""A rank's buffer: its plan (a :class:`~solar.schedule.RankPlan`) executed in pools of its own, in process memory
(:class:`~solar.buffer.pool.SlotPools`) or on a torch device (:class:`~solar.buffer.device_pools.DevicePools`).

The rank reads every block its plan loads; slots are taken from the pools when a step is booked and given back
when the plan evicts the block: a slot is reused only once the last step that touched its block (read it, or
used it in a batch) is assembled, so a step whose read is in flight or whose batch is being gathered never sees
its blocks overwritten.  That step is usually earlier than the eviction's own (a block evicted at step q was
last used at q - 1 in about 60% of evictions at f = 0.5, and more than 4 steps before in about a third), so
reads run further ahead in the same slots.  The per-step loop is the manager's
(:mod:`solar.buffer.manager`); this is the place it runs in.
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import Dict, Optional

import numpy as np

from ..io.reader import ReadStats
from ..layout.parts import extent_of, stored_once
from ..memory import BATCHES_HANDED_OUT, bookkeeping_bytes, live_batches, memory_need
from .book import step_need
from .pool import SlotPools
from .steps import Booked, BufferError, BufferTotals, StepBlocks, StepStats, check_distinct, read_outside
from .warmup import resident_at, used_before_evicted

#: Host bytes a device buffer's resume stages at once (its warm-up reads the resident blocks in parts this big).
WARMUP_STAGING = 256 << 20


class RankPlace:
    """The pools of rank ``rank_plan.rank`` and the bookkeeping of its plan; ``device``: None (process
    memory) or a torch device for :class:`~solar.buffer.device_pools.DevicePools`.  ``staging_limit`` (device
    pools; 0: none): host bytes of misses staged at once (steps whose reads are in flight; rows of their size
    class's width), a device plan's host budget (:attr:`~solar.schedule.Schedule.host_staging_bytes`): a step is
    booked once the staged steps before it leave it room (a step that alone takes more, which ``solar plan``
    refuses in the file's epochs, is staged alone)."""

    error_cls, what, kind = BufferError, "buffer manager", ""
    totals_cls = BufferTotals
    closed = ran_all = False  # (a node's place frees its window once; this one's pools go with it)

    def __init__(self, rank_plan, demand: Dict[str, np.ndarray], reader, *, budget: int, prefetch: int, start: int,
                 stop, keep_step_stats, io_depth: int, batch_bytes: int, device=None, staging_limit: int = 0,
                 memory_prefetch: Optional[int] = None):
        if prefetch < 1:
            raise BufferError(f"prefetch must be >= 1 step, got {prefetch}")
        self.plan, self.reader, self.rank = rank_plan, reader, rank_plan.rank
        self.sample_ptr = np.asarray(demand["sample_ptr"], dtype=np.int64)
        self.sample_blocks = np.asarray(demand["sample_blocks"], dtype=np.int64)
        self.block_nbytes = np.asarray(demand["block_nbytes"], dtype=np.int64)
        self.block_stored = np.asarray(demand.get("block_stored", demand["block_nbytes"]), dtype=np.int64)
        self.extent = extent_of(getattr(reader, "layout", None))  # parts of chunks: a chunk is read once a step
        if isinstance(keep_step_stats, bool) or not isinstance(keep_step_stats, int) or keep_step_stats < 0:
            raise BufferError(f"keep_step_stats must be an integer >= 0 (steps), got {keep_step_stats!r}")
        self.prefetch = int(prefetch)
        G = rank_plan.n_steps
        self.start, self.stop = int(start), G if stop is None else int(stop)
        if not 0 <= self.start <= self.stop <= G:
            raise BufferError(f"steps [{start}, {stop}) outside the schedule's [0, {G})")
        self.budget = int(budget)
        self.io_depth = steps_in_flight(reader, io_depth)
        self.memory, slots, self.class_of, class_bytes = rank_memory(
            rank_plan, demand, budget=self.budget, batch_bytes=batch_bytes,
            prefetch=self.prefetch if memory_prefetch is None else int(memory_prefetch), io_depth=self.io_depth)
        if device is None:  # faulted in beside the first reads, not before them (start-up counts in epoch 0)
            self.pools = SlotPools(class_bytes, slots, background=True)
        else:
            from .device_pools import DevicePools
            self.pools = DevicePools(class_bytes, slots, device)
        self.slot_of = np.full(self.block_nbytes.shape[0], -1, dtype=np.int64)
        # blocks the plan holds resident at a resume but evicts before using them again: never read (warmup.py)
        self._ghost = np.zeros(self.block_nbytes.shape[0], dtype=bool)
        #: a resume's warm-up: blocks read, blocks skipped (evicted before any use), storage bytes read
        self.warmup = {"blocks": 0, "skipped": 0, "bytes_read": 0}
        self._assembled = self.start - 1
        self._held: Dict[int, list] = {}   # step -> [(classes, slots)] evicted, free once that step is assembled
        # the last step booked that reads or uses each block (-1: none since the start; a resume's warm-up reads
        # are done before the first step is booked)
        self._touched = np.full(self.block_nbytes.shape[0], -1, dtype=np.int64)
        self._mark = np.full(self.block_nbytes.shape[0], -1, dtype=np.int64)  # step_need's scratch
        self._evicted = self.start - 1     # the last step whose evictions are done
        self._step = None                  # the plan's step being booked (its evictions done)
        self._alloc_for = None             # (step, load, views, pending): its slots taken, its reads not submitted
        self._refused = -1                 # the last step whose slots did not fit yet (waits for a step to assemble)
        self.staging_limit = int(staging_limit) if getattr(self.pools, "on_device", False) else 0
        self._staged: Dict[int, int] = {}  # step -> host bytes of its misses staged (device pools), until committed
        z = np.zeros(0, np.int64)  # step_need's machine code loaded now, not in the first step (nothing written)
        step_need(-1, self.sample_ptr, self.sample_blocks, z, z, self.slot_of, self.class_of, self.block_nbytes,
                  self._touched, self._mark)

    @property
    def resident_bytes(self) -> int:
        return self.pools.in_use()

    # ------------------------------------------------------------------ the manager's hooks
    def warm_up(self):
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
        # device pools stage their reads on the host: in parts of at most WARMUP_STAGING bytes, not all at once, as
        # many as this rank's resident bytes take, so read alone (a collective reader's ranks would make different
        # numbers of calls); a host buffer's one call is made by every rank, collective or not
        if not getattr(self.pools, "on_device", False):
            parts, read = [blocks], self.reader.read_blocks
        else:
            parts = _parts_of(blocks, self.pools.class_bytes[self.class_of[blocks]],  # (rows of their class's width)
                              min(WARMUP_STAGING, self.staging_limit or WARMUP_STAGING))
            read = getattr(self.reader, "read_alone", self.reader.read_blocks)
        for part in parts:
            views, pending = self._alloc(part)
            self.warmup["bytes_read"] += int(read(part, views).bytes_read)
            self._commit(pending)

    def poll(self, booked) -> bool:
        return False

    def ready(self, item: Booked) -> bool:
        return item.fut.done()

    def before_assemble(self, item: Booked):
        rs = item.fut.result()
        st = item.stats
        st.read_s = time.perf_counter() - item.t0
        st.bytes_read, st.n_reads = rs.bytes_read, rs.n_reads
        self._commit(item.pending)  # device pools: the step's misses into their slots, queued before its gather
        self._staged.pop(item.g, None)  # (its staging rows go back to the host allocator once the copies are done)

    def assembled(self, g: int):
        self._assembled = g
        for freed in self._held.pop(g, ()):
            self.pools.free_many(*freed)

    def drained(self) -> bool:
        return True

    def may_book(self, g: int, booked) -> bool:
        """Evict what step g evicts (once), then take the slots of its loads; False while the pools are full and
        steps in flight (``booked``: non-empty while any is booked or being assembled) will give slots back once
        assembled (none in flight: MemoryError, it cannot fit)."""
        if self._evicted < g:
            self._step = self.plan.step(g)
            self._evict(g, np.asarray(self._step.evict, np.int64))
            self._evicted = g
        if self._alloc_for is None:
            load = np.asarray(self._step.load, dtype=np.int64)
            if (self.slot_of[load] >= 0).any() or self._ghost[load].any():
                b = int(load[(self.slot_of[load] >= 0) | self._ghost[load]][0])
                raise BufferError(f"step {g}: the plan loads block {b}, which is already resident (damaged plan?)")
            check_distinct(g, load, "loads")
            staged = int(self.pools.class_bytes[self.class_of[load]].sum()) if self.staging_limit else 0
            if staged and booked and sum(self._staged.values()) + staged > self.staging_limit:
                self._refused = g  # the host staging is full: wait for the steps in flight to be committed
                return False
            try:
                self._alloc_for = (g, load) + self._alloc(load)
            except MemoryError:
                if not booked:
                    raise
                self._refused = g
                return False
            if staged:
                self._staged[g] = staged
        return True

    def book(self, g: int, io) -> Booked:
        _, load, views, pending = self._alloc_for
        self._alloc_for = None
        sp = self._step
        st = StepStats(g, samples=int(sp.samples.shape[0]))
        st.stored_bytes = stored_once(self.block_stored, self.extent, load)
        samples = np.asarray(sp.samples, dtype=np.int64)
        # where each block of this step lives now (a later step may move it; the old slot stays held); misses: the
        # loads this step uses (a plan on parts, or with neighbours, also loads blocks for later)
        nd = step_need(g, self.sample_ptr, self.sample_blocks, samples, load, self.slot_of, self.class_of,
                       self.block_nbytes, self._touched, self._mark)
        st.misses, st.bytes_loaded, st.hits, st.hit_bytes = nd.misses, nd.bytes_loaded, nd.hits, nd.hit_bytes
        extra = read_outside(self.reader, nd.missing, self.block_nbytes, st)
        blocks = StepBlocks(g, nd.blocks, nd.block_class, nd.block_slot, self.pools, self.block_nbytes, extra)
        t0 = time.perf_counter()
        # (a collective reader's call is made on every rank, also an empty one)
        if load.size or getattr(self.reader, "collective", False):
            fut = io.submit(self.reader.read_blocks, load, views)
        else:  # nothing to read: no hand-off to the I/O pool and back (a step of hits is ready now)
            fut = concurrent.futures.Future()
            fut.set_result(ReadStats())
        return Booked(g, samples, blocks, st, fut, t0, pending)

    def idle(self, q, booked, g_book: int, wait_s: float, idle_s: float) -> bool:
        """Nothing moved: wait for the oldest step's read (the queue has room for it) or for the consumer."""
        with q._cv:
            if q._closed:
                return False
            room = bool(booked) and booked[0].g - q._next_get < q.prefetch
            if not room:  # the consumer's get or release moves it on, unless booking became possible meanwhile
                # or the oldest assembly ended since the loop looked (its _wake came before this wait: not again)
                done = bool(q._making) and q._making[0][1].done()
                if not done and not (g_book < q.stop and q._may_read_ahead(g_book, booked)
                                     and self._refused != g_book):
                    q._cv.wait(0.5)
                return False
        making = q._making  # (or the oldest step in the assembly thread: its slots may go then)
        concurrent.futures.wait([booked[0].fut] + ([making[0][1]] if making else []),
                                return_when=concurrent.futures.FIRST_COMPLETED)
        return False

    def close(self, q):
        close = getattr(self.pools, "close", None)
        if close is not None:  # device pools: the copies queued on the device done; host pools: the populator stopped
            close()

    def fail(self, exc: BaseException):
        """Nothing to tell: no other rank waits for this one's buffer."""

    def failure(self, exc: BaseException) -> str:
        return f"prefetch of rank {self.rank} failed: {type(exc).__name__}: {exc}"

    def failed(self, exc: BaseException, err: BaseException):
        """Nothing to tell (see :meth:`fail`)."""

    # ------------------------------------------------------------------ slots
    def _evict(self, g: int, ev: np.ndarray):
        check_distinct(g, ev, "evicts")
        ghost = self._ghost[ev]
        if ghost.any():  # resident at a resume but never read (not used before this eviction): nothing to free
            self._ghost[ev[ghost]] = False
            ev = ev[~ghost]
        ev_slot = self.slot_of[ev]
        if (ev_slot < 0).any():
            b = int(ev[ev_slot < 0][0])
            raise BufferError(f"step {g}: the plan evicts block {b}, which is not resident (damaged plan?)")
        cls, last = self.class_of[ev].astype(np.int64), self._touched[ev]
        self.slot_of[ev] = -1
        now = last <= self._assembled  # no step in flight reads or uses the block
        if now.all():
            self.pools.free_many(cls, ev_slot)
            return
        self.pools.free_many(cls[now], ev_slot[now])
        for u in np.unique(last[~now]).tolist():  # held until step u is assembled
            mine = last == u
            self._held.setdefault(u, []).append((cls[mine], ev_slot[mine]))

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


def steps_in_flight(reader, io_depth: int) -> int:
    """Steps whose reads may be in flight at once: ``io_depth``, one for a collective reader (one call per step,
    in order)."""
    return 1 if getattr(reader, "collective", False) else max(1, int(io_depth))


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
        per = need.batches // live_batches(need.prefetch)
        best = (need.limit - need.resident - need.bookkeeping) // per - BATCHES_HANDED_OUT if per else 0
        if 1 <= best < need.prefetch:
            fix = f"lower prefetch to {best} (each queued batch is {hb(per)})"
        else:
            fix = f"lower the local batch or prefetch (each queued batch is {hb(per)}), or {fix}"
    raise BufferError(
        f"rank {rank} needs {hb(need.total)}: pools {hb(need.resident)} for the plan's resident blocks, "
        f"{need.prefetch} + {BATCHES_HANDED_OUT} batches {hb(need.batches)}, bookkeeping {hb(need.bookkeeping)}; "
        f"the plan was made for {hb(need.limit)} per rank: {fix}")
