"""Node-shared pools: the memory of a node's buffer, and the pure functions that lay a node plan
out in it.

The ranks of one node (a :class:`~solar.scheduler.nodes.NodeMap` node, not necessarily a machine)
keep one pool of slots in an MPI shared-memory window (``MPI.Win.Allocate_shared`` on the node's
communicator, ``comm.Split(color=node)``); :class:`SharedPools` is that window: a header of
progress counters, then the pool's slots per size class, then the staging area's (blocks used at
one step only: a node plan's ``stage`` lists and the blocks received from other nodes).

Where each block goes is decided before anything runs, the same on every rank of the node
(:func:`assign_slots`: arrays in, arrays out), so the ranks never exchange a slot table; they share
only bytes and counters.  A freed slot is reused first-in first-out (the slot freed longest ago
first), and each step gets ``after[g]``: the step that every rank of the node must have assembled
before step g's reads may overwrite their slots (:func:`assign_slots`).  With more slots than the
plan's peak (room for reads in flight), FIFO reuse lets reads run ahead.

Pure parts (no I/O, no MPI, no clock): :func:`assign_slots`, the read splits of :data:`READ_SPLITS`.
How many slots of each class the pool and the staging area get, and the window's size and layout, are
the memory model's (:mod:`solar.memory.node`, shared with the planner's summary).
"""
from __future__ import annotations

import platform
import time
from typing import Callable, Dict, Optional, Sequence

import numba as nb
import numpy as np

from ..errors import SolarError
from ..memory.node import HEADER_KINDS, LINE, MESSAGE_BYTES, NodeMemory, class_offsets, header_bytes
from .pool import Populator, SlotPools, can_populate, pool_memory, populate


class NodeBufferError(SolarError):
    """A node-shared buffer cannot start or go on (one line, naming the rank, step or figure)."""


# ---------------------------------------------------------------- slot assignment
OK, NOT_RESIDENT, ALREADY_RESIDENT, NO_SLOT = 0, 1, 2, 3


@nb.njit(nogil=True, cache=True)
def _assign(load, load_ptr, evict, evict_ptr, class_of, slots, check_evict, by_use, used, slot_out, after_out, err):
    """FIFO slot assignment of a node's lists (see :func:`assign_slots`); ``err`` int64[3] out:
    (status, step, block or class)."""
    G = load_ptr.shape[0] - 1
    loaded_at = np.full(class_of.shape[0], -1, np.int64)  # (by_use) step of each resident block's load
    C = slots.shape[0]
    off = np.zeros(C + 1, np.int64)
    for c in range(C):
        off[c + 1] = off[c] + slots[c]
    q_slot = np.empty(off[C], np.int64)  # ring of free slots per class, at off[c] .. off[c+1]
    q_step = np.empty(off[C], np.int64)  # the step that freed each (-1: never used)
    head = np.zeros(C, np.int64)
    count = slots.copy()
    for c in range(C):
        for i in range(slots[c]):
            q_slot[off[c] + i] = i
            q_step[off[c] + i] = -1
    cur = np.full(class_of.shape[0], -1, np.int64)  # slot of each resident block
    for g in range(G):
        a = -1
        for i in range(evict_ptr[g], evict_ptr[g + 1]):
            b = evict[i]
            c = class_of[b]
            s = cur[b]
            if s < 0:
                if check_evict:
                    err[0], err[1], err[2] = NOT_RESIDENT, g, b
                    return
                continue
            cur[b] = -1
            pos = off[c] + (head[c] + count[c]) % slots[c]
            q_slot[pos] = s
            # free once step g-1 is assembled everywhere; knowing the uses: once the block's last use (or its
            # load, unused) is
            q_step[pos] = max(loaded_at[b], used[i]) + 1 if by_use else g
            count[c] += 1
        for i in range(load_ptr[g], load_ptr[g + 1]):
            b = load[i]
            c = class_of[b]
            if cur[b] >= 0:
                err[0], err[1], err[2] = ALREADY_RESIDENT, g, b
                return
            if count[c] == 0:
                err[0], err[1], err[2] = NO_SLOT, g, c
                return
            pos = off[c] + head[c]
            head[c] = (head[c] + 1) % slots[c]
            count[c] -= 1
            cur[b] = q_slot[pos]
            slot_out[i] = q_slot[pos]
            loaded_at[b] = g
            if q_step[pos] - 1 > a:
                a = q_step[pos] - 1
        after_out[g] = a


