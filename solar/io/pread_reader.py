"""The ``pread`` reader: coalesced positional reads in a thread pool, decoding outside HDF5.

One ``O_RDONLY`` descriptor per file, opened on first use and shared by the
threads (``preadv`` carries its own offset).  At most ``max_open`` files are open
at once (default :func:`~solar.io.fdcache.open_file_budget`, from ``ulimit -n``): a
:class:`~solar.io.fdcache.FileCache` closes the least recently used idle file and
reopens it when it is read again; a descriptor is pinned only for the ``preadv``
of one range, so a worker thread holds one descriptor at a time.  ``opens`` and
``evictions`` (:meth:`PreadReader.open_stats`) count what that cost.  Each coalesced range is one
scatter ``preadv``: the bytes of blocks that need no decoding go straight into
the caller's arrays; compressed blocks and gaps go to a per-thread scratch
buffer, and compressed blocks are decoded from there straight into the caller's
array in the same worker thread (zlib and the numba LZF decoder release the GIL).

A call's reads are a few arrays (:class:`_ReadPlan`), not an object per range; up to
``threads`` pool workers take the next range from a shared counter until none is left,
so a call costs at most ``threads`` hand-offs however many ranges it reads, and a slow
read delays only its own worker.  The pool's ``threads`` are the I/O depth and bound the
scratch memory (one buffer of at most ``max_read`` bytes per thread).

``direct_io`` (default ``"auto"``) opens the files with ``O_DIRECT``: every range is read, rounded
out to :data:`DIRECT_ALIGN`, into a page-aligned per-thread bounce buffer (HDF5 places data at
unaligned offsets, so reads cannot land in the caller's arrays), then copied or decoded from there.
Ranges whose blocks need no decoding are cut into jobs of up to 16 ranges of one file, and a worker reads
a job in one GIL-free numba call (:func:`~solar.io.kernels.read_direct_ranges`: ``pread`` into the bounce
buffer, ``memcpy`` into the caller's arrays, the retries of :func:`pread_direct`), not in Python per range.
With libdeflate installed (extra ``fast``), chunks filtered by deflate alone join such jobs too
(:func:`~solar.io.kernels.inflate_direct_ranges`: each zlib stream inflated straight into the caller's array,
no bytes object, no copy; +10% samples/s on the gzip bench, docs/runtime.md); other filters decode in Python.
With native AIO (option ``aio``, default ``"auto"``: files on ext4, xfs and btrfs, where the kernel runs
``O_DIRECT`` AIO asynchronously; ``True``: every ``O_DIRECT`` file; ``False``: never) the ranges of such jobs
whose windows are at most :data:`~solar.io.aio.AIO_SLOT_MAX` are instead read by the calling thread itself,
``threads`` of them in flight per call, in one GIL-free call (:func:`~solar.io.aio.aio_read_ranges`): no
thread wakes per read, which on a rank with few cores leaves the cores to booking and assembly (measured:
docs/runtime.md, "Native AIO").  Retries and errors are the kernel path's; where the kernel refuses AIO
(seccomp, ``fs.aio-max-nr``) the pool reads them.
Nothing goes through the page cache (the buffer is the only copy: its budget is the memory used), and
the kernel's share of a read is about halved (measured: docs/runtime.md).  A file whose file system has
no direct I/O (tmpfs, some FUSE mounts: ``open`` fails with EINVAL) is read through the page cache
instead, with ``drop_cache``, under ``"auto"``; with ``True`` it is a one-line error naming the file;
``False`` never asks for ``O_DIRECT``.  :meth:`PreadReader.open_stats` counts the ``buffered_files``.

Page cache (``drop_cache``, default on): once a call's bytes are in the caller's
arrays, ``posix_fadvise(POSIX_FADV_DONTNEED)`` asks the kernel to drop the file's
pages around each range read (rounded out to ``DROP_ALIGN``: the kernel drops only
page-cache folios wholly inside the advised range, and folios reach 2 MiB; with 4 KiB
rounding ~20% of a file stayed cached after 3 epochs), so a block held in the buffer
is not kept a second time by the page cache.  Cached neighbours go too.  The calls are
made in one GIL-free loop (:func:`~solar.io.kernels.fadvise_ranges`), merged per file, for
the files still open at the end of the call (a file closed during the call to stay within
``max_open`` keeps its pages: advice only, nothing read depends on it).  With
``readahead=False`` (default) each file is opened with ``POSIX_FADV_RANDOM``: the
kernel does not read ahead of the (random, planned) block reads.
"""
from __future__ import annotations

import errno
import itertools
import mmap
import os
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from functools import partial
from typing import ClassVar, NamedTuple

import numpy as np

from ..errors import DecodeError, SpecError
from ..threads import start_threads
from .block_plan import (
    chunk_where,
    deliver,
    direct_mask,
    fill_unwritten,
    plan_reads,
    short_read_error,
)
from .aio import AIO_SLOT_MAX, aio_available, aio_fs, aio_read_ranges, io_destroy, make_ring
from .coalesce import CoalescePolicy
from .fdcache import FileCache, open_file_budget
from .kernels import (LIBDEFLATE, DirectIO, DirectRanges, fadvise_ranges, inflate_direct_ranges,
                      read_direct_ranges)
from .reader import BlockReader, ReadStats, register

try:
    IOV_MAX = int(os.sysconf("SC_IOV_MAX"))
except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
    IOV_MAX = 1024
# drop_cache rounds each range out to this alignment: the page cache holds large folios (up to
# 2 MiB, x86-64), and the kernel drops only folios wholly inside the advised range
DROP_ALIGN = 2 << 20


