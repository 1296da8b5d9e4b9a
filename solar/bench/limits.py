"""Physical limits ``solar bench`` measures besides the disk's (:mod:`solar.bench.disk`): the memory's copy
bandwidth with a given number of cores (the hit path's limit: assembling a batch is copying), and the bytes the
operating system read from storage for a process (``/proc/self/io``), next to solar's own counters."""
from __future__ import annotations

import time

import numpy as np
from numba import njit

from ..buffer.gather import _memcpy


@njit(nogil=True, cache=True)
def copy_part(dst, src, lo, hi):
    """``dst[lo:hi] = src[lo:hi]`` without the GIL, with the libc ``memcpy`` batch assembly uses
    (:func:`solar.buffer.gather._memcpy`): the limit is the same copy, not a slower loop."""
    _memcpy(dst, lo, src, lo, hi - lo)


def measure_copy(cpus: int, nbytes: int = 256 << 20, repeat: int = 3) -> dict:
    """The memory's copy bandwidth with ``cpus`` threads (the limit of the hit path: assembling is copying):
    ``nbytes`` copied between two buffers in ``cpus`` equal parts at once, best of ``repeat``.  Returns
    ``dict(gbps, cpus, bytes)``."""
    from concurrent.futures import ThreadPoolExecutor
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    edges = [nbytes * i // cpus for i in range(cpus + 1)]
    parts = list(zip(edges[:-1], edges[1:]))
    best = float("inf")
    with ThreadPoolExecutor(cpus) as pool:
        copy_part(dst, src, 0, 1)  # compiled before the timer
        for _ in range(repeat):
            t0 = time.perf_counter()
            list(pool.map(lambda p: copy_part(dst, src, p[0], p[1]), parts))
            best = min(best, time.perf_counter() - t0)
    return dict(gbps=nbytes / best / 1e9, cpus=int(cpus), bytes=int(nbytes))


def os_read_bytes() -> int:
    """Bytes this process (all its threads) had the storage layer read (``read_bytes`` of ``/proc/self/io``;
    0 where there is none)."""
    try:
        with open("/proc/self/io") as fh:
            for line in fh:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
