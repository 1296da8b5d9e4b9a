"""Splits in a layout spec (``"splits": {"train": [...], "valid": [...], "test": [...]}``), ``solar gen
well`` naming all three, ``solar plan --split/--fields`` (a layout restricted to a split or to some
fields, from the same spec), old specs unchanged, bad names listed with the valid ones."""
import json
import os
import re

import numpy as np
import pytest

import solar
from solar.cli import main
from solar.layout import LayoutSpec, load_layout
from solar.loader import SolarLoader

from helpers import h5py_sample, make_dataset

JOB = ["-P", "2", "-b", "2", "--epochs", "1", "--buffer-fraction", "0.9"]


@pytest.fixture(scope="module")
def well(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("splits"), "well", "contiguous")


def run_main(capsys, *args):
    try:
        rc = main(list(args))
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


def test_gen_well_names_three_splits_train_by_default(well):
    with open(os.path.join(well, "solar-layout.json")) as fh:
        d = json.load(fh)
    assert list(d["splits"]) == ["train", "valid", "test"] and "files" not in d and "split" not in d
    spec = LayoutSpec.load(well)
    assert spec.split == "train" and spec.split_names == ("train", "valid", "test")
    for split in spec.split_names:
        lay = load_layout(well, split=split)
        assert lay.files and all(f"/data/{split}/" in p for p in lay.files)
    assert load_layout(well).files == load_layout(well, split="train").files


def test_default_split_is_train_else_the_first():
    base = {"solar_layout_spec": 1, "kind": "rows", "fields": ["x"]}
    assert LayoutSpec.from_dict({**base, "splits": {"a": ["a.h5"], "train": ["t.h5"]}}).files == ("t.h5",)
    assert LayoutSpec.from_dict({**base, "splits": {"b": ["b.h5"], "a": ["a.h5"]}}).files == ("b.h5",)
    spec = LayoutSpec.from_dict({**base, "splits": {"b": ["b.h5"], "a": ["a.h5"]}, "split": "a"})
    assert spec.files == ("a.h5",) and LayoutSpec.from_dict(spec.to_dict()) == spec


def test_old_specs_are_unchanged():
    old = {"solar_layout_spec": 1, "kind": "rows", "files": ["p.h5"], "fields": ["x", "y"], "name": "rows"}
    spec = LayoutSpec.from_dict(old)
    assert spec.splits is None and spec.split is None and spec.to_dict() == old
    assert spec.select(fields="y").to_dict() == {**old, "fields": ["y"]}
    with pytest.raises(solar.SpecError, match=r"split 'train' asked for, but the layout spec names no splits"):
        spec.select("train")


@pytest.mark.parametrize("d,msg", [
    ({"files": ["a.h5"], "splits": {"train": ["a.h5"]}}, "either 'files' or 'splits' \\(not both\\)"),
    ({"splits": {}}, "'splits' names no split"),
    ({"splits": {"train": []}}, "split 'train' must list file patterns"),
    ({"splits": {"train": ["a.h5"]}, "split": "valid"}, "unknown split 'valid'; the spec's splits: train"),
    ({"files": ["a.h5"], "split": "valid"}, "split 'valid' given, but the layout spec names no splits"),
])
def test_bad_splits_say_what_is_wrong(d, msg):
    with pytest.raises(solar.SpecError, match=msg):
        LayoutSpec.from_dict({"solar_layout_spec": 1, "kind": "rows", "fields": ["x"], **d})


def test_plan_split_and_fields(well, tmp_path, capsys):
    out = str(tmp_path / "valid.h5")
    rc, err = run_main(capsys, "plan", well, *JOB, "--split", "valid", "--fields", "t1_fields/velocity", "-o", out)
    assert rc == 0, err
    lay = load_layout(well, split="valid", fields="t1_fields/velocity")
    assert lay.field_names == ("t1_fields/velocity",)
    with solar.Schedule.load(out) as s:
        assert s.fingerprint == lay.fingerprint and s.n_samples == lay.n_samples
    with SolarLoader(out, lay, rank=0) as loader:
        for b in loader:
            assert set(b) == {"t1_fields/velocity", "index", "weight"}
            for i, s in enumerate(b["index"].tolist()):
                np.testing.assert_array_equal(b["t1_fields/velocity"][i].numpy(),
                                              h5py_sample(lay, s)["t1_fields/velocity"])


@pytest.mark.parametrize("args,msg", [
    (["--split", "validation"], "unknown split 'validation'; the spec's splits: train, valid, test"),
    (["--fields", "density"], "unknown field\\(s\\) 'density'; the spec's fields: t0_fields/density, "
                              "t0_fields/pressure, t1_fields/velocity"),
])
def test_plan_bad_names_list_the_valid_ones(well, tmp_path, capsys, args, msg):
    rc, err = run_main(capsys, "plan", well, *JOB, *args, "-o", str(tmp_path / "x.h5"))
    assert rc == 2 and err.startswith("solar plan: error: ") and len(err.strip().splitlines()) == 1
    assert re.search(msg, err), err
    assert not os.path.exists(tmp_path / "x.h5")


def test_plan_split_on_a_spec_without_splits(tmp_path, capsys):
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=8, size=8)
    rc, err = run_main(capsys, "plan", data, *JOB, "--split", "train", "-o", str(tmp_path / "x.h5"))
    assert rc == 2 and "split 'train' asked for, but the layout spec names no splits" in err


def test_loader_without_data_uses_the_planned_split(well, tmp_path, capsys):
    """The schedule stores the layout it was planned on (format v3), split and fields included."""
    out = str(tmp_path / "test.h5")
    assert run_main(capsys, "plan", well, *JOB, "--split", "test", "-o", out)[0] == 0
    with SolarLoader(out, rank=1) as loader:
        assert loader.layout.spec.split == "test" and all("/data/test/" in p for p in loader.layout.files)
        assert sum(len(b["index"]) for b in loader) == loader.layout.n_samples // 2