class _ReadPlan(NamedTuple):
    """A call's coalesced reads as arrays (R ranges over all files, m blocks sorted by range, offset).

    ``file``/``start``/``length`` int64[R]: the file (index into ``Layout.files``) and bytes of range r; its blocks are
    ``ptr[r]:ptr[r+1]`` (int64[R+1]) of ``pos`` (int64[m], positions into the request),
    ``rel`` (int64[m], offset inside the range), ``stored`` (int64[m]) and ``direct``
    (bool[m], stored bytes = decoded bytes); ``whole`` (bool[R]): the range is exactly one
    direct block (read straight into the caller's array, nothing else to do).
    """

    file: np.ndarray
    start: np.ndarray
    length: np.ndarray
    ptr: np.ndarray
    pos: np.ndarray
    rel: np.ndarray
    stored: np.ndarray
    direct: np.ndarray
    whole: np.ndarray


class _DirectJobs(NamedTuple):
    """A call's work as J jobs for the pool's workers when files are read with ``O_DIRECT``.

    Job j is ranges ``cut[j]:cut[j+1]`` (int64[J+1]) of one file.  ``kernel`` (bool[J]): every block
    of the job's ranges needs no decoding, or is a zlib stream libdeflate inflates (``inflate`` (bool[J]):
    some do), so one :func:`~solar.io.kernels.read_direct_ranges` (or ``inflate_direct_ranges``) call
    reads them all and copies (inflates) the blocks out without the GIL; else its ranges go one by one
    through ``_read_range`` (decoding in Python).  ``bounce`` (int64[J]): the bounce buffer the job needs.
    ``ranges``: the kernels' view of every range and block of the call (:class:`~solar.io.kernels.DirectRanges`:
    the aligned windows, the kernel's results, each block's place in its window and its output address).
    """

    cut: np.ndarray
    kernel: np.ndarray
    bounce: np.ndarray
    inflate: np.ndarray
    ranges: DirectRanges


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
    returned (0 bytes) or the OSError raised (``retries`` failures in a row: a call that reads something starts
    the count again).  Other errors are raised at once.
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
        failures = 0  # (tries count failures in a row: a long read that moves on may meet several)
        while n > 0 and i < len(views):  # drop filled buffers, trim a partly filled one
            take = min(n, len(views[i]))
            n -= take
            views[i] = views[i][take:]
            if len(views[i]) == 0:
                i += 1
    return done, calls


#: offsets, lengths and buffer addresses of ``O_DIRECT`` reads are multiples of this
DIRECT_ALIGN = 4096


def open_fd(files, readahead: bool, file: int, direct: bool = False, buffered: set | None = None,
            pins: dict | None = None) -> int:
    """A new read-only descriptor of ``files[file]`` (``POSIX_FADV_RANDOM`` unless ``readahead``; ``O_DIRECT``
    with ``direct``); DecodeError if it cannot be opened, except EMFILE/ENFILE (OSError: the file cache
    handles those).  Where the file system refuses ``O_DIRECT`` (EINVAL): with a ``buffered`` set the file
    is opened without it and ``file`` added to the set, else a DecodeError naming the option.

    ``pins``: ``{file: (device, inode, size, mtime_ns)}`` as each file was when first opened (filled here).  A file
    the cache closed is opened again by its path: if that is no longer the same file, unchanged, its blocks'
    offsets may point anywhere in it, so a DecodeError says so instead of reading it."""
    path = files[file]
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    try:
        try:
            fd = os.open(path, flags | (os.O_DIRECT if direct else 0))
        except OSError as exc:
            if not (direct and exc.errno == errno.EINVAL):
                raise
            if buffered is None:
                raise DecodeError(f"cannot open {path} with O_DIRECT: its file system does not support direct "
                                  f"I/O (reader option direct_io=False or \"auto\")") from None
            fd = os.open(path, flags)
            buffered.add(file)
            direct = False
        else:
            if buffered is not None:
                buffered.discard(file)
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise
        raise DecodeError(f"cannot open {path}: {exc.strerror}") from None
    if pins is not None:
        st = os.fstat(fd)
        now = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        was = pins.setdefault(file, now)
        if was != now:
            os.close(fd)
            what = "replaced by another file" if was[:2] != now[:2] else \
                f"modified ({now[2]:,} bytes, mtime {now[3]} ns; {was[2]:,} bytes, mtime {was[3]} ns before)"
            raise DecodeError(f"{path} was {what} while this job read it: the plan's block offsets no longer "
                              f"describe it (plan again once it stays put)")
    if not readahead and not direct:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def pread_direct(fd: int, buf: memoryview, offset: int, need: int, *, retries: int = READ_RETRIES) -> int:
    """``O_DIRECT`` reads into ``buf`` (page aligned, a multiple of :data:`DIRECT_ALIGN` long) from the aligned
    ``offset`` until ``need`` bytes are in or the file ends; returns the bytes read.  A partial read goes on
    from its aligned part (one shorter than a block is the file's end); zero bytes and transient errors
    (EINTR, EAGAIN, EIO) are retried as :func:`preadv_full` does."""
    done = failures = 0
    while done < need:
        try:
            n = os.preadv(fd, [buf[done:]], offset + done)
        except OSError as exc:
            if exc.errno not in TRANSIENT_ERRNOS or failures >= retries:
                raise
            n = -1
        if n <= 0:  # 0: the end of the file, or a storage hiccup: tried again as preadv_full does
            if failures >= retries:
                break
            time.sleep(RETRY_BACKOFF_S * 2 ** failures)
            failures += 1
            continue
        if done + n >= need:
            return done + n
        if n % DIRECT_ALIGN:  # short: keep the aligned part and read on from there
            if n < DIRECT_ALIGN:
                return done + n  # the file ends inside this block
            n -= n % DIRECT_ALIGN
        done += n
        failures = 0
    return done


