"""What a The Well file says besides its fields: field roles, scalars, boundary conditions, grids.

Read with h5py from the attributes and small datasets The Well's format defines
(``t{0,1,2}_fields`` with ``field_names``, ``time_varying``, ``sample_varying``,
``dim_varying``; ``scalars/``; ``boundary_conditions/*/mask``; ``dimensions/``), with
the semantics of ``the_well.data.WellDataset``.  Any missing piece is a LayoutError
naming the file and the object.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import h5py
import numpy as np

from ..errors import LayoutError
from ..io.h5open import open_readonly

BC_CODES = {"WALL": 0, "OPEN": 1, "PERIODIC": 2}
"""The Well's padding codes (``the_well.data.datasets.BoundaryCondition``); OPEN where no mask says otherwise."""
ORDERS = 3
"""Tensor orders of The Well's field groups ``t0_fields`` .. ``t2_fields``."""


def _attr(obj, name: str, path: str):
    if name not in obj.attrs:
        raise LayoutError(f"{os.path.basename(path)}:{obj.name} lacks The Well's {name!r} attribute")
    value = obj.attrs[name]
    return value.decode() if isinstance(value, bytes) else value


def _names(obj, name: str, path: str) -> List[str]:
    """A list-of-names attribute (``field_names``, ``spatial_dims``, ``associated_dims``) as ``str``."""
    return [n.decode() if isinstance(n, bytes) else str(n) for n in np.atleast_1d(_attr(obj, name, path))]


def _get(f: h5py.File, name: str, path: str):
    if name not in f:
        raise LayoutError(f"{os.path.basename(path)} has no {name!r} (not a The Well file?)")
    return f[name]


@dataclass(frozen=True)
class WellField:
    """One field as The Well stores it: ``t{order}_fields/{leaf}``.

    ``dim_varying[i]``: the field has spatial axis ``i`` (else it is constant along it
    and The Well repeats it); ``time_varying``: it has a time axis (a variable field,
    else a constant field).
    """

    path: str
    leaf: str
    order: int
    time_varying: bool
    dim_varying: Tuple[bool, ...]

    def channel_names(self, spatial_dims: List[str]) -> List[str]:
        """WellDataset's channel names: ``velocity_x``, ``velocity_y`` for a vector in x, y."""
        return [f"{self.leaf}_{''.join(d)}" if d else self.leaf
                for d in itertools.product(spatial_dims, repeat=self.order)]


@dataclass(frozen=True)
class WellFileInfo:
    """Everything of one file that a window needs besides its field values.

    Shapes (B trajectories, T steps, ndim spatial axes of sizes ``spatial``):
    ``scalars``: ``{name: array ()/(B,)/(T,)/(B, T)}`` with ``scalar_roles[name]`` =
    ``(sample_varying, time_varying)``; ``bc``: float32 (ndim, 2) padding codes;
    ``time``: (T,) or (B, T); ``coords``: per spatial axis, (n,) or (B, n).
    """

    spatial_dims: Tuple[str, ...]
    spatial: Tuple[int, ...]
    fields: Dict[int, List[str]]  # order -> leaf names, in the file's field_names order
    scalars: Dict[str, np.ndarray]
    scalar_roles: Dict[str, Tuple[bool, bool]]
    bc: np.ndarray
    time: np.ndarray
    time_sample_varying: bool
    coords: Tuple[np.ndarray, ...]
    coords_sample_varying: Tuple[bool, ...]


def read_field(f: h5py.File, name: str, path: str, spatial_dims: List[str]) -> WellField:
    """The :class:`WellField` of dataset ``name`` (``t{k}_fields/leaf``); a LayoutError for anything else."""
    group, _, leaf = name.strip("/").rpartition("/")
    if group not in {f"t{k}_fields" for k in range(ORDERS)}:
        raise LayoutError(f"field {name!r} of {os.path.basename(path)} is not in The Well's t0_fields, t1_fields "
                          f"or t2_fields group")
    dset = _get(f, name, path)
    flags = tuple(bool(v) for v in np.atleast_1d(_attr(dset, "dim_varying", path)))
    if len(flags) != len(spatial_dims):
        raise LayoutError(f"{os.path.basename(path)}:{dset.name} has {len(flags)} dim_varying flags for "
                          f"{len(spatial_dims)} spatial axes")
    return WellField(name, leaf, int(group[1]), bool(_attr(dset, "time_varying", path)), flags)


def _scalars(f: h5py.File, path: str):
    group = _get(f, "scalars", path)
    values, roles = {}, {}
    for name in _names(group, "field_names", path):
        d = _get(f, f"scalars/{name}", path)
        roles[name] = (bool(_attr(d, "sample_varying", path)), bool(_attr(d, "time_varying", path)))
        values[name] = d[()]
    return values, roles


def boundary_codes(f: h5py.File, path: str, spatial_dims: List[str]) -> np.ndarray:
    """float32 (ndim, 2): each axis' code at its first and last index (WellDataset's ``padding``).

    A mask marks boundary points; an axis end takes a group's ``bc_type`` when any
    point of its mask there is set (WALL: when all are), else stays OPEN.
    """
    out = np.full((len(spatial_dims), 2), BC_CODES["OPEN"], dtype=np.float32)
    group = _get(f, "boundary_conditions", path)
    for name in group:
        bc = group[name]
        kind = str(_attr(bc, "bc_type", path)).upper()
        if kind not in BC_CODES:
            raise LayoutError(f"{os.path.basename(path)}:{bc.name} has bc_type {kind!r}; The Well knows "
                              f"{', '.join(BC_CODES)}")
        assoc = _names(bc, "associated_dims", path)
        mask = np.asarray(_get(f, f"{bc.name}/mask", path)[()], dtype=bool)
        agg = np.min if kind == "WALL" else np.max
        for dim in assoc:
            if dim not in spatial_dims:
                raise LayoutError(f"{os.path.basename(path)}:{bc.name} names axis {dim!r}, not one of {spatial_dims}")
            ax = assoc.index(dim)
            for end, k in ((0, 0), (-1, 1)):
                if agg(np.take(mask, end, axis=ax)):
                    out[spatial_dims.index(dim), k] = BC_CODES[kind]
    return out


def read_file_info(path: str) -> WellFileInfo:
    """The :class:`WellFileInfo` of one The Well file."""
    with open_readonly(path) as f:
        dims = _get(f, "dimensions", path)
        spatial = _names(dims, "spatial_dims", path)
        fields = {k: _names(_get(f, f"t{k}_fields", path), "field_names", path) for k in range(ORDERS)}
        scalars, roles = _scalars(f, path)
        time = _get(f, "dimensions/time", path)
        coords = [_get(f, f"dimensions/{d}", path) for d in spatial]
        return WellFileInfo(
            spatial_dims=tuple(spatial), spatial=tuple(int(c.shape[-1]) for c in coords), fields=fields,
            scalars=scalars, scalar_roles=roles, bc=boundary_codes(f, path, spatial),
            time=time[()], time_sample_varying=bool(_attr(time, "sample_varying", path)),
            coords=tuple(c[()] for c in coords),
            coords_sample_varying=tuple(bool(_attr(c, "sample_varying", path)) for c in coords))


class FileInfoCache:
    """:func:`read_file_info` once per file, on first use."""

    def __init__(self):
        self._infos: Dict[str, WellFileInfo] = {}

    def __call__(self, path: str) -> WellFileInfo:
        info: Optional[WellFileInfo] = self._infos.get(path)
        if info is None:
            info = self._infos[path] = read_file_info(path)
        return info
