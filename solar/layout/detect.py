"""Find the layout spec for a path: a spec file, a folder holding one, or a bare HDF5 file."""
from __future__ import annotations

import collections
import json
import os

import h5py
import numpy as np

from ..errors import LayoutError, SolarError, SpecError
from .build import open_h5
from .h5meta import H5_ERRORS
from .spec import SPEC_FILENAME, LayoutSpec

WELL_FIELD_GROUPS = ("t0_fields", "t1_fields", "t2_fields")
MAX_VISIT = 100_000
"""Objects visited at most when listing a file's datasets (a huge or looping file stops there)."""
MAX_LISTED = 12
"""Candidate datasets shown in the 'cannot guess' help."""


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


def numeric_datasets(h5f: h5py.File):
    """``[(path, shape, dtype), ...]`` of the non-empty numeric datasets with 1+ axes, anywhere in the file.

    Paths have no leading slash (as in a spec's ``fields``); biggest datasets first.
    Stops after :data:`MAX_VISIT` objects.
    """
    found, seen = [], [0]

    def visit(name, obj):
        seen[0] += 1
        if seen[0] > MAX_VISIT:
            return True  # stop the walk
        if isinstance(obj, h5py.Dataset) and obj.shape and all(obj.shape) and obj.dtype.kind in "biufc" \
                and obj.dtype.fields is None and obj.dtype.subdtype is None:
            found.append((name, tuple(int(s) for s in obj.shape), np.dtype(obj.dtype)))
        return None

    h5f.visititems(visit)
    return sorted(found, key=lambda c: (-int(np.prod(c[1], dtype=object)), c[0]))


def spec_line(file_name: str, fields) -> str:
    """The ``solar-layout.json`` content (one JSON line) of a ``rows`` spec over ``fields`` of one file."""
    return json.dumps(LayoutSpec("rows", (file_name,), tuple(fields), name="rows").to_dict())


def candidates_help(path: str, cands) -> str:
    """Multi-line help listing candidate datasets and the spec line that selects each."""
    name = os.path.basename(path)
    if not cands:
        return f"cannot guess the samples of {path}: it holds no non-empty numeric dataset"
    shown = cands[:MAX_LISTED]
    w = max(len(p) for p, _, _ in shown) + 1
    lines = [f"cannot guess the samples of {path}: no numeric dataset with 2+ axes at the root.",
             "Candidate datasets (path, shape, dtype):"]
    lines += [f"  /{p:<{w}} {str(s):<20} {d}" for p, s, d in shown]
    if len(cands) > len(shown):
        lines.append(f"  ... and {len(cands) - len(shown)} more")
    lines.append(f"To use one, save its line as {os.path.join(os.path.dirname(os.path.abspath(path)), SPEC_FILENAME)} "
                 f"and pass that folder (sample i = row i of the field):")
    lines += [f"  {spec_line(name, [p])}" for p, _, _ in shown]
    rows = collections.Counter(s[0] for _, s, _ in cands)
    n_rows, count = rows.most_common(1)[0]
    if count > 1:
        same = [p for p, s, _ in cands if s[0] == n_rows]
        lines.append(f"or all {count} datasets with {n_rows} rows as fields of one sample:")
        lines.append(f"  {spec_line(name, same)}")
    return "\n".join(lines)


def _guess(f: h5py.File, path: str, root: str, name: str) -> LayoutSpec:
    if f.attrs.get("format", None) in ("solar-schedule", b"solar-schedule"):  # solar.schedule.format.FORMAT
        raise LayoutError(f"{path} is a solar schedule (made by solar plan), not a dataset: give the data it was "
                          f"planned for (solar inspect {path} names it)")
    if any(g in f for g in WELL_FIELD_GROUPS):
        fields = well_fields(f)
        if fields:
            return LayoutSpec("windows", (name,), tuple(fields), root=root, name="the_well")
    groups = [k for k, v in f.items() if isinstance(v, h5py.Group)]
    if groups and all(k.isdigit() for k in groups) and all("data" in f[k] for k in groups):
        return LayoutSpec("whole", (name,), ("data",), root=root, groups="*", name="pdebench-mult")
    cands = [k for k, v in f.items()
             if isinstance(v, h5py.Dataset) and v.ndim >= 2 and v.dtype.kind in "biufc" and all(v.shape)]
    if not cands:
        raise LayoutError(candidates_help(path, numeric_datasets(f)))
    common = collections.Counter(f[k].shape[0] for k in cands).most_common(1)[0][0]
    fields = tuple(k for k in cands if f[k].shape[0] == common)
    return LayoutSpec("rows", (name,), fields, root=root, name="rows")


def detect_spec(path: str) -> LayoutSpec:
    """Guess a spec for one HDF5 file (The Well, PDEBench mult, or rows).

    When the numeric datasets sit in groups (NeXus ``/entry/data/data`` and the
    like), the LayoutError lists them with the spec line that selects each.
    """
    root, name = os.path.split(os.path.abspath(path))
    with open_h5(path) as f:
        try:
            return _guess(f, path, root, name)
        except SolarError:
            raise
        except H5_ERRORS as exc:
            text = str(exc).strip().splitlines()
            raise LayoutError(f"cannot read the structure of {path}: {text[0] if text else type(exc).__name__} "
                              f"(damaged file?)") from None


def find_spec(path: str) -> LayoutSpec:
    """Spec for ``path``: a ``.json`` spec, a folder with ``solar-layout.json``, or an HDF5 file."""
    if not os.path.exists(path):
        raise SpecError(f"file not found: {path}")
    if os.path.isdir(path) or path.endswith(".json"):
        return LayoutSpec.load(path)
    return detect_spec(path)
