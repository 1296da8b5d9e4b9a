"""Per-step routing of the ``solar`` policy (mode ``ROUTED``), shared by the rank engine
(:mod:`.engine`) and the node/peer engine (:mod:`.peer_engine`).  "Ranks" here are the engine's
buffers: ranks, or nodes when ranks share a node's pool.

Pure: arrays in, arrays out; no I/O, no MPI, no clock.
"""
from __future__ import annotations

import numba as nb
import numpy as np

INF = np.int64(1) << np.int64(62)  # next use of a unit never used again


@nb.njit(cache=True)
def _rr_next(ptr, P, cnt, limit):
    """Next rank (round robin from ptr[0]) with cnt < limit[rank]; -1 if none."""
    for _ in range(P):
        r = ptr[0]
        ptr[0] = (r + 1) % P
        if cnt[r] < limit[r]:
            return r
    return -1


@nb.njit(cache=True)
def _least_due_pick(ptr, P, cnt, limit, due, slot, cap_t):
    """Among ranks with a free slot, one holding the fewest blocks due at ring slot ``slot``,
    if fewer than ``cap_t`` (the first such in round-robin order from ``ptr``); else any free rank."""
    m = cap_t
    for r in range(P):  # branch-free min, so that it vectorises
        v = due[slot, r] if cnt[r] < limit[r] else cap_t
        m = min(m, v)
    if m < cap_t:
        r = ptr[0]
        for _ in range(P):
            if due[slot, r] == m and cnt[r] < limit[r]:
                ptr[0] = r + 1 if r + 1 < P else 0
                return r
            r = r + 1 if r + 1 < P else 0
    return _rr_next(ptr, P, cnt, limit)


@nb.njit(cache=True, nogil=True)
def route_step(k, s, lo, hi, step0, S, P, idx, acc_ptr, nu, cap_lo, cap_hi, target, sample_ptr, sample_blocks,
               block_nbytes, owner, rank_of, due, blocks_per_slot, cnt, lim, rr, aff_rank, aff_val, resv, resv_r,
               qfar, qpos, qkey, qord, bcnt):
    """Assign positions ``lo..hi-1`` (step ``k`` of the epoch, global step ``s``) to buffers.

    (A) each sample with owned units goes to the buffer owning most of its bytes (samples of
    several units that one buffer holds whole go first), within ``cap_hi`` and keeping ``cap_lo``
    feasible; (B) the others in order of next use, soonest first, each to the free buffer with the
    fewest units due at that step (a routed miss reserves its due slot for the rest of the pass;
    the reservations are undone before returning).  Unowned units of a routed sample are claimed
    by its buffer (``owner``), so that samples sharing them follow.  Writes ``rank_of[lo:hi]`` and
    ``cnt`` (samples per buffer); the other arrays are scratch (see :func:`.engine.run_epoch`).
    """
    n_resv = 0
    # ROUTED: pass A sends each sample with resident (or already claimed) blocks to the
    # rank holding most of its bytes, within cap_hi and keeping cap_lo feasible.
    deficit = P * cap_lo[k]
    unassigned = hi - lo
    # round 0 (samples of several units only): samples whose bytes are all on one rank;
    # round 1: the others
    first = 0 if blocks_per_slot > 1 else 1
    for rnd in range(first, 2):
        for p in range(lo, hi):
            if rnd == first:
                rank_of[p] = -1
            elif rank_of[p] >= 0:
                continue
            smp = idx[p]
            na = 0
            tot = 0
            for a in range(sample_ptr[smp], sample_ptr[smp + 1]):
                blk = sample_blocks[a]
                if rnd == 0:
                    tot += block_nbytes[blk]
                o = owner[blk]
                if o < 0:
                    continue
                found = False
                for j in range(na):
                    if aff_rank[j] == o:
                        aff_val[j] += block_nbytes[blk]
                        found = True
                        break
                if not found and na < 64:
                    aff_rank[na] = o
                    aff_val[na] = block_nbytes[blk]
                    na += 1
            if na == 0 or (rnd == 0 and (na > 1 or aff_val[0] < tot)):
                continue
            best = -1
            bval = -1
            for j in range(na):
                o = aff_rank[j]
                if cnt[o] >= cap_hi[k]:
                    continue
                d_after = deficit - (1 if cnt[o] < cap_lo[k] else 0)
                if unassigned - 1 < d_after:
                    continue
                if aff_val[j] > bval:
                    bval = aff_val[j]
                    best = o
            if best >= 0:
                rank_of[p] = best
                if cnt[best] < cap_lo[k]:
                    deficit -= 1
                cnt[best] += 1
                unassigned -= 1
                for a in range(sample_ptr[smp], sample_ptr[smp + 1]):
                    if owner[sample_blocks[a]] < 0:
                        owner[sample_blocks[a]] = best  # claim: co-block samples follow
    # pass B: the rest, first up to cap_lo on every rank, then up to the target share.
    # Samples used again go first, soonest next use first (bucket sort, buckets of w
    # steps), each to the free rank with the fewest blocks due at that step; samples
    # never used again follow in index order, round robin.
    horizon = due.shape[0] - 1  # next uses lie within this many steps
    nq = 0
    nfar = 0
    for p in range(lo, hi):
        if rank_of[p] < 0:
            d = nu[acc_ptr[p]] - s if acc_ptr[p + 1] > acc_ptr[p] else INF
            if d <= horizon:
                qpos[nq] = p
                qkey[nq] = d
                nq += 1
            else:
                qfar[nfar] = p
                nfar += 1
    nbk = min(horizon, nq) + 1
    w = (horizon + nbk - 1) // nbk
    bcnt[:nbk + 1] = 0
    for i in range(nq):
        bk = (qkey[i] - 1) // w
        qkey[i] = bk
        bcnt[bk + 1] += 1
    for i in range(nbk):
        bcnt[i + 1] += bcnt[i]
    for i in range(nq):
        bk = qkey[i]
        qord[bcnt[bk]] = qpos[i]
        bcnt[bk] += 1
    for i in range(nfar):
        qord[nq + i] = qfar[i]
    nq += nfar
    R = due.shape[0]
    for phase in range(2):
        for r in range(P):
            lim[r] = cap_lo[k] if phase == 0 else target[k]
        for qi in range(nq):
            p = qord[qi]
            if rank_of[p] >= 0:
                continue
            smp = idx[p]
            r = -1
            for a in range(sample_ptr[smp], sample_ptr[smp + 1]):
                o = owner[sample_blocks[a]]
                if o >= 0 and cnt[o] < lim[o]:
                    r = o
                    break
            if r < 0:
                t = nu[acc_ptr[p]] if acc_ptr[p + 1] > acc_ptr[p] else INF
                if t < INF:
                    slot = t % R
                    cap_t = cap_hi[(t - step0) % S] * blocks_per_slot
                    r = _least_due_pick(rr, P, cnt, lim, due, slot, cap_t)
                    if r >= 0:
                        due[slot, r] += 1  # reserved until the buffers run (undone below)
                        resv[n_resv] = slot
                        resv_r[n_resv] = r
                        n_resv += 1
                else:
                    r = _rr_next(rr, P, cnt, lim)
                if r < 0:
                    break
            rank_of[p] = r
            cnt[r] += 1
            for a in range(sample_ptr[smp], sample_ptr[smp + 1]):
                if owner[sample_blocks[a]] < 0:
                    owner[sample_blocks[a]] = r
    for j in range(n_resv):
        due[resv[j], resv_r[j]] -= 1
