"""``solar gen well`` writes what The Well's own tools accept.

The conventions checked here are those of The Well's format checker
(``scripts/check_thewell_formatting.py`` in PolymathicAI/the_well) and of its ``WellDataset``
and ``ZScoreNormalization``/``RMSNormalization`` (package ``the-well``), restated from their
documented behaviour: they run without the-well installed.  The last tests run the real
package (and the real checker, when ``THE_WELL_CHECKER`` names its file) and skip otherwise.
"""
import glob
import importlib.util
import os
import re
import warnings

import h5py
import numpy as np
import pytest

import solar
from solar.cli import main
from solar.errors import SpecError
from solar.gen import GenConfig, generate
from solar.gen.presets import WELL_FIELDS, WELL_NAME, WELL_STAT_KEYS, well_file_name
from helpers import SMALL, make_dataset

NAMES = ["turbulent_radiative_layer_tcool_0.03.hdf5", "turbulent_radiative_layer_tcool_0.10.hdf5"]
YAML11_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+][0-9]+)?$")  # PyYAML's float, no inf/nan


@pytest.fixture(scope="module")
def well(tmp_path_factory):
    """A small generated The Well folder (SMALL['well'], chunked so that chunks cross trajectories)."""
    return make_dataset(tmp_path_factory.mktemp("well"), "well", "multi")


def well_files(out, split="*"):
    return sorted(glob.glob(os.path.join(out, WELL_NAME, "data", split, "*.hdf5")))


def _str_list(value):
    """An attribute that The Well reads as a list of names: an array whose items are ``str``."""
    assert isinstance(value, np.ndarray), value
    assert all(isinstance(v, str) for v in value), value
    return list(value)


def _check_flags_and_shape(f, obj, kind, order=0):
    """``sample_varying``/``time_varying`` are booleans, and the shape they imply is the shape stored.

    Implied shape: ``[B]`` if sample-varying, then ``[T]`` if time-varying, then per ``kind``:
    a field adds its spatial axes (``dim_varying``) and ``order`` axes of ``n_spatial_dims``;
    a boundary group's ``mask`` adds the axes it is associated with; a coordinate's own
    (last) axis is not counted.
    """
    for attr in ("sample_varying", "time_varying"):
        assert attr in obj.attrs, f"{obj.name} lacks {attr}"
        assert isinstance(obj.attrs[attr], (bool, np.bool_)), f"{obj.name}.{attr} is not a boolean"
    dims = f["dimensions"]
    spatial = _str_list(dims.attrs["spatial_dims"])
    want = ((f.attrs["n_trajectories"],) if obj.attrs["sample_varying"] else ()) + \
        ((dims["time"].shape[-1],) if obj.attrs["time_varying"] else ())
    got = obj["mask"].shape if kind == "bc" else obj.shape
    if kind == "field":
        flags = obj.attrs["dim_varying"]
        assert isinstance(flags, np.ndarray) and len(flags) == f.attrs["n_spatial_dims"], obj.name
        want += tuple(dims[d].shape[-1] for d, on in zip(spatial, flags) if on) + (f.attrs["n_spatial_dims"],) * order
    elif kind == "bc":
        assert isinstance(obj.attrs["bc_type"], str), obj.name
        assoc = _str_list(obj.attrs["associated_dims"])
        _str_list(obj.attrs["associated_fields"])
        assert set(assoc) <= set(spatial), obj.name
        want += tuple(dims[d].shape[-1] for d in spatial if d in assoc)
    elif kind == "coordinate":
        got = got[:-1]
    assert got == want, f"{obj.name}: shape {got}, its flags imply {want}"


def _check_file(path):
    """Every rule of The Well's format checker, on one file."""
    with h5py.File(path, "r") as f:
        for attr, kind in (("dataset_name", str), ("grid_type", str), ("n_spatial_dims", np.integer),
                           ("n_trajectories", np.integer)):
            assert isinstance(f.attrs[attr], kind), attr
        for p in _str_list(f.attrs["simulation_parameters"]):
            assert p in f.attrs and p in f["scalars"], p
        dims = f["dimensions"]
        spatial = _str_list(dims.attrs["spatial_dims"])
        assert len(spatial) == f.attrs["n_spatial_dims"]
        _check_flags_and_shape(f, dims["time"], "time")
        for d in spatial:
            _check_flags_and_shape(f, dims[d], "coordinate")
        for order in range(3):
            g = f[f"t{order}_fields"]
            for name in _str_list(g.attrs["field_names"]):
                _check_flags_and_shape(f, g[name], "field", order)
        for name in _str_list(f["scalars"].attrs["field_names"]):
            _check_flags_and_shape(f, f["scalars"][name], "scalar")
        for name, g in f["boundary_conditions"].items():
            _check_flags_and_shape(f, g, "bc")
            assert g.attrs["bc_type"].lower() in name, name  # the checker warns otherwise


