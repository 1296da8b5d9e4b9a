"""The Well as its users load it: solar batches of a ``windows`` layout through
:class:`solar.well.WellTransform` are what ``the_well.data.WellDataset`` gives for the same
windows (frame stride ``dt``, input/output split, fields stacked on the last axis, constant
and time-varying scalars, boundary codes, grids, z-score / RMS normalisation from
``stats.yaml``).

The always-run tests build the expected batch from plain h5py slicing and statistics computed
here; the last ones compare with the real package (``the-well``) when it is installed.
"""
import dataclasses
import glob
import importlib.util
import os
import shutil

import h5py
import numpy as np
import pytest
import torch

import solar
from solar.errors import LayoutError, SpecError
from solar.gen.presets import WELL_NAME
from solar.layout import LayoutSpec, build_layout
from solar.loader import SolarLoader
from solar.well import WellTransform, find_stats, parse_stats
from helpers import SMALL, make_dataset

N_TRAJ, STEPS, SIZE = SMALL["well"]["samples"], SMALL["well"]["steps"], SMALL["well"]["size"]
WINDOWS = [(4, 1, 1), (2, 1, 2), (1, 2, 3)]  # (n_steps_input, n_steps_output, dt)
BASE = ("t0_fields/density", "t0_fields/pressure", "t1_fields/velocity")
EXTRA = ("t0_fields/obstacle",)  # constant per trajectory: [B, X, Y]
PROFILE = "t0_fields/profile"    # constant everywhere and along y: [X], dim_varying (True, False)


@pytest.fixture(scope="module")
def well(tmp_path_factory):
    """``solar gen well`` output, chunks of 3 frames (chunks cross trajectories)."""
    return make_dataset(tmp_path_factory.mktemp("wl"), "well", "multi")


def train_files(out):
    return sorted(glob.glob(os.path.join(out, WELL_NAME, "data", "train", "*.hdf5")))


def layout_of(out, n_in, n_out, dt, fields=BASE):
    spec = dataclasses.replace(LayoutSpec.load(out), n_steps_input=n_in, n_steps_output=n_out, dt=dt,
                               fields=tuple(fields))
    return build_layout(spec)


def delivered(layout, transform=None):
    """Every batch of a 1-rank, 1-epoch plan (local batch 3) through SolarLoader, transformed."""
    sched = solar.plan(layout, world_size=1, local_batch=3, epochs=1, buffer_fraction=0.95)
    with SolarLoader(sched, layout, rank=0, abort_on_error=False) as loader:
        return [transform(b) if transform else b for b in loader]


def window_of(i, n_files, n_in, n_out, dt):
    """``(file, trajectory, frames)`` of global window ``i``, counted independently of solar:
    files in name order, trajectories in order, ``STEPS - dt * (window - 1)`` windows each."""
    per_traj = STEPS - dt * (n_in + n_out - 1)
    per_file = N_TRAJ * per_traj
    f, r = divmod(i, per_file)
    assert f < n_files
    b, t0 = divmod(r, per_traj)
    return f, b, np.arange(n_in + n_out) * dt + t0


# ------------------------------------------------------------------ building a richer The Well folder
def _strs(names):
    return np.array(list(names), dtype=object).astype(h5py.string_dtype())


def _flag(d, sample_varying, time_varying, dim_varying=None):
    d.attrs["sample_varying"], d.attrs["time_varying"] = sample_varying, time_varying
    if dim_varying is not None:
        d.attrs["dim_varying"] = np.array(dim_varying)


def add_extras(path, seed, profile):
    """Add to one The Well file: ``t0_fields/obstacle`` [B, X, Y] (not time-varying), a time-varying
    scalar ``scalars/forcing`` [B, T] and, with ``profile``, ``t0_fields/profile`` [X] (varies along x only)."""
    rng = np.random.default_rng(seed)
    with h5py.File(path, "r+") as f:
        B, T, X, Y = f["t0_fields/density"].shape
        _flag(f["t0_fields"].create_dataset("obstacle", data=rng.random((B, X, Y), dtype=np.float32)),
              True, False, [True, True])
        names = ["density", "pressure", "obstacle"]
        if profile:
            _flag(f["t0_fields"].create_dataset("profile", data=rng.random(X, dtype=np.float32)),
                  False, False, [True, False])
            names.append("profile")
        f["t0_fields"].attrs["field_names"] = _strs(names)
        _flag(f["scalars"].create_dataset("forcing", data=rng.random((B, T), dtype=np.float32)), True, True)
        f["scalars"].attrs["field_names"] = _strs(["tcool", "forcing"])


