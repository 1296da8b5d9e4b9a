"""``solar inspect FILE`` on files whose data sits in groups (NeXus, instrument files): it describes the file
(exit 0: the tree, the best guess of a sample with its spec, the alternatives, the guess's layout), saves the
spec with ``--save-spec``, and that spec plans; ``solar plan FILE`` on such a file refuses with one line
pointing there."""
import json
import os

import h5py
import numpy as np
import pytest

from solar.cli import main
from solar.errors import LayoutError
from solar.layout import LayoutSpec, load_layout


def _nexus(path):
    """NeXus-style: ``/entry/data/data`` frames (the NXdata signal), per-frame and per-pixel arrays, scalars and
    strings, a hard link to a per-frame array, a second entry with 6 rows."""
    with h5py.File(path, "w") as f:
        entry = f.create_group("entry")
        entry.attrs["NX_class"] = "NXentry"
        entry.create_dataset("title", data="scan 17")
        entry.create_dataset("energy", data=8.5)
        data = entry.create_group("data")
        data.attrs.update(NX_class="NXdata", signal="data")
        data.create_dataset("data", data=np.arange(6 * 4 * 5, dtype="u2").reshape(6, 4, 5), chunks=(1, 4, 5),
                            compression="gzip")
        det = entry.create_group("instrument/detector")
        det.create_dataset("count_time", data=np.linspace(0.1, 0.6, 6))
        det.create_dataset("x_pixel_size", data=np.full(5, 75e-6))
        data["count_time"] = det["count_time"]  # a hard link: the same dataset, counted once
        f.create_group("entry_2/data").create_dataset("mask", data=np.ones((6, 3), "i1"))


