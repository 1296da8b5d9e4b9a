"""``WellTransform``: a solar batch of a The Well ``windows`` layout, as The Well's models take it.

``the_well.data.WellDataset`` gives one window as a dict (``Ti``/``To`` input/output
frames, ``H x W [x D]`` spatial axes, ``C`` channels: every field's tensor components,
flattened and stacked on the last axis in the file's ``t0_fields``, ``t1_fields``,
``t2_fields`` order):

=====================  ======================  ========================================
key                    shape                   what
=====================  ======================  ========================================
``input_fields``       (Ti, H, W, C)           the window's first ``n_steps_input`` frames
``output_fields``      (To, H, W, C)           its last ``n_steps_output`` frames
``constant_fields``    (H, W, Cc)              fields without a time axis
``input_scalars``      (Ti, Cs)                time-varying ``scalars/`` at the input frames
``output_scalars``     (To, Cs)                ... at the output frames
``constant_scalars``   (Ccs,)                  the other ``scalars/`` (per file or trajectory)
``boundary_conditions`` (ndim, 2)              per axis and end: WALL 0, OPEN 1, PERIODIC 2
``space_grid``         (H, W, ndim)            cell coordinates
``input_time_grid``    (Ti,)                   frame times, relative to the window's first
``output_time_grid``   (To,)
=====================  ======================  ========================================

and leaves out a key whose tensor is empty.  ``WellTransform(layout)(batch)`` returns the
same keys with a leading batch axis ``n`` (what ``DataLoader`` collation of ``n`` items
gives), plus the batch's ``index``, ``weight`` and ``step``; the raw field entries are
replaced.  Normalisation, when asked for, is WellDataset's: per field, before flattening,
``(x - mean) / max(std, 1e-4)`` (``"zscore"``) or ``x / max(rms, 1e-4)`` (``"rms"``), with the
statistics of ``stats.yaml`` as float32 tensors.
"""
from __future__ import annotations

import math
import os
from typing import Dict, List, Optional

import numpy as np

from ..errors import LayoutError, SpecError
from ..io.h5open import open_readonly
from .meta import FileInfoCache, WellField, WellFileInfo, read_field
from .stats import find_stats, read_stats

NORMALIZATIONS = {"zscore": ("mean", "std"), "rms": (None, "rms")}
"""``normalization=`` name -> (stats key subtracted or None, stats key divided by)."""
MIN_DENOM = 1e-4
"""Smallest divisor (The Well's ``min_denom``): a near-constant field is not blown up."""


def _as_tensor(x):
    import torch
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))


