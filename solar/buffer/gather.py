"""Batch assembly in one GIL-free numba call per field: copy each (sample, block) piece of a
step straight from the buffer's slot pool into the batch array.

For a step's samples, a piece is the part of one resident block that one sample's field
selects: a box of ``m <= MAX_DIMS`` axes, copied as runs of contiguous bytes (a row
layout's piece is one run of the whole sample field; a multi-sample chunk gives one
strided run of its rows; a window gives its frames).  The geometry comes from small
per-layout tables (:class:`GatherTables`); per step, the kernel walks the samples' CSR
block lists, finds each block's slot by binary search in the step's resident table and
copies.  It equals :func:`solar.io.raw.place_block` applied per sample and block, bit
for bit (``tests/test_gather.py``).

What it does not serve (the caller keeps the per-block path): layouts whose samples
differ in shape (``whole`` over uneven files), datasets with more than ``MAX_DIMS`` axes.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..layout.blocks import chunk_grid

MAX_DIMS = 8
ROLE_FULL, ROLE_INDEX, ROLE_TIME = 0, 1, 2


class Geometry(NamedTuple):
    """What the kernel knows of the layout (int64 arrays; :class:`GatherTables` documents the tables): the
    samples' CSR block lists, each block's dataset, and the per-dataset, per-source and per-field tables."""

    sample_ptr: np.ndarray
    sample_blocks: np.ndarray
    block_dataset: np.ndarray
    ds_block_start: np.ndarray
    ds_ndim: np.ndarray
    ds_shape: np.ndarray
    blk_shape: np.ndarray
    grid: np.ndarray
    grid_div: np.ndarray
    blk_stride: np.ndarray
    itemsize: np.ndarray
    src_ds: np.ndarray
    roles: np.ndarray
    src_kind: np.ndarray
    src_wpt: np.ndarray
    src_window: np.ndarray
    src_dt: np.ndarray
    out_stride: np.ndarray
    field_bytes: np.ndarray


class Rows(NamedTuple):
    """The batch's rows (int64[n] each): sample id, its source and its index inside the source."""

    samples: np.ndarray
    src: np.ndarray
    local: np.ndarray


class Resident(NamedTuple):
    """The step's resident blocks (int64[m] each): ids ascending, and each one's size class and slot."""

    blocks: np.ndarray
    block_class: np.ndarray
    block_slot: np.ndarray


