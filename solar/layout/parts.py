"""Parts of chunks: a layout whose blocks are one sample's share of a chunk (issue 25, item 3).

A chunk that holds several samples (a gzip chunk of 4 PtychoNN rows; a Well chunk of several frames) is
one block of the :class:`~solar.layout.Layout`: a buffer holds it whole, all 4 rows, until it evicts it,
so with half the data in memory a chunk is often evicted before its last sample of the epoch is used and
read again.  Its *parts* are the chunk cut along the sample axes (the ``s``, ``b``, ``t`` roles): one row
(frame) each, the full chunk along the other axes, which is exactly a contiguous slice of the decoded
chunk.  A layout of parts has one block per part; the planner keeps and evicts parts (it keeps the parts
the plan uses soon and drops the rest), and a read of a part reads and decodes its whole chunk, whose
other parts the same step may keep at no storage cost (:mod:`solar.scheduler.steps`).

Arrays of a layout of parts, beside the :class:`Layout`'s (B' parts):

=================  ==========  ====================================================================
``block_parent``   int64[B']   the chunk of each part: its block id in the layout of whole chunks
``part_offset``    int64[B']   byte offset of the part in its decoded chunk
=================  ==========  ====================================================================

A part's ``block_offset``, ``block_stored`` and ``block_mask`` are its chunk's (what reading it costs);
``block_nbytes`` is the part's own.  Blocks that are already one row (contiguous data, chunks one row
deep) are parts of themselves.  Readers read whole chunks: :func:`solar.io.get_reader` wraps a reader of
the chunks (:func:`chunks_of`) in :class:`solar.io.parts.PartReader`.  Pure: no file is opened.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from ..errors import LayoutError
from .blocks import chunk_grid, field_chunk_lists, merge_fields
from .layout import Layout

PART_ARRAYS = ("block_parent", "part_offset")


def is_parts(layout) -> bool:
    """Whether ``layout`` is a layout of parts (made by :func:`split_chunks`)."""
    return getattr(layout, "block_parent", None) is not None


def _roles_of(layout) -> Dict[int, Optional[str]]:
    """dataset -> the roles every source gives it (None: sources disagree)."""
    out: Dict[int, Optional[str]] = {}
    for src in layout.sources:
        for d, roles in zip(src.datasets, src.roles):
            out[d] = roles if out.get(d, roles) == roles else None
    return out


def part_shapes(layout) -> List[Tuple[int, ...]]:
    """The block shape of each dataset in the layout of parts: a chunk cut to one step along every sample
    axis its chunk spans more than one step of, the chunk shape elsewhere (unchanged where nothing cuts)."""
    roles_of = _roles_of(layout)
    out = []
    for d, (info, shp) in enumerate(zip(layout.datasets, layout.block_shapes)):
        roles = roles_of.get(d)
        n = len(roles) if roles else 0
        if info.chunks is None or n == 0 or tuple(shp) != tuple(info.chunks) or all(c == 1 for c in shp[:n]):
            out.append(tuple(int(c) for c in shp))
        else:
            out.append(tuple([1] * n + [int(c) for c in shp[n:]]))
    return out


def _sample_lists(layout, shapes, ds_start) -> Tuple[np.ndarray, np.ndarray]:
    """``(sample_ptr, sample_blocks)`` over blocks of ``shapes`` (the builder's own computation)."""
    ptrs, ids = [np.zeros(1, dtype=np.int64)], []
    base = 0
    for src in layout.sources:
        index, t0 = src.coords(np.arange(src.n_samples, dtype=np.int64))
        counts, lists = [], []
        for d, roles in zip(src.datasets, src.roles):
            c, lin = field_chunk_lists(layout.datasets[d].shape, shapes[d], roles, index, t0, src.window, src.dt,
                                       n_samples=src.n_samples)
            counts.append(c)
            lists.append(lin + ds_start[d])
        ptr, blk = merge_fields(counts, lists)
        ptrs.append(ptr[1:] + base)
        base += int(ptr[-1])
        ids.append(blk)
    return np.concatenate(ptrs), (np.concatenate(ids) if ids else np.zeros(0, np.int64))


def _parents(info, chunk, part, n_roles: int) -> Tuple[np.ndarray, np.ndarray]:
    """For every block of grid ``part`` of one dataset: ``(its chunk's linear index in grid chunk, the
    part's byte offset in the decoded chunk)``."""
    pgrid = chunk_grid(info.shape, part)
    cgrid = chunk_grid(info.shape, chunk)
    coords = np.unravel_index(np.arange(int(np.prod(pgrid, dtype=np.int64)), dtype=np.int64), pgrid)
    ccoords = [c // (chunk[i] if i < n_roles else 1) for i, c in enumerate(coords)]
    parent = np.ravel_multi_index(ccoords, cgrid).astype(np.int64) if coords else np.zeros(1, np.int64)
    inner = [coords[i] % chunk[i] for i in range(n_roles)]  # the part's place along the chunk's sample axes
    row = np.ravel_multi_index(inner, tuple(chunk[:n_roles])).astype(np.int64) if n_roles else \
        np.zeros_like(parent)
    row_bytes = int(np.prod(chunk[n_roles:], dtype=np.int64)) * info.itemsize
    return parent, row * row_bytes


def _starts(datasets, shapes) -> np.ndarray:
    """int64[D+1]: the first block of each dataset over blocks of ``shapes``."""
    starts = np.zeros(len(shapes) + 1, dtype=np.int64)
    for d, (info, shp) in enumerate(zip(datasets, shapes)):
        starts[d + 1] = starts[d] + int(np.prod(chunk_grid(info.shape, shp), dtype=np.int64))
    return starts


def _block_nbytes(datasets, shapes, starts) -> np.ndarray:
    """int64[B]: decoded bytes of each block of ``shapes``."""
    nbytes = np.empty(int(starts[-1]), dtype=np.int64)
    for d, (info, shp) in enumerate(zip(datasets, shapes)):
        nbytes[starts[d]:starts[d + 1]] = int(np.prod(shp, dtype=np.int64)) * info.itemsize
    return nbytes


def _part_map(datasets, shapes, chunks, roles_of) -> Tuple[np.ndarray, np.ndarray]:
    """``(block_parent, part_offset)`` of the blocks of ``shapes`` (parts) over those of ``chunks`` (whole
    chunks), dataset by dataset: a dataset whose shapes agree is its own parts."""
    starts, c_starts = _starts(datasets, shapes), _starts(datasets, chunks)
    parent = np.empty(int(starts[-1]), dtype=np.int64)
    offset = np.zeros(int(starts[-1]), dtype=np.int64)
    for d, (info, shp, chunk) in enumerate(zip(datasets, shapes, chunks)):
        lo, hi = int(starts[d]), int(starts[d + 1])
        if tuple(shp) == tuple(chunk):
            parent[lo:hi] = c_starts[d] + np.arange(hi - lo, dtype=np.int64)
        else:
            p, off = _parents(info, tuple(chunk), tuple(shp), len(roles_of[d]))
            parent[lo:hi] = c_starts[d] + p
            offset[lo:hi] = off
    return parent, offset


def split_chunks(layout) -> Optional[Layout]:
    """The layout of parts of ``layout`` (see the module), or None when no chunk holds more than one step
    of a sample axis (nothing to cut: contiguous data, one-row chunks).  Its fingerprint is that of its own
    block map (a plan on parts names parts), computed with the files' stats now; a LayoutError if the files
    changed since ``layout`` was built."""
    if is_parts(layout):
        return layout
    shapes = part_shapes(layout)
    if all(tuple(s) == tuple(b) for s, b in zip(shapes, layout.block_shapes)):
        return None
    roles_of = _roles_of(layout)
    from .limits import check_layout_size
    check_layout_size(layout.datasets, shapes, layout.sources, layout.files)  # the builder's limits, on parts
    starts = _starts(layout.datasets, shapes)
    parent, offset = _part_map(layout.datasets, shapes, layout.block_shapes, roles_of)
    nbytes = _block_nbytes(layout.datasets, shapes, starts)
    sample_ptr, sample_blocks = _sample_lists(layout, shapes, starts)
    arrays = dict(sample_ptr=sample_ptr, sample_blocks=sample_blocks,
                  block_dataset=layout.block_dataset[parent], block_offset=layout.block_offset[parent],
                  block_stored=layout.block_stored[parent], block_nbytes=nbytes,
                  block_mask=layout.block_mask[parent], dataset_block_start=starts,
                  source_start=layout.source_start, block_parent=parent, part_offset=offset)
    from .build import fingerprint
    try:
        if fingerprint(layout.spec, layout.files, layout.datasets, _arrays(layout)) != layout.fingerprint:
            raise LayoutError(f"the data in {layout.spec.root} changed since its layout was built; build it again")
        fp = fingerprint(layout.spec, layout.files, layout.datasets, arrays)
    except OSError as exc:
        raise LayoutError(f"a data file vanished: {exc}") from None
    out = Layout(layout.spec, layout.files, layout.datasets, tuple(shapes), layout.sources, arrays, fp)
    out._chunks = layout
    return out


def extent_of(layout) -> Optional[np.ndarray]:
    """int64[B] the chunk of each block of a layout of parts (None for any other layout, or None)."""
    return getattr(layout, "block_parent", None) if layout is not None else None


def stored_once(block_stored: np.ndarray, extent: Optional[np.ndarray], blocks: np.ndarray) -> int:
    """Storage bytes of reading ``blocks`` in one request: each chunk once (``extent``: :func:`extent_of`)."""
    blocks = np.asarray(blocks, dtype=np.int64)
    if extent is None or blocks.size < 2:
        return int(block_stored[blocks].sum())
    _, first = np.unique(extent[blocks], return_index=True)
    return int(block_stored[blocks[first]].sum())


def _arrays(layout) -> dict:
    return {k: getattr(layout, k) for k in ("block_offset", "block_stored", "block_mask")}


def chunks_of(layout) -> Layout:
    """The layout of whole chunks a layout of parts was cut from (``layout`` itself if it is not one):
    what readers read.  Rebuilt from the parts' arrays when the layout of parts was read from a schedule."""
    if not is_parts(layout):
        return layout
    got = getattr(layout, "_chunks", None)
    if got is not None:
        return got
    shapes = []
    roles_of = _roles_of(layout)
    for d, (info, shp) in enumerate(zip(layout.datasets, layout.block_shapes)):
        shapes.append(tuple(info.chunks) if info.chunks is not None and roles_of.get(d) else tuple(shp))
    starts = _starts(layout.datasets, shapes)
    B = int(starts[-1])
    parent = layout.block_parent
    first = np.full(B, -1, dtype=np.int64)  # a part of each chunk (the first)
    first[parent[::-1]] = np.arange(parent.shape[0] - 1, -1, -1, dtype=np.int64)
    if parent.min(initial=0) < 0 or parent.max(initial=-1) >= B or (first < 0).any():
        raise LayoutError("the layout of parts does not cover its chunks (damaged)")
    nbytes = _block_nbytes(layout.datasets, shapes, starts)
    sample_ptr, sample_blocks = _sample_lists(layout, shapes, starts)
    arrays = dict(sample_ptr=sample_ptr, sample_blocks=sample_blocks, block_dataset=layout.block_dataset[first],
                  block_offset=layout.block_offset[first], block_stored=layout.block_stored[first],
                  block_nbytes=nbytes, block_mask=layout.block_mask[first], dataset_block_start=starts,
                  source_start=layout.source_start)
    out = Layout(layout.spec, layout.files, layout.datasets, tuple(shapes), layout.sources, arrays,
                 layout.fingerprint + ":chunks")
    layout._chunks = out
    return out


def restore_parts(layout) -> Layout:
    """A layout read back from a schedule whose block shapes are parts (see :func:`part_shapes`) gets its
    :data:`PART_ARRAYS` again, computed from its datasets' chunk shapes; any other layout is returned as is."""
    roles_of = _roles_of(layout)
    cut = [info.chunks is not None and roles_of.get(d) and tuple(shp) != tuple(info.chunks)
           for d, (info, shp) in enumerate(zip(layout.datasets, layout.block_shapes))]
    if not any(cut) or is_parts(layout):
        return layout
    chunks = [tuple(info.chunks) if c else tuple(shp) for info, shp, c in zip(layout.datasets, layout.block_shapes,
                                                                                cut)]
    parent, offset = _part_map(layout.datasets, layout.block_shapes, chunks, roles_of)
    arrays = {k: getattr(layout, k) for k in ("sample_ptr", "sample_blocks", "block_dataset", "block_offset",
                                              "block_stored", "block_nbytes", "block_mask", "dataset_block_start",
                                              "source_start")}
    arrays.update(block_parent=parent, part_offset=offset)
    return Layout(layout.spec, layout.files, layout.datasets, layout.block_shapes, layout.sources, arrays,
                  layout.fingerprint)
