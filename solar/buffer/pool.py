"""Preallocated slot pools, one per block size class: the buffer's memory."""
from __future__ import annotations

import mmap
import threading

import numpy as np

from .. import aligned

#: Pools of at least this many bytes are mapped with their pages faulted in at once.
POPULATE_MIN = 8 << 20


def pool_memory(nbytes: int, fault_in: bool = True) -> np.ndarray:
    """uint8[nbytes] for one pool, its pages faulted in now where the OS can (Linux
    ``MAP_POPULATE``): on the development VM 768 MiB took 0.33 s that way against 1.3-3 s of
    page faults (numpy's ``empty``, 4 KiB or huge pages) spread over the first epoch's reads.
    Small pools, and systems without ``MAP_POPULATE``, get :func:`solar.aligned.empty` (touched lazily; on a
    page boundary like a mapping's, so that copies out of the slots run at full speed).
    ``fault_in=False``: an anonymous mapping whose pages are not faulted in yet (a :class:`Populator` does it)."""
    flag = getattr(mmap, "MAP_POPULATE", 0) if fault_in else 0
    if nbytes >= POPULATE_MIN and (flag or not fault_in):
        try:
            m = mmap.mmap(-1, int(nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flag)
        except (OSError, ValueError):
            pass
        else:
            return np.frombuffer(m, dtype=np.uint8)  # the array keeps the mapping alive
    return aligned.empty(int(nbytes))  # slots on page boundaries, as an mmap's (see solar.aligned)


MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable without touching their bytes
#: Bytes a background populator faults in per call (:class:`Populator`).
POPULATE_CHUNK = 4 << 20
_CAN_POPULATE = None


def populate(buf: np.ndarray, lo: int, hi: int) -> bool:
    """Fault the pages of ``buf[lo:hi]`` into this process's page tables, writable, without writing them
    (Linux ``madvise(MADV_POPULATE_WRITE)``; the range widened to whole pages).  False where the system
    cannot (another OS, an older kernel): the pages then fault in at first touch, as before."""
    import ctypes
    import sys
    if not sys.platform.startswith("linux") or hi <= lo:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    page = mmap.PAGESIZE
    start = (int(buf.ctypes.data) + int(lo)) // page * page
    end = int(buf.ctypes.data) + int(hi)
    return madvise(start, end - start, MADV_POPULATE_WRITE) == 0


def can_populate() -> bool:
    """True where :func:`populate` works here (Linux >= 5.14), tried once on a page of its own."""
    global _CAN_POPULATE
    if _CAN_POPULATE is None:
        probe = np.frombuffer(mmap.mmap(-1, mmap.PAGESIZE), dtype=np.uint8)
        _CAN_POPULATE = populate(probe, 0, probe.shape[0])
    return _CAN_POPULATE


class Populator:
    """Faults pools' pages in from a thread of its own, lowest addresses first and the pools side by side (the
    order their slots are handed out in), :data:`POPULATE_CHUNK` bytes a call (``madvise`` without the GIL).
    Reads that reach a page first fault it in themselves; what this saves is the start-up waiting for all of
    it.  :meth:`close` stops it (between chunks) and waits for it."""

    def __init__(self, arrays, chunk: int = POPULATE_CHUNK):
        self._stop = threading.Event()
        flat = [a.reshape(-1) for a in arrays if a.size]
        self._thread = threading.Thread(target=self._run, args=(flat, int(chunk)), name="solar-populate", daemon=True)
        self._thread.start()

    def _run(self, flat, chunk: int):
        sizes = [a.shape[0] for a in flat]
        k = max(1, -(-sum(sizes) // chunk))
        for i in range(k):
            for a, z in zip(flat, sizes):
                if self._stop.is_set():
                    return
                populate(a, z * i // k, z * (i + 1) // k)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def close(self):
        self._stop.set()
        self._thread.join()


class SlotPools:
    """``slots[c]`` fixed-size slots of ``class_bytes[c]`` bytes each, allocated once.

    ``view(c, i)`` is a writable uint8 view of slot i of class c.  Each class keeps
    its free slots as a stack in an int64 array (``top[c]`` of them free, lowest
    index on top), so :meth:`alloc_many`/:meth:`free_many` take a whole step's
    blocks in a few numpy calls per class.  The pools are the plan's peak (sized by
    :mod:`solar.memory`), resident from the start (:func:`pool_memory`).

    ``memory``: a uint8 buffer to carve the pools from instead (a shared-memory window of
    node-shared pools, :mod:`solar.buffer.node_pools`): class c starts at ``offsets[c]``
    (default: packed one after the other), ``slots[c] * class_bytes[c]`` bytes each.
    ``background``: (own memory only) the pages are faulted in by a :class:`Populator` thread while the
    buffer already runs, where the OS can (else at once, as without it); :meth:`close` stops it.
    """

    def __init__(self, class_bytes: np.ndarray, slots: np.ndarray, memory=None, offsets=None,
                 background: bool = False):
        self.class_bytes = np.asarray(class_bytes, dtype=np.int64)
        self.slots = np.asarray(slots, dtype=np.int64)
        sizes = [int(n) * int(sz) for sz, n in zip(self.class_bytes, self.slots)]
        self.populator = None
        lazy = memory is None and background and sum(sizes) >= POPULATE_MIN and can_populate()  # small: at once
        if memory is None:
            mem = [pool_memory(z, fault_in=not lazy) for z in sizes]
        else:
            buf = np.frombuffer(memory, dtype=np.uint8)
            starts = np.cumsum([0, *sizes[:-1]]) if offsets is None else np.asarray(offsets, np.int64)
            if sizes and int(starts[-1]) + sizes[-1] > buf.shape[0]:
                raise ValueError(f"pools of {sum(sizes)} bytes do not fit a buffer of {buf.shape[0]} bytes")
            mem = [buf[int(a):int(a) + z] for a, z in zip(starts.tolist(), sizes)]
        # (slots[c], class_bytes[c]) per class: slot i of class c is arrays[c][i]
        self.arrays = [m.reshape(int(n), int(sz)) for m, sz, n in zip(mem, self.class_bytes, self.slots)]
        # stack[c][:top[c]] are the free slots of class c, the next to hand out last
        self.stack = [np.arange(int(n) - 1, -1, -1, dtype=np.int64) for n in self.slots]
        self.top = [int(n) for n in self.slots]
        if lazy:
            self.populator = Populator(self.arrays)

    def close(self):
        """Stop faulting pages in (if a :class:`Populator` still runs)."""
        if self.populator is not None:
            self.populator.close()

    @property
    def capacity_bytes(self) -> int:
        return int((self.class_bytes * self.slots).sum())

    def alloc(self, c: int) -> int:
        return int(self.alloc_many(np.array([c], np.int64))[0])

    def free(self, c: int, i: int) -> None:
        self.free_many(np.array([c], np.int64), np.array([i], np.int64))

    def alloc_many(self, classes: np.ndarray) -> np.ndarray:
        """int64[k]: one free slot for each entry of ``classes`` (int[k]); all or nothing.

        Raises MemoryError (nothing allocated) when a class has too few free slots.
        """
        classes = np.asarray(classes, dtype=np.int64)
        out = np.empty(classes.shape[0], dtype=np.int64)
        groups = self._groups(classes)
        for c, pos in groups:
            if pos.shape[0] > self.top[c]:
                raise MemoryError(f"no free slot of {int(self.class_bytes[c])} bytes "
                                  f"({int(self.slots[c])} in the pool, {pos.shape[0]} asked, {self.top[c]} free)")
        for c, pos in groups:
            t = self.top[c]
            out[pos] = self.stack[c][t - pos.shape[0]:t][::-1]
            self.top[c] = t - pos.shape[0]
        return out

    def free_many(self, classes: np.ndarray, slots: np.ndarray) -> None:
        """Return slots ``slots[i]`` of class ``classes[i]`` (int[k] each) to their pools."""
        slots = np.asarray(slots, dtype=np.int64)
        for c, pos in self._groups(np.asarray(classes, dtype=np.int64)):
            t = self.top[c]
            if t + pos.shape[0] > self.slots[c]:
                raise ValueError(f"freeing {pos.shape[0]} slots of class {c}: more than were in use")
            self.stack[c][t:t + pos.shape[0]] = slots[pos]
            self.top[c] = t + pos.shape[0]

    def _groups(self, classes: np.ndarray) -> list:
        """``[(class, positions int64[...]), ...]`` of the classes present, in class order."""
        if classes.shape[0] == 0:
            return []
        first = int(classes[0])
        if (classes == first).all():  # the common case: one size class
            return [(first, np.arange(classes.shape[0]))]
        order = np.argsort(classes, kind="stable")
        cuts = np.flatnonzero(np.diff(classes[order])) + 1
        return [(int(classes[p[0]]), p) for p in np.split(order, cuts)]

    def view(self, c: int, i: int) -> np.ndarray:
        return self.arrays[c][i]

    def in_use(self) -> int:
        return int(sum((int(n) - t) * int(sz) for n, t, sz in zip(self.slots, self.top, self.class_bytes)))