def _direct_failed(layout, block: int, start: int, length: int, code, why) -> DecodeError:
    """The error of an ``O_DIRECT`` read of bytes ``[start, start + length)`` (first block ``block``) that
    failed with errno ``code``: tried ``READ_RETRIES + 1`` times if ``code`` is transient, else once."""
    tries = READ_RETRIES + 1 if code in TRANSIENT_ERRNOS else 1
    return DecodeError(f"reading {chunk_where(layout, block)}: bytes [{start}, {start + length}) with O_DIRECT "
                       f"failed ({tries} tries): {why}")


def _zlib_blocks(layout):
    """bool[B]: the blocks stored as one zlib stream (HDF5's deflate filter alone, not skipped by the
    chunk's filter mask), which :func:`~solar.io.kernels.inflate_direct_ranges` decodes; None: none."""
    from .filters import DEFLATE
    ds = np.array([len(d.filters) == 1 and d.filters[0].id == DEFLATE for d in layout.datasets], dtype=bool)
    if not ds.any():
        return None
    return ds[layout.block_dataset] & (layout.block_mask == 0) & (layout.block_offset >= 0)


_LIB = []


def _libdeflate_ctypes():
    """libdeflate through ctypes (its decompressors' allocation), loaded once."""
    if not _LIB:
        import ctypes
        lib = ctypes.CDLL(LIBDEFLATE)
        lib.libdeflate_alloc_decompressor.restype = ctypes.c_void_p
        lib.libdeflate_alloc_decompressor.argtypes = []
        lib.libdeflate_free_decompressor.restype = None
        lib.libdeflate_free_decompressor.argtypes = [ctypes.c_void_p]
        _LIB.append(lib)
    return _LIB[0]


def max_open_option(value, reader: str) -> int:
    """The ``max_open`` option checked: an integer >= 1, or None for :func:`open_file_budget`."""
    if value is None:
        return open_file_budget()
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise SpecError(f"reader {reader!r} option max_open must be an integer >= 1 or None, got {value!r}")
    return int(value)


def _destroy_ring(pid: int, ctx: int) -> None:
    """Destroy AIO context ``ctx`` if this is the process ``pid`` that made it (a forked child's copy is not its)."""
    if os.getpid() == pid:
        io_destroy(ctx)


class _RingHolder:
    """A thread's :class:`~solar.io.aio.AioRing` and the mmap of its slots, in the thread's ``threading.local``:
    when the thread ends (or the reader goes), the holder goes and its finalizer destroys the context; ``close()``
    runs the finalizers of every holder still alive.  AIO contexts count against the machine's ``fs.aio-max-nr``."""

    def __init__(self, ring, buf, finalizers: list):
        self.ring, self.buf = ring, buf
        self.fin = weakref.finalize(self, _destroy_ring, os.getpid(), ring.ctx)
        finalizers.append(self.fin)


