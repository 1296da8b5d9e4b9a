"""System calls over many byte ranges in one GIL-free numba call.

Every ``os.posix_fadvise`` from Python releases and re-acquires the GIL; with the
reader's threads busy, that round trip cost 220-590 us per call on a 2-core VM, far
more than the advice itself (~15 us).  :func:`fadvise_ranges` issues them all at once.
"""
from __future__ import annotations

import errno
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def _posix_fadvise(typingctx, fd, offset, length, advice):
    """libc ``posix_fadvise(int fd, off_t offset, off_t len, int advice) -> int`` (0 or an errno)."""
    sig = types.int32(types.int32, types.int64, types.int64, types.int32)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32), ir.IntType(64), ir.IntType(64), ir.IntType(32)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "posix_fadvise")
        return builder.call(fn, args)
    return sig, codegen


@njit(nogil=True, cache=True)
def _advise_merged(fds, lo, hi, advice):
    """Advise ``[lo[i], hi[i])`` of ``fds[i]`` (sorted by fd, then lo), merging overlapping or
    touching regions of one descriptor; returns the calls made, or -1 - calls on a failure."""
    calls = 0
    i, n = 0, fds.shape[0]
    while i < n:
        fd, a, b = fds[i], lo[i], hi[i]
        i += 1
        while i < n and fds[i] == fd and lo[i] <= b:
            b = max(b, hi[i])
            i += 1
        if _posix_fadvise(np.int32(fd), a, b - a, np.int32(advice)) != 0:
            return -1 - calls
        calls += 1
    return calls


def fadvise_ranges(fds, starts, lengths, advice: int, align: int = 1) -> int:
    """``posix_fadvise`` over byte ranges ``[starts[i], starts[i]+lengths[i])`` of ``fds[i]``
    (int64[k] each), rounded out to multiples of ``align`` bytes and merged per descriptor.

    Returns the number of calls made, or ``-1 - calls`` when one failed (the rest are then
    not advised: advice only, nothing read depends on it).
    """
    fds = np.asarray(fds, np.int64)
    lo = np.asarray(starts, np.int64)
    hi = lo + np.asarray(lengths, np.int64)
    lo, hi = lo - lo % align, -(-hi // align) * align
    order = np.lexsort((lo, fds))
    return int(_advise_merged(fds[order], lo[order], hi[order], int(advice)))


# ------------------------------------------------------------------ O_DIRECT range reads
_I32, _I64, _PTR = ir.IntType(32), ir.IntType(64), ir.IntType(8).as_pointer()


def _call(builder, name: str, ret, args, values):
    """Call libc ``name`` (llvmlite types ``ret``/``args``); an ``i8*`` argument is given as an int64 address."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)
    return builder.call(fn, [builder.inttoptr(v, _PTR) if a == _PTR else v for v, a in zip(values, args)])


@intrinsic
def _pread(typingctx, fd, addr, count, offset):
    """libc ``pread(int fd, void *buf, size_t count, off_t offset) -> ssize_t``, ``buf`` an int64 address."""
    def codegen(context, builder, signature, args):
        return _call(builder, "pread", _I64, [_I32, _PTR, _I64, _I64], args)
    return types.int64(types.int32, types.int64, types.int64, types.int64), codegen


@intrinsic
def _memcpy(typingctx, dst, src, count):
    """libc ``memcpy`` between two int64 addresses."""
    def codegen(context, builder, signature, args):
        _call(builder, "memcpy", _PTR, [_PTR, _PTR, _I64], args)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64), codegen


@njit(nogil=True, cache=True)
def copy_out(src, src_off, dst, nbytes):
    """``memcpy(dst[k], src + src_off[k], nbytes[k])`` for every k (``src``, ``dst[k]``: int64 addresses),
    without the GIL: the parts of decoded chunks into their slots (:class:`solar.io.parts.PartReader`)."""
    for k in range(dst.shape[0]):
        _memcpy(dst[k], src + src_off[k], nbytes[k])


@intrinsic
def _usleep(typingctx, us):
    """libc ``usleep(useconds_t)``."""
    def codegen(context, builder, signature, args):
        return _call(builder, "usleep", _I32, [_I32], args)
    return types.int32(types.int32), codegen


@intrinsic
def _errno(typingctx):
    """This thread's ``errno`` (glibc and musl: ``int *__errno_location(void)``)."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32.as_pointer(), []),
                                            "__errno_location")
        return builder.load(builder.call(fn, []))
    return types.int32(), codegen


