"""Build a :class:`Layout` from a :class:`LayoutSpec` by reading HDF5 metadata."""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from dataclasses import replace
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import h5py
import numpy as np

from ..errors import LayoutError
from ..io.h5open import follow, open_readonly
from .blocks import chunk_grid, field_chunk_lists, merge_fields, virtual_chunks
from .h5meta import DatasetInfo, read_dataset_info
from .layout import Layout
from .limits import MAX_BLOCKS, MAX_LINKS, MAX_SAMPLES, check_count, check_layout_size
from .sources import Source
from .spec import LayoutSpec


_LOOKUP_ERRORS = (KeyError, OSError, ValueError, TypeError, RuntimeError)
MAX_NAMED = 6
"""Files named per dtype / shape in a consistency error before "and N more"."""


def open_h5(path: str) -> h5py.File:
    """Open read-only (see :func:`solar.io.h5open.open_readonly`); a clear error if it is not HDF5."""
    if not os.path.exists(path):
        raise LayoutError(f"file not found: {path}")
    return _open_h5(path)


def _open_h5(path: str) -> h5py.File:
    """:func:`open_h5` of a file known to exist (no ``stat``)."""
    try:
        return open_readonly(path)
    except OSError as exc:
        raise LayoutError(f"cannot open {path} as HDF5: {str(exc).splitlines()[0]}") from None


def _where(path: str, name: str) -> str:
    return f"{os.path.basename(path)}:/{name.lstrip('/')}"


def _follow(h5f: h5py.File, name: str, where: str):
    """The object at ``name``, following soft and external links; None if there is none.

    A LayoutError if ``name`` is an external link HDF5 cannot follow (missing file or target).
    """
    try:
        return follow(h5f, name)
    except _LOOKUP_ERRORS:
        pass
    try:
        link = h5f.get(name, getlink=True)
    except _LOOKUP_ERRORS:
        link = None
    if isinstance(link, h5py.ExternalLink):
        raise LayoutError(f"{where} is an external link to {link.filename}:{link.path}, which cannot be opened "
                          f"(missing file or dataset; HDF5 looks next to {os.path.basename(h5f.filename)} "
                          f"and in the current folder)")
    return None


def _name_in_own_file(obj: h5py.Dataset, where: str) -> str:
    """A path of dataset ``obj`` inside the file that holds it (``obj.file``).

    ``obj.name`` is the path HDF5 walked, which may not exist in that file (a soft
    link to an external link); then the file is searched for the same object.
    """
    own = obj.file
    if obj.name and obj.name in own and own[obj.name] == obj:
        return obj.name
    found = own.visititems(lambda n, o: n if o == obj else None)
    if found is None:
        raise LayoutError(f"{where} links to a dataset of {own.filename} that has no path there")
    return "/" + found


def _describe(groups: Dict[str, List[str]]) -> str:
    """``"uint8 in a.h5, c.h5; float32 in b.h5"`` from ``{value: [places]}``."""
    parts = []
    for value, places in groups.items():
        more = f" and {len(places) - MAX_NAMED} more" if len(places) > MAX_NAMED else ""
        parts.append(f"{value} in {', '.join(places[:MAX_NAMED])}{more}")
    return "; ".join(parts)


def _well_roles(dset: h5py.Dataset) -> str:
    """Roles of a The Well field from its sample_varying / time_varying attributes."""
    attrs = dset.attrs
    if "sample_varying" in attrs or "time_varying" in attrs:
        roles = ("b" if bool(attrs.get("sample_varying", True)) else "") + \
                ("t" if bool(attrs.get("time_varying", True)) else "")
        return roles
    return "bt"


class FileScan(NamedTuple):
    """What one spec file contributes to a layout, with file and dataset indexes local to it (picklable:
    built in worker processes, merged in file order by :func:`merge_scans`).

    ``files``: ``[(path, (dev, inode), size, mtime_ns)]``, ``[0]`` the scanned file, then the targets
    of external links it follows; ``datasets``/``block_shapes``/``sources``: as in :class:`Layout`
    (``DatasetInfo.file``, ``Source.file`` index ``files``; ``Source.datasets`` index ``datasets``);
    ``ds_start`` int64[D+1]; ``blocks``: the block arrays (``block_dataset`` local);
    ``source_start`` int64[S+1], ``sample_ptr`` int64[N+1], ``sample_blocks`` int64[nnz] (local ids).
    """

    files: list
    datasets: list
    block_shapes: list
    sources: list
    ds_start: np.ndarray
    blocks: dict
    source_start: np.ndarray
    sample_ptr: np.ndarray
    sample_blocks: np.ndarray