def field_stats(files, name):
    """float64 mean, std (population), rms of one field over ``files``, per tensor component."""
    with h5py.File(files[0], "r") as f:
        order = int(f[name].parent.name[2])
    x = np.concatenate([h5py.File(p, "r")[name][()][None].astype(np.float64) for p in files])
    axes = tuple(range(x.ndim - order))
    return x.mean(axis=axes), x.std(axis=axes), np.sqrt((x ** 2).mean(axis=axes))


def write_stats(path, files, fields):
    """A block-style stats.yaml of mean/std/rms (and the _delta keys The Well requires, zeros) per field."""
    table = {k: {} for k in ("mean", "std", "rms", "mean_delta", "std_delta", "rms_delta")}
    for name in fields:
        for key, v in zip(("mean", "std", "rms"), field_stats(files, name)):
            table[key][name.split("/")[1]] = v
            table[key + "_delta"][name.split("/")[1]] = np.zeros_like(v)
    lines = []
    for key, per in table.items():
        lines.append(f"{key}:")
        for leaf, v in per.items():
            lines += [f"  {leaf}:"] + [f"  - {float(c)!r}" for c in v] if np.ndim(v) else [f"  {leaf}: {float(v)!r}"]
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return table


@pytest.fixture(scope="module")
def rich(tmp_path_factory, well):
    """``well``'s train split plus the extras (and ``profile``), its own stats.yaml computed here."""
    out = str(tmp_path_factory.mktemp("rich") / "w")
    shutil.copytree(well, out)
    for k, p in enumerate(train_files(out)):
        add_extras(p, k, profile=True)
    fields = BASE + EXTRA + (PROFILE,)
    table = write_stats(os.path.join(out, WELL_NAME, "stats.yaml"), train_files(out), fields)
    return out, fields, table


# ------------------------------------------------------------------ frame stride
@pytest.mark.parametrize("n_in,n_out,dt", WINDOWS)
def test_windows_honour_dt_and_equal_strided_h5py_slices(well, n_in, n_out, dt):
    """Each delivered window is ``f[field][b, t0 : t0 + dt*(w-1) + 1 : dt]``, every window once."""
    lay = layout_of(well, n_in, n_out, dt)
    files = train_files(well)
    assert lay.n_samples == len(files) * N_TRAJ * (STEPS - dt * (n_in + n_out - 1))
    seen = []
    for b in delivered(lay):
        for j, i in enumerate(b["index"].tolist()):
            f, traj, frames = window_of(i, len(files), n_in, n_out, dt)
            with h5py.File(files[f], "r") as h:
                for name in BASE:
                    np.testing.assert_array_equal(b[name][j].numpy(), h[name][traj][frames], err_msg=f"{name} {i}")
            seen.append(i)
    assert sorted(seen) == list(range(lay.n_samples))


# ------------------------------------------------------------------ against h5py + statistics computed here
def expected(out, i, fields, table, n_in, n_out, dt, normalization):
    """WellDataset's item for window ``i``, built from h5py: channels in The Well's order."""
    files = train_files(out)
    f, traj, frames = window_of(i, len(files), n_in, n_out, dt)
    variable, constant = [], []
    with h5py.File(files[f], "r") as h:
        for name in fields:
            d = h[name]
            x = d[()]
            x = x[traj] if d.attrs["sample_varying"] else x
            x = x[frames] if d.attrs["time_varying"] else x
            leaf = name.split("/")[1]
            if normalization == "zscore":
                x = (x - np.float32(table["mean"][leaf])) / np.maximum(np.float32(table["std"][leaf]), np.float32(1e-4))
            elif normalization == "rms":
                x = x / np.maximum(np.float32(table["rms"][leaf]), np.float32(1e-4))
            if not d.attrs["dim_varying"][1]:  # repeated along y
                x = np.repeat(x[..., None], SIZE * 3, axis=-1)
            x = x[..., None] if name.startswith("t0") else x
            (variable if d.attrs["time_varying"] else constant).append(x)
        scal = [h[f"scalars/{s}"] for s in h["scalars"].attrs["field_names"]]
        const_sc = np.array([s[()] for s in scal if not s.attrs["time_varying"]], dtype=np.float32)
        var_sc = [s[traj][frames] for s in scal if s.attrs["time_varying"]]
        t = h["dimensions/time"][()][frames]
        xs, ys = h["dimensions/x"][()], h["dimensions/y"][()]
        tcool = h.attrs["tcool"]
    v = np.concatenate(variable, axis=-1)
    item = {"input_fields": v[:n_in], "output_fields": v[n_in:], "constant_scalars": const_sc,
            "boundary_conditions": np.array([[2, 2], [1, 1]], np.float32),  # x periodic, y open
            "space_grid": np.stack(np.meshgrid(xs, ys, indexing="ij"), -1),
            "input_time_grid": (t - t[0])[:n_in], "output_time_grid": (t - t[0])[n_in:]}
    if constant:
        item["constant_fields"] = np.concatenate(constant, axis=-1)
    if var_sc:
        series = np.stack(var_sc, -1)
        item["input_scalars"], item["output_scalars"] = series[:n_in], series[n_in:]
    assert const_sc[0] == np.float32(tcool)
    return item