def assign_slots(class_of: np.ndarray, slots: np.ndarray, load: np.ndarray, load_ptr: np.ndarray,
                 evict: np.ndarray, evict_ptr: np.ndarray, check_evict: bool = True, last_use=None):
    """``(slot int64[K], after int64[G])``: the slot of each entry of ``load`` and, per step, the
    last step whose assembly must be over on every rank of the node before that step's loads are
    written (-1: none).

    ``class_of`` int32[B] size class of each block, ``slots`` int64[C] slots per class;
    ``load``/``evict`` block ids, CSR over G steps (``*_ptr`` int64[G+1]); a step evicts before it
    loads.  Freed slots are handed out first-in first-out.  A slot freed at step q held a block
    the plan no longer needs at q, so it may be overwritten once step q-1 is assembled:
    ``after[g]`` = max(q - 1) over the slots step g's loads take.  ``check_evict=False`` ignores
    evictions of blocks that are not resident (staging lists that start mid-plan).

    ``last_use``: int64[len(evict)], the last step before each eviction at which the node used the block
    (:func:`last_uses`; -1: never), where known: a slot freed at step q is then free once that step is
    assembled (or the block's load, if it was not used since), often long before q - 1, so reads run
    further ahead of the slowest rank.  A damaged plan
    (evicting a block that is not resident, loading one that is) or too few slots raise
    :class:`NodeBufferError` naming the step.
    """
    load = np.ascontiguousarray(load, dtype=np.int64)
    evict = np.ascontiguousarray(evict, dtype=np.int64)
    G = int(np.shape(load_ptr)[0] - 1)
    slot = np.full(load.shape[0], -1, dtype=np.int64)
    after = np.full(G, -1, dtype=np.int64)
    err = np.zeros(3, dtype=np.int64)
    used = np.zeros(0, np.int64) if last_use is None else np.ascontiguousarray(last_use, np.int64)
    if last_use is not None and used.shape != evict.shape:
        raise ValueError(f"last_use has {used.shape[0]} entries for {evict.shape[0]} evictions")
    _assign(load, np.ascontiguousarray(load_ptr, np.int64), evict, np.ascontiguousarray(evict_ptr, np.int64),
            np.ascontiguousarray(class_of, np.int64), np.ascontiguousarray(slots, np.int64), bool(check_evict),
            last_use is not None, used, slot, after, err)
    status, g, x = (int(v) for v in err)
    if status == NOT_RESIDENT:
        raise NodeBufferError(f"step {g}: the plan evicts block {x}, which is not resident (damaged plan?)")
    if status == ALREADY_RESIDENT:
        raise NodeBufferError(f"step {g}: the plan loads block {x}, which is already resident (damaged plan?)")
    if status == NO_SLOT:
        raise NodeBufferError(f"step {g}: no free slot of size class {x} ({int(slots[x])} slots): the pools are "
                              f"smaller than the plan's residency")
    return slot, after


@nb.njit(nogil=True, cache=True)
def _last_uses(evict, evict_ptr, items, items_ptr, sample_ptr, sample_blocks, direct, used_at, out):
    """Raise ``out[i]`` to the last step before eviction i at which ``items`` (per step: samples, whose blocks
    ``sample_ptr``/``sample_blocks`` list; ``direct``: blocks) use the evicted block."""
    G = evict_ptr.shape[0] - 1
    used_at[:] = -1
    for g in range(G):
        for i in range(evict_ptr[g], evict_ptr[g + 1]):
            if used_at[evict[i]] > out[i]:
                out[i] = used_at[evict[i]]
        if g + 1 < items_ptr.shape[0]:
            for t in range(items_ptr[g], items_ptr[g + 1]):
                x = items[t]
                if direct:
                    used_at[x] = g
                else:
                    for k in range(sample_ptr[x], sample_ptr[x + 1]):
                        used_at[sample_blocks[k]] = g