class GatherTables:
    """The layout's geometry as arrays (D datasets, S sources, K fields, A = MAX_DIMS axes).

    ===============  ==============  ==========================================
    ``ds_shape``     int64[D, A]     dataset shape (padded with 1)
    ``blk_shape``    int64[D, A]     block (chunk) shape
    ``grid_div``     int64[D, A]     block linear id // grid_div % grid = grid coordinate
    ``grid``         int64[D, A]     blocks along each axis
    ``blk_stride``   int64[D, A]     byte stride of each axis inside a decoded block
    ``ds_ndim``      int64[D]
    ``itemsize``     int64[D]
    ``src_ds``       int64[S, K]     dataset of field k in source s
    ``roles``        int64[S, K, A]  ROLE_FULL / ROLE_INDEX (s, b) / ROLE_TIME (t)
    ``src_kind``     int64[S]        0 rows, 1 windows, 2 whole
    ``src_wpt``      int64[S]        windows per trajectory (windows sources)
    ``src_window``   int64[S]        frames per window
    ``src_dt``       int64[S]        frame stride
    ``out_stride``   int64[K, A]     byte stride of each axis of one sample's field
    ``field_bytes``  int64[K]        bytes of one sample's field
    ===============  ==============  ==========================================

    ``ok`` is False (and ``why`` says why) when the layout needs the per-block path.
    """

    def __init__(self, layout):
        self.layout = layout
        D, S, K = len(layout.datasets), len(layout.sources), len(layout.field_names)
        A = MAX_DIMS
        self.ok, self.why = True, ""
        shapes = {tuple(sorted(shp.items())) for _, shp, _ in layout.sample_shape_groups()}
        self.uniform = len(shapes) <= 1
        if not self.uniform:
            self.ok, self.why = False, "samples differ in shape"
        if any(len(info.shape) > A for info in layout.datasets):
            self.ok, self.why = False, f"a dataset has more than {A} axes"
        for k in range(K):  # one byte order per field: the swap to native is done per field
            if len({np.dtype(layout.datasets[src.datasets[k]].dtype).isnative for src in layout.sources}) > 1:
                self.ok, self.why = False, "a field's byte order differs between files"
        self.ds_shape = np.ones((D, A), np.int64)
        self.blk_shape = np.ones((D, A), np.int64)
        self.grid = np.ones((D, A), np.int64)
        self.grid_div = np.ones((D, A), np.int64)
        self.blk_stride = np.zeros((D, A), np.int64)
        self.ds_ndim = np.zeros(D, np.int64)
        self.itemsize = np.zeros(D, np.int64)
        self.ds_block_start = np.asarray(layout.dataset_block_start, np.int64)
        self.geometry = None  # (the kernel's view of the tables: set below when the layout is served)
        if not self.ok:
            return
        # datasets of many files share a few (shape, block shape, dtype): one row of tables per kind
        kinds: dict = {}
        kind_of = np.empty(D, np.int64)
        for d, info in enumerate(layout.datasets):
            kind_of[d] = kinds.setdefault((tuple(info.shape), tuple(layout.block_shapes[d]), str(info.dtype)),
                                          len(kinds))
        rows = [np.zeros((len(kinds), A), np.int64) for _ in range(5)]  # shape, blk, grid, grid_div, stride
        nd_k, item_k = np.zeros(len(kinds), np.int64), np.zeros(len(kinds), np.int64)
        for (shape, bs, dtype), k in kinds.items():
            nd, g = len(shape), chunk_grid(shape, bs)
            nd_k[k], item_k[k] = nd, np.dtype(dtype).itemsize
            rows[0][k, :nd], rows[1][k, :nd], rows[2][k, :nd] = shape, bs, g
            rows[0][k, nd:] = rows[1][k, nd:] = rows[2][k, nd:] = 1
            for a in range(nd):
                rows[3][k, a] = math.prod(int(v) for v in g[a + 1:])
                rows[4][k, a] = math.prod(int(v) for v in bs[a + 1:]) * int(item_k[k])
            rows[3][k, nd:] = 1
        if D:
            self.ds_ndim, self.itemsize = nd_k[kind_of], item_k[kind_of]  # int64[D]
            self.ds_shape, self.blk_shape, self.grid, self.grid_div, self.blk_stride = (r[kind_of] for r in rows)
        self.src_ds = np.zeros((S, K), np.int64)
        self.roles = np.zeros((S, K, A), np.int64)
        self.src_kind = np.zeros(S, np.int64)
        self.src_wpt = np.ones(S, np.int64)
        self.src_window = np.ones(S, np.int64)
        self.src_dt = np.ones(S, np.int64)
        code = {"s": ROLE_INDEX, "b": ROLE_INDEX, "t": ROLE_TIME}
        for s, src in enumerate(layout.sources):
            self.src_kind[s] = {"rows": 0, "windows": 1}.get(src.kind, 2)
            if src.kind == "windows":
                self.src_wpt[s], self.src_window[s], self.src_dt[s] = src.windows_per_traj, src.window, src.dt
            for k, d in enumerate(src.datasets):
                self.src_ds[s, k] = d
                for a, r in enumerate(src.roles[k]):
                    self.roles[s, k, a] = code[r]
        self.fields = list(layout.field_names)
        self.shapes = layout.field_shapes(0) if layout.n_samples else {}
        self.out_stride = np.zeros((K, A), np.int64)
        self.field_bytes = np.zeros(K, np.int64)
        dsz = {name: int(self.itemsize[d]) for name, d, _ in layout.sample_fields(0)} if layout.n_samples else {}
        for k, name in enumerate(self.fields):
            shp = self.shapes.get(name, ())
            for a in range(len(shp)):
                self.out_stride[k, a] = int(np.prod(shp[a + 1:], dtype=np.int64)) * dsz.get(name, 0)
            self.field_bytes[k] = int(np.prod(shp, dtype=np.int64)) * dsz.get(name, 0)
        self._set_geometry()

    def _set_geometry(self) -> None:
        """The kernel's view of the tables (:class:`Geometry`), made again whenever they change."""
        lay = self.layout
        self.geometry = Geometry(lay.sample_ptr, lay.sample_blocks, lay.block_dataset, self.ds_block_start,
                                 self.ds_ndim, self.ds_shape, self.blk_shape, self.grid, self.grid_div,
                                 self.blk_stride, self.itemsize, self.src_ds, self.roles, self.src_kind, self.src_wpt,
                                 self.src_window, self.src_dt, self.out_stride, self.field_bytes)

    def keep_fields(self, names) -> None:
        """Restrict the tables to fields ``names``: the per-field rows (``src_ds``/``roles`` axis 1,
        ``out_stride``/``field_bytes`` axis 0, ``fields``) are sliced, and the kernel's :class:`Geometry` with
        them, so that :meth:`gather` copies those fields only (field k of the batch is the k-th kept)."""
        keep = [k for k, name in enumerate(self.fields) if name in names]
        self.src_ds = np.ascontiguousarray(self.src_ds[:, keep])
        self.roles = np.ascontiguousarray(self.roles[:, keep])
        self.out_stride = np.ascontiguousarray(self.out_stride[keep])
        self.field_bytes = np.ascontiguousarray(self.field_bytes[keep])
        self.fields = [self.fields[k] for k in keep]
        self._set_geometry()

    def gather(self, samples: np.ndarray, blocks: np.ndarray, block_class: np.ndarray, block_slot: np.ndarray,
               pools, out: dict[str, np.ndarray], workers=None, parts: int = 1, flat=None) -> None:
        """Fill ``out[field]`` (C-contiguous, shape (n, *field shape)) for ``samples`` (int64[n]).

        ``blocks`` int64[m] ascending: the step's resident blocks; ``block_class``/``block_slot``
        int64[m]: where each lives in ``pools`` (:class:`~solar.buffer.SlotPools`).  Every block
        of every sample must be among ``blocks``, and every piece inside its slot and field
        (ValueError otherwise, before that piece is copied).  Values land in the file's byte
        order; :meth:`to_native` converts.

        ``workers`` (an executor with ``submit``, ``parts - 1`` threads are enough) and ``parts`` > 1: the
        samples are split into up to ``parts`` runs of rows (:func:`row_parts`), the first gathered by the
        calling thread and each other by one worker, into its own rows of ``out``; the kernel holds no GIL,
        so the runs are copied on as many cores at once.

        ``flat``: ``(raw, starts)`` where every ``out[field]`` is a view of one uint8 array ``raw`` starting at byte
        ``starts[k]`` (int64, in :attr:`fields` order; :class:`~solar.loader.assemble.BatchAssembler`'s batches):
        all fields are then copied in one kernel call per run of rows (one hand-back of the GIL instead of one
        per field).
        """
        lay = self.layout
        samples = np.ascontiguousarray(samples, dtype=np.int64)
        for name in self.fields:
            if not out[name].flags.c_contiguous:
                raise ValueError(f"batch array of field {name!r} must be C-contiguous")
        src = np.searchsorted(lay.source_start, samples, side="right") - 1
        local = samples - lay.source_start[src]
        classes = [0] if len(pools.arrays) == 1 else np.unique(block_class).tolist()
        runs = row_parts(samples.shape[0], parts if workers is not None else 1, int(self.field_bytes.sum()),
                         MIN_PART_BYTES)

        def rows(lo_hi):
            lo, hi = lo_hi
            if flat is not None:
                self._gather_flat(samples[lo:hi], src[lo:hi], local[lo:hi], blocks, block_class, block_slot, pools,
                                  flat[0], flat[1] + lo * self.field_bytes, classes)
                return
            self._gather_rows(samples[lo:hi], src[lo:hi], local[lo:hi], blocks, block_class, block_slot, pools,
                              {k: v[lo:hi] for k, v in out.items()}, classes)
        if len(runs) == 1:
            rows(runs[0])
            return
        # the calling thread gathers the first run itself while the workers take the others (one thread
        # fewer to wake per batch); every run has ended before this returns or raises (they write into out)
        futures = [workers.submit(rows, r) for r in runs[1:]]
        try:
            rows(runs[0])
        finally:
            for f in futures:
                f.exception()  # waits
        for f in futures:
            f.result()  # the first worker's exception, if any

    def _gather_rows(self, samples, src, local, blocks, block_class, block_slot, pools, out, classes) -> None:
        rows, step = Rows(samples, src, local), _resident(blocks, block_class, block_slot)
        for c in classes:
            flat = pools.arrays[c].reshape(-1)
            slot_bytes = int(pools.class_bytes[c])
            for k, name in enumerate(self.fields):
                dest = out[name].reshape(-1).view(np.uint8)
                self._field(k, c, rows, step, flat, slot_bytes, dest, _NO_RUNS, np.zeros(1, np.int64), False)

    def _gather_flat(self, samples, src, local, blocks, block_class, block_slot, pools, raw, starts, classes) -> None:
        if self.geometry is None:
            raise ValueError(f"this layout cannot be gathered in one call: {self.why}")
        rows, step = Rows(samples, src, local), _resident(blocks, block_class, block_slot)
        starts = np.ascontiguousarray(starts, dtype=np.int64)
        for c in classes:
            k, missing = _gather_fields(self.geometry, rows, step, c, pools.arrays[c].reshape(-1),
                                        int(pools.class_bytes[c]), raw, starts)
            if missing != -1:
                self._missing(int(k), int(missing))

    def _field(self, k, c, rows: Rows, step: Resident, flat, slot_bytes, dest, runs, count, record) -> None:
        if self.geometry is None:
            raise ValueError(f"this layout cannot be gathered in one call: {self.why}")
        missing = _gather_field(self.geometry, rows, step, k, c, flat, slot_bytes, dest, 0, runs, count, record)
        if missing != -1:
            self._missing(k, missing)

    def _missing(self, k: int, missing: int) -> None:
        """ValueError for the kernel's code ``missing`` (see :func:`_gather_field`) on field ``k``."""
        name = self.fields[k]
        if missing >= 0:
            raise ValueError(f"block {missing} of field {name!r} is not among the step's blocks")
        if missing < -1:
            raise ValueError(f"block {-2 - missing} of field {name!r}: the piece a sample selects falls "
                             f"outside its slot or the batch (layout geometry disagrees with the pools)")

    def warm(self) -> None:
        """Load the gather kernel's machine code from numba's cache now: a process's first call loads it (about
        0.1 s on the development VM), which the first batch waited for.  One call with no rows, its arguments
        of the types :meth:`gather` passes (no byte copied)."""
        if self.geometry is None or not self.fields:
            return
        z = np.zeros(0, np.int64)
        _gather_field(self.geometry, Rows(z, z, z), Resident(z, z, z), 0, 0, np.zeros(0, np.uint8), 0,
                      np.zeros(0, np.uint8), 0, _NO_RUNS, np.zeros(1, np.int64), False)
        _gather_fields(self.geometry, Rows(z, z, z), Resident(z, z, z), 0, np.zeros(0, np.uint8), 0,
                       np.zeros(0, np.uint8), np.zeros(len(self.fields), np.int64))

    def runs(self, samples: np.ndarray, blocks: np.ndarray, block_class: np.ndarray, block_slot: np.ndarray,
             class_bytes) -> list:
        """The copies :meth:`gather` would make, as ``[(class c, field k, int64[r, 3]), ...]``: each row a run of
        ``(source byte offset in class c's flat pool, destination byte offset in field k's flat batch, bytes)``,
        for a gather done elsewhere (on a GPU: :mod:`solar.buffer.device_pools`).  The same geometry and
        checks as :meth:`gather` (ValueError for a block not in the step or a piece outside its slot)."""
        samples = np.ascontiguousarray(samples, dtype=np.int64)
        src = np.searchsorted(self.layout.source_start, samples, side="right") - 1
        local = samples - self.layout.source_start[src]
        out = []
        dummy = np.zeros(0, np.uint8)
        rows, step = Rows(samples, src, local), _resident(blocks, block_class, block_slot)
        for c in np.unique(block_class).tolist():
            for k in range(len(self.fields)):
                runs, count = np.empty((max(16, samples.shape[0]), 3), np.int64), np.zeros(1, np.int64)
                self._field(k, c, rows, step, dummy, int(class_bytes[c]), dummy, runs, count, True)
                if count[0] > runs.shape[0]:  # more runs than guessed: again with room for all of them
                    runs, count = np.empty((int(count[0]), 3), np.int64), np.zeros(1, np.int64)
                    self._field(k, c, rows, step, dummy, int(class_bytes[c]), dummy, runs, count, True)
                if count[0]:
                    out.append((c, k, runs[:int(count[0])]))
        return out

    def to_native(self, out: dict[str, np.ndarray]) -> None:
        """Swap the bytes of fields stored in non-native byte order, in place (lossless)."""
        for name, d in zip(self.fields, self.src_ds[0].tolist() if self.src_ds.size else []):
            dt = np.dtype(self.layout.datasets[d].dtype)
            if dt.itemsize > 1 and not dt.isnative:
                out[name].byteswap(inplace=True)


