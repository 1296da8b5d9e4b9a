"""Blocks that are always used together, merged into one planning unit.

Two blocks belong to the same *group* when exactly the same samples use them
(a PtychoNN sample's three field rows; the density, pressure and velocity
blocks of one Well frame; the chunks of several fields that hold the same
samples).  Such blocks are needed at the same steps, by the same ranks, so a
planner loses nothing by loading, keeping and evicting them together, and its
per-step balance counts become exact (one unit per sample instead of a
guessed number of blocks per sample).

Pure functions, arrays in, arrays out (N samples, B layout blocks, G groups,
nnz = sample->block links, gnnz = sample->group links):

=====================  ============  ============================================
``group_of``           int64[B]      group of each block; -1 for a block no
                                     sample uses
``group_ptr``          int64[G+1]    CSR pointers into ``group_blocks``
``group_blocks``       int64[Bu]     layout blocks of each group, ascending; Bu =
                                     blocks some sample uses
``g_sample_ptr``       int64[N+1]    CSR pointers into ``g_sample_blocks``
``g_sample_blocks``    int64[gnnz]   groups of each sample, in the order of their
                                     first block in the sample, no repeats
``g_nbytes``           int64[G]      summed decoded bytes of a group's blocks
``g_stored``           int64[G]      summed stored bytes
``g_count``            int64[G]      number of layout blocks in a group
=====================  ============  ============================================

Groups are numbered in the order of their smallest block id, so the result
depends only on the inputs.  A sample that lists a block twice uses it once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray, salt: int) -> np.ndarray:
    """A splitmix64-style finaliser of uint64 values (wraps mod 2**64 by design)."""
    z = x.astype(np.uint64) + np.uint64(salt)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _users(sample_ptr: np.ndarray, sample_blocks: np.ndarray, n_blocks: int) -> Tuple[np.ndarray, np.ndarray]:
    """Transpose to block -> sorted distinct samples: ``(user_ptr int64[B+1], users int64[m])``."""
    n = sample_ptr.shape[0] - 1
    smp = np.repeat(np.arange(n, dtype=np.int64), np.diff(sample_ptr))  # (nnz,) sample of each link
    key = np.unique(sample_blocks.astype(np.int64) * max(n, 1) + smp)  # (m,) sorted by (block, sample)
    blk = key // max(n, 1)
    users = key - blk * max(n, 1)
    user_ptr = np.zeros(n_blocks + 1, dtype=np.int64)
    np.cumsum(np.bincount(blk, minlength=n_blocks), out=user_ptr[1:])
    return user_ptr, users


def block_groups(sample_ptr: np.ndarray, sample_blocks: np.ndarray, n_blocks: int):
    """Merge blocks with identical sets of using samples.

    Returns ``(group_of int64[B], group_ptr int64[G+1], group_blocks int64[Bu])``
    (see the module table).  Exact: candidates are found with a hash of the
    using-sample set and then compared sample by sample.
    """
    sample_ptr = np.asarray(sample_ptr, dtype=np.int64)
    sample_blocks = np.asarray(sample_blocks, dtype=np.int64)
    group_of = np.full(n_blocks, -1, dtype=np.int64)
    if sample_blocks.size == 0:
        return group_of, np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    user_ptr, users = _users(sample_ptr, sample_blocks, n_blocks)
    cnt = np.diff(user_ptr)  # (B,) distinct users per block
    used = np.flatnonzero(cnt > 0)  # (Bu,) ascending
    starts = user_ptr[:-1][used]
    h1 = np.add.reduceat(_mix(users, 1), starts)  # order-free set signatures (users are sorted anyway)
    h2 = np.add.reduceat(_mix(users, 2), starts)
    srt = np.lexsort((used, h2, h1, cnt[used]))  # candidates adjacent, ascending ids inside a run
    order = used[srt]
    c, a1, a2 = cnt[order], h1[srt], h2[srt]
    new_run = np.ones(order.shape[0], dtype=bool)
    new_run[1:] = (c[1:] != c[:-1]) | (a1[1:] != a1[:-1]) | (a2[1:] != a2[:-1])
    run_id = np.cumsum(new_run) - 1  # (Bu,) candidate run of each block in `order`
    # exact check: each block's users equal its run leader's, element by element
    leader = order[np.flatnonzero(new_run)][run_id]  # (Bu,)
    link_blk = np.repeat(order, cnt[order])
    link_leader = np.repeat(leader, cnt[order])
    j = np.arange(link_blk.shape[0], dtype=np.int64) - np.repeat(np.cumsum(cnt[order]) - cnt[order], cnt[order])
    same = users[user_ptr[link_blk] + j] == users[user_ptr[link_leader] + j]
    bad_blocks = np.unique(link_blk[~same])
    key = run_id.copy()  # group key of each block in `order`; hash collisions are split below
    if bad_blocks.size:
        bad_runs = np.unique(run_id[np.isin(order, bad_blocks)])
        next_key = int(run_id.max()) + 1
        for rid in bad_runs.tolist():
            members = np.flatnonzero(run_id == rid)
            seen = {}
            for m in members.tolist():
                b = int(order[m])
                sig = users[user_ptr[b]:user_ptr[b + 1]].tobytes()
                if sig not in seen:
                    seen[sig] = next_key
                    next_key += 1
                key[m] = seen[sig]
    # number groups by their smallest block id
    first = np.full(int(key.max()) + 1, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first, key, order)
    live = np.flatnonzero(first < np.iinfo(np.int64).max)
    rank = np.empty(first.shape[0], dtype=np.int64)
    rank[live[np.argsort(first[live], kind="stable")]] = np.arange(live.shape[0], dtype=np.int64)
    group_of[order] = rank[key]
    G = live.shape[0]
    group_blocks = used[np.argsort(group_of[used], kind="stable")]  # blocks ascending inside each group
    group_ptr = np.zeros(G + 1, dtype=np.int64)
    np.cumsum(np.bincount(group_of[used], minlength=G), out=group_ptr[1:])
    return group_of, group_ptr, group_blocks


@dataclass(frozen=True)
class Groups:
    """Group-level demand and the map back to layout blocks (shapes in the module table)."""

    group_of: np.ndarray
    group_ptr: np.ndarray
    group_blocks: np.ndarray
    g_sample_ptr: np.ndarray
    g_sample_blocks: np.ndarray
    g_nbytes: np.ndarray
    g_stored: np.ndarray
    g_count: np.ndarray

    @property
    def n_groups(self) -> int:
        return int(self.group_ptr.shape[0] - 1)


def group_demand(sample_ptr: np.ndarray, sample_blocks: np.ndarray, block_nbytes: np.ndarray,
                 block_stored: np.ndarray) -> Groups:
    """The demand of ``sample_ptr``/``sample_blocks`` (CSR) rewritten over groups."""
    sample_ptr = np.asarray(sample_ptr, dtype=np.int64)
    sample_blocks = np.asarray(sample_blocks, dtype=np.int64)
    n = sample_ptr.shape[0] - 1
    group_of, group_ptr, group_blocks = block_groups(sample_ptr, sample_blocks, block_nbytes.shape[0])
    G = group_ptr.shape[0] - 1
    g = group_of[sample_blocks]  # (nnz,) group of each link
    smp = np.repeat(np.arange(n, dtype=np.int64), np.diff(sample_ptr))
    _, first = np.unique(smp * max(G, 1) + g, return_index=True)
    first.sort()  # first occurrence of each (sample, group), in link order
    g_sample_blocks = g[first]
    g_sample_ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(smp[first], minlength=n), out=g_sample_ptr[1:])
    if G:
        g_nbytes = np.add.reduceat(np.asarray(block_nbytes, dtype=np.int64)[group_blocks], group_ptr[:-1])
        g_stored = np.add.reduceat(np.asarray(block_stored, dtype=np.int64)[group_blocks], group_ptr[:-1])
    else:
        g_nbytes = g_stored = np.zeros(0, dtype=np.int64)
    return Groups(group_of, group_ptr, group_blocks, g_sample_ptr, g_sample_blocks, g_nbytes, g_stored,
                  np.diff(group_ptr))


def expand(ids: np.ndarray, ptr: np.ndarray, group_ptr: np.ndarray, group_blocks: np.ndarray):
    """Group-id lists with CSR pointers -> layout-block lists with CSR pointers.

    ``ids`` int64[m] group ids, ``ptr`` int64[R+1] (``ptr[-1] == m``); returns
    ``(blocks int64[M], new_ptr int64[R+1])`` where each group is replaced by its
    blocks in ascending order and row i covers the same groups as before.
    """
    ids = np.asarray(ids, dtype=np.int64)
    sizes = group_ptr[ids + 1] - group_ptr[ids]  # (m,)
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if ends.size else 0
    offs = np.arange(total, dtype=np.int64) - np.repeat(ends - sizes, sizes)
    blocks = group_blocks[np.repeat(group_ptr[ids], sizes) + offs]
    cum = np.zeros(ids.shape[0] + 1, dtype=np.int64)
    cum[1:] = ends
    return blocks, cum[np.asarray(ptr, dtype=np.int64)]