def last_uses(evict: np.ndarray, evict_ptr: np.ndarray, n_blocks: int, sample_ptr: np.ndarray,
              sample_blocks: np.ndarray, ranks: Sequence[tuple] = (), direct: Sequence[tuple] = ()) -> np.ndarray:
    """int64[len(evict)]: for each eviction (CSR over steps, a step evicting before anything is used), the
    last step before it at which the node used the block (-1: never).  Uses: every ``(samples, samples_ptr)``
    of ``ranks`` (a step's samples' blocks) and every ``(blocks, blocks_ptr)`` of ``direct`` (a node's sends,
    say).  Pure; memory: the output and one int64 per block, whatever the plan's length."""
    evict = np.ascontiguousarray(evict, np.int64)
    evict_ptr = np.ascontiguousarray(evict_ptr, np.int64)
    out = np.full(evict.shape[0], -1, np.int64)
    used_at = np.empty(int(n_blocks), np.int64)
    sp, sb = np.ascontiguousarray(sample_ptr, np.int64), np.ascontiguousarray(sample_blocks, np.int64)
    for items, ptr, is_direct in [(a, p, False) for a, p in ranks] + [(a, p, True) for a, p in direct]:
        _last_uses(evict, evict_ptr, np.ascontiguousarray(items), np.ascontiguousarray(ptr, np.int64), sp, sb,
                   is_direct, used_at, out)
    return out


# ---------------------------------------------------------------- who reads what
def split_spread(stored: np.ndarray, L: int) -> np.ndarray:
    """int64[L+1]: the ranks of a node read contiguous runs of the step's reads (sorted by block),
    balanced by stored bytes: rank j reads ``[ptr[j], ptr[j+1])``."""
    stored = np.asarray(stored, np.int64)
    k = stored.shape[0]
    if k == 0:
        return np.zeros(L + 1, dtype=np.int64)
    csum = np.cumsum(stored)  # (k,)
    targets = csum[-1] * np.arange(1, L, dtype=np.int64) // L  # (L-1,) byte boundaries
    cut = np.searchsorted(csum, targets, side="right")  # (L-1,) first read of each later rank
    return np.concatenate([[0], cut, [k]]).astype(np.int64)


def _owners_of_runs(ptr: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(ptr.shape[0] - 1, dtype=np.int64), np.diff(ptr))


def owners_spread(blocks: np.ndarray, stored: np.ndarray, needs: Sequence[np.ndarray], L: int) -> np.ndarray:
    """Contiguous runs balanced by stored bytes (:func:`split_spread`), whoever needs the blocks."""
    return _owners_of_runs(split_spread(stored, L))


def owners_leader(blocks: np.ndarray, stored: np.ndarray, needs: Sequence[np.ndarray], L: int) -> np.ndarray:
    """Local rank 0 reads everything, the others nothing."""
    return np.zeros(np.shape(blocks)[0], dtype=np.int64)


def owners_need(blocks: np.ndarray, stored: np.ndarray, needs: Sequence[np.ndarray], L: int) -> np.ndarray:
    """Each block is read by a rank whose samples use it at this step: a block one rank needs, by that rank
    (as with a buffer of its own); a block several need, by the one of them with the fewest stored bytes to read
    so far, in block order; a block none needs now (kept for later), likewise among all ranks.  A rank then
    waits for another only where they share a block (see :class:`~solar.buffer.node_place.NodePlace`)."""
    blocks = np.asarray(blocks, np.int64)
    k = blocks.shape[0]
    if L == 1 or k == 0:
        return np.zeros(k, dtype=np.int64)
    users = np.zeros((L, k), dtype=np.bool_)  # rank j uses block i at this step
    for j, n in enumerate(needs):
        n = np.asarray(n, np.int64)
        pos = np.minimum(np.searchsorted(blocks, n), k - 1)
        users[j, pos[blocks[pos] == n]] = True
    owner = np.empty(k, dtype=np.int64)
    _greedy_owners(users, np.asarray(stored, np.int64), owner)
    return owner


@nb.njit(nogil=True, cache=True)
def _greedy_owners(users, stored, owner):
    """``owner`` out: the one user of a block with one; else the least loaded of its users (of all ranks
    for a block with none), in block order, loads counted from the blocks with one user first."""
    L, k = users.shape
    load = np.zeros(L, np.int64)
    for i in range(k):
        owner[i] = -1
        n = 0
        for j in range(L):
            if users[j, i]:
                n += 1
                owner[i] = j
        if n == 1:
            load[owner[i]] += stored[i]
        else:
            owner[i] = -1
    for i in range(k):
        if owner[i] >= 0:
            continue
        anyone = False
        for j in range(L):
            anyone = anyone or users[j, i]
        best = -1
        for j in range(L):
            if (users[j, i] or not anyone) and (best < 0 or load[j] < load[best]):
                best = j
        owner[i] = best
        load[best] += stored[i]


