"""Read one HDF5 dataset's storage metadata with h5py (the only h5py use of the layout).

For a chunked dataset: chunk shape, filter pipeline and, per chunk, byte offset,
stored size and filter mask (``chunk_iter`` when HDF5 has it).  For a contiguous
dataset: its byte offset, or None when it was never written (it reads as its
fill value) or its bytes are not in the file (compact, virtual, external raw
storage: those are marked for the h5py reader).  Nothing here reads data.

Damaged files: every byte range is checked against the file size, every chunk
against the chunk grid, and a chunk grid larger than :data:`MAX_BLOCKS` is
refused before any array of that size exists (:mod:`solar.layout.limits`);
HDF5's own errors become :class:`~solar.errors.LayoutError` naming the dataset.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

import h5py
import numpy as np

from ..errors import LayoutError, SolarError
from ..io.filters import Filter, decodable, filter_name
from .h5capi import DONT_FILTER_PARTIAL_CHUNKS, chunk_opts
from .limits import MAX_BLOCKS, check_count

_LOOKUP_ERRORS = (KeyError, OSError, ValueError, TypeError, RuntimeError)
# what h5py raises on metadata it cannot parse (damaged headers, chunk indexes, attributes)
H5_ERRORS = (OSError, RuntimeError, ValueError, TypeError, KeyError, IndexError, OverflowError, SystemError)

MAX_CHUNK_BYTES = (1 << 32) - 1
"""HDF5's own limit on the decoded size of one chunk (4 GiB - 1)."""


@dataclass(frozen=True)
class DatasetInfo:
    """Storage facts of one HDF5 dataset (``file`` indexes ``Layout.files``).

    ``chunks`` is the real chunk shape, or None for contiguous storage;
    ``offset`` the contiguous data's file offset (None when chunked, never
    written, or not stored in the file).  ``raw`` says whether solar's raw
    reader can serve it; otherwise ``fallback`` says why the h5py reader must.
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _check_dtype(dset, where: str) -> np.dtype:
    dt = dset.dtype
    if dt.kind not in "biufc" or dt.fields is not None or dt.subdtype is not None:
        raise LayoutError(f"{where} has non-numeric dtype {dt}; solar serves numeric arrays only")
    return dt


def _plain_type(tid, dt: np.dtype) -> bool:
    """Whether HDF5 file type ``tid`` stores each value as numpy's ``dt`` does, byte for byte.

    h5py gives a 12-bit integer in 2 bytes (``H5Tset_precision``), one at a bit offset, or a float
    with its own exponent and mantissa fields the nearest numpy dtype; HDF5 converts those on read
    (sign extension, shifts), so their stored bytes are not that dtype's bytes."""
    h5t = h5py.h5t
    cls = tid.get_class()
    if tid.get_size() != dt.itemsize:
        return False
    if cls == h5t.INTEGER:
        return tid.get_precision() == 8 * dt.itemsize and tid.get_offset() == 0
    if cls == h5t.BITFIELD:  # h5py gives no precision of a bitfield: it must equal a standard one
        return any(tid.equal(getattr(h5t, f"STD_B{8 * dt.itemsize}{o}", h5t.STD_B8LE)) for o in ("LE", "BE"))
    if cls == h5t.ENUM:  # bool, and h5py's enums: plain when their integer base is
        return _plain_type(tid.get_super(), dt)
    if cls == h5t.FLOAT:
        return tid.equal(h5t.py_create(np.dtype(dt.str)))
    if cls == h5t.COMPOUND and dt.kind == "c":  # h5py's complex: (r, i) floats, packed
        half = np.dtype(f"{dt.str[0]}f{dt.itemsize // 2}")
        return tid.get_nmembers() == 2 and all(
            tid.get_member_offset(i) == i * half.itemsize and _plain_type(tid.get_member_type(i), half)
            for i in range(2))
    return False


