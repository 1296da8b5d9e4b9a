"""One suite for every block reader: samples assembled from its blocks equal h5py's.

Written once, run serially and under ``mpiexec -n 2 python -m pytest -m mpi``:
tests marked ``mpi`` give each rank its own random block subsets and call
sequences (same number of calls everywhere, some with zero blocks), which is
what the collective MPI-IO reader must survive.
"""
import ctypes
import os
import shutil
import signal
import tempfile

import h5py
import numpy as np
import pytest
from conftest import on_root
from helpers import SMALL, STORAGES, assert_same_sample, h5py_sample, make_dataset

from solar.errors import DecodeError, SolarError, SpecError
from solar.io import (
    READERS,
    ReadStats,
    assemble_sample,
    coalesce,
    decode_block,
    default_reader_name,
    get_reader,
    pread_exact,
)
from solar.io.aio import aio_available
from solar.layout import LayoutSpec, build_layout, load_layout
from solar.layout.parts import chunks_of, is_parts, split_chunks

# every registered reader with its defaults, plus variants that change how ranges are read
BACKENDS = [(name, {}) for name in sorted(READERS)] + [
    ("pread", {"threads": 1, "coalesce": False}),
    ("pread", {"threads": 2, "max_gap": 0, "max_read": 3000}),  # cuts runs of blocks into several reads
    ("pread", {"direct_io": True}),  # O_DIRECT through an aligned bounce buffer (the default "auto" here)
    ("pread", {"direct_io": True, "threads": 1, "max_gap": 0, "max_read": 3000}),
    ("pread", {"direct_io": True, "aio": False}),  # O_DIRECT by the pool, a thread blocked per read
    ("pread", {"aio": True, "threads": 2, "max_gap": 0, "max_read": 3000}),  # native AIO, 2 slots refilled
    ("pread", {"direct_io": False}),  # through the page cache: scatter preadv straight into the slots
    ("pread", {"direct_io": False, "threads": 2, "max_gap": 0, "max_read": 3000}),
    ("mpiio", {"collective": False, "threads": 1}),
]


def _id(b):
    name, opts = b
    return name + "".join(f"-{k}={v}" for k, v in opts.items())


@pytest.fixture(params=BACKENDS, ids=[_id(b) for b in BACKENDS])
def backend(request):
    name, opts = request.param
    ok, why = READERS[name].available()
    if not ok:
        pytest.skip(f"{name}: {why}")
    if opts.get("aio") is True and not aio_available()[0]:
        pytest.skip(f"native AIO: {aio_available()[1]}")
    return name, opts


@pytest.fixture(scope="module")
def data_root(comm):
    """A folder every rank sees, for the whole module (datasets are shared by all backends)."""
    path = tempfile.mkdtemp(prefix="solar-readers-") if comm.rank == 0 else None
    path = comm.bcast(path, root=0)
    yield path
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def dataset(comm, data_root):
    """``dataset(preset, storage) -> (layout, reference cache)``, generated once per module."""
    cache = {}

    def get(preset, storage):
        if (preset, storage) not in cache:
            out = on_root(comm, lambda: make_dataset(data_root, preset, storage))
            cache[preset, storage] = (load_layout(out), {})
        return cache[preset, storage]
    return get


# ----------------------------------------------------------------- helpers
def _read(reader, layout, blocks):
    """Read ``blocks`` into fresh arrays; returns ``({block: uint8 array}, ReadStats)``."""
    blocks = np.asarray(blocks, dtype=np.int64)
    outs = [np.full(int(layout.block_nbytes[b]), 0xAB, dtype=np.uint8) for b in blocks]
    stats = reader.read_blocks(blocks, outs)
    assert stats.blocks == len(blocks)
    return dict(zip(blocks.tolist(), outs)), stats


def _block_view(layout, got, b):
    d = int(layout.block_dataset[b])
    return got[b].view(np.dtype(layout.datasets[d].dtype)).reshape(layout.block_shapes[d])


def _inside(layout, b):
    """Index of the part of block ``b`` inside its dataset's extent."""
    d, origin = layout.block_grid_coords(b)
    return tuple(slice(0, min(s, n - o)) for o, s, n in zip(origin, layout.block_shapes[d], layout.datasets[d].shape))


def _reference_block(layout, b):
    if is_parts(layout):  # a part: its rows of the chunk decoded
        d = int(layout.block_dataset[b])
        whole = _reference_block(chunks_of(layout), int(layout.block_parent[b])).view(np.uint8).reshape(-1)
        lo = int(layout.part_offset[b])
        return whole[lo:lo + int(layout.block_nbytes[b])].view(np.dtype(layout.datasets[d].dtype)).reshape(
            layout.block_shapes[d])
    if layout.block_offset[b] < 0:
        return decode_block(layout, b, b"")
    fd = os.open(layout.files[layout.datasets[layout.block_dataset[b]].file], os.O_RDONLY)
    try:
        return decode_block(layout, b, pread_exact(fd, int(layout.block_stored[b]), int(layout.block_offset[b])))
    finally:
        os.close(fd)


def _check(layout, refs, got, raw_reader: bool):
    """Blocks equal decode_block (whole block for raw readers, inside the extent plus zeros outside for
    h5py), and every sample assembled from them equals h5py's."""
    for b in got:
        blk = _block_view(layout, got, b)
        key = ("block", b)
        if key not in refs:
            refs[key] = _reference_block(layout, b) if all(i.raw for i in layout.datasets) else None
        ref = refs[key]
        inside = _inside(layout, b)
        if ref is not None and raw_reader:
            np.testing.assert_array_equal(blk.view(np.uint8), ref.view(np.uint8), err_msg=f"block {b}")
        elif ref is not None:
            np.testing.assert_array_equal(blk[inside], ref[inside], err_msg=f"block {b}")
        if not raw_reader:
            rest = np.ones(blk.shape, dtype=bool)
            rest[inside] = False
            assert not blk[rest].view(np.uint8).any(), f"block {b}: bytes outside the extent are not zero"
    for s in range(layout.n_samples):
        if not all(int(b) in got for b in layout.blocks_of(s)):
            continue
        if s not in refs:
            refs[s] = h5py_sample(layout, s)
        assert_same_sample(assemble_sample(layout, s, lambda b: _block_view(layout, got, b)), refs[s])


