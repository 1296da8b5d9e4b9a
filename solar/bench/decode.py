"""The CPU's decode speed for a layout's filtered blocks: the second physical limit of ``solar bench``.

For compressed data the disk is not the only limit: every stored byte must also be inflated (and
unshuffled, checksummed...) on the node's cores.  :func:`decode_limit` measures that in the same run:
it reads a random sample of the layout's filtered blocks into memory (not timed), then decodes them
with solar's own decoders (:func:`solar.io.filters.decode_chunk`, the fastest inflate installed, GIL
released) on one thread per usable core, straight into preallocated outputs as the buffer does, and
reports stored bytes decoded per second.  The figure is per node (all its cores), like the disk's.
"""
from __future__ import annotations

import os
import time
from typing import Optional

import numpy as np

from ..errors import SolarError

MIB = 1 << 20


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def filtered_blocks(layout) -> np.ndarray:
    """int64[k]: the stored blocks of ``layout`` that go through a filter pipeline (empty: none)."""
    on = (layout.block_offset >= 0) & (layout.block_stored > 0)
    has = np.array([bool(info.chunks is not None and info.filters) for info in layout.datasets], dtype=bool)
    if not has.any():
        return np.zeros(0, np.int64)
    return np.flatnonzero(on & has[layout.block_dataset]).astype(np.int64)


def decode_limit(layout, *, threads: Optional[int] = None, max_bytes: int = 64 * MIB, max_seconds: float = 3.0,
                 seed: int = 0) -> Optional[dict]:
    """Stored bytes per second the node's cores decode, or None when no block of ``layout`` is filtered.

    Up to ``max_bytes`` of stored blocks picked at random are read first (``os.pread``, untimed, their
    pages dropped from the page cache again), then
    ``threads`` threads (default: the usable cores) each decode every ``threads``-th of them in a loop
    until ``max_seconds`` pass or each has decoded its share once.  Returns ``dict(bytes_per_s (stored),
    decoded_bytes_per_s, blocks, threads, seconds, method)``.
    """
    from ..io.filters import decode_chunk
    blocks = filtered_blocks(layout)
    if blocks.size == 0:
        return None
    threads = _cores() if threads is None else int(threads)
    if threads < 1:
        raise SolarError(f"decode threads must be >= 1, got {threads!r}")
    rng = np.random.default_rng(seed)
    blocks = blocks[rng.permutation(blocks.shape[0])]
    stored = layout.block_stored[blocks]
    blocks = blocks[: max(1, int(np.searchsorted(np.cumsum(stored), max_bytes)))]  # (k,) the sample
    raws = []
    fds = {}
    try:
        for b in blocks.tolist():
            info = layout.datasets[int(layout.block_dataset[b])]
            if info.file not in fds:
                fds[info.file] = os.open(layout.files[info.file], os.O_RDONLY)
            off, n = int(layout.block_offset[b]), int(layout.block_stored[b])
            raws.append(os.pread(fds[info.file], n, off))
            os.posix_fadvise(fds[info.file], off, n, os.POSIX_FADV_DONTNEED)  # leave no warm pages to the loaders
    except OSError as exc:
        raise SolarError(f"decode limit: cannot read {layout.files[info.file]}: {exc.strerror}") from None
    finally:
        for fd in fds.values():
            os.close(fd)
    work = []  # (raw, pipeline, mask, nbytes, itemsize) per block
    for b, raw in zip(blocks.tolist(), raws):
        info = layout.datasets[int(layout.block_dataset[b])]
        work.append((raw, info.filters, int(layout.block_mask[b]), int(layout.block_nbytes[b]),
                     np.dtype(info.dtype).itemsize))
    done = np.zeros((threads, 2), np.int64)  # stored, decoded bytes per thread
    deadline = [0.0]
    errors = []

    def run(t):
        mine = work[t::threads]
        if not mine:
            return
        out = np.empty(max(w[3] for w in mine), np.uint8)
        try:
            for raw, pipe, mask, nb, isz in mine:
                decode_chunk(raw, pipe, mask, nb, isz, out=out[:nb])
                done[t] += (len(raw), nb)
                if time.perf_counter() > deadline[0]:
                    break
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)

    import threading
    ths = [threading.Thread(target=run, args=(t,), name=f"solar-decode-{t}") for t in range(threads)]
    t0 = time.perf_counter()
    deadline[0] = t0 + max_seconds
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise SolarError(f"decode limit: {type(errors[0]).__name__}: {errors[0]}")
    st, dec = int(done[:, 0].sum()), int(done[:, 1].sum())
    return dict(bytes_per_s=st / seconds if seconds > 0 else float("inf"),
                decoded_bytes_per_s=dec / seconds if seconds > 0 else float("inf"),
                blocks=len(work), threads=threads, seconds=seconds,
                method=f"{len(work)} filtered blocks ({st / MIB:.1f} MiB stored) read into memory, then decoded "
                       f"by solar's decoders on {threads} threads (one per usable core)")
