"""Byte buffers that start on a page boundary, so that copies between them and solar's pools run at full speed.

A ``memcpy`` whose destination lies a few bytes *after* its source modulo 4 KiB (``(dst - src) % 4096`` in
1..31 here) runs 3-5x slower on x86 than at any other distance (4K aliasing of the loads against the
stores just made, and ``rep movsb``'s short-distance case).  Pool slots start on page boundaries, while
``numpy.empty`` returns what ``malloc`` gives: 16 bytes past a page for every allocation glibc maps (all of
those over 32 MiB), anywhere in the heap for the others.  A batch gathered from the pools into mapped memory
copied every row at that worst distance (measured on the
development VM, AMD EPYC, glibc 2.36: 4 KiB rows 1.3-1.5 against 4.3-5.6 GB/s, 64 KiB rows 1.8-2.3
against 9-11 GB/s; ``docs/runtime.md``, "Batches on page boundaries").  Buffers from :func:`empty` start
on a page, so a copy between them and a slot is at a distance that is a multiple of the 64-byte
alignment both share, never in the slow window.
"""
from __future__ import annotations

import numpy as np

#: Bytes: where :func:`empty`'s buffers start (a page; any multiple of 64 keeps copies out of the slow window).
ALIGN = 4096


def empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """A new uint8[nbytes] array whose first byte's address is a multiple of ``align`` (a power of two).

    Over-allocates ``align - 1`` bytes through ``numpy.empty`` (which keeps numpy's huge-page advice for
    large arrays) and returns the aligned view; the view keeps the allocation alive."""
    nbytes = int(nbytes)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if align < 1 or align & (align - 1):
        raise ValueError(f"align must be a power of two, got {align}")
    raw = np.empty(nbytes + align - 1, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes]


def offset(arr: np.ndarray, align: int = ALIGN) -> int:
    """``arr``'s first byte's address modulo ``align``."""
    return int(arr.__array_interface__["data"][0]) % align