def _rank_calls(comm, n_blocks, seed):
    """This rank's call sequence: all blocks in a random order over three calls, an empty call,
    and a random distinct subset (even ranks) or nothing (odd ranks).  Five calls on every rank."""
    rng = np.random.default_rng([seed, comm.rank])
    perm = rng.permutation(n_blocks)
    cuts = np.sort(rng.integers(0, n_blocks + 1, size=2))
    a, b, c = np.split(perm, cuts)
    subset = rng.choice(n_blocks, size=rng.integers(1, n_blocks + 1), replace=False)
    return [a, np.zeros(0, np.int64), b, c, subset if comm.rank % 2 == 0 else np.zeros(0, np.int64)]


# ----------------------------------------------------------------- suite
def _parts(layout, refs, parts: bool):
    """``(layout, refs)``, or with ``parts`` the layout of parts (:mod:`solar.layout.parts`) and its own refs
    (pytest skips where no chunk holds several rows: nothing to cut)."""
    if not parts:
        return layout, refs
    cut = split_chunks(layout)
    if cut is None:
        pytest.skip("no chunk holds more than one sample's rows")
    return cut, refs.setdefault("parts", {})


@pytest.mark.mpi
@pytest.mark.parametrize("parts", [False, True], ids=["blocks", "parts"])
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("preset", sorted(SMALL))
def test_samples_equal_h5py(comm, dataset, backend, preset, storage, parts):
    name, opts = backend
    layout, refs = _parts(*dataset(preset, storage), parts)
    calls = _rank_calls(comm, layout.n_blocks, seed=len(preset) * 7 + STORAGES.index(storage))
    got, total = {}, ReadStats()
    with get_reader(name, layout, comm=comm, **opts) as reader:
        for blocks in calls:
            part, stats = _read(reader, layout, blocks)
            _check(layout, refs, part, READERS[name].needs_raw)  # each call on its own, fresh arrays
            got.update(part)
            total += stats
    assert len(got) == layout.n_blocks
    _check(layout, refs, got, READERS[name].needs_raw)
    assert total.blocks == sum(len(c) for c in calls)
    whole = chunks_of(layout)  # a part's read is its chunk's: each chunk read at least once
    assert total.bytes_read >= int(whole.block_stored[whole.block_offset >= 0].sum())


@pytest.mark.mpi
@pytest.mark.parametrize("parts", [False, True], ids=["blocks", "parts"])
def test_unwritten_chunks_read_as_fill_value(comm, shared_tmp, backend, parts):
    name, opts = backend

    def make():
        with h5py.File(os.path.join(shared_tmp, "u.h5"), "w") as f:
            d = f.create_dataset("X", shape=(9, 3), dtype="i2", chunks=(2, 3), fillvalue=-7)
            d[0:2] = 1
            d[6:9] = 2  # rows 2..5 (chunks 1 and 2) never written; chunk 4 sticks out of the extent
    on_root(comm, make)
    layout = build_layout(LayoutSpec("rows", ("u.h5",), ("X",), root=shared_tmp))
    assert (layout.block_offset < 0).sum() == 2
    if parts:
        layout = split_chunks(layout)
        assert (layout.block_offset < 0).sum() == 4 and layout.n_blocks == 9  # rows 2..5 of chunks 1, 2
    refs = {}
    with get_reader(name, layout, comm=comm, **opts) as reader:
        for blocks in _rank_calls(comm, layout.n_blocks, seed=5):
            got, _ = _read(reader, layout, blocks)
            for b in blocks.tolist():
                if layout.block_offset[b] < 0:
                    assert (_block_view(layout, got, b) == -7).all()
            _check(layout, refs, got, READERS[name].needs_raw)


def _expect_failure(comm, reader, layout, bad, clean, path, dataset_name):
    """Rank 0 reads ``bad`` blocks (plus clean ones), other ranks only ``clean``; the error names the file
    and dataset on rank 0, and on every rank when the reader is collective."""
    mine = np.concatenate([bad, clean]) if comm.rank == 0 else clean
    try:
        _read(reader, layout, mine)
    except SolarError as exc:
        msg = str(exc)
        assert path in msg and dataset_name in msg, msg
        assert comm.rank == 0 or reader.collective or READERS[reader.name] is READERS["h5py"], msg
        return
    assert comm.rank != 0, "reading a bad block did not fail"
    assert not reader.collective, "a collective reader must fail on every rank"


