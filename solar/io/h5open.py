"""Open an HDF5 data file read-only, the same way for every reader of data files.

solar opens data files with HDF5 file locking off (``locking=False``): read-only
access needs no lock, and parallel file systems often have none.  HDF5 keeps one
shared handle per file and process, and refuses to open a file again with other
locking flags than an open handle's ("file locking flag values don't match").
Users often hold the data open with a plain ``h5py.File(path)`` (default
locking) to read metadata; :func:`open_readonly` then retries with the other
locking settings until one matches the open handle, and :func:`follow` does the
same for the target file of an external link.
"""
from __future__ import annotations

import h5py

LOCKING_TRIES = (False, None, True, "best-effort")
"""``locking=`` values tried in order: off, HDF5's default, on, best effort."""

_MISMATCH = "flag values don't match"


def locking_mismatch(exc: BaseException) -> bool:
    """True for HDF5's error when the file is open in this process with other locking flags."""
    return "locking" in str(exc) and _MISMATCH in str(exc)


def _elink_access(locking) -> h5py.h5p.PropLAID:
    """Link access list opening external-link targets with h5py's ``locking=`` meaning."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    if locking is not None:  # None: HDF5's default
        fapl.set_file_locking(bool(locking), locking == "best-effort")
    lapl = h5py.h5p.create(h5py.h5p.LINK_ACCESS)
    lapl.set_elink_fapl(fapl)
    return lapl


def follow(group: h5py.Group, name: str):
    """``group[name]``, also when an external link on the way leads to a file this process
    holds open with other locking flags (then each locking setting is tried for the target)."""
    try:
        return group[name]
    except (KeyError, OSError) as exc:
        if not locking_mismatch(exc):
            raise
    for locking in LOCKING_TRIES[1:]:
        try:
            oid = h5py.h5o.open(group.id, name.encode(), lapl=_elink_access(locking))
        except (KeyError, OSError) as exc:
            if not locking_mismatch(exc):
                raise
            continue
        if isinstance(oid, h5py.h5d.DatasetID):
            return h5py.Dataset(oid)
        return h5py.Group(oid) if isinstance(oid, h5py.h5g.GroupID) else h5py.Datatype(oid)
    return group[name]  # no setting matched: HDF5's own error again


def open_readonly(path: str, **kwargs) -> h5py.File:
    """``h5py.File(path, "r")``, locking off unless this process holds ``path`` open with locking on.

    ``kwargs`` go to :class:`h5py.File`.  Any other error (missing file, not HDF5)
    propagates unchanged, as does the mismatch if no locking setting matches.
    """
    for locking in LOCKING_TRIES[:-1]:
        try:
            return h5py.File(path, "r", locking=locking, **kwargs)
        except OSError as exc:
            if not locking_mismatch(exc):
                raise
    return h5py.File(path, "r", locking=LOCKING_TRIES[-1], **kwargs)
