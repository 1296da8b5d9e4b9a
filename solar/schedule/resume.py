"""Loader-state files for ``solar plan --resume-from STATE``: a JSON file of ``loader.state_dict()``, or a
``torch.save``'d checkpoint that holds it (at its top level or in one nested dict, e.g.
``{"model": ..., "loader": loader.state_dict()}``).

    json.dump(loader.state_dict(), open("state.json", "w"))       # or solar.schedule.resume.write_state
    torch.save({"model": model.state_dict(), "loader": loader.state_dict()}, "ckpt.pt")
"""
from __future__ import annotations

import json
import os
from typing import List, Tuple

from ..atomic import write_atomic
from ..scheduler.elastic import STATE_KEYS, ResumeError, check_state

MAX_DEPTH = 4  # nested dicts searched for the loader state in a checkpoint


def read_state(path: str) -> dict:
    """The loader state in file ``path`` (JSON, else a torch checkpoint read with ``weights_only=True``),
    checked (:func:`~solar.scheduler.elastic.check_state`); :class:`ResumeError` naming the file otherwise."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ResumeError(f"{path!r} is a folder: give the loader state file in it (loader.state_dict() saved as "
                          "JSON or in a torch checkpoint)")
    if not os.path.isfile(path):
        raise ResumeError(f"no loader state file {path!r} (save loader.state_dict() as JSON or in a torch checkpoint)")
    with open(path, "rb") as f:
        raw = f.read()
    if raw.startswith(b"\x89HDF"):
        raise ResumeError(f"{path}: an HDF5 file (a schedule, or data?), not a loader state: give the JSON or torch "
                          "checkpoint the training job saved")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        if raw.lstrip()[:1] in (b"{", b"["):  # meant as JSON: say where it breaks
            raise ResumeError(f"{path}: not valid JSON ({exc})") from None
        if not raw.startswith((b"PK\x03\x04", b"\x80")):  # neither torch.save's zip nor its older pickle
            raise ResumeError(f"{path}: neither JSON nor a torch checkpoint (it begins {raw[:24]!r})") from None
        doc = _torch_load(path)
    found = _find(doc, "", 0)
    if not found:
        raise ResumeError(f"{path}: holds no loader state (a dict with the keys {', '.join(STATE_KEYS)}, from "
                          f"SolarLoader.state_dict())")
    if len(found) > 1:
        raise ResumeError(f"{path}: holds {len(found)} loader states (at {', '.join(repr(k) for k, _ in found)}): "
                          f"save the one to resume alone")
    where, state = found[0]
    try:
        check_state(state)
    except ResumeError as exc:
        raise ResumeError(f"{path}{' at ' + repr(where) if where else ''}: {exc}") from None
    return state


def write_state(path: str, state: dict):
    """Write loader state ``state`` as JSON (atomically: a temporary file renamed)."""
    check_state(state)
    text = json.dumps(_plain(state), indent=1, sort_keys=True) + "\n"

    def write(tmp: str):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    write_atomic(os.fspath(path), write)


def _torch_load(path: str):
    try:
        import torch
    except ImportError:
        raise ResumeError(f"{path}: not JSON, and torch (for a torch checkpoint) is not installed") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - pickle, zip and torch errors of a file that is neither format
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if len(first) > 160:  # torch's weights-only advice runs on for lines: its first sentence
            first = first[:160].rsplit(" ", 1)[0] + " ..."
        raise ResumeError(f"{path}: neither JSON nor a torch checkpoint ({first})") from None


def _find(doc, where: str, depth: int) -> List[Tuple[str, dict]]:
    """``(key path, dict)`` of every dict in ``doc`` that has the loader state's keys (not below one)."""
    if not isinstance(doc, dict):
        return []
    if all(k in doc for k in STATE_KEYS):
        return [(where, doc)]
    if depth >= MAX_DEPTH:
        return []
    out = []
    for k, v in doc.items():
        out.extend(_find(v, f"{where}.{k}" if where else str(k), depth + 1))
    return out


def _plain(v):
    """numpy / torch scalars in a state -> Python numbers (JSON)."""
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if hasattr(v, "item") and callable(v.item):
        return v.item()
    return v