@pytest.mark.parametrize("n_in,n_out,dt,normalization", [(2, 1, 2, None), (1, 2, 3, "zscore"), (4, 1, 1, "rms")])
def test_transform_equals_h5py_reference(rich, n_in, n_out, dt, normalization):
    out, fields, table = rich
    lay = layout_of(out, n_in, n_out, dt, fields)
    tr = WellTransform(lay, normalization=normalization)
    assert tr.field_names == ["density", "pressure", "velocity_x", "velocity_y"]
    assert tr.constant_field_names == ["obstacle", "profile"]
    n = 0
    for b in delivered(lay, tr):
        assert set(b) == {"index", "weight", "input_fields", "output_fields", "constant_fields", "constant_scalars",
                          "input_scalars", "output_scalars", "boundary_conditions", "space_grid",
                          "input_time_grid", "output_time_grid"}
        for j, i in enumerate(b["index"].tolist()):
            want = expected(out, i, fields, table, n_in, n_out, dt, normalization)
            for k, v in want.items():
                got = b[k][j].numpy()
                assert got.dtype == v.dtype and got.shape == v.shape, (k, got.dtype, v.dtype, got.shape, v.shape)
                np.testing.assert_array_equal(got, v, err_msg=f"{k} of window {i}")
            n += 1
    assert n == lay.n_samples


def test_transform_takes_numpy_batches_and_leaves_the_batch_alone(well):
    lay = layout_of(well, 2, 1, 2)
    sched = solar.plan(lay, world_size=1, local_batch=4, epochs=1, buffer_fraction=0.95)
    tr = WellTransform(lay, normalization="zscore")
    with SolarLoader(sched, lay, rank=0, as_torch=False, abort_on_error=False) as loader:
        raw = next(iter(loader))
        keep = {k: v.copy() for k, v in raw.items() if isinstance(v, np.ndarray)}
        got = tr(raw)
    ref = tr({k: torch.from_numpy(v) for k, v in keep.items()})
    for k, v in keep.items():
        np.testing.assert_array_equal(raw[k], v)  # normalising did not write into the loader's arrays
    for k in ("input_fields", "output_fields", "space_grid", "boundary_conditions"):
        assert torch.equal(got[k], ref[k]), k
    assert got["input_fields"].shape == (4, 2, SIZE, 3 * SIZE, 4)


def test_stats_yaml_is_found_where_the_well_keeps_it(well):
    assert find_stats(train_files(well)) == os.path.join(well, WELL_NAME, "stats.yaml")
    tr = WellTransform(layout_of(well, 4, 1, 1), normalization="zscore")
    assert tr.stats_path == os.path.join(well, WELL_NAME, "stats.yaml")


