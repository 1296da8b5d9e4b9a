"""``solar inspect`` on files written by other projects' tools: three real files from PyPI packages
(tests/data/README.md says where from), and h5py files that copy the layout of others (EDAX and kikuchipy
h5ebsd, EMsoft, a NeXus master file with its detector data behind external links, PyTables' undefined fill
values, types numpy cannot hold, a filter nobody here decodes).  Each is described (exit 0, a guess), the
guess's saved spec loads, and what solar's readers deliver for it is what h5py reads."""
import ctypes
import json
import os
import shutil
import tempfile

import h5py
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from solar.cli import main
from solar.errors import LayoutError
from solar.io import READERS, assemble_sample, get_reader, read_sample
from solar.layout import LayoutSpec, load_layout
from solar.layout.describe import chosen_spec, describe_file
from solar.layout.h5capi import _hdf5

from helpers import assert_same_sample, h5py_sample

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def _inspect(capsys, path, *args):
    rc = main(["inspect", str(path), "--json", *map(str, args)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert err == ""
    return json.loads(out)


def _delivered_equals_h5py(layout):
    """Every sample through the raw reader (when the layout allows it) and the h5py reader equals h5py's read."""
    names = [n for n in ("pread", "h5py") if READERS[n].available()[0] and
             (n == "h5py" or all(d.raw for d in layout.datasets))]
    for name in names:
        with get_reader(name, layout) as reader:
            for s in range(layout.n_samples):
                blocks = np.asarray(layout.blocks_of(s), dtype=np.int64)
                bufs = [np.empty(int(layout.block_nbytes[b]), np.uint8) for b in blocks]
                reader.read_blocks(blocks, bufs)
                got = dict(zip(blocks.tolist(), bufs))

                def block(b):
                    d = int(layout.block_dataset[b])
                    return got[b].view(np.dtype(layout.datasets[d].dtype)).reshape(layout.block_shapes[d])
                assert_same_sample(assemble_sample(layout, s, block), h5py_sample(layout, s))
    return names


def _save_and_load(capsys, path, tmp_path, *args):
    """``inspect PATH --save-spec`` into another folder, then the spec's layout (checked against h5py)."""
    folder = tmp_path / "spec"
    folder.mkdir(exist_ok=True)
    d = _inspect(capsys, path, "--save-spec", folder / "s.json", *args)
    layout = load_layout(str(folder / "s.json"))
    chosen = d["alternatives"][d["chosen"] - 1] if d["chosen"] else d["guess"]
    assert layout.field_names == tuple(chosen["fields"]) and layout.n_samples == chosen["samples"] == d["samples"]
    _delivered_equals_h5py(layout)
    return d, layout


# ---------------------------------------------------------------------------- real files from PyPI
def test_nexpy_example_nexus_file(tmp_path, capsys):
    f = shutil.copy(os.path.join(DATA, "nexpy_example.nxs"), tmp_path)
    d, layout = _save_and_load(capsys, f, tmp_path)
    assert d["guess"]["fields"] == ["entry/data/signal", "entry/data/x", "entry/data/y"]
    assert d["guess"]["why"] == "row i of the 3 datasets with 101 rows (holds the NeXus signal)"
    assert d["samples"] == 101 and d["fields"] == {"entry/data/signal": [101], "entry/data/x": [], "entry/data/y": []}
    tree = {n["path"]: n for n in d["tree"]}
    assert tree["/entry/data/signal"]["chunks"] == [26, 51] and tree["/entry/data/signal"]["filters"] == ["gzip"]
    assert tree["/entry/data/signal"]["signal"] and tree["/entry"]["nx_class"] == "NXentry"
    assert tree["/entry/title"]["why_not_field"] == "strings"
    assert [a["fields"] for a in d["alternatives"]] == [["entry/data/signal"]]


def test_pytables_file_with_undefined_fill_values(tmp_path, capsys):
    """PyTables left the fill value undefined; h5py cannot read it ('Can't get fill value'), which made the layout
    refuse the file as damaged.  Every chunk is written, so the fill value is never needed: raw reads."""
    f = shutil.copy(os.path.join(DATA, "pytables_attr-u16.h5"), tmp_path)
    d, layout = _save_and_load(capsys, f, tmp_path)
    assert d["guess"]["fields"] == ["wfm_group0/axes/axis1/data_vector/data"] and d["samples"] == 256
    assert d["raw_readable"] is True
    assert [a["fields"] for a in d["alternatives"]] == [["wfm_group0/traces/trace0/render_info/digital/order"]]


def test_h5py_file_of_strings_only_is_one_line(capsys):
    f = os.path.join(DATA, "h5py_vlen_string_dset.h5")
    assert main(["inspect", f]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"solar inspect: error: {f} holds no array solar can load (a numeric dataset with "
                                 f"2+ values): its one dataset: strings\n")


# ---------------------------------------------------------------------------- files in others' layouts
def _edax_h5ebsd(path, n=9):
    """EDAX OIM h5ebsd (kikuchipy's edax_h5ebsd/patterns.h5): names with spaces, a leading-space root dataset,
    header schematics bigger than the patterns, a compound table, one-value settings."""
    rng = np.random.default_rng(1)
    with h5py.File(path, "w") as f:
        f.create_dataset(" Manufacturer", data=np.array([b"EDAX"]))
        data = f.create_group("Scan 1/EBSD/Data")
        data.create_dataset("Pattern", data=rng.integers(0, 255, (n, 12, 12), dtype="u1"))
        for k in ("CI", "Fit", "IQ", "Phi", "Phi1", "Phi2", "X Position", "Y Position"):
            data.create_dataset(k, data=rng.random(n, dtype="f4"))
        data.create_dataset("Phase", data=np.zeros(n, "i1"))
        hdr = f.create_group("Scan 1/EBSD/Header")
        for i in range(1, 5):
            hdr.create_dataset(f"Coordinate System/Schematic {i}", data=np.ones((40, 30, 3), "u1"))
        hdr.create_dataset("Pattern Height", data=np.array([12], "i4"))
        hdr.create_dataset("Notes", data=np.array([b"none"]))
        hdr.create_dataset("Phase/1/hkl Families", data=np.zeros(5, [("H", "i4"), ("Use in Indexing", "i1")]))
        f.create_dataset("Scan 1/SEM-PRIAS Images/Data/SEM Image", data=np.ones((3, 3), "u1"))


def test_edax_h5ebsd(tmp_path, capsys):
    _edax_h5ebsd(tmp_path / "edax.h5")
    d, layout = _save_and_load(capsys, tmp_path / "edax.h5", tmp_path)
    assert d["guess"]["fields"][0] == "Scan 1/EBSD/Data/Pattern" and len(d["guess"]["fields"]) == 10
    assert d["fields"]["Scan 1/EBSD/Data/Pattern"] == [12, 12] and d["fields"]["Scan 1/EBSD/Data/CI"] == []
    assert d["alternatives"][-1]["why"].endswith("(under header/metadata)")  # the schematics: offered, last
    assert main(["inspect", str(tmp_path / "edax.h5")]) == 0
    text = capsys.readouterr().out
    assert "  / Manufacturer" not in text  # one value: not listed
    assert "/Scan 1/EBSD/Header/Phase/1/hkl Families" in text and "not a field: compound type" in text


def _kikuchipy_h5ebsd(path, n=6):
    """kikuchipy's own h5ebsd: two scans, chunked patterns, a crystal map per scan."""
    rng = np.random.default_rng(2)
    with h5py.File(path, "w") as f:
        f.attrs["manufacturer"] = "kikuchipy"
        for s in (1, 2):
            f.create_dataset(f"Scan {s}/EBSD/Data/patterns", data=rng.integers(0, 255, (n, 10, 10), dtype="u1"),
                             chunks=(2, 10, 10))
            for k in ("phi1", "Phi", "phi2", "x", "y"):
                f.create_dataset(f"Scan {s}/EBSD/CrystalMap/crystal_map/data/{k}", data=rng.random(n))
            f.create_dataset(f"Scan {s}/EBSD/Header/static_background", data=np.ones((10, 10), "u1"))


def test_kikuchipy_h5ebsd_two_scans(tmp_path, capsys):
    _kikuchipy_h5ebsd(tmp_path / "k.h5")
    d = _inspect(capsys, tmp_path / "k.h5")
    assert len(d["guess"]["fields"]) == 12 and d["guess"]["samples"] == 6  # both scans, side by side
    scan1 = d["alternatives"][1]
    assert scan1["why"] == "row i of the 6 datasets with 6 rows under /Scan 1 only"
    assert all(f.startswith("Scan 1/") for f in scan1["fields"])
    _, layout = _save_and_load(capsys, tmp_path / "k.h5", tmp_path, "--alternative", "2")
    assert layout.field_names[0] == "Scan 1/EBSD/Data/patterns" and layout.block_shapes[0] == (2, 10, 10)


def _emsoft(path, n=7):
    """EMsoft EBSD output: every setting a (1,) dataset, strings as variable-length, patterns and angles."""
    rng = np.random.default_rng(3)
    with h5py.File(path, "w") as f:
        vlen = h5py.string_dtype()
        for k in ("CreationDate", "Creator", "ProgramName"):
            f.create_dataset(f"CrystalData/{k}", data=np.array(["x"], dtype=object), dtype=vlen)
        f.create_dataset("CrystalData/LatticeParameters", data=np.ones(6))
        f.create_dataset("CrystalData/AtomData", data=np.ones((5, 1), "f4"))
        f.create_dataset("EMData/EBSD/EBSDPatterns", data=rng.integers(0, 255, (n, 16, 20), dtype="u1"))
        f.create_dataset("EMData/EBSD/EulerAngles", data=rng.random((n, 3), dtype="f4"))
        f.create_dataset("EMData/EBSD/numangles", data=np.array([n], "i4"))
        for k in ("L", "alphaBD", "beamcurrent", "binning", "energymax", "energymin", "xpc", "ypc"):
            f.create_dataset(f"NMLparameters/EBSDNameList/{k}", data=np.array([1.0]))
        f.create_dataset("NMLfiles/EMEBSDNML", data=np.array(["a", "b"], dtype=object), dtype=vlen)


def test_emsoft_ebsd(tmp_path, capsys):
    _emsoft(tmp_path / "em.h5")
    d, _ = _save_and_load(capsys, tmp_path / "em.h5", tmp_path)
    assert d["guess"]["fields"] == ["EMData/EBSD/EBSDPatterns", "EMData/EBSD/EulerAngles"] and d["samples"] == 7
    assert [a["samples"] for a in d["alternatives"]] == [7, 6, 5]  # the patterns alone, LatticeParameters, AtomData


def _nexus_master(folder, n=8):
    """A NeXus master file as Dectris detectors write it: frames in data_00000k.h5 files behind external links
    (one of them missing), per-frame values in the master, settings as scalars."""
    rng = np.random.default_rng(4)
    with h5py.File(folder / "scan_data_000001.h5", "w") as f:
        f.create_dataset("entry/data/data", data=rng.integers(0, 999, (n, 6, 5), dtype="u2"), chunks=(1, 6, 5),
                         compression="gzip", shuffle=True)
    with h5py.File(folder / "scan_master.h5", "w") as f:
        entry = f.create_group("entry")
        entry.attrs["NX_class"] = "NXentry"
        data = entry.create_group("data")
        data.attrs.update(NX_class="NXdata", signal="data_000001")
        data["data_000001"] = h5py.ExternalLink("scan_data_000001.h5", "/entry/data/data")
        data["data_000002"] = h5py.ExternalLink("scan_data_000002.h5", "/entry/data/data")  # not there
        det = entry.create_group("instrument/detector")
        det.create_dataset("count_time", data=np.full(1, 0.1))
        det.create_dataset("detectorSpecific/frame_time", data=np.linspace(0, 1, n))
        det.create_dataset("x_pixel_size", data=np.full(1, 75e-6))
        det.create_dataset("description", data="EIGER 4M")
        entry["data/frame_time"] = h5py.SoftLink("/entry/instrument/detector/detectorSpecific/frame_time")


def test_nexus_master_with_external_data_files(tmp_path, capsys):
    _nexus_master(tmp_path)
    d, layout = _save_and_load(capsys, tmp_path / "scan_master.h5", tmp_path)
    assert d["guess"]["fields"] == ["entry/data/data_000001", "entry/instrument/detector/detectorSpecific/frame_time"]
    assert "holds the NeXus signal" in d["guess"]["why"] and d["samples"] == 8
    tree = {n["path"]: n for n in d["tree"]}
    assert tree["/entry/data/data_000001"]["target"] == "scan_data_000001.h5:/entry/data/data"
    assert tree["/entry/data/data_000001"]["filters"] == ["shuffle", "gzip"]
    assert tree["/entry/data/data_000002"] == {"path": "/entry/data/data_000002", "kind": "link",
                                               "problem": "cannot be opened (missing file or target)",
                                               "target": "scan_data_000002.h5:/entry/data/data"}
    assert tree["/entry/data/frame_time"]["kind"] == "link"  # a soft link: counted once, under its target
    assert len(layout.files) == 2  # the master, and the data file that holds the frames' bytes
    assert main(["inspect", str(tmp_path / "scan_master.h5")]) == 0
    assert "[stored in scan_data_000001.h5:/entry/data/data]" in capsys.readouterr().out


def _quad_type():
    """An IEEE quadruple-precision float type (as PyTables' float.h5 holds): numpy has no such dtype."""
    t = h5py.h5t.IEEE_F64LE.copy()
    t.set_size(16)
    t.set_precision(128)
    t.set_fields(127, 112, 15, 0, 112)
    t.set_ebias(16383)
    return t


def test_unreadable_types_and_filters_are_described_not_fatal(tmp_path, capsys):
    with h5py.File(tmp_path / "odd.h5", "w") as f:
        f.create_dataset("good/x", data=np.arange(12, dtype="i4").reshape(4, 3))
        h5py.h5d.create(f.id, b"quad", _quad_type(), h5py.h5s.create_simple((4,)))
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((4,))
        dcpl.set_filter(32026, h5py.h5z.FLAG_OPTIONAL, ())  # blosc2, not installed here
        if h5py.h5z.filter_avail(32026):
            pytest.skip("blosc2 is installed here")
        h5py.h5d.create(f.id, b"packed", h5py.h5t.NATIVE_FLOAT, h5py.h5s.create_simple((4,)), dcpl=dcpl)
    d = _inspect(capsys, tmp_path / "odd.h5")
    tree = {n["path"]: n for n in d["tree"]}
    assert tree["/quad"]["why_not_field"].startswith("unreadable type: ") and tree["/quad"]["dtype"] == "?"
    assert tree["/packed"]["why_not_field"] == ("filter blosc2 (id 32026) not decodable here (install its plugin, "
                                                "e.g. hdf5plugin)")
    assert d["guess"]["fields"] == ["good/x"] and d["alternatives"] == [] and d["samples"] == 4


def _undefined_fill_dataset(f, name, shape, chunks):
    """A chunked uint8 dataset whose fill value is undefined (``H5Pset_fill_value(dcpl, type, NULL)``)."""
    lib = _hdf5()
    if lib is None:
        pytest.skip("HDF5's C library cannot be reached here")
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_chunk(chunks)
    fn = lib.H5Pset_fill_value
    fn.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    assert fn(dcpl.id, h5py.h5t.NATIVE_UINT8.id, None) >= 0
    assert dcpl.fill_value_defined() == h5py.h5d.FILL_VALUE_UNDEFINED
    h5py.h5d.create(f.id, name.encode(), h5py.h5t.NATIVE_UINT8, h5py.h5s.create_simple(shape), dcpl=dcpl)
    return f[name]


def test_undefined_fill_value(tmp_path, capsys):
    """All chunks written: raw reads (the fill value is never used); chunks never written: the h5py reader,
    which returns what HDF5 returns for them."""
    with h5py.File(tmp_path / "u.h5", "w") as f:
        full = _undefined_fill_dataset(f, "full", (8, 4), (4, 4))
        full[...] = np.arange(32, dtype="u1").reshape(8, 4)
        part = _undefined_fill_dataset(f, "part", (8, 4), (4, 4))
        part[:4] = 7
    for field, raw in (("full", True), ("part", False)):
        spec = LayoutSpec("rows", ("u.h5",), (field,), root=str(tmp_path))
        layout = load_layout(spec.save(str(tmp_path / f"{field}.json")))
        assert layout.datasets[0].raw is raw
        if not raw:
            assert "fill value is undefined" in layout.datasets[0].fallback
        assert _delivered_equals_h5py(layout) == (["pread", "h5py"] if raw else ["h5py"])
    d = _inspect(capsys, tmp_path / "u.h5")
    assert d["guess"]["fields"] == ["full", "part"] and d["samples"] == 8


def test_tree_walk_cycles_limit_and_old_nexus_signal(tmp_path):
    """A group hard-linked into its own child is walked once; the walk stops at its limit; a dataset marked
    signal=1 (NeXus before 2014) is a signal."""
    from solar.layout.tree import read_tree
    with h5py.File(tmp_path / "c.h5", "w") as f:
        f.create_dataset("a/frames", data=np.zeros((3, 2)))
        f["a/frames"].attrs["signal"] = 1
        f["a/b/up"] = f["a"]  # a cycle: /a/b/up is /a
        f["a/b/root"] = f["/"]
    with h5py.File(tmp_path / "c.h5", "r") as f:
        tree = read_tree(f)
        cut = read_tree(f, limit=2)
    nodes = {n.path: n for n in tree.nodes}
    assert tree.complete and set(nodes) == {"/a", "/a/b", "/a/frames", "/a/b/up", "/a/b/root"}
    assert (nodes["/a/b/up"].kind, nodes["/a/b/up"].target) == ("link", "/a")
    assert (nodes["/a/b/root"].kind, nodes["/a/b/root"].target) == ("link", "/")
    assert nodes["/a/frames"].signal
    assert not cut.complete and len(cut.nodes) == 2


SHAPES = st.lists(st.sampled_from((0, 1, 2, 3, 5)), max_size=3).map(tuple)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(("", "entry", "entry/data", "Scan 1/Header", "g/h/i")), SHAPES,
                          st.sampled_from(("u1", "<f4", ">i8", "S3")), st.booleans()), max_size=7))
