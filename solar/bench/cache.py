"""Cold page cache for benchmarks: drop files from it, measure how much of a file is in it.

Two ways to make a read cold:

* ``file`` — ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each data file.  Needs no
  privileges and leaves the rest of the system's cache alone; dirty pages are
  written back first (``fdatasync``) because the kernel cannot drop them.
* ``system`` — ``sync`` then ``3`` into ``/proc/sys/vm/drop_caches`` (page cache,
  dentries and inodes).  Root only.

Under MPI the cache belongs to a node, so :func:`make_cache_dropper` lets one
rank per node drop it.  ``mpi4py`` is imported only when a communicator is used.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from typing import Callable, Iterable, Optional, Tuple

import numpy as np

from ..errors import SolarError

DROP_CACHES = "/proc/sys/vm/drop_caches"
MODES = ("file", "system", "none")

_libc = None


def _c():
    """libc with ``mmap``/``mincore``/``munmap`` typed for ctypes (loaded once)."""
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_long]
        lib.mincore.restype = ctypes.c_int
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = lib
    return _libc


def _paths(paths) -> list:
    if isinstance(paths, (str, os.PathLike)):
        return [os.fspath(paths)]
    return [os.fspath(p) for p in paths]


def drop_file_cache(paths: Iterable[str]) -> str:
    """Evict each file's pages from the page cache; returns a one-line description of the method.

    Raises :class:`SolarError` naming a file that cannot be opened.
    """
    paths = _paths(paths)
    total = 0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError as exc:
            raise SolarError(f"cannot open {p} to drop its cached pages: {exc.strerror}") from None
        try:
            try:
                os.fdatasync(fd)  # dirty pages are not dropped by DONTNEED
            except OSError:
                pass
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return f"posix_fadvise(DONTNEED) on {len(paths)} file(s), {total / 1e9:.2f} GB"


def cached_fraction(path: str) -> float:
    """Fraction (0..1) of the file's pages resident in the page cache (``mmap`` + ``mincore``).

    An empty file has no pages to read and counts as 0.0.
    """
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise SolarError(f"cannot open {path} to check its cached pages: {exc.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0.0
        lib = _c()
        addr = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            raise SolarError(f"cannot mmap {path}: {os.strerror(err)}")
        try:
            page = mmap.PAGESIZE
            vec = np.zeros((size + page - 1) // page, dtype=np.uint8)
            if lib.mincore(addr, size, vec.ctypes.data) != 0:
                err = ctypes.get_errno()
                raise SolarError(f"mincore failed on {path}: {os.strerror(err)}")
        finally:
            lib.munmap(addr, size)
        return float(np.count_nonzero(vec & 1)) / vec.size
    finally:
        os.close(fd)


def drop_all_caches() -> str:
    """``sync`` then write 3 to /proc/sys/vm/drop_caches; raises :class:`SolarError` if not permitted."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise SolarError(f"cannot drop the system page cache: writing 3 to {DROP_CACHES} failed ({why}); "
                         "run as root or drop only the data files' pages (mode 'file')") from None
    return f"sync; echo 3 > {DROP_CACHES}"


def _can_drop_all() -> Optional[str]:
    """None if :func:`drop_all_caches` should work here, else why not."""
    if not os.path.exists(DROP_CACHES):
        return f"{DROP_CACHES} does not exist"
    if not os.access(DROP_CACHES, os.W_OK):
        return f"{DROP_CACHES} is not writable (needs root)"
    return None


def largest_left(values) -> Optional[float]:
    """Largest of the per-rank ``drop()`` results that are not None (None if all are)."""
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _left(paths) -> float:
    """Largest fraction of any of ``paths`` resident in the page cache (0.0 for no paths)."""
    return max((cached_fraction(p) for p in paths), default=0.0)


def make_cache_dropper(paths: Iterable[str], mode: str = "file", comm=None) -> Tuple[Callable[[], None], str]:
    """``(drop, description)``: ``drop()`` makes the next read of ``paths`` cold.

    ``mode`` is ``"file"`` (:func:`drop_file_cache`), ``"system"``
    (:func:`drop_all_caches`) or ``"none"`` (``drop`` does nothing).  With an
    MPI communicator ``comm`` only node-local rank 0 (found with
    ``Split_type(COMM_TYPE_SHARED)``) drops, once per node; building the
    dropper is then collective over ``comm``, and a ``"system"`` dropper that
    would fail on any node raises :class:`SolarError` on every rank up front.
    ``drop()`` itself is not collective: put a barrier after it.  On the dropping
    rank it returns the largest fraction (0..1) of a data file still in the page
    cache right after the drop (:func:`cached_fraction`, the check that the drop
    worked); elsewhere, and in mode ``"none"``, None.
    """
    if mode not in MODES:
        raise SolarError(f"cache drop mode must be one of {', '.join(MODES)}, got {mode!r}")
    paths = _paths(paths)
    dropper = True
    if comm is not None:
        from mpi4py import MPI
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        dropper = node.rank == 0
        n_nodes = comm.allreduce(1 if dropper else 0)
        node.Free()
    else:
        n_nodes = 1
    where = f", one rank on each of {n_nodes} node(s)" if comm is not None else ""
    if mode == "none":
        return (lambda: None), "none (page cache left warm)"
    if mode == "system":
        why = _can_drop_all() if dropper else None
        whys = comm.allgather(why) if comm is not None else [why]
        bad = [w for w in whys if w]
        if bad:
            raise SolarError(f"cannot drop the system page cache: {bad[0]}; run as root or use mode 'file'")

        def drop():
            if dropper:
                drop_all_caches()
                return _left(paths)
            return None
        return drop, f"sync; echo 3 > {DROP_CACHES}{where}"
    for p in paths:
        if not os.path.isfile(p):
            raise SolarError(f"cannot drop the cached pages of {p}: not a file")
    size = sum(os.path.getsize(p) for p in paths)

    def drop():
        if dropper:
            drop_file_cache(paths)
            return _left(paths)
        return None
    return drop, f"posix_fadvise(DONTNEED) on {len(paths)} file(s), {size / 1e9:.2f} GB{where}"
