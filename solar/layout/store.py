"""A :class:`Layout` as flat arrays and back: what ``solar plan`` stores in a schedule file so
that no rank of the job needs HDF5 metadata (format version 3, group ``/layout``).

:func:`encode` gives a JSON document and named arrays; :func:`decode` rebuilds the
Layout from them (plus the sample -> blocks map and block sizes, which the schedule
already holds in ``/demand``).  Arrays (F files, D datasets, S sources, B blocks,
K fields, M blocks with a non-zero filter mask):

=======================  ===============  ==============================================
``files``                uint8[...]       file names relative to the spec's root, NUL-separated
``file_size``            int64[F]         bytes of each file when planned
``file_mtime_ns``        int64[F]         modification time of each file when planned (ns)
``ds_ints``              int64[D, 3]      dataset: file index, offset (-1: none), stored bytes
``ds_cols``              int32[D, 9]      dataset: row of each :data:`DS_TABLES` table
``src_ints``             int64[S, 6]      source: file, n_samples, n_traj, n_steps, window, dt
``src_cols``             int32[S, 3]      source: row of each :data:`SRC_TABLES` table
``src_datasets``         int64[S, K]      source: dataset of each field
``block_offset``         int64[B]         file byte offset of each block (-1: never written)
``dataset_block_start``  int64[D+1]       first block of each dataset
``source_start``         int64[S+1]       first sample of each source
``mask_blocks``          int64[M]         blocks whose filter mask is not 0 ...
``mask_values``          uint32[M]        ... and their masks
=======================  ===============  ==============================================

The JSON document holds the spec and the tables of distinct values (dataset names, shapes,
dtypes, chunk shapes, filter pipelines, fill values...: one-file-per-sample datasets repeat
the same few).  :func:`decode` checks everything it reads and raises :class:`StoreDamaged`.
"""
from __future__ import annotations

import json
import math
import os
import struct
from typing import Dict, List, Sequence, Tuple

import numpy as np

from ..errors import SolarError
from ..io.filters import Filter
from .blocks import chunk_grid
from .h5meta import DatasetInfo
from .layout import Layout
from .sources import Source
from .spec import LayoutSpec

DS_TABLES = ("name", "shape", "dtype", "chunks", "filters", "fillvalue", "raw", "fallback", "block_shape")
"""Columns of ``ds_cols``: DatasetInfo fields (and the block shape) stored as rows of a table."""
SRC_INTS = ("file", "n_samples", "n_traj", "n_steps", "window", "dt")
SRC_TABLES = ("kind", "group", "roles")
ARRAYS = {"files": "u1", "file_size": "<i8", "file_mtime_ns": "<i8", "ds_ints": "<i8", "ds_cols": "<i4",
          "src_ints": "<i8", "src_cols": "<i4", "src_datasets": "<i8", "block_offset": "<i8",
          "dataset_block_start": "<i8", "source_start": "<i8", "mask_blocks": "<i8", "mask_values": "<u4"}
"""Every stored array and its dtype (little-endian)."""


class StoreDamaged(Exception):
    """A stored layout that cannot be right (the message says which part and why)."""


# ------------------------------------------------------------------ encode
def _jsonable(field: str, value):
    """A DatasetInfo / Source value in JSON form (tuples as lists, filters as [id, flags, values])."""
    if field == "filters":
        return [[int(f.id), int(f.flags), [int(v) for v in f.values]] for f in value]
    if field == "fillvalue" and isinstance(value, complex):
        return {"complex": [_jsonable(field, value.real), _jsonable(field, value.imag)]}
    if field == "fillvalue" and isinstance(value, float) and math.isnan(value):
        return {"nan": struct.pack("<d", value).hex()}  # JSON's NaN would lose the payload bits
    if isinstance(value, tuple):
        return [int(v) if isinstance(v, (int, np.integer)) else v for v in value]
    return value


def _table_column(values: Sequence, field: str, tables: Dict[str, list]) -> np.ndarray:
    """int32[n]: the row of each value in ``tables[field]`` (distinct JSON forms, in first-seen order)."""
    rows: Dict[str, int] = {}
    out = np.empty(len(values), dtype="<i4")
    for i, v in enumerate(values):
        key = json.dumps(_jsonable(field, v), sort_keys=True)
        out[i] = rows.setdefault(key, len(rows))
    tables[field] = [json.loads(k) for k in rows]
    return out