@register
class PreadReader(BlockReader):
    """``os.preadv`` in a thread pool; options ``coalesce``, ``max_gap``, ``max_read`` (bytes),
    ``drop_cache`` (drop what was read from the page cache), ``readahead`` (keep the
    kernel's read-ahead; default off: ``POSIX_FADV_RANDOM``), ``max_open`` (files open
    at once; None: from ``ulimit -n``), ``direct_io`` and ``aio`` (native AIO for ``O_DIRECT``
    reads: ``"auto"``, True, False), see the module notes.

    ``threads=1`` reads in the calling thread (no pool).  Safe to use after a
    fork: the child opens its own descriptors and pool on first use.
    """

    name = "pread"
    threaded = True
    collective = False
    needs_raw = True
    OPTIONS: ClassVar[dict] = {"coalesce": True, "max_gap": CoalescePolicy.max_gap,
                               "max_read": CoalescePolicy.max_read, "drop_cache": True, "readahead": False,
                               "max_open": None, "direct_io": "auto", "aio": "auto"}

    @classmethod
    def available(cls):
        if not hasattr(os, "preadv"):
            return False, "os.preadv is missing on this platform"
        return True, ""

    def __init__(self, layout, *, comm=None, threads: int = 4, **options):
        super().__init__(layout, comm=comm, threads=threads, **options)
        o = self.options
        self.policy = CoalescePolicy(o["max_gap"], o["max_read"], o["coalesce"])
        for name in ("drop_cache", "readahead"):
            if not isinstance(o[name], bool):
                raise SpecError(f"reader 'pread' option {name} must be True or False, got {o[name]!r}")
        mode = o["direct_io"]
        if not (isinstance(mode, bool) or mode == "auto"):
            raise SpecError(f"reader 'pread' option direct_io must be True, False or \"auto\", got {mode!r}")
        if mode is True and not hasattr(os, "O_DIRECT"):
            raise SpecError("reader 'pread' option direct_io=True needs O_DIRECT, which this platform lacks")
        self.direct = mode is True or (mode == "auto" and hasattr(os, "O_DIRECT"))
        aio = o["aio"]
        if not (isinstance(aio, bool) or aio == "auto"):
            raise SpecError(f"reader 'pread' option aio must be True, False or \"auto\", got {aio!r}")
        if aio is True and not self.direct:
            raise SpecError("reader 'pread' option aio=True needs direct_io (native AIO reads O_DIRECT files only)")
        if aio is not False and self.direct:
            ok, why = aio_available()
            if aio is True and not ok:
                raise SpecError(f"reader 'pread' option aio=True: native AIO is not available here ({why})")
            aio = aio if ok else False
        #: False (threads only), True (native AIO for every O_DIRECT file) or "auto" (files on ext4, xfs, btrfs)
        self.aio = aio if self.direct else False
        self._aio_files: dict[int, bool] = {}  # file -> read with native AIO
        self._ring_fins: list = []  # the finalizers of the threads' rings (_RingHolder), run by close()
        self._aio_refused = 0  # calls read by the pool because io_setup refused a context
        self._aio_submit_refused = 0  # requests io_submit refused (read with pread instead)
        # files opened without O_DIRECT although asked ("auto" on a file system without it): read buffered
        self._buffered: set[int] = set()
        self.drop_cache = o["drop_cache"] and hasattr(os, "posix_fadvise")
        self.readahead = o["readahead"] or not hasattr(os, "posix_fadvise")
        # the opener holds no reference to the reader (no cycle: a dropped reader is freed at once)
        self._pins: dict[int, tuple] = {}  # each file as first opened: a file the cache reopens must be the same
        self._files = FileCache(partial(open_fd, layout.files, self.readahead, direct=self.direct,
                                        buffered=self._buffered if mode == "auto" else None, pins=self._pins), os.close,
                                max_open_option(o["max_open"], self.name))
        self._pool = None
        self._pool_lock = threading.Lock()
        self._pid = os.getpid()
        self._local = threading.local()
        #: None, or a list each call appends its reads to, as int64[R, 3] rows (file, offset, bytes) in the
        #: order issued: ``solar bench`` replays an epoch's reads bare (:func:`solar.bench.disk.replay_reads`)
        self.trace: list | None = None
        # blocks inflate_direct_ranges decodes: a zlib stream alone (HDF5's deflate filter and nothing else,
        # no filter skipped), with libdeflate installed; None: none
        self._zlib = _zlib_blocks(layout) if self.direct and LIBDEFLATE else None
        self._decompressors: list = []  # (pid, address) of each thread's libdeflate decompressor

    # ------------------------------------------------------------ resources
    def _workers(self) -> ThreadPoolExecutor:
        """The worker pool (made on first use)."""
        with self._pool_lock:  # the buffer calls read_blocks from several I/O threads: one pool
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="solar-pread")
            return self._pool

    def start(self) -> None:
        """Start the ``threads`` workers now, each with its ``O_DIRECT`` bounce buffer mapped and faulted in, and
        load the read kernels' machine code (:meth:`warm`).  Where native AIO reads every block (no filter, no
        block larger than an AIO slot, the first file on a file system AIO serves), the workers' bounce buffers
        are left to their first use: the pool then reads only coalesced ranges beyond
        :data:`~solar.io.aio.AIO_SLOT_MAX`, which random order rarely makes."""
        self._fork_check()
        if self.threads > 1 and not self._closed:
            setup = None if self._aio_reads_all() else self._thread_setup
            start_threads(self._workers(), self.threads, setup)
        if not self._closed:
            try:
                self.warm()
            except Exception:  # noqa: BLE001 - only a head start: the first real read loads the kernel, or fails itself
                pass

    def _aio_reads_all(self) -> bool:
        """Whether native AIO reads every block of the layout (one block a range, as random order makes them)."""
        lay = self.layout
        if not self.aio or lay.n_blocks == 0 or any(info.filters for info in lay.datasets):
            return False
        if int(lay.block_stored.max()) + 2 * DIRECT_ALIGN > AIO_SLOT_MAX:
            return False
        return self._aio_file(0)

    def warm(self) -> None:
        """Load the machine code of the GIL-free read kernels this layout takes, from numba's cache, now.

        A process's first call of a kernel loads it (about 0.1 s each on the development VM), and the first
        step's reads waited for that: a fresh process's first batch came 0.27 s after it was asked for, 0.04 s
        in a process that had read before.  Each kernel is called once on an empty job made the way a real
        call makes one (block 0's plan, no range of it read; no I/O), so the types, and the code loaded, are
        the real call's."""
        lay = self.layout
        if not self.direct or lay.n_blocks == 0:
            return
        blocks = np.zeros(1, np.int64)
        unwritten, plans = plan_reads(lay, blocks, self.policy)
        if unwritten.size or not plans:  # block 0 is not stored: nothing to shape a job from
            return
        plan = self._plan(blocks, plans)
        jobs = self._direct_jobs(plan, [np.empty(0, np.uint8)], blocks)  # (only its address is taken)
        io = DirectIO(-1, 0, READ_RETRIES, int(RETRY_BACKOFF_S * 1e6), DIRECT_ALIGN)  # never read: no ranges
        read_direct_ranges(io, jobs.ranges, 0, 0)
        if self._zlib is not None and self._zlib.any():
            inflate_direct_ranges(io, jobs.ranges, 0, 0, 0, np.full(3, -1, np.int64))
        if self.aio:  # a ring of no slots: no system call
            aio_read_ranges(make_ring(0, 0, 0, ctx=0), jobs.ranges, np.zeros(1, np.int64), np.zeros(0, np.int64),
                            READ_RETRIES, int(RETRY_BACKOFF_S * 1e6), DIRECT_ALIGN)

    def _thread_setup(self) -> None:
        if self.direct:
            np.frombuffer(self._bounce(1), np.uint8)[::mmap.PAGESIZE] = 0  # its pages faulted in now

    def _fork_check(self):
        """After a fork, the pool's threads do not exist in the child: start afresh, with this process's
        own per-thread buffers (the parent may go on reading into its own) and a lock no thread holds."""
        if os.getpid() != self._pid:
            for fd in self._files.forget():
                os.close(fd)  # the child's copies; the parent's stay open
            self._pool, self._pid = None, os.getpid()
            self._local, self._pool_lock = threading.local(), threading.Lock()
            self._decompressors = []  # the parent's, which the parent frees
            self._ring_fins = []  # the parent's AIO contexts (the kernel ties them to the parent's memory)

    @contextmanager
    def _fd(self, file: int):
        """The descriptor of file ``file``, pinned open for the ``with`` body."""
        fd = self._acquire(file)
        try:
            yield fd
        finally:
            self._files.release(file)

    def open_stats(self) -> dict:
        """The file cache's counts; ``direct_io``: whether files are opened with O_DIRECT, and
        ``buffered_files``: how many of those opened so far refused it and are read through the page cache;
        ``aio``: whether native AIO may be used (option True or "auto", and available), ``aio_files``: files
        read so far with it, ``aio_refused``: calls whose ranges went to the pool because ``io_setup`` refused,
        ``aio_submit_refused``: reads ``io_submit`` refused (read with ``pread`` in the calling thread; a file whose
        reads it refuses other than for EAGAIN is read by the pool from then on)."""
        return {**self._files.stats(), "direct_io": self.direct, "buffered_files": len(self._buffered),
                "aio": bool(self.aio), "aio_files": sum(self._aio_files.values()), "aio_refused": self._aio_refused,
                "aio_submit_refused": self._aio_submit_refused}

    def _scratch(self, nbytes: int) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.buf = bytearray(max(nbytes, 1 << 16))
        return memoryview(buf)[:nbytes]

    def _bounce(self, nbytes: int) -> memoryview:
        """This thread's page-aligned buffer for ``O_DIRECT`` reads, at least ``nbytes`` long."""
        buf = getattr(self._local, "direct", None)
        if buf is None or len(buf) < nbytes:
            # private: a forked child writing into its copy must not change the parent's pages (an anonymous
            # mmap is MAP_SHARED by default)
            buf = self._local.direct = mmap.mmap(-1, max(-(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN, 1 << 20),
                                                 flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return memoryview(buf)

    def _bounce_addr(self, nbytes: int) -> int:
        """The address of this thread's :meth:`_bounce` buffer, grown to at least ``nbytes``."""
        self._bounce(nbytes)
        buf = self._local.direct
        if getattr(self._local, "direct_of", None) is not buf:
            self._local.direct_addr = np.frombuffer(buf, np.uint8).ctypes.data  # the mmap stays in _local
            self._local.direct_of = buf
        return self._local.direct_addr

    def _decompressor(self) -> int:
        """This thread's libdeflate decompressor (an address; freed by :meth:`close`)."""
        d = getattr(self._local, "decompressor", None)
        if d is None:
            d = self._local.decompressor = _libdeflate_ctypes().libdeflate_alloc_decompressor()
            if not d:
                raise MemoryError("libdeflate_alloc_decompressor failed")
            with self._pool_lock:
                self._decompressors.append((os.getpid(), d))
        return d

    def close(self) -> None:
        if self._pool is not None and os.getpid() == self._pid:
            self._pool.shutdown(wait=True)
        self._pool = None
        with self._pool_lock:
            mine = [d for pid, d in self._decompressors if pid == os.getpid()]
            self._decompressors = []
        for d in mine:  # no worker uses them now: the pool is shut down (or this is a one-thread reader)
            _libdeflate_ctypes().libdeflate_free_decompressor(d)
        with self._pool_lock:
            fins, self._ring_fins = self._ring_fins, []
        for fin in fins:  # no call is reading: the caller's threads are done with this reader
            fin()
        self._local = threading.local()
        if os.getpid() == self._pid:
            self._files.close_all()
        else:
            for fd in self._files.forget():  # this (forked) process's copies; the parent closes its own
                os.close(fd)
        super().close()

    # ----------------------------------------------------------------- read
    def _read(self, blocks: np.ndarray, out: Sequence[np.ndarray]) -> ReadStats:
        self._fork_check()
        lay = self.layout
        unwritten, plans = plan_reads(lay, blocks, self.policy)
        for i in unwritten.tolist():
            fill_unwritten(lay, int(blocks[i]), out[i])
        plan = self._plan(blocks, plans)
        R = plan.start.shape[0]
        stats = ReadStats(bytes_read=int(plan.length.sum()))
        if R == 0:
            return stats
        if self.trace is not None:
            self.trace.append(np.stack([plan.file, plan.start, plan.length], axis=1))  # int64[R, 3]
        jobs = self._direct_jobs(plan, out, blocks) if self.direct else None
        todo = range(R if jobs is None else jobs.kernel.shape[0])  # the jobs (ranges) of the thread pool
        aio = self._aio_jobs(plan, jobs) if jobs is not None and self.aio else None
        ring = self._ring(int(jobs.bounce[aio].max())) if aio is not None else None
        if ring is None:
            aio = None  # no context to be had (the machine's aio-max-nr): the pool reads them
        else:
            todo = np.flatnonzero(~aio)
        counter, failed, futs = itertools.count(), [], []
        if len(todo) and (self.threads == 1 or (len(todo) == 1 and aio is None)):
            self._work(plan, jobs, todo, blocks, out, counter, failed)
        elif len(todo):
            futs = [self._workers().submit(self._work, plan, jobs, todo, blocks, out, counter, failed)
                    for _ in range(min(self.threads, len(todo)))]
        if aio is not None and not failed:
            try:
                self._read_aio(ring, plan, jobs, np.flatnonzero(aio), blocks, out)
            except BaseException as exc:  # noqa: BLE001 - raised once the pool's workers have stopped
                failed.append(exc)
        wait(futs)  # every worker has finished writing into `out` before we return or raise
        if failed:
            raise failed[0]
        if self.drop_cache and (not self.direct or self._buffered):  # the bytes are in the caller's arrays:
            self._drop(plan)  # the page cache need not keep them (files read with O_DIRECT left nothing there)
        stats.n_reads = R
        return stats

    def _drop(self, plan: _ReadPlan) -> None:
        """``POSIX_FADV_DONTNEED`` over the plan's ranges of the files still open (none is reopened)."""
        files = np.unique(plan.file).tolist()
        if self.direct:
            files = [f for f in files if f in self._buffered]
            if not files:
                return
        fds = {f: self._files.pin_if_open(f) for f in files}
        try:
            lut = np.full(int(plan.file.max()) + 1, -1, np.int64)
            for f, fd in fds.items():
                lut[f] = -1 if fd is None else fd
            fd_of = lut[plan.file]
            keep = fd_of >= 0
            fadvise_ranges(fd_of[keep], plan.start[keep], plan.length[keep], os.POSIX_FADV_DONTNEED, DROP_ALIGN)
        finally:
            for f, fd in fds.items():
                if fd is not None:
                    self._files.release(f)

    def _plan(self, blocks: np.ndarray, plans) -> _ReadPlan:
        """The per-file coalesced reads of ``plan_reads`` as one :class:`_ReadPlan`."""
        lay = self.layout
        file, start, length, counts, pos, rel = [], [], [], [], [], []
        for fp in plans:
            rng = fp.ranges
            order = np.lexsort((rng.offset_in_range, rng.range_of))
            file.append(np.full(rng.n_ranges, fp.file, np.int64))
            start.append(rng.starts)
            length.append(rng.lengths)
            counts.append(np.bincount(rng.range_of, minlength=rng.n_ranges))
            pos.append(fp.pos[order])
            rel.append(rng.offset_in_range[order])
        if not plans:
            z = np.zeros(0, np.int64)
            return _ReadPlan(z, z, z, np.zeros(1, np.int64), z, z, z, z.astype(bool), z.astype(bool))
        pos = np.concatenate(pos)
        b = blocks[pos]
        stored = lay.block_stored[b]
        direct = direct_mask(lay, b)
        ptr = np.concatenate([[0], np.cumsum(np.concatenate(counts))])
        length = np.concatenate(length)
        first = ptr[:-1]  # every range has at least one block
        whole = (np.diff(ptr) == 1) & direct[first] & (stored[first] == length)
        return _ReadPlan(np.concatenate(file), np.concatenate(start), length, ptr, pos, np.concatenate(rel), stored,
                         direct, whole)

    def _direct_jobs(self, plan: _ReadPlan, out, blocks) -> _DirectJobs:
        """The call's ranges cut into jobs (:class:`_DirectJobs`): runs of ranges of one file whose blocks
        all need no decoding, up to ``k`` ranges a job, k chosen so that every worker gets about 2 jobs, at
        least 2 and at most 16 ranges: a job costs one GIL hand-off when its numba call returns, and the
        workers of the other calls in flight keep the depth.  Measured with benchmarks/cold_reads.py (reader
        / bare O_DIRECT reads, 16 threads, 4 calls in flight): median 0.74-0.85 with 1 range a job, 0.82-0.91
        with 2 or 3, at 48 and 96 ranges a call."""
        R = plan.start.shape[0]
        zlib = self._zlib[blocks[plan.pos]] & ~plan.direct if self._zlib is not None else \
            np.zeros(plan.pos.shape[0], bool)  # bool[m]: a block the kernel inflates
        direct = np.logical_and.reduceat(plan.direct | zlib, plan.ptr[:-1])  # bool[R]: the kernel does it all
        start, end = plan.start, plan.start + plan.length
        lo = start - start % DIRECT_ALIGN
        size = -(-end // DIRECT_ALIGN) * DIRECT_ALIGN - lo
        brk = np.ones(R + 1, dtype=bool)  # brk[r]: a job starts at range r (brk[R]: the end)
        brk[1:R] = (plan.file[1:] != plan.file[:-1]) | ~direct[1:] | ~direct[:-1]
        k = max(2, min(16, R // (2 * self.threads)))  # also cut each run every k ranges
        first = np.flatnonzero(brk[:R])
        run_start = first[np.cumsum(brk[:R]) - 1]  # int64[R]: the first range of r's run
        brk[:R] |= (np.arange(R) - run_start) % k == 0
        cut = np.flatnonzero(brk)
        counts = np.diff(plan.ptr)
        addr = np.fromiter((o.__array_interface__["data"][0] for o in out), dtype=np.int64, count=len(out))
        inflate = np.logical_or.reduceat(zlib, plan.ptr[cut[:-1]]) if zlib.shape[0] else np.zeros(0, bool)
        ranges = DirectRanges(lo, size, end - lo, np.zeros(R, np.int64), np.zeros(R, np.int64), plan.ptr,
                              np.repeat(start - lo, counts) + plan.rel, plan.stored, self.layout.block_nbytes[
                                  blocks[plan.pos]], addr[plan.pos], zlib)
        return _DirectJobs(cut, direct[cut[:-1]], np.maximum.reduceat(size, cut[:-1]), inflate, ranges)

    def _work(self, plan: _ReadPlan, jobs, todo, blocks, out, counter, failed: list) -> None:
        """Do jobs (ranges, or :class:`_DirectJobs`) ``todo[next(counter)]`` until none is left or a worker
        has failed (``failed``)."""
        try:
            while not failed:
                i = next(counter)  # atomic under the GIL: every job is done by exactly one worker
                if i >= len(todo):
                    return
                j = int(todo[i])
                if jobs is None:
                    self._read_range(plan, j, blocks, out)
                elif not (jobs.kernel[j] and self._read_job_direct(plan, jobs, j, blocks)):
                    for r in range(int(jobs.cut[j]), int(jobs.cut[j + 1])):
                        self._read_range(plan, r, blocks, out)
        except BaseException as exc:  # noqa: BLE001 - raised by _read once every worker has stopped
            failed.append(exc)

    def _read_job_direct(self, plan: _ReadPlan, jobs: _DirectJobs, j: int, blocks) -> bool:
        """Job ``j`` in one GIL-free call (:func:`~solar.io.kernels.read_direct_ranges`); False (nothing
        read) if its file was opened without O_DIRECT.  Errors as ``_read_range_direct``'s."""
        a, b = int(jobs.cut[j]), int(jobs.cut[j + 1])
        file = int(plan.file[a])
        bounce = self._bounce_addr(int(jobs.bounce[j]))
        zbad = np.full(3, -1, np.int64)  # the block a zlib stream failed in, libdeflate's result, bytes out
        with self._fd(file) as fd:
            if file in self._buffered:
                return False
            io = DirectIO(fd, bounce, READ_RETRIES, int(RETRY_BACKOFF_S * 1e6), DIRECT_ALIGN)
            if jobs.inflate[j]:
                bad = inflate_direct_ranges(io, jobs.ranges, a, b, self._decompressor(), zbad)
            else:
                bad = read_direct_ranges(io, jobs.ranges, a, b)
        if bad >= 0:
            self._direct_error(plan, jobs.ranges, int(bad), blocks, zbad)
        return True

    def _direct_error(self, plan: _ReadPlan, rg, r: int, blocks, zbad) -> None:
        """Raise the error of range ``r`` left short or failed by a read kernel (``zbad``: where a zlib stream
        failed, as :func:`~solar.io.kernels.inflate_direct_ranges` sets it)."""
        lay = self.layout
        if zbad[0] >= 0:
            k, res, got = (int(x) for x in zbad)
            n = int(rg.nbytes[k])
            why = f"decodes to {got} bytes, expected {n}" if res == 0 else \
                f"corrupt zlib stream (libdeflate result {res})" if res != 3 else \
                f"corrupt zlib stream (decodes to more than {n} bytes)"
            raise DecodeError(f"cannot decode {chunk_where(lay, int(blocks[plan.pos[k]]))}: {why}")
        start, length = int(plan.start[r]), int(plan.length[r])
        pos = plan.pos[plan.ptr[r]:plan.ptr[r + 1]]
        e = int(rg.err[r])
        if e:
            raise _direct_failed(lay, int(blocks[pos[0]]), start, length, e, os.strerror(e))
        raise short_read_error(lay, blocks[pos], start + plan.rel[plan.ptr[r]:plan.ptr[r + 1]],
                               int(rg.lo[r] + rg.got[r]))

    # ------------------------------------------------------------ native AIO
    def _aio_file(self, file: int) -> bool:
        """Whether file ``file`` is read with native AIO (``aio=True``: every file; ``"auto"``: on ext4, xfs, btrfs)."""
        use = self._aio_files.get(file)
        if use is None:
            use = self._aio_files[file] = self.aio is True or aio_fs(self.layout.files[file]) is not None
        return use

    def _aio_jobs(self, plan: _ReadPlan, jobs: _DirectJobs):
        """bool[jobs]: the jobs read with native AIO (whole GIL-free copies, windows of at most
        :data:`~solar.io.aio.AIO_SLOT_MAX`, files :meth:`_aio_file` picks); None if none is."""
        first = jobs.cut[:-1]
        files = plan.file[first]
        use = jobs.kernel & ~jobs.inflate & (jobs.bounce <= AIO_SLOT_MAX)
        if use.any():
            ok = np.fromiter((self._aio_file(int(f)) for f in np.unique(files[use]).tolist()), bool)
            if not ok.all():
                use &= np.isin(files, np.unique(files[use])[ok])
        return use if use.any() else None

    def _ring(self, slot_bytes: int):
        """This thread's :class:`~solar.io.aio.AioRing` (``threads`` reads in flight), its slots at least
        ``slot_bytes`` each; None when the kernel gives no new context (EAGAIN: the machine's ``fs.aio-max-nr``
        is used up), counted in ``open_stats()["aio_refused"]``."""
        holder = getattr(self._local, "ring", None)
        if holder is not None and holder.ring.slot_bytes >= slot_bytes:
            return holder.ring
        slot_bytes = max(-(-slot_bytes // DIRECT_ALIGN) * DIRECT_ALIGN, 1 << 16)
        buf = mmap.mmap(-1, self.threads * slot_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        addr = np.frombuffer(buf, np.uint8).ctypes.data
        if holder is not None:  # larger slots, the same context (no read in flight: calls finish their reads)
            holder.ring, holder.buf = holder.ring._replace(bounce=addr, slot_bytes=slot_bytes), buf
            return holder.ring
        try:
            ring = make_ring(self.threads, slot_bytes, addr)
        except OSError:
            with self._pool_lock:
                self._aio_refused += 1
            return None
        with self._pool_lock:
            self._local.ring = _RingHolder(ring, buf, self._ring_fins)
        return ring

    def _read_aio(self, ring, plan: _ReadPlan, jobs: _DirectJobs, aio_jobs: np.ndarray, blocks, out) -> None:
        """The ranges of jobs ``aio_jobs`` read in this thread with native AIO
        (:func:`~solar.io.aio.aio_read_ranges`), a group of files at a time, each file pinned open meanwhile; a
        file opened without O_DIRECT is read range by range.  Errors as :meth:`_read_job_direct`'s."""
        cut, rg = jobs.cut, jobs.ranges
        lens = cut[aio_jobs + 1] - cut[aio_jobs]
        rs = np.repeat(cut[aio_jobs] - np.cumsum(lens) + lens, lens) + np.arange(int(lens.sum()))
        files = plan.file[rs]
        todo = np.unique(files).tolist()
        cap = self._files.capacity  # files one thread pins at once: enough for `threads` reads in flight
        group = max(1, min(cap // 2, max(self.threads, cap // 16)))
        fds = np.full(plan.start.shape[0], -1, np.int64)
        i = 0
        while i < len(todo):
            fds_of = {todo[i]: self._acquire(todo[i])}  # waits (no pin held yet)
            pinned = [todo[i]]
            i += 1
            try:
                while i < len(todo) and len(pinned) < group:
                    try:
                        fd = self._files.acquire(todo[i], wait=False)
                    except OSError:  # EMFILE with the group's files pinned: the next group opens it, pinning none
                        fd = None
                    if fd is None:
                        break
                    pinned.append(todo[i])
                    fds_of[todo[i]] = fd
                    i += 1
                mine = np.isin(files, pinned)  # (pinned: sorted, as todo is)
                fds[rs[mine]] = np.array([fds_of[f] for f in pinned])[np.searchsorted(pinned, files[mine])]
                direct = [f for f in pinned if f not in self._buffered]
                sel = rs[mine & np.isin(files, direct)]
                for r in rs[mine & ~np.isin(files, direct)].tolist():  # refused O_DIRECT: through the page cache
                    self._read_range(plan, r, blocks, out)
                bad = aio_read_ranges(ring, rg, fds, sel, READ_RETRIES, int(RETRY_BACKOFF_S * 1e6), DIRECT_ALIGN) \
                    if sel.size else -1
            finally:
                for f in pinned:
                    self._files.release(f)
            if sel.size and ring.refused[0]:
                with self._pool_lock:
                    self._aio_submit_refused += int(ring.refused[0])
                if ring.refused[1] != errno.EAGAIN:  # not a passing shortage: these files take no AIO
                    self._aio_files.update((f, False) for f in direct)
            if bad <= -2:  # io_getevents failed: destroy the context (waits for its reads), make a new one next time
                holder, self._local.ring = self._local.ring, None
                holder.fin()
                e = -2 - int(bad)
                names = ", ".join(self.layout.files[f] for f in pinned[:3]) + (" ..." if len(pinned) > 3 else "")
                raise DecodeError(f"native AIO failed reading {names}: io_getevents: {os.strerror(e)} (reader "
                                  f"option aio=False reads with threads instead)")
            if bad >= 0:
                self._direct_error(plan, rg, int(bad), blocks, np.full(3, -1, np.int64))

    def _acquire(self, file: int):
        """File ``file``'s descriptor pinned (release it with ``self._files.release``); DecodeError when it
        cannot be opened."""
        try:
            return self._files.acquire(file)
        except OSError as exc:  # EMFILE/ENFILE with no idle file of ours left to close
            raise DecodeError(f"cannot open {self.layout.files[file]}: {exc.strerror} (this reader holds "
                              f"{len(self._files)} files open; raise 'ulimit -n' or lower max_open)") from None

    def _read_range(self, plan: _ReadPlan, r: int, blocks, out) -> None:
        """One scatter preadv for range ``r``, then decode its compressed blocks into ``out``."""
        lay = self.layout
        file, start, length = int(plan.file[r]), int(plan.start[r]), int(plan.length[r])
        a, b = int(plan.ptr[r]), int(plan.ptr[r + 1])
        if self.direct and self._read_range_direct(plan, r, a, b, blocks, out):
            return
        if plan.whole[r]:
            self._preadv(file, [out[int(plan.pos[a])]], start, length, blocks[plan.pos[a:b]], plan.rel[a:b])
            return
        pos, rel, stored, direct = plan.pos[a:b], plan.rel[a:b], plan.stored[a:b], plan.direct[a:b]
        rel_end = rel + stored
        overlap = bool(np.any(rel[1:] < rel_end[:-1])) if b - a > 1 else False
        needs_scratch = overlap or not bool(direct.all()) or int(stored.sum()) != length
        scratch = self._scratch(length) if needs_scratch else None
        if overlap:  # duplicate or overlapping chunks: read once, copy each out
            iov = [scratch]
        else:
            iov, cur = [], 0
            for k, (lo, hi) in enumerate(zip(rel.tolist(), rel_end.tolist())):
                if lo > cur:
                    iov.append(scratch[cur:lo])
                iov.append(out[int(pos[k])] if direct[k] else scratch[lo:hi])
                cur = hi
        self._preadv(file, iov, start, length, blocks[pos], rel)
        for k in np.flatnonzero(~direct | overlap).tolist():
            lo = int(rel[k])
            deliver(lay, int(blocks[pos[k]]), scratch[lo:lo + int(stored[k])], out[int(pos[k])])

    def _read_range_direct(self, plan: _ReadPlan, r: int, a: int, b: int, blocks, out) -> bool:
        """Range ``r`` with ``O_DIRECT``: one aligned read into the bounce buffer, then each block copied or
        decoded from it into ``out``; False (nothing read) if its file was opened without O_DIRECT."""
        lay = self.layout
        file, start, length = int(plan.file[r]), int(plan.start[r]), int(plan.length[r])
        lo = start - start % DIRECT_ALIGN  # aligned window [lo, hi) around [start, start + length)
        hi = -(-(start + length) // DIRECT_ALIGN) * DIRECT_ALIGN
        buf = self._bounce(hi - lo)
        pos, rel, stored = plan.pos[a:b], plan.rel[a:b], plan.stored[a:b]
        try:
            with self._fd(file) as fd:
                if file in self._buffered:
                    return False
                got = pread_direct(fd, buf[:hi - lo], lo, start + length - lo)
        except OSError as exc:
            raise _direct_failed(lay, int(blocks[pos[0]]), start, length, exc.errno, exc.strerror or exc) from None
        if got < start + length - lo:
            raise short_read_error(lay, blocks[pos], start + rel, lo + got)
        skip = start - lo
        for k in range(b - a):
            x, n = skip + int(rel[k]), int(stored[k])
            raw = np.frombuffer(buf, dtype=np.uint8, count=n, offset=x)
            if plan.direct[a + k]:
                out[int(pos[k])][:n] = raw
            else:
                deliver(lay, int(blocks[pos[k]]), raw, out[int(pos[k])])
        return True

    def _preadv(self, file: int, iov: list, start: int, length: int, blocks: np.ndarray, rel: np.ndarray) -> None:
        """``preadv_full`` of file ``file`` (its descriptor pinned meanwhile) with the reader's errors:
        DecodeError naming the chunk and bytes."""
        lay = self.layout
        try:
            with self._fd(file) as fd:
                got, _ = preadv_full(fd, iov, start)
        except OSError as exc:
            tries = READ_RETRIES + 1 if exc.errno in TRANSIENT_ERRNOS else 1
            raise DecodeError(f"reading {chunk_where(lay, int(blocks[0]))}: bytes [{start}, {start + length})"
                              f" failed ({tries} tries): {exc.strerror or exc}") from None
        if got < length:
            raise short_read_error(lay, blocks, start + rel, start + got)