def _stat(path: str) -> os.stat_result:
    try:
        return os.stat(path)
    except FileNotFoundError:
        raise LayoutError(f"file not found: {path}") from None
    except OSError as exc:
        raise LayoutError(f"cannot open {path}: {exc.strerror}") from None


class _Builder:
    """Builds one file's :class:`FileScan` (one ``stat`` and one HDF5 open of the file)."""

    def __init__(self, spec: LayoutSpec):
        self.spec = spec
        self.files: List[str] = []
        self.file_stats: List[tuple] = []  # per file: ((dev, ino), size, mtime_ns)
        self.datasets: List[DatasetInfo] = []
        self.block_shapes = []
        self.tables = []  # per dataset: dict of chunk arrays, or None (contiguous)
        self.sources: List[Source] = []
        self._file_index: Dict[Tuple[int, int], int] = {}

    def add_file(self, path: str, st: Optional[os.stat_result] = None) -> int:
        """Index of ``path`` in ``files`` (appended if new; one index per file on disk)."""
        st = _stat(path) if st is None else st
        key = (st.st_dev, st.st_ino)
        if key not in self._file_index:
            self._file_index[key] = len(self.files)
            self.files.append(path)
            self.file_stats.append((key, st.st_size, st.st_mtime_ns))
        return self._file_index[key]

    def holder(self, h5f: h5py.File, file_idx: int, name: str, where: str):
        """``(open file, file index, path, dataset)`` of the file that really holds dataset ``name``'s bytes.

        A dataset reached through an external link (NeXus / detector master files)
        lives in the link's target file, at offsets of that file: the target joins
        ``files`` under an absolute path (HDF5 resolved it from the current folder).
        Soft links and links into other groups stay in the same file.
        """
        obj = _follow(h5f, name, where)
        if not isinstance(obj, h5py.Dataset) or obj.id.fileno == h5f.id.fileno:
            return h5f, file_idx, name, obj
        own = obj.file
        real = os.path.abspath(own.filename)
        return own, self.add_file(real), _name_in_own_file(obj, where), None

    def add_dataset(self, h5f, file_idx: int, name: str, roles: str) -> int:
        where = _where(self.files[file_idx], name)
        h5f, real_idx, real_name, obj = self.holder(h5f, file_idx, name, where)
        if real_idx != file_idx:
            where = f"{where} (stored in {_where(self.files[real_idx], real_name)})"
        info, table = read_dataset_info(h5f, real_idx, real_name, where, obj=obj,
                                        file_size=self.file_stats[real_idx][1])
        if len(info.shape) < len(roles):
            raise LayoutError(f"{where} has {len(info.shape)} axes, fewer than its sample axes ({roles!r})")
        self.datasets.append(info)
        self.block_shapes.append(info.chunks if info.chunks is not None else virtual_chunks(info.shape, roles))
        self.tables.append(table)
        return len(self.datasets) - 1

    # ---------------------------------------------------------------- kinds
    def rows(self, h5f, fi: int):
        ids = [self.add_dataset(h5f, fi, name, "s") for name in self.spec.fields]
        counts = {self.spec.fields[k]: self.datasets[d].shape[0] for k, d in enumerate(ids)}
        if len(set(counts.values())) > 1:
            desc = ", ".join(f"{n} has {c}" for n, c in counts.items())
            raise LayoutError(f"fields disagree on the sample count in {os.path.basename(self.files[fi])}: {desc}")
        n = next(iter(counts.values()))
        self.sources.append(Source("rows", fi, "", tuple(ids), ("s",) * len(ids), n))

    def windows(self, h5f, fi: int):
        ids, roles = [], []
        for name in self.spec.fields:
            obj = _follow(h5f, name, _where(self.files[fi], name))
            if not isinstance(obj, h5py.Dataset):
                raise LayoutError(f"dataset {name!r} not found in {self.files[fi]}")
            r = _well_roles(obj)
            roles.append(r)
            ids.append(self.add_dataset(h5f, fi, name, r))
        fname = os.path.basename(self.files[fi])
        trajs = {self.spec.fields[k]: self.datasets[d].shape[0] for k, d in enumerate(ids) if "b" in roles[k]}
        steps = {self.spec.fields[k]: self.datasets[d].shape[roles[k].index("t")]
                 for k, d in enumerate(ids) if "t" in roles[k]}
        for what, table in (("trajectory", trajs), ("time-step", steps)):
            if len(set(table.values())) > 1:
                desc = ", ".join(f"{n} has {c}" for n, c in table.items())
                raise LayoutError(f"fields disagree on the {what} count in {fname}: {desc}")
        if not steps:
            raise LayoutError(f"no time-varying field in {fname}: windows need a time axis")
        n_steps = next(iter(steps.values()))
        n_traj = next(iter(trajs.values())) if trajs else int(h5f.attrs.get("n_trajectories", 1))
        span = self.spec.window_span
        if span > n_steps:
            raise LayoutError(
                f"window of {self.spec.window} frames with dt={self.spec.dt} spans {span} steps, longer than "
                f"the {n_steps}-step trajectories in {fname}")
        src = Source("windows", fi, "", tuple(ids), tuple(roles), n_traj * (n_steps - span + 1),
                     n_traj, n_steps, self.spec.window, self.spec.dt)
        self.sources.append(src)

    def group_or_dataset(self, h5f, fi: int, name: str):
        """The object a root link names; a LayoutError if the link is broken (never skipped silently)."""
        obj = _follow(h5f, name, _where(self.files[fi], name))
        if obj is None:
            raise LayoutError(f"{_where(self.files[fi], name)} is a broken link (its target does not exist)")
        return obj

    def whole(self, h5f, fi: int):
        if self.spec.groups is None:
            groups = [""]
        else:
            groups = [k for k in sorted(h5f.keys()) if fnmatch.fnmatchcase(k, self.spec.groups)
                      and isinstance(self.group_or_dataset(h5f, fi, k), h5py.Group)]
            if not groups:
                raise LayoutError(f"no group matching {self.spec.groups!r} in {self.files[fi]}")
        for g in groups:
            ids = []
            for name in self.spec.fields:
                full = f"{g}/{name}" if g else name
                ids.append(self.add_dataset(h5f, fi, full, ""))
            self.sources.append(Source("whole", fi, g, tuple(ids), ("",) * len(ids), 1))

    # ---------------------------------------------------------------- blocks
    def block_arrays(self):
        starts = np.zeros(len(self.datasets) + 1, dtype=np.int64)
        for d, (info, shp) in enumerate(zip(self.datasets, self.block_shapes)):
            starts[d + 1] = starts[d] + int(np.prod(chunk_grid(info.shape, shp), dtype=np.int64))
        n_b = int(starts[-1])
        offset = np.empty(n_b, dtype=np.int64)
        stored = np.empty(n_b, dtype=np.int64)
        nbytes = np.empty(n_b, dtype=np.int64)
        mask = np.zeros(n_b, dtype=np.uint32)
        dset = np.empty(n_b, dtype=np.int32)
        for d, (info, shp, table) in enumerate(zip(self.datasets, self.block_shapes, self.tables)):
            lo, hi = starts[d], starts[d + 1]
            dset[lo:hi] = d
            chunk_bytes = int(np.prod(shp, dtype=np.int64)) * info.itemsize
            nbytes[lo:hi] = chunk_bytes
            if table is None:
                base = info.offset if info.offset is not None else -1
                offset[lo:hi] = base + np.arange(hi - lo, dtype=np.int64) * chunk_bytes if base >= 0 else -1
                # never written (raw, no storage): nothing on storage, read as the fill value
                stored[lo:hi] = 0 if base < 0 and info.raw else chunk_bytes
            else:
                offset[lo:hi] = table["offset"]
                stored[lo:hi] = table["nbytes"]
                mask[lo:hi] = table["mask"]
        return starts, dict(block_dataset=dset, block_offset=offset, block_stored=stored,
                            block_nbytes=nbytes, block_mask=mask)

    def sample_arrays(self, ds_start):
        ptrs, ids = [], []
        source_start = np.zeros(len(self.sources) + 1, dtype=np.int64)
        for s, src in enumerate(self.sources):
            source_start[s + 1] = source_start[s] + src.n_samples
            index, t0 = src.coords(np.arange(src.n_samples, dtype=np.int64))
            counts, lists = [], []
            for d, roles in zip(src.datasets, src.roles):
                c, lin = field_chunk_lists(self.datasets[d].shape, self.block_shapes[d], roles, index, t0,
                                           src.window, src.dt, n_samples=src.n_samples)
                counts.append(c)
                lists.append(lin + ds_start[d])
            ptr, blk = merge_fields(counts, lists)
            ptrs.append(ptr)
            ids.append(blk)
        # concatenate per-source CSRs: shift each source's row pointers by the links before it
        sample_ptr = [np.zeros(1, dtype=np.int64)]
        base = 0
        for ptr in ptrs:
            sample_ptr.append(ptr[1:] + base)
            base += int(ptr[-1])
        return source_start, np.concatenate(sample_ptr), (np.concatenate(ids) if ids else np.zeros(0, np.int64))

    def scan(self, path: str) -> FileScan:
        """Read the file ``path`` (one ``stat``, one HDF5 open) into its :class:`FileScan`."""
        fi = self.add_file(path)
        with _open_h5(path) as h5f:
            getattr(self, self.spec.kind)(h5f, fi)
        check_layout_size(self.datasets, self.block_shapes, self.sources, self.files)
        ds_start, blocks = self.block_arrays()
        source_start, sample_ptr, sample_blocks = self.sample_arrays(ds_start)
        files = [(p, *st) for p, st in zip(self.files, self.file_stats)]
        return FileScan(files, self.datasets, self.block_shapes, self.sources, ds_start, blocks,
                        source_start, sample_ptr, sample_blocks)


