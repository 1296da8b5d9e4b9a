"""A bounded, thread-safe LRU of open files, shared by a reader's threads.

A many-file dataset (one HDF5 file per sample: CosmoFlow, DeepCAM) has more
files than a process may hold open (``ulimit -n``, often 1024).  A reader
therefore keeps at most ``capacity`` files open: a file is opened on its first
read, the least recently used idle file is closed when another must be opened,
and an evicted file is reopened when it is needed again.

``capacity`` defaults to :func:`open_file_budget`: half of the soft
``RLIMIT_NOFILE``, and never closer than :data:`FD_RESERVE` descriptors to it
(the rest is left to the rest of the process: Python, HDF5, MPI, torch,
sockets), at least :data:`MIN_OPEN`.

A handle in use is pinned (``with cache.use(key) as fd:``): it is never closed
while a thread reads through it; a thread that needs a new file while every
slot is pinned waits until one is released.  A thread pins one handle at a
time, or pins more only with ``acquire(key, wait=False)``, which never waits, so
with ``capacity >= 1`` every wait ends.  If the operating system still refuses
an open (EMFILE/ENFILE: something else in the process holds descriptors), idle
files are closed, ``capacity`` shrinks to what is open, and the open is tried
again; with no idle file left the error propagates.
"""
from __future__ import annotations

import errno
import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, Hashable

FD_RESERVE = 64
"""Descriptors of the soft limit left to the rest of the process."""
MIN_OPEN = 4
"""Smallest default capacity, however low the limit."""
MAX_OPEN = 1 << 16
"""Largest default capacity (an unlimited ``RLIMIT_NOFILE``)."""
_NO_FILES = frozenset({errno.EMFILE, errno.ENFILE})


def open_file_budget(reserve: int = FD_RESERVE) -> int:
    """Files one reader may keep open: ``max(MIN_OPEN, min(soft // 2, soft - reserve))`` (``soft``:
    the soft ``RLIMIT_NOFILE`` now; :data:`MAX_OPEN` when unlimited or unknown)."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # pragma: no cover - not POSIX
        return MAX_OPEN
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return MAX_OPEN
    return max(MIN_OPEN, min(MAX_OPEN, soft // 2, soft - reserve))


class _Entry:
    __slots__ = ("handle", "pins", "ready")

    def __init__(self):
        self.handle = None
        self.pins = 1
        self.ready = False


class FileCache:
    """LRU of at most ``capacity`` open handles, keyed by ``key``.

    ``opener(key)`` returns a handle (an fd, an ``h5py.File``, an ``MPI.File``)
    or raises; ``closer(handle)`` releases it.  ``opens``/``evictions`` count
    the opens and the closes made to free a slot; ``peak`` is the most handles
    open at once.
    """

    def __init__(self, opener: Callable[[Hashable], Any], closer: Callable[[Any], None], capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.opener, self.closer, self.capacity = opener, closer, int(capacity)
        self._entries: OrderedDict = OrderedDict()  # key -> _Entry, least recently used first
        self._cond = threading.Condition()
        self.opens = self.evictions = self.peak = 0

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict:
        """``{"opens", "evictions", "max_open"}``: counters so far and the capacity."""
        return {"opens": self.opens, "evictions": self.evictions, "max_open": self.capacity}

    @contextmanager
    def use(self, key: Hashable):
        """Pin ``key``'s handle (opening it if needed) for the ``with`` body."""
        handle = self.acquire(key)
        try:
            yield handle
        finally:
            self.release(key)

    def acquire(self, key: Hashable, wait: bool = True):
        """The open handle of ``key``, pinned until :meth:`release`; opens it (and evicts) if needed.

        ``wait=False``: None instead of waiting (every slot pinned, or another thread opening ``key``), for a
        thread that already holds pins and must not wait for others' (two such threads could wait forever)."""
        with self._cond:
            while True:
                e = self._entries.get(key)
                if e is not None:
                    if e.ready:
                        e.pins += 1
                        self._entries.move_to_end(key)
                        return e.handle
                    if not wait:
                        return None
                    self._cond.wait()  # another thread is opening it
                    continue
                if len(self._entries) < self.capacity or self._evict_one():
                    break
                if not wait:
                    return None
                self._cond.wait()  # every slot is pinned: wait for a release
            e = self._entries[key] = _Entry()  # a placeholder holds the slot while we open outside the lock
        try:
            handle = self._open(key)
        except BaseException:
            with self._cond:
                del self._entries[key]
                self._cond.notify_all()
            raise
        with self._cond:
            e.handle, e.ready = handle, True
            self.opens += 1
            self.peak = max(self.peak, len(self._entries))
            self._cond.notify_all()
        return handle

    def pin_if_open(self, key: Hashable):
        """``key``'s handle pinned (release it) if it is open now, else None (nothing is opened)."""
        with self._cond:
            e = self._entries.get(key)
            if e is None or not e.ready:
                return None
            e.pins += 1
            return e.handle

    def release(self, key: Hashable) -> None:
        """Unpin ``key`` (one :meth:`acquire`)."""
        with self._cond:
            self._entries[key].pins -= 1
            self._cond.notify_all()

    def _open(self, key):
        """``opener(key)``; on EMFILE/ENFILE close idle handles, shrink, and try again."""
        while True:
            try:
                return self.opener(key)
            except OSError as exc:
                if exc.errno not in _NO_FILES:
                    raise
                with self._cond:
                    freed = 0
                    while self._evict_one():
                        freed += 1
                    self.capacity = max(1, len(self._entries))
                if not freed:
                    raise

    def _evict_one(self) -> bool:
        """Close the least recently used idle handle (caller holds the lock); False if none is idle."""
        for key, e in self._entries.items():
            if e.ready and e.pins == 0:
                del self._entries[key]
                self.evictions += 1
                self.closer(e.handle)
                return True
        return False

    def close_all(self) -> None:
        """Close every handle (none may be pinned: the reader's threads have stopped)."""
        with self._cond:
            entries, self._entries = list(self._entries.values()), OrderedDict()
        for e in entries:
            if e.ready:
                self.closer(e.handle)

    def forget(self) -> list:
        """After a fork: drop every entry without locking or closing; returns the handles (the
        child's copies, for the caller to close as it sees fit)."""
        handles = [e.handle for e in self._entries.values() if e.ready]
        self._entries = OrderedDict()
        self._cond = threading.Condition()
        return handles