def test_every_file_follows_the_well_format(well):
    files = well_files(well)
    assert len(files) == 6
    for path in files:
        _check_file(path)


def test_time_is_time_varying_and_coordinates_are_not(well):
    with h5py.File(well_files(well, "train")[0], "r") as f:
        dims = f["dimensions"]
        assert dims["time"].attrs["time_varying"] and not dims["time"].attrs["sample_varying"]
        for d in ("x", "y"):
            assert not dims[d].attrs["time_varying"] and not dims[d].attrs["sample_varying"]


def test_boundary_masks_mark_both_edges_periodic_included(well):
    """A mask all False reads as no boundary given (open by default): periodic x must mark its edges."""
    size = SMALL["well"]["size"]
    with h5py.File(well_files(well, "valid")[1], "r") as f:
        bcs = f["boundary_conditions"]
        assert {k: bcs[k].attrs["bc_type"] for k in bcs} == {"x_periodic": "PERIODIC", "y_open": "OPEN"}
        for name, n in (("x_periodic", size), ("y_open", 3 * size)):
            mask = bcs[name]["mask"][()]
            assert mask.dtype == bool and mask.shape == (n,)
            assert mask[0] and mask[-1] and not mask[1:-1].any(), name


def test_file_names_and_folders_are_the_real_sets(well):
    """``{name}/data/{split}/turbulent_radiative_layer_tcool_{p:.2f}.hdf5``: no ``_2D``, two decimals."""
    for split in ("train", "valid", "test"):
        assert sorted(os.listdir(os.path.join(well, WELL_NAME, "data", split))) == NAMES
    assert sorted(os.listdir(os.path.join(well, WELL_NAME))) == ["data", "stats.yaml"]
    assert sorted(os.listdir(well)) == ["solar-layout.json", WELL_NAME]  # no temporary file left
    assert [well_file_name(t) for t in (0.06, 1.0, 3.16)] == [
        "turbulent_radiative_layer_tcool_0.06.hdf5", "turbulent_radiative_layer_tcool_1.00.hdf5",
        "turbulent_radiative_layer_tcool_3.16.hdf5"]
    with h5py.File(well_files(well, "test")[1], "r") as f:
        assert f.attrs["dataset_name"] == WELL_NAME and f.attrs["tcool"] == pytest.approx(0.1)


def _yaml_number(text: str) -> float:
    assert YAML11_FLOAT.match(text), f"{text!r} would load as a string in PyYAML"
    return float(text)


def read_stats(path):
    """The block-style ``stats.yaml``: ``{key: {field: float or [float, ...]}}``; every number a YAML float."""
    out, key, name = {}, None, None
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    for line in lines:
        if not line.startswith(" "):  # "mean:"
            key = line.rstrip(":")
            out[key] = {}
        elif line.startswith("  - "):  # a component of the vector field above
            out[key][name].append(_yaml_number(line[4:]))
        else:  # "  density: 1.0E+00" or "  velocity:"
            name, _, text = line.strip().partition(":")
            out[key][name] = _yaml_number(text.strip()) if text.strip() else []
    return out


def _train_field(out, name):
    """One field over every train trajectory, float64 ``[B_total, T, X, Y(, 2)]``."""
    parts = []
    for path in well_files(out, "train"):
        with h5py.File(path, "r") as f:
            parts.append(f[name][()].astype(np.float64))
    return np.concatenate(parts)


