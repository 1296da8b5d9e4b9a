"""The planner kernels' hash table of resident (buffer, unit) pairs and their per-buffer lazy max-heaps of
``(priority, unit)``: int64 arrays and open addressing, shared by :mod:`.engine` and :mod:`.peer_engine`.

Pure: arrays in, arrays out; no I/O, no MPI, no clock.
"""
from __future__ import annotations

import numba as nb
import numpy as np

from .kernel import EMPTY, TOMB

_GOLD = np.uint64(11400714819323198485)


@nb.njit(inline="always", cache=True)
def _slot(key, mask):
    return np.int64((np.uint64(key) * _GOLD) >> np.uint64(24)) & mask  # wraps mod 2**64 by design


@nb.njit(cache=True, no_cpython_wrapper=True)
def ht_find(keys, key):
    mask = keys.shape[0] - 1
    h = _slot(key, mask)
    while True:
        k = keys[h]
        if k == key:
            return h
        if k == EMPTY:
            return -1
        h = (h + 1) & mask


@nb.njit(cache=True, no_cpython_wrapper=True)
def ht_insert(keys, key):
    """Slot for a key known to be absent; ``-slot-1`` when it reused a tombstone."""
    mask = keys.shape[0] - 1
    h = _slot(key, mask)
    while keys[h] >= 0:
        h = (h + 1) & mask
    was_tomb = keys[h] == TOMB
    keys[h] = key
    return -h - 1 if was_tomb else h


@nb.njit(cache=True, no_cpython_wrapper=True)
def heap_push(hk, hb, hn, r, key, blk):
    i = hn[r]
    hn[r] = i + 1
    while i > 0:
        p = (i - 1) >> 1
        if hk[r, p] >= key:
            break
        hk[r, i] = hk[r, p]
        hb[r, i] = hb[r, p]
        i = p
    hk[r, i] = key
    hb[r, i] = blk


@nb.njit(cache=True, no_cpython_wrapper=True)
def heap_pop(hk, hb, hn, r):
    key = hk[r, 0]
    blk = hb[r, 0]
    n = hn[r] - 1
    hn[r] = n
    if n > 0:
        lk = hk[r, n]
        lb = hb[r, n]
        i = 0
        while True:
            c = 2 * i + 1
            if c >= n:
                break
            if c + 1 < n and hk[r, c + 1] > hk[r, c]:
                c += 1
            if hk[r, c] <= lk:
                break
            hk[r, i] = hk[r, c]
            hb[r, i] = hb[r, c]
            i = c
        hk[r, i] = lk
        hb[r, i] = lb
    return key, blk


@nb.njit(cache=True, no_cpython_wrapper=True)
def heap_compact(hk, hb, hn, r, keys, prio, n_blocks):
    """Drop stale entries of rank r's heap and re-heapify."""
    m = 0
    for i in range(hn[r]):
        blk = hb[r, i]
        h = ht_find(keys, r * n_blocks + blk)
        if h >= 0 and prio[h] == hk[r, i]:
            hk[r, m] = hk[r, i]
            hb[r, m] = blk
            m += 1
    hn[r] = 0
    tk = hk[r, :m].copy()
    tb = hb[r, :m].copy()
    for i in range(m):
        heap_push(hk, hb, hn, r, tk[i], tb[i])


@nb.njit(cache=True, no_cpython_wrapper=True)
def heap_push_room(hk, hb, hn, r, key, blk, keys, prio, n_blocks, heap_cap):
    """Push onto rank r's heap, compacting stale entries first when it is full; False if still full."""
    if hn[r] >= heap_cap:
        heap_compact(hk, hb, hn, r, keys, prio, n_blocks)
        if hn[r] >= heap_cap:
            return False
    heap_push(hk, hb, hn, r, key, blk)
    return True


@nb.njit(cache=True, nogil=True)
def ht_rebuild(keys, prio, used, new_keys, new_prio, new_used):
    """Copy live entries into fresh (EMPTY-filled) arrays, dropping tombstones."""
    for i in range(keys.shape[0]):
        if keys[i] >= 0:
            h = ht_insert(new_keys, keys[i])
            new_prio[h] = prio[i]
            new_used[h] = used[i]
