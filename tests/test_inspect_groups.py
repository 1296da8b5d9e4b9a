"""``solar inspect FILE`` on files whose data sits in groups (NeXus, instrument files): the error lists
the candidate datasets and a ``solar-layout.json`` line that selects each, and those lines work."""
import json
import os
import shutil

import h5py
import numpy as np
import pytest

from solar.cli import main
from solar.errors import LayoutError
from solar.layout import load_layout


def _nexus(path):
    """NeXus-style: ``/entry/data/data`` frames, per-frame and per-pixel arrays, scalars and strings."""
    with h5py.File(path, "w") as f:
        entry = f.create_group("entry")
        entry.attrs["NX_class"] = "NXentry"
        entry.create_dataset("title", data="scan 17")
        entry.create_dataset("energy", data=8.5)
        entry.create_group("data").create_dataset("data", data=np.arange(6 * 4 * 5, dtype="u2").reshape(6, 4, 5),
                                                  chunks=(1, 4, 5), compression="gzip")
        det = entry.create_group("instrument/detector")
        det.create_dataset("count_time", data=np.linspace(0.1, 0.6, 6))
        det.create_dataset("x_pixel_size", data=np.full(5, 75e-6))
        f.create_group("entry_2/data").create_dataset("mask", data=np.ones((6, 3), "i1"))


def _spec_lines(text):
    return [json.loads(ln.strip()) for ln in text.splitlines() if ln.strip().startswith("{")]


def test_inspect_lists_grouped_datasets_and_their_spec_lines(tmp_path, capsys):
    _nexus(tmp_path / "scan.nxs")
    assert main(["inspect", str(tmp_path / "scan.nxs")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.startswith("solar inspect: error: cannot guess the samples of ")
    table = [ln.split() for ln in err.splitlines() if ln.startswith("  /")]
    assert table == [["/entry/data/data", "(6,", "4,", "5)", "uint16"],
                     ["/entry_2/data/mask", "(6,", "3)", "int8"],
                     ["/entry/instrument/detector/count_time", "(6,)", "float64"],
                     ["/entry/instrument/detector/x_pixel_size", "(5,)", "float64"]]
    assert os.path.join(str(tmp_path), "solar-layout.json") in err
    specs = _spec_lines(err)
    assert [s["fields"] for s in specs] == [["entry/data/data"], ["entry_2/data/mask"],
                                            ["entry/instrument/detector/count_time"],
                                            ["entry/instrument/detector/x_pixel_size"],
                                            ["entry/data/data", "entry_2/data/mask",
                                             "entry/instrument/detector/count_time"]]
    assert all(s["kind"] == "rows" and s["files"] == ["scan.nxs"] for s in specs)


def test_the_printed_spec_lines_load(tmp_path, capsys):
    """Each printed line, saved as the folder's solar-layout.json, gives a layout over that dataset."""
    _nexus(tmp_path / "scan.nxs")
    with pytest.raises(LayoutError) as ei:
        load_layout(str(tmp_path / "scan.nxs"))
    specs = _spec_lines(str(ei.value))
    assert len(specs) == 5
    for k, spec in enumerate(specs):
        d = tmp_path / f"use{k}"
        d.mkdir()
        shutil.copy(tmp_path / "scan.nxs", d / "scan.nxs")
        (d / "solar-layout.json").write_text(json.dumps(spec))
        layout = load_layout(str(d))
        assert layout.field_names == tuple(spec["fields"])
        assert layout.n_samples == (5 if spec["fields"] == ["entry/instrument/detector/x_pixel_size"] else 6)
        assert main(["inspect", str(d)]) == 0
    capsys.readouterr()


def test_file_without_numeric_data_says_so(tmp_path, capsys):
    with h5py.File(tmp_path / "t.h5", "w") as f:
        f.create_group("meta").create_dataset("note", data="nothing numeric")
        f.create_dataset("empty", shape=(0, 3), dtype="f4")
    assert main(["inspect", str(tmp_path / "t.h5")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"solar inspect: error: cannot guess the samples of {tmp_path / 't.h5'}: it holds no " \
                          f"non-empty numeric dataset"


def test_long_listings_are_cut(tmp_path, capsys):
    with h5py.File(tmp_path / "many.h5", "w") as f:
        for i in range(20):
            f.create_dataset(f"g{i:02d}/x", data=np.zeros((4, i + 1)))
    assert main(["inspect", str(tmp_path / "many.h5")]) == 2
    err = capsys.readouterr().err
    assert "  ... and 8 more" in err
    assert len([ln for ln in err.splitlines() if ln.startswith("  /")]) == 12
    assert _spec_lines(err)[-1]["fields"] == [f"g{i:02d}/x" for i in range(19, -1, -1)]  # all 20 share 4 rows
