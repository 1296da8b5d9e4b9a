"""Every bad input gets a one-line error naming the culprit."""
import json
import os

import h5py
import numpy as np
import pytest

from solar.cli import main
from solar.errors import SolarError, SpecError
from solar.layout import LayoutSpec, build_layout, load_layout
from helpers import make_dataset


def _rows(tmp_path, **datasets):
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        for name, data in datasets.items():
            f.create_dataset(name, data=data)
    return LayoutSpec("rows", ("d.h5",), tuple(datasets), root=str(tmp_path))


def _err(spec, match):
    with pytest.raises(SolarError, match=match) as ei:
        build_layout(spec)
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


def test_missing_file(tmp_path):
    msg = _err(LayoutSpec("rows", ("nope.h5",), ("X",), root=str(tmp_path)), "file not found")
    assert "nope.h5" in msg


def test_missing_file_glob(tmp_path):
    _err(LayoutSpec("rows", ("*.h5",), ("X",), root=str(tmp_path)), r"no file matches .*\*\.h5")


def test_not_hdf5(tmp_path):
    (tmp_path / "bad.h5").write_bytes(b"not an hdf5 file at all")
    _err(LayoutSpec("rows", ("bad.h5",), ("X",), root=str(tmp_path)), "cannot open .*bad.h5 as HDF5")


def test_missing_dataset(tmp_path):
    spec = _rows(tmp_path, X=np.zeros((4, 2)))
    spec = LayoutSpec("rows", spec.files, ("X", "Y"), root=spec.root)
    _err(spec, "dataset 'Y' not found in .*d.h5")


def test_missing_group(tmp_path):
    with h5py.File(tmp_path / "g.h5", "w") as f:
        f.create_group("0000").create_dataset("data", data=np.zeros((3, 2)))
    _err(LayoutSpec("whole", ("g.h5",), ("data",), root=str(tmp_path), groups="seed*"),
         "no group matching 'seed\\*' in .*g.h5")
    _err(LayoutSpec("whole", ("g.h5",), ("grid/x",), root=str(tmp_path), groups="*"),
         "dataset '0000/grid/x' not found")


def test_group_instead_of_dataset(tmp_path):
    with h5py.File(tmp_path / "g.h5", "w") as f:
        f.create_group("X")
    _err(LayoutSpec("rows", ("g.h5",), ("X",), root=str(tmp_path)), "g.h5:/X is a group, not a dataset")


def test_sample_counts_disagree(tmp_path):
    msg = _err(_rows(tmp_path, X=np.zeros((10, 3)), Y=np.zeros((9, 3))), "disagree on the sample count")
    assert "X has 10" in msg and "Y has 9" in msg


def test_non_numeric_dtype(tmp_path):
    _err(_rows(tmp_path, X=np.zeros((3, 2)), S=np.array([b"ab", b"cd", b"ef"])), "d.h5:/S has non-numeric dtype")


def test_compound_dtype(tmp_path):
    rec = np.zeros(3, dtype=[("a", "f4"), ("b", "i4")])
    _err(_rows(tmp_path, R=rec), "non-numeric dtype")


def test_empty_dataset(tmp_path):
    _err(_rows(tmp_path, X=np.zeros((0, 4))), r"d.h5:/X is empty \(shape \(0, 4\)\)")


def test_scalar_dataset_has_no_sample_axis(tmp_path):
    _err(_rows(tmp_path, X=np.float32(1.0)), "fewer than its sample axes")


def test_window_longer_than_trajectory(tmp_path):
    out = make_dataset(tmp_path, "well", steps=6)
    spec = LayoutSpec.load(out)
    long = LayoutSpec("windows", spec.files, spec.fields, root=spec.root, n_steps_input=4, n_steps_output=1, dt=2)
    msg = _err(long, "window of 5 frames with dt=2 spans 9 steps, longer than the 6-step trajectories")
    assert ".hdf5" in msg
    assert build_layout(LayoutSpec("windows", spec.files, spec.fields, root=spec.root, dt=1)).n_samples > 0


def test_unsupported_filter_is_named(tmp_path):
    """A chunk written with bzip2 (id 307), which neither solar nor this HDF5 build decodes."""
    path = tmp_path / "bz.h5"
    with h5py.File(path, "w") as f:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((4,))
        dcpl.set_filter(307, h5py.h5z.FLAG_OPTIONAL)
        space = h5py.h5s.create_simple((8,))
        h5py.h5d.create(f.id, b"X", h5py.h5t.NATIVE_FLOAT, space, dcpl=dcpl)
        f["X"].id.write_direct_chunk((0,), b"BZh91AY&SY not really", filter_mask=0)
    if h5py.h5z.filter_avail(307):
        pytest.skip("this HDF5 build has a bzip2 filter")
    _err(LayoutSpec("rows", ("bz.h5",), ("X",), root=str(tmp_path)), r"uses HDF5 filter bzip2 \(id 307\)")


def test_spec_validation():
    with pytest.raises(SpecError, match="unknown layout kind 'table'; valid kinds: rows, windows, whole"):
        LayoutSpec("table", ("a.h5",), ("X",))
    with pytest.raises(SpecError, match="lists no fields"):
        LayoutSpec("rows", ("a.h5",), ())
    with pytest.raises(SpecError, match="dt must be a positive integer, got 0"):
        LayoutSpec("windows", ("a.h5",), ("X",), dt=0)
    with pytest.raises(SpecError, match="field twice"):
        LayoutSpec("rows", ("a.h5",), ("X", "X"))


def test_bad_spec_files(tmp_path):
    (tmp_path / "s.json").write_text("{not json")
    with pytest.raises(SpecError, match="cannot read layout spec"):
        load_layout(str(tmp_path / "s.json"))
    (tmp_path / "s.json").write_text(json.dumps({"solar_layout_spec": 1, "kind": "rows", "files": ["a.h5"],
                                                 "fields": ["X"], "colour": "red"}))
    with pytest.raises(SpecError, match="unknown key.*colour"):
        load_layout(str(tmp_path / "s.json"))
    with pytest.raises(SpecError, match="folder has no solar-layout.json"):
        load_layout(str(tmp_path))
    with pytest.raises(SpecError, match="file not found"):
        load_layout(str(tmp_path / "missing"))


def test_cli_error_is_one_line_exit_2(tmp_path, capsys):
    rc = main(["inspect", str(tmp_path / "missing.h5")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().count("\n") == 0 and "missing.h5" in err and "Traceback" not in err


def test_corrupt_chunk_names_file_dataset_chunk(tmp_path):
    from solar.errors import DecodeError
    from solar.io import read_block
    out = make_dataset(tmp_path, "ptychonn", "gzip")
    lay = load_layout(out)
    b = int(lay.blocks_of(4)[1])  # a Y_I_train chunk
    with open(lay.files[0], "r+b") as fh:
        fh.seek(int(lay.block_offset[b]) + 2)
        fh.write(b"\xff" * 16)
    fd = os.open(lay.files[0], os.O_RDONLY)
    try:
        with pytest.raises(DecodeError, match=r"chunk at \(3, 0, 0, 0\) of .*ptychonn.h5:/Y_I_train: gzip"):
            read_block(lay, b, fd)
    finally:
        os.close(fd)
