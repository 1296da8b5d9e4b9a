"""The numba kernel shared by every policy: assign a step's samples to ranks, then
run each rank's buffer (hits, loads, evictions) under its byte budget.

Pure: arrays in, arrays out; no I/O, no MPI, no clock.

State kept across epochs (arrays allocated by :func:`solar.scheduler.run.run_policy`):
a hash table of resident ``(rank, block)`` pairs with each entry's eviction
priority, one lazy max-heap of ``(priority, block)`` per rank (stale entries are
skipped when popped), the bytes resident per rank, and ``owner[block]``: for the
routed policy the rank that last used the block (its next use is routed there),
for the others the rank that last loaded it.

Priorities (the heap pops the largest):
``belady``  next use step (``INF`` = never again) - farthest first;
``lru``     minus the last use step - least recently used first;
``fifo``    minus the load step, not refreshed on hits - oldest load first.
"""
from __future__ import annotations

import numba as nb
import numpy as np

from .routing import INF, route_step

EMPTY = np.int64(-1)
TOMB = np.int64(-2)
FRESH = INF + np.int64(1)  # priority of a block loaded this step, before its refresh

# assignment modes
STRIDED, ROUTED, BOUNDARY = 0, 1, 2
# eviction kinds
BELADY, LRU, FIFO = 0, 1, 2

# status codes returned by run_epoch
OK, TOO_SMALL, HEAP_FULL, OUT_FULL, TABLE_FULL = 0, 1, 2, 3, 4

_GOLD = np.uint64(11400714819323198485)


@nb.njit(inline="always", cache=True)
def _slot(key, mask):
    return np.int64((np.uint64(key) * _GOLD) >> np.uint64(24)) & mask  # wraps mod 2**64 by design


@nb.njit(cache=True)
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


@nb.njit(cache=True)
def ht_insert(keys, key):
    """Slot for a key known to be absent; ``-slot-1`` when it reused a tombstone."""
    mask = keys.shape[0] - 1
    h = _slot(key, mask)
    while keys[h] >= 0:
        h = (h + 1) & mask
    was_tomb = keys[h] == TOMB
    keys[h] = key
    return -h - 1 if was_tomb else h


@nb.njit(cache=True)
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


@nb.njit(cache=True)
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


@nb.njit(cache=True)
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


@nb.njit(cache=True)
def heap_push_room(hk, hb, hn, r, key, blk, keys, prio, n_blocks, heap_cap):
    """Push onto rank r's heap, compacting stale entries first when it is full; False if still full."""
    if hn[r] >= heap_cap:
        heap_compact(hk, hb, hn, r, keys, prio, n_blocks)
        if hn[r] >= heap_cap:
            return False
    heap_push(hk, hb, hn, r, key, blk)
    return True


