"""The ``pread`` reader: coalesced positional reads in a thread pool, decoding outside HDF5.

One ``O_RDONLY`` descriptor per file, opened on first use and shared by the
threads (``preadv`` carries its own offset).  Each coalesced range is one
scatter ``preadv``: the bytes of blocks that need no decoding go straight into
the caller's arrays; compressed blocks and gaps go to a per-thread scratch
buffer, and compressed blocks are decoded from there in the same worker thread
(zlib and the numba LZF decoder release the GIL).  Ranges are spread over the
threads in groups of similar byte counts.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import ClassVar

import numpy as np

from ..errors import DecodeError
from .block_plan import (
    deliver,
    direct_mask,
    fill_unwritten,
    plan_reads,
    chunk_where,
    short_read_error,
)
from .coalesce import CoalescePolicy
from .reader import BlockReader, ReadStats, register

try:
    IOV_MAX = int(os.sysconf("SC_IOV_MAX"))
except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
    IOV_MAX = 1024


class _Range:
    """One coalesced read: file bytes ``[start, start+length)`` and the blocks inside."""

    __slots__ = ("blocks", "direct", "file", "length", "outs", "rel", "start")

    def __init__(self, file, start, length, blocks, rel, outs, direct):
        self.file, self.start, self.length = file, start, length
        self.blocks, self.rel, self.outs, self.direct = blocks, rel, outs, direct


# a read that fails with one of these, or returns no bytes before the end of the request, is tried
# again up to READ_RETRIES times, waiting RETRY_BACKOFF_S * 2**k seconds before try k
READ_RETRIES = 3
RETRY_BACKOFF_S = 0.01
TRANSIENT_ERRNOS = frozenset({errno.EINTR, errno.EAGAIN, errno.EIO})


def preadv_full(fd: int, buffers: list, offset: int, *, retries: int = READ_RETRIES) -> tuple:
    """``preadv`` until every buffer is full or the file ends; returns ``(bytes, calls)``.

    Re-issues the call after a short read (signals, network file systems) and
    passes at most ``IOV_MAX`` buffers per call.  A call that returns 0 bytes
    (end of file, or a storage hiccup) or fails with EINTR/EAGAIN/EIO is tried
    again up to ``retries`` times with a short backoff; then the short count is
    returned (0 bytes) or the OSError raised.  Other errors are raised at once.
    """
    views = [memoryview(b).cast("B") for b in buffers]
    done = calls = failures = 0
    i = 0
    while i < len(views):
        calls += 1
        try:
            n = os.preadv(fd, views[i:i + IOV_MAX], offset + done)
        except OSError as exc:
            if exc.errno not in TRANSIENT_ERRNOS or failures >= retries:
                raise
            n = -1
        if n <= 0:
            if failures >= retries:
                break
            time.sleep(RETRY_BACKOFF_S * 2 ** failures)
            failures += 1
            continue
        done += n
        while n > 0 and i < len(views):  # drop filled buffers, trim a partly filled one
            take = min(n, len(views[i]))
            n -= take
            views[i] = views[i][take:]
            if len(views[i]) == 0:
                i += 1
    return done, calls


@register
class PreadReader(BlockReader):
    """``os.preadv`` in a thread pool; options ``coalesce``, ``max_gap``, ``max_read`` (bytes).

    ``threads=1`` reads in the calling thread (no pool).  Safe to use after a
    fork: the child opens its own descriptors and pool on first use.
    """

    name = "pread"
    threaded = True
    collective = False
    needs_raw = True
    OPTIONS: ClassVar[dict] = {"coalesce": True, "max_gap": CoalescePolicy.max_gap,
                               "max_read": CoalescePolicy.max_read}

    @classmethod
    def available(cls):
        if not hasattr(os, "preadv"):
            return False, "os.preadv is missing on this platform"
        return True, ""

    def __init__(self, layout, *, comm=None, threads: int = 4, **options):
        super().__init__(layout, comm=comm, threads=threads, **options)
        o = self.options
        self.policy = CoalescePolicy(o["max_gap"], o["max_read"], o["coalesce"])
        self._fds = {}
        self._pool = None
        self._pid = os.getpid()
        self._local = threading.local()

    # ------------------------------------------------------------ resources
    def _fork_check(self):
        """After a fork, the pool's threads do not exist in the child: start afresh."""
        if os.getpid() != self._pid:
            for fd in self._fds.values():
                os.close(fd)  # the child's copies; the parent's stay open
            self._fds, self._pool, self._pid = {}, None, os.getpid()

    def _fd(self, file: int) -> int:
        fd = self._fds.get(file)
        if fd is None:
            path = self.layout.files[file]
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                raise DecodeError(f"cannot open {path}: {exc.strerror}") from None
            self._fds[file] = fd
        return fd

    def _scratch(self, nbytes: int) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.buf = bytearray(max(nbytes, 1 << 16))
        return memoryview(buf)[:nbytes]

    def close(self) -> None:
        if self._pool is not None and os.getpid() == self._pid:
            self._pool.shutdown(wait=True)
        self._pool = None
        if os.getpid() == self._pid:
            for fd in self._fds.values():
                os.close(fd)
        self._fds = {}
        super().close()

    # ----------------------------------------------------------------- read
    def _read(self, blocks: np.ndarray, out: Sequence[np.ndarray]) -> ReadStats:
        self._fork_check()
        lay = self.layout
        unwritten, plans = plan_reads(lay, blocks, self.policy)
        for i in unwritten.tolist():
            fill_unwritten(lay, int(blocks[i]), out[i])
        direct = direct_mask(lay, blocks)
        ranges: list[_Range] = []
        for fp in plans:
            self._fd(fp.file)
            rng = fp.ranges
            for r, mem in enumerate(fp.members()):
                p = fp.pos[mem]
                ranges.append(_Range(fp.file, int(rng.starts[r]), int(rng.lengths[r]), blocks[p],
                                     rng.offset_in_range[mem], [out[i] for i in p.tolist()], direct[p]))
        stats = ReadStats(bytes_read=sum(r.length for r in ranges))
        if not ranges:
            return stats
        if self.threads == 1 or len(ranges) == 1:
            stats.n_reads = self._run_group(ranges)
            return stats
        groups = _balanced_groups([r.length for r in ranges], 4 * self.threads)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="solar-pread")
        futs = [self._pool.submit(self._run_group, [ranges[i] for i in g]) for g in groups]
        wait(futs)  # every worker has finished writing into `out` before we return or raise
        for f in futs:
            if f.exception() is not None:
                raise f.exception()
        stats.n_reads = sum(f.result() for f in futs)
        return stats

    def _run_group(self, ranges: list[_Range]) -> int:
        return sum(self._read_range(r) for r in ranges)

    def _read_range(self, r: _Range) -> int:
        """One scatter preadv for a range, then decode its compressed blocks; returns 1 (one range read)."""
        lay = self.layout
        stored = lay.block_stored[r.blocks]
        rel_end = r.rel + stored
        overlap = bool(np.any(r.rel[1:] < rel_end[:-1])) if len(r.blocks) > 1 else False
        needs_scratch = overlap or not bool(r.direct.all()) or int(stored.sum()) != r.length
        scratch = self._scratch(r.length) if needs_scratch else None
        if overlap:  # duplicate or overlapping chunks: read once, copy each out
            iov = [scratch]
        else:
            iov, cur = [], 0
            for k in range(len(r.blocks)):
                a, b = int(r.rel[k]), int(rel_end[k])
                if a > cur:
                    iov.append(scratch[cur:a])
                iov.append(r.outs[k] if r.direct[k] else scratch[a:b])
                cur = b
        try:
            got, _ = preadv_full(self._fds[r.file], iov, r.start)
        except OSError as exc:
            tries = READ_RETRIES + 1 if exc.errno in TRANSIENT_ERRNOS else 1
            raise DecodeError(f"reading {chunk_where(lay, int(r.blocks[0]))}: bytes [{r.start}, {r.start + r.length})"
                              f" failed ({tries} tries): {exc.strerror or exc}") from None
        if got < r.length:
            raise short_read_error(lay, r.blocks, r.start + r.rel, r.start + got)
        for k in range(len(r.blocks)):
            if overlap or not r.direct[k]:
                a, b = int(r.rel[k]), int(rel_end[k])
                deliver(lay, int(r.blocks[k]), scratch[a:b], r.outs[k])
        return 1


def _balanced_groups(lengths: list[int], n_groups: int) -> list[np.ndarray]:
    """Split item indices (in order) into at most ``n_groups`` runs of similar byte totals."""
    ln = np.asarray(lengths, dtype=np.float64)
    n_groups = max(1, min(n_groups, ln.shape[0]))
    before = np.cumsum(ln) - ln  # (n,) bytes before each item
    gid = np.minimum((before * n_groups / max(ln.sum(), 1.0)).astype(np.int64), n_groups - 1)
    cuts = np.flatnonzero(np.diff(gid)) + 1
    return np.split(np.arange(ln.shape[0]), cuts)
