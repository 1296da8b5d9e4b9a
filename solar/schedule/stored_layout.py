"""The layout stored in a schedule file (``/layout``, format version 3): written by ``solar plan``,
read by every rank instead of the HDF5 files' metadata (see :mod:`solar.layout.store`)."""
from __future__ import annotations

import json
import os
from typing import Callable, Tuple

import numpy as np

from ..errors import LayoutError
from ..layout import store
from ..layout.parts import restore_parts
from . import checks
from .format import source_paths


def write_layout(group, layout, schedule_path, put: Callable) -> int:
    """Store ``layout`` in the HDF5 ``group`` with ``put(group, name, array)`` (checksummed); returns the
    bytes stored.  The data folder is recorded relative to the schedule file and absolute.

    Raises :class:`~solar.errors.LayoutError` if a file changed since the layout was built (its
    fingerprint, recomputed from what is about to be stored, differs): the stored sizes and mtimes
    are then exactly the fingerprint's.
    """
    doc, arrays = store.encode(layout)
    doc["root"], doc["root_abs"] = source_paths(os.path.abspath(layout.spec.root), schedule_path)
    _check_roundtrip(doc, arrays, layout)
    raw = np.frombuffer(json.dumps(doc).encode(), dtype="u1")  # key order kept: the spec round-trips exactly
    put(group, "document", raw)
    for name, arr in arrays.items():
        put(group, name, arr)
    return int(raw.nbytes + sum(a.nbytes for a in arrays.values()))


def _check_roundtrip(doc: dict, arrays: dict, layout):
    """The layout decoded from what is stored has ``layout``'s fingerprint (files unchanged since the build,
    nothing lost in the encoding)."""
    from ..layout.build import fingerprint
    demand = {k: getattr(layout, k) for k in ("sample_ptr", "sample_blocks", "block_nbytes", "block_stored")}
    back = store.decode(doc, arrays, demand, os.path.abspath(layout.spec.root), layout.fingerprint)
    arrs = {k: getattr(back, k) for k in ("block_offset", "block_stored", "block_mask")}
    try:
        now = fingerprint(back.spec, back.files, back.datasets, arrs)
    except OSError as exc:
        raise LayoutError(f"a data file vanished while planning: {exc}") from None
    if now != layout.fingerprint:
        raise LayoutError(f"the data in {layout.spec.root} changed while it was planned (layout fingerprint "
                          f"{layout.fingerprint[:12]}, now {now[:12]}); re-run solar plan")


def read_layout(sched) -> Tuple[object, np.ndarray, np.ndarray]:
    """``(Layout, file sizes int64[F], file mtimes int64[F] ns when planned)`` of schedule ``sched``:
    every array checked for dtype/shape before it is read and for its checksum after, the whole
    for consistency (:class:`checks.Damaged` otherwise)."""
    raw = sched._read("layout/document", "u1", (None,))
    try:
        doc = json.loads(raw.tobytes().decode())
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise checks.Damaged("layout/document is not JSON") from None
    try:
        if not isinstance(doc, dict):
            raise store.StoreDamaged("the document is not a JSON object")
        want = store.shapes(doc, sched.n_blocks)
        arrays = {k: sched._read(f"layout/{k}", dt, want[k]) for k, dt in store.ARRAYS.items()}
        root = _data_root(sched, doc.get("root"), doc.get("root_abs"))
        layout = restore_parts(store.decode(doc, arrays, sched.demand(), root, sched.fingerprint))
    except (store.StoreDamaged, LayoutError) as exc:
        raise checks.Damaged(f"layout: {exc}") from None
    return layout, arrays["file_size"], arrays["file_mtime_ns"]


def _data_root(sched, rel, absolute) -> str:
    """The data folder: relative to the schedule file's folder if it exists there, else the absolute
    path recorded when planning; a ScheduleError naming both when neither exists."""
    if not isinstance(rel, str) or not isinstance(absolute, str) or not rel:
        raise store.StoreDamaged(f"the data folder ({rel!r}, {absolute!r}) is not text")
    here = os.path.join(os.path.dirname(os.path.abspath(sched.path)), rel)
    for p in (here, absolute):
        if p and os.path.isdir(p):
            return p
    from .schedule import ScheduleError
    raise ScheduleError(f"{sched.path}: the data folder it was planned for is neither at {here!r} nor at "
                        f"{absolute!r}; pass its layout spec path (data=...)")