@nb.njit(cache=True, nogil=True)  # background window planning (open-ended) runs beside training
def run_epoch(idx, bounds, acc_ptr, nu, step0, P, cap_lo, cap_hi, target, mode, evict_kind, budget,
              boundary_steps, sample_ptr, sample_blocks, block_nbytes, block_stored, block_count,
              keys, prio, used, hk, hb, hn, res_bytes, owner, stamp, n_res,
              rank_of, st_count, st_hits, st_hit_bytes, st_miss, st_miss_bytes, st_stored,
              record, load_blk, load_ptr, evict_blk, evict_ptr, err, due, blocks_per_slot, first_step=0):
    """Process the steps ``first_step .. S-1`` of one epoch (all of them by default).

    "Blocks" here are the planner's units (layout blocks, or groups of them, see
    :mod:`.groups`); ``block_count`` int64[B] gives the layout blocks of each unit
    (empty: one each), so that hit and miss counts are in layout blocks.

    idx        int64[T]    sample id of each position of the epoch's global index
    bounds     int64[S+1]  global batch k = positions bounds[k]:bounds[k+1]
    acc_ptr    int64[T+1]  accesses of position p: sample_blocks[sample_ptr[idx[p]]...], nu[acc_ptr[p]...]
    nu         int64[A]    next use step of each access's block (after this step; INF = never)
    cap_lo/hi  int64[S]    per-rank sample count bounds of each step; target int64[S] = per-rank share
    rank_of    int32[T]    out: rank of each position
    st_*       int64[S,P]  out: samples, hits, hit bytes, misses, miss bytes, stored bytes read
    load_*/evict_*         out (if record): block ids, CSR over (step, rank): ptr int64[S*P+1]
    err        int64[4+]   out on failure: (status, step, rank, bytes needed)
    due        int64[R,P]  ROUTED: blocks resident on rank r whose next use is step t, at [t % R, r]
                           (R = 2S+1); a rank can serve at most cap_hi * blocks_per_slot of them at t,
                           so a block past that is kept at INF priority, and misses are routed where
                           they fit
    blocks_per_slot        most units of one sample
    first_step             steps before it are skipped: nothing is assigned, loaded or counted there
                           (``rank_of`` of their positions is left unwritten, their record rows empty);
                           with fresh state, an epoch that starts there from empty buffers

    ROUTED, per step: (A) each sample with owned units goes to the rank owning most of its
    bytes (samples of several units that one rank holds whole go first), within the count
    bounds; (B) the others in order of next use, soonest first, each to the free rank with
    the fewest blocks due at that step (a routed miss reserves its due slot for the rest of
    the pass); then the buffers run, and every used unit becomes owned by the rank that used
    it (its next use will be routed there).
    """
    n_blocks = block_nbytes.shape[0]
    S = bounds.shape[0] - 1
    unit_blocks = block_count.shape[0] == 0  # every unit is one layout block
    cnt = np.zeros(P, np.int64)
    lim = np.zeros(P, np.int64)
    rr = np.zeros(1, np.int64)
    aff_rank = np.empty(64, np.int64)
    aff_val = np.empty(64, np.int64)
    pos_by_rank = np.empty(bounds[S] - bounds[0] + 1, np.int64)
    rank_start = np.zeros(P + 1, np.int64)
    # one rank's units of one step: at most (samples of the step) x (units per sample); sized once,
    # never grown (re-binding an array inside the step loop costs reference counting per step)
    umax = np.max(bounds[1:] - bounds[:-1]) * blocks_per_slot + 1 if S > 0 else 1
    need_blk = np.empty(umax, np.int64)
    need_nu = np.empty(umax, np.int64)
    loads = np.empty(umax, np.int64)
    pinned_k = np.empty(umax, np.int64)
    pinned_b = np.empty(umax, np.int64)
    n_load = 0
    n_evict = 0
    resv = np.empty(bounds[S] - bounds[0] + 1, np.int64)  # at most one reservation per position
    resv_r = np.empty(bounds[S] - bounds[0] + 1, np.int64)
    qfar = np.empty(bounds[S] - bounds[0] + 1, np.int64)
    qpos = np.empty(bounds[S] - bounds[0] + 1, np.int64)
    qkey = np.empty(bounds[S] - bounds[0] + 1, np.int64)
    qord = np.empty(bounds[S] - bounds[0] + 1, np.int64)
    bcnt = np.zeros(bounds[S] - bounds[0] + 3, np.int64)
    heap_cap = hk.shape[1]
    for k in range(first_step, S):
        s = step0 + k
        lo = bounds[k]
        hi = bounds[k + 1]
        cnt[:] = 0
        # ------------------------------------------------------------ assignment
        if mode == STRIDED or (mode == BOUNDARY and k >= boundary_steps):
            for p in range(lo, hi):
                r = (p - lo) % P
                rank_of[p] = r
                cnt[r] += 1
        elif mode == BOUNDARY:
            # SOLAR-2023: a sample whose first block is held goes to its holder if it has a
            # free slot; all other samples are dealt round robin and appended (uneven sizes).
            for p in range(lo, hi):
                a0 = sample_ptr[idx[p]]
                o = owner[sample_blocks[a0]] if a0 < sample_ptr[idx[p] + 1] else -1  # a sample may have no block
                if o >= 0 and cnt[o] < target[k]:
                    rank_of[p] = o
                    cnt[o] += 1
                else:
                    rank_of[p] = -1
            r = 0
            for p in range(lo, hi):
                if rank_of[p] < 0:
                    rank_of[p] = r
                    cnt[r] += 1
                    r = (r + 1) % P
        else:
            route_step(k, s, lo, hi, step0, S, P, idx, acc_ptr, nu, cap_lo, cap_hi, target, sample_ptr, sample_blocks,
                       block_nbytes, owner, rank_of, due, blocks_per_slot, cnt, lim, rr, aff_rank, aff_val, resv,
                       resv_r, qfar, qpos, qkey, qord, bcnt)
        # positions grouped by rank (counting sort, keeps index order inside a rank)
        rank_start[:] = 0
        for p in range(lo, hi):
            rank_start[rank_of[p] + 1] += 1
        for r in range(P):
            rank_start[r + 1] += rank_start[r]
            st_count[k, r] = rank_start[r + 1] - rank_start[r]
        for r in range(P):
            lim[r] = rank_start[r]
        for p in range(lo, hi):
            r = rank_of[p]
            pos_by_rank[lim[r]] = p
            lim[r] += 1
        # ------------------------------------------------------------ buffers
        for r in range(P):
            tag = s * P + r
            nn = 0
            load_bytes = 0
            nl = 0
            for q in range(rank_start[r], rank_start[r + 1]):
                p = pos_by_rank[q]
                smp = idx[p]
                base = sample_ptr[smp]
                for a in range(base, sample_ptr[smp + 1]):
                    blk = sample_blocks[a]
                    if stamp[blk] == tag:
                        continue
                    stamp[blk] = tag
                    need_blk[nn] = blk
                    need_nu[nn] = nu[acc_ptr[p] + a - base]
                    nn += 1
                    h = ht_find(keys, r * n_blocks + blk)
                    if h >= 0:
                        used[h] = s
                        st_hits[k, r] += 1 if unit_blocks else block_count[blk]
                        st_hit_bytes[k, r] += block_nbytes[blk]
                    else:
                        loads[nl] = blk
                        nl += 1
                        load_bytes += block_nbytes[blk]
            # evict farthest-priority residents not needed now until the loads fit
            n_pinned = 0
            while res_bytes[r] + load_bytes > budget:
                if hn[r] == 0:
                    err[0] = TOO_SMALL
                    err[1] = s
                    err[2] = r
                    err[3] = load_bytes + res_bytes[r]
                    return n_load, n_evict
                key, blk = heap_pop(hk, hb, hn, r)
                h = ht_find(keys, r * n_blocks + blk)
                if h < 0 or prio[h] != key:
                    continue  # stale entry
                if used[h] == s:  # needed now: cannot go, but keep its entry (FIFO never re-pushes)
                    pinned_k[n_pinned] = key
                    pinned_b[n_pinned] = blk
                    n_pinned += 1
                    continue
                keys[h] = TOMB
                if mode == ROUTED and evict_kind == BELADY and s < key < INF:
                    due[key % due.shape[0], r] -= 1
                n_res[0] -= 1
                n_res[1] += 1
                res_bytes[r] -= block_nbytes[blk]
                if owner[blk] == r:
                    owner[blk] = -1
                if record:
                    if n_evict == evict_blk.shape[0]:
                        err[0] = OUT_FULL
                        return n_load, n_evict
                    evict_blk[n_evict] = blk
                n_evict += 1
            for j in range(n_pinned):
                heap_push(hk, hb, hn, r, pinned_k[j], pinned_b[j])
            for j in range(nl):
                blk = loads[j]
                if n_res[0] + n_res[1] + 1 > (keys.shape[0] * 7) // 10:
                    err[0] = TABLE_FULL
                    err[1] = s
                    return n_load, n_evict
                h = ht_insert(keys, r * n_blocks + blk)
                if h < 0:
                    h = -h - 1
                    n_res[1] -= 1  # reused a tombstone
                n_res[0] += 1
                prio[h] = FRESH
                used[h] = s
                res_bytes[r] += block_nbytes[blk]
                st_miss[k, r] += 1 if unit_blocks else block_count[blk]
                st_miss_bytes[k, r] += block_nbytes[blk]
                st_stored[k, r] += block_stored[blk]
                if mode != ROUTED:
                    owner[blk] = r  # the last loader (SOLAR-2023 routes boundary samples to it)
                if record:
                    load_blk[n_load] = blk
                n_load += 1
            # refresh priorities of everything this rank used at this step
            for j in range(nn):
                blk = need_blk[j]
                h = ht_find(keys, r * n_blocks + blk)
                if evict_kind == BELADY:
                    newp = need_nu[j]
                    if mode == ROUTED:
                        o = owner[blk]
                        if o != r:
                            # the block follows its last user: r owns it now, and a copy the
                            # previous owner still holds becomes the first thing it evicts
                            if o >= 0:
                                h2 = ht_find(keys, o * n_blocks + blk)
                                if h2 >= 0 and prio[h2] < INF:
                                    if prio[h2] > s:
                                        due[prio[h2] % due.shape[0], o] -= 1
                                    prio[h2] = INF
                                    if not heap_push_room(hk, hb, hn, o, INF, blk, keys, prio, n_blocks, heap_cap):
                                        err[0] = HEAP_FULL
                                        err[1] = s
                                        err[2] = o
                                        return n_load, n_evict
                            owner[blk] = r
                        if newp < INF:
                            slot = newp % due.shape[0]
                            if due[slot, r] < cap_hi[(newp - step0) % S] * blocks_per_slot:
                                due[slot, r] += 1
                            else:
                                newp = INF  # this rank cannot serve another block at that step
                elif evict_kind == LRU:
                    newp = -s
                else:
                    if prio[h] != FRESH:
                        continue  # FIFO: hits do not refresh
                    newp = -s
                if prio[h] == newp:
                    continue
                prio[h] = newp
                if not heap_push_room(hk, hb, hn, r, newp, blk, keys, prio, n_blocks, heap_cap):
                    err[0] = HEAP_FULL
                    err[1] = s
                    err[2] = r
                    return n_load, n_evict
            if record:
                load_ptr[k * P + r + 1] = n_load
                evict_ptr[k * P + r + 1] = n_evict
        if mode == ROUTED:
            due[s % due.shape[0], :] = 0
    return n_load, n_evict