#: errno values a read retries, as ``pread_reader.TRANSIENT_ERRNOS`` (constants when a kernel compiles)
_EINTR, _EAGAIN, _EIO = errno.EINTR, errno.EAGAIN, errno.EIO


@njit(nogil=True, cache=True)
def _read_window(fd, bounce, lo, size, need, retries, backoff_us, align):
    """``(bytes read, errno)`` of one aligned window: ``pread`` from offset ``lo`` into the address
    ``bounce`` (``size`` bytes) until ``need`` bytes are in or the file ends, retried as
    :func:`read_direct_ranges` says."""
    done = 0
    failures = 0
    while done < need:
        n = _pread(fd, bounce + done, size - done, lo + done)
        if n < 0:
            e = _errno()
            if (e != _EINTR and e != _EAGAIN and e != _EIO) or failures >= retries:
                return done, e
        if n <= 0:  # 0: the end of the file, or a storage hiccup
            if failures >= retries:
                break
            _usleep(backoff_us << failures)
            failures += 1
            continue
        if done + n >= need:
            done += n
            break
        if n % align:  # short: keep the aligned part and read on from there
            if n < align:
                done += n  # the file ends inside this block
                break
            n -= n % align
        done += n
        failures = 0  # (failures in a row: a long window that moves on may meet several)
    return done, 0


class DirectIO(NamedTuple):
    """How the kernels read (ints): descriptor ``fd`` (opened with ``O_DIRECT``), the address ``bounce`` of a
    page-aligned buffer as large as the largest window, and the retry rule (:func:`read_direct_ranges`)."""

    fd: int
    bounce: int
    retries: int
    backoff_us: int
    align: int


class DirectRanges(NamedTuple):
    """A call's ranges and their blocks (int64 arrays unless said).  Per range r: ``lo``/``size`` the aligned
    window, ``need`` the bytes up to the range's end, ``got``/``err`` what the kernel read (bytes, errno);
    ``ptr`` (one more): range r's blocks are ``ptr[r]:ptr[r+1]``.  Per block k: ``src`` its offset in the
    window, ``stored`` its stored bytes, ``nbytes`` its decoded bytes, ``dst`` the address of its output,
    ``zlib`` (bool) a zlib stream to inflate (else copied)."""

    lo: np.ndarray
    size: np.ndarray
    need: np.ndarray
    got: np.ndarray
    err: np.ndarray
    ptr: np.ndarray
    src: np.ndarray
    stored: np.ndarray
    nbytes: np.ndarray
    dst: np.ndarray
    zlib: np.ndarray


@njit(nogil=True, cache=True)
def _read_range(io, rg, r):
    """Range ``r``'s window read into the bounce buffer (:func:`_read_window`), ``got[r]``/``err[r]`` set;
    True when all ``need[r]`` bytes are in."""
    done, e = _read_window(io.fd, io.bounce, rg.lo[r], rg.size[r], rg.need[r], io.retries, io.backoff_us, io.align)
    rg.got[r] = done
    rg.err[r] = e
    return e == 0 and done >= rg.need[r]


