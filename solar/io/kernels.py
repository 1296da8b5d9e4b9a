"""System calls over many byte ranges in one GIL-free numba call.

Every ``os.posix_fadvise`` from Python releases and re-acquires the GIL; with the
reader's threads busy, that round trip cost 220-590 us per call on a 2-core VM, far
more than the advice itself (~15 us).  :func:`fadvise_ranges` issues them all at once.
"""
from __future__ import annotations

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