# ------------------------------------------------------------------ what is refused
def test_normalisation_without_stats_yaml_is_refused(tmp_path, well):
    out = str(tmp_path / "w")
    shutil.copytree(well, out)
    os.remove(os.path.join(out, WELL_NAME, "stats.yaml"))
    lay = layout_of(out, 4, 1, 1)
    with pytest.raises(LayoutError, match="normalization='zscore' needs The Well's stats.yaml.*pass stats=PATH"):
        WellTransform(lay, normalization="zscore")
    assert "input_fields" in WellTransform(lay)(delivered(lay)[0])  # no normalisation asked: fine
    bad = tmp_path / "stats.yaml"
    bad.write_text("mean:\n  density: 1.0\n  velocity: [0.0, 0.0]\nstd:\n  density: 2.0\n  velocity: [1.0, 1.0]\n")
    with pytest.raises(LayoutError, match=r"stats.yaml has no 'mean' for field 'pressure'"):
        WellTransform(lay, normalization="zscore", stats=str(bad))
    bad.write_text("mean:\n  density: 1.0\n  pressure: 1.0\n  velocity: [0.0, 0.0, 0.0]\n"
                   "std:\n  density: 1.0\n  pressure: 1.0\n  velocity: [1.0, 1.0, 1.0]\n")
    with pytest.raises(LayoutError, match=r"mean of 'velocity' has shape \(3,\), not one value per component \(2,\)"):
        WellTransform(lay, normalization="zscore", stats=str(bad))


def test_bad_options_and_foreign_batches_are_refused(well, tmp_path):
    lay = layout_of(well, 4, 1, 1)
    with pytest.raises(SpecError, match="normalization must be None, 'zscore' or 'rms', got 'minmax'"):
        WellTransform(lay, normalization="minmax")
    ptycho = make_dataset(tmp_path, "ptychonn")
    with pytest.raises(SpecError, match="WellTransform needs a 'windows' layout .*not 'rows'"):
        WellTransform(ptycho)
    with pytest.raises(SpecError, match=r"leaves out t0_fields/pressure of .*all_fields=False"):
        WellTransform(layout_of(well, 4, 1, 1, ("t0_fields/density", "t1_fields/velocity")))
    part = WellTransform(layout_of(well, 4, 1, 1, ("t1_fields/velocity", "t0_fields/density")), all_fields=False)
    assert part.field_names == ["density", "velocity_x", "velocity_y"]  # The Well's order, not the spec's
    tr = WellTransform(lay)
    other = delivered(layout_of(well, 2, 1, 2))[0]
    with pytest.raises(SpecError, match=r"has batch shape \(3, 3, 8, 24\), expected \(3, 5, 8, 24\): not a batch"):
        tr(other)
    with pytest.raises(SpecError, match="batch index 999 is not a sample of the layout"):
        tr({**other, "index": torch.tensor([999])})


# ------------------------------------------------------------------ stats.yaml without PyYAML
def test_stats_reader_without_pyyaml_reads_block_and_flow_styles():
    text = ("# The Well\nmean:\n  density: 1.0E+00\n  velocity:\n  - -2.5e-3\n  - 4\n  stress:\n  - - 1.0\n    - 2.0\n"
            "  -   - 3.0\n      - .inf\nstd: {density: 2.0, velocity: [1.0, 1_000.0]}\n"
            "rms:\n  velocity: [1.0, [2.0, 3.0]]\n")
    assert parse_stats(text) == {"mean": {"density": 1.0, "velocity": [-0.0025, 4],
                                          "stress": [[1.0, 2.0], [3.0, float("inf")]]},
                                 "std": {"density": 2.0, "velocity": [1.0, 1000.0]},
                                 "rms": {"velocity": [1.0, [2.0, 3.0]]}}
    with pytest.raises(LayoutError, match=r"stats.yaml:2: 'one' is not a number"):
        parse_stats("mean:\n  density: one\n")


@pytest.mark.skipif(importlib.util.find_spec("yaml") is None, reason="PyYAML not installed")
def test_stats_reader_equals_pyyaml(well):
    import yaml
    with open(os.path.join(well, WELL_NAME, "stats.yaml")) as fh:
        text = fh.read()
    assert parse_stats(text) == yaml.safe_load(text)
    table = {"mean": {"a": 1.5, "v": [0.1, -2e-12], "s": [[1.0, 2.0], [3.0, 4.0]]}, "std": {"a": 3}}
    for kw in ({}, {"default_flow_style": None}, {"indent": 4}):
        dumped = yaml.dump(table, **kw)
        assert parse_stats(dumped) == yaml.safe_load(dumped) == table, dumped


