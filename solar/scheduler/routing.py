"""One step's assignment of positions to buffers, shared by the rank kernel (:mod:`.engine`) and the node/peer
kernel (:mod:`.peer_engine`): the strided split, SOLAR-2023's boundary reassignment, and the routing of the
``solar`` policy (mode ``ROUTED``); then the step's positions grouped by buffer.  "Ranks" here are the
kernels' buffers: ranks, or nodes when ranks share a node's pool.

Pure: arrays in, arrays out; no I/O, no MPI, no clock.
"""
from __future__ import annotations

import numba as nb

from .kernel import BOUNDARY, COUNT, INF, STRIDED


@nb.njit(cache=True, nogil=True, no_cpython_wrapper=True)
def assign_step(k, job, ep, buf, out, sc):
    """Give each position of step ``k`` a buffer (``out.buf_of``), counting each buffer's samples in ``sc.cnt``.

    STRIDED (and BOUNDARY after ``job.boundary_steps``): position p of the batch from lo goes to rank
    (p - lo) % ``job.ranks``, buffer rank // ``job.per_buf`` (DistributedSampler's split); BOUNDARY before:
    SOLAR-2023's holder first; ROUTED: :func:`route_step`.
    """
    lo = job.bounds[k]
    hi = job.bounds[k + 1]
    cnt = sc.cnt
    buf_of = out.buf_of
    cnt[:] = 0
    if job.mode == STRIDED or (job.mode == BOUNDARY and k >= job.boundary_steps):
        ranks, per_buf = job.ranks, job.per_buf
        for p in range(lo, hi):
            r = ((p - lo) % ranks) // per_buf
            buf_of[p] = r
            cnt[r] += 1
    elif job.mode == BOUNDARY:
        # SOLAR-2023: a sample whose first block is held goes to its holder if it has a
        # free slot; all other samples are dealt round robin and appended (uneven sizes).
        idx, sample_ptr, sample_blocks, owner, tk = ep.idx, ep.unit_ptr, ep.units, buf.owner, job.target[k]
        for p in range(lo, hi):
            a0 = sample_ptr[idx[p]]
            o = owner[sample_blocks[a0]] if a0 < sample_ptr[idx[p] + 1] else -1  # a sample may have no block
            if o >= 0 and cnt[o] < tk:
                buf_of[p] = o
                cnt[o] += 1
            else:
                buf_of[p] = -1
        r = 0
        for p in range(lo, hi):
            if buf_of[p] < 0:
                buf_of[p] = r
                cnt[r] += 1
                r = (r + 1) % job.n_buf
    else:
        route_step(k, job, ep, buf, buf_of, sc)


@nb.njit(cache=True, nogil=True, no_cpython_wrapper=True)
def group_by_buffer(k, job, out, sc):
    """Step ``k``'s positions grouped by buffer in ``sc.pos_by``/``sc.start`` (a counting sort: index order
    inside a buffer); each buffer's sample count in ``out.st[COUNT, k]``."""
    lo = job.bounds[k]
    hi = job.bounds[k + 1]
    Q = job.n_buf
    buf_of, start, pos_by, lim, st = out.buf_of, sc.start, sc.pos_by, sc.lim, out.st
    start[:] = 0
    for p in range(lo, hi):
        start[buf_of[p] + 1] += 1
    for r in range(Q):
        start[r + 1] += start[r]
        st[COUNT, k, r] = start[r + 1] - start[r]
    for r in range(Q):
        lim[r] = start[r]
    for p in range(lo, hi):
        r = buf_of[p]
        pos_by[lim[r]] = p
        lim[r] += 1


@nb.njit(cache=True, no_cpython_wrapper=True)
def _rr_next(ptr, P, cnt, limit):
    """Next rank (round robin from ptr[0]) with cnt < limit[rank]; -1 if none."""
    for _ in range(P):
        r = ptr[0]
        ptr[0] = (r + 1) % P
        if cnt[r] < limit[r]:
            return r
    return -1


@nb.njit(cache=True, no_cpython_wrapper=True)
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


@nb.njit(cache=True, nogil=True, no_cpython_wrapper=True)
def route_step(k, job, ep, buf, rank_of, sc):
    """Assign positions of step ``k`` (``job.bounds[k]:job.bounds[k+1]``) to buffers.

    (A) each sample with owned units goes to the buffer owning most of its bytes (samples of
    several units that one buffer holds whole go first), within ``cap_hi`` and keeping ``cap_lo``
    feasible; (B) the others in order of next use, soonest first, each to the free buffer with the
    fewest units due at that step (a routed miss reserves its due slot for the rest of the pass;
    the reservations are undone before returning).  Unowned units of a routed sample are claimed
    by its buffer (``buf.owner``), so that samples sharing them follow.  Writes ``rank_of[lo:hi]`` and
    ``sc.cnt`` (samples per buffer); the rest of ``sc`` is scratch.
    """
    S = job.bounds.shape[0] - 1
    P = job.n_buf
    step0 = ep.step0
    s = step0 + k
    lo = job.bounds[k]
    hi = job.bounds[k + 1]
    idx, acc_ptr, nu, sample_ptr, sample_blocks = ep.idx, ep.acc_ptr, ep.nu, ep.unit_ptr, ep.units
    cap_lo, cap_hi, target, block_nbytes, blocks_per_slot = job.cap_lo, job.cap_hi, job.target, job.nbytes, \
        job.blocks_per_slot
    owner, due = buf.owner, buf.due
    cnt, lim, rr, aff_rank, aff_val = sc.cnt, sc.lim, sc.rr, sc.aff_rank, sc.aff_val
    resv, resv_r, qfar, qpos, qkey, qord, bcnt = sc.resv, sc.resv_r, sc.qfar, sc.qpos, sc.qkey, sc.qord, sc.bcnt
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
