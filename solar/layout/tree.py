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


def _filters(plist) -> Tuple[Tuple[str, ...], str, str]:
    """``(names, problem, note)`` of a dataset creation property list's filter pipeline."""
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


def _signal_flag(oid) -> bool:
    """NeXus before 2014: ``signal=1`` on the dataset itself."""
    if not h5py.h5a.exists(oid, b"signal"):
        return False
    flag = _attr(h5py.Dataset(oid), "signal")
    if isinstance(flag, np.ndarray) and flag.size == 1:
        flag = flag.reshape(-1)[0]
    return _text(flag).strip() == "1" or (isinstance(flag, (int, np.integer)) and int(flag) == 1)


def dataset_node(path: str, dsid, signal: bool = False, target: str = "") -> Node:
    """The :class:`Node` of the dataset ``dsid`` (h5py's low-level ``DatasetID``) found at ``path``; what cannot
    be read becomes its ``problem``."""
    base = dict(path=path, kind="dataset", target=target)
    try:
        space = dsid.get_space()
        shape = None if space.get_simple_extent_type() == h5py.h5s.NULL else tuple(int(s) for s in space.shape)
        plist = dsid.get_create_plist()
        chunks = tuple(int(c) for c in plist.get_chunk()) if plist.get_layout() == h5py.h5d.CHUNKED else None
        filters, f_problem, note = _filters(plist)
        stored = int(dsid.get_storage_size())
        signal = signal or _signal_flag(dsid)
    except H5_ERRORS as exc:
        return Node(**base, signal=signal, shape=None, dtype="?",
                    problem=f"unreadable metadata: {_first_line(exc)}")
    try:
        dt = dsid.dtype
    except H5_ERRORS as exc:  # a type numpy has no equivalent for (long double, HDF5 time)
        return Node(**base, signal=signal, shape=shape, chunks=chunks, filters=filters, stored_nbytes=stored,
                    dtype="?", problem=f"unreadable type: {_first_line(exc)}")
    name, problem = describe_dtype(dt)
    return Node(**base, signal=signal, shape=shape, dtype=name, itemsize=int(dt.itemsize), chunks=chunks,
                filters=filters, stored_nbytes=stored, problem=problem or f_problem, note=note)


def _group_text_attr(gid, name: bytes) -> str:
    if not h5py.h5a.exists(gid, name):
        return ""
    return _text(_attr(h5py.Group(gid), name.decode()))


def read_tree(h5f: h5py.File, limit: int = MAX_NODES) -> Tree:
    """Every object of the open file ``h5f`` (module docstring).  h5py's low-level API: 4x faster than its
    ``Group``/``Dataset`` objects (60 us an object)."""
    nodes: List[Node] = []
    seen = {}  # (file number, object address) -> the first path it was found at, for objects with 2+ hard links
    try:
        root = h5py.h5o.get_info(h5f.id)
        seen[(root.fileno, root.addr)] = "/"
    except H5_ERRORS:
        pass
    stack = [(h5f.id, "")]
    while stack:
        gid, prefix = stack.pop()
        children = []
        try:
            signal = _group_text_attr(gid, b"signal").encode()
            names: List[bytes] = []
            gid.links.iterate(names.append)
        except H5_ERRORS as exc:
            nodes.append(Node(prefix or "/", "group", problem=f"cannot list its members: {_first_line(exc)}"))
            continue
        for bname in names:
            if len(nodes) >= limit:
                return Tree(tuple(nodes), False)
            path = f"{prefix}/{bname.decode('utf-8', 'surrogateescape')}"
            node, sub = _child(h5f, gid, bname, path, bname == signal, seen)
            nodes.append(node)
            if sub is not None:
                children.append((sub, path))
        stack.extend(reversed(children))  # depth first, in name order
    return Tree(tuple(nodes), True)


def _text_of(b) -> str:
    return b.decode("utf-8", "surrogateescape") if isinstance(b, bytes) else str(b)


def _child(h5f: h5py.File, gid, bname: bytes, path: str, signal: bool, seen: dict):
    """``(node, group id to walk or None)`` of member ``bname`` of the group ``gid``."""
    try:
        kind = gid.links.get_info(bname).type
        if kind == h5py.h5l.TYPE_SOFT:
            return Node(path, "link", target=_text_of(gid.links.get_val(bname)), signal=signal), None
        if kind == h5py.h5l.TYPE_EXTERNAL:
            fname, tpath = gid.links.get_val(bname)
            return _external(h5py.Group(gid), bname, path, f"{_text_of(fname)}:{_text_of(tpath)}", signal)
        if kind != h5py.h5l.TYPE_HARD:
            return Node(path, "link", problem="user-defined link, not followed"), None
        oid = h5py.h5o.open(gid, bname)
        info = h5py.h5o.get_info(oid)
    except H5_ERRORS as exc:
        return Node(path, "link", problem=f"unreadable: {_first_line(exc)}"), None
    if info.rc > 1:  # more than one hard link to it: a link to the path it was first found at
        first = seen.setdefault((info.fileno, info.addr), path)
        if first != path:
            return Node(path, "link", target=first, signal=signal, note="hard link"), None
    if isinstance(oid, h5py.h5d.DatasetID):
        return dataset_node(path, oid, signal), None
    if isinstance(oid, h5py.h5g.GroupID):
        try:
            nx = _group_text_attr(oid, b"NX_class")
        except H5_ERRORS:
            nx = ""
        return Node(path, "group", nx_class=nx), oid
    return Node(path, "datatype"), None


def _external(group: h5py.Group, bname: bytes, path: str, target: str, signal: bool):
    """The node of an external link: the dataset it leads to (solar follows such links), a group (not walked: it
    may lead anywhere, even back here), or a link that cannot be opened."""
    try:
        obj = follow(group, bname.decode("utf-8", "surrogateescape"))
    except H5_ERRORS:
        return Node(path, "link", target=target, problem="cannot be opened (missing file or target)"), None
    if isinstance(obj, h5py.Dataset):
        return dataset_node(path, obj.id, signal, target), None
    if isinstance(obj, h5py.Group):
        return Node(path, "group", nx_class=_text(_attr(obj, "NX_class")), target=target), None
    return Node(path, "datatype", target=target), None