def scan_file(spec: LayoutSpec, path: str) -> FileScan:
    """One spec file's :class:`FileScan` (LayoutError naming the culprit, see :func:`build_layout`)."""
    return _Builder(spec).scan(path)


def check_fields(spec: LayoutSpec, files, datasets, sources) -> None:
    """One dtype per field over all files/groups, and for rows/windows one per-sample shape.

    Byte order may differ (the loader delivers native byte order); anything
    else is a LayoutError naming every dtype or shape with its files.
    """
    native: Dict[str, str] = {}
    for k, name in enumerate(spec.fields):
        dtypes: Dict[str, List[int]] = {}
        shapes: Dict[str, List[int]] = {}
        for s, src in enumerate(sources):
            info = datasets[src.datasets[k]]
            if info.dtype not in native:
                native[info.dtype] = str(np.dtype(info.dtype).newbyteorder("="))
            dtypes.setdefault(native[info.dtype], []).append(s)
            shapes.setdefault(str(src.field_shape(k, info.shape)), []).append(s)
        if len(dtypes) > 1:
            raise LayoutError(f"field {name!r} has different dtypes: {_describe(_places(spec, files, sources, dtypes))} "
                              f"(solar does not convert: write one dtype)")
        if len(shapes) > 1 and spec.kind != "whole":
            raise LayoutError(f"field {name!r} has different per-sample shapes: "
                              f"{_describe(_places(spec, files, sources, shapes))} "
                              f"({spec.kind} samples of one field must have one shape)")


