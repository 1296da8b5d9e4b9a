"""Runs of neighbouring blocks: blocks stored back to back in one file, read in one request (issue 25, item 4).

A contiguous PtychoNN dataset stores sample ``i``'s 64 KiB row right after sample ``i-1``'s; read at random,
every row is a request of its own, and a disk serves small random requests at a fraction of its sequential
rate.  When the planner reads a block it may also keep the block's *neighbours* (blocks of the same run)
that the plan uses soon (:func:`solar.scheduler.steps.admit_parts`): they are read in the same step, so the
reader's coalescing (:mod:`solar.io.coalesce`) makes one request of them.

``neighbour_runs(layout)`` cuts the layout's raw blocks (stored unfiltered: stored bytes are decoded bytes),
in file order, into runs of adjacent blocks of about ``run_bytes`` each.  Pure: arrays in, array out.

=================  ==========  ====================================================================
``run``            int64[B]    run of each block; a block that is no one's neighbour has its own run
=================  ==========  ====================================================================
"""
from __future__ import annotations

from typing import Optional

import numpy as np

#: bytes of one run at most: the size of request at which the disks measured here read near their
#: sequential rate (docs/planner.md, "Runs of neighbouring blocks")
RUN_BYTES = 1 << 20
#: blocks of one run at most (runs of small blocks, 8-byte labels, would otherwise hold 10^5 blocks; the planner
#: keeps at most :data:`RUN_ADMIT` neighbours per block it reads, whatever the run's length)
RUN_BLOCKS = 64
#: neighbours kept per block read at a step, at most: the planner sizes an epoch's recorded loads by it
RUN_ADMIT = 32


def neighbour_runs(layout, run_bytes: int = RUN_BYTES, run_blocks: int = RUN_BLOCKS) -> Optional[np.ndarray]:
    """int64[B]: the run of each block of ``layout``, or None when no two blocks may be read together.

    Two blocks are neighbours when both are stored raw (``block_stored == block_nbytes``, on storage) in the
    same file and one ends where the other begins.  A stretch of neighbours (in file order) is cut every
    ``run_bytes`` and every ``run_blocks`` blocks: a run is the blocks that begin in one such cut (it may end
    up to one block past ``run_bytes``).

    Only layouts whose blocks are all one size have runs: with blocks of several sizes the buffer's pools
    are one per size, and neighbours kept per field shift the peaks of the sizes apart, so the pools would
    need more memory than the plan's budget (a review measured 1.18-1.25x of it against 1.03x without)."""
    off = np.asarray(layout.block_offset, dtype=np.int64)
    stored = np.asarray(layout.block_stored, dtype=np.int64)
    nbytes = np.asarray(layout.block_nbytes, dtype=np.int64)
    B = off.shape[0]
    if B < 2 or getattr(layout, "block_parent", None) is not None:
        return None  # parts of chunks: read together as chunks (solar.layout.parts)
    if np.unique(nbytes).shape[0] > 1:
        return None  # blocks of several sizes (see above)
    files = np.array([d.file for d in layout.datasets], dtype=np.int64)[np.asarray(layout.block_dataset)]
    raw = (off >= 0) & (stored > 0) & (stored == nbytes)
    ids = np.flatnonzero(raw)
    if ids.shape[0] < 2:
        return None
    ids = ids[np.lexsort((off[ids], files[ids]))]
    adjacent = (files[ids[1:]] == files[ids[:-1]]) & (off[ids[1:]] == off[ids[:-1]] + stored[ids[:-1]])
    if not adjacent.any():
        return None
    # a stretch: neighbours back to back; a run: the blocks of a stretch that begin in one run_bytes of it
    stretch = np.concatenate(([0], np.cumsum(~adjacent)))
    start = np.concatenate(([0], np.cumsum(stored[ids])[:-1]))
    begin = np.zeros(ids.shape[0], dtype=np.int64)
    heads = np.flatnonzero(np.concatenate(([True], ~adjacent)))
    begin[heads] = start[heads]
    begin = np.maximum.accumulate(begin)  # the offset (in this order) where each block's stretch begins
    first = np.zeros(ids.shape[0], dtype=np.int64)
    first[heads] = heads
    first = np.maximum.accumulate(first)  # the position (in this order) of each block's stretch's first block
    # the cut of each block in its stretch: every run_bytes, and every run_blocks blocks (all blocks are one size)
    cut = np.maximum((start - begin) // max(1, int(run_bytes)),
                     (np.arange(ids.shape[0], dtype=np.int64) - first) // max(1, int(run_blocks)))
    key = np.empty(B, dtype=np.int64)
    key[:] = -1
    key[ids] = stretch * (int(cut.max()) + 1) + cut
    lone = key < 0
    key[lone] = key.max() + 1 + np.arange(int(lone.sum()), dtype=np.int64)
    _, run = np.unique(key, return_inverse=True)
    run = run.reshape(-1).astype(np.int64)
    return run if int(run.max()) + 1 < B else None