def _filters(plist, where: str):
    """``(filters, raw, fallback)`` of a dataset creation property list."""
    filters = []
    for i in range(plist.get_nfilters()):
        code, flags, values, _name = plist.get_filter(i)
        filters.append(Filter(int(code), int(flags), tuple(int(v) for v in values)))
    raw, fallback = True, ""
    for f in filters:
        if not decodable(f):
            if h5py.h5z.filter_avail(f.id):
                raw, fallback = False, f"filter {f.name} is decoded by HDF5 only (h5py reader)"
            else:
                raise LayoutError(
                    f"{where} uses HDF5 filter {filter_name(f.id)} (id {f.id}), which neither solar "
                    f"nor this HDF5 build can decode (install the plugin, e.g. hdf5plugin)")
    return tuple(filters), raw, fallback


UNDEFINED_FILL = "its fill value is undefined and parts of it were never written: HDF5 decides what they read " \
                 "as (h5py reader)"


def _fillvalue(obj, plist, where: str):
    """The dataset's fill value as a Python scalar (what HDF5 returns for unwritten data); None when the file
    leaves it undefined (``H5Pset_fill_value(..., NULL)``, as older PyTables wrote): h5py cannot read it."""
    if plist.fill_value_defined() == h5py.h5d.FILL_VALUE_UNDEFINED:
        return None
    fill = obj.fillvalue
    try:
        return fill.item() if hasattr(fill, "item") else fill
    except (ValueError, TypeError):
        raise LayoutError(f"{where} has an unreadable fill value {fill!r}") from None


def external_files(plist, h5path: str, where: str) -> Tuple[str, ...]:
    """Paths of a dataset's external raw storage files, resolved as HDF5 resolves them.

    A relative name is taken relative to ``HDF5_EXTFILE_PREFIX`` (``${ORIGIN}``:
    the HDF5 file's folder) or else the current directory; a missing file is a
    LayoutError naming it.
    """
    prefix = os.environ.get("HDF5_EXTFILE_PREFIX", "")
    prefix = prefix.replace("${ORIGIN}", os.path.dirname(os.path.abspath(h5path)))
    out = []
    for i in range(plist.get_external_count()):
        name = plist.get_external(i)[0]
        name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        path = name if os.path.isabs(name) else os.path.join(prefix or os.getcwd(), name)
        if not os.path.isfile(path):
            raise LayoutError(
                f"{where} keeps its data in external raw file {name!r}, not found at {path} (HDF5 looks "
                f"relative to the current directory, or to HDF5_EXTFILE_PREFIX; '${{ORIGIN}}' = the file's folder)")
        out.append(name)
    return tuple(out)


def _contiguous(dsid, plist, h5path: str, where: str, nbytes: int, file_size: int):
    """``(offset or None, raw, fallback)`` of a dataset without chunks."""
    layout = plist.get_layout()
    if layout != h5py.h5d.CONTIGUOUS:
        return None, False, "compact or virtual storage (no byte range to read)"
    if plist.get_external_count() > 0:
        names = external_files(plist, h5path, where)
        return None, False, f"external raw storage in {', '.join(names)} (HDF5 reads it: h5py reader)"
    offset = dsid.get_offset()
    if offset is None:  # never written: no storage allocated, HDF5 returns the fill value
        return None, True, ""
    offset = int(offset)
    if offset < 0 or offset + nbytes > file_size:
        raise LayoutError(f"{where} has its data at bytes [{offset}, {offset + nbytes}) but the file has "
                          f"{file_size} bytes (truncated or damaged)")
    return offset, True, ""


def _chunk_records(dsid, limit: int, where: str):
    """``(coords, offset, size, mask)`` of each written chunk, in index order.

    A chunk index listing more than ``limit`` chunks (the grid size) is damaged:
    iteration stops there with a LayoutError, before the list grows further.
    """
    recs = []

    def take(si):
        recs.append((si.chunk_offset, si.byte_offset, si.size, si.filter_mask))
        return True if len(recs) > limit else None  # a not-None return ends chunk_iter

    if hasattr(dsid, "chunk_iter"):
        dsid.chunk_iter(take)
        count = len(recs)
    else:  # older HDF5: one call per chunk
        count = dsid.get_num_chunks()
        for i in range(min(count, limit)):
            take(dsid.get_chunk_info(i))
    if count > limit:
        raise LayoutError(f"{where} lists more chunks than its grid of {limit} holds (damaged chunk index)")
    return recs