@pytest.mark.mpi
def test_corrupt_gzip_chunk_is_named(comm, shared_tmp, backend):
    name, opts = backend
    out = on_root(comm, lambda: make_dataset(shared_tmp, "ptychonn", "gzip"))
    layout = load_layout(out)
    b = int(layout.dataset_block_start[1]) + 1  # Y_I_train, second chunk
    off, n = int(layout.block_offset[b]), int(layout.block_stored[b])

    def corrupt():
        with open(layout.files[0], "r+b") as fh:
            fh.seek(off + n // 3)
            raw = bytearray(fh.read(16))
            fh.seek(off + n // 3)
            fh.write(bytes(x ^ 0xFF for x in raw))
    comm.Barrier()  # every rank has its layout before the file changes
    on_root(comm, corrupt)
    clean = np.array([0, int(layout.dataset_block_start[2])], dtype=np.int64)
    with get_reader(name, layout, comm=comm, **opts) as reader:
        _expect_failure(comm, reader, layout, np.array([b]), clean, layout.files[0], "Y_I_train")
    if comm.rank == 0 and READERS[name].needs_raw:
        with get_reader(name, layout) as reader, pytest.raises(DecodeError, match=r"chunk at \(3, 0, 0, 0\)"):
            _read(reader, layout, [b])


@pytest.mark.mpi
def test_truncated_file_is_named(comm, shared_tmp, backend):
    name, opts = backend
    out = on_root(comm, lambda: make_dataset(shared_tmp, "ptychonn", "contiguous"))
    layout = load_layout(out)
    last = layout.n_blocks - 1
    cut = int(layout.block_offset[last] + layout.block_stored[last] // 2)
    comm.Barrier()  # every rank has its layout before the file changes
    on_root(comm, lambda: os.truncate(layout.files[0], cut))
    with get_reader(name, layout, comm=comm, **opts) as reader:
        _expect_failure(comm, reader, layout, np.array([last]), np.array([0, 1]), layout.files[0],
                        "Y_phi_train" if READERS[name].needs_raw else "")
    if comm.rank == 0 and READERS[name].needs_raw:
        with get_reader(name, layout) as reader, pytest.raises(DecodeError, match=f"the file has {cut} bytes"):
            _read(reader, layout, [last - 1, last])


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["pread", "mpiio"])
def test_coalescing_reduces_reads(comm, dataset, name):
    layout, refs = dataset("ptychonn", "contiguous")
    blocks = np.random.default_rng(comm.rank).permutation(layout.n_blocks)
    with get_reader(name, layout, comm=comm) as on, get_reader(name, layout, comm=comm, coalesce=False) as off:
        got_on, s_on = _read(on, layout, blocks)
        got_off, s_off = _read(off, layout, blocks)
    assert s_off.n_reads == layout.n_blocks
    expected = coalesce(layout.block_offset, layout.block_stored, on.policy.max_gap, on.policy.max_read)
    assert s_on.n_reads == expected.n_ranges <= len(layout.datasets)  # at most one read per dataset
    assert s_off.bytes_read == int(layout.block_stored.sum())
    assert s_on.bytes_read == expected.nbytes >= s_off.bytes_read  # gaps between datasets are read too
    _check(layout, refs, got_on, True)
    _check(layout, refs, got_off, True)


def test_duplicate_blocks_are_read_once(dataset, backend):
    name, opts = backend
    layout, _ = dataset("pdebench", "gzip")
    blocks = np.array([3, 1, 3, 0, 1, 3])
    with get_reader(name, layout, **opts) as reader:
        got, stats = _read(reader, layout, np.unique(blocks))
        outs = [np.zeros(int(layout.block_nbytes[b]), np.uint8) for b in blocks]
        dstats = reader.read_blocks(blocks, outs)
    assert dstats.blocks == 6 and dstats.n_reads == stats.n_reads and dstats.bytes_read == stats.bytes_read
    for b, o in zip(blocks.tolist(), outs):
        np.testing.assert_array_equal(o, got[b])


@pytest.mark.parametrize("name,opts", [("pread", {"coalesce": False}), ("h5py", {})])
def test_reader_built_before_a_fork_works_in_the_child(dataset, name, opts):
    """As in DataLoader workers: the child gets its own descriptors, handles and threads."""
    layout, refs = dataset("pdebench", "lzf")
    blocks = np.arange(layout.n_blocks)
    with get_reader(name, layout, threads=2, **opts) as reader:
        parent, _ = _read(reader, layout, blocks)  # files and thread pool now exist in the parent
        pid = os.fork()
        if pid == 0:  # child: report through the exit status only
            code = 1
            try:
                signal.alarm(20)  # a pool that never runs must not hang the test
                child, _ = _read(reader, layout, blocks)
                code = 0 if all(np.array_equal(child[b], parent[b]) for b in parent) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        again, _ = _read(reader, layout, blocks)  # the parent's resources are untouched
    _check(layout, refs, again, READERS[name].needs_raw)


@pytest.mark.parametrize("storage", ["contiguous", "gzip"])
def test_forked_readers_reading_at_once_keep_their_bytes_apart(dataset, storage):
    """Parent and two forked children read different blocks over and over, each with a one-thread O_DIRECT reader
    built (and used) before the fork: each process's aligned bounce buffer must be its own (an anonymous mmap is
    shared across fork unless made private), so every read equals what the parent read before the fork."""
    layout, _ = dataset("pdebench", storage)
    blocks = np.arange(layout.n_blocks)
    with get_reader("pread", layout, threads=1, direct_io=True) as reader:
        ref, _ = _read(reader, layout, blocks)
        pids = []
        for child in range(2):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    signal.alarm(60)
                    mine = blocks[child::3]
                    bad = 0
                    for it in range(150):
                        b = int(mine[it % len(mine)])
                        got = [np.empty(int(layout.block_nbytes[b]), np.uint8)]
                        reader.read_blocks(np.array([b]), got)  # one block: read in this (the forking) thread
                        bad += not np.array_equal(got[0], ref[b])
                    code = 0 if bad == 0 else 2
                finally:
                    os._exit(code)
            pids.append(pid)
        mine, bad = blocks[2::3], 0
        for it in range(150):
            b = int(mine[it % len(mine)])
            got = [np.empty(int(layout.block_nbytes[b]), np.uint8)]
            reader.read_blocks(np.array([b]), got)
            bad += not np.array_equal(got[0], ref[b])
        statuses = [os.waitpid(pid, 0)[1] for pid in pids]
    assert bad == 0
    assert all(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in statuses), statuses


# ----------------------------------------------------------------- non-raw layouts
def _scaleoffset_layout(tmp_path):
    """X: gzip (raw-readable); Z: HDF5's scale-offset filter, which only HDF5 decodes."""
    rng = np.random.default_rng(2)
    with h5py.File(tmp_path / "so.h5", "w") as f:
        f.create_dataset("X", data=rng.standard_normal((10, 4)).astype("f4"), chunks=(3, 4), compression="gzip")
        f.create_dataset("Z", data=rng.integers(-500, 500, (10, 6)).astype("i4"), chunks=(4, 6), scaleoffset=0)
    return build_layout(LayoutSpec("rows", ("so.h5",), ("X", "Z"), root=str(tmp_path)))


def test_h5py_reader_serves_filters_only_hdf5_decodes(tmp_path):
    layout = _scaleoffset_layout(tmp_path)
    assert layout.datasets[0].raw and not layout.datasets[1].raw
    assert default_reader_name(layout) == "h5py"
    blocks = np.random.default_rng(0).permutation(layout.n_blocks)
    with get_reader("h5py", layout) as reader:
        got, stats = _read(reader, layout, blocks)
    assert stats.n_reads == layout.n_blocks
    _check(layout, {}, got, raw_reader=False)


@pytest.mark.parametrize("name", [n for n, c in sorted(READERS.items()) if c.needs_raw])
def test_raw_readers_refuse_non_raw_layout(tmp_path, name):
    layout = _scaleoffset_layout(tmp_path)
    with pytest.raises(SpecError, match=r"so.h5:/Z cannot be read raw \(filter scaleoffset is decoded by HDF5 "
                                        r"only \(h5py reader\)\); use the 'h5py' reader"):
        get_reader(name, layout)


def _custom_type_layout(tmp_path):
    """Types whose stored bytes are not the bytes of the numpy dtype h5py reports (HDF5 converts them on read):
    I12 a 12-bit signed integer in 2 bytes, U12 a 12-bit unsigned one at bit offset 4 (chunked), F a float with
    float32's fields in 8 bytes; P plain float32."""
    rng = np.random.default_rng(3)
    h5t = h5py.h5t
    i12 = h5t.STD_I16LE.copy()
    i12.set_precision(12)
    u12 = h5t.STD_U16LE.copy()
    u12.set_precision(12)
    u12.set_offset(4)
    f = h5t.IEEE_F64LE.copy()
    f.set_fields(31, 23, 8, 0, 23)
    f.set_ebias(127)
    f.set_precision(32)
    values = {"I12": rng.integers(-2000, 2000, (8, 5)).astype("<i2"),
              "U12": rng.integers(0, 4000, (8, 5)).astype("<u2"),
              "F": rng.standard_normal((8, 4)).astype("<f4").astype("<f8")}
    with h5py.File(tmp_path / "types.h5", "w") as h:
        for name, tid in (("I12", i12), ("U12", u12), ("F", f)):
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            if name == "U12":
                dcpl.set_chunk((3, 5))
            h5py.h5d.create(h.id, name.encode(), tid, h5py.h5s.create_simple(values[name].shape), dcpl=dcpl)
            h[name][...] = values[name]
            assert np.array_equal(h[name][...], values[name])
        h.create_dataset("P", data=rng.standard_normal((8, 3)).astype("<f4"))
    return build_layout(LayoutSpec("rows", ("types.h5",), ("I12", "U12", "F", "P"), root=str(tmp_path)))


def test_types_hdf5_converts_on_read_are_read_by_hdf5(tmp_path):
    """Copying their stored bytes gave wrong values without an error (e.g. 4091 for -5); now the layout sends them
    to the h5py reader, which delivers h5py's values, and the raw readers refuse them by name."""
    layout = _custom_type_layout(tmp_path)
    assert [d.raw for d in layout.datasets] == [False, False, False, True]
    assert "stored type is not plain int16" in layout.datasets[0].fallback
    assert default_reader_name(layout) == "h5py"
    with get_reader("h5py", layout) as reader:
        got, _ = _read(reader, layout, np.arange(layout.n_blocks))
    _check(layout, {}, got, raw_reader=False)
    for name in [n for n, c in sorted(READERS.items()) if c.needs_raw and c.available()[0]]:
        with pytest.raises(SpecError, match=r"types.h5:/I12 cannot be read raw \(its stored type is not plain int16"):
            get_reader(name, layout)


def _unfiltered_edges_layout(tmp_path):
    """Chunked fields written with H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS (latest file format): HDF5 stores the
    partial edge chunks unfiltered with filter mask 0.  S: shuffle, rows partial; G: shuffle + gzip + Fletcher-32,
    rows and columns partial; D: gzip alone (the O_DIRECT reader inflates such chunks in its kernel), rows
    partial; Z: gzip, every chunk whole (nothing to mark)."""
    from solar.layout.h5capi import DONT_FILTER_PARTIAL_CHUNKS, _hdf5
    lib = _hdf5()
    if lib is None or not hasattr(lib, "H5Pset_chunk_opts"):
        pytest.skip("HDF5's H5Pset_chunk_opts is not reachable here")
    rng = np.random.default_rng(4)
    path = str(tmp_path / "edges.h5")
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    fid = h5py.h5f.create(path.encode(), h5py.h5f.ACC_TRUNC, fapl=fapl)
    specs = {"S": ((10, 8), (4, 8), ("shuffle",)), "G": ((10, 7), (4, 3), ("shuffle", "gzip", "fletcher32")),
             "D": ((10, 6), (4, 6), ("gzip",)), "Z": ((10, 4), (5, 4), ("gzip",))}
    for name, (shape, chunks, filters) in specs.items():
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk(chunks)
        for f in filters:
            {"shuffle": dcpl.set_shuffle, "gzip": lambda: dcpl.set_deflate(4), "fletcher32": dcpl.set_fletcher32}[f]()
        assert lib.H5Pset_chunk_opts(ctypes.c_int64(dcpl.id), ctypes.c_uint(DONT_FILTER_PARTIAL_CHUNKS)) >= 0
        h5py.h5d.create(fid, name.encode(), h5py.h5t.STD_I32LE, h5py.h5s.create_simple(shape), dcpl=dcpl)
    fid.close()
    with h5py.File(path, "a") as h:
        for name, (shape, _, _) in specs.items():
            h[name][...] = rng.integers(0, 1 << 30, shape).astype("<i4")
    return build_layout(LayoutSpec("rows", ("edges.h5",), tuple(specs), root=str(tmp_path)))


def test_partial_edge_chunks_stored_unfiltered_are_read_as_stored(tmp_path, backend):
    """The readers ran the pipeline on such chunks: shuffle gave wrong bytes without an error, gzip and Fletcher-32
    a false corruption error on a valid file."""
    name, opts = backend
    layout = _unfiltered_edges_layout(tmp_path)
    assert all(d.raw for d in layout.datasets)
    with get_reader(name, layout, **opts) as reader:
        got, _ = _read(reader, layout, np.random.default_rng(0).permutation(layout.n_blocks))
    _check(layout, {}, got, READERS[name].needs_raw)


def test_partial_edge_chunks_go_to_hdf5_where_the_chunk_options_cannot_be_read(tmp_path, monkeypatch):
    import solar.layout.h5meta as h5meta
    monkeypatch.setattr(h5meta, "chunk_opts", lambda plist: None)
    layout = _unfiltered_edges_layout(tmp_path)
    assert [d.raw for d in layout.datasets] == [False, False, False, True]  # Z's chunks are all whole
    assert "HDF5's chunk options cannot be read" in layout.datasets[0].fallback


# ----------------------------------------------------------------- registry and API
def test_get_reader_errors(dataset):
    layout, _ = dataset("ptychonn", "contiguous")
    with pytest.raises(SpecError, match="unknown reader 'posix'; valid readers: h5py, h5py-mpio, mpiio, pread"):
        get_reader("posix", layout)
    with pytest.raises(SpecError, match="reader 'pread' has no option 'colective'; valid: threads, coalesce"):
        get_reader("pread", layout, colective=True)
    with pytest.raises(SpecError, match="threads must be an integer >= 1, got 0"):
        get_reader("pread", layout, threads=0)
    with pytest.raises(SpecError, match="max_read must be an integer >= 0 .*got -1"):
        get_reader("pread", layout, max_read=-1)
    for name, cls in READERS.items():
        ok, why = cls.available()
        if not ok:
            assert why
            with pytest.raises(SpecError, match=f"reader '{name}' is not available here: "):
                get_reader(name, layout)


def test_request_is_validated(dataset):
    layout, _ = dataset("ptychonn", "contiguous")
    n = int(layout.block_nbytes[0])
    with get_reader("pread", layout) as r:
        with pytest.raises(ValueError, match=rf"out\[1\] must be a writable contiguous uint8 array of {n} bytes"):
            r.read_blocks(np.array([0, 1]), [np.empty(n, np.uint8), np.empty(n - 1, np.uint8)])
        with pytest.raises(ValueError, match=f"block id {layout.n_blocks} out of range"):
            r.read_blocks(np.array([layout.n_blocks]), [np.empty(n, np.uint8)])
        with pytest.raises(ValueError, match="2 blocks but 1 output arrays"):
            r.read_blocks(np.array([0, 1]), [np.empty(n, np.uint8)])
    with pytest.raises(ValueError, match="reader 'pread' is closed"):
        r.read_blocks(np.array([0]), [np.empty(n, np.uint8)])


def test_collective_flag_follows_the_option(dataset):
    layout, _ = dataset("ptychonn", "contiguous")
    assert READERS["mpiio"].collective and not READERS["pread"].collective
    with get_reader("mpiio", layout) as a, get_reader("mpiio", layout, collective=False) as b:
        assert a.collective and not b.collective


def test_default_reader_name(dataset, monkeypatch):
    import solar.io.reader as reader_mod

    class FakeComm:
        def __init__(self, size):
            self.size = size

        def Get_size(self):
            return self.size

    layout, _ = dataset("ptychonn", "contiguous")
    assert default_reader_name(layout) == "pread"
    assert default_reader_name(layout, FakeComm(4)) == "pread"  # a local disk
    monkeypatch.setattr(reader_mod, "parallel_fs_name", lambda path: "lustre")
    assert default_reader_name(layout, FakeComm(4)) == "mpiio"
    assert default_reader_name(layout, FakeComm(1)) == "pread"


def test_fs_magic_of_a_local_folder(tmp_path):
    from solar.io.fstype import fs_magic, parallel_fs_name
    magic = fs_magic(str(tmp_path))
    assert magic is None or magic > 0
    assert parallel_fs_name(str(tmp_path)) is None  # tests run on a local file system
    assert fs_magic(str(tmp_path / "missing")) is None


def test_read_stats_add():
    a = ReadStats(1, 10, 2, 0.5)
    b = a.merge(ReadStats(2, 5, 1, 0.25))
    assert b == ReadStats(3, 15, 3, 0.75) and a == ReadStats(1, 10, 2, 0.5)
    a += b
    assert a == ReadStats(4, 25, 5, 1.25)


def test_direct_io_where_the_file_system_has_none_is_one_line(tmp_path, monkeypatch):
    """A file system without O_DIRECT (open fails with EINVAL): a DecodeError naming the file and the option."""
    import errno
    import os
    from solar.errors import DecodeError
    from solar.io.pread_reader import open_fd
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT here")
    path = str(tmp_path / "x.bin")
    open(path, "wb").close()
    real = os.open

    def no_direct(p, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(p, flags, *a)
    monkeypatch.setattr(os, "open", no_direct)
    with pytest.raises(DecodeError, match=r"cannot open .*x\.bin with O_DIRECT: .*direct_io=False"):
        open_fd([path], False, 0, direct=True)
    os.close(open_fd([path], False, 0, direct=False))  # without it the file opens


def test_direct_io_auto_reads_through_the_page_cache_where_the_file_system_has_none(tmp_path, monkeypatch):
    """direct_io="auto" (the default) on a file system that refuses O_DIRECT: the file is read buffered,
    the bytes equal h5py's, the pages read are dropped (drop_cache), and open_stats counts the file."""
    import errno
    import os
    from solar.io import kernels
    from solar.io import pread_reader as pr
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT here")
    path = str(tmp_path / "f.h5")
    data = np.random.default_rng(3).standard_normal((64, 100)).astype(np.float32)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data, chunks=(8, 100))
    lay = build_layout(LayoutSpec("rows", ("f.h5",), ("x",), root=str(tmp_path)))
    real_open = os.open
    asked_direct = []

    def no_direct(p, flags, *a):
        if flags & os.O_DIRECT:
            asked_direct.append(p)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *a)
    dropped = []
    real_fadvise = kernels.fadvise_ranges

    def spy(fds, starts, lengths, advice, align):
        dropped.append(int(len(fds)))
        return real_fadvise(fds, starts, lengths, advice, align)
    monkeypatch.setattr(os, "open", no_direct)
    monkeypatch.setattr(pr, "fadvise_ranges", spy)
    rd = get_reader("pread", lay, threads=2)
    assert rd.options["direct_io"] == "auto"
    blocks = np.arange(lay.n_blocks, dtype=np.int64)
    out = [np.empty(int(lay.block_nbytes[b]), np.uint8) for b in blocks]
    rd.read_blocks(blocks, out)
    got = np.concatenate([o.view(np.float32) for o in out]).reshape(data.shape)
    np.testing.assert_array_equal(got, data)
    assert asked_direct and rd.open_stats()["buffered_files"] == 1 and rd.open_stats()["direct_io"]
    assert sum(dropped) > 0  # the buffered file's pages were dropped
    rd.close()


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_direct_io_option_is_checked(tmp_path, bad):
    path = str(tmp_path / "f.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.zeros((4, 4), np.float32))
    lay = build_layout(LayoutSpec("rows", ("f.h5",), ("x",), root=str(tmp_path)))
    with pytest.raises(SpecError, match=r"direct_io must be True, False or \"auto\", got"):
        get_reader("pread", lay, direct_io=bad)


def test_direct_io_reads_a_file_whose_end_is_not_aligned(tmp_path):
    """The last block of a file ends before the aligned window does: the short read at the end of the
    file is the data, not an error."""
    import os
    from solar.io.pread_reader import DIRECT_ALIGN, open_fd, pread_direct
    path = str(tmp_path / "tail.bin")
    data = np.random.default_rng(0).integers(0, 256, 3 * DIRECT_ALIGN + 123, dtype=np.uint8)
    data.tofile(path)
    fd = open_fd([path], False, 0, direct=True)
    try:
        import mmap
        buf = memoryview(mmap.mmap(-1, 4 * DIRECT_ALIGN))
        got = pread_direct(fd, buf, 2 * DIRECT_ALIGN, DIRECT_ALIGN + 123)
        assert got == DIRECT_ALIGN + 123
        assert bytes(buf[:got]) == data[2 * DIRECT_ALIGN:].tobytes()
    finally:
        os.close(fd)


def test_direct_kernel_reads_copies_and_reports_failures(tmp_path):
    """The GIL-free O_DIRECT kernel (what the pread reader runs for unfiltered blocks): ranges read
    into the aligned buffer and their blocks copied out; a file ending inside the window is data; a read
    past the end comes back short after the retries; a misaligned offset reports EINVAL and stops there."""
    import errno
    import mmap
    from solar.io.kernels import DirectIO, DirectRanges, read_direct_ranges
    from solar.io.pread_reader import DIRECT_ALIGN as A
    from solar.io.pread_reader import open_fd
    path = str(tmp_path / "k.bin")
    data = np.random.default_rng(1).integers(0, 256, 5 * A + 123, dtype=np.uint8)
    data.tofile(path)
    fd = open_fd([path], False, 0, direct=True)
    bounce = np.frombuffer(mmap.mmap(-1, 4 * A), np.uint8)
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    try:
        # range 0: window [A, 3A), blocks at A+5 (700 bytes) and A+900 (A bytes); range 1: the file's tail
        lo, size, need = i64(A, 4 * A), i64(2 * A, 2 * A), i64(900 + A, A + 123)
        ptr, src, nb = i64(0, 2, 3), i64(5, 900, 100), i64(700, A, 23)
        out = [np.zeros(n, np.uint8) for n in nb]
        dst = i64(*[o.ctypes.data for o in out])
        got, err = np.zeros(2, np.int64), np.full(2, -7, np.int64)
        io = DirectIO(fd, bounce.ctypes.data, 3, 0, A)
        none = np.zeros(3, bool)  # no zlib stream
        # (decoded sizes that differ from the stored ones: a raw block is copied by its stored bytes)
        rg = lambda lo, need: DirectRanges(lo, size, need, got, err, ptr, src, nb, nb + 7, dst, none)  # noqa: E731
        assert read_direct_ranges(io, rg(lo, need), 0, 2) == -1
        assert got.tolist() == [2 * A, A + 123] and err.tolist() == [0, 0]
        for o, start in zip(out, [A + 5, A + 900, 4 * A + 100]):
            np.testing.assert_array_equal(o, data[start:start + o.shape[0]])
        # past the end: 0 bytes, retried, then reported short (nothing copied)
        out[2][:] = 0
        lo2, need2 = i64(A, 6 * A), i64(900 + A, 10)
        assert read_direct_ranges(io, rg(lo2, need2), 0, 2) == 1
        assert got[1] == 0 and err[1] == 0 and not out[2].any()
        # misaligned offset: O_DIRECT refuses it (EINVAL), not retried, range 0 reported
        lo3 = i64(A + 1, 4 * A)
        assert read_direct_ranges(io, rg(lo3, need), 0, 2) == 0
        assert err[0] == errno.EINVAL
    finally:
        os.close(fd)


@pytest.mark.skipif(not __import__("solar.io.kernels", fromlist=["x"]).LIBDEFLATE, reason="libdeflate not installed")
@pytest.mark.parametrize("preset", ["ptychonn", "cosmoflow"])
def test_zlib_chunks_inflate_in_the_kernel(dataset, monkeypatch, tmp_path, preset):
    """With O_DIRECT and libdeflate, chunks filtered by deflate alone are read and inflated straight into
    the caller's arrays by one GIL-free call per job (the same bytes as h5py's); a corrupt stream is a
    DecodeError naming file, dataset and chunk, and so is one that inflates to too few bytes."""
    import copy
    import zlib

    from solar.io import pread_reader
    layout, _ = dataset(preset, "gzip")
    calls, real = [], pread_reader.inflate_direct_ranges
    monkeypatch.setattr(pread_reader, "inflate_direct_ranges", lambda *a: calls.append(a[2:4]) or real(*a))
    blocks = np.arange(layout.n_blocks)
    with get_reader("h5py", layout) as h5:
        ref, _ = _read(h5, layout, blocks)
    with get_reader("pread", layout, threads=3, direct_io=True) as reader:
        got, _ = _read(reader, layout, blocks)
    for b in blocks.tolist():
        np.testing.assert_array_equal(got[b], ref[b])
    assert calls  # the kernel ran (these files' chunks are zlib streams: deflate alone)
    # damage one chunk in a copy of the files: its stream, then its length (a stream of an empty chunk)
    z = np.flatnonzero(pread_reader._zlib_blocks(layout))
    b = int(z[len(z) // 2])
    files = [str(tmp_path / os.path.basename(f)) for f in layout.files]
    for f, g in zip(layout.files, files):
        shutil.copy(f, g)
    path = files[layout.datasets[int(layout.block_dataset[b])].file]
    off, n = int(layout.block_offset[b]), int(layout.block_stored[b])
    short = zlib.compress(b"\0" * 10)
    for damage in (b"\xff" * 16, short + b"\0" * (n - len(short))):
        with open(path, "r+b") as f:
            f.seek(off)
            f.write(damage)
        lay = copy.copy(layout)
        lay.files = tuple(files)  # the same block map over the damaged copies
        with get_reader("pread", lay, threads=2, direct_io=True) as reader:
            with pytest.raises(DecodeError, match=r"cannot decode chunk at .* of .*\.h(df)?5:/\S+: (corrupt|decodes)"):
                _read(reader, lay, np.array([b]))


def test_direct_jobs_spread_over_the_pool(dataset, monkeypatch):
    """With O_DIRECT a call's unfiltered ranges are cut into jobs for the pool's workers (a call of many
    ranges is not one serial job), every range in exactly one job, each job one file."""
    import threading
    import time
    from solar.io import pread_reader
    layout, _ = dataset("ptychonn", "contiguous")
    seen, real = [], pread_reader.read_direct_ranges

    def slow(io, ranges, r0, r1):
        seen.append((threading.get_ident(), r0, r1))
        time.sleep(0.005)  # long enough for the other workers to take the next jobs
        return real(io, ranges, r0, r1)
    monkeypatch.setattr(pread_reader, "read_direct_ranges", slow)
    blocks = np.arange(0, layout.n_blocks, 2)
    with get_reader("h5py", layout) as h5:
        ref, _ = _read(h5, layout, blocks)
    with get_reader("pread", layout, threads=4, direct_io=True, coalesce=False, aio=False) as reader:
        got, stats = _read(reader, layout, blocks)
    assert stats.n_reads == blocks.shape[0]  # one range per block
    for b in blocks.tolist():
        np.testing.assert_array_equal(got[b], ref[b])
    spans = sorted((a, b) for _, a, b in seen)
    assert spans[0][0] == 0 and all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
    assert len(spans) > 1 and len({t for t, _, _ in seen}) > 1


needs_aio = pytest.mark.skipif(not aio_available()[0], reason=f"native AIO: {aio_available()[1]}")


@needs_aio
def test_aio_kernel_reads_copies_and_reports_failures(tmp_path):
    """The native AIO kernel (what the pread reader runs for unfiltered blocks by default on ext4, xfs,
    btrfs): more ranges than slots, each range's blocks copied out of its slot; a file ending inside a window
    is data; a read past the end comes back short after the pread retries; a misaligned offset reports
    EINVAL; with several failures the first in the order given is reported, once every read is back; a
    context the kernel refuses reads every range with pread."""
    import errno
    import mmap
    from solar.io.aio import aio_read_ranges, io_destroy, make_ring
    from solar.io.kernels import DirectRanges
    from solar.io.pread_reader import DIRECT_ALIGN as A
    from solar.io.pread_reader import open_fd
    path = str(tmp_path / "k.bin")
    data = np.random.default_rng(1).integers(0, 256, 9 * A + 123, dtype=np.uint8)
    data.tofile(path)
    fd = open_fd([path], False, 0, direct=True)
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    slots = np.frombuffer(mmap.mmap(-1, 2 * 2 * A), np.uint8)
    ring = make_ring(2, 2 * A, slots.ctypes.data)
    try:
        # 5 ranges of one block each through 2 slots; the last is the file's tail (123 bytes past 9A)
        lo, size = i64(0, 2 * A, 4 * A, 6 * A, 8 * A), i64(2 * A, 2 * A, A, 2 * A, 2 * A)
        need = i64(A + 10, 2 * A, 100, 2 * A, A + 123)
        ptr, src, nb = i64(0, 1, 2, 3, 4, 5), i64(10, 0, 7, A - 1, 0), i64(A, 2 * A, 93, A + 1, A + 123)
        out = [np.zeros(n, np.uint8) for n in nb]
        dst = i64(*[o.ctypes.data for o in out])
        got, err = np.zeros(5, np.int64), np.full(5, -7, np.int64)

        def rg(lo, need):
            return DirectRanges(lo, size, need, got, err, ptr, src, nb, nb, dst, np.zeros(5, bool))
        fds = np.full(5, fd, np.int64)
        order = i64(4, 0, 3, 1, 2)
        assert aio_read_ranges(ring, rg(lo, need), fds, order, 3, 0, A) == -1
        assert err.tolist() == [0] * 5 and got[4] == A + 123 and (got[:4] >= need[:4]).all()
        for o, start in zip(out, (lo + src).tolist()):
            np.testing.assert_array_equal(o, data[start:start + o.shape[0]])
        # ranges 1 and 3 past the end (short after the retries, nothing copied), range 2 misaligned (EINVAL)
        for o in out:
            o[:] = 0
        lo2, need2 = i64(0, 12 * A, 4 * A + 1, 14 * A, 8 * A), i64(A + 10, 10, 100, 10, A + 123)
        bad = aio_read_ranges(ring, rg(lo2, need2), fds, i64(0, 1, 2, 3, 4), 3, 0, A)
        assert bad == 1 and got[1] == 0 and err[1] == 0 and not out[1].any()
        assert aio_read_ranges(ring, rg(lo2, need2), fds, i64(4, 2, 3, 1, 0), 3, 0, A) == 2
        assert err[2] == errno.EINVAL
        # the ring is fit for the next call: nothing was left in flight
        assert aio_read_ranges(ring, rg(lo, need), fds, i64(0, 1, 2, 3, 4), 3, 0, A) == -1
        # a context the kernel refuses (io_submit fails): every range read with pread, the same bytes
        for o in out:
            o[:] = 0
        assert aio_read_ranges(ring._replace(ctx=0), rg(lo, need), fds, order, 3, 0, A) == -1
        for o, start in zip(out, (lo + src).tolist()):
            np.testing.assert_array_equal(o, data[start:start + o.shape[0]])
    finally:
        io_destroy(ring.ctx)
        os.close(fd)


@needs_aio
def test_aio_reads_equal_h5py_and_fall_back_when_refused(dataset, monkeypatch):
    """aio=True reads h5py's bytes; where io_setup refuses a context (the machine's aio-max-nr), the pool
    reads the call and open_stats counts it; a bad option is one line."""
    import errno
    from solar.io import pread_reader
    layout, _ = dataset("ptychonn", "contiguous")
    blocks = np.random.default_rng(5).permutation(layout.n_blocks)
    with get_reader("h5py", layout) as h5:
        ref, _ = _read(h5, layout, blocks)
    with get_reader("pread", layout, threads=3, direct_io=True, aio=True) as reader:
        got, _ = _read(reader, layout, blocks)
        st = reader.open_stats()
    assert st["aio"] is True and st["aio_files"] >= 1 and st["aio_refused"] == 0
    for b in blocks.tolist():
        np.testing.assert_array_equal(got[b], ref[b])

    def refuse(*a):
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
    monkeypatch.setattr(pread_reader, "make_ring", refuse)
    with get_reader("pread", layout, threads=3, direct_io=True, aio=True) as reader:
        got, _ = _read(reader, layout, blocks)
        assert reader.open_stats()["aio_refused"] >= 1
    for b in blocks.tolist():
        np.testing.assert_array_equal(got[b], ref[b])
    with pytest.raises(SpecError, match=r"aio must be True, False or \"auto\", got 'yes'"):
        get_reader("pread", layout, aio="yes")
    with pytest.raises(SpecError, match=r"aio=True needs direct_io"):
        get_reader("pread", layout, aio=True, direct_io=False)


@needs_aio
def test_aio_call_with_a_missing_file_names_it_and_leaves_no_file_pinned(tmp_path):
    """Review finding: a file that failed to open while a group of files was being pinned for one AIO call left
    the others pinned for good (pinned files are never closed; once all are pinned, readers wait forever)."""
    data = make_dataset(tmp_path, "cosmoflow", samples=12, size=4)
    layout = load_layout(data)
    blocks = np.arange(layout.n_blocks, dtype=np.int64)
    gone = layout.files[int(layout.datasets[int(layout.block_dataset[blocks[-1]])].file)]
    os.remove(gone)
    with get_reader("pread", layout, threads=4, aio=True) as reader:
        out = [np.empty(int(layout.block_nbytes[b]), np.uint8) for b in blocks]
        with pytest.raises(DecodeError, match=os.path.basename(gone)):
            reader.read_blocks(blocks, out)
        assert reader.open_stats()["aio_files"] >= 2
        assert all(e.pins == 0 for e in reader._files._entries.values())


@needs_aio
def test_aio_context_of_a_thread_that_ended_is_destroyed(dataset):
    """Review finding: each calling thread's AIO context lived until close(), so readers called from short-lived
    threads piled up contexts against the machine-wide fs.aio-max-nr.  Now a thread's context goes with it,
    and close() destroys the rest."""
    import gc
    import threading
    layout, _ = dataset("ptychonn", "contiguous")
    blocks = np.arange(min(8, layout.n_blocks), dtype=np.int64)
    with get_reader("pread", layout, threads=2, aio=True) as reader:
        for _ in range(3):
            t = threading.Thread(target=_read, args=(reader, layout, blocks))
            t.start()
            t.join()
        gc.collect()
        assert len(reader._ring_fins) == 3 and not any(f.alive for f in reader._ring_fins)
        _read(reader, layout, blocks)  # this thread's ring stays until close
        assert [f.alive for f in reader._ring_fins] == [False] * 3 + [True]
        fins = list(reader._ring_fins)
    assert not any(f.alive for f in fins)