@nb.njit(cache=True, nogil=True)
def ht_rebuild(keys, prio, used, new_keys, new_prio, new_used):
    """Copy live entries into fresh (EMPTY-filled) arrays, dropping tombstones."""
    for i in range(keys.shape[0]):
        if keys[i] >= 0:
            h = ht_insert(new_keys, keys[i])
            new_prio[h] = prio[i]
            new_used[h] = used[i]


@nb.njit(cache=True, nogil=True)
def next_use(idx, bounds, step0, idx_f, n_future, acc_ptr, P, per_rank, sample_ptr, sample_blocks, last, nu,
             first_step=0):
    """Fill ``nu`` (int64[A], aligned with ``acc_ptr``) with each access's next use step, for the accesses of
    steps ``first_step .. S-1`` of this epoch (those of earlier steps are left as they are).

    The next use of a block used at step s is the first later step that uses it, in
    this epoch or in the ``n_future`` epochs that follow (``idx_f``: their indices
    concatenated, int64[n_future*T], same batch bounds; epoch j starts at step
    step0 + (j+1)*S), else INF.  ``per_rank``: next use by the same rank under the
    strided split (position p of a batch starting at lo goes to rank (p - lo) % P).
    ``last``: int64[B] scratch, INF on entry and on exit.
    """
    n_groups = P if per_rank else 1
    stride = P if per_rank else 1
    S = bounds.shape[0] - 1
    T = idx.shape[0]
    for g in range(n_groups):
        for j in range(n_future - 1, -1, -1):
            off = j * T
            for k in range(S - 1, -1, -1):
                for p in range(bounds[k] + g, bounds[k + 1], stride):
                    smp = idx_f[off + p]
                    for a in range(sample_ptr[smp], sample_ptr[smp + 1]):
                        last[sample_blocks[a]] = step0 + (j + 1) * S + k
        for k in range(S - 1, first_step - 1, -1):
            for p in range(bounds[k] + g, bounds[k + 1], stride):
                smp = idx[p]
                base = sample_ptr[smp]
                for a in range(base, sample_ptr[smp + 1]):
                    nu[acc_ptr[p] + a - base] = last[sample_blocks[a]]
            for p in range(bounds[k] + g, bounds[k + 1], stride):
                smp = idx[p]
                for a in range(sample_ptr[smp], sample_ptr[smp + 1]):
                    last[sample_blocks[a]] = step0 + k
        for j in range(-1, n_future):  # reset what this group touched
            src = idx if j < 0 else idx_f[j * T:(j + 1) * T]
            for k in range(first_step if j < 0 else 0, S):
                for p in range(bounds[k] + g, bounds[k + 1], stride):
                    smp = src[p]
                    for a in range(sample_ptr[smp], sample_ptr[smp + 1]):
                        last[sample_blocks[a]] = INF
