"""What the loader delivers is what h5py reads, in the cases that used to go silently wrong:
datasets reached through external / soft links, fields whose dtype, byte order, shape or fill
value differ between files, scalar per-sample fields, and files the user holds open with h5py."""
import json
import os

import h5py
import numpy as np
import pytest

import solar
from solar.cli import main
from solar.errors import LayoutError
from solar.io import READERS
from solar.layout import LayoutSpec, build_layout, load_layout
from solar.loader import SolarLoader

READER_NAMES = [n for n in ("pread", "mpiio", "h5py") if READERS[n].available()[0]]


def _deliver(layout, reader, local_batch=3):
    """Every sample once through SolarLoader (1 rank, 1 epoch, torch tensors): ``{field: {sample: array}}``."""
    sched = solar.plan(layout, world_size=1, local_batch=local_batch, epochs=1, buffer_fraction=1.0)
    out = {k: {} for k in layout.field_names}
    with SolarLoader(sched, layout, rank=0, reader=reader) as loader:
        for batch in loader:
            for i, s in enumerate(np.asarray(batch["index"]).tolist()):
                for k in layout.field_names:
                    v = batch[k][i]
                    out[k][s] = v.numpy() if hasattr(v, "numpy") else np.asarray(v)
    sched.close()
    assert all(len(v) == layout.n_samples for v in out.values())
    return out


def _rows_reference(paths, field):
    """Rows of ``field`` over ``paths`` in order, read by h5py through the spec's own files."""
    rows = []
    for p in paths:
        with h5py.File(p, "r", locking=False) as f:
            rows.extend(np.asarray(f[field][...]))
    return rows


def _assert_rows(got, ref):
    assert len(got) == len(ref)
    for s, want in enumerate(ref):
        assert got[s].shape == want.shape, s
        assert got[s].dtype == want.dtype.newbyteorder("="), (s, got[s].dtype, want.dtype)
        np.testing.assert_array_equal(got[s], want, err_msg=f"sample {s}")


# ------------------------------------------------------------------ links
def _linked_files(tmp_path):
    """``d/master.h5`` whose fields live in ``d/sub/data.h5`` (external links, relative targets),
    with a padding dataset first so that the two files' byte offsets differ."""
    rng = np.random.default_rng(4)
    sub = tmp_path / "d" / "sub"
    sub.mkdir(parents=True)
    x = rng.standard_normal((10, 4)).astype("f4")
    with h5py.File(sub / "data.h5", "w") as f:
        f.create_dataset("pad", data=np.full(777, 5, "i8"))  # shift the real data's offsets
        g = f.create_group("inner")
        g.create_dataset("x", data=x)
        g.create_dataset("y", data=rng.integers(0, 9, (10, 3), dtype="i2"), chunks=(4, 3), compression="gzip")
    with h5py.File(sub / "mid.h5", "w") as f:
        f["to_x"] = h5py.ExternalLink("data.h5", "/inner/x")  # relative to mid.h5's folder
    with h5py.File(tmp_path / "d" / "master.h5", "w") as f:
        f.create_dataset("local", data=rng.standard_normal((10, 2)))
        f["entry/x"] = h5py.ExternalLink("sub/data.h5", "/inner/x")
        f["entry/y"] = h5py.ExternalLink("sub/data.h5", "/inner/y")
        f["group_link"] = h5py.ExternalLink("sub/data.h5", "/inner")
        f["chain"] = h5py.ExternalLink("sub/mid.h5", "/to_x")
        f["soft_to_external"] = h5py.SoftLink("/entry/x")
    return tmp_path / "d"


