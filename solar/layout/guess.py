"""What a sample of an HDF5 file is: a guess made from the file's metadata tree alone (pure, no file access).

:func:`solar.layout.tree.read_tree` turns a file into :class:`Node` records; :func:`guess_samples`
ranks the ways to cut that file into samples, best first, as ``rows`` specs (sample ``i`` = row ``i`` of
every field):

1. A dataset can be a field when it is numeric (bool, int, uint, float, complex; no compound, string,
   variable-length or reference type), readable here (no filter that neither solar nor HDF5 can decode)
   and holds at least two values in at least one axis. Scalars and one-value arrays (``(1,)``, how many
   instruments store a setting) are metadata, never fields.
2. Fields sharing a leading length ``n`` (anywhere in the file, in any group) form a set: row ``i`` of each
   is sample ``i``; ``n`` samples.
3. Sets are ranked: one holding a NeXus signal first (the dataset an ``NXdata`` group's ``signal``
   attribute names, or one with ``signal=1``), then by bytes, then by number of datasets, then by ``n``.
   Datasets under a group (or named) ``*header*`` or ``*metadata*`` (any case: EBSD ``Header``
   schematics, EMsoft ``EMheader``, saved calibration fields) only form sets after all the others.
4. After the best set, when it has several datasets: its main dataset alone (the signal, else the
   largest), and, when the set spans several top-level groups (``/Scan 1``, ``/Scan 2``), its datasets
   under the main dataset's top-level group; then the other sets in rank order.

A dataset reached through a soft link is the same dataset as its target: it is counted once (a signal
named through a soft link marks the target).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

KINDS = ("group", "dataset", "link", "datatype")
METADATA_WORDS = ("header", "metadata")
"""Path components (case-insensitive substrings) that mark datasets as metadata (rule 3)."""
MAX_GUESSES = 9
"""The best guess and at most 8 alternatives."""


@dataclass(frozen=True)
class Node:
    """One object of an HDF5 file, as :func:`solar.layout.tree.read_tree` saw it.

    ``path``: absolute (``"/entry/data/data"``); ``kind``: one of :data:`KINDS`.  Datasets:
    ``shape`` (None: null dataspace), ``dtype`` (numpy's name, e.g. ``"uint16"`` or ``">f4"``, or a
    description such as ``"string"``, ``"compound (3 fields)"``), ``itemsize`` (bytes per value), ``chunks``
    (None: not chunked), ``filters`` (names, write order), ``stored_nbytes`` (bytes in the file),
    ``problem`` (why it cannot be a field whatever its shape: a type or filter solar cannot serve; "" if none),
    ``note`` (e.g. why the h5py reader would serve it).  ``signal``: a NeXus signal.  ``nx_class``: a
    group's ``NX_class``.  ``target``: where a link points (``"/path"`` for a soft link,
    ``"file.h5:/path"`` for an external link, also on a dataset reached through one).
    """

    path: str
    kind: str = "dataset"
    shape: Optional[Tuple[int, ...]] = ()
    dtype: str = ""
    itemsize: int = 0
    chunks: Optional[Tuple[int, ...]] = None
    filters: Tuple[str, ...] = ()
    stored_nbytes: int = 0
    problem: str = ""
    note: str = ""
    signal: bool = False
    nx_class: str = ""
    target: str = ""

    @property
    def size(self) -> int:
        """Values in the dataset (0 for a null dataspace or a non-dataset)."""
        if self.kind != "dataset" or self.shape is None:
            return 0
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def field_name(self) -> str:
        """The path as a spec's ``fields`` entry (no leading slash)."""
        return self.path.lstrip("/")

    def to_dict(self) -> dict:
        """JSON-ready (lists for tuples), without the keys that are empty for this kind."""
        d = {"path": self.path, "kind": self.kind}
        if self.kind == "dataset":
            d.update(shape=None if self.shape is None else list(self.shape), dtype=self.dtype,
                     chunks=None if self.chunks is None else list(self.chunks), filters=list(self.filters),
                     nbytes=self.nbytes, stored_nbytes=self.stored_nbytes, field=not why_not_field(self),
                     why_not_field=why_not_field(self) or None)
        elif self.problem:
            d["problem"] = self.problem
        for k in ("note", "nx_class", "target"):
            if getattr(self, k):
                d[k] = getattr(self, k)
        if self.signal:
            d["signal"] = True
        return d


def why_not_field(node: Node) -> str:
    """"" if ``node`` can be a field (rule 1), else a short reason (``"scalar"``, ``"one value"``, ...)."""
    if node.kind != "dataset":
        return node.kind
    if node.problem:
        return node.problem
    if node.shape is None:
        return "null dataspace"
    if not node.shape:
        return "scalar"
    if any(s == 0 for s in node.shape):
        return "empty"
    if node.size == 1:
        return "one value"
    return ""


def is_metadata(path: str) -> bool:
    """Whether a group on ``path`` (or the dataset's own name) contains one of :data:`METADATA_WORDS`."""
    return any(w in part.casefold() for part in path.split("/") for w in METADATA_WORDS)