#: who reads which of a node's reads at a step: ``fn(blocks, stored, needs, L) -> int64[k]``, the local rank
#: that reads each of the step's ``k`` reads (``blocks`` ascending, ``stored`` their stored bytes, ``needs[j]``
#: the blocks local rank j's samples use at the step).  Pure: every rank of the node computes the same.
READ_SPLITS: Dict[str, Callable[..., np.ndarray]] = {"need": owners_need, "spread": owners_spread,
                                                     "leader": owners_leader}
DEFAULT_READ_SPLIT = "need"


def get_read_split(name: str) -> Callable[..., np.ndarray]:
    try:
        return READ_SPLITS[name]
    except KeyError:
        raise NodeBufferError(f"unknown read split {name!r}; valid: {', '.join(READ_SPLITS)}") from None


# ---------------------------------------------------------------- memory
def check_node_memory(m: NodeMemory, node: int, L: int) -> None:
    """NodeBufferError when what the planner reserves (pool, batches, bookkeeping) is over the node's limit."""
    if m.fits:
        return
    from ..layout.summary import human_bytes as hb
    raise NodeBufferError(
        f"node {node} needs {hb(m.resident + m.batches + m.bookkeeping)} before staging: pool {hb(m.resident)}, "
        f"batches {hb(m.batches)}, bookkeeping {hb(m.bookkeeping)}; its {L} ranks' plans were made for "
        f"{hb(m.limit)}: re-plan with a smaller budget per rank or lower prefetch")


# ---------------------------------------------------------------- the window
# each local rank's counters (the header's size: solar.memory.node)
READ, DONE, FLAG, RECV, SHARED = range(HEADER_KINDS)
RUNNING, FAILED, CLOSED = 0, 1, 2             # values of FLAG


def node_comm(comm, node: int):
    """The communicator of this rank's node (``comm.Split(color=node)``, ranks in ``comm`` order);
    on a real cluster the NodeMap comes from the topology and this equals
    ``Split_type(COMM_TYPE_SHARED)``.  Collective over ``comm``."""
    return comm.Split(color=int(node), key=comm.Get_rank())


def _barriers_needed() -> bool:
    """Plain stores and loads of aligned int64 are ordered enough on x86-64 (TSO); elsewhere the
    counters need ``Win.Sync`` memory barriers."""
    return platform.machine().lower() not in ("x86_64", "amd64")