# ------------------------------------------------------------------ the real package, when installed
@pytest.fixture(scope="module")
def rich_well(tmp_path_factory, well):
    """Like ``rich`` without ``profile`` (WellDataset tiles a field that omits an axis into a wrong shape)."""
    out = str(tmp_path_factory.mktemp("richwell") / "w")
    shutil.copytree(well, out)
    for k, p in enumerate(train_files(out)):
        add_extras(p, k, profile=False)
    write_stats(os.path.join(out, WELL_NAME, "stats.yaml"), train_files(out), BASE + EXTRA)
    return out, BASE + EXTRA


@pytest.mark.parametrize("data,n_in,n_out,dt,normalization", [
    ("well", 4, 1, 1, None), ("well", 2, 1, 2, "zscore"),
    ("rich_well", 4, 1, 1, "rms"), ("rich_well", 2, 1, 2, "zscore"), ("rich_well", 1, 2, 3, None)])
def test_batches_equal_well_dataset_items(request, data, n_in, n_out, dt, normalization):
    """Bit for bit, same keys and dtypes: WellDataset(min_dt_stride = max_dt_stride = dt)[i]."""
    wd = pytest.importorskip("the_well.data")
    got = request.getfixturevalue(data)
    out, fields = (got, BASE) if data == "well" else got
    kinds = {None: None, "zscore": wd.normalization.ZScoreNormalization, "rms": wd.normalization.RMSNormalization}
    ds = wd.WellDataset(well_base_path=out, well_dataset_name=WELL_NAME, well_split_name="train",
                        n_steps_input=n_in, n_steps_output=n_out, min_dt_stride=dt, max_dt_stride=dt,
                        use_normalization=normalization is not None, normalization_type=kinds[normalization])
    lay = layout_of(out, n_in, n_out, dt, fields)
    assert len(ds) == lay.n_samples
    n = 0
    for b in delivered(lay, WellTransform(lay, normalization=normalization)):
        for j, i in enumerate(b["index"].tolist()):
            item = ds[i]
            assert set(b) - {"index", "weight", "step"} == set(item)
            for k, v in item.items():
                assert b[k][j].dtype == v.dtype and torch.equal(b[k][j], v), (k, i)
            n += 1
    assert n == len(ds)


def test_stats_reader_without_pyyaml_equals_with_it(well, monkeypatch):
    from solar.well import read_stats
    path = os.path.join(well, WELL_NAME, "stats.yaml")
    first = read_stats(path)
    monkeypatch.setitem(__import__("sys").modules, "yaml", None)  # `import yaml` raises ImportError
    assert read_stats(path) == first
    assert set(first) == {"mean", "std", "rms", "mean_delta", "std_delta", "rms_delta"}
    assert len(first["mean"]["velocity"]) == 2


def test_as_the_loaders_transform(well):
    """``SolarLoader(..., transform=WellTransform(layout))``: the same batches as applying it afterwards."""
    import inspect
    if "transform" not in inspect.signature(SolarLoader).parameters:
        pytest.skip("SolarLoader has no transform= hook")
    lay = layout_of(well, 2, 1, 2)
    tr = WellTransform(lay, normalization="zscore")
    sched = solar.plan(lay, world_size=1, local_batch=3, epochs=1, buffer_fraction=0.95)
    with SolarLoader(sched, lay, rank=0, transform=tr, abort_on_error=False) as loader:
        hooked = list(loader)
    after = delivered(lay, tr)
    assert len(hooked) == len(after) == -(-lay.n_samples // 3)
    for a, b in zip(hooked, after):
        assert set(a) == set(b) and torch.equal(a["index"], b["index"])
        for k in ("input_fields", "output_fields", "constant_scalars", "boundary_conditions", "input_time_grid"):
            assert torch.equal(a[k], b[k]), k


def test_a_transform_of_another_layout_is_refused_by_the_loader(well):
    """Review finding: a WellTransform built on one split's layout, given batches of another split, mapped
    the sample ids through the wrong files (wrong scalars, boundary conditions, grids) without an error."""
    from solar.errors import SpecError
    lay, other = layout_of(well, 2, 1, 2), layout_of(well, 1, 1, 1)
    assert lay.fingerprint != other.fingerprint
    sched = solar.plan(lay, world_size=1, local_batch=3, epochs=1, buffer_fraction=0.95)
    with pytest.raises(SpecError, match="WellTransform was built for another layout"):
        SolarLoader(sched, lay, rank=0, transform=WellTransform(other), abort_on_error=False)
