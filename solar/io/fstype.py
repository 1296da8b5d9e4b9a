"""Which file system a path sits on, from ``statfs(2)``'s ``f_type`` magic number.

Linux only (elsewhere the type is unknown and no file system counts as
parallel).  ``f_type`` is the first field of ``struct statfs`` on every Linux
ABI, a C ``long`` (``__fsword_t``); it is read with ctypes, no subprocess.
The magic numbers are the ones the file systems' kernel modules register.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

PARALLEL_FS = {
    0x0BD00BD0: "lustre",
    0x47504653: "gpfs",
    0x19830326: "beegfs",
    0x20030528: "orangefs",
    0xAAD7AAEA: "panfs",
}

_libc = None


def fs_magic(path: str) -> int | None:
    """``f_type`` of the file system holding ``path`` (None if unknown or not Linux)."""
    global _libc
    if not sys.platform.startswith("linux"):
        return None
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    buf = ctypes.create_string_buffer(256)  # larger than struct statfs on any Linux ABI
    if _libc.statfs(os.fsencode(path), buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def parallel_fs_name(path: str) -> str | None:
    """``"lustre"``, ``"gpfs"``, ... if ``path`` is on a parallel file system, else None."""
    magic = fs_magic(path)
    return PARALLEL_FS.get(magic) if magic is not None else None
