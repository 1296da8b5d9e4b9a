"""An HDF5 file's metadata tree as :class:`~solar.layout.guess.Node` records (what ``solar inspect`` lists and
:func:`~solar.layout.guess.guess_samples` reads).  Nothing here reads data.

Every group, dataset and link is visited once, in HDF5's name order, depth first; an object reached again
through another hard link is recorded as a link to the path it was first found at (so a group is walked once
and a dataset counted once); soft links are recorded as links (their target is visited under its own path); an
external link to a dataset is recorded as that dataset (solar follows such links, see docs/layouts.md), an
external link to a group is recorded but not walked.  Anything HDF5 or h5py cannot read about one object (a
damaged header, a type numpy has no equivalent for) becomes that node's ``problem``; the walk goes on.  At
most :data:`MAX_NODES` nodes are read (``complete`` False beyond).
"""
from __future__ import annotations

from typing import List, NamedTuple, Tuple

import h5py
import numpy as np

from ..io.filters import Filter, decodable, filter_name
from ..io.h5open import follow
from .guess import Node
from .h5meta import H5_ERRORS

MAX_NODES = 100_000
"""Nodes read at most (a huge or looping file stops there)."""


class Tree(NamedTuple):
    nodes: Tuple[Node, ...]
    complete: bool  # False: the walk stopped at MAX_NODES


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _text(value) -> str:
    """An attribute value as text (str, bytes, a one-element array of either); "" otherwise."""
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.reshape(-1)[0]
    if isinstance(value, (bytes, np.bytes_)):
        return value.decode("utf-8", "replace")
    if isinstance(value, str):
        return value
    return ""


def _attr(obj, name: str):
    """Attribute ``name`` of ``obj`` or None (also when it cannot be read)."""
    try:
        return obj.attrs[name] if name in obj.attrs else None
    except H5_ERRORS:
        return None


def describe_dtype(dt: np.dtype) -> Tuple[str, str]:
    """``(name, problem)``: numpy's name of a numeric dtype and "", or a description and why it cannot be a
    field (``("string", "strings")``, ``("compound (6 fields)", "compound type")``...)."""
    if h5py.check_string_dtype(dt) is not None:
        return ("string" if dt.kind == "O" else f"string ({dt.itemsize} bytes)"), "strings"
    if h5py.check_vlen_dtype(dt) is not None:
        return f"variable-length {h5py.check_vlen_dtype(dt)}", "variable-length"
    if h5py.check_ref_dtype(dt) is not None:
        return "reference", "references"
    if dt.fields is not None:
        return f"compound ({len(dt.fields)} fields)", "compound type"
    if dt.subdtype is not None:
        return f"array type {dt.subdtype[0]}{dt.subdtype[1]}", "array type"
    if dt.kind in "biufc":
        return str(dt), ""
    return (f"opaque ({dt.itemsize} bytes)" if dt.kind == "V" else str(dt)), "non-numeric type"


def _filters(dsid) -> Tuple[Tuple[str, ...], str, str]:
    """``(names, problem, note)`` of a dataset's filter pipeline."""
    plist = dsid.get_create_plist()
    names, problem, note = [], "", ""
    for i in range(plist.get_nfilters()):
        code, flags, values, _ = plist.get_filter(i)
        f = Filter(int(code), int(flags), tuple(int(v) for v in values))
        names.append(f.name)
        if not decodable(f):
            if h5py.h5z.filter_avail(f.id):
                note = note or f"filter {f.name} is decoded by HDF5 only (h5py reader)"
            elif not problem:
                problem = f"filter {filter_name(f.id)} (id {f.id}) not decodable here (install its plugin, e.g. " \
                          f"hdf5plugin)"
    return tuple(names), problem, note


