"""Physical limits ``solar bench`` measures: the disk's, cold, at the layout's block size (random at several
depths, and sequential: :mod:`solar.bench.disk`), the CPU's for filtered data (:mod:`solar.bench.decode`), the
memory's copy bandwidth with a given number of cores (the hit path's limit: assembling a batch is copying), and
the bytes the operating system read from storage for a process (``/proc/self/io``), next to solar's own
counters."""
from __future__ import annotations

import time

import numpy as np
from numba import njit

from ..buffer.gather import _memcpy
from ..layout.parts import chunks_of


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


def os_read_bytes(pid=None) -> int:
    """Bytes this process (all its threads), or process ``pid``, had the storage layer read (``read_bytes`` of
    ``/proc/<pid>/io``; 0 where there is none)."""
    try:
        with open(f"/proc/{pid or 'self'}/io") as fh:
            for line in fh:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


#: Random reads in flight the disk's best cold random-read rate is looked for at (besides ``--disk-depth``).
BEST_DEPTHS = (16, 64, 256)


def measure_disk(layout, depth: int = 16, depths=BEST_DEPTHS) -> dict:
    """The physical limit, cold: random reads of the layout's stored blocks (``depth`` in flight, and each of
    ``depths``: the best of them is the disk's limit for one rank that keeps enough reads in flight) and 8 MiB
    sequential reads (4 in flight) over its files.

    Returns ``dict(bytes_per_s, method, random_read_gbps, sequential_read_gbps, block_bytes, random, sequential,
    random_by_depth, best_random_read_gbps, best_depth)``; ``bytes_per_s``/``method`` are the sequential figure
    (as before), ``random_read_gbps`` the one at ``depth``.
    """
    layout = chunks_of(layout)  # a plan on parts of chunks reads whole chunks
    from .disk import cold_parallel_sequential_read, cold_random_read, typical_block
    extents, block = typical_block(layout)
    rnd = cold_random_read(layout.files, extents, depth=depth)
    by_depth = {int(depth): rnd["bytes_per_s"] / 1e9}
    for d in sorted(set(int(x) for x in depths) - {int(depth)}):
        by_depth[d] = cold_random_read(layout.files, extents, depth=d)["bytes_per_s"] / 1e9
    best = max(by_depth, key=by_depth.get)
    seq = cold_parallel_sequential_read(layout.files)
    return dict(bytes_per_s=seq["bytes_per_s"], method=seq["method"], random_read_gbps=rnd["bytes_per_s"] / 1e9,
                sequential_read_gbps=seq["bytes_per_s"] / 1e9, block_bytes=block, random=rnd, sequential=seq,
                random_by_depth={str(d): g for d, g in sorted(by_depth.items())}, best_random_read_gbps=by_depth[best],
                best_depth=best)


def measure_random(layout, depth: int = 16) -> float:
    """The disk's cold random-read GB/s alone, as :func:`measure_disk` measures it (between solar's epochs)."""
    layout = chunks_of(layout)  # a plan on parts of chunks reads whole chunks
    from .disk import cold_random_read, typical_block
    extents, _ = typical_block(layout)
    return cold_random_read(layout.files, extents, depth=depth)["bytes_per_s"] / 1e9


def measure_decode(layout) -> "dict | None":
    """The CPU limit of filtered data (:func:`solar.bench.decode.decode_limit`, the node's cores), with
    ``filtered_fraction``: the share of the layout's stored bytes that are filtered (what it applies to)."""
    layout = chunks_of(layout)  # a plan on parts of chunks reads whole chunks
    from .decode import decode_limit, filtered_blocks
    r = decode_limit(layout)
    if r is not None:
        on = (layout.block_offset >= 0) & (layout.block_stored > 0)
        total = int(layout.block_stored[on].sum())
        r["filtered_fraction"] = float(layout.block_stored[filtered_blocks(layout)].sum()) / total if total else 0.0
    return r
