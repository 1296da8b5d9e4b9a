"""Checks of a schedule's output path, made before planning: a schedule never replaces data.

Refused: a directory, a missing or read-only folder, one of the layout's files (also
through a hard or symbolic link), an existing file that is not a solar schedule (HDF5
or not), and a path that one of the spec's glob patterns would match (the schedule
would be read as data next time).  An existing schedule may be overwritten.
"""
from __future__ import annotations

import fnmatch
import glob
import os
from typing import Iterable, Optional, Tuple

import h5py

from ..errors import SpecError, WriteError
from .format import FORMAT


def is_schedule(path: str) -> bool:
    """Whether ``path`` is an HDF5 file with ``format == "solar-schedule"`` (opened read-only)."""
    try:
        with h5py.File(path, "r", locking=False) as f:
            fmt = f.attrs.get("format")
    except (OSError, ValueError):
        return False
    if isinstance(fmt, bytes):
        fmt = fmt.decode(errors="replace")
    return fmt == FORMAT


def check_folder(out: str):
    """Refuse ``out`` if it is a directory or its folder is missing or not writable."""
    if os.path.isdir(out):
        raise SpecError(f"output {out} is a directory; give a file name, e.g. -o {os.path.join(out, 'plan.h5')}")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise WriteError(f"cannot write {out}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise WriteError(f"cannot write {out}: folder {folder} is not writable")


def check_target(out: str, files: Iterable[str] = (), spec=None):
    """Refuse ``out`` if it is one of ``files`` (the layout's), matches a glob of ``spec``, or is not a schedule."""
    if os.path.exists(out):
        for f in files:
            if _same_file(out, f):
                raise SpecError(f"output {out} is the input data file {f}; choose another output path")
    pat = _matching_pattern(out, spec) if spec is not None else None
    if pat is not None:
        raise SpecError(f"output {out} matches the layout's file pattern {pat!r} and would be read as data next "
                        f"time; choose an -o outside {spec.root} or one the pattern does not match")
    if os.path.lexists(out) and not is_schedule(out):
        raise SpecError(f"output {out} exists and is not a solar schedule; refusing to replace it (choose another "
                        "output path)")


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _matching_pattern(out: str, spec) -> Optional[str]:
    """The first glob pattern of ``spec.files`` that would match ``out`` once written, if any."""
    full = os.path.abspath(out)
    targets = {full, os.path.join(os.path.realpath(os.path.dirname(full)), os.path.basename(full))}
    roots = {os.path.abspath(spec.root), os.path.realpath(spec.root)}
    for pat in spec.files:
        if not glob.has_magic(pat):
            continue
        fulls = {pat} if os.path.isabs(pat) else {os.path.join(r, pat) for r in roots}
        if any(_glob_match(p, t) for p in fulls for t in targets):
            return pat
    return None


def _glob_match(pattern: str, path: str) -> bool:
    """Whether :func:`glob.glob` (not recursive) of ``pattern`` would list ``path``: component by component,
    wildcards do not cross ``/`` and do not match a leading dot."""
    p_parts, t_parts = _parts(pattern), _parts(path)
    if len(p_parts) != len(t_parts):
        return False
    for p, t in zip(p_parts, t_parts):
        if not glob.has_magic(p):
            if p != t:
                return False
        elif (t.startswith(".") and not p.startswith(".")) or not fnmatch.fnmatchcase(t, p):
            return False
    return True


def _parts(path: str) -> Tuple[str, ...]:
    return tuple(os.path.normpath(path).split(os.sep))