def _chunk_table(dsid, shape, chunks, file_size: int, where: str) -> dict:
    """Arrays over the chunk grid (row-major): ``offset`` int64 (-1: unwritten), ``nbytes`` int64, ``mask`` uint32.

    Each written chunk must sit on the grid, once, with its bytes inside the file.
    """
    grid = tuple(-(-s // c) for s, c in zip(shape, chunks))
    n = int(np.prod(grid, dtype=object))
    check_count(n, MAX_BLOCKS, "chunks", where)
    offs = np.full(n, -1, dtype=np.int64)
    sizes = np.zeros(n, dtype=np.int64)
    masks = np.zeros(n, dtype=np.uint32)
    recs = _chunk_records(dsid, n, where)
    if not recs:
        return {"offset": offs, "nbytes": sizes, "mask": masks}
    coords = np.array([tuple(r[0]) for r in recs], dtype=np.int64).reshape(len(recs), len(shape))  # (nrec, ndim)
    rec_off = np.array([r[1] if r[1] is not None else -1 for r in recs], dtype=np.int64)
    rec_size = np.array([r[2] for r in recs], dtype=np.int64)
    chunk_arr = np.array(chunks, dtype=np.int64)
    bad = (coords < 0).any(axis=1) | (coords >= np.array(shape, dtype=np.int64)).any(axis=1) \
        | (coords % chunk_arr != 0).any(axis=1)
    bad |= (rec_off < 0) | (rec_size <= 0) | (rec_size > file_size - np.maximum(rec_off, 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise LayoutError(f"{where} has a chunk at {tuple(int(c) for c in coords[i])} with bytes "
                          f"[{int(rec_off[i])}, {int(rec_off[i] + rec_size[i])}) that is off the chunk grid "
                          f"{grid} or outside the file's {file_size} bytes (damaged chunk index)")
    strides = np.array([int(np.prod(grid[k + 1:], dtype=np.int64)) for k in range(len(grid))], dtype=np.int64)
    lin = (coords // chunk_arr) @ strides
    if np.unique(lin).shape[0] != lin.shape[0]:
        raise LayoutError(f"{where} lists a chunk twice (damaged chunk index)")
    offs[lin] = rec_off
    sizes[lin] = rec_size
    masks[lin] = np.array([r[3] for r in recs], dtype=np.int64).astype(np.uint32)
    return {"offset": offs, "nbytes": sizes, "mask": masks}


def _unfiltered_edges(plist, shape, chunks, n_filters: int, table: dict) -> str:
    """Marks the partial edge chunks that HDF5 stored unfiltered as skipping every filter (in ``table["mask"]``);
    returns why the dataset must go to the h5py reader instead ("" if it need not).

    With ``H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS`` (``H5Pset_chunk_opts``) HDF5 writes the chunks that stick
    out of the dataset without their filters but with filter mask 0, and decodes them by the option; running
    the pipeline on them gives wrong bytes (shuffle) or a false checksum error.  Where the option cannot be
    read (HDF5's C library not found), a dataset with partial edge chunks goes to the h5py reader."""
    if all(s % c == 0 for s, c in zip(shape, chunks)):
        return ""  # no partial edge chunk
    opts = chunk_opts(plist)
    if opts is None:
        return "partial edge chunks, and HDF5's chunk options cannot be read here (h5py reader)"
    if opts & DONT_FILTER_PARTIAL_CHUNKS:
        edge = np.zeros(tuple(-(-s // c) for s, c in zip(shape, chunks)), dtype=bool)  # over the chunk grid
        for k, (s, c) in enumerate(zip(shape, chunks)):
            if s % c:
                edge[(slice(None),) * k + (-1,)] = True  # the last chunk along axis k is partial
        table["mask"][edge.reshape(-1)] |= np.uint32((1 << n_filters) - 1)  # (grid,) -> (n_chunks,) row-major
    return ""


def _linked(h5file: h5py.File, path: str) -> bool:
    """Whether a link named ``path`` exists (the object behind it may still be unreadable)."""
    try:
        return h5file.get(path, getlink=True) is not None
    except H5_ERRORS:
        return False


def _read_info(h5file: h5py.File, file_idx: int, path: str, where: str, obj, file_size: Optional[int]):
    if obj is None:
        try:
            obj = h5file[path]
        except _LOOKUP_ERRORS as exc:
            if _linked(h5file, path):
                raise LayoutError(f"cannot open {where}: {_first_line(exc)} (damaged file?)") from None
            raise LayoutError(f"dataset {path!r} not found in {h5file.filename}") from None
    if not isinstance(obj, h5py.Dataset):
        raise LayoutError(f"{where} is a group, not a dataset")
    dt = _check_dtype(obj, where)
    if obj.shape is None:
        raise LayoutError(f"{where} is empty (null dataspace)")
    shape = tuple(int(s) for s in obj.shape)
    if any(s == 0 for s in shape):
        raise LayoutError(f"{where} is empty (shape {shape})")
    nbytes = int(np.prod(shape, dtype=object)) * dt.itemsize
    if file_size is None:
        file_size = os.path.getsize(h5file.filename)
    dsid = obj.id
    plist = dsid.get_create_plist()
    filters, raw, fallback = _filters(plist, where)
    if not _plain_type(dsid.get_type(), dt):
        raw, fallback = False, (f"its stored type is not plain {dt} (custom precision, bit offset or float "
                                f"fields): HDF5 converts it on read (h5py reader)")
    fill = _fillvalue(obj, plist, where)
    undefined_fill = fill is None  # harmless where every byte was written; else HDF5 must read it
    fill = 0 if undefined_fill else fill
    stored = int(dsid.get_storage_size())
    if obj.chunks is None:
        offset, c_raw, c_fallback = _contiguous(dsid, plist, h5file.filename, where, nbytes, file_size)
        raw, fallback = (raw and c_raw), (fallback or c_fallback)
        if undefined_fill and raw and offset is None:
            raw, fallback = False, UNDEFINED_FILL
        return DatasetInfo(file_idx, path, shape, dt.str, None, filters, offset, stored, fill, raw, fallback), None
    chunks = tuple(int(c) for c in obj.chunks)
    if int(np.prod(chunks, dtype=object)) * dt.itemsize > MAX_CHUNK_BYTES:
        raise LayoutError(f"{where} declares chunks {chunks} of more than 4 GiB, beyond HDF5's limit (damaged header)")
    table = _chunk_table(dsid, shape, chunks, file_size, where)
    if undefined_fill and raw and (table["offset"] < 0).any():
        raw, fallback = False, UNDEFINED_FILL
    if filters and raw:
        edges = _unfiltered_edges(plist, shape, chunks, len(filters), table)
        if edges:
            raw, fallback = False, edges
    return DatasetInfo(file_idx, path, shape, dt.str, chunks, filters, None, stored, fill, raw, fallback), table


def read_dataset_info(h5file: h5py.File, file_idx: int, path: str, where: str, *, obj=None,
                      file_size: Optional[int] = None):
    """Return ``(DatasetInfo, chunk_table)`` for dataset ``path`` of an open file.

    ``obj``: the object at ``path`` when the caller has already looked it up; ``file_size``: the
    file's size in bytes when the caller knows it (else one ``stat``).

    ``chunk_table`` is None for contiguous data, else a dict of arrays over the
    chunk grid in row-major order: ``offset`` (int64, -1 if unallocated),
    ``nbytes`` (int64 stored size) and ``mask`` (uint32 filter mask).
    Raises LayoutError for anything HDF5 cannot parse or that points outside the file.
    """
    try:
        return _read_info(h5file, file_idx, path, where, obj, file_size)
    except SolarError:
        raise
    except H5_ERRORS as exc:
        raise LayoutError(f"cannot read the metadata of {where}: {_first_line(exc)} (damaged file?)") from None
