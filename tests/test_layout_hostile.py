"""Legal but unusual storage, and hostile layout input.

External raw storage is served (by the h5py reader, for the right reason); contiguous data never
written reads as its fill value with every reader; declared-huge datasets are refused before any
array of their size exists; damaged files, wrong field lists and odd datasets give a SolarError or
a sane block map, never another exception, a crash or an out-of-file block (hypothesis; the
damaged-bytes search runs in a child process so that a crash of HDF5 shows as a failure).
"""
import os
import subprocess
import sys
import tempfile
import tracemalloc

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import solar
from solar.cli import main
from solar.errors import LayoutError, SolarError, SpecError
from solar.io import READERS, assemble_sample, default_reader_name, get_reader
from solar.layout import LayoutSpec, build_layout, load_layout
from solar.loader import SolarLoader

from helpers import assert_same_sample, h5py_sample

READER_NAMES = [n for n in ("pread", "mpiio", "h5py") if READERS[n].available()[0]]


def _deliver(layout, reader=None):
    """Every sample once through SolarLoader (1 rank, 1 epoch), as numpy: ``{sample: {field: array}}``."""
    sched = solar.plan(layout, world_size=1, local_batch=2, epochs=1, buffer_fraction=1.0)
    out = {}
    with SolarLoader(sched, layout, rank=0, reader=reader, as_torch=False) as loader:
        name = loader.reader_name
        for batch in loader:
            for i, s in enumerate(np.asarray(batch["index"]).tolist()):
                out[s] = {k: np.asarray(batch[k][i]) for k in layout.field_names}
    sched.close()
    assert sorted(out) == list(range(layout.n_samples))
    return name, out


def _assert_equals_h5py(layout, got):
    for s, fields in got.items():
        assert_same_sample(fields, h5py_sample(layout, s))


# ------------------------------------------------------------------ external raw storage
def _external_file(folder):
    """``e.h5`` whose ``X`` (6 x 4 float32) lives in two raw files, at an offset in the first,
    next to an ordinary ``Y``; the raw file names are relative (HDF5 resolves them from the cwd,
    which must be ``folder`` here)."""
    assert os.path.samefile(os.getcwd(), folder)
    with open(os.path.join(folder, "x0.raw"), "wb") as fh:
        fh.write(b"\xee" * 40)  # header bytes before the data
    x = np.arange(24, dtype="f4").reshape(6, 4) * 1.5
    with h5py.File(os.path.join(folder, "e.h5"), "w") as f:
        f.create_dataset("X", shape=x.shape, dtype="f4", external=[("x0.raw", 40, 40), ("x1.raw", 8, 56)])[...] = x
        f.create_dataset("Y", data=np.arange(6, dtype="i8") * 7)
    return LayoutSpec("rows", ("e.h5",), ("X", "Y"), root=folder)