class SharedPools:
    """One node's window: progress counters and the pools (``pools``: a :class:`SlotPools` of 2C
    classes, the pool's then the staging area's, over the window's memory).

    Collective over ``ncomm`` (the node's communicator; None: a node of one rank, private
    memory).  Local rank 0 allocates the whole window, the others map it
    (``Win.Shared_query(0)``).  Each rank faults the window's pages into its own page tables from a
    :class:`~solar.buffer.pool.Populator` thread while the buffer already runs, its own share and the others'
    side by side, lowest addresses first
    (where the OS cannot, it writes zeros to its share at start, as before).  Counters
    (:data:`READ`, :data:`SHARED`, :data:`RECV`, :data:`DONE`, :data:`FLAG`) have one writer each: local rank j
    writes row j.  They start at ``init`` (the step before the first), DONE at ``done_init`` where
    given (a resume: lower until the rank's warm-up reads are in).
    """

    def __init__(self, ncomm, class_bytes2: np.ndarray, slots2: np.ndarray, window_bytes: int, init: int = -1,
                 done_init: Optional[int] = None):
        self.ncomm = ncomm
        self.L = ncomm.Get_size() if ncomm is not None else 1
        self.local = ncomm.Get_rank() if ncomm is not None else 0
        self.win = None
        self._sync = False
        self.populator = None
        hb = header_bytes(self.L)
        lazy = can_populate()  # pages faulted in by a thread of their own (Linux >= 5.14)
        if ncomm is None:
            buf = pool_memory(int(window_bytes), fault_in=not lazy)
        else:
            from mpi4py import MPI
            self.win = MPI.Win.Allocate_shared(int(window_bytes) if self.local == 0 else 0, 1, comm=ncomm)
            mem, _ = self.win.Shared_query(0)
            buf = np.frombuffer(mem, dtype=np.uint8)
            if buf.shape[0] < window_bytes:
                raise NodeBufferError(f"shared window of {buf.shape[0]} bytes, {window_bytes} asked")
            self.win.Lock_all(MPI.MODE_NOCHECK)
            self._sync = _barriers_needed() and MPI.Query_thread() == MPI.THREAD_MULTIPLE
            if _barriers_needed() and not self._sync:
                raise NodeBufferError("node-shared buffers on this CPU need MPI_THREAD_MULTIPLE (memory barriers "
                                      "from the prefetch thread); mpi4py.rc.thread_level is lower")
        self.buf = buf
        # (HEADER_KINDS, L, LINE): counter k of local rank j is header[k, j, 0]
        self.header = buf[:HEADER_KINDS * self.L * LINE * 8].view(np.int64).reshape(HEADER_KINDS, self.L, LINE)
        msg0 = HEADER_KINDS * self.L * LINE * 8
        # (L, MESSAGE_BYTES): local rank j's failure message
        self.messages = buf[msg0:msg0 + self.L * MESSAGE_BYTES].reshape(self.L, MESSAGE_BYTES)
        offsets = class_offsets(class_bytes2, slots2, hb)
        self.pools = SlotPools(class_bytes2, slots2, memory=buf, offsets=offsets)
        self.window_bytes = int(window_bytes)
        # each rank faults in its share of the pages and maps the other ranks' shares too, so that few reads or
        # gathers of the run fault on a page (first touch of a page another process brought in: 2.8 GB/s
        # against 6.0 GB/s after, on the development VM).  Where the OS can, a thread does it while the buffer
        # already runs (a start-up of 0.28-0.36 s on 200 MB shares saved); it only maps pages, never writes
        # them, so a rank's reads into a slot meanwhile are safe.  Else each rank writes zeros to its share now.
        share = -(-(buf.shape[0] - hb) // self.L)
        lo = hb + self.local * share
        hi = min(buf.shape[0], lo + share)
        if lazy:
            self.populator = Populator([buf[lo:hi], buf[hb:lo], buf[hi:]])
        elif ncomm is not None and not populate(buf, lo, hi):  # (one rank's private memory: MAP_POPULATE did it)
            buf[lo:hi] = 0
        self.messages[self.local, :] = 0
        self.header[READ, self.local, 0] = int(init)
        self.header[DONE, self.local, 0] = int(init if done_init is None else done_init)
        self.header[RECV, self.local, 0] = int(init)
        self.header[SHARED, self.local, 0] = int(init)
        self.header[FLAG, self.local, 0] = RUNNING
        self.barrier()
        if self.L > 1 and not lazy:
            populate(buf, 0, lo)
            populate(buf, hi, buf.shape[0])

    def stop_populating(self):
        """Stop faulting pages in (between chunks) and wait for the thread."""
        if self.populator is not None:
            self.populator.close()
            self.populator = None

    def barrier(self):
        if self.ncomm is not None:
            from ..mpi import sleep_barrier
            self.sync()
            sleep_barrier(self.ncomm)
            self.sync()

    def sync(self):
        if self.win is not None and self._sync:
            self.win.Sync()

    def publish(self, kind: int, value: int):
        """Write this rank's counter ``kind`` (after the data it covers is in place)."""
        self.sync()
        self.header[kind, self.local, 0] = value

    def counters(self, kind: int) -> np.ndarray:
        """int64[L]: every local rank's counter ``kind`` (a copy)."""
        out = self.header[kind, :, 0].copy()
        self.sync()
        return out

    def fail(self, message: str):
        raw = message.encode("utf-8", "replace")[:MESSAGE_BYTES - 1]
        self.messages[self.local, :] = 0
        self.messages[self.local, :len(raw)] = np.frombuffer(raw, np.uint8)
        self.publish(FLAG, FAILED)

    def message(self, j: int) -> str:
        row = self.messages[j].tobytes()
        return row.split(b"\0", 1)[0].decode("utf-8", "replace")

    def free(self, poll_s: float = 0.002) -> bool:
        """Collective over the node: wait (sleeping) for every rank to arrive, then free the window.
        Gives up (returns False, the window left to the process's end) when a rank of the node marks
        itself failed meanwhile: it will not arrive."""
        self.stop_populating()
        if self.win is None:
            return True
        self.sync()
        req = self.ncomm.Ibarrier()
        while not req.Test():
            if (self.counters(FLAG) == FAILED).any():
                return False
            time.sleep(poll_s)
        self.pools = None
        self.header = self.messages = self.buf = None
        self.win.Unlock_all()
        self.win.Free()
        self.win = None
        return True