@dataclass(frozen=True)
class SampleGuess:
    """One way to cut a file into samples: a ``rows`` spec over ``fields`` (spec paths, no leading slash),
    ``samples`` rows (None where only the built layout knows, e.g. ``windows``), ``why`` in words."""

    fields: Tuple[str, ...]
    samples: Optional[int]
    why: str
    kind: str = "rows"
    nbytes: int = 0

    def to_dict(self) -> dict:
        return {"kind": self.kind, "samples": self.samples, "fields": list(self.fields), "why": self.why,
                "nbytes": self.nbytes}


def _signals(nodes: Sequence[Node]) -> set:
    """Paths of the NeXus signals, soft links resolved to their targets."""
    out = set()
    for n in nodes:
        if n.signal:
            out.add(n.target if n.kind == "link" and n.target.startswith("/") else n.path)
    return out


def _set_key(members: Sequence[Node], signals: set):
    n = members[0].shape[0]
    return (any(m.path in signals for m in members), sum(m.nbytes for m in members), len(members), n)


def _ordered(members: Iterable[Node], signals: set) -> List[Node]:
    """The signal first, then by bytes (largest first), then by path."""
    return sorted(members, key=lambda m: (m.path not in signals, -m.nbytes, m.path))


def _describe_set(members: Sequence[Node], signals: set, meta: bool) -> str:
    n = members[0].shape[0]
    what = (f"row i of the {len(members)} datasets with {_rows(n)}" if len(members) > 1
            else f"row i of {members[0].path}")
    notes = []
    if any(m.path in signals for m in members):
        notes.append("holds the NeXus signal")
    if meta:
        notes.append("under header/metadata")
    return what + (f" ({'; '.join(notes)})" if notes else "")


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n:,} rows"


def _top(path: str) -> str:
    return path.lstrip("/").split("/", 1)[0]


def _narrower(members: Sequence[Node], signals: set) -> List[SampleGuess]:
    """Rule 4: the best set's main dataset alone; and, when the set spans several top-level groups (``/Scan 1``,
    ``/Scan 2``), its datasets in the main dataset's top-level group."""
    main = members[0]
    n = main.shape[0]
    role = "the NeXus signal" if main.path in signals else "the largest array of the guess"
    out = [SampleGuess((main.field_name,), n, f"row i of {main.path} alone ({role})", nbytes=main.nbytes)]
    same = [m for m in members if _top(m.path) == _top(main.path)]
    if 1 < len(same) < len(members):
        out.append(SampleGuess(tuple(m.field_name for m in same), n,
                               f"row i of the {len(same)} datasets with {_rows(n)} under /{_top(main.path)} only",
                               nbytes=sum(m.nbytes for m in same)))
    return out


def guess_samples(nodes: Sequence[Node]) -> Tuple[SampleGuess, ...]:
    """The ways to cut a file into samples, best first (module docstring's rules); () when no dataset can be a
    field.  Depends on the nodes' content only, not on their order."""
    signals = _signals(nodes)
    cands = {n.path: n for n in nodes if not why_not_field(n)}  # one node per path
    out: List[SampleGuess] = []
    for meta in (False, True):
        by_rows: Dict[int, List[Node]] = collections.defaultdict(list)
        for n in cands.values():
            if is_metadata(n.path) == meta:
                by_rows[n.shape[0]].append(n)
        sets = sorted(by_rows.values(), key=lambda ms: _set_key(ms, signals), reverse=True)
        for members in sets:
            members = _ordered(members, signals)
            out.append(SampleGuess(tuple(m.field_name for m in members), members[0].shape[0],
                                   _describe_set(members, signals, meta),
                                   nbytes=sum(m.nbytes for m in members)))
            if len(out) == 1 and len(members) > 1:
                out.extend(_narrower(members, signals))
    return tuple(out[:MAX_GUESSES])


def no_field_reason(nodes: Sequence[Node]) -> str:
    """Why no dataset of ``nodes`` can be a field, in a few words (most common reason first):
    ``"its 10 datasets: scalar (7), strings (3)"``, ``"its one dataset: compound type"``, ``"no dataset
    (2 groups, 1 link)"``."""
    counts = collections.Counter(why_not_field(n) for n in nodes if n.kind == "dataset")
    if not counts:
        kinds = collections.Counter(n.kind for n in nodes)
        parts = [f"{kinds[k]} {k}{'s' if kinds[k] > 1 else ''}" for k in ("group", "link") if kinds[k]]
        return "no dataset" + (f" ({', '.join(parts)})" if parts else "")
    if sum(counts.values()) == 1:
        return f"its one dataset: {next(iter(counts))}"
    parts = ", ".join(f"{reason} ({k})" for reason, k in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"its {sum(counts.values())} datasets: {parts}"


def short_fields(fields: Sequence[str], shown: int = 3) -> str:
    """``"a, b, c and 4 more"``."""
    more = f" and {len(fields) - shown} more" if len(fields) > shown else ""
    return ", ".join(fields[:shown]) + more
