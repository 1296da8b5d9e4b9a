"""Is the data still what the schedule was planned for?  Checked once per job (or node), not per rank.

Modes (``SolarLoader(verify_data=...)``), for a schedule that stores its layout:

``fast`` (default)
    every data file exists with the size and modification time (ns) it had when planned: one
    ``stat`` per file, no open, on one rank.  The stored sizes and mtimes are the ones the
    layout fingerprint was computed from, so equal stats mean an equal fingerprint.
``strict``
    the fast check, then the block map rebuilt from the HDF5 files' metadata (every file opened)
    and its fingerprint compared with the schedule's.
``off``
    nothing is checked: a file rewritten since planning may be read at stale offsets.
"""
from __future__ import annotations

import os

from ..errors import SpecError

MODES = ("fast", "strict", "off")
SCOPES = ("job", "node")


def check_mode(mode, scope) -> None:
    """A SpecError naming a ``verify_data`` / ``verify_scope`` value that is not one of the choices."""
    if not isinstance(mode, str) or mode not in MODES:
        raise SpecError(f"verify_data must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    if not isinstance(scope, str) or scope not in SCOPES:
        raise SpecError(f"verify_scope must be one of {', '.join(map(repr, SCOPES))}, got {scope!r}")


def check_data(sched, layout, mode: str) -> None:
    """Raise :class:`~solar.schedule.ScheduleError` if ``layout``'s files (the one ``sched`` stores) are not
    as planned (``mode`` ``fast`` or ``strict``, see the module docstring)."""
    from .schedule import ScheduleError
    size, mtime = sched.planned_file_stats()
    changed = []
    for i, path in enumerate(layout.files):
        why = _changed(path, int(size[i]), int(mtime[i]))
        if why:
            changed.append(f"data file {path} {why}")
    if changed:
        more = f" (and {len(changed) - 1} more files)" if len(changed) > 1 else ""
        raise ScheduleError(f"{sched.path}: {changed[0]}{more}; the schedule was planned for the data as it was: "
                            f"re-run solar plan")
    if mode == "strict":
        from ..layout import build_layout
        sched.check(layout=build_layout(layout.spec))


def _changed(path: str, size: int, mtime_ns: int) -> str:
    """Why ``path`` is not the file planned (``size`` bytes, modified at ``mtime_ns``); "" if it is."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "is missing"
    except OSError as exc:
        return f"cannot be checked ({exc.strerror or exc})"
    if st.st_size != size:
        return f"has {st.st_size:,} bytes, {size:,} when planned"
    if st.st_mtime_ns != mtime_ns:
        return f"was modified since planning (mtime {st.st_mtime_ns} ns, {mtime_ns} ns when planned)"
    return ""


def verify_data(sched, layout, mode: str = "fast", comm=None, scope: str = "job") -> None:
    """:func:`check_data` on one rank of ``comm`` (rank 0; ``scope="node"``: local rank 0 of each node) while
    the others wait; a failure raises the same ScheduleError on every rank.  Without ``comm`` (or with
    one rank) this process checks for itself.  ``mode="off"``: nothing."""
    check_mode(mode, scope)
    if mode == "off":
        return
    if comm is None or comm.Get_size() <= 1:
        check_data(sched, layout, mode)
        return
    from ..mpi import leader_call
    leader_call(comm, lambda: check_data(sched, layout, mode), per_node=scope == "node")