class WellTransform:
    """``batch dict -> batch dict``: a solar batch of a The Well window layout in WellDataset's format.

    ``layout``: the :class:`~solar.layout.Layout` the batches come from (``loader.layout``)
    or its spec path; its kind must be ``windows`` and its fields The Well's
    ``t{0,1,2}_fields/NAME`` datasets.  ``normalization``: None, ``"zscore"`` or ``"rms"``
    from ``stats`` (a ``stats.yaml`` path; default: the one The Well keeps next to the
    data, see :func:`~solar.well.find_stats`).  ``all_fields`` (default True): refuse a
    layout that leaves out a field of the files, since WellDataset's channels would then
    differ.  ``return_grid``: add ``space_grid`` and the time grids, as WellDataset does
    by default.  Window sizes and stride are the layout's (``n_steps_input``,
    ``n_steps_output``, ``dt``: WellDataset's ``min_dt_stride = max_dt_stride = dt``).
    """

    def __init__(self, layout, *, normalization: Optional[str] = None, stats: Optional[str] = None,
                 all_fields: bool = True, return_grid: bool = True):
        if isinstance(layout, str):
            from ..layout import load_layout
            layout = load_layout(layout)
        if layout.spec.kind != "windows":
            raise SpecError(f"WellTransform needs a 'windows' layout (The Well), not {layout.spec.kind!r}")
        if normalization is not None and normalization not in NORMALIZATIONS:
            raise SpecError(f"normalization must be None, 'zscore' or 'rms', got {normalization!r}")
        self.layout = layout
        self.fingerprint = layout.fingerprint
        self.n_steps_input = layout.spec.n_steps_input
        self.n_steps_output = layout.spec.n_steps_output
        self.dt = layout.spec.dt
        self.return_grid = bool(return_grid)
        self._info = FileInfoCache()
        first = self._path(0)
        info = self._info(first)
        self.spatial_resolution = info.spatial
        self.n_spatial_dims = len(info.spatial)
        fields = self._read_fields(first, info, all_fields)
        self.variable = [f for f in fields if f.time_varying]
        self.constant = [f for f in fields if not f.time_varying]
        self.field_names = [c for f in self.variable for c in f.channel_names(list(info.spatial_dims))]
        self.constant_field_names = [c for f in self.constant for c in f.channel_names(list(info.spatial_dims))]
        self.normalization = normalization
        self.stats_path = None
        self._scale: Dict[str, tuple] = {}
        if normalization is not None:
            self._load_scales(normalization, stats, fields)

    # ------------------------------------------------------------ set-up
    def _path(self, source: int) -> str:
        """The file of source ``source`` (where The Well's metadata groups are)."""
        return self.layout.files[self.layout.sources[source].file]

    def _read_fields(self, path: str, info: WellFileInfo, all_fields: bool) -> List[WellField]:
        """The layout's fields, in The Well's channel order (tensor order, then ``field_names``)."""
        with open_readonly(path) as f:
            fields = [read_field(f, name, path, list(info.spatial_dims)) for name in self.layout.spec.fields]
        for fld in fields:
            if fld.leaf not in info.fields[fld.order]:
                raise LayoutError(f"field {fld.path!r} is not in t{fld.order}_fields' field_names of "
                                  f"{os.path.basename(path)}: WellDataset would not load it")
        if all_fields:
            have = {(f.order, f.leaf) for f in fields}
            left = [f"t{k}_fields/{n}" for k, names in info.fields.items() for n in names if (k, n) not in have]
            if left:
                raise SpecError(f"the layout leaves out {', '.join(left)} of {os.path.basename(path)}: WellDataset's "
                                f"channels include them (add them to the spec's fields, or all_fields=False)")
        return sorted(fields, key=lambda f: (f.order, info.fields[f.order].index(f.leaf)))

    def _load_scales(self, normalization: str, stats: Optional[str], fields: List[WellField]):
        """``{field path: (shift or None, divisor)}`` float32 tensors from ``stats.yaml``."""
        import torch
        path = stats if stats is not None else find_stats(self._path(s) for s in range(len(self.layout.sources)))
        if path is None:
            raise LayoutError(f"normalization={normalization!r} needs The Well's stats.yaml: none next to "
                              f"{os.path.dirname(self._path(0))} or two folders up (pass stats=PATH)")
        table = read_stats(path)
        self.stats_path = path
        shift_key, div_key = NORMALIZATIONS[normalization]
        for fld in fields:
            vals = []
            for key in (shift_key, div_key):
                if key is None:
                    vals.append(None)
                    continue
                if fld.leaf not in (table.get(key) or {}):
                    raise LayoutError(f"{path} has no {key!r} for field {fld.leaf!r}")
                t = torch.as_tensor(table[key][fld.leaf])
                if tuple(t.shape) not in ((), (self.n_spatial_dims,) * fld.order):
                    raise LayoutError(f"{path}: {key} of {fld.leaf!r} has shape {tuple(t.shape)}, not one value per "
                                      f"component {(self.n_spatial_dims,) * fld.order}")
                vals.append(torch.clip(t, min=MIN_DENOM) if key == div_key else t)
            self._scale[fld.path] = tuple(vals)

    # ------------------------------------------------------------ batches
    def bind_layout(self, layout) -> None:
        """Called by ``SolarLoader(transform=...)`` with the layout its batches come from: sample ids map to
        files and trajectories through this transform's layout, so the two must be the same (a layout of
        another split or other files would give wrong scalars, boundary conditions and grids, silently).  The
        loader's layout may be this one cut into parts of chunks (:mod:`solar.layout.parts`: the same samples)."""
        if layout.fingerprint != self.fingerprint and not self._same_parts(layout):
            raise SpecError(f"WellTransform was built for another layout ({self.layout.spec.name or 'fingerprint'} "
                            f"{self.fingerprint}) than the loader's ({layout.fingerprint}): build it with "
                            f"WellTransform(loader.layout) or the same split")

    def _same_parts(self, layout) -> bool:
        from ..layout.parts import is_parts, split_chunks
        if not is_parts(layout) or is_parts(self.layout):
            return False
        cut = split_chunks(self.layout)
        return cut is not None and cut.fingerprint == layout.fingerprint

    def __call__(self, batch: dict) -> dict:
        """The batch in WellDataset's format (module docstring); ``batch`` is not modified."""
        import torch
        if "index" not in batch:
            raise SpecError("the batch has no 'index' (sample ids): not a solar batch")
        index = batch["index"]
        index = np.asarray(index.cpu() if isinstance(index, torch.Tensor) else index, dtype=np.int64).reshape(-1)
        files, traj, t0 = self._coords(index)
        out = {k: v for k, v in batch.items() if k not in self.layout.spec.fields}
        if self.variable:
            v = torch.cat([self._channels(batch, f, len(index)) for f in self.variable], dim=-1)
            out["input_fields"], out["output_fields"] = v[:, :self.n_steps_input], v[:, self.n_steps_input:]
        if self.constant:
            out["constant_fields"] = torch.cat([self._channels(batch, f, len(index)) for f in self.constant], dim=-1)
        out.update(self._scalars(files, traj, t0))
        out["boundary_conditions"] = torch.stack([torch.from_numpy(self._info(p).bc) for p in files]) \
            if len(files) else torch.empty((0, self.n_spatial_dims, 2))
        if self.return_grid:
            out.update(self._grids(files, traj, t0))
        return {k: v for k, v in out.items() if not isinstance(v, torch.Tensor) or k in batch
                or math.prod(v.shape[1:]) > 0}

    def _coords(self, index: np.ndarray):
        """Per sample: its file path, trajectory and first frame (lists of length n)."""
        lay = self.layout
        bad = (index < 0) | (index >= lay.n_samples)
        if bad.any():
            raise SpecError(f"batch index {int(index[bad][0])} is not a sample of the layout "
                            f"(0..{lay.n_samples - 1}): not a batch of this layout")
        src = np.searchsorted(lay.source_start, index, side="right") - 1
        traj = np.empty_like(index)
        t0 = np.empty_like(index)
        for s in np.unique(src).tolist():
            sel = src == s
            traj[sel], t0[sel] = lay.sources[s].coords(index[sel] - lay.source_start[s])
        return [self._path(s) for s in src.tolist()], traj.tolist(), t0.tolist()

    def _channels(self, batch: dict, fld: WellField, n: int):
        """One field as (n, [window,] *spatial, components): normalised, repeated along the
        axes it does not vary on, tensor components flattened into the last axis."""
        if fld.path not in batch:
            raise SpecError(f"the batch has no field {fld.path!r}: not a batch of this layout")
        x = _as_tensor(batch[fld.path])
        lead = (n, self.n_steps_input + self.n_steps_output) if fld.time_varying else (n,)
        used = tuple(s for s, on in zip(self.spatial_resolution, fld.dim_varying) if on)
        tensor = (self.n_spatial_dims,) * fld.order
        if tuple(x.shape) != lead + used + tensor:
            raise SpecError(f"field {fld.path!r} has batch shape {tuple(x.shape)}, expected {lead + used + tensor}: "
                            f"not a batch of this layout")
        if fld.path in self._scale:
            shift, div = self._scale[fld.path]
            x = (x - shift) / div if shift is not None else x / div
        if not all(fld.dim_varying):
            ones = tuple(s if on else 1 for s, on in zip(self.spatial_resolution, fld.dim_varying))
            x = x.reshape(lead + ones + tensor).expand(lead + self.spatial_resolution + tensor)
        return x.unsqueeze(-1).flatten(-fld.order - 1)

    def _scalars(self, files: List[str], traj: List[int], t0: List[int]) -> dict:
        """``constant_scalars`` (n, Ccs) and ``input_scalars`` / ``output_scalars`` (n, T, Cs)."""
        import torch
        const, var = [], []
        for p, b, t in zip(files, traj, t0):
            info = self._info(p)
            c, v = [], []
            for name, arr in info.scalars.items():
                sample_varying, time_varying = info.scalar_roles[name]
                val = arr[b] if sample_varying else arr
                if time_varying:
                    v.append(torch.as_tensor(val[self._frames(t)]).unsqueeze(-1))
                else:
                    c.append(torch.as_tensor(val).unsqueeze(-1))
            const.append(torch.cat(c, -1) if c else torch.empty(0))
            var.append(torch.cat(v, -1) if v else torch.empty((self.n_steps_input + self.n_steps_output, 0)))
        if not files:
            return {}
        series = torch.stack(var)
        return {"constant_scalars": torch.stack(const), "input_scalars": series[:, :self.n_steps_input],
                "output_scalars": series[:, self.n_steps_input:]}

    def _frames(self, t0: int) -> slice:
        """The window's frames of a trajectory that starts at ``t0``: stride ``dt``."""
        return slice(t0, t0 + self.dt * (self.n_steps_input + self.n_steps_output - 1) + 1, self.dt)

    def _grids(self, files: List[str], traj: List[int], t0: List[int]) -> dict:
        """``space_grid`` (n, *spatial, ndim) and the window's relative ``input/output_time_grid`` (n, T)."""
        import torch
        space, times = [], []
        for p, b, t in zip(files, traj, t0):
            info = self._info(p)
            axes = [torch.as_tensor(c[b] if per else c) for c, per in zip(info.coords, info.coords_sample_varying)]
            space.append(torch.stack(torch.meshgrid(*axes, indexing="ij"), -1))
            tg = torch.as_tensor(info.time[b] if info.time_sample_varying else info.time)[self._frames(t)]
            times.append(tg - tg.min())
        if not files:
            return {}
        grid = torch.stack(times)
        return {"space_grid": torch.stack(space), "input_time_grid": grid[:, :self.n_steps_input],
                "output_time_grid": grid[:, self.n_steps_input:]}
