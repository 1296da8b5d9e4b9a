"""Find the layout spec for a path: a spec file, a folder holding one, or a bare HDF5 file."""
from __future__ import annotations

import collections
import os
import shlex

import h5py

from ..errors import LayoutError, SolarError, SpecError
from .build import open_h5
from .guess import guess_samples, no_field_reason, short_fields
from .h5meta import H5_ERRORS
from .spec import SPEC_FILENAME, LayoutSpec
from .tree import read_tree

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


def known_spec(f: h5py.File, path: str, root: str, name: str):
    """``(spec, why)`` of a file whose layout solar knows (The Well, PDEBench "mult", numeric datasets with 2+
    axes at the root), or None; a LayoutError for a solar schedule."""
    if f.attrs.get("format", None) in ("solar-schedule", b"solar-schedule"):  # solar.schedule.format.FORMAT
        raise LayoutError(f"{path} is a solar schedule (made by solar plan), not a dataset: give the data it was "
                          f"planned for (solar inspect {path} names it)")
    if any(g in f for g in WELL_FIELD_GROUPS):
        fields = well_fields(f)
        if fields:
            return (LayoutSpec("windows", (name,), tuple(fields), root=root, name="the_well"),
                    "The Well: windows of time steps of each trajectory (t0/t1/t2_fields)")
    groups = [k for k, v in f.items() if isinstance(v, h5py.Group)]
    if groups and all(k.isdigit() for k in groups) and all("data" in f[k] for k in groups):
        return (LayoutSpec("whole", (name,), ("data",), root=root, groups="*", name="pdebench-mult"),
                f"one sample per numbered group's data (PDEBench, {len(groups)} groups)")
    cands = [k for k in f if _root_array(f, k)]
    if not cands:
        return None
    common = collections.Counter(f[k].shape[0] for k in cands).most_common(1)[0][0]
    fields = tuple(k for k in cands if f[k].shape[0] == common)
    if _larger_array_in_a_group(f, sum(f[k].size * f[k].dtype.itemsize for k in fields)):
        return None  # root arrays beside larger ones in groups: which are the data is a guess, shown, not used
    return (LayoutSpec("rows", (name,), fields, root=root, name="rows"),
            f"row i of the root datasets with 2+ axes and {common:,} rows")


def _larger_array_in_a_group(f: h5py.File, nbytes: int) -> bool:
    """Whether a numeric dataset with 2+ values inside a group holds more than ``nbytes`` (a file whose root
    arrays are small beside its data: NeXus ``/entry/data`` with a calibration table at the root)."""
    found = []

    def visit(name, obj):
        if "/" in name and isinstance(obj, h5py.Dataset) and obj.dtype.kind in "biufc" and obj.size >= 2 \
                and obj.size * obj.dtype.itemsize > nbytes:
            found.append(name)
            return True  # (stops the walk)
        return None
    try:
        f.visititems(visit)
    except H5_ERRORS:
        return False
    return bool(found)


def _root_array(f: h5py.File, key: str) -> bool:
    """Whether root member ``key`` is a numeric dataset with 2+ axes and 2+ values (rule 1 of
    :func:`~solar.layout.guess.why_not_field`: one value is no array; False if it cannot be read)."""
    try:
        v = f[key]
        return isinstance(v, h5py.Dataset) and v.ndim >= 2 and v.dtype.kind in "biufc" and v.size >= 2
    except H5_ERRORS:
        return False


def no_array_message(path: str, nodes) -> str:
    """The one line for a file none of whose datasets can be a field."""
    return f"{path} holds no array solar can load (a numeric dataset with 2+ values): {no_field_reason(nodes)}"


def _refusal(path: str, nodes, root=()) -> str:
    """The one line of :func:`detect_spec` for a file whose arrays sit in groups (or have one axis; ``root``:
    its arrays at the root, which sit beside a larger one in a group)."""
    guesses = guess_samples(nodes)
    if not guesses:
        return no_array_message(path, nodes)
    g = guesses[0]
    q = shlex.quote(path)
    what = ((f"arrays at the root ({short_fields(list(root))}) sit" if len(root) > 1 else
             f"array at the root ({root[0]}) sits") + " beside a larger one in a group" if root else
            "arrays sit in groups" if any("/" in f for f in g.fields) else "arrays have one axis")
    return (f"cannot tell what a sample of {path} is: its {what} (best guess: {g.samples} samples, "
            f"row i of {short_fields(g.fields)}); `solar inspect {q}` shows it with the alternatives and "
            f"`solar inspect {q} --save-spec {SPEC_FILENAME}` saves it as a spec to give instead of the file")


def detect_spec(path: str) -> LayoutSpec:
    """The spec of one HDF5 file whose layout solar knows (The Well, PDEBench "mult", rows of the numeric
    datasets with 2+ axes at the root).

    Any other file (data in groups: NeXus ``/entry/data/data``, EBSD, instrument files) is refused with one
    line giving the best guess of :func:`solar.layout.guess.guess_samples` and the ``solar inspect`` command
    that shows and saves it: a guess is not used without the user seeing it.
    """
    root, name = os.path.split(os.path.abspath(path))
    with open_h5(path) as f:
        try:
            known = known_spec(f, path, root, name)
            if known is not None:
                return known[0]
            raise LayoutError(_refusal(path, read_tree(f).nodes, [k for k in f if _root_array(f, k)]))
        except SolarError:
            raise
        except H5_ERRORS as exc:
            raise unreadable(path, exc) from None


def unreadable(path: str, exc: BaseException) -> LayoutError:
    """The error for an HDF5 file whose structure h5py cannot read: its first line, and that it may be damaged."""
    text = str(exc).strip().splitlines()
    return LayoutError(f"cannot read the structure of {path}: {text[0] if text else type(exc).__name__} "
                       f"(damaged file?)")


def find_spec(path: str) -> LayoutSpec:
    """Spec for ``path``: a ``.json`` spec, a folder with ``solar-layout.json``, or an HDF5 file."""
    if not os.path.exists(path):
        raise SpecError(f"file not found: {path}")
    if os.path.isdir(path) or path.endswith(".json"):
        return LayoutSpec.load(path)
    return detect_spec(path)
