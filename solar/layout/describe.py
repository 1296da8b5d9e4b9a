"""``solar inspect FILE`` on one HDF5 file: its tree, what a sample is (best guess and alternatives, each
with the spec that selects it), and the layout summary of the chosen spec."""
from __future__ import annotations

import glob
import json
import os
import shlex
from dataclasses import replace
from typing import List, Tuple

from ..errors import LayoutError, SolarError, SpecError
from .build import build_layout, open_h5
from .detect import known_spec, no_array_message, unreadable
from .guess import SampleGuess, guess_samples, short_fields
from .h5meta import H5_ERRORS
from .spec import SPEC_FILENAME, LayoutSpec
from .summary import format_summary, human_bytes, summarize
from .tree import read_tree

MAX_TREE_LINES = 40
"""Datasets listed in the text (``--json`` lists every object)."""
MAX_PATH_WIDTH = 56


def _choices(path: str) -> Tuple[list, tuple, bool]:
    """``([(spec, guess), ...], nodes, complete)``: the spec solar would use first (a known layout, else the
    best guess), then the alternatives."""
    root, name = os.path.split(os.path.abspath(path))
    stem = os.path.splitext(name)[0] or name
    with open_h5(path) as f:
        try:
            tree = read_tree(f)
            try:
                known = known_spec(f, path, root, name)
            except SolarError:
                raise
            except H5_ERRORS:
                known = None
        except SolarError:
            raise
        except H5_ERRORS as exc:
            raise unreadable(path, exc) from None
    out = []
    if known is not None:
        spec, why = known
        rows = _rows_of(tree.nodes, spec)
        out.append((spec, SampleGuess(spec.fields, rows, why + " (what solar plan FILE uses)", kind=spec.kind)))
    for g in guess_samples(tree.nodes):
        if known is not None and g.fields == known[0].fields and known[0].kind == "rows":
            continue
        out.append((LayoutSpec("rows", (glob.escape(name),), g.fields, root=root, name=stem), g))
    return out, tree.nodes, tree.complete


def _rows_of(nodes, spec: LayoutSpec):
    """Samples of a ``rows`` spec over this file (None for other kinds: the layout knows)."""
    if spec.kind != "rows":
        return None
    first = next((n for n in nodes if n.path == "/" + spec.fields[0]), None)
    return first.shape[0] if first is not None and first.shape else None


def describe_file(path: str, alternative: int = 0, progress: bool = False) -> dict:
    """JSON-ready description of HDF5 file ``path`` (what ``solar inspect FILE --json`` prints).

    Keys: ``file`` (path, bytes, groups, datasets, links, complete), ``tree`` (every object, see
    :meth:`Node.to_dict`), ``guess`` (the spec solar would use: kind, fields, samples, why, spec),
    ``alternatives`` (the same, numbered from 1), ``chosen`` (``alternative``), and the keys of
    :func:`~solar.layout.summary.summarize` for the chosen spec's layout, or ``layout_error`` (one line)
    when that layout cannot be built.  A LayoutError when no dataset can be a field; a SpecError for an
    ``alternative`` the file does not have.
    """
    choices, nodes, complete = _choices(path)
    if not choices:
        raise LayoutError(no_array_message(path, nodes))
    if not 0 <= alternative < len(choices):
        have = f"alternatives 1 to {len(choices) - 1}" if len(choices) > 1 else "no alternative"
        raise SpecError(f"alternative {alternative} does not exist: {path} has {have}")
    listed = [{**g.to_dict(), "spec": spec.to_dict()} for spec, g in choices]
    out = {}
    spec = choices[alternative][0]
    try:
        layout = build_layout(spec, progress=progress)
    except LayoutError as exc:
        out["layout_error"] = str(exc)
    else:
        out.update(summarize(layout))
        listed[alternative]["samples"] = layout.n_samples
    kinds = [n.kind for n in nodes]
    out.update(file={"path": path, "bytes": os.path.getsize(path), "groups": kinds.count("group"),
                     "datasets": kinds.count("dataset"), "links": kinds.count("link"), "complete": complete},
               tree=[n.to_dict() for n in nodes], guess=listed[0], alternatives=listed[1:], chosen=alternative)
    return out


def chosen_spec(d: dict, root: str) -> LayoutSpec:
    """The chosen spec of :func:`describe_file`'s dict, its ``files`` relative to folder ``root``."""
    spec = LayoutSpec.from_dict((d["alternatives"][d["chosen"] - 1] if d["chosen"] else d["guess"])["spec"],
                                root=root)
    data = os.path.abspath(d["file"]["path"])
    return replace(spec, files=(glob.escape(os.path.relpath(data, root)),))


def spec_destination(path: str, overwrite: bool) -> str:
    """Where ``--save-spec path`` writes: ``path`` (a .json file in an existing folder) or
    ``path/solar-layout.json`` for a folder; a SpecError naming it otherwise, or if it exists and not
    ``overwrite``."""
    dest = os.path.join(path, SPEC_FILENAME) if os.path.isdir(path) else path
    folder = os.path.dirname(os.path.abspath(dest))
    if not dest.endswith(".json"):
        if path.endswith(os.sep) or path.endswith("/"):  # meant as a folder
            raise SpecError(f"--save-spec {path!r}: folder {os.path.abspath(path)} does not exist")
        raise SpecError(f"--save-spec {path!r} must end with .json (or be a folder), as solar plan takes a spec")
    if not os.path.isdir(folder):
        raise SpecError(f"--save-spec {path!r}: folder {folder} does not exist")
    if os.path.exists(dest) and not overwrite:
        raise SpecError(f"--save-spec {dest!r} exists; give --overwrite to replace it")
    return dest