def test_external_raw_storage_is_served_by_the_h5py_reader(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    layout = build_layout(_external_file(str(tmp_path)))
    info = layout.datasets[0]
    assert not info.raw and info.fallback.startswith("external raw storage in x0.raw, x1.raw")
    assert layout.datasets[1].raw
    assert default_reader_name(layout) == "h5py"
    for name in ("pread", "mpiio"):
        with pytest.raises(SpecError, match=r"e.h5:/X cannot be read raw \(external raw storage"):
            get_reader(name, layout)
    reader, got = _deliver(layout)
    assert reader == "h5py"
    _assert_equals_h5py(layout, got)
    assert got[5]["X"].tolist() == [30.0, 31.5, 33.0, 34.5]


def test_external_raw_files_next_to_the_hdf5_file(tmp_path, monkeypatch):
    """With HDF5_EXTFILE_PREFIX=${ORIGIN} (read by HDF5 once, at start: a fresh process) the raw files
    are found next to the HDF5 file from any folder; without it, the layout names the missing file."""
    monkeypatch.chdir(tmp_path)
    spec = _external_file(str(tmp_path))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(LayoutError, match=r"external raw file 'x0.raw', not found at .*elsewhere"):
        build_layout(spec)
    code = ("import numpy as np, h5py, solar, sys; from solar.io import get_reader, assemble_sample\n"
            "from solar.layout import LayoutSpec, build_layout\n"
            "lay = build_layout(LayoutSpec('rows', ('e.h5',), ('X', 'Y'), root=sys.argv[1]))\n"
            "blocks = np.arange(lay.n_blocks)\n"
            "outs = [np.empty(int(lay.block_nbytes[b]), np.uint8) for b in blocks]\n"
            "get_reader('h5py', lay).read_blocks(blocks, outs)\n"
            "view = lambda b: outs[b].view(lay.datasets[lay.block_dataset[b]].dtype).reshape("
            "lay.block_shapes[lay.block_dataset[b]])\n"
            "x = np.stack([assemble_sample(lay, s, view)['X'] for s in range(lay.n_samples)])\n"
            "with h5py.File(lay.files[0], 'r') as f: assert (x == f['X'][...]).all()\n"
            "print('same', x.sum())\n")
    env = dict(os.environ, HDF5_EXTFILE_PREFIX="${ORIGIN}",
               PYTHONPATH=os.path.dirname(os.path.dirname(solar.__file__)))
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "same 414.0" in proc.stdout, proc.stderr[-3000:]


def test_missing_external_raw_file_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = _external_file(str(tmp_path))
    os.remove(tmp_path / "x1.raw")
    with pytest.raises(LayoutError, match=r"e.h5:/X keeps its data in external raw file 'x1.raw', not found"):
        build_layout(spec)


# ------------------------------------------------------------------ never-written data
def _unwritten_file(folder):
    """``U``: contiguous, never written (no storage), fill -3; ``C``: chunked, chunks 1 and 2 never
    written, fill 7; ``X``: ordinary data."""
    with h5py.File(os.path.join(folder, "u.h5"), "w") as f:
        f.create_dataset("U", shape=(7, 5), dtype="i2", fillvalue=-3)
        c = f.create_dataset("C", shape=(7, 3), dtype="f4", chunks=(2, 3), fillvalue=7.0)
        c[0:2] = 1.0
        c[6] = 2.0
        f.create_dataset("X", data=np.arange(14, dtype="u1").reshape(7, 2))
    return LayoutSpec("rows", ("u.h5",), ("U", "C", "X"), root=folder)


@pytest.mark.parametrize("reader", READER_NAMES)
def test_never_written_data_reads_as_the_fill_value(tmp_path, reader):
    layout = build_layout(_unwritten_file(str(tmp_path)))
    u = layout.datasets[0]
    assert u.raw and u.offset is None and u.stored_nbytes == 0
    lo, hi = layout.dataset_block_start[0], layout.dataset_block_start[1]
    assert (layout.block_offset[lo:hi] == -1).all()
    assert (layout.block_offset[layout.dataset_block_start[1]:layout.dataset_block_start[2]] < 0).sum() == 2
    _, got = _deliver(layout, reader)
    _assert_equals_h5py(layout, got)
    assert all((got[s]["U"] == -3).all() for s in got)
    assert got[3]["C"].tolist() == [7.0, 7.0, 7.0] and got[6]["C"].tolist() == [2.0, 2.0, 2.0]


def test_nan_fill_values_keep_their_bits_through_the_schedule(tmp_path):
    """A NaN fill value with payload bits (f4, big-endian f8, complex) is delivered with h5py's bytes when the
    loader takes the layout stored in the schedule, not only the one built in the process (JSON turned every
    NaN into the default one)."""
    nan4 = np.frombuffer(bytes.fromhex("0100c07f"), "<f4")[0]
    nan8 = np.frombuffer(bytes.fromhex("03000000" "0000f87f"), "<f8")[0]
    with h5py.File(tmp_path / "n.h5", "w") as f:
        for name, dt, fill in (("A", "<f4", nan4), ("B", ">f8", nan8), ("C", "<c8", complex(nan4, -1.5))):
            d = f.create_dataset(name, shape=(4, 3), dtype=dt, chunks=(2, 3), fillvalue=np.array(fill, dt))
            d[0:2] = 1  # rows 2, 3 never written
    layout = build_layout(LayoutSpec("rows", ("n.h5",), ("A", "B", "C"), root=str(tmp_path)))
    plan = str(tmp_path / "s.h5")
    solar.plan(layout, out=plan, world_size=1, local_batch=4, epochs=1, buffer_per_rank=1 << 20).close()
    with h5py.File(tmp_path / "n.h5", "r") as f:
        ref = {k: f[k][...] for k in "ABC"}
    for data in (layout, None):  # None: the layout stored in the schedule
        with SolarLoader(plan, data, rank=0, as_torch=False, reader="pread") as loader:
            batch = next(iter(loader))
        idx = np.asarray(batch["index"])
        for k in "ABC":
            want = ref[k][idx].astype(ref[k].dtype.newbyteorder("="))  # delivered in native byte order
            assert np.asarray(batch[k]).tobytes() == want.tobytes(), (k, data is None)


def test_inspect_a_never_written_dataset(tmp_path, capsys):
    _unwritten_file(str(tmp_path)).save(str(tmp_path))
    assert main(["inspect", str(tmp_path)]) == 0
    assert "U " in capsys.readouterr().out


# ------------------------------------------------------------------ declared-huge datasets
HUGE = {
    # name: (h5py create_dataset kwargs, spec kind, message)
    "grid-1e12": (dict(shape=(10**12,), dtype="f4", chunks=(1,)), "rows", r"1,000,000,000,000 chunks"),
    "grid-2d": (dict(shape=(2**20, 2**20, 1), dtype="u1", chunks=(1, 1, 1), maxshape=(None, None, 1)), "whole",
                r"1,099,511,627,776 chunks"),
    "contiguous-unwritten-rows": (dict(shape=(10**12, 4), dtype="f8"), "rows", r"1,000,000,000,000 blocks"),
    "contiguous-unwritten-whole": (dict(shape=(10**12, 4), dtype="f8"), "whole", r"bytes in one block"),
    "sparse-rows": (dict(shape=(2**40, 1), dtype="u1", chunks=(2**24, 1)), "rows", r"1,099,511,627,776 samples"),
    "links": (dict(shape=(2**24, 2**12), dtype="u1", chunks=(2**24, 1)), "rows", r"68,719,476,736 sample->block links"),
}


@pytest.mark.parametrize("case", sorted(HUGE))
def test_declared_huge_datasets_are_refused_before_allocating(tmp_path, case):
    kwargs, kind, msg = HUGE[case]
    with h5py.File(tmp_path / "h.h5", "w") as f:
        f.create_dataset("D", **kwargs)
    assert os.path.getsize(tmp_path / "h.h5") < 10**5
    tracemalloc.start()
    try:
        with pytest.raises(LayoutError, match=msg + r", more than solar's limit"):
            build_layout(LayoutSpec(kind, ("h.h5",), ("D",), root=str(tmp_path)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"{peak} bytes allocated to refuse a declared-huge dataset"


def test_damaged_dataset_header_is_not_called_missing(tmp_path):
    """A header whose data address points past the end: HDF5 refuses to open the dataset, and the
    error says so instead of 'not found'."""
    with h5py.File(tmp_path / "t.h5", "w") as f:
        f.create_dataset("X", data=np.arange(4000, dtype="f8").reshape(100, 40))
        off = f["X"].id.get_offset()
    raw = bytearray((tmp_path / "t.h5").read_bytes())
    msg = off.to_bytes(8, "little") + (32000).to_bytes(8, "little")  # layout message: address, size
    at = raw.find(msg)
    assert at >= 0 and raw.find(msg, at + 1) < 0
    raw[at:at + 8] = (len(raw) - 1000).to_bytes(8, "little")
    (tmp_path / "t.h5").write_bytes(raw)
    with pytest.raises(LayoutError, match=r"cannot open t.h5:/X: .*corruption.* \(damaged file\?\)"):
        build_layout(LayoutSpec("rows", ("t.h5",), ("X",), root=str(tmp_path)))
    with pytest.raises(LayoutError, match=r"dataset 'Y' not found in .*t.h5"):
        build_layout(LayoutSpec("rows", ("t.h5",), ("Y",), root=str(tmp_path)))


# ------------------------------------------------------------------ sanity of a built layout
def assert_sane(layout):
    """Block map inside the files: written blocks within their file's size, ids and pointers in range."""
    sizes = np.array([os.path.getsize(p) for p in layout.files], dtype=np.int64)
    files = np.array([i.file for i in layout.datasets], dtype=np.int64)
    assert layout.block_dataset.min() >= 0 and layout.block_dataset.max() < len(layout.datasets)
    w = layout.block_offset >= 0
    ends = layout.block_offset + layout.block_stored
    assert (ends[w] <= sizes[files[layout.block_dataset[w]]]).all(), "a block lies past the end of its file"
    assert (layout.block_stored >= 0).all() and (layout.block_nbytes > 0).all()
    assert np.all(np.diff(layout.sample_ptr) >= 0) and layout.sample_ptr[0] == 0
    if layout.sample_blocks.size:
        assert layout.sample_blocks.min() >= 0 and layout.sample_blocks.max() < layout.n_blocks
    assert np.all(np.diff(layout.dataset_block_start) >= 0)


def load_or_refuse(build):
    """``build()`` -> Layout (checked sane) or None when it raised a SolarError; anything else propagates."""
    try:
        layout = build()
    except SolarError as exc:
        assert str(exc), "an empty error message"
        return None
    assert_sane(layout)
    return layout


# ------------------------------------------------------------------ fuzz: odd datasets, wrong specs
DTYPES = ["u1", "i1", "<i2", ">i4", "<u8", "<f4", ">f8", "f2", "c8", "?", "S3", "compound", "vlen-str"]
STORAGES = ["contiguous", "unwritten", "chunked", "chunked-partial", "gzip", "compact", "scalar"]


def _make_dataset(f, name, dtype, shape, storage, chunk_div):
    if dtype == "compound":
        dt = np.dtype([("a", "f4"), ("b", "i2")])
    elif dtype == "vlen-str":
        dt = h5py.string_dtype()
    else:
        dt = np.dtype(dtype)
    if storage == "scalar":
        f.create_dataset(name, shape=(), dtype=dt)
        return
    kw = {}
    if storage.startswith("chunked") or storage == "gzip":
        kw["chunks"] = tuple(max(1, s // chunk_div) for s in shape) if all(shape) else None
        kw["maxshape"] = tuple(None for _ in shape)
        if storage == "gzip":
            kw["compression"] = "gzip"
    if kw.get("chunks") is None:
        kw.pop("chunks", None)
        kw.pop("maxshape", None)
    if storage == "compact":  # data inside the object header (no h5py keyword for it)
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.COMPACT)
        h5py.h5d.create(f.id, name.encode(), h5py.h5t.py_create(dt, logical=True), h5py.h5s.create_simple(shape),
                        dcpl=dcpl)
    else:
        f.create_dataset(name, shape=shape, dtype=dt, **kw)
    d = f[name]
    if storage != "unwritten" and all(shape) and dt.kind in "biufc":
        data = (np.arange(int(np.prod(shape))) % 251).reshape(shape).astype(dt)
        if storage == "chunked-partial":
            d[: max(1, shape[0] // 2)] = data[: max(1, shape[0] // 2)]
        else:
            d[...] = data


dataset_st = st.tuples(st.sampled_from(DTYPES), st.lists(st.sampled_from([1, 2, 3, 7]), max_size=2),
                       st.sampled_from(STORAGES), st.sampled_from([1, 2, 3]))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lead=st.sampled_from([0, 1, 3, 7, 7, 7]), dsets=st.lists(dataset_st, min_size=1, max_size=4),
       picks=st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True),
       bogus=st.one_of(st.none(), st.sampled_from(["g", "g/d0", "nope", ""])),
       kind=st.sampled_from(["rows", "whole", "windows"]))
def test_fuzz_odd_datasets_and_wrong_field_lists(lead, dsets, picks, bogus, kind):
    """Any mix of dtypes, shapes (0-size included), storages and field lists (missing names, groups):
    a SolarError, or a sane layout whose samples equal h5py's through the default reader."""
    fields = list(dict.fromkeys(f"d{i % len(dsets)}" for i in picks)) + ([bogus] if bogus is not None else [])
    with tempfile.TemporaryDirectory(prefix="solar-fuzz-") as root:
        with h5py.File(os.path.join(root, "f.h5"), "w") as f:
            f.create_group("g")
            for i, (dtype, rest, storage, div) in enumerate(dsets):
                _make_dataset(f, f"d{i}", dtype, (lead, *rest), storage, div)
        layout = load_or_refuse(lambda: build_layout(LayoutSpec(kind, ("f.h5",), tuple(fields), root=root)))
        if layout is None:
            return
        blocks = np.unique(np.concatenate([layout.blocks_of(s) for s in range(min(3, layout.n_samples))]))
        with get_reader(default_reader_name(layout), layout) as reader:
            outs = [np.empty(int(layout.block_nbytes[b]), np.uint8) for b in blocks]
            reader.read_blocks(blocks, outs)
        got = dict(zip(blocks.tolist(), outs))

        def block(b):
            d = int(layout.block_dataset[b])
            return got[b].view(np.dtype(layout.datasets[d].dtype)).reshape(layout.block_shapes[d])
        for s in range(min(3, layout.n_samples)):
            sample, ref = assemble_sample(layout, s, block), h5py_sample(layout, s)
            for k in ref:  # h5py reads a single element in native byte order
                have, want = sample[k], np.asarray(ref[k])
                assert have.shape == want.shape and have.dtype.newbyteorder("=") == want.dtype.newbyteorder("=")
                np.testing.assert_array_equal(have, want, err_msg=f"sample {s} field {k}")


# ------------------------------------------------------------------ fuzz: damaged bytes (child process)
def _base_file(path, libver):
    """A small file with contiguous, chunked (gzip, shuffle + fletcher32) and grouped datasets."""
    with h5py.File(path, "w", libver=libver) as f:
        f.create_dataset("A", data=np.arange(60, dtype="f4").reshape(10, 6))
        f.create_dataset("B", data=np.arange(40, dtype="i2").reshape(10, 4), chunks=(3, 4), compression="gzip")
        f.create_dataset("C", data=np.arange(10, dtype="u1"), chunks=(4,), maxshape=(None,))
        g = f.create_group("g/h")
        g.create_dataset("D", data=np.ones((10, 2)), chunks=(5, 2), shuffle=True, fletcher32=True)
        f.attrs["note"] = "fuzz base"


POSITION = st.integers(0, 1 << 20)  # a byte of the file: taken modulo its length
damage_st = st.tuples(
    st.sampled_from(["earliest", "latest"]),
    st.lists(st.tuples(POSITION, st.integers(0, 255)), max_size=8),  # byte flips
    st.one_of(st.none(), POSITION),  # truncate here
    st.one_of(st.none(), st.tuples(POSITION, st.integers(1, 96))),  # zeroed run
)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(damage=damage_st)
def damaged_file_property(damage):
    """Flip, zero and truncate bytes of a small HDF5 file; every way of loading it gives a SolarError or a
    sane layout.  Called in a child process by the test below."""
    libver, flips, cut, zeros = damage
    with tempfile.TemporaryDirectory(prefix="solar-fuzz-") as root:
        good = os.path.join(root, "good.h5")
        _base_file(good, libver)
        raw = bytearray(open(good, "rb").read())
        for where, value in flips:
            raw[where % len(raw)] = value
        if zeros is not None:
            at = zeros[0] % len(raw)
            raw[at:at + zeros[1]] = bytes(len(raw[at:at + zeros[1]]))
        if cut is not None:
            del raw[cut % len(raw):]
        with open(os.path.join(root, "bad.h5"), "wb") as fh:
            fh.write(raw)
        for kind, fields in (("rows", ("A", "B", "C", "g/h/D")), ("whole", ("A", "g/h/D")),
                             ("windows", ("A", "B"))):
            load_or_refuse(lambda: build_layout(LayoutSpec(kind, ("bad.h5",), fields, root=root)))
        load_or_refuse(lambda: load_layout(os.path.join(root, "bad.h5")))


def test_fuzz_damaged_files_in_a_child_process():
    """The search runs in a child so that a crash inside HDF5 (a signal) fails this test instead of
    killing pytest; the child prints hypothesis's falsifying example."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(solar.__file__)), here]))
    code = "import test_layout_hostile as t; t.damaged_file_property(); print('fuzz ok')"
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], env=env, cwd=here,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "fuzz ok" in proc.stdout, (
        f"exit status {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