@njit(nogil=True, cache=True)
def read_direct_ranges(io, rg, r0, r1):
    """``O_DIRECT`` reads of ranges ``r0..r1-1`` of ``rg`` (:class:`DirectRanges`) with ``io``
    (:class:`DirectIO`), each copied out block by block, in one GIL-free call (one Python call for many
    ranges: a worker thread holds the GIL only to start it).

    Range r: ``pread`` from the aligned offset ``lo[r]`` into the page-aligned buffer at address
    ``io.bounce`` (``size[r]`` bytes: the aligned window) until ``need[r]`` bytes are in or the file ends;
    then its blocks k in ``ptr[r]:ptr[r+1]`` are copied, ``stored[k]`` bytes from ``bounce + src[k]`` to the
    address ``dst[k]``.  Retries as ``pread_reader.pread_direct``: a read returning 0 bytes or failing with
    EINTR/EAGAIN/EIO is tried again up to ``io.retries`` times, sleeping ``io.backoff_us * 2**k`` us before
    try k; a read ending between ``io.align`` multiples goes on from its aligned part (shorter than
    ``align``: the file's end).  Sets ``got[r]`` (bytes read) and ``err[r]`` (the errno of a failed read,
    else 0).  Returns the first range left short or failed (its blocks not copied, later ranges not read),
    or -1 when all are in.
    """
    for r in range(r0, r1):
        if not _read_range(io, rg, r):
            return r
        for k in range(rg.ptr[r], rg.ptr[r + 1]):
            _memcpy(rg.dst[k], io.bounce + rg.src[k], rg.stored[k])
    return -1


# ------------------------------------------------------------------ zlib blocks (HDF5's deflate filter)
def _libdeflate() -> str:
    """The path of the shared object holding libdeflate (the ``deflate`` package, extra ``fast``), its
    symbols made visible to numba's linker; "" when it is not installed."""
    try:
        from deflate import _deflate
        from llvmlite import binding
        binding.load_library_permanently(_deflate.__file__)
    except (ImportError, OSError, RuntimeError):
        return ""
    return _deflate.__file__


#: where libdeflate lives ("": not installed; zlib blocks then decode in Python, :mod:`solar.io.inflate`)
LIBDEFLATE = _libdeflate()


@intrinsic
def _zlib_decompress(typingctx, decompressor, src, n, dst, avail, actual):
    """``libdeflate_zlib_decompress(d, in, in_nbytes, out, out_nbytes_avail, &actual_out) -> int``
    (0: success), every pointer an int64 address."""
    def codegen(context, builder, signature, args):
        return _call(builder, "libdeflate_zlib_decompress", _I32, [_PTR, _PTR, _I64, _PTR, _I64, _PTR], args)
    return types.int32(types.int64, types.int64, types.int64, types.int64, types.int64, types.int64), codegen


@njit(nogil=True, cache=True)
def inflate_direct_ranges(io, rg, r0, r1, decompressor, bad):
    """:func:`read_direct_ranges` for ranges whose blocks are raw or zlib streams: block k (``rg.zlib[k]``
    nonzero) is inflated by libdeflate from its ``stored[k]`` bytes at ``bounce + src[k]`` straight into
    its ``nbytes[k]`` bytes at ``dst[k]`` (``decompressor``: this thread's, an address from
    ``libdeflate_alloc_decompressor``); the others are copied.  A stream that is corrupt or decodes to
    another size stops the call: ``bad`` (int64[3]) = (block index k, libdeflate's result, bytes it
    gave), and the range is returned as failed with ``err[r]`` = 0 and ``got[r]`` = ``need[r]``.
    """
    actual = np.zeros(1, np.int64)
    at = actual.ctypes.data
    bounce, src, stored, dst, nbytes = io.bounce, rg.src, rg.stored, rg.dst, rg.nbytes
    for r in range(r0, r1):
        if not _read_range(io, rg, r):
            return r
        for k in range(rg.ptr[r], rg.ptr[r + 1]):
            if rg.zlib[k]:
                actual[0] = -1
                res = _zlib_decompress(decompressor, bounce + src[k], stored[k], dst[k], nbytes[k], at)
                if res != 0 or actual[0] != nbytes[k]:
                    bad[0] = k
                    bad[1] = res
                    bad[2] = actual[0]
                    return r
            else:
                _memcpy(dst[k], bounce + src[k], stored[k])
    return -1