def save_spec(spec: LayoutSpec, dest: str) -> str:
    """Write ``spec`` to ``dest`` whole or not at all (a temporary name, then renamed)."""
    from ..atomic import os_reason, remove_quietly, temp_name
    from ..errors import WriteError
    tmp = temp_name(dest)
    try:
        spec.save(tmp)
        os.replace(tmp, dest)
    except OSError as exc:
        remove_quietly(tmp)
        raise WriteError(f"cannot write the spec {dest}: {os_reason(exc)}") from None
    return dest


# ---------------------------------------------------------------------- text
def _tree_lines(d: dict) -> List[str]:
    nodes = [n for n in d["tree"] if n["kind"] == "dataset" and _listed(n)]
    shown = nodes[:MAX_TREE_LINES]
    lines = []
    if shown:
        w = min(MAX_PATH_WIDTH, max(len(n["path"]) for n in shown))
        wt = max(len(n["dtype"]) for n in shown)
        for n in shown:
            shape = "?" if n["shape"] is None else str(tuple(n["shape"]))
            store = "contiguous" if n["chunks"] is None else "chunks " + "x".join(map(str, n["chunks"]))
            flags = []
            if n.get("signal"):
                flags.append("NeXus signal")
            if n["why_not_field"]:
                flags.append(f"not a field: {n['why_not_field']}")
            if n.get("target"):
                flags.append(f"[stored in {n['target']}]")
            if n.get("note"):
                flags.append(f"[{n['note']}]")
            lines.append(f"  {n['path']:<{w}} {shape:<16} {n['dtype']:<{wt}} {store:<16} "
                         f"{'+'.join(n['filters']) or '-':<12} {'  '.join(flags)}".rstrip())
    hidden = []
    if len(nodes) > len(shown):
        hidden.append(_count(len(nodes) - len(shown), "more array"))
    small = sum(1 for n in d["tree"] if n["kind"] == "dataset" and not _listed(n))
    if small:
        hidden.append(f"{small} scalar and one-value dataset{'s' if small > 1 else ''}")
    links = sum(1 for n in d["tree"] if n["kind"] == "link")
    if links:
        hidden.append(_count(links, "link"))
    if hidden:
        lines.append(f"  (not listed: {', '.join(hidden)}; --json lists every object)")
    return lines


def _listed(n: dict) -> bool:
    """A dataset the text lists: 2+ values (any type), or one whose shape cannot be read."""
    if n["shape"] is None:
        return True
    size = 1
    for k in n["shape"]:
        size *= k
    return size > 1


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _choice_line(c: dict) -> str:
    n = "? samples" if c["samples"] is None else f"{c['samples']:,} sample{'' if c['samples'] == 1 else 's'}"
    return f"{c['why']}: {n}"


def format_description(d: dict) -> str:
    """Human-readable text of :func:`describe_file`'s dict."""
    f = d["file"]
    lines = [f"file: {f['path']} ({human_bytes(f['bytes'])}): {_count(f['groups'], 'group')}, "
             f"{_count(f['datasets'], 'dataset')}, {_count(f['links'], 'link')}"
             + ("" if f["complete"] else " (the walk stopped there: too many objects)")]
    lines.append("arrays: path, shape, dtype, storage, filters")
    lines += _tree_lines(d)
    g = d["guess"]
    lines.append(f"sample (best guess): {_choice_line(g)}")
    lines.append(f"  fields: {short_fields(g['fields'], 8)}")
    lines.append(f"  spec: {json.dumps(g['spec'])}")
    if d["alternatives"]:
        lines.append("alternatives (--alternative K):")
        for k, c in enumerate(d["alternatives"], 1):
            lines.append(f"  {k}. {_choice_line(c)}" + (f"; fields {short_fields(c['fields'])}"
                                                         if len(c["fields"]) > 1 else ""))
    if d["chosen"]:
        c = d["alternatives"][d["chosen"] - 1]
        lines.append(f"chosen: alternative {d['chosen']}; its spec: {json.dumps(c['spec'])}")
    lines.append("")
    if "layout_error" in d:
        lines.append(f"layout: cannot be built: {d['layout_error']}")
    else:
        lines.append(format_summary(d))
    alt = f" --alternative {d['chosen']}" if d["chosen"] else ""
    if "saved_spec" in d:
        q = shlex.quote(d["saved_spec"])
        lines.append(f"saved the spec as {d['saved_spec']}; plan with it: solar plan {q} -P RANKS -b BATCH "
                     f"--buffer-fraction 0.5 -o plan.h5")
    elif "layout_error" not in d:
        lines.append(f"to plan with it: solar inspect {shlex.quote(f['path'])}{alt} --save-spec {SPEC_FILENAME}, "
                     f"then solar plan {SPEC_FILENAME} -P RANKS -b BATCH --buffer-fraction 0.5 -o plan.h5")
    return "\n".join(lines)

