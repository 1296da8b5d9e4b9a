"""The Well's ``stats.yaml``: where it is, and its numbers.

The file holds ``{key: {field: value}}`` for keys such as ``mean``/``std``/``rms`` (and
their ``_delta`` variants); a value is a number for a scalar field, a list of numbers
for a vector field (one per component) and a list of lists for a rank-2 tensor field.
It is read with PyYAML when installed (as The Well does), else with :func:`parse_stats`,
a reader of that subset of YAML's block style.
"""
from __future__ import annotations

import math
import os
import re
from typing import List, Optional, Tuple

from ..errors import LayoutError

STATS_NAME = "stats.yaml"
_NUMBER = re.compile(r"^[-+]?(\d[\d_]*\.?[\d_]*|\.\d[\d_]*)([eE][-+]?\d+)?$")
_SPECIAL = {".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf, ".nan": math.nan}


def find_stats(data_files) -> Optional[str]:
    """The ``stats.yaml`` that goes with these data files, or None.

    Looked for where The Well keeps it (``{dataset}/stats.yaml`` for files in
    ``{dataset}/data/{split}/``), then next to the files' folder and in it.
    """
    for path in data_files:
        folder = os.path.dirname(os.path.abspath(path))
        for cand in (os.path.dirname(os.path.dirname(folder)), os.path.dirname(folder), folder):
            full = os.path.join(cand, STATS_NAME)
            if os.path.isfile(full):
                return full
    return None


def read_stats(path: str) -> dict:
    """``{key: {field: float | list}}`` from a ``stats.yaml``; a LayoutError naming the file if unreadable."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise LayoutError(f"cannot read {path}: {exc}") from None
    try:
        import yaml
    except ImportError:
        table = parse_stats(text, path)
    else:
        try:
            table = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise LayoutError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise LayoutError(f"{path} is not a stats file: expected a mapping of statistic -> field -> value")
    return table


def _scalar(text: str, where: str):
    """A YAML number (int, float, ``.inf``, ``.nan``), or a one-line flow list ``[1.0, 2.0]`` or
    mapping ``{a: 1.0}`` of them."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        return [_scalar(t, where) for t in _split_flow(text[1:-1])]
    if text.startswith("{") and text.endswith("}"):
        pairs = [t.partition(":") for t in _split_flow(text[1:-1])]
        if not all(sep for _, sep, _ in pairs):
            raise LayoutError(f"{where}: {text!r} is not a mapping of numbers")
        return {k.strip().strip("'\""): _scalar(v, where) for k, _, v in pairs}
    if text.lower() in _SPECIAL:
        return _SPECIAL[text.lower()]
    if _NUMBER.match(text):
        clean = text.replace("_", "")
        return int(clean) if re.fullmatch(r"[-+]?\d+", clean) else float(clean)
    raise LayoutError(f"{where}: {text!r} is not a number (install PyYAML to read general YAML)")


def _split_flow(inner: str) -> List[str]:
    """The items inside a flow list or mapping (``1.0, [2.0, 3.0]``), split at top-level commas."""
    items, depth, start = [], 0, 0
    for k, ch in enumerate(inner):
        depth += (ch in "[{") - (ch in "]}")
        if ch == "," and depth == 0:
            items.append(inner[start:k])
            start = k + 1
    items.append(inner[start:])
    return [t for t in items if t.strip()]


def _is_item(content: str) -> bool:
    """A sequence item line: ``-`` alone or ``- value``."""
    return content == "-" or content.startswith("- ")


def _lines(text: str, path: str) -> List[Tuple[int, str, int]]:
    """``(indent, content, line number)`` of each line with content; comments dropped."""
    out = []
    for no, raw in enumerate(text.splitlines(), 1):
        body = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if body.strip() and body.strip() != "---":
            if "\t" in body[:len(body) - len(body.lstrip())]:
                raise LayoutError(f"{path}:{no}: tab in indentation")
            out.append((len(body) - len(body.lstrip()), body.strip(), no))
    return out


def parse_stats(text: str, path: str = STATS_NAME):
    """The block-style YAML of a stats file: nested mappings and sequences of numbers.

    Handles what ``yaml.dump`` writes for such data (``key:`` then an indented block,
    sequences at the key's indent, compact nested ``- - x`` items) and flow lists.
    """
    lines = _lines(text, path)
    if not lines:
        return None
    value, end = _block(lines, 0, lines[0][0], path)
    if end != len(lines):
        raise LayoutError(f"{path}:{lines[end][2]}: unexpected indentation")
    return value


def _block(lines, i: int, indent: int, path: str):
    """Parse the mapping or sequence starting at line ``i`` (at ``indent``); returns ``(value, next line)``."""
    is_seq = _is_item(lines[i][1])
    out = [] if is_seq else {}
    while i < len(lines) and lines[i][0] == indent:
        _, content, no = lines[i]
        where = f"{path}:{no}"
        if is_seq != _is_item(content):
            if is_seq:  # the sequence of a "key:" line at the key's indent ends at the next key
                break
            raise LayoutError(f"{where}: a sequence item among mapping keys")
        if is_seq:
            after = content[1:]
            item, i = _item(lines, i, indent, after.lstrip(), where, path,
                            inner=indent + len(content) - len(after.lstrip()))
            out.append(item)
        else:
            key, sep, rest = content.partition(":")
            if not sep:
                raise LayoutError(f"{where}: expected 'key: value', got {content!r}")
            item, i = _item(lines, i, indent, rest.strip(), where, path, inner=None)
            out[key.strip().strip("'\"")] = item
    return out, i


def _item(lines, i: int, indent: int, rest: str, where: str, path: str, inner: Optional[int]):
    """The value of a mapping entry (``inner`` None) or sequence item whose text after ``key:`` /
    ``-`` is ``rest``; ``inner``: the column where ``rest`` starts on a sequence item's line."""
    key_line = inner is None
    if rest and (key_line or not (_is_item(rest) or ": " in rest)):
        return _scalar(rest, where), i + 1
    if rest:  # "- - 1.0" or "- key: v": a block that starts on this line, at column ``inner``
        patched = lines[:i] + [(inner, rest, lines[i][2])] + lines[i + 1:]
        value, end = _block(patched, i, inner, path)
        return value, end
    nxt = i + 1
    if nxt < len(lines) and (lines[nxt][0] > indent or (key_line and lines[nxt][0] == indent
                                                          and _is_item(lines[nxt][1]))):
        return _block(lines, nxt, lines[nxt][0], path)
    return None, nxt