def test_random_files_are_described_and_their_guess_loads(items):
    """Any mix of groups, shapes, dtypes and storage: a guess whose spec builds the layout the description
    summarised (same samples and fields, bytes equal to h5py's), or the one line for a file with no array."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "r.h5")
        with h5py.File(path, "w") as f:
            for i, (group, shape, dtype, chunked) in enumerate(items):
                data = np.arange(int(np.prod(shape)), dtype="i8").reshape(shape).astype(dtype)
                chunks = tuple(max(1, s // 2) for s in shape) if chunked and shape and all(shape) else None
                f.create_dataset(f"{group}/d{i}".lstrip("/"), data=data, chunks=chunks)
        arrays = any(dt != "S3" and len(sh) >= 1 and int(np.prod(sh)) >= 2 for _, sh, dt, _ in items)
        if not arrays:
            with pytest.raises(LayoutError, match="holds no array solar can load"):
                describe_file(path)
            return
        d = describe_file(path)
        assert "layout_error" not in d
        spec = chosen_spec(d, tmp)
        layout = load_layout(spec.save(os.path.join(tmp, "s.json")))
        assert layout.n_samples == d["samples"] == (d["guess"]["samples"] or layout.n_samples)
        assert list(layout.field_names) == list(d["fields"])
        for s in {0, layout.n_samples - 1}:
            with open(path, "rb") as fh:
                got = read_sample(layout, s, {0: fh.fileno()})
            assert_same_sample({k: v.astype(v.dtype.newbyteorder("=")) for k, v in got.items()},
                               {k: v.astype(v.dtype.newbyteorder("=")) for k, v in h5py_sample(layout, s).items()})


@pytest.mark.parametrize("shape", [(1, 1), (1, 1, 1)])
def test_a_root_array_of_one_value_is_no_array(tmp_path, shape):
    """A (1, 1) dataset at the root holds one value, like a (1,) one: refused the same way (hypothesis found
    the (1, 1) case described as one sample of one value, where (1,) was refused)."""
    path = str(tmp_path / "one.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("d0", data=np.zeros(shape, "u1"))
    with pytest.raises(LayoutError, match="holds no array solar can load"):
        describe_file(path)
