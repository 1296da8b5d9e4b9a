"""The disk's read speed, measured in the same run as a benchmark (the physical limit).

``solar bench`` uses the deep-queue figures: :func:`cold_random_read` (the layout's
stored blocks, :func:`typical_block`, in random order with 16+ reads in flight) and
:func:`cold_parallel_sequential_read` (large requests, a few in flight).  The
single-stream functions below are kept for comparison with older figures.

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


# ------------------------------------------------------------ deep-queue reads
def typical_block(layout) -> tuple:
    """``(extents, block_bytes)`` of a layout's stored blocks.

    ``extents``: int64[B', 3] of ``(file index, byte offset, stored bytes)`` for every
    block that is on storage (written, not empty); ``block_bytes``: their median stored
    size (the layout's typical read).  Raises :class:`SolarError` when no block is on storage.
    """
    import numpy as np
    on = (layout.block_offset >= 0) & (layout.block_stored > 0)
    if not on.any():
        raise SolarError(f"no block of {', '.join(layout.files)} is stored on disk: nothing to measure")
    files = np.array([layout.datasets[d].file for d in range(len(layout.datasets))], dtype=np.int64)
    ext = np.stack([files[layout.block_dataset[on]], layout.block_offset[on], layout.block_stored[on]], axis=1)
    return ext.astype(np.int64), int(np.median(ext[:, 2]))


def _parallel(work, depth: int) -> float:
    """Run ``work(t)`` for t in ``range(depth)`` on ``depth`` threads; the wall seconds until all end."""
    import threading
    errors = []

    def run(t):
        try:
            work(t)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(t,), name=f"solar-disk-{t}") for t in range(depth)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def _open_all(paths, advice: int) -> list:
    fds = []
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError as exc:
            for f in fds:
                os.close(f)
            raise SolarError(f"cannot open {p} for reading: {exc.strerror}") from None
        os.posix_fadvise(fd, 0, 0, advice)
        fds.append(fd)
    return fds


def _check_depth(depth: int, max_bytes: int, max_seconds: float):
    if not isinstance(depth, int) or depth < 1:
        raise SolarError(f"reads in flight must be an integer >= 1, got {depth!r}")
    if not isinstance(max_bytes, int) or max_bytes < 1:
        raise SolarError(f"max_bytes must be a positive integer, got {max_bytes!r}")
    if not max_seconds > 0:
        raise SolarError(f"max_seconds must be > 0, got {max_seconds!r}")


def _timed(work, depth: int, fds, deadline: list, max_seconds: float) -> float:
    """Seconds for ``work`` on ``depth`` threads (:func:`_parallel`), ``deadline[0]`` set ``max_seconds``
    ahead for the workers to check; ``fds`` closed afterwards, also on an error."""
    try:
        deadline[0] = time.perf_counter() + max_seconds
        return _parallel(work, depth)
    finally:
        for fd in fds:
            os.close(fd)


def cold_random_read(paths: Iterable[str], extents, *, depth: int = 16, max_bytes: int = 256 * MIB,
                     max_seconds: float = 3.0, seed: int = 0) -> dict:
    """Cold random-read bandwidth at the layout's block size with ``depth`` reads in flight.

    ``extents``: int64[B, 3] rows ``(file index into paths, offset, bytes)`` (see
    :func:`typical_block`).  The files are dropped from the page cache (not timed) and
    hinted ``POSIX_FADV_RANDOM`` (no readahead: only the requested bytes move); then
    ``depth`` threads each issue ``os.preadv`` of the extents in one shuffled order
    (thread t takes every depth-th), until all are read, ``max_bytes`` are read or
    ``max_seconds`` pass.  Returns ``dict(bytes, reads, seconds, bytes_per_s, depth,
    block_bytes, method, files)``.
    """
    import numpy as np
    paths = _paths(paths)
    _check_depth(depth, max_bytes, max_seconds)
    ext = np.asarray(extents, dtype=np.int64).reshape(-1, 3)
    if ext.shape[0] == 0:
        raise SolarError("no extents to read: the layout has no block on storage")
    order = ext[np.random.default_rng(seed).permutation(ext.shape[0])]
    how = drop_file_cache(paths)
    fds = _open_all(paths, os.POSIX_FADV_RANDOM)
    done = np.zeros((depth, 2), dtype=np.int64)  # bytes, reads per thread
    deadline = [0.0]

    def work(t):
        view = memoryview(bytearray(int(order[:, 2].max())))
        cap = max_bytes // depth + 1
        for fi, off, n in order[t::depth]:
            if done[t, 0] >= cap or time.perf_counter() > deadline[0]:
                break
            done[t, 0] += os.preadv(fds[fi], [view[:n]], int(off))
            done[t, 1] += 1
    seconds = _timed(work, depth, fds, deadline, max_seconds)
    nbytes, reads = int(done[:, 0].sum()), int(done[:, 1].sum())
    block = int(np.median(ext[:, 2]))
    r = _result(paths, nbytes, seconds, f"cold: {how}, then POSIX_FADV_RANDOM and {depth} threads each issuing "
                                        f"preadv of the layout's stored blocks (median {block:,} bytes) in random order")
    r.update(reads=reads, depth=depth, block_bytes=block)
    return r


def cold_parallel_sequential_read(paths: Iterable[str], *, request: int = 8 * MIB, depth: int = 4,
                                  max_bytes: int = 1 << 30, max_seconds: float = 3.0) -> dict:
    """Cold sequential bandwidth: ``request``-byte ``preadv`` calls, ``depth`` in flight, front to back.

    The files are dropped from the page cache (not timed) and hinted
    ``POSIX_FADV_SEQUENTIAL``; ``depth`` threads take the next request of the files in
    order from a shared cursor, until the files, ``max_bytes`` or ``max_seconds`` end.
    Returns ``dict(bytes, seconds, bytes_per_s, depth, request_bytes, method, files)``.
    """
    import threading
    paths = _paths(paths)
    _check(request, None)
    _check_depth(depth, max_bytes, max_seconds)
    sizes = [os.path.getsize(p) for p in paths]
    reqs = [(i, off) for i, s in enumerate(sizes) for off in range(0, s, request)]
    how = drop_file_cache(paths)
    fds = _open_all(paths, os.POSIX_FADV_SEQUENTIAL)
    lock = threading.Lock()
    cursor, total = [0], [0]
    deadline = [0.0]

    def work(_t):
        view = memoryview(bytearray(request))
        while True:
            with lock:
                k = cursor[0]
                if k >= len(reqs) or total[0] >= max_bytes or time.perf_counter() > deadline[0]:
                    return
                cursor[0] += 1
            fi, off = reqs[k]
            n = os.preadv(fds[fi], [view[:min(request, sizes[fi] - off)]], off)
            with lock:
                total[0] += n
    seconds = _timed(work, depth, fds, deadline, max_seconds)
    r = _result(paths, total[0], seconds, f"cold: {how}, then POSIX_FADV_SEQUENTIAL and {depth} threads issuing "
                                          f"{request / MIB:g} MiB preadv requests front to back")
    r.update(depth=depth, request_bytes=request)
    return r


def replay_reads(paths: Iterable[str], extents, *, depth: int = 16, direct: bool = True,
                 max_bytes: int = 512 * MIB, max_seconds: float = 4.0, align: int = 4096) -> dict:
    """The same reads again, bare: what the disk gives to exactly this access pattern at this depth.

    ``extents``: int64[N, 3] rows ``(file index into paths, offset, bytes)`` in the order a reader
    issued them (``PreadReader.trace``).  ``depth`` threads take the next extent from a shared cursor
    and ``os.preadv`` it into their own buffer, nothing else, until all are read, ``max_bytes`` are
    read or ``max_seconds`` pass (a prefix: the rate, not the epoch, is wanted).  ``direct``: with
    ``O_DIRECT`` (the ``align``-aligned window around each extent, as the reader reads it); where a file
    system refuses ``O_DIRECT``, or with ``direct=False``, the files are dropped from the page cache first
    and hinted ``POSIX_FADV_RANDOM``.  Returns ``dict(bytes, reads, seconds, bytes_per_s, depth,
    direct, method)``; ``bytes`` counts the extents' own bytes (not the alignment), as the reader's
    ``bytes_read`` does, so ``bytes_per_s`` compares with its storage bytes per second.
    """
    import mmap
    import threading

    import numpy as np
    paths = _paths(paths)
    _check_depth(depth, max_bytes, max_seconds)
    ext = np.asarray(extents, dtype=np.int64).reshape(-1, 3)
    if ext.shape[0] == 0:
        return dict(bytes=0, reads=0, seconds=0.0, bytes_per_s=None, depth=depth, direct=direct,
                    method="nothing to replay")
    used = np.unique(ext[:, 0]).tolist()
    fds = {}
    how = "O_DIRECT"
    try:
        for f in used:
            try:
                fds[f] = os.open(paths[f], os.O_RDONLY | (os.O_DIRECT if direct else 0))
            except OSError as exc:
                if not direct:
                    raise SolarError(f"cannot open {paths[f]} for reading: {exc.strerror}") from None
                direct = False  # this file system has no O_DIRECT: cold through the page cache instead
                for fd in fds.values():
                    os.close(fd)
                fds = {}
                break
        if not direct:
            how = drop_file_cache([paths[f] for f in used]) + ", then POSIX_FADV_RANDOM"
            fds = dict(zip(used, _open_all([paths[f] for f in used], os.POSIX_FADV_RANDOM)))
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    a = align if direct else 1
    lo = ext[:, 1] - ext[:, 1] % a
    size = -(-(ext[:, 1] + ext[:, 2]) // a) * a - lo  # the window read, aligned at both ends
    cursor, lock = [0], threading.Lock()
    done = np.zeros((depth, 2), dtype=np.int64)  # extent bytes, reads per thread
    deadline = [0.0]
    cap = max_bytes // depth + 1

    def work(t):
        buf = memoryview(mmap.mmap(-1, int(size.max())))  # page-aligned, as O_DIRECT needs
        while done[t, 0] < cap and time.perf_counter() < deadline[0]:
            with lock:
                k = cursor[0]
                cursor[0] += 1
            if k >= ext.shape[0]:
                return
            os.preadv(fds[int(ext[k, 0])], [buf[:int(size[k])]], int(lo[k]))
            done[t, 0] += ext[k, 2]
            done[t, 1] += 1
    seconds = _timed(work, depth, list(fds.values()), deadline, max_seconds)
    nbytes, reads = int(done[:, 0].sum()), int(done[:, 1].sum())
    return dict(bytes=nbytes, reads=reads, seconds=seconds, bytes_per_s=nbytes / seconds if seconds else None,
                depth=depth, direct=direct,
                method=f"{how}: {depth} threads each issuing preadv of the recorded reads, in their order")
