"""What a resumed buffer must read before step ``start``: the plan's resident blocks that are used again
before the plan evicts them.

A rank's plan holds blocks resident that it later evicts without using them again (Belady keeps a
block while nothing nearer needs its space, then gives the space to one used sooner): on a resume
at a mid-epoch step, 17-70% of the resident blocks of a 16,384-sample, f = 0.5 plan are of that
kind.  Reading them would be I/O for nothing; the buffer keeps them as resident without bytes
("ghosts") until the plan evicts them.  Pure: arrays in, arrays out.
"""
from __future__ import annotations

import numpy as np

STEPS_PER_SCAN = 64  # steps of the plan looked at in one vectorised pass


def resident_at(load: np.ndarray, load_ptr: np.ndarray, evict: np.ndarray, evict_ptr: np.ndarray, start: int,
                n_blocks: int) -> np.ndarray:
    """int64[m] ascending: the blocks the plan holds resident when step ``start`` begins (loads minus evictions
    of steps ``< start``)."""
    res = np.zeros(n_blocks, dtype=np.int64)  # (B,) resident count per block
    np.add.at(res, np.asarray(load[:load_ptr[start]], np.int64), 1)
    np.add.at(res, np.asarray(evict[:evict_ptr[start]], np.int64), -1)
    return np.flatnonzero(res > 0)


def _first(blocks: np.ndarray, steps: np.ndarray):
    """``(block ids ascending, the first of ``steps`` at which each appears)``; ``steps`` ascending along
    ``blocks``."""
    ids, at = np.unique(blocks, return_index=True)
    return ids, steps[at]


def _lookup(ids: np.ndarray, steps: np.ndarray, keys: np.ndarray, never: int) -> np.ndarray:
    """int64[k]: the step of each of ``keys`` in ``(ids, steps)``, else ``never``."""
    pos = np.minimum(np.searchsorted(ids, keys), max(ids.shape[0] - 1, 0))
    hit = (ids[pos] == keys) if ids.size else np.zeros(keys.shape[0], bool)
    return np.where(hit, steps[pos] if ids.size else never, never)


def used_before_evicted(resident: np.ndarray, start: int, *, samples: np.ndarray, samples_ptr: np.ndarray,
                        evict: np.ndarray, evict_ptr: np.ndarray, sample_ptr: np.ndarray,
                        sample_blocks: np.ndarray, n_blocks: int, horizon: int = 4096) -> np.ndarray:
    """bool[m]: whether each of ``resident`` (blocks resident at ``start``) is used by a step ``>= start`` before
    the plan evicts it.  Within a step the plan evicts before it trains, so a block evicted and used at the
    same step is not used as resident (the plan loads it again).  A block neither used nor evicted again is not
    needed.  The plan is scanned forward ``STEPS_PER_SCAN`` steps at a time until every block is decided, for
    at most ``horizon`` steps: a block still undecided there counts as needed.

    ``samples``/``samples_ptr``, ``evict``/``evict_ptr``: the rank's per-step lists (int64[G+1] pointers);
    ``sample_ptr``/``sample_blocks``: the sample -> block CSR map."""
    G = samples_ptr.shape[0] - 1
    end, never = min(G, start + int(horizon)), G + 1
    need = np.zeros(n_blocks, dtype=bool)
    pending = np.zeros(n_blocks, dtype=bool)
    pending[resident] = True
    left = int(resident.shape[0])
    lo = start
    while left and lo < end:
        hi = min(end, lo + STEPS_PER_SCAN)
        smp = np.asarray(samples[samples_ptr[lo]:samples_ptr[hi]], np.int64)
        smp_step = np.repeat(np.arange(lo, hi, dtype=np.int64), np.diff(samples_ptr[lo:hi + 1]))  # (n,)
        a, b = sample_ptr[smp], sample_ptr[smp + 1]
        cnt = b - a
        pos = np.arange(int(cnt.sum()), dtype=np.int64) + np.repeat(a - (np.cumsum(cnt) - cnt), cnt)
        blk, blk_step = sample_blocks[pos].astype(np.int64), np.repeat(smp_step, cnt)  # (accesses,) in step order
        keep = pending[blk]
        used = _first(blk[keep], blk_step[keep])
        ev = np.asarray(evict[evict_ptr[lo]:evict_ptr[hi]], np.int64)
        ev_step = np.repeat(np.arange(lo, hi, dtype=np.int64), np.diff(evict_ptr[lo:hi + 1]))  # (evictions,)
        keep = pending[ev]
        gone = _first(ev[keep], ev_step[keep])
        decided = np.union1d(used[0], gone[0])
        need[decided] = _lookup(*used, decided, never) < _lookup(*gone, decided, never)
        pending[decided] = False
        left -= int(decided.shape[0])
        lo = hi
    if left and end < G:  # undecided within the horizon: read them (at the plan's end: never used again)
        need[resident[pending[resident]]] = True
    return need[resident]
