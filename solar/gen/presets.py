"""Synthetic datasets with the real projects' HDF5 layouts (see docs/datasets.md).

Every preset is ``fn(outdir, cfg) -> LayoutSpec``: it writes HDF5 files under
``outdir`` and returns the spec it saved as ``outdir/solar-layout.json``.  Every file
is written under a temporary name and renamed once complete (:mod:`solar.atomic`), so
a full disk, an error or a signal never leaves a half-written file.
Data is seeded per sample, so the same seed gives the same values whatever the
batching, and different samples differ.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import h5py
import numpy as np

from ..atomic import AtomicH5, os_reason, write_atomic
from ..errors import SpecError, WriteError
from ..layout.spec import SPEC_FILENAME, LayoutSpec
from .fields import diffraction, smooth_frames
from .storage import Storage


@dataclass(frozen=True)
class GenConfig:
    """Generator inputs; ``None`` means the preset's realistic default."""

    samples: Optional[int] = None
    seed: int = 0
    size: Optional[int] = None
    steps: Optional[int] = None
    storage: Optional[Storage] = None
    variant: Optional[str] = None
    progress: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("samples", "size", "steps"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise SpecError(f"--{name} must be a positive integer, got {v!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise SpecError(f"--seed must be a non-negative integer, got {self.seed!r}")
        from ..progress import check as check_progress
        check_progress(self.progress)


def _rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([seed, *keys])


def _bar(total: int, desc: str, progress):
    from ..progress import counter
    return counter(total, desc, "sample", progress)


def _storage(cfg: GenConfig, default: Storage) -> Storage:
    return cfg.storage if cfg.storage is not None else default


# --------------------------------------------------------------------- PtychoNN
def gen_ptychonn(outdir: str, cfg: GenConfig) -> LayoutSpec:
    """One file, ``X_train``/``Y_I_train``/``Y_phi_train`` float32 ``[N, S, S, 1]``."""
    n = cfg.samples or 2048
    s = cfg.size or 128
    st = _storage(cfg, Storage())
    path = os.path.join(outdir, "ptychonn.h5")
    names = ("X_train", "Y_I_train", "Y_phi_train")
    with AtomicH5(path) as out, _bar(n, "ptychonn", cfg.progress) as bar:
        f = out.file
        shape = (n, s, s, 1)
        dsets = [f.create_dataset(nm, shape=shape, dtype="f4", **st.kwargs(shape, 1)) for nm in names]
        step = 64
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            batch = np.empty((3, hi - lo, s, s, 1), dtype=np.float32)  # (field, samples, S, S, 1)
            for i in range(lo, hi):
                rng = _rng(cfg.seed, 1, i)
                amp = 1.0 + 0.25 * smooth_frames(rng, (s, s))
                phase = np.pi * np.tanh(smooth_frames(rng, (s, s)))
                batch[0, i - lo, ..., 0] = diffraction(amp, phase)
                batch[1, i - lo, ..., 0] = amp
                batch[2, i - lo, ..., 0] = phase
            for k, d in enumerate(dsets):
                d[lo:hi] = batch[k]
            out.check()
            bar.update(hi - lo)
    spec = LayoutSpec("rows", ("ptychonn.h5",), names, root=outdir, name="ptychonn")
    _save_spec(spec, outdir)
    return spec


# --------------------------------------------------------------------- The Well
WELL_NAME = "turbulent_radiative_layer_2D"  # dataset folder and ``dataset_name`` attribute
WELL_FILE_PREFIX = "turbulent_radiative_layer"  # the real files drop the "_2D": ..._tcool_0.10.hdf5
WELL_PARAMS = (0.03, 0.1)  # tcool values (2 of the real set's 9): one file per value in each split
WELL_FIELDS = ("t0_fields/density", "t0_fields/pressure", "t1_fields/velocity")
WELL_SPLITS = ("train", "valid", "test")  # data/<split>/; the spec names all three (train by default)
WELL_STATS = "stats.yaml"  # next to data/, as The Well ships it; from the train split
WELL_STAT_KEYS = ("mean", "mean_delta", "rms", "rms_delta", "std", "std_delta")


def well_file_name(tcool: float) -> str:
    """The real set's file name for one tcool value: ``turbulent_radiative_layer_tcool_0.10.hdf5``."""
    return f"{WELL_FILE_PREFIX}_tcool_{tcool:.2f}.hdf5"


def _strs(names) -> np.ndarray:
    """A list of names as an HDF5 variable-length string array (read back as ``str``)."""
    return np.array(list(names), dtype=object).astype(h5py.string_dtype())


def _flags(obj, sample_varying: bool, time_varying: bool):
    """The two booleans The Well's format checker requires on every dataset and boundary group."""
    obj.attrs["sample_varying"] = sample_varying
    obj.attrs["time_varying"] = time_varying


def _well_metadata(f: h5py.File, n_traj: int, T: int, nx: int, ny: int, tcool: float):
    """Root attributes, ``dimensions``, ``boundary_conditions`` and ``scalars`` of one file.

    ``dimensions/time`` is ``[T]`` (time-varying), ``x``/``y`` are ``[nx]``/``[ny]`` cell
    coordinates.  Each boundary mask is True on the two edge points of its axis, periodic
    x included, as in the real files (all False would read as no boundary given).
    """
    f.attrs["dataset_name"] = WELL_NAME
    f.attrs["grid_type"] = "cartesian"
    f.attrs["n_spatial_dims"] = 2
    f.attrs["n_trajectories"] = n_traj
    f.attrs["simulation_parameters"] = _strs(["tcool"])
    f.attrs["tcool"] = tcool
    dims = f.create_group("dimensions")
    dims.attrs["spatial_dims"] = _strs(["x", "y"])
    for name, vals in (("time", np.linspace(0, 1, T)), ("x", np.linspace(-0.5, 0.5, nx)),
                       ("y", np.linspace(-1, 2, ny))):
        _flags(dims.create_dataset(name, data=vals.astype(np.float32)), False, name == "time")
    bcs = f.create_group("boundary_conditions")
    for name, kind, dim, n in (("x_periodic", "PERIODIC", "x", nx), ("y_open", "OPEN", "y", ny)):
        g = bcs.create_group(name)
        g.attrs["bc_type"] = kind
        g.attrs["associated_dims"] = _strs([dim])
        g.attrs["associated_fields"] = _strs([])
        _flags(g, False, False)
        mask = np.zeros(n, dtype=bool)
        mask[[0, -1]] = True
        g.create_dataset("mask", data=mask)
    sc = f.create_group("scalars")
    sc.attrs["field_names"] = _strs(["tcool"])
    _flags(sc.create_dataset("tcool", data=np.float32(tcool)), False, False)


def _well_field_datasets(f: h5py.File, n_traj: int, T: int, nx: int, ny: int, st: Storage) -> dict:
    """Empty ``t{0,1,2}_fields`` datasets: ``{WELL_FIELDS name: dataset [B, T, nx, ny(, 2)]}``."""
    groups = {}
    for g, names in (("t0_fields", ["density", "pressure"]), ("t1_fields", ["velocity"]), ("t2_fields", [])):
        groups[g] = f.create_group(g)
        groups[g].attrs["field_names"] = _strs(names)
    dsets = {}
    for name in WELL_FIELDS:
        g, leaf = name.split("/")
        shape = (n_traj, T, nx, ny) + ((2,) if g == "t1_fields" else ())
        d = groups[g].create_dataset(leaf, shape=shape, dtype="f4", **st.kwargs(shape, 2))
        d.attrs["dim_varying"] = np.array([True, True])
        _flags(d, True, True)
        dsets[name] = d
    return dsets


def _well_trajectory(rng: np.random.Generator, T: int, nx: int, ny: int) -> dict:
    """One trajectory: ``{WELL_FIELDS name: float32 (T, nx, ny) or (T, nx, ny, 2)}``."""
    density = np.exp(0.3 * smooth_frames(rng, (nx, ny), T))
    pressure = 1.0 + 0.1 * smooth_frames(rng, (nx, ny), T)
    vel = np.stack([smooth_frames(rng, (nx, ny), T), smooth_frames(rng, (nx, ny), T)], axis=-1)
    return dict(zip(WELL_FIELDS, (density, pressure, vel)))


class _Moments:
    """Count, mean and summed squared deviation of values, per tensor component (float64).

    Batches are merged with Chan et al.'s pairwise update, so the result equals one pass
    over all values (up to rounding) without holding them.
    """

    def __init__(self):
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def add(self, x: np.ndarray, order: int):
        """Fold in ``x``: reduce over every axis but the last ``order`` (0: scalar field, 1: vector)."""
        axes = tuple(range(x.ndim - order))
        n = int(np.prod([x.shape[a] for a in axes]))
        if n == 0:
            return
        mean = x.mean(axis=axes)
        m2 = ((x - mean) ** 2).sum(axis=axes)
        total = self.n + n
        d = mean - self.mean
        self.mean = self.mean + d * (n / total)
        self.m2 = self.m2 + m2 + d * d * (self.n * n / total)
        self.n = total

    def summary(self):
        """``(mean, std, rms)`` with the population variance (divide by the count)."""
        var = self.m2 / self.n
        return self.mean, np.sqrt(var), np.sqrt(var + self.mean ** 2)


class _WellStats:
    """The statistics of The Well's ``stats.yaml`` over the trajectories given to :meth:`add`.

    Per field (leaf name, e.g. ``velocity``) and component: mean, std and rms of the values
    and of the frame-to-frame differences ``x[t+1] - x[t]`` (the ``*_delta`` keys), over
    trajectories, time and space.
    """

    def __init__(self):
        self.values = {name: _Moments() for name in WELL_FIELDS}
        self.deltas = {name: _Moments() for name in WELL_FIELDS}

    def add(self, frames: dict):
        """Fold in one trajectory, as :func:`_well_trajectory` returns it."""
        for name, x in frames.items():
            order = int(name[1])  # t0_fields: scalar, t1_fields: vector
            x = x.astype(np.float64)
            self.values[name].add(x, order)
            self.deltas[name].add(x[1:] - x[:-1], order)

    def table(self) -> dict:
        """``{key: {field: float or [float per component]}}`` for each of :data:`WELL_STAT_KEYS`."""
        out = {k: {} for k in WELL_STAT_KEYS}
        for suffix, moments in (("", self.values), ("_delta", self.deltas)):
            for name, m in moments.items():
                leaf = name.split("/")[1]
                for key, v in zip(("mean", "std", "rms"), m.summary()):
                    out[key + suffix][leaf] = np.asarray(v).tolist()
        return out


def _yaml_float(v: float) -> str:
    """17 significant digits (exact round trip), with the dot and signed exponent YAML 1.1 needs."""
    return f"{v:.16E}"


def well_stats_yaml(table: dict) -> str:
    """``stats.yaml`` text in The Well's layout: a block mapping per key, a list for vector fields."""
    lines = []
    for key in WELL_STAT_KEYS:
        lines.append(f"{key}:")
        for field_name, v in table[key].items():
            if isinstance(v, list):
                lines.append(f"  {field_name}:")
                lines.extend(f"  - {_yaml_float(c)}" for c in v)
            else:
                lines.append(f"  {field_name}: {_yaml_float(v)}")
    return "\n".join(lines) + "\n"


def _write_text(path: str, text: str):
    """``text`` as UTF-8 into ``path`` (a temporary name given by :func:`write_atomic`)."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def _write_well_file(path: str, n_traj: int, T: int, nx: int, ny: int, tcool: float, st: Storage,
                     seed: int, file_key: int, bar, stats: Optional[_WellStats] = None):
    """One file of ``n_traj`` trajectories; each is also folded into ``stats`` when given."""
    with AtomicH5(path) as out:
        f = out.file
        _well_metadata(f, n_traj, T, nx, ny, tcool)
        dsets = _well_field_datasets(f, n_traj, T, nx, ny, st)
        for b in range(n_traj):
            frames = _well_trajectory(_rng(seed, 2, file_key, b), T, nx, ny)
            for name, d in dsets.items():
                d[b] = frames[name]
            if stats is not None:
                stats.add(frames)
            out.check()
            bar.update(1)


#: Frames of one sample of the well preset's spec (``n_steps_input`` 4 + ``n_steps_output`` 1, dt 1).
WELL_WINDOW = 5


def gen_well(outdir: str, cfg: GenConfig) -> LayoutSpec:
    """The Well: ``{name}/data/{train,valid,test}/turbulent_radiative_layer_tcool_{p:.2f}.hdf5``,
    one file per parameter, and ``{name}/stats.yaml`` computed over the train split.  The spec
    names the three splits (``solar plan --split valid``); it describes ``train`` by default.

    ``samples`` = trajectories per train file (valid/test get a quarter, at least 1);
    ``steps`` = frames per trajectory, at least :data:`WELL_WINDOW` (the spec's windows of 4 + 1 frames).
    """
    n_traj = cfg.samples or 4
    T = cfg.steps or 101
    if T < WELL_WINDOW:
        raise SpecError(f"well needs --steps of at least {WELL_WINDOW} (the spec's samples are windows of "
                        f"{WELL_WINDOW - 1} input frames and 1 output frame), got {T}")
    nx = cfg.size or 128
    ny = 3 * nx
    st = _storage(cfg, Storage())
    n_small = max(1, n_traj // 4)
    jobs = []
    for split, nt in zip(WELL_SPLITS, (n_traj, n_small, n_small)):
        folder = os.path.join(outdir, WELL_NAME, "data", split)
        _makedirs(folder)
        for tcool in WELL_PARAMS:
            jobs.append((os.path.join(folder, well_file_name(tcool)), nt, tcool, len(jobs), split == "train"))
    stats = _WellStats()
    with _bar(sum(j[1] for j in jobs), "well (trajectories)", cfg.progress) as bar:
        for path, nt, tcool, key, train in jobs:
            _write_well_file(path, nt, T, nx, ny, tcool, st, cfg.seed, key, bar, stats if train else None)
    text = well_stats_yaml(stats.table())
    write_atomic(os.path.join(outdir, WELL_NAME, WELL_STATS), lambda tmp: _write_text(tmp, text))
    splits = {split: (f"{WELL_NAME}/data/{split}/*.hdf5",) for split in WELL_SPLITS}
    spec = LayoutSpec("windows", (), WELL_FIELDS, root=outdir, n_steps_input=WELL_WINDOW - 1, n_steps_output=1, dt=1,
                      name="well", splits=splits)
    _save_spec(spec, outdir)
    return spec


# --------------------------------------------------------------------- PDEBench
PDE_SINGLE = "2D_CFD_Rand_M0.1_Eta0.01_Zeta0.01_periodic_Train.hdf5"
PDE_MULT = "2D_diff-react_NA_NA.h5"


def gen_pdebench(outdir: str, cfg: GenConfig) -> LayoutSpec:
    """PDEBench: ``single`` (root density/pressure/Vx/Vy ``[N, T, X, Y]``) or ``mult`` (group per seed)."""
    variant = cfg.variant or "single"
    if variant not in ("single", "mult"):
        raise SpecError(f"pdebench variant must be 'single' or 'mult', got {variant!r}")
    s = cfg.size or 128
    if variant == "single":
        n, T = cfg.samples or 100, cfg.steps or 21
        st = _storage(cfg, Storage())
        names = ("density", "pressure", "Vx", "Vy")
        with AtomicH5(os.path.join(outdir, PDE_SINGLE)) as out, _bar(n, "pdebench single", cfg.progress) as bar:
            f = out.file
            shape = (n, T, s, s)
            dsets = [f.create_dataset(nm, shape=shape, dtype="f4", **st.kwargs(shape, 1)) for nm in names]
            grid = np.linspace(0, 1, s, endpoint=False, dtype=np.float32) + 0.5 / s
            f.create_dataset("x-coordinate", data=grid)
            f.create_dataset("y-coordinate", data=grid)
            f.create_dataset("t-coordinate", data=np.linspace(0, 1, T + 1, dtype=np.float32))
            for i in range(n):
                rng = _rng(cfg.seed, 3, i)
                dsets[0][i] = np.exp(0.2 * smooth_frames(rng, (s, s), T))
                dsets[1][i] = 1.0 + 0.1 * smooth_frames(rng, (s, s), T)
                dsets[2][i] = 0.1 * smooth_frames(rng, (s, s), T)
                dsets[3][i] = 0.1 * smooth_frames(rng, (s, s), T)
                out.check()
                bar.update(1)
        spec = LayoutSpec("rows", (PDE_SINGLE,), names, root=outdir, name="pdebench-single")
    else:
        n, T = cfg.samples or 50, cfg.steps or 101
        st = _storage(cfg, Storage(chunk_samples=1, compression="lzf"))
        with AtomicH5(os.path.join(outdir, PDE_MULT)) as out, _bar(n, "pdebench mult", cfg.progress) as bar:
            f = out.file
            for i in range(n):
                rng = _rng(cfg.seed, 4, i)
                g = f.create_group(f"{i:04d}")
                data = np.stack([smooth_frames(rng, (s, s), T), smooth_frames(rng, (s, s), T)], axis=-1)
                g.create_dataset("data", data=data, **st.kwargs(data.shape, 0))  # (T, X, Y, 2)
                grid = g.create_group("grid")
                grid.create_dataset("x", data=np.linspace(-1, 1, s, dtype=np.float32))
                grid.create_dataset("y", data=np.linspace(-1, 1, s, dtype=np.float32))
                grid.create_dataset("t", data=np.linspace(0, 5, T, dtype=np.float32))
                out.check()
                bar.update(1)
        spec = LayoutSpec("whole", (PDE_MULT,), ("data",), root=outdir, groups="*", name="pdebench-mult")
    _save_spec(spec, outdir)
    return spec


# -------------------------------------------------------------------- CosmoFlow
def gen_cosmoflow(outdir: str, cfg: GenConfig) -> LayoutSpec:
    """One file per sample: ``full`` int16 ``[S, S, S, 4]`` particle counts, ``unitPar`` f32 ``[4]``."""
    n = cfg.samples or 32
    s = cfg.size or 128
    st = _storage(cfg, Storage())
    with _bar(n, "cosmoflow", cfg.progress) as bar:
        for i in range(n):
            rng = _rng(cfg.seed, 5, i)
            full = np.empty((s, s, s, 4), dtype=np.int16)
            for c in range(4):  # redshift channels: log-normal densities as particle counts
                dens = np.exp(0.8 * smooth_frames(rng, (s, s, s)) + 0.5 * c / 4)
                full[..., c] = np.minimum(np.floor(3.0 * dens), 32767).astype(np.int16)
            with AtomicH5(os.path.join(outdir, f"univ_{i:05d}.hdf5")) as out:
                out.file.create_dataset("full", data=full, **st.kwargs(full.shape, 0))
                out.file.create_dataset("unitPar", data=rng.uniform(-1, 1, 4).astype(np.float32))
            bar.update(1)
    spec = LayoutSpec("whole", ("univ_*.hdf5",), ("full", "unitPar"), root=outdir, name="cosmoflow")
    _save_spec(spec, outdir)
    return spec


PRESETS = {"ptychonn": gen_ptychonn, "well": gen_well, "pdebench": gen_pdebench, "cosmoflow": gen_cosmoflow}


def generate(preset: str, outdir: str, cfg: GenConfig = GenConfig()) -> LayoutSpec:
    """Write preset ``preset`` into ``outdir`` (created) and return its saved spec."""
    if preset not in PRESETS:
        raise SpecError(f"unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    _makedirs(outdir)
    return PRESETS[preset](os.path.abspath(outdir), cfg)


def _makedirs(folder: str):
    """``os.makedirs(folder, exist_ok=True)``; :class:`WriteError` naming the folder and the OS reason."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise WriteError(f"cannot create output folder {folder}: {os_reason(exc)}") from None


def _save_spec(spec: LayoutSpec, outdir: str):
    """``outdir/solar-layout.json`` through a temporary name: it appears complete or not at all."""
    write_atomic(os.path.join(outdir, SPEC_FILENAME), spec.save)
