"""What the raw readers (pread, MPI-IO) share: which byte ranges to read for a request
of blocks, and how a block's stored bytes land in the caller's output array.

Shapes (k requested blocks, all distinct; R ranges of one file):

==================  ===========  ===============================================
``blocks``          int64[k]     requested block ids
``unwritten``       int64[u]     positions (into ``blocks``) of never-written chunks
``FilePlan.pos``    int64[m]     positions (into ``blocks``) of this file's blocks
``FilePlan.ranges`` Ranges       coalesced reads of those m blocks (R ranges)
==================  ===========  ===============================================
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from ..errors import DecodeError
from .coalesce import CoalescePolicy, Ranges
from .filters import decode_chunk
from .raw import decode_block


class FilePlan(NamedTuple):
    """The reads of one file: its blocks (by request position) and their merged ranges."""

    file: int
    pos: np.ndarray
    ranges: Ranges

    def members(self) -> list[np.ndarray]:
        """For each range: the positions into ``pos`` of its blocks, by offset (list of R int64 arrays)."""
        rid = self.ranges.range_of
        order = np.lexsort((self.ranges.offset_in_range, rid))
        cuts = np.searchsorted(rid[order], np.arange(1, self.ranges.n_ranges))
        return np.split(order, cuts)


def plan_reads(layout, blocks: np.ndarray, policy: CoalescePolicy) -> tuple[np.ndarray, list[FilePlan]]:
    """Split distinct ``blocks`` into never-written ones and per-file coalesced reads.

    Returns ``(unwritten positions int64[u], [FilePlan, ...] in file order)``.
    """
    offs = layout.block_offset[blocks]
    written = offs >= 0
    unwritten = np.flatnonzero(~written)
    pos = np.flatnonzero(written)
    if pos.size == 0:
        return unwritten, []
    files = np.array([info.file for info in layout.datasets], dtype=np.int64)[layout.block_dataset[blocks[pos]]]
    order = np.argsort(files, kind="stable")
    pos, files = pos[order], files[order]
    cuts = np.flatnonzero(np.diff(files)) + 1
    plans = []
    for p in np.split(pos, cuts):
        b = blocks[p]
        rng = policy.apply(layout.block_offset[b], layout.block_stored[b])
        plans.append(FilePlan(int(layout.datasets[layout.block_dataset[b[0]]].file), p, rng))
    return unwritten, plans


def direct_mask(layout, blocks: np.ndarray) -> np.ndarray:
    """bool[k]: the block's stored bytes are its decoded bytes (no filter ran on it).

    True for contiguous and unfiltered chunked data, and for chunks whose every
    filter is skipped in their filter mask, when the stored size is the decoded size.
    """
    n_filters = np.array([len(info.filters) for info in layout.datasets], dtype=np.int64)
    nf = n_filters[layout.block_dataset[blocks]]
    all_skipped = (layout.block_mask[blocks].astype(np.int64) & ((1 << nf) - 1)) == (1 << nf) - 1
    return all_skipped & (layout.block_stored[blocks] == layout.block_nbytes[blocks])


def chunk_where(layout, block: int) -> str:
    """``"chunk at (0, 3) of file.h5:/name"`` for error messages."""
    d, origin = layout.block_grid_coords(int(block))
    info = layout.datasets[d]
    return f"chunk at {origin} of {layout.files[info.file]}:/{info.name.lstrip('/')}"


def deliver(layout, block: int, raw, out: np.ndarray) -> None:
    """Decode a block's stored bytes ``raw`` (buffer of ``block_stored`` bytes) into ``out`` (uint8).

    Filtered chunks are decoded straight into ``out`` (the last filter stage writes there:
    no intermediate array, no second copy); the result equals :func:`decode_block`'s bytes.
    """
    block = int(block)
    d = int(layout.block_dataset[block])
    info = layout.datasets[d]
    if info.chunks is None or not info.filters:
        out[:] = decode_block(layout, block, raw).reshape(-1).view(np.uint8)
        return
    try:
        decode_chunk(raw, info.filters, int(layout.block_mask[block]), int(layout.block_nbytes[block]),
                     np.dtype(info.dtype).itemsize, out=out)
    except ValueError as exc:
        _, origin = layout.block_grid_coords(block)
        raise DecodeError(f"cannot decode chunk at {origin} of {layout.files[info.file]}:/{info.name.lstrip('/')}: "
                          f"{exc}") from None


def fill_unwritten(layout, block: int, out: np.ndarray) -> None:
    """A never-written chunk reads as the dataset's fill value (as HDF5 returns it)."""
    info = layout.datasets[int(layout.block_dataset[block])]
    out.view(np.dtype(info.dtype))[:] = info.fillvalue


def short_read_error(layout, blocks: np.ndarray, offsets: np.ndarray, got_until: int) -> DecodeError:
    """The error for a read that stopped at file byte ``got_until`` (end of file).

    ``blocks``/``offsets``: the blocks of the short range and their file offsets.
    """
    ends = offsets + layout.block_stored[blocks]
    bad = np.flatnonzero(ends > got_until)
    b = int(blocks[bad[0]]) if bad.size else int(blocks[0])
    lo = int(layout.block_offset[b])
    hi = lo + int(layout.block_stored[b])
    try:  # the file's real size: a read from an aligned offset past the end stops at that offset, not at the end
        size = os.path.getsize(layout.files[layout.datasets[int(layout.block_dataset[b])].file])
        end = f"the file has {size} bytes" if size < hi else f"the read ended at byte {got_until}"
    except (OSError, AttributeError, IndexError):
        end = f"the read ended at byte {got_until}"
    return DecodeError(f"{chunk_where(layout, b)} needs bytes [{lo}, {hi}) but {end} (truncated?)")