def test_stats_yaml_is_numpy_mean_std_rms_over_the_train_split(well):
    stats = read_stats(os.path.join(well, WELL_NAME, "stats.yaml"))
    assert list(stats) == list(WELL_STAT_KEYS)
    for name in WELL_FIELDS:
        leaf, order = name.split("/")[1], int(name[1])
        x = _train_field(well, name)
        axes = tuple(range(x.ndim - order))
        for suffix, v in (("", x), ("_delta", np.diff(x, axis=1))):  # differences within each trajectory
            mean, std = v.mean(axis=axes), v.std(axis=axes)
            rms = np.sqrt((v ** 2).mean(axis=axes))
            scale = np.abs(v).max()
            for key, want in (("mean", mean), ("std", std), ("rms", rms)):
                got = np.asarray(stats[key + suffix][leaf])
                assert got.shape == want.shape, (key + suffix, leaf)
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14 * scale, err_msg=key + suffix + leaf)


@pytest.mark.skipif(importlib.util.find_spec("yaml") is None, reason="PyYAML not installed")
def test_stats_yaml_loads_the_same_in_pyyaml(well):
    import yaml
    path = os.path.join(well, WELL_NAME, "stats.yaml")
    with open(path, encoding="utf-8") as fh:
        assert yaml.safe_load(fh) == read_stats(path)


def test_fewer_steps_than_a_window_is_refused(tmp_path, capsys):
    """The spec's samples are windows of 5 frames: 4 frames a trajectory made a dataset its own spec refused."""
    with pytest.raises(SpecError, match="well needs --steps of at least 5 .*got 1"):
        generate("well", str(tmp_path / "a"), GenConfig(samples=1, size=4, steps=1))
    assert main(["gen", "well", str(tmp_path / "b"), "--steps", "4", "--size", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "solar gen: error: well needs --steps of at least 5" in err and "Traceback" not in err
    assert main(["gen", "well", str(tmp_path / "c"), "--steps", "5", "--size", "4", "--samples", "1",
                 "--no-progress"]) == 0
    assert solar.load_layout(str(tmp_path / "c")).n_samples > 0


# ------------------------------------------------------------------ the real package, when installed
@pytest.mark.skipif(importlib.util.find_spec("the_well") is None, reason="the-well not installed")
@pytest.mark.parametrize("norm", ["ZScoreNormalization", "RMSNormalization"])
def test_the_well_dataset_opens_and_normalises(well, norm):
    from the_well.data import WellDataset, normalization
    kw = {"well_base_path": well, "well_dataset_name": WELL_NAME, "well_split_name": "train",
          "n_steps_input": 4, "n_steps_output": 1}
    raw = WellDataset(**kw)
    normed = WellDataset(**kw, use_normalization=True, normalization_type=getattr(normalization, norm))
    stats = read_stats(os.path.join(well, WELL_NAME, "stats.yaml"))

    def chan(key):  # per channel, in WellDataset's order: density, pressure, velocity_x, velocity_y
        return np.array([stats[key]["density"], stats[key]["pressure"], *stats[key]["velocity"]])

    steps, n_traj = SMALL["well"]["steps"], SMALL["well"]["samples"]
    assert len(raw) == len(NAMES) * n_traj * (steps - 4)
    assert raw.metadata.boundary_condition_types and set(raw.metadata.boundary_condition_types) == {"OPEN", "PERIODIC"}
    for i in (0, len(raw) - 1):
        x = raw[i]["input_fields"].numpy().astype(np.float64)  # (4, X, Y, 4 channels)
        y = normed[i]["input_fields"].numpy()
        want = (x - chan("mean")) / chan("std") if norm == "ZScoreNormalization" else x / chan("rms")
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
        # padding boundary codes: x periodic (2) at both ends, y open (1)
        assert raw[i]["boundary_conditions"].tolist() == [[2, 2], [1, 1]]
    with h5py.File(well_files(well, "train")[0], "r") as f:  # window 0: trajectory 0, frames 0..3
        np.testing.assert_array_equal(raw[0]["input_fields"][..., 0].numpy(), f["t0_fields/density"][0, :4])
        np.testing.assert_array_equal(raw[0]["input_fields"][..., 2:].numpy(), f["t1_fields/velocity"][0, :4])


@pytest.mark.skipif(not os.environ.get("THE_WELL_CHECKER"),
                    reason="set THE_WELL_CHECKER to the_well's scripts/check_thewell_formatting.py")
def test_the_well_format_checker_accepts_every_file(well):
    spec = importlib.util.spec_from_file_location("check_thewell_formatting", os.environ["THE_WELL_CHECKER"])
    checker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checker)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its naming warnings count as failures
        for path in well_files(well):
            checker.check_hdf5_format(path)  # raises AssertionError on the first broken rule
