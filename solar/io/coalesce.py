"""Merge the byte ranges of one file's blocks into fewer, larger reads.

Pure arithmetic: arrays in, arrays out, no I/O.  Shapes (n inputs, R ranges):

=====================  ==========  ============================================
``offsets``, lengths   int64[n]    input byte ranges ``[offset, offset+length)``
``starts``             int64[R]    merged range starts, ascending
``lengths``            int64[R]    merged range lengths
``range_of``           int64[n]    range index of each input (input order)
``offset_in_range``    int64[n]    input's first byte minus its range's start
=====================  ==========  ============================================

Inputs are sorted by offset and a neighbour joins the current range when the
gap to it is at most ``max_gap`` bytes and the grown range stays within
``max_read`` bytes.  A single input longer than ``max_read`` gets a range of
its own.  Overlapping inputs (a duplicate request) always share a range, so
ranges never overlap; only such a chain may exceed ``max_read``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..errors import SpecError


@dataclass(frozen=True)
class CoalescePolicy:
    """How far apart two blocks may be to be read together, and how big a read may grow.

    ``enabled=False`` reads every block on its own (``max_gap``/``max_read``
    are then ignored by :meth:`apply`).
    """

    max_gap: int = 1 << 16
    max_read: int = 8 << 20
    enabled: bool = True

    def __post_init__(self):
        for name in ("max_gap", "max_read"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise SpecError(f"{name} must be an integer >= 0 (bytes), got {v!r}")
        if not isinstance(self.enabled, bool):
            raise SpecError(f"coalesce must be True or False, got {self.enabled!r}")

    def apply(self, offsets, lengths) -> Ranges:
        """:func:`coalesce` with this policy (one range per input when disabled)."""
        if not self.enabled:
            return coalesce(offsets, lengths, max_gap=0, max_read=0)
        return coalesce(offsets, lengths, max_gap=self.max_gap, max_read=self.max_read)


class Ranges(NamedTuple):
    """Merged reads of :func:`coalesce` (see the module table for shapes)."""

    starts: np.ndarray
    lengths: np.ndarray
    range_of: np.ndarray
    offset_in_range: np.ndarray

    @property
    def n_ranges(self) -> int:
        return int(self.starts.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes the merged reads cover, gaps included."""
        return int(self.lengths.sum())


def coalesce(offsets, lengths, max_gap: int, max_read: int) -> Ranges:
    """Merge byte ranges ``[offsets[i], offsets[i]+lengths[i])`` of one file.

    ``offsets``/``lengths``: int64[n], offsets >= 0, lengths >= 0.  Returns
    :class:`Ranges`; ``max_gap=0, max_read=0`` gives one range per input
    (apart from overlapping inputs, which always share one).
    """
    off = np.asarray(offsets, dtype=np.int64).reshape(-1)
    ln = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if off.shape != ln.shape:
        raise ValueError(f"offsets has {off.shape[0]} entries but lengths has {ln.shape[0]}")
    if off.size and off.min() < 0:
        raise ValueError(f"offsets must be >= 0, got {int(off.min())}")
    if ln.size and ln.min() < 0:
        raise ValueError(f"lengths must be >= 0, got {int(ln.min())}")
    if max_gap < 0 or max_read < 0:
        raise ValueError(f"max_gap and max_read must be >= 0, got {max_gap} and {max_read}")
    n = off.shape[0]
    if n == 0:
        z = np.zeros(0, dtype=np.int64)
        return Ranges(z, z.copy(), z.copy(), z.copy())
    order = np.argsort(off, kind="stable")
    o = off[order]
    e = o + ln[order]
    run_end = np.maximum.accumulate(e)  # (n,) end of everything up to i
    gap = np.empty(n, dtype=np.int64)  # gap[i]: bytes between input i-1's range and input i
    gap[0] = 0
    gap[1:] = o[1:] - run_end[:-1]
    # may a range end after sorted input i?  Only where the next input does not overlap.
    can_split = np.ones(n, dtype=bool)
    can_split[:-1] = gap[1:] >= 0
    hard = np.flatnonzero(gap[1:] > max_gap) + 1  # inputs that must start a range
    seg_lo = np.concatenate([[0], hard])
    seg_hi = np.concatenate([hard, [n]])
    split_at = np.flatnonzero(can_split)  # sorted indices after which a range may end
    first = np.zeros(n, dtype=bool)  # first[i]: sorted input i starts a range
    first[seg_lo] = True
    # Segments (runs of close inputs) wider than max_read are cut greedily.
    wide = np.flatnonzero(run_end[seg_hi - 1] - o[seg_lo] > max_read)
    for s in wide.tolist():
        i, hi = int(seg_lo[s]), int(seg_hi[s])
        while i < hi:
            # last j in [i, hi) with the range [o[i], run_end[j]) within max_read ...
            j = i + int(np.searchsorted(run_end[i:hi], o[i] + max_read, side="right")) - 1
            # ... moved back to a legal split point, or forward if there is none >= i
            k = int(np.searchsorted(split_at, j, side="right")) - 1
            if k >= 0 and split_at[k] >= i:
                j = int(split_at[k])
            else:
                j = int(split_at[np.searchsorted(split_at, i, side="left")])
            if j + 1 < hi:
                first[j + 1] = True
            i = j + 1
    rid_sorted = np.cumsum(first) - 1  # (n,) range id of each sorted input
    heads = np.flatnonzero(first)
    tails = np.concatenate([heads[1:], [n]]) - 1
    starts = o[heads]
    lens = run_end[tails] - starts
    range_of = np.empty(n, dtype=np.int64)
    range_of[order] = rid_sorted
    in_range = np.empty(n, dtype=np.int64)
    in_range[order] = o - starts[rid_sorted]
    return Ranges(starts, lens, range_of, in_range)
