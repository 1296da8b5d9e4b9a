"""The layout spec: a small, frozen, JSON-serialisable description of a dataset.

A spec says *which* files and datasets hold the samples and *how* samples are cut
out of them; :func:`solar.layout.build_layout` turns it into a :class:`Layout`
(the block map) by reading the files' metadata with h5py.

Kinds (``LayoutSpec.kind``):

``rows``
    Sample ``i`` is row ``i`` (axis 0) of every field dataset; several files are
    concatenated in file order (PtychoNN, PDEBench "single").
``windows``
    Files hold trajectories ``[B, T, ...]``; a sample is a window of
    ``n_steps_input + n_steps_output`` frames with stride ``dt`` of one trajectory
    (The Well).  Fields without a trajectory or time axis (The Well's
    ``sample_varying`` / ``time_varying`` attributes) are handled.
``whole``
    Each file (or each group matching ``groups`` in each file) is one sample made
    of whole datasets (CosmoFlow, DeepCAM, PDEBench "mult").
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
from dataclasses import dataclass
from typing import Optional, Tuple

from ..errors import SpecError

SPEC_FILENAME = "solar-layout.json"
SPEC_VERSION = 1
KINDS = ("rows", "windows", "whole")


@dataclass(frozen=True)
class LayoutSpec:
    """Which files/datasets hold the samples and how samples are cut from them.

    ``files`` are glob patterns relative to ``root`` (expanded and sorted);
    ``fields`` are dataset paths (relative to the group for ``kind='whole'`` with
    ``groups``).  ``root`` is not serialised: it is the spec file's folder.
    """

    kind: str
    files: Tuple[str, ...]
    fields: Tuple[str, ...]
    root: str = "."
    groups: Optional[str] = None
    n_steps_input: int = 4
    n_steps_output: int = 1
    dt: int = 1
    name: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise SpecError(f"unknown layout kind {self.kind!r}; valid kinds: {', '.join(KINDS)}")
        for attr in ("files", "fields"):
            val = getattr(self, attr)
            if isinstance(val, str):
                object.__setattr__(self, attr, (val,))
            elif not isinstance(val, tuple):
                object.__setattr__(self, attr, tuple(val))
        if not self.files:
            raise SpecError("layout spec lists no files")
        if not self.fields:
            raise SpecError("layout spec lists no fields (datasets)")
        if len(set(self.fields)) != len(self.fields):
            raise SpecError(f"layout spec lists a field twice: {list(self.fields)}")
        for attr in ("n_steps_input", "n_steps_output", "dt"):
            val = getattr(self, attr)
            if not isinstance(val, int) or isinstance(val, bool) or val < (0 if attr == "n_steps_output" else 1):
                raise SpecError(f"{attr} must be a positive integer, got {val!r}")
        if self.groups is not None and self.kind != "whole":
            raise SpecError(f"'groups' is only valid for kind 'whole', not {self.kind!r}")

    # ------------------------------------------------------------------ paths
    @property
    def window(self) -> int:
        """Frames per window sample (``kind='windows'``)."""
        return self.n_steps_input + self.n_steps_output

    @property
    def window_span(self) -> int:
        """Time steps covered by one window: ``dt * (window - 1) + 1``."""
        return self.dt * (self.window - 1) + 1

    def resolve_files(self) -> Tuple[str, ...]:
        """Expand the file patterns (sorted within a pattern, order of patterns kept)."""
        out = []
        for pat in self.files:
            full = pat if os.path.isabs(pat) else os.path.join(self.root, pat)
            if glob.has_magic(pat):
                hits = sorted(glob.glob(full))
                if not hits:
                    raise SpecError(f"no file matches {full!r}")
                out.extend(hits)
            else:
                out.append(full)
        seen = set()
        uniq = []
        for p in out:
            key = os.path.abspath(p)
            if key not in seen:
                seen.add(key)
                uniq.append(p)
        return tuple(uniq)

    # ------------------------------------------------------------- serialise
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("root")
        d["files"] = list(self.files)
        d["fields"] = list(self.fields)
        d = {"solar_layout_spec": SPEC_VERSION, **d}
        if self.kind != "windows":
            for k in ("n_steps_input", "n_steps_output", "dt"):
                d.pop(k)
        if self.groups is None:
            d.pop("groups")
        return d

    def save(self, path: str) -> str:
        """Write the spec as JSON (``path`` may be a folder: ``SPEC_FILENAME`` inside)."""
        if os.path.isdir(path):
            path = os.path.join(path, SPEC_FILENAME)
        with open(path, "w") as fh:
            json.dump(self.to_dict(), fh, indent=2)
            fh.write("\n")
        return path

    @classmethod
    def from_dict(cls, d: dict, root: str = ".") -> "LayoutSpec":
        d = dict(d)
        version = d.pop("solar_layout_spec", None)
        if version != SPEC_VERSION:
            raise SpecError(f"not a solar layout spec (version {version!r}, expected {SPEC_VERSION})")
        names = {f.name for f in dataclasses.fields(cls)} - {"root"}
        unknown = set(d) - names
        if unknown:
            raise SpecError(f"unknown key(s) in layout spec: {', '.join(sorted(unknown))}")
        if "kind" not in d or "files" not in d or "fields" not in d:
            raise SpecError("layout spec needs 'kind', 'files' and 'fields'")
        return cls(root=root, **d)

    @classmethod
    def load(cls, path: str) -> "LayoutSpec":
        """Read a spec file, or ``SPEC_FILENAME`` inside a folder."""
        if os.path.isdir(path):
            path = os.path.join(path, SPEC_FILENAME)
            if not os.path.exists(path):
                raise SpecError(f"folder has no {SPEC_FILENAME}: {os.path.dirname(path)}")
        if not os.path.exists(path):
            raise SpecError(f"file not found: {path}")
        try:
            with open(path) as fh:
                d = json.load(fh)
        except (OSError, ValueError) as exc:
            raise SpecError(f"cannot read layout spec {path}: {exc}") from None
        if not isinstance(d, dict):
            raise SpecError(f"layout spec {path} is not a JSON object")
        return cls.from_dict(d, root=os.path.dirname(os.path.abspath(path)))