def _places(spec: LayoutSpec, files, sources, groups: Dict[str, List[int]]) -> Dict[str, List[str]]:
    """``{value: [source indexes]}`` -> ``{value: ["file:/group", ...]}`` (paths relative to the spec root)."""
    def place(src):
        rel = os.path.relpath(files[src.file], spec.root)
        return f"{rel}:/{src.group}" if src.group else rel
    return {v: [place(sources[i]) for i in idx] for v, idx in groups.items()}


def merge_scans(spec: LayoutSpec, scans: Sequence[FileScan]):
    """The per-file scans, in spec file order, as one layout's parts: ``(files, file_stats, datasets,
    block_shapes, sources, arrays)`` (``file_stats``: ``(size, mtime_ns)`` per file), exactly what one
    builder reading the files one after the other would hold: a file reached twice (another spelling, an
    external link target) keeps its first index."""
    files, file_stats, index = [], [], {}
    datasets, block_shapes, sources = [], [], []
    n_blocks = [0]
    n_samples = [0]
    n_links = [0]
    for sc in scans:
        fmap = []
        for path, key, size, mtime in sc.files:
            if key not in index:
                index[key] = len(files)
                files.append(path)
                file_stats.append((size, mtime))
            fmap.append(index[key])
        d0 = len(datasets)
        datasets.extend(i if i.file == fmap[i.file] else replace(i, file=fmap[i.file]) for i in sc.datasets)
        block_shapes.extend(sc.block_shapes)
        sources.extend(replace(src, file=fmap[src.file], datasets=tuple(d + d0 for d in src.datasets))
                       for src in sc.sources)
        n_blocks.append(n_blocks[-1] + int(sc.ds_start[-1]))
        n_samples.append(n_samples[-1] + int(sc.source_start[-1]))
        n_links.append(n_links[-1] + int(sc.sample_ptr[-1]))
    more = f" and {len(files) - 3} more" if len(files) > 3 else ""
    where = f"the layout of {', '.join(os.path.basename(p) for p in files[:3])}{more}"
    check_count(n_blocks[-1], MAX_BLOCKS, "blocks", where)
    check_count(n_samples[-1], MAX_SAMPLES, "samples", where)
    check_count(n_links[-1], MAX_LINKS, "sample->block links", where)
    arrays = _concat_arrays(scans, np.array(n_blocks, np.int64), np.array(n_samples, np.int64),
                            np.array(n_links, np.int64))
    return files, file_stats, datasets, block_shapes, sources, arrays