def dataset_node(path: str, ds: h5py.Dataset, signal: bool = False, target: str = "") -> Node:
    """The :class:`Node` of dataset ``ds`` found at ``path``; what cannot be read becomes its ``problem``."""
    base = dict(path=path, kind="dataset", signal=signal, target=target)
    try:
        shape = None if ds.shape is None else tuple(int(s) for s in ds.shape)
        chunks = None if ds.chunks is None else tuple(int(c) for c in ds.chunks)
        filters, f_problem, note = _filters(ds.id)
        stored = int(ds.id.get_storage_size())
    except H5_ERRORS as exc:
        return Node(**base, shape=None, dtype="?", problem=f"unreadable metadata: {_first_line(exc)}")
    try:
        dt = ds.dtype
    except H5_ERRORS as exc:  # a type numpy has no equivalent for (long double, HDF5 time)
        return Node(**base, shape=shape, chunks=chunks, filters=filters, stored_nbytes=stored, dtype="?",
                    problem=f"unreadable type: {_first_line(exc)}")
    name, problem = describe_dtype(dt)
    if not signal:
        flag = _attr(ds, "signal")  # NeXus before 2014: signal=1 on the dataset itself
        signal = flag is not None and _text(flag).strip() == "1" or (
            isinstance(flag, (int, np.integer)) and int(flag) == 1)
    return Node(**{**base, "signal": bool(signal)}, shape=shape, dtype=name, itemsize=int(dt.itemsize),
                chunks=chunks, filters=filters, stored_nbytes=stored, problem=problem or f_problem, note=note)


def read_tree(h5f: h5py.File, limit: int = MAX_NODES) -> Tree:
    """Every object of the open file ``h5f`` (module docstring)."""
    nodes: List[Node] = []
    seen = {}  # object id -> the first path it was found at (hard links: one object, walked once)
    stack = [(h5f, "")]
    try:
        seen[h5f.id] = "/"
    except H5_ERRORS:
        pass
    while stack:
        group, prefix = stack.pop()
        children = []
        signal = _text(_attr(group, "signal"))
        try:
            names = list(group.keys())
        except H5_ERRORS as exc:
            nodes.append(Node(prefix or "/", "group", problem=f"cannot list its members: {_first_line(exc)}"))
            continue
        for name in names:
            if len(nodes) >= limit:
                return Tree(tuple(nodes), False)
            node, sub = _child(group, name, f"{prefix}/{name}", name == signal, seen)
            nodes.append(node)
            if sub is not None:
                children.append((sub, node.path))
        stack.extend(reversed(children))  # depth first, in name order
    return Tree(tuple(nodes), True)


def _child(group: h5py.Group, name: str, path: str, signal: bool, seen: dict):
    """``(node, group to walk or None)`` of member ``name`` of ``group``."""
    try:
        link = group.get(name, getlink=True)
    except H5_ERRORS as exc:
        return Node(path, "link", problem=f"unreadable link: {_first_line(exc)}"), None
    if isinstance(link, h5py.SoftLink):
        return Node(path, "link", target=link.path, signal=signal), None
    external = isinstance(link, h5py.ExternalLink)
    target = f"{link.filename}:{link.path}" if external else ""
    try:
        obj = follow(group, name)
    except H5_ERRORS as exc:
        why = "cannot be opened (missing file or target)" if external else f"unreadable: {_first_line(exc)}"
        return Node(path, "link" if external else "dataset", shape=None, target=target, problem=why), None
    if not external:  # a second hard link to an object already seen: a link to its first path
        try:
            first = seen.setdefault(obj.id, path)
        except H5_ERRORS:
            first = path
        if first != path:
            return Node(path, "link", target=first, signal=signal, note="hard link"), None
    if isinstance(obj, h5py.Dataset):
        return dataset_node(path, obj, signal, target), None
    if isinstance(obj, h5py.Group):
        node = Node(path, "group", nx_class=_text(_attr(obj, "NX_class")), target=target)
        return node, (None if external else obj)  # an external group is not walked: it may lead anywhere
    return Node(path, "datatype", target=target), None