_NO_RUNS = np.zeros((0, 3), np.int64)


def _resident(blocks, block_class, block_slot) -> Resident:
    return Resident(blocks, block_class, block_slot)

#: Bytes below which a run of rows is not split further (a worker's hand-off costs more than copying less).
MIN_PART_BYTES = 1 << 20


def row_parts(n: int, parts: int, row_bytes: int, min_bytes: int = MIN_PART_BYTES) -> list:
    """``[(lo, hi), ...]``: ``n`` rows in at most ``parts`` contiguous runs of nearly equal length, none under
    ``min_bytes`` (at ``row_bytes`` a row) unless there is one run only (pure)."""
    parts = max(1, min(int(parts), n, (n * max(int(row_bytes), 0)) // max(int(min_bytes), 1)))
    edges = [n * i // parts for i in range(parts + 1)]
    return [(edges[i], edges[i + 1]) for i in range(parts)]


@njit(nogil=True, cache=True)
def _find(blocks, b):
    """Position of ``b`` in ascending ``blocks`` (-1 if absent)."""
    lo, hi = 0, blocks.shape[0]
    while lo < hi:
        mid = (lo + hi) >> 1
        if blocks[mid] < b:
            lo = mid + 1
        else:
            hi = mid
    if lo < blocks.shape[0] and blocks[lo] == b:
        return lo
    return -1


@intrinsic
def _memcpy(typingctx, dest, doff, src, soff, n):
    """``dest[doff:doff+n] = src[soff:soff+n]`` for 1-D uint8 arrays, as one libc ``memcpy``
    (no bounds or overlap checks: the caller's geometry keeps it inside both arrays)."""
    sig = types.void(dest, doff, src, soff, n)

    def codegen(context, builder, signature, args):
        d, do, s, so, nn = args
        da = context.make_array(signature.args[0])(context, builder, d)
        sa = context.make_array(signature.args[2])(context, builder, s)
        cgutils.raw_memcpy(builder, builder.gep(da.data, [do]), builder.gep(sa.data, [so]), nn, 1)
        return context.get_dummy_value()
    return sig, codegen


@njit(nogil=True, cache=True)
def _box(pool, soff, dest, doff, m, cnt, sst, dstr, run, runs, nrun, record, idx):
    """The ``run``-byte runs of a box of ``m`` axes (counts ``cnt``, byte strides ``sst``/``dstr``): copied from
    ``pool`` into ``dest``, or with ``record`` written into ``runs`` rows ``(source, destination, bytes)`` from
    row ``nrun`` on (rows past its end only counted), nothing copied.  Returns the new row count.  ``idx``:
    int64[MAX_DIMS] of zeros, the position in the box (zeros again on return)."""
    while True:
        if not record:
            _memcpy(dest, doff, pool, soff, run)
        elif nrun < runs.shape[0]:
            runs[nrun, 0] = soff
            runs[nrun, 1] = doff
            runs[nrun, 2] = run
        nrun += 1
        a = m - 1
        while a >= 0:
            idx[a] += 1
            soff += sst[a]
            doff += dstr[a]
            if idx[a] < cnt[a]:
                break
            soff -= sst[a] * cnt[a]
            doff -= dstr[a] * cnt[a]
            idx[a] = 0
            a -= 1
        if a < 0:
            return nrun


@njit(nogil=True, cache=True)
def _gather_field(geo, rows, step, k, c, pool, slot_bytes, dest, dbase, runs, count, record):
    """Field ``k`` of every row (``rows``: :class:`Rows`), from the step's blocks (``step``: :class:`Resident`)
    of class ``c``, which live in ``pool`` (uint8, ``slot_bytes`` a slot): copied into ``dest`` (the field's
    flat bytes from byte ``dbase`` on), or with ``record`` the copies listed in ``runs`` (``count[0]`` of them;
    see :func:`_box`), nothing copied.  ``geo``: the layout's :class:`Geometry`.

    Returns -1; or a block id >= 0 that is not in the step's blocks; or -2 - block id for a piece
    whose bytes would fall outside its slot or its sample's field (nothing of it copied).
    """
    samples, src, local = rows.samples, rows.src, rows.local
    blocks, block_class, block_slot = step.blocks, step.block_class, step.block_slot
    sample_ptr, sample_blocks, block_dataset = geo.sample_ptr, geo.sample_blocks, geo.block_dataset
    ds_block_start, ds_ndim, ds_shape, blk_shape = geo.ds_block_start, geo.ds_ndim, geo.ds_shape, geo.blk_shape
    grid, grid_div, blk_stride, itemsize = geo.grid, geo.grid_div, geo.blk_stride, geo.itemsize
    src_ds, roles, src_kind, src_wpt = geo.src_ds, geo.roles, geo.src_kind, geo.src_wpt
    src_window, src_dt, out_stride, field_bytes = geo.src_window, geo.src_dt, geo.out_stride, geo.field_bytes
    cnt = np.zeros(MAX_DIMS, np.int64)
    sst = np.zeros(MAX_DIMS, np.int64)
    dstr = np.zeros(MAX_DIMS, np.int64)
    idx = np.zeros(MAX_DIMS, np.int64)
    for i in range(samples.shape[0]):
        s, so, loc = samples[i], src[i], local[i]
        index, t0 = loc, 0
        if src_kind[so] == 1:
            index, t0 = loc // src_wpt[so], loc % src_wpt[so]
        d = src_ds[so, k]
        for p in range(sample_ptr[s], sample_ptr[s + 1]):
            b = sample_blocks[p]
            if block_dataset[b] != d:
                continue
            j = _find(blocks, b)
            if j < 0:
                return b
            if block_class[j] != c:
                continue
            lin = b - ds_block_start[d]
            soff = block_slot[j] * slot_bytes
            doff = dbase + i * field_bytes[k]
            m = 0
            skip = False
            for a in range(ds_ndim[d]):
                # (integer divisions only where needed: they were most of a small row's cost)
                origin = 0 if grid[d, a] == 1 else (lin // grid_div[d, a]) % grid[d, a] * blk_shape[d, a]
                hi = min(origin + blk_shape[d, a], ds_shape[d, a])
                r = roles[so, k, a]
                if r == ROLE_INDEX:
                    if index < origin or index >= hi:
                        skip = True
                        break
                    soff += (index - origin) * blk_stride[d, a]
                    continue
                start, n, step = 0, ds_shape[d, a], 1
                if r == ROLE_TIME:
                    start, n, step = t0, src_window[so], src_dt[so]
                if step == 1:
                    j_lo, j_hi = max(0, origin - start), min(n, hi - start)
                else:
                    j_lo = max(0, -((start - origin) // step))
                    j_hi = min(n, -((start - hi) // step))
                if j_lo >= j_hi:
                    skip = True
                    break
                soff += (start + step * j_lo - origin) * blk_stride[d, a]
                doff += j_lo * out_stride[k, m]
                cnt[m], sst[m], dstr[m] = j_hi - j_lo, step * blk_stride[d, a], out_stride[k, m]
                m += 1
            if skip:
                continue
            run = itemsize[d]
            while m > 0 and sst[m - 1] == run and dstr[m - 1] == run:  # merge contiguous inner axes
                run *= cnt[m - 1]
                m -= 1
            s_end, d_end = soff + run, doff + run  # one past the last byte each side touches
            for a in range(m):
                s_end += (cnt[a] - 1) * sst[a]
                d_end += (cnt[a] - 1) * dstr[a]
            if s_end > (block_slot[j] + 1) * slot_bytes or d_end > dbase + (i + 1) * field_bytes[k]:
                return -2 - b  # geometry outside the block's slot or the sample's field: never copied
            count[0] = _box(pool, soff, dest, doff, m, cnt, sst, dstr, run, runs, count[0], record, idx)
    return -1


@njit(nogil=True, cache=True)
def _gather_fields(geo, rows, step, c, pool, slot_bytes, raw, starts):
    """Every field of every row, as :func:`_gather_field` per field ``k``, into ``raw`` (uint8) from byte
    ``starts[k]`` on: one call (one hand-back of the GIL) for all fields.  Returns ``(k, code)``: ``(-1, -1)``,
    or the first field whose :func:`_gather_field` returned ``code`` != -1 (fields after it not copied)."""
    runs = np.zeros((0, 3), np.int64)
    count = np.zeros(1, np.int64)
    for k in range(starts.shape[0]):
        missing = _gather_field(geo, rows, step, k, c, pool, slot_bytes, raw, starts[k], runs, count, False)
        if missing != -1:
            return k, missing
    return -1, -1
