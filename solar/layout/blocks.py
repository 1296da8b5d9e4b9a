"""Pure block arithmetic: which chunks of a dataset each sample touches.

Arrays in, arrays out; no h5py.  A dataset's *block grid* is its HDF5 chunk grid,
or for contiguous data a virtual grid whose blocks are one step along each
sample-indexing axis and the full extent along the others (so a contiguous
sample's block is exactly its byte range, and overlapping windows share frames).

Roles name the leading axes of a field dataset:
``s`` sample row, ``b`` trajectory, ``t`` time (a window of frames), in that
order; the remaining axes are read whole.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

VALID_ROLES = ("", "s", "b", "t", "bt")


def virtual_chunks(shape: Sequence[int], roles: str) -> Tuple[int, ...]:
    """Block shape of a contiguous dataset: 1 along role axes, full elsewhere."""
    return tuple([1] * len(roles) + list(shape[len(roles):]))


def chunk_grid(shape: Sequence[int], chunks: Sequence[int]) -> Tuple[int, ...]:
    """Number of chunks along each axis (edge chunks count)."""
    return tuple(-(-int(s) // int(c)) for s, c in zip(shape, chunks))


def field_chunk_lists(shape, chunks, roles: str, index: Optional[np.ndarray],
                      t0: Optional[np.ndarray], window: int = 1, dt: int = 1,
                      n_samples: Optional[int] = None):
    """Chunk linear indices touched by each of S samples of one field.

    ``index`` (int64[S]) is the row (role ``s``) or trajectory (role ``b``) of
    each sample, ``t0`` (int64[S]) its first frame (role ``t``); frames are
    ``t0 + dt * arange(window)``.  Returns ``(counts int64[S], lin int64[sum])``,
    ``lin`` in sample order, each sample's chunks ascending.
    """
    if roles not in VALID_ROLES:
        raise ValueError(f"invalid roles {roles!r}; valid: {VALID_ROLES}")
    grid = chunk_grid(shape, chunks)
    n_other = int(np.prod(grid[len(roles):], dtype=np.int64))
    S = n_samples if n_samples is not None else (len(index) if index is not None else len(t0))
    if roles in ("s", "b"):
        lead = (np.asarray(index, dtype=np.int64) // chunks[0])[:, None]  # (S, 1)
    elif roles == "":
        lead = np.zeros((S, 1), dtype=np.int64)  # (S, 1): the whole dataset
    else:
        ax = roles.index("t")
        frames = np.asarray(t0, dtype=np.int64)[:, None] + dt * np.arange(window, dtype=np.int64)  # (S, window)
        lead = frames // chunks[ax]  # (S, window) time-chunk coordinate of each frame
        if roles == "bt":
            lead = (np.asarray(index, dtype=np.int64) // chunks[0])[:, None] * grid[1] + lead
    keep = np.ones(lead.shape, dtype=bool)
    keep[:, 1:] = lead[:, 1:] != lead[:, :-1]  # frames are ascending: drop repeats
    counts = keep.sum(axis=1).astype(np.int64) * n_other
    lead_flat = lead[keep]  # (sum of kept,) in sample-major order
    lin = (lead_flat[:, None] * n_other + np.arange(n_other, dtype=np.int64)).reshape(-1)  # (sum counts,)
    return counts, lin


def merge_fields(per_field_counts: Sequence[np.ndarray], per_field_ids: Sequence[np.ndarray]):
    """Interleave per-field block lists into one CSR, field order inside each sample.

    Returns ``(ptr int64[S+1], ids int64[nnz])``.
    """
    counts = np.stack(per_field_counts, axis=0)  # (F, S)
    total = counts.sum(axis=0)
    ptr = np.zeros(total.shape[0] + 1, dtype=np.int64)
    np.cumsum(total, out=ptr[1:])
    out = np.empty(int(ptr[-1]), dtype=np.int64)
    before = np.zeros(total.shape[0], dtype=np.int64)  # block count of earlier fields, per sample
    for c, ids in zip(per_field_counts, per_field_ids):
        start_in_field = np.zeros(len(c) + 1, dtype=np.int64)
        np.cumsum(c, out=start_in_field[1:])
        owner = np.repeat(np.arange(len(c), dtype=np.int64), c)  # sample of each entry
        rank = np.arange(len(ids), dtype=np.int64) - start_in_field[owner]
        out[ptr[owner] + before[owner] + rank] = ids
        before += c
    return ptr, out
