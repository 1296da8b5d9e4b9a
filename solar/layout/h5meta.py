"""Read one HDF5 dataset's storage metadata with h5py (the only h5py use of the layout).

For a chunked dataset: chunk shape, filter pipeline and, per chunk, byte offset,
stored size and filter mask (``chunk_iter`` when HDF5 has it).  For a contiguous
dataset: its byte offset.  Nothing here reads data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import h5py
import numpy as np

from ..errors import LayoutError
from ..io.filters import DECODERS, Filter, filter_name

_LOOKUP_ERRORS = (KeyError, OSError, ValueError, TypeError)


@dataclass(frozen=True)
class DatasetInfo:
    """Storage facts of one HDF5 dataset (``file`` indexes ``Layout.files``).

    ``chunks`` is the real chunk shape, or None for contiguous storage;
    ``offset`` the contiguous data's file offset (None when chunked).
    ``raw`` says whether solar's raw reader can serve it; otherwise
    ``fallback`` says why the h5py reader must.
    """

    file: int
    name: str
    shape: Tuple[int, ...]
    dtype: str
    chunks: Optional[Tuple[int, ...]]
    filters: Tuple[Filter, ...]
    offset: Optional[int]
    stored_nbytes: int
    fillvalue: float = 0
    raw: bool = True
    fallback: str = ""

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize

    @property
    def where(self) -> str:
        return self.name


def _check_dtype(dset, where: str) -> np.dtype:
    dt = dset.dtype
    if dt.kind not in "biufc" or dt.fields is not None or dt.subdtype is not None:
        raise LayoutError(f"{where} has non-numeric dtype {dt}; solar serves numeric arrays only")
    return dt


def read_dataset_info(h5file: h5py.File, file_idx: int, path: str, where: str):
    """Return ``(DatasetInfo, chunk_table)`` for dataset ``path`` of an open file.

    ``chunk_table`` is None for contiguous data, else a dict of arrays over the
    chunk grid in row-major order: ``offset`` (int64, -1 if unallocated),
    ``nbytes`` (int64 stored size) and ``mask`` (uint32 filter mask).
    """
    try:
        obj = h5file[path]
    except _LOOKUP_ERRORS:
        raise LayoutError(f"dataset {path!r} not found in {h5file.filename}") from None
    if not isinstance(obj, h5py.Dataset):
        raise LayoutError(f"{where} is a group, not a dataset")
    dt = _check_dtype(obj, where)
    if obj.shape is None:
        raise LayoutError(f"{where} is empty (null dataspace)")
    shape = tuple(int(s) for s in obj.shape)
    if any(s == 0 for s in shape):
        raise LayoutError(f"{where} is empty (shape {shape})")
    dsid = obj.id
    plist = dsid.get_create_plist()
    filters = []
    for i in range(plist.get_nfilters()):
        code, flags, values, _name = plist.get_filter(i)
        filters.append(Filter(int(code), int(flags), tuple(int(v) for v in values)))
    filters = tuple(filters)
    raw, fallback = True, ""
    for f in filters:
        if f.id not in DECODERS:
            if h5py.h5z.filter_avail(f.id):
                raw, fallback = False, f"filter {f.name} is decoded by HDF5 only (h5py reader)"
            else:
                raise LayoutError(
                    f"{where} uses HDF5 filter {filter_name(f.id)} (id {f.id}), which neither solar "
                    f"nor this HDF5 build can decode (install the plugin, e.g. hdf5plugin)")
    layout = plist.get_layout()
    try:
        fill = obj.fillvalue
        fill = fill.item() if hasattr(fill, "item") else fill
    except Exception:  # pragma: no cover - exotic fill values
        fill = 0
    if obj.chunks is None:
        if layout != h5py.h5d.CONTIGUOUS:
            raw, fallback = False, "compact or virtual storage (no byte range to read)"
            offset = None
        else:
            offset = dsid.get_offset()
            if offset is None:
                raise LayoutError(f"{where} has no data written (no storage allocated)")
        info = DatasetInfo(file_idx, path, shape, dt.str, None, filters, offset,
                           int(dsid.get_storage_size()), fill, raw, fallback)
        return info, None
    chunks = tuple(int(c) for c in obj.chunks)
    grid = tuple(-(-s // c) for s, c in zip(shape, chunks))
    n = int(np.prod(grid, dtype=np.int64))
    offs = np.full(n, -1, dtype=np.int64)
    sizes = np.zeros(n, dtype=np.int64)
    masks = np.zeros(n, dtype=np.uint32)
    strides = np.array([int(np.prod(grid[k + 1:], dtype=np.int64)) for k in range(len(grid))], dtype=np.int64)
    chunk_arr = np.array(chunks, dtype=np.int64)

    if hasattr(dsid, "chunk_iter"):
        recs = []
        dsid.chunk_iter(lambda si: recs.append((si.chunk_offset, si.byte_offset, si.size, si.filter_mask)))
    else:  # older HDF5: one call per chunk
        recs = []
        for i in range(dsid.get_num_chunks()):
            si = dsid.get_chunk_info(i)
            recs.append((si.chunk_offset, si.byte_offset, si.size, si.filter_mask))
    if recs:
        coords = np.array([r[0] for r in recs], dtype=np.int64).reshape(len(recs), len(shape))  # (nrec, ndim)
        lin = (coords // chunk_arr) @ strides
        offs[lin] = np.array([r[1] for r in recs], dtype=np.int64)
        sizes[lin] = np.array([r[2] for r in recs], dtype=np.int64)
        masks[lin] = np.array([r[3] for r in recs], dtype=np.uint32)
    info = DatasetInfo(file_idx, path, shape, dt.str, chunks, filters, None,
                       int(dsid.get_storage_size()), fill, raw, fallback)
    return info, {"offset": offs, "nbytes": sizes, "mask": masks}
