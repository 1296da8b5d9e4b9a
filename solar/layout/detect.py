"""Find the layout spec for a path: a spec file, a folder holding one, or a bare HDF5 file."""
from __future__ import annotations

import collections
import os

import h5py

from ..errors import LayoutError, SpecError
from .build import open_h5
from .spec import SPEC_FILENAME, LayoutSpec

WELL_FIELD_GROUPS = ("t0_fields", "t1_fields", "t2_fields")


def well_fields(h5f: h5py.File):
    """Field datasets of a The Well file, in t0, t1, t2 order."""
    out = []
    for g in WELL_FIELD_GROUPS:
        if g in h5f:
            names = h5f[g].attrs.get("field_names", None)
            names = [n.decode() if isinstance(n, bytes) else str(n) for n in names] if names is not None \
                else sorted(h5f[g].keys())
            out.extend(f"{g}/{n}" for n in names)
    return out


def detect_spec(path: str) -> LayoutSpec:
    """Guess a spec for one HDF5 file (The Well, PDEBench mult, or rows)."""
    root, name = os.path.split(os.path.abspath(path))
    with open_h5(path) as f:
        if any(g in f for g in WELL_FIELD_GROUPS):
            fields = well_fields(f)
            if fields:
                return LayoutSpec("windows", (name,), tuple(fields), root=root, name="the_well")
        groups = [k for k, v in f.items() if isinstance(v, h5py.Group)]
        if groups and all(k.isdigit() for k in groups) and all("data" in f[k] for k in groups):
            return LayoutSpec("whole", (name,), ("data",), root=root, groups="*", name="pdebench-mult")
        cands = [k for k, v in f.items()
                 if isinstance(v, h5py.Dataset) and v.ndim >= 2 and v.dtype.kind in "biufc"]
        if not cands:
            raise LayoutError(f"cannot guess the samples of {path}: no numeric dataset with 2+ axes at the root; "
                              f"write a {SPEC_FILENAME}")
        common = collections.Counter(f[k].shape[0] for k in cands).most_common(1)[0][0]
        fields = tuple(k for k in cands if f[k].shape[0] == common)
        return LayoutSpec("rows", (name,), fields, root=root, name="rows")


def find_spec(path: str) -> LayoutSpec:
    """Spec for ``path``: a ``.json`` spec, a folder with ``solar-layout.json``, or an HDF5 file."""
    if not os.path.exists(path):
        raise SpecError(f"file not found: {path}")
    if os.path.isdir(path) or path.endswith(".json"):
        return LayoutSpec.load(path)
    return detect_spec(path)