@pytest.mark.parametrize("reader", READER_NAMES)
def test_external_links_are_read_from_the_file_holding_the_bytes(tmp_path, monkeypatch, reader):
    d = _linked_files(tmp_path)
    fields = ("local", "entry/x", "entry/y", "group_link/x", "chain", "soft_to_external")
    monkeypatch.chdir(tmp_path)
    layout = build_layout(LayoutSpec("rows", ("master.h5",), fields, root=str(d)))
    data = os.path.realpath(d / "sub" / "data.h5")
    assert [os.path.realpath(p) for p in layout.files] == [os.path.realpath(d / "master.h5"), data]
    for k, name in enumerate(fields):
        info = layout.datasets[layout.sources[0].datasets[k]]
        assert os.path.isabs(layout.files[info.file]) or info.file == 0
        assert os.path.realpath(layout.files[info.file]) == (data if k else os.path.realpath(d / "master.h5"))
        with h5py.File(layout.files[info.file], "r") as f:  # the recorded name is valid in the recorded file
            assert isinstance(f[info.name], h5py.Dataset)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the readers open the recorded paths from any folder
    got = _deliver(layout, reader)
    for name in fields:
        _assert_rows(got[name], _rows_reference([d / "master.h5"], name))


def test_external_link_target_changes_the_fingerprint(tmp_path):
    d = _linked_files(tmp_path)
    spec = LayoutSpec("rows", ("master.h5",), ("entry/x",), root=str(d))
    before = build_layout(spec).fingerprint
    with h5py.File(d / "sub" / "data.h5", "r+") as f:
        f["inner/x"][0, 0] = 1e6  # the linking file is untouched
    st = os.stat(d / "sub" / "data.h5")
    os.utime(d / "sub" / "data.h5", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert build_layout(spec).fingerprint != before


def test_dangling_external_link_is_refused(tmp_path):
    with h5py.File(tmp_path / "m.h5", "w") as f:
        f["x"] = h5py.ExternalLink("gone.h5", "/x")
    with pytest.raises(LayoutError, match=r"m.h5:/x is an external link to gone.h5:/x, which cannot be opened"):
        build_layout(LayoutSpec("rows", ("m.h5",), ("x",), root=str(tmp_path)))


def test_inspect_names_the_file_holding_linked_data(tmp_path, capsys):
    d = _linked_files(tmp_path)
    LayoutSpec("rows", ("master.h5",), ("local", "entry/x"), root=str(d)).save(str(d))
    assert main(["inspect", str(d)]) == 0
    text = capsys.readouterr().out
    assert "2 file(s)" in text
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("entry/x"))
    assert "data.h5:/inner/x" in line
    assert main(["inspect", str(d), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["datasets"]}
    assert rows["entry/x"]["stored_in"] == ["sub/data.h5:/inner/x"] and rows["local"]["stored_in"] is None


@pytest.mark.parametrize("reader", READER_NAMES)
def test_soft_links_and_links_into_other_groups(tmp_path, reader):
    rng = np.random.default_rng(5)
    with h5py.File(tmp_path / "s.h5", "w") as f:
        f.create_dataset("raw/frames", data=rng.integers(0, 255, (8, 3, 3), dtype="u1"), chunks=(3, 3, 3))
        f.create_dataset("raw/energy", data=rng.standard_normal((8, 2)))
        f["entry/data"] = h5py.SoftLink("/raw/frames")  # soft link to a dataset
        f["entry/detector"] = h5py.SoftLink("/raw")  # soft link to a group
        f["other/e"] = f["raw/energy"]  # a second hard link in another group
    fields = ("entry/data", "entry/detector/energy", "other/e")
    layout = build_layout(LayoutSpec("rows", ("s.h5",), fields, root=str(tmp_path)))
    assert len(layout.files) == 1 and {i.file for i in layout.datasets} == {0}
    got = _deliver(layout, reader)
    for name in fields:
        _assert_rows(got[name], _rows_reference([tmp_path / "s.h5"], name))


# ------------------------------------------------------------------ per-field consistency across files
def _rows_files(tmp_path, specs, name="X", **kw):
    """One file per ``(file name, array)`` holding dataset ``name``; returns the paths."""
    paths = []
    for fname, arr in specs:
        with h5py.File(tmp_path / fname, "w") as f:
            f.create_dataset(name, data=arr, **kw)
        paths.append(tmp_path / fname)
    return paths


def test_rows_with_different_dtypes_are_refused(tmp_path):
    _rows_files(tmp_path, [("a.h5", np.full((4, 2), 7, "u1")), ("b.h5", np.full((3, 2), 300.5, "f4")),
                           ("c.h5", np.full((2, 2), 1, "u1"))])
    with pytest.raises(LayoutError, match=r"field 'X' has different dtypes: uint8 in a.h5, c.h5; float32 in b.h5"):
        build_layout(LayoutSpec("rows", ("*.h5",), ("X",), root=str(tmp_path)))


def test_rows_with_different_trailing_shapes_are_refused(tmp_path):
    _rows_files(tmp_path, [("a.h5", np.zeros((4, 2), "f4")), ("b.h5", np.zeros((3, 5), "f4"))])
    with pytest.raises(LayoutError, match=r"field 'X' has different per-sample shapes: \(2,\) in a.h5; \(5,\) in b.h5"):
        build_layout(LayoutSpec("rows", ("*.h5",), ("X",), root=str(tmp_path)))


@pytest.mark.parametrize("reader", READER_NAMES)
def test_byte_order_differences_come_out_native(tmp_path, reader):
    rng = np.random.default_rng(6)
    big = rng.standard_normal((5, 3)).astype(">f4")
    little = rng.standard_normal((4, 3)).astype("<f4")
    paths = _rows_files(tmp_path, [("a.h5", big), ("b.h5", little)], chunks=(2, 3))
    for p, order in zip(paths, "><"):
        with h5py.File(p, "a") as f:
            f.create_dataset("L", data=rng.integers(-900, 900, f["X"].shape[0]).astype(order + "i2"))
    layout = build_layout(LayoutSpec("rows", ("*.h5",), ("X", "L"), root=str(tmp_path)))
    got = _deliver(layout, reader)  # torch tensors: torch.from_numpy refuses a non-native byte order
    _assert_rows(got["X"], _rows_reference(paths, "X"))
    _assert_rows(got["L"], _rows_reference(paths, "L"))
    assert all(v.dtype.isnative for v in got["X"].values())


@pytest.mark.parametrize("reader", READER_NAMES)
def test_fill_value_of_never_written_chunks_is_per_file(tmp_path, reader):
    for fname, fill in (("a.h5", -7), ("b.h5", 9)):
        with h5py.File(tmp_path / fname, "w") as f:
            d = f.create_dataset("X", shape=(6, 2), dtype="i4", chunks=(2, 2), fillvalue=fill)
            d[0:2] = 1  # rows 2..5 never written: they read as this file's fill value
    layout = build_layout(LayoutSpec("rows", ("*.h5",), ("X",), root=str(tmp_path)))
    got = _deliver(layout, reader)
    _assert_rows(got["X"], _rows_reference([tmp_path / "a.h5", tmp_path / "b.h5"], "X"))
    assert got["X"][3][0] == -7 and got["X"][9][0] == 9


@pytest.mark.parametrize("reader", READER_NAMES)
def test_storage_differs_per_file(tmp_path, reader):
    """Chunk shape, filters and byte order are each file's own (nothing is taken from the first file)."""
    rng = np.random.default_rng(11)
    paths = []
    for fname, kw in (("a.h5", dict(chunks=(2, 3), compression="gzip", shuffle=True)),
                      ("b.h5", {}), ("c.h5", dict(chunks=(3, 1), fletcher32=True))):
        order = ">" if fname == "b.h5" else "<"
        paths += _rows_files(tmp_path, [(fname, rng.standard_normal((5, 3)).astype(order + "f8"))], **kw)
    layout = build_layout(LayoutSpec("rows", ("*.h5",), ("X",), root=str(tmp_path)))
    assert len({(i.chunks, len(i.filters)) for i in layout.datasets}) == 3
    _assert_rows(_deliver(layout, reader)["X"], _rows_reference(paths, "X"))


@pytest.mark.parametrize("reader", READER_NAMES)
def test_whole_groups_of_uneven_shapes_come_as_native_lists(tmp_path, reader):
    rng = np.random.default_rng(7)
    arrays = {"g0": rng.standard_normal((4, 3)).astype(">f8"), "g1": rng.standard_normal((2, 5)).astype("<f8"),
              "g2": rng.standard_normal((3, 3)).astype(">f8")}
    with h5py.File(tmp_path / "w.h5", "w") as f:
        for g, a in arrays.items():
            f.create_dataset(f"{g}/data", data=a)
    layout = build_layout(LayoutSpec("whole", ("w.h5",), ("data",), root=str(tmp_path), groups="g*"))
    got = _deliver(layout, reader, local_batch=2)
    for s, g in enumerate(sorted(arrays)):
        assert got["data"][s].dtype == np.dtype("f8") and got["data"][s].shape == arrays[g].shape
        np.testing.assert_array_equal(got["data"][s], arrays[g])


def test_whole_groups_with_different_dtypes_are_refused(tmp_path):
    with h5py.File(tmp_path / "w.h5", "w") as f:
        f.create_dataset("g0/data", data=np.zeros((2, 2), "f4"))
        f.create_dataset("g1/data", data=np.zeros((2, 2), "i8"))
    with pytest.raises(LayoutError, match=r"field 'data' has different dtypes: float32 in w.h5:/g0; int64 in w.h5:/g1"):
        build_layout(LayoutSpec("whole", ("w.h5",), ("data",), root=str(tmp_path), groups="g*"))


# ------------------------------------------------------------------ scalar per-sample fields
@pytest.mark.parametrize("reader", READER_NAMES)
@pytest.mark.parametrize("chunks", [None, (3,)])
def test_scalar_per_sample_fields(tmp_path, reader, chunks):
    rng = np.random.default_rng(8)
    with h5py.File(tmp_path / "s.h5", "w") as f:
        f.create_dataset("X", data=rng.standard_normal((10, 4)).astype("f4"))
        f.create_dataset("label", data=rng.integers(0, 10, 10), chunks=chunks)
        f.create_dataset("label_col", data=rng.integers(0, 10, (10, 1)).astype("u2"),
                         chunks=None if chunks is None else (3, 1))
    spec = LayoutSpec("rows", ("s.h5",), ("X", "label", "label_col"), root=str(tmp_path))
    assert main(["inspect", spec.save(str(tmp_path))]) == 0
    layout = build_layout(spec)
    assert layout.field_shapes() == {"X": (4,), "label": (), "label_col": (1,)}
    sched = solar.plan(layout, world_size=1, local_batch=4, epochs=1, buffer_fraction=1.0)
    with SolarLoader(sched, layout, rank=0, reader=reader) as loader:
        batch = next(iter(loader))
    n = len(batch["index"])
    assert tuple(batch["label"].shape) == (n,) and tuple(batch["label_col"].shape) == (n, 1)
    got = _deliver(layout, reader, local_batch=4)
    for name in ("X", "label", "label_col"):
        _assert_rows(got[name], _rows_reference([tmp_path / "s.h5"], name))


@pytest.mark.parametrize("reader", READER_NAMES)
def test_whole_files_with_scalar_datasets(tmp_path, reader):
    """CosmoFlow-like: one sample per file, with an HDF5 scalar (shape ()) and a big-endian (1,) field."""
    for i in range(3):
        with h5py.File(tmp_path / f"f{i}.h5", "w") as f:
            f.create_dataset("data", data=np.arange(16, dtype="f4").reshape(4, 4) + i)
            f.create_dataset("param", data=np.float32(i + 0.5))
            f.create_dataset("tag", data=np.array([300 + i], dtype=">i4"))
    layout = build_layout(LayoutSpec("whole", ("f*.h5",), ("data", "param", "tag"), root=str(tmp_path)))
    assert layout.field_shapes() == {"data": (4, 4), "param": (), "tag": (1,)}
    got = _deliver(layout, reader, local_batch=2)
    for s in range(3):
        with h5py.File(tmp_path / f"f{s}.h5", "r") as f:
            for name in ("data", "param", "tag"):
                want = f[name][()]
                assert got[name][s].dtype == want.dtype.newbyteorder("=") and got[name][s].shape == want.shape
                np.testing.assert_array_equal(got[name][s], want)


@pytest.mark.parametrize("reader", READER_NAMES)
def test_well_fields_without_trailing_axes(tmp_path, reader):
    """The Well: a [B, T] field gives (window,), a [B] field a scalar, a [T] field (window,)."""
    rng = np.random.default_rng(9)
    with h5py.File(tmp_path / "w.h5", "w") as f:
        f.attrs["n_trajectories"] = 2
        g = f.create_group("t0_fields")
        g.create_dataset("u", data=rng.standard_normal((2, 7)).astype("f4"))
        g.create_dataset("mass", data=rng.standard_normal(2), chunks=(1,)).attrs.update(
            {"sample_varying": True, "time_varying": False})
        g.create_dataset("forcing", data=rng.standard_normal(7)).attrs.update(
            {"sample_varying": False, "time_varying": True})
    spec = LayoutSpec("windows", ("w.h5",), ("t0_fields/u", "t0_fields/mass", "t0_fields/forcing"),
                      root=str(tmp_path), n_steps_input=2, n_steps_output=1, dt=2)
    layout = build_layout(spec)
    assert layout.field_shapes() == {"t0_fields/u": (3,), "t0_fields/mass": (), "t0_fields/forcing": (3,)}
    got = _deliver(layout, reader, local_batch=2)
    with h5py.File(tmp_path / "w.h5", "r") as f:
        u, mass, forcing = (f[f"t0_fields/{k}"][...] for k in ("u", "mass", "forcing"))
    for s in range(layout.n_samples):
        b, t0 = divmod(s, 3)  # 7 steps, window span 5: 3 windows per trajectory
        np.testing.assert_array_equal(got["t0_fields/u"][s], u[b, t0:t0 + 5:2])
        np.testing.assert_array_equal(got["t0_fields/mass"][s], mass[b])
        np.testing.assert_array_equal(got["t0_fields/forcing"][s], forcing[t0:t0 + 5:2])


# ------------------------------------------------------------------ files held open by the user
@pytest.mark.parametrize("reader", READER_NAMES)
def test_data_held_open_with_plain_h5py(tmp_path, reader):
    rng = np.random.default_rng(10)
    paths = _rows_files(tmp_path, [("a.h5", rng.standard_normal((6, 3)))], compression="gzip", chunks=(2, 3))
    spec_path = LayoutSpec("rows", ("a.h5",), ("X",), root=str(tmp_path)).save(str(tmp_path))
    with h5py.File(paths[0]) as user:  # default locking, as users open files to read metadata
        assert user["X"].shape == (6, 3)
        layout = load_layout(spec_path)
        got = _deliver(layout, reader)
        assert main(["inspect", spec_path]) == 0
    _assert_rows(got["X"], _rows_reference(paths, "X"))


@pytest.mark.parametrize("reader", READER_NAMES)
def test_link_target_held_open_with_plain_h5py(tmp_path, reader):
    d = _linked_files(tmp_path)
    with h5py.File(d / "sub" / "data.h5") as user:  # the file holding the bytes, default locking
        assert user["inner/x"].shape == (10, 4)
        layout = build_layout(LayoutSpec("rows", ("master.h5",), ("entry/x", "chain"), root=str(d)))
        got = _deliver(layout, reader)
    for name in ("entry/x", "chain"):
        _assert_rows(got[name], _rows_reference([d / "master.h5"], name))


def test_broken_group_link_is_refused_not_skipped(tmp_path):
    with h5py.File(tmp_path / "g.h5", "w") as f:
        f.create_dataset("g0/data", data=np.zeros((2, 2), "f4"))
        f["g1"] = h5py.SoftLink("/nowhere")
        f["g2"] = h5py.ExternalLink("gone.h5", "/g")
    spec = LayoutSpec("whole", ("g.h5",), ("data",), root=str(tmp_path), groups="g*")
    with pytest.raises(LayoutError, match=r"g.h5:/g1 is a broken link"):
        build_layout(spec)
    with h5py.File(tmp_path / "g.h5", "a") as f:
        del f["g1"]
    with pytest.raises(LayoutError, match=r"g.h5:/g2 is an external link to gone.h5:/g, which cannot be opened"):
        build_layout(spec)
