"""Regroup one epoch's plan from step-major (what the engine emits) to rank-major
(what the schedule file stores, so that each rank reads one contiguous slice).

Pure numba kernels: arrays in, arrays out.  S steps, P ranks, T positions.
"""
from __future__ import annotations

import numba as nb
import numpy as np


@nb.njit(cache=True)
def samples_rank_major(indices, bounds, rank_of, P):
    """Sample ids of each (rank, step), rank-major, keeping position order inside a step.

    ``indices`` int64[T], ``bounds`` int64[S+1], ``rank_of`` int32[T] ->
    ``(out int64[T], count int64[P, S])``; rank r's samples are
    ``out[count[:r].sum() : count[:r+1].sum()]``, step by step.
    """
    S = bounds.shape[0] - 1
    count = np.zeros((P, S), dtype=np.int64)
    for s in range(S):
        for i in range(bounds[s], bounds[s + 1]):
            count[rank_of[i], s] += 1
    fill = np.empty((P, S), dtype=np.int64)
    acc = 0
    for r in range(P):
        for s in range(S):
            fill[r, s] = acc
            acc += count[r, s]
    out = np.empty(indices.shape[0], dtype=np.int64)
    for s in range(S):
        for i in range(bounds[s], bounds[s + 1]):
            r = rank_of[i]
            out[fill[r, s]] = indices[i]
            fill[r, s] += 1
    return out, count


@nb.njit(cache=True)
def csr_rank_major(ptr, data, S, P):
    """Rows of a CSR over (step, rank) (``ptr`` int64[S*P+1], step-major) re-laid rank-major.

    Returns ``(out int64[nnz], count int64[P, S])``.
    """
    count = np.empty((P, S), dtype=np.int64)
    for s in range(S):
        for r in range(P):
            count[r, s] = ptr[s * P + r + 1] - ptr[s * P + r]
    out = np.empty(ptr[S * P] - ptr[0], dtype=np.int64)
    k = 0
    for r in range(P):
        for s in range(S):
            lo = ptr[s * P + r]
            for j in range(count[r, s]):
                out[k] = data[lo + j]
                k += 1
    return out, count


def split_rows(count: np.ndarray):
    """``count`` int64[P, S] -> int64[P+1] start of each rank's slice in the rank-major array."""
    starts = np.zeros(count.shape[0] + 1, dtype=np.int64)
    np.cumsum(count.sum(axis=1), out=starts[1:])
    return starts