def _inspect_json(capsys, *args):
    rc = main(["inspect", *map(str, args), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def test_inspect_describes_a_nexus_file(tmp_path, capsys):
    _nexus(tmp_path / "scan.nxs")
    assert main(["inspect", str(tmp_path / "scan.nxs")]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"file: {tmp_path / 'scan.nxs'} (") and "6 groups, 6 datasets, 1 link" in lines[0]
    arrays = [ln.split()[0] for ln in lines if ln.startswith("  /")]
    assert arrays == ["/entry/data/count_time", "/entry/data/data", "/entry/instrument/detector/x_pixel_size",
                      "/entry_2/data/mask"]  # HDF5's name order; the hard link's second name is a link
    data_line = next(ln for ln in lines if ln.startswith("  /entry/data/data"))
    assert "(6, 4, 5)" in data_line and "uint16" in data_line and "chunks 1x4x5" in data_line \
        and "gzip" in data_line and "NeXus signal" in data_line
    assert "(not listed: 2 scalar and one-value datasets, 1 link; --json lists every object)" in out
    assert "sample (best guess): row i of the 3 datasets with 6 rows (holds the NeXus signal): 6 samples" in out
    assert "alternatives (--alternative K):" in out and "layout: rows (scan), 1 file(s), 6 samples" in out
    assert "read amplification" in out and "to plan with it: solar inspect" in out

    d = _inspect_json(capsys, tmp_path / "scan.nxs")
    assert d["guess"]["fields"] == ["entry/data/data", "entry/data/count_time", "entry_2/data/mask"]
    assert d["guess"]["samples"] == d["samples"] == 6 and d["chosen"] == 0
    assert d["guess"]["spec"] == {"solar_layout_spec": 1, "kind": "rows", "files": ["scan.nxs"],
                                  "fields": d["guess"]["fields"], "name": "scan"}
    assert [a["fields"] for a in d["alternatives"]] == [["entry/data/data"],
                                                        ["entry/data/data", "entry/data/count_time"],
                                                        ["entry/instrument/detector/x_pixel_size"]]
    assert d["alternatives"][1]["why"] == "row i of the 2 datasets with 6 rows under /entry only"
    assert d["alternatives"][2]["why"] == "row i of /entry/instrument/detector/x_pixel_size"
    assert d["alternatives"][2]["samples"] == 5
    tree = {n["path"]: n for n in d["tree"]}
    assert tree["/entry/instrument/detector/count_time"] == {
        "path": "/entry/instrument/detector/count_time", "kind": "link", "target": "/entry/data/count_time",
        "note": "hard link"}
    assert tree["/entry/title"]["why_not_field"] == "strings" and tree["/entry/energy"]["why_not_field"] == "scalar"
    assert tree["/entry/data"]["nx_class"] == "NXdata" and tree["/entry/data/data"]["signal"] is True
    assert tree["/entry/data/data"]["filters"] == ["gzip"] and tree["/entry/data/data"]["chunks"] == [1, 4, 5]
    assert d["file"] == {"path": str(tmp_path / "scan.nxs"), "bytes": os.path.getsize(tmp_path / "scan.nxs"),
                         "groups": 6, "datasets": 6, "links": 1, "complete": True}
    assert [r["name"] for r in d["datasets"]] == d["guess"]["fields"]  # the layout summary of the guess


def test_saved_spec_plans_at_once(tmp_path, capsys):
    """--save-spec elsewhere: the spec names the file relative to its own folder, loads, and solar plan takes it."""
    (tmp_path / "raw").mkdir()
    (tmp_path / "specs").mkdir()
    _nexus(tmp_path / "raw" / "scan [17].nxs")  # glob characters in the name are escaped in the spec
    spec_path = tmp_path / "specs" / "scan.json"
    d = _inspect_json(capsys, tmp_path / "raw" / "scan [17].nxs", "--save-spec", spec_path)
    assert d["saved_spec"] == str(spec_path)
    saved = json.loads(spec_path.read_text())
    assert saved["files"] == ["../raw/scan [[]17].nxs"] and saved["fields"] == d["guess"]["fields"]
    layout = load_layout(str(spec_path))
    assert layout.field_names == tuple(d["guess"]["fields"]) and layout.n_samples == 6
    assert {k: list(v) for k, v in layout.field_shapes(0).items()} == d["fields"]
    plan = tmp_path / "plan.h5"
    assert main(["plan", str(spec_path), "-P", "2", "-b", "1", "--epochs", "1", "--buffer-fraction", "1",
                 "-o", str(plan)]) == 0
    assert main(["inspect", str(plan)]) == 0
    capsys.readouterr()


def test_alternative_is_summarised_and_saved(tmp_path, capsys):
    _nexus(tmp_path / "scan.nxs")
    d = _inspect_json(capsys, tmp_path / "scan.nxs", "--alternative", "3", "--save-spec", tmp_path)
    assert d["chosen"] == 3 and d["samples"] == 5 and d["fields"] == {"entry/instrument/detector/x_pixel_size": []}
    spec = LayoutSpec.load(str(tmp_path / "solar-layout.json"))  # a folder: solar-layout.json in it
    assert spec.fields == ("entry/instrument/detector/x_pixel_size",) and spec.files == ("scan.nxs",)
    assert main(["inspect", str(tmp_path / "scan.nxs"), "--alternative", "3"]) == 0
    assert "chosen: alternative 3; its spec: " in capsys.readouterr().out


@pytest.mark.parametrize("args, needle", [
    (["--alternative", "4"], "alternative 4 does not exist: {f} has alternatives 1 to 3"),
    (["--save-spec", "{d}/taken.json"], "--save-spec '{d}/taken.json' exists; give --overwrite to replace it"),
    (["--save-spec", "{d}/spec.txt"], "--save-spec '{d}/spec.txt' must end with .json (or be a folder), as solar "
                                      "plan takes a spec"),
    (["--save-spec", "{d}/no/spec.json"], "--save-spec '{d}/no/spec.json': folder {d}/no does not exist"),
    (["--save-spec", "{d}/new/"], "--save-spec '{d}/new/': folder {d}/new does not exist"),
    (["--overwrite"], "--overwrite goes with --save-spec"),
])
def test_bad_options_are_one_line(tmp_path, capsys, args, needle):
    _nexus(tmp_path / "scan.nxs")
    (tmp_path / "taken.json").write_text("{}")
    f = str(tmp_path / "scan.nxs")
    rc = main(["inspect", f, *[a.format(d=tmp_path) for a in args]])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.strip() == f"solar inspect: error: {needle.format(f=f, d=tmp_path)}"
    assert (tmp_path / "taken.json").read_text() == "{}" and not (tmp_path / "spec.txt").exists()


def test_file_options_refused_for_a_spec(tmp_path, capsys):
    _nexus(tmp_path / "scan.nxs")
    LayoutSpec("rows", ("scan.nxs",), ("entry_2/data/mask",), root=str(tmp_path)).save(str(tmp_path))
    assert main(["inspect", str(tmp_path), "--alternative", "1"]) == 2
    assert capsys.readouterr().err.strip() == (f"solar inspect: error: --alternative: only for an HDF5 data file, "
                                               f"and {tmp_path} is a spec or a folder, not one")
    assert main(["inspect", str(tmp_path)]) == 0  # a spec's layout, as before
    assert "layout: rows" in capsys.readouterr().out


def test_overwrite_replaces_a_spec(tmp_path, capsys):
    _nexus(tmp_path / "scan.nxs")
    (tmp_path / "s.json").write_text("old")
    _inspect_json(capsys, tmp_path / "scan.nxs", "--save-spec", tmp_path / "s.json", "--overwrite")
    assert LayoutSpec.load(str(tmp_path / "s.json")).fields[0] == "entry/data/data"
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_small_root_arrays_beside_larger_data_in_groups_are_not_taken_silently(tmp_path):
    """Rows of the root arrays is the rule for a bare file; a 5 x 5 table at the root beside 64 images in /entry
    was planned as 5 samples without a word.  Now such a file is refused with the guess, as grouped files are; a
    file whose root arrays are its largest still loads."""
    f = str(tmp_path / "mixed.h5")
    with h5py.File(f, "w") as h:
        h.create_dataset("other", data=np.zeros((5, 5)))
        h.create_dataset("entry/images", data=np.zeros((64, 8, 8)))
        h.create_dataset("entry/energy", data=np.arange(64.0))
    with pytest.raises(LayoutError, match=r"its array at the root \(other\) sits beside a larger one in a group "
                                          r"\(best guess: 64 samples, row i of entry/images"):
        load_layout(f)
    g = str(tmp_path / "rooted.h5")
    with h5py.File(g, "w") as h:
        h.create_dataset("x", data=np.zeros((64, 8, 8)))
        h.create_dataset("meta/calibration", data=np.zeros((4, 4)))
    assert load_layout(g).n_samples == 64


def test_plan_on_the_bare_file_points_to_inspect(tmp_path, capsys):
    """solar plan FILE does not train on a guess the user has not seen: one line with the guess and the command."""
    f = str(tmp_path / "scan.nxs")
    _nexus(f)
    with pytest.raises(LayoutError) as ei:
        load_layout(f)
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg == (f"cannot tell what a sample of {f} is: its arrays sit in groups (best guess: 6 samples, row i of "
                   f"entry/data/data, entry/data/count_time, entry_2/data/mask); `solar inspect {f}` "
                   f"shows it with the alternatives and `solar inspect {f} --save-spec solar-layout.json` saves "
                   f"it as a spec to give instead of the file")
    assert main(["plan", f, "-P", "1", "-b", "2", "--buffer-fraction", "1", "-o", str(tmp_path / "p.h5")]) == 2
    assert capsys.readouterr().err.strip() == f"solar plan: error: {msg}"
    with h5py.File(tmp_path / "flat.h5", "w") as h:  # arrays at the root, but one axis each
        h.create_dataset("labels", data=np.arange(5))
    with pytest.raises(LayoutError, match=r"flat.h5 is: its arrays have one axis \(best guess: 5 samples, row i "
                                          r"of labels\)"):
        load_layout(str(tmp_path / "flat.h5"))


def test_file_without_array_data_is_one_line(tmp_path, capsys):
    with h5py.File(tmp_path / "t.h5", "w") as f:
        f.create_group("meta").create_dataset("note", data="nothing numeric")
        f.create_dataset("empty", shape=(0, 3), dtype="f4")
        f.create_dataset("one", data=[3.0])
        f.create_dataset("table", data=np.zeros(4, dtype=[("a", "i4"), ("b", "f8")]))
    assert main(["inspect", str(tmp_path / "t.h5"), "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == (f"solar inspect: error: {tmp_path / 't.h5'} holds no array solar can load (a numeric "
                           f"dataset with 2+ values): its 4 datasets: compound type (1), empty (1), one value (1), "
                           f"strings (1)")
    with h5py.File(tmp_path / "e.h5", "w") as f:
        f.create_group("a/b")
    assert main(["inspect", str(tmp_path / "e.h5")]) == 2
    assert capsys.readouterr().err.strip().endswith("(a numeric dataset with 2+ values): no dataset (2 groups)")


def test_long_listings_are_cut(tmp_path, capsys):
    with h5py.File(tmp_path / "many.h5", "w") as f:
        for i in range(50):
            f.create_dataset(f"g{i:02d}/x", data=np.zeros((4, i + 1)))
    assert main(["inspect", str(tmp_path / "many.h5")]) == 0
    out = capsys.readouterr().out
    assert len([ln for ln in out.splitlines() if ln.startswith("  /")]) == 40
    assert "(not listed: 10 more arrays; --json lists every object)" in out
    d = _inspect_json(capsys, tmp_path / "many.h5")
    assert len(d["tree"]) == 100 and len(d["guess"]["fields"]) == 50  # all 50 share 4 rows
    assert d["guess"]["fields"][0] == "g49/x"  # the largest first


def test_a_guess_that_cannot_be_built_is_described_then_refused(tmp_path, capsys):
    """External raw storage whose raw file is gone: the tree and guess print, the error says why, exit 2, and
    --save-spec writes nothing."""
    with h5py.File(tmp_path / "ext.h5", "w") as f:
        f.create_dataset("g/x", shape=(4, 2), dtype="f4", external=[(str(tmp_path / "x.raw"), 0, 32)])
    rc = main(["inspect", str(tmp_path / "ext.h5"), "--save-spec", str(tmp_path / "s.json")])
    out, err = capsys.readouterr()
    assert rc == 2 and "sample (best guess): row i of /g/x: 4 samples" in out
    assert "layout: cannot be built: " in out and "x.raw" in err and "nothing written to" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "s.json").exists()