def _concat_arrays(scans: Sequence[FileScan], blk0, smp0, lnk0) -> dict:
    """The layout's arrays from the scans' (``blk0``/``smp0``/``lnk0`` int64[F+1]: blocks, samples and
    links before each scan)."""
    n_ds = np.array([len(sc.datasets) for sc in scans], np.int64)
    ds0 = np.concatenate([[0], np.cumsum(n_ds)])
    per_block = np.diff(blk0)
    out = {name: _cat([sc.blocks[name] for sc in scans], sc_dtype)
           for name, sc_dtype in (("block_dataset", np.int32), ("block_offset", np.int64),
                                  ("block_stored", np.int64), ("block_nbytes", np.int64), ("block_mask", np.uint32))}
    out["block_dataset"] += np.repeat(ds0[:-1], per_block).astype(np.int32)
    out["dataset_block_start"] = _cat([[0]] + [sc.ds_start[1:] + blk0[i] for i, sc in enumerate(scans)], np.int64)
    out["source_start"] = _cat([[0]] + [sc.source_start[1:] + smp0[i] for i, sc in enumerate(scans)], np.int64)
    out["sample_ptr"] = _cat([[0]] + [sc.sample_ptr[1:] + lnk0[i] for i, sc in enumerate(scans)], np.int64)
    out["sample_blocks"] = _cat([sc.sample_blocks for sc in scans], np.int64)
    out["sample_blocks"] += np.repeat(blk0[:-1], np.diff(lnk0))
    return out


def _cat(parts, dtype) -> np.ndarray:
    return np.concatenate([np.asarray(p, dtype) for p in parts]) if parts else np.zeros(0, dtype)


def fingerprint(spec: LayoutSpec, files, datasets, arrays, file_stats=None) -> str:
    """sha256 over the spec, each file's name/size/mtime, dataset metadata and the block map.

    ``file_stats``: ``(size, mtime_ns)`` per file as seen when the layout was read (default: ``os.stat``
    of each file now).
    """
    h = hashlib.sha256()
    h.update(json.dumps(spec.to_dict(), sort_keys=True).encode())
    if file_stats is None:
        file_stats = [(st.st_size, st.st_mtime_ns) for st in map(os.stat, files)]
    for p, (size, mtime) in zip(files, file_stats):
        h.update(json.dumps([os.path.relpath(p, spec.root), size, mtime]).encode())
    for info in datasets:
        h.update(json.dumps([info.file, info.name, info.shape, info.dtype, info.chunks,
                             [(f.id, f.values) for f in info.filters]]).encode())
    for name in ("block_offset", "block_stored", "block_mask"):
        h.update(np.ascontiguousarray(arrays[name]).tobytes())
    return h.hexdigest()


def build_layout(spec: LayoutSpec, progress: bool = False, workers: Optional[int] = None) -> Layout:
    """Read the files named by ``spec`` and return their :class:`Layout`.

    Each file is read once (one ``stat``, one HDF5 open) into a :class:`FileScan`;
    with many files the scans run in ``workers`` processes (default
    :func:`~solar.layout.scan_pool.default_workers`: the cores this process may
    use, shared with the other ranks of the node; 1: in this process only), see
    :mod:`solar.layout.scan_pool`.  The result does not depend on ``workers``.
    ``progress``: progress over the files (more than 20), as :mod:`solar.progress` takes it.

    Raises :class:`~solar.errors.LayoutError` (one line, naming the culprit)
    for a missing file, dataset or group, a broken external link, disagreeing
    sample counts, a field whose dtype (or, for rows/windows, per-sample shape)
    differs between files, a non-numeric or empty dataset, a window longer than
    a trajectory, or a filter nobody can decode (the first file in spec order
    with a problem is named).  A dataset reached through an external link is
    recorded in the file that holds its bytes.
    """
    from .scan_pool import scan_files
    paths = spec.resolve_files()
    scans = scan_files(spec, paths, workers=workers, progress=progress)
    files, file_stats, datasets, block_shapes, sources, arrays = merge_scans(spec, scans)
    check_fields(spec, files, datasets, sources)
    if arrays["sample_ptr"].shape[0] == 1:
        raise LayoutError(f"no samples in {', '.join(paths)}")
    fp = fingerprint(spec, files, datasets, arrays, file_stats)
    return Layout(spec, tuple(files), tuple(datasets), tuple(block_shapes), tuple(sources), arrays, fp)
