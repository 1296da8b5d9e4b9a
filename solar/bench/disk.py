"""The disk's sequential read speed, measured in the same run as a benchmark (the physical limit).

:func:`cold_sequential_read` drops each file from the page cache, then reads
it front to back in large blocks with ``os.preadv`` into one reused buffer,
so the figure is what the device delivers through the page cache with the
kernel's readahead (hinted ``POSIX_FADV_SEQUENTIAL``), with no copy into
Python objects.  :func:`warm_sequential_read` is the same read from the page
cache (the memory-copy ceiling of a warm run).
"""
from __future__ import annotations

import os
import time
from typing import Iterable, Optional

from ..errors import SolarError
from .cache import _paths, drop_file_cache

MIB = 1 << 20


def _check(block: int, max_bytes: Optional[int]):
    if not isinstance(block, int) or block < 4096:
        raise SolarError(f"read block must be an integer of at least 4096 bytes, got {block!r}")
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
        raise SolarError(f"max_bytes must be a positive integer or None, got {max_bytes!r}")


def _read_all(paths, block: int, max_bytes: Optional[int]) -> tuple:
    """``(bytes read, seconds)``: each file front to back, at most ``max_bytes`` in all."""
    buf = bytearray(block)
    view = memoryview(buf)
    total = 0
    budget = max_bytes if max_bytes is not None else float("inf")
    t0 = time.perf_counter()
    for p in paths:
        if total >= budget:
            break
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError as exc:
            raise SolarError(f"cannot open {p} for reading: {exc.strerror}") from None
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            off = 0
            while total < budget:
                want = int(min(block, budget - total))
                n = os.preadv(fd, [view[:want]], off)
                if n <= 0:
                    break
                off += n
                total += n
        finally:
            os.close(fd)
    return total, time.perf_counter() - t0


def _result(paths, nbytes: int, seconds: float, method: str) -> dict:
    if nbytes == 0:
        raise SolarError(f"nothing to read: {', '.join(paths) or 'no files'} hold 0 bytes")
    return dict(bytes=nbytes, seconds=seconds, bytes_per_s=nbytes / seconds if seconds > 0 else float("inf"),
                method=method, files=len(paths))


def cold_sequential_read(paths: Iterable[str], *, block: int = 16 * MIB, max_bytes: Optional[int] = None) -> dict:
    """Cold sequential read speed of ``paths``: ``dict(bytes, seconds, bytes_per_s, method, files)``.

    Every file is dropped from the page cache first (not timed), then read in
    ``block``-byte ``preadv`` calls, at most ``max_bytes`` over all files.
    The files stay cached afterwards; drop them again before a cold run.
    """
    paths = _paths(paths)
    _check(block, max_bytes)
    how = drop_file_cache(paths)
    nbytes, seconds = _read_all(paths, block, max_bytes)
    return _result(paths, nbytes, seconds,
                   f"cold: {how}, then sequential preadv of {block / MIB:g} MiB blocks into one buffer")


def warm_sequential_read(paths: Iterable[str], *, block: int = 16 * MIB, max_bytes: Optional[int] = None) -> dict:
    """Same read from a warm page cache: one untimed pass to load the pages, then a timed pass."""
    paths = _paths(paths)
    _check(block, max_bytes)
    _read_all(paths, block, max_bytes)
    nbytes, seconds = _read_all(paths, block, max_bytes)
    return _result(paths, nbytes, seconds,
                   f"warm: second sequential preadv pass of {block / MIB:g} MiB blocks into one buffer")
