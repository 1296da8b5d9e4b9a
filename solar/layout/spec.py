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

Splits: instead of ``files`` a spec may name ``splits``, ``{"train": [globs], "valid":
[globs], "test": [globs]}`` (any names, in order); the spec then describes one split at a
time: ``train`` when it has one, else the first (``split`` in the JSON picks another).
:meth:`LayoutSpec.select` gives the spec of another split or of a subset of the fields.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence, Tuple, Union

from ..errors import SpecError

SPEC_FILENAME = "solar-layout.json"
SPEC_VERSION = 1
KINDS = ("rows", "windows", "whole")
DEFAULT_SPLIT = "train"
"""The split a spec with ``splits`` describes unless told otherwise (else its first split)."""

Splits = Tuple[Tuple[str, Tuple[str, ...]], ...]
"""``((name, file patterns), ...)`` in the spec's order (a dict in JSON)."""


@dataclass(frozen=True)
class LayoutSpec:
    """Which files/datasets hold the samples and how samples are cut from them.

    ``files`` are glob patterns relative to ``root`` (expanded and sorted);
    ``fields`` are dataset paths (relative to the group for ``kind='whole'`` with
    ``groups``).  ``root`` is not serialised: it is the spec file's folder.

    ``splits`` (optional): ``{name: patterns}`` (or pairs); ``files`` are then the patterns of
    split ``split`` (default ``"train"`` if named, else the first split) and may be left
    empty.  A spec without ``splits`` has ``split`` None.
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
    splits: Optional[Splits] = None
    split: Optional[str] = None

    def __post_init__(self):
        self._init_splits()
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

    def _init_splits(self):
        """Normalise ``splits`` to pairs, pick ``split`` and set ``files`` from it."""
        if self.splits is None:
            if self.split is not None:
                raise SpecError(f"split {self.split!r} given, but the layout spec names no splits")
            return
        pairs = _split_pairs(self.splits)
        split = self.split if self.split is not None else default_split(name for name, _ in pairs)
        names = [name for name, _ in pairs]
        if split not in names:
            raise SpecError(f"unknown split {split!r}; the spec's splits: {', '.join(names)}")
        files = dict(pairs)[split]
        given = (self.files,) if isinstance(self.files, str) else tuple(self.files)
        if given and given != files:
            raise SpecError(f"files {list(given)} differ from split {split!r}'s files {list(files)}: give one")
        object.__setattr__(self, "splits", pairs)
        object.__setattr__(self, "split", split)
        object.__setattr__(self, "files", files)

    # ------------------------------------------------------------- selection
    @property
    def split_names(self) -> Tuple[str, ...]:
        """The splits the spec names, in its order (empty without ``splits``)."""
        return tuple(name for name, _ in self.splits or ())

    def select(self, split: Optional[str] = None, fields: Union[None, str, Sequence[str]] = None) -> "LayoutSpec":
        """This spec restricted to split ``split`` and/or to ``fields`` (kept in the spec's order).

        Unknown names raise :class:`SpecError` listing the valid ones; None keeps what the spec has.
        ``fields`` may be a comma-separated string (``"a,b"``)."""
        changes = {}
        if split is not None:
            if not self.splits:
                raise SpecError(f"split {split!r} asked for, but the layout spec names no splits "
                                f"(it lists files {list(self.files)})")
            if split not in self.split_names:
                raise SpecError(f"unknown split {split!r}; the spec's splits: {', '.join(self.split_names)}")
            changes.update(split=split, files=())
        if fields is not None:
            changes["fields"] = self.field_subset(fields)
        return dataclasses.replace(self, **changes) if changes else self

    def field_subset(self, fields: Union[str, Iterable[str]]) -> Tuple[str, ...]:
        """``fields`` checked against the spec's (each known, none twice, at least one), in the spec's order."""
        want = [f.strip() for f in fields.split(",")] if isinstance(fields, str) else list(fields)
        valid = ", ".join(self.fields)
        bad = [f for f in want if f not in self.fields]
        if bad:
            raise SpecError(f"unknown field(s) {', '.join(map(repr, bad))}; the spec's fields: {valid}")
        if not want:
            raise SpecError(f"fields: name at least one of the spec's fields: {valid}")
        if len(set(want)) != len(want):
            raise SpecError(f"fields lists a field twice: {want}")
        return tuple(f for f in self.fields if f in want)

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
        if self.splits is None:
            d.pop("splits")
            d.pop("split")
        else:  # the split's files are in ``splits``; ``split`` only when not the default one
            d.pop("files")
            d["splits"] = {name: list(pats) for name, pats in self.splits}
            if self.split == default_split(self.split_names):
                d.pop("split")
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
        if "kind" not in d or "fields" not in d or ("files" in d) == ("splits" in d):
            raise SpecError("layout spec needs 'kind', 'fields' and either 'files' or 'splits' (not both)")
        d.setdefault("files", ())
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


def default_split(names: Iterable[str]) -> str:
    """:data:`DEFAULT_SPLIT` when among ``names``, else the first name."""
    names = list(names)
    return DEFAULT_SPLIT if DEFAULT_SPLIT in names else names[0]


def _split_pairs(splits: Union[Dict[str, Sequence[str]], Splits]) -> Splits:
    """``splits`` (a dict or pairs) as ``((name, patterns), ...)``, checked: at least one split,
    names non-empty strings, each with at least one pattern."""
    items = list(splits.items()) if isinstance(splits, dict) else list(splits)
    if not items:
        raise SpecError("layout spec 'splits' names no split")
    out = []
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise SpecError(f"layout spec 'splits' must map names to file patterns, got {item!r}")
        name, pats = item
        pats = (pats,) if isinstance(pats, str) else pats
        if not isinstance(name, str) or not name:
            raise SpecError(f"split names must be non-empty strings, got {name!r}")
        if not isinstance(pats, (list, tuple)) or not pats or not all(isinstance(p, str) and p for p in pats):
            raise SpecError(f"split {name!r} must list file patterns (strings), got {pats!r}")
        out.append((name, tuple(pats)))
    if len({n for n, _ in out}) != len(out):
        raise SpecError(f"layout spec 'splits' names a split twice: {[n for n, _ in out]}")
    return tuple(out)