def file_stats(paths: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
    """``(size int64[F] bytes, mtime int64[F] ns)`` of each file now (one ``stat`` each)."""
    size = np.empty(len(paths), dtype="<i8")
    mtime = np.empty(len(paths), dtype="<i8")
    for i, p in enumerate(paths):
        st = os.stat(p)
        size[i], mtime[i] = st.st_size, st.st_mtime_ns
    return size, mtime


def encode(layout: Layout) -> Tuple[dict, Dict[str, np.ndarray]]:
    """``(JSON document, arrays)`` of ``layout`` (see the module docstring); stats every file once.

    ``/demand``'s arrays (sample -> blocks, block sizes) are not repeated here.
    """
    root = os.path.abspath(layout.spec.root)
    names = [os.fsencode(os.path.relpath(os.path.abspath(p), root)) for p in layout.files]
    size, mtime = file_stats(layout.files)
    tables: Dict[str, list] = {}
    ds = layout.datasets
    ds_cols = np.stack([_table_column([getattr(d, f) for d in ds], f, tables) for f in DS_TABLES[:-1]]
                       + [_table_column(layout.block_shapes, "block_shape", tables)], axis=1).astype("<i4")
    ds_ints = np.array([[d.file, -1 if d.offset is None else d.offset, d.stored_nbytes] for d in ds],
                       dtype="<i8").reshape(len(ds), 3)
    src = layout.sources
    src_cols = np.stack([_table_column([getattr(s, f) for s in src], f, tables) for f in SRC_TABLES],
                        axis=1).astype("<i4")
    src_ints = np.array([[getattr(s, f) for f in SRC_INTS] for s in src], dtype="<i8").reshape(len(src), 6)
    src_datasets = np.array([s.datasets for s in src], dtype="<i8").reshape(len(src), len(layout.spec.fields))
    masked = np.flatnonzero(layout.block_mask)
    arrays = {"files": np.frombuffer(b"\0".join(names), dtype="u1"), "file_size": size, "file_mtime_ns": mtime,
              "ds_ints": ds_ints, "ds_cols": ds_cols, "src_ints": src_ints, "src_cols": src_cols,
              "src_datasets": src_datasets, "block_offset": layout.block_offset,
              "dataset_block_start": layout.dataset_block_start, "source_start": layout.source_start,
              "mask_blocks": masked, "mask_values": layout.block_mask[masked]}
    doc = {"spec": layout.spec.to_dict(), "tables": tables, "n_files": len(layout.files)}
    return doc, {k: np.ascontiguousarray(v, dtype=ARRAYS[k]) for k, v in arrays.items()}


# ------------------------------------------------------------------ decode
def _expect(ok: bool, what: str):
    if not ok:
        raise StoreDamaged(what)


def _tuple(v, what: str, allow_none: bool = False):
    if v is None and allow_none:
        return None
    _expect(isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
            f"{what} is {str(v)[:40]}, expected a list of integers")
    return tuple(v)


def _filters(v) -> Tuple[Filter, ...]:
    _expect(isinstance(v, list) and all(isinstance(f, list) and len(f) == 3 for f in v),
            f"filter pipeline {str(v)[:40]} is not a list of [id, flags, values]")
    return tuple(Filter(int(i), int(fl), _tuple(vals, "filter values")) for i, fl, vals in v)


def _fill(v):
    if isinstance(v, dict) and "complex" in v:
        _expect(isinstance(v["complex"], list) and len(v["complex"]) == 2, f"fill value {str(v)[:40]} is not a number")
        re, im = (_fill(x) for x in v["complex"])
        return complex(re, im)
    if isinstance(v, dict) and "nan" in v:
        try:
            bits = bytes.fromhex(v["nan"])
        except (TypeError, ValueError):
            bits = b""
        _expect(len(bits) == 8, f"fill value {str(v)[:40]} is not a number")
        return struct.unpack("<d", bits)[0]
    _expect(isinstance(v, (int, float, bool)), f"fill value {str(v)[:40]} is not a number")
    return v


_DECODE = {"name": lambda v: _text(v, "dataset name"), "shape": lambda v: _tuple(v, "a shape"),
           "dtype": lambda v: _dtype(v), "chunks": lambda v: _tuple(v, "chunks", True),
           "filters": _filters, "fillvalue": _fill, "raw": lambda v: _flag(v, "raw"),
           "fallback": lambda v: _text(v, "fallback"), "block_shape": lambda v: _tuple(v, "a block shape"),
           "kind": lambda v: _text(v, "source kind"), "group": lambda v: _text(v, "group"),
           "roles": lambda v: tuple(_text(r, "roles") for r in _list(v, "roles"))}


def _text(v, what: str) -> str:
    _expect(isinstance(v, str), f"{what} {str(v)[:40]!r} is not text")
    return v


def _dtype(v) -> str:
    """A numeric dtype string as DatasetInfo keeps it (``'<f4'``: byte order kept)."""
    _expect(isinstance(v, str) and np.dtype(v).kind in "biufc", f"dtype {str(v)[:40]!r} is not numeric")
    return v


def _flag(v, what: str) -> bool:
    _expect(isinstance(v, bool), f"{what} is {str(v)[:40]!r}, expected true or false")
    return v


def _list(v, what: str) -> list:
    _expect(isinstance(v, list), f"{what} is {type(v).__name__}, expected a list")
    return v


def _columns(cols: np.ndarray, fields: Sequence[str], tables: dict) -> List[list]:
    """Per field, the decoded table row of every record (``cols`` int32[n, len(fields)])."""
    out = []
    for k, f in enumerate(fields):
        table = [_DECODE[f](v) for v in _list(tables.get(f), f"table {f}")]
        col = cols[:, k]
        _expect(not col.size or (int(col.min()) >= 0 and int(col.max()) < len(table)),
                f"a row of table {f} outside [0, {len(table)})")
        out.append([table[i] for i in col.tolist()])
    return out


def _in_range(arr: np.ndarray, lo: int, hi: int, what: str):
    _expect(not arr.size or (int(arr.min()) >= lo and int(arr.max()) < hi), f"{what} outside [{lo}, {hi})")


def _starts(arr: np.ndarray, end: int, what: str):
    """CSR start array: from 0, never decreasing, ending at ``end``."""
    _expect(arr.shape[0] >= 1 and arr[0] == 0 and arr[-1] == end and bool((np.diff(arr) >= 0).all()),
            f"{what} is not a start array from 0 to {end}")


def _datasets(a: Dict[str, np.ndarray], tables: dict, n_files: int):
    """``(DatasetInfo tuple, block shapes)`` from ``ds_ints``/``ds_cols`` and the tables."""
    ints = a["ds_ints"]
    _in_range(ints[:, 0], 0, n_files, "a dataset's file index")
    _in_range(ints[:, 1:], -1, 2**63 - 1, "a dataset's offset or size")
    name, shape, dtype, chunks, filters, fill, raw, fallback, block_shape = _columns(a["ds_cols"], DS_TABLES, tables)
    f, off, stored = (c.tolist() for c in ints.T)
    infos = tuple(DatasetInfo(*row[:6], None if row[6] < 0 else row[6], *row[7:])
                  for row in zip(f, name, shape, dtype, chunks, filters, off, stored, fill, raw, fallback))
    return infos, tuple(block_shape)


def _sources(a: Dict[str, np.ndarray], tables: dict, n_files: int, n_datasets: int):
    ints, dsets = a["src_ints"], a["src_datasets"]
    _in_range(ints[:, 0], 0, n_files, "a source's file index")
    _in_range(ints[:, 1:], 0, 2**62, "a source's sizes")
    _in_range(dsets, 0, n_datasets, "a source's dataset")
    cols = _columns(a["src_cols"], SRC_TABLES, tables)
    out = []
    for i, (row, ds) in enumerate(zip(ints.tolist(), dsets.tolist())):
        kw = dict(zip(SRC_INTS, row))
        out.append(Source(kind=cols[0][i], group=cols[1][i], roles=cols[2][i], datasets=tuple(ds), **kw))
    return tuple(out)


def _file_names(raw: np.ndarray, root: str, n_files: int) -> Tuple[str, ...]:
    names = raw.tobytes().split(b"\0") if raw.size else []
    _expect(len(names) == n_files and all(names), f"files holds {len(names)} names, expected {n_files}")
    prefix = os.path.join(root, "")
    return tuple(prefix + os.fsdecode(n) for n in names)


def _blocks_per_dataset(cols: np.ndarray, datasets, block_shapes) -> np.ndarray:
    """int64[D]: blocks of each dataset, computed once per distinct (shape, block shape) pair of ``cols``."""
    pairs = cols[:, [DS_TABLES.index("shape"), DS_TABLES.index("block_shape")]]
    if not pairs.size:
        return np.zeros(0, dtype=np.int64)
    _, first, inverse = np.unique(pairs, axis=0, return_index=True, return_inverse=True)
    counts = np.array([int(np.prod(chunk_grid(datasets[i].shape, block_shapes[i]), dtype=np.int64)) for i in first],
                      dtype=np.int64)
    return counts[inverse.reshape(-1)]


def shapes(doc: dict, n_blocks: int) -> Dict[str, Tuple]:
    """The shape each array must have (None: any length) given the JSON document and B (checked
    before anything is read)."""
    tables, spec = doc.get("tables"), doc.get("spec")
    _expect(isinstance(tables, dict) and isinstance(spec, dict), "the document lacks spec or tables")
    n_files, n_fields = doc.get("n_files"), len(_list(spec.get("fields"), "spec fields"))
    _expect(isinstance(n_files, int) and n_files >= 1, f"n_files is {n_files!r}")
    return {"files": (None,), "file_size": (n_files,), "file_mtime_ns": (n_files,), "ds_ints": (None, 3),
            "ds_cols": (None, len(DS_TABLES)), "src_ints": (None, len(SRC_INTS)), "src_cols": (None, len(SRC_TABLES)),
            "src_datasets": (None, n_fields), "block_offset": (n_blocks,), "dataset_block_start": (None,),
            "source_start": (None,), "mask_blocks": (None,), "mask_values": (None,)}


def decode(doc: dict, a: Dict[str, np.ndarray], demand: Dict[str, np.ndarray], root: str,
           fingerprint: str) -> Layout:
    """The :class:`Layout` stored as ``doc`` and arrays ``a`` (shapes as :func:`shapes` says), with
    ``demand``'s ``sample_ptr``, ``sample_blocks``, ``block_nbytes``, ``block_stored`` and the data
    folder ``root``.  Raises :class:`StoreDamaged` on anything inconsistent."""
    try:
        return _decode(doc, a, demand, root, fingerprint)
    except StoreDamaged:
        raise
    except (SolarError, AssertionError, TypeError, ValueError, KeyError, IndexError, OverflowError) as exc:
        raise StoreDamaged(f"{type(exc).__name__}: {exc}") from None


def _decode(doc, a, demand, root, fingerprint) -> Layout:
    spec = LayoutSpec.from_dict(doc["spec"], root=root)
    n_files, tables = doc["n_files"], doc["tables"]
    n_blocks = int(demand["block_nbytes"].shape[0])
    n_ds, n_src = a["ds_ints"].shape[0], a["src_ints"].shape[0]
    _expect(a["ds_cols"].shape[0] == n_ds and a["dataset_block_start"].shape == (n_ds + 1,),
            f"dataset arrays disagree on the dataset count {n_ds}")
    _expect(a["src_cols"].shape[0] == n_src == a["src_datasets"].shape[0] and a["source_start"].shape ==
            (n_src + 1,), f"source arrays disagree on the source count {n_src}")
    _starts(a["dataset_block_start"], n_blocks, "dataset_block_start")
    _starts(a["source_start"], int(demand["sample_ptr"].shape[0] - 1), "source_start")
    _in_range(a["block_offset"], -1, 2**63 - 1, "a block offset")
    _expect(a["mask_values"].shape == a["mask_blocks"].shape, "mask_blocks and mask_values differ in length")
    _in_range(a["mask_blocks"], 0, n_blocks, "a masked block")
    datasets, block_shapes = _datasets(a, tables, n_files)
    sources = _sources(a, tables, n_files, n_ds)
    per_ds = _blocks_per_dataset(a["ds_cols"], datasets, block_shapes)
    _expect(np.array_equal(per_ds, np.diff(a["dataset_block_start"])), "dataset_block_start disagrees with the shapes")
    _expect(np.array_equal(a["src_ints"][:, 1], np.diff(a["source_start"])),
            "source_start disagrees with the sources' sample counts")
    mask = np.zeros(n_blocks, dtype=np.uint32)
    mask[a["mask_blocks"]] = a["mask_values"]
    arrays = {"sample_ptr": demand["sample_ptr"], "sample_blocks": demand["sample_blocks"].astype(np.int64),
              "block_nbytes": demand["block_nbytes"], "block_stored": demand["block_stored"],
              "block_dataset": np.repeat(np.arange(n_ds, dtype=np.int32), per_ds),
              "block_offset": a["block_offset"], "block_mask": mask,
              "dataset_block_start": a["dataset_block_start"], "source_start": a["source_start"]}
    files = _file_names(a["files"], root, n_files)
    return Layout(spec, files, datasets, block_shapes, sources, arrays, fingerprint)
