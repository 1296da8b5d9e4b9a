"""Raw block access: positional reads of a block's stored bytes, decoding, and
placing decoded blocks into a sample's field arrays.  No HDF5 library calls.
"""
from __future__ import annotations

import os
from typing import Callable, Dict

import numpy as np

from ..errors import DecodeError
from .filters import decode_chunk


def pread_exact(fd: int, nbytes: int, offset: int, out=None) -> memoryview:
    """Read exactly ``nbytes`` at ``offset`` (into ``out`` if given); error on a short file."""
    buf = bytearray(nbytes) if out is None else out
    view = memoryview(buf)
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [view[done:nbytes]], offset + done)
        if n <= 0:
            raise DecodeError(f"file ends at byte {offset + done}, {nbytes - done} bytes short of a block")
        done += n
    return view[:nbytes]


def decode_block(layout, block: int, raw) -> np.ndarray:
    """Decode a block's stored bytes into an array of its block shape."""
    d = int(layout.block_dataset[block])
    info = layout.datasets[d]
    shape = layout.block_shapes[d]
    dtype = np.dtype(info.dtype)
    nbytes = int(layout.block_nbytes[block])
    if layout.block_offset[block] < 0:  # chunk never written: HDF5 returns the fill value
        return np.full(shape, info.fillvalue, dtype=dtype)
    if info.chunks is None or not info.filters:
        arr = np.frombuffer(raw, dtype=np.uint8)
        if arr.shape[0] != nbytes:
            raise DecodeError(f"block {block} of {_where(layout, d)} has {arr.shape[0]} bytes, expected {nbytes}")
    else:
        try:
            arr = decode_chunk(raw, info.filters, int(layout.block_mask[block]), nbytes, dtype.itemsize)
        except ValueError as exc:
            _, origin = layout.block_grid_coords(block)
            raise DecodeError(f"cannot decode chunk at {origin} of {_where(layout, d)}: {exc}") from None
    return arr.view(dtype).reshape(shape)


def _where(layout, d: int) -> str:
    info = layout.datasets[d]
    return f"{layout.files[info.file]}:/{info.name.lstrip('/')}"


def read_block(layout, block: int, fd: int) -> np.ndarray:
    """Read and decode one block from an open file descriptor of its file."""
    off = int(layout.block_offset[block])
    if off < 0:
        return decode_block(layout, block, b"")
    return decode_block(layout, block, pread_exact(fd, int(layout.block_stored[block]), off))


def _axis_overlap(sel, origin: int, extent: int, size: int):
    """Overlap of one axis selection with a block ``[origin, origin+extent)``.

    Returns ``(out_index_or_slice, block_index_or_slice)`` or None if disjoint.
    """
    hi = min(origin + extent, size)
    if isinstance(sel, int):
        if not origin <= sel < hi:
            return None
        return None, sel - origin  # None: this axis is dropped from the output
    start, stop, step = sel.indices(size)
    n = len(range(start, stop, step))
    j_lo = max(0, -(-(origin - start) // step))
    j_hi = min(n, -(-(hi - start) // step))
    if j_lo >= j_hi:
        return None
    first = start + step * j_lo - origin
    return slice(j_lo, j_hi), slice(first, first + step * (j_hi - j_lo - 1) + 1, step)


def place_block(out: np.ndarray, sel: tuple, origin, block: np.ndarray, shape) -> bool:
    """Copy the part of a decoded block that ``sel`` selects into ``out``."""
    out_idx, blk_idx = [], []
    for a, s in enumerate(sel):
        ov = _axis_overlap(s, origin[a], block.shape[a], shape[a])
        if ov is None:
            return False
        if ov[0] is not None:
            out_idx.append(ov[0])
        blk_idx.append(ov[1])
    out[tuple(out_idx)] = block[tuple(blk_idx)]
    return True


def assemble_sample(layout, sample: int, get_block: Callable[[int], np.ndarray]) -> Dict[str, np.ndarray]:
    """Build ``{field: array}`` of one sample from its decoded blocks (``get_block(id)``)."""
    src, _ = layout.locate(sample)
    fields = layout.sample_fields(sample)
    by_dataset = {d: (name, sel) for name, d, sel in fields}
    shapes = layout.field_shapes(sample)
    out = {name: np.empty(shapes[name], dtype=np.dtype(layout.datasets[d].dtype)) for name, d, _ in fields}
    for b in layout.blocks_of(sample):
        d, origin = layout.block_grid_coords(int(b))
        name, sel = by_dataset[d]
        place_block(out[name], sel, origin, get_block(int(b)), layout.datasets[d].shape)
    return out


def read_sample(layout, sample: int, fds: Dict[int, int]) -> Dict[str, np.ndarray]:
    """Read one sample straight from storage (``fds``: file index -> open fd)."""
    return assemble_sample(layout, sample,
                           lambda b: read_block(layout, b, fds[layout.datasets[layout.block_dataset[b]].file]))
