"""A step of the buffers, shared by both planner kernels (:func:`.engine.run_epoch`, a buffer per rank or one
per node, and :func:`.peer_engine.run_epoch_peer`, node pools with transfers between nodes): each step, the
positions get buffers (:func:`.routing.assign_step`), then the buffers run (:func:`buffer_step`).

The kernels take the structs of :mod:`.kernel` (``job``, ``ep``, ``buf``, ``out``) and differ only in
``peer``, a compile-time constant (``numba.literally``: each kernel gets its own machine code).  The phases
of a buffer's step (needs, misses, priorities) are written out in :func:`buffer_step` rather than called per
buffer: a call that passes the structs, or numba's inlining of one, costs reference counts on every array
per call, and per (step, rank) that made the ``solar`` policy 10-25% slower at 1M samples x 64 ranks.  The
helpers called per unit (``ht_find``, heaps, :func:`follow_user` only when a unit changes owner) take the
arrays they use.

Compile time (numba compiles these on the first plan after an install, then caches them): every kernel here
is called only from other kernels, so it is compiled with ``no_cpython_wrapper``: the wrapper, which unboxes
every array of the structs from Python objects and was never used, took about a fifth of a first
``solar plan``'s CPU (38-42 s now against 47-52 s, this VM otherwise idle; plans unchanged,
``tests/test_plan_digests.py``).  The entry points ``run_epoch`` / ``run_epoch_peer`` stay compiled: called
from Python with ``peer`` as an argument, :func:`run_steps` would be dispatched on a literal, about 7 ms a call.

Pure: arrays in, arrays out; no I/O, no MPI, no clock.
"""
from __future__ import annotations

import numba as nb
import numpy as np
from numba import literally

from .kernel import (BELADY, FRESH, HEAP_FULL, HIT, HIT_BYTES, HITS, INF, LOAD, LRU, MISS, MISS_BYTES, N_EVICT,
                     N_LOAD, N_STAGE, N_XFER, OUT_FULL, PEER, PEER_BYTES, RECV, ROUTED, STAGED, STAGED_BYTES, STORED,
                     TABLE_FULL, TOMB, TOO_SMALL, scratch)
from .routing import assign_step, group_by_buffer
from .table import heap_pop, heap_push, heap_push_room, ht_find, ht_insert


@nb.njit(cache=True, nogil=True, no_cpython_wrapper=True)
def follow_user(u, q, s, owner, keys, prio, due, hk, hb, hn, err):
    """ROUTED: unit u, used by buffer q at step s, is owned by q from now on (its next use is routed there),
    and a copy its previous owner still holds becomes the first thing that one evicts.  False: HEAP_FULL.
    Called only when q is not the owner already."""
    o = owner[u]
    if o >= 0:
        h2 = ht_find(keys, o * owner.shape[0] + u)
        if h2 >= 0 and prio[h2] < INF:
            if prio[h2] > s:
                due[prio[h2] % due.shape[0], o] -= 1
            prio[h2] = INF
            if not heap_push_room(hk, hb, hn, o, INF, u, keys, prio, owner.shape[0], hk.shape[1]):
                err[0] = HEAP_FULL
                err[1] = s
                err[2] = o
                return False
    owner[u] = q
    return True


@nb.njit(cache=True, nogil=True, no_cpython_wrapper=True)
def insert_entry(key, priority, s, keys, prio, used, n_res, err):
    """A new hash-table entry ``key`` (buffer * U + unit) at ``priority``, used at step s: its slot, or -1 when
    the table is full (TABLE_FULL)."""
    if n_res[0] + n_res[1] + 1 > (keys.shape[0] * 7) // 10:
        err[0] = TABLE_FULL
        err[1] = s
        return -1
    h = ht_insert(keys, key)
    if h < 0:
        h = -h - 1
        n_res[1] -= 1  # reused a tombstone
    n_res[0] += 1
    prio[h] = priority
    used[h] = s
    return h


@nb.njit(cache=True, nogil=True, no_cpython_wrapper=True)
def evict_entry(h, u, key, q, s, track_due, record, keys, due, n_res, res_bytes, nbytes, owner, evict, n_out, err):
    """Buffer q evicts unit u at step s (its hash-table entry h, priority ``key``): the entry becomes a tombstone,
    its booking in ``due`` (ROUTED) and its bytes are released, q stops owning it, and the eviction is recorded.
    False: the recorded list is full (OUT_FULL)."""
    keys[h] = TOMB
    if track_due and s < key < INF:
        due[key % due.shape[0], q] -= 1
    n_res[0] -= 1
    n_res[1] += 1
    res_bytes[q] -= nbytes[u]
    if owner[u] == q:
        owner[u] = -1
    if record:
        if n_out[N_EVICT] == evict.shape[0]:
            err[0] = OUT_FULL
            return False
        evict[n_out[N_EVICT]] = u
    n_out[N_EVICT] += 1
    return True


@nb.njit(cache=True, nogil=True, no_cpython_wrapper=True)
def buffer_step(k, peer, job, ep, buf, out, sc):
    """Run the buffers at step k, its positions grouped by buffer in ``sc``; False on failure (``out.err``).

    The rank kernel (``peer`` False) runs each buffer in turn through three phases: a buffer's priorities
    change what the next one evicts (a unit following its new user leaves the old owner's copy at INF).
    The peer kernel runs each phase over all nodes: a node's needs decide what its peers send and keep.

    1. Needs: each unit of the buffer's samples once (``sc.node/unit/nu/kind``): resident, a HIT (counted;
       its entry used at this step); with ``peer``, a unit that may travel (``job.peer_ok``) homed on another
       node (``owner``) is received from there (RECV: counted, recorded as a transfer; the sender's copy is
       pinned for the step and, with ``job.refresh_holder``, refreshed as the sender's need), one with no home
       gets this node as its home; else a read (LOAD, listed in ``sc.loads``).
    2. Misses: evict the residents of highest priority not used at this step until the reads fit (rank
       kernel: else TOO_SMALL; peer kernel: what does not fit is read into staging only, counted in STAGED),
       then load them (priority FRESH until refreshed; rank kernel, unless ROUTED: owned by their loader).
    3. Priorities of every unit used: Belady, the next use; LRU (and, in the peer kernel, FIFO), minus the
       step; FIFO, minus the load step.  ROUTED (Belady in the rank kernel): a unit follows its user
       (:func:`follow_user`), and ``buf.due`` counts the units a buffer keeps for each step: it can serve at
       most ``cap_hi * blocks_per_slot`` of them there, so a unit past that is kept at INF priority.  A unit
       that may travel keeps one copy, at its home: it is booked in ``due`` without that bound.
    """
    peer = literally(peer)  # a compile-time constant: each kernel gets its own machine code
    s = ep.step0 + k
    Q = job.n_buf
    nbytes, stored, count, peer_ok, budget, cap_hi, bps = job.nbytes, job.stored, job.count, job.peer_ok, job.budget, \
        job.cap_hi, job.blocks_per_slot
    mode, evict_kind, step0, S = job.mode, job.evict_kind, ep.step0, cap_hi.shape[0]
    idx, acc_ptr, nu, sample_ptr, sample_blocks = ep.idx, ep.acc_ptr, ep.nu, ep.unit_ptr, ep.units
    keys, prio, used, hk, hb, hn = buf.keys, buf.prio, buf.used, buf.hk, buf.hb, buf.hn
    res_bytes, owner, stamp, n_res, due = buf.res_bytes, buf.owner, buf.stamp, buf.n_res, buf.due
    st, n_out, record, err = out.st, out.n, out.record, out.err
    load, evict, stage, x_src, x_dst, x_blk = out.load, out.evict, out.stage, out.x_src, out.x_dst, out.x_blk
    pos_by, start, nd_node, nd_unit, nd_nu, nd_kind = sc.pos_by, sc.start, sc.node, sc.unit, sc.nu, sc.kind
    loads, ld_start, ld_bytes, pinned_k, pinned_b = sc.loads, sc.ld_start, sc.ld_bytes, sc.pinned_k, sc.pinned_b
    U = nbytes.shape[0]
    R = due.shape[0]
    heap_cap = hk.shape[1]
    admit, nxt, ext_ptr, ext_ids, ext_stored, ext_stamp = job.admit, buf.nxt, job.ext_ptr, job.ext_ids, \
        job.ext_stored, buf.ext_stamp
    by_extent = ext_ptr.shape[0] > 0
    runs = job.runs
    chunks = admit and not runs  # parts of chunks: evicting a part may take its chunk's later parts along
    unit_blocks = count.shape[0] == 0  # every unit is one layout block
    track_due = mode == ROUTED and (peer or evict_kind == BELADY)  # next uses are booked in buf.due
    own_loads = not peer and mode != ROUTED  # the last loader owns a unit (SOLAR-2023 routes boundary samples to it)
    for g in range(1 if peer else Q):
        q0, q1 = (0, Q) if peer else (g, g + 1)
        # ------------------------------------------------------------ 1. needs
        m = 0
        nl = 0
        for q in range(q0, q1):
            tag = s * Q + q
            ld_start[q] = nl
            need = 0
            for i in range(start[q], start[q + 1]):
                p = pos_by[i]
                smp = idx[p]
                base = sample_ptr[smp]
                for a in range(base, sample_ptr[smp + 1]):
                    u = sample_blocks[a]
                    if stamp[u] == tag:
                        continue
                    stamp[u] = tag
                    kind = LOAD
                    h = ht_find(keys, q * U + u)
                    if h >= 0:
                        used[h] = s
                        kind = HIT
                        st[HITS, k, q] += 1 if unit_blocks else count[u]
                        st[HIT_BYTES, k, q] += nbytes[u]
                    elif peer and peer_ok[u]:
                        o = owner[u]
                        if o < 0:
                            owner[u] = q
                        elif o != q:
                            kind = RECV
                            st[PEER, k, q] += 1 if unit_blocks else count[u]
                            st[PEER_BYTES, k, q] += nbytes[u]
                            if record:
                                x_src[n_out[N_XFER]] = o
                                x_dst[n_out[N_XFER]] = q
                                x_blk[n_out[N_XFER]] = u
                            n_out[N_XFER] += 1
                    if kind == LOAD:
                        loads[nl] = u
                        nl += 1
                        need += nbytes[u]
                    nd_unit[m] = u
                    nd_nu[m] = nu[acc_ptr[p] + a - base]
                    if admit:
                        nxt[u] = nd_nu[m]
                    if peer:  # (the rank kernel's needs are all its buffer's, none received)
                        nd_node[m] = q
                        nd_kind[m] = kind
                    m += 1
            ld_bytes[q] = need
        ld_start[q1] = nl
        if peer:  # pin the senders' copies (resident before this step) and queue their refreshes
            for i in range(m):
                if nd_kind[i] != RECV:
                    continue
                u = nd_unit[i]
                o = owner[u]
                h = ht_find(keys, o * U + u)
                if h >= 0:
                    used[h] = s
                    if job.refresh_holder:
                        nd_node[m] = o
                        nd_unit[m] = u
                        nd_nu[m] = nd_nu[i]
                        nd_kind[m] = HIT
                        m += 1
        # ------------------------------------------------------------ 2. misses: evict, read (or stage)
        for q in range(q0, q1):
            n_pinned = 0
            while res_bytes[q] + ld_bytes[q] > budget:
                if hn[q] == 0:
                    if peer:
                        break  # every resident is needed at this step: what does not fit is staged
                    err[0] = TOO_SMALL
                    err[1] = s
                    err[2] = q
                    err[3] = ld_bytes[q] + res_bytes[q]
                    return False
                key, u = heap_pop(hk, hb, hn, q)
                h = ht_find(keys, q * U + u)
                if h < 0 or prio[h] != key:
                    continue  # stale entry
                if used[h] == s:  # needed now, here or by a peer: cannot go, but keep its entry (FIFO never re-pushes)
                    pinned_k[n_pinned] = key
                    pinned_b[n_pinned] = u
                    n_pinned += 1
                    continue
                # evict_entry's steps written out here, as insert_entry's below: in this loop, run per unit, calls
                # made planning 15% slower (400,000 samples x 32 ranks, f = 0.5; numba's inline="always" too)
                keys[h] = TOMB
                if track_due and s < key < INF:
                    due[key % R, q] -= 1
                n_res[0] -= 1
                n_res[1] += 1
                res_bytes[q] -= nbytes[u]
                if owner[u] == q:
                    owner[u] = -1
                if record:
                    if n_out[N_EVICT] == evict.shape[0]:
                        err[0] = OUT_FULL
                        return False
                    evict[n_out[N_EVICT]] = u
                n_out[N_EVICT] += 1
                if chunks and key < step0 + S and not evict_chunk(u, key, q, s, step0 + S, track_due, record, job, keys,
                                                                  prio, used, due, n_res, res_bytes, owner, evict,
                                                                  n_out, err):
                    return False
            for j in range(n_pinned):
                heap_push(hk, hb, hn, q, pinned_k[j], pinned_b[j])
            for i in range(ld_start[q], ld_start[q + 1]):
                u = loads[i]
                nblk = 1 if unit_blocks else count[u]
                st[MISS, k, q] += nblk
                st[MISS_BYTES, k, q] += nbytes[u]
                if by_extent:  # a chunk is read once however many of its parts the step loads
                    for a in range(ext_ptr[u], ext_ptr[u + 1]):
                        x = ext_ids[a]
                        if ext_stamp[x] != s * Q + q:
                            ext_stamp[x] = s * Q + q
                            st[STORED, k, q] += ext_stored[x]  # 0 for runs of neighbours
                if runs or not by_extent:
                    st[STORED, k, q] += stored[u]
                if peer and res_bytes[q] + nbytes[u] > budget:  # no room left: read into staging only
                    st[STAGED, k, q] += nblk
                    st[STAGED_BYTES, k, q] += nbytes[u]
                    if owner[u] == q and peer_ok[u]:
                        owner[u] = -1
                    if record:
                        stage[n_out[N_STAGE]] = u
                    n_out[N_STAGE] += 1
                    continue
                if n_res[0] + n_res[1] + 1 > (keys.shape[0] * 7) // 10:
                    err[0] = TABLE_FULL
                    err[1] = s
                    return False
                h = ht_insert(keys, q * U + u)
                if h < 0:
                    h = -h - 1
                    n_res[1] -= 1  # reused a tombstone
                n_res[0] += 1
                prio[h] = FRESH
                used[h] = s
                res_bytes[q] += nbytes[u]
                if own_loads:
                    owner[u] = q
                if record:
                    if n_out[N_LOAD] == load.shape[0]:
                        err[0] = OUT_FULL
                        return False
                    load[n_out[N_LOAD]] = u
                n_out[N_LOAD] += 1
            if admit and ld_start[q + 1] > ld_start[q] and not admit_parts(k, q, job, ep, buf, out, sc):
                return False
            if record:
                row = k * Q + q + 1
                out.load_ptr[row] = n_out[N_LOAD]
                out.evict_ptr[row] = n_out[N_EVICT]
                if peer:
                    out.stage_ptr[row] = n_out[N_STAGE]
        if peer and record:
            out.x_ptr[k + 1] = n_out[N_XFER]
        # ------------------------------------------------------------ 3. priorities
        for i in range(m):
            q = g
            if peer:
                if nd_kind[i] == RECV:
                    continue  # received: never resident here
                q = nd_node[i]
            u = nd_unit[i]
            h = ht_find(keys, q * U + u)
            if peer and h < 0:
                continue  # staged, not kept
            if evict_kind == BELADY:
                newp = nd_nu[i]
            elif evict_kind == LRU or peer:
                newp = -s
            elif prio[h] != FRESH:
                continue  # FIFO: hits do not refresh
            else:
                newp = -s
            if peer and peer_ok[u]:
                if prio[h] == newp:
                    continue  # already refreshed at this step (the home used it too)
                if track_due and newp < INF:
                    due[newp % R, q] += 1
            elif track_due:
                if owner[u] != q and not follow_user(u, q, s, owner, keys, prio, due, hk, hb, hn, err):
                    return False
                if newp < INF:
                    slot = newp % R
                    if due[slot, q] < cap_hi[(newp - step0) % S] * bps:
                        due[slot, q] += 1
                    else:
                        newp = INF  # this buffer cannot serve another unit at that step
            elif peer:
                owner[u] = q
            if prio[h] == newp:
                continue
            prio[h] = newp
            if not heap_push_room(hk, hb, hn, q, newp, u, keys, prio, U, heap_cap):
                err[0] = HEAP_FULL
                err[1] = s
                err[2] = q
                return False
    return True


@nb.njit(cache=True, nogil=True, no_cpython_wrapper=True)
def evict_chunk(u, key, q, s, horizon, track_due, record, job, keys, prio, used, due, n_res, res_bytes, owner,
                evict, n_out, err):
    """Buffer q has just evicted part u, used again at step ``key`` of this epoch (before ``horizon``, its end):
    its chunk will be read again by then.  It also evicts the chunk's other parts it holds that this epoch uses
    no sooner than halfway from now to ``key`` (not those used at this step): they come back with that read,
    one read for all.  Per part, Belady would keep them and evict parts of other chunks, each read again for
    its own part.  Halfway: evicting the chunk's parts used soon moves its read too close (they would then
    occupy the room they freed), measured on parts of 2, 4 and 8 rows at f = 0.25-0.75 (docs/planner.md).
    False on failure (``out.err``)."""
    ext_ptr, ext_ids, xu_ptr, xu_units = job.ext_ptr, job.ext_ids, job.xu_ptr, job.xu_units
    U = job.nbytes.shape[0]
    x0 = ext_ids[ext_ptr[u]]
    for c in range(xu_ptr[x0], xu_ptr[x0 + 1]):
        w = xu_units[c]
        if w == u:
            continue
        h = ht_find(keys, q * U + w)
        if h < 0 or used[h] == s or prio[h] >= horizon or 2 * (prio[h] - s) < key - s:
            continue
        if not evict_entry(h, w, prio[h], q, s, track_due, record, keys, due, n_res, res_bytes, job.nbytes, owner,
                           evict, n_out, err):
            return False
    return True


@nb.njit(cache=True, nogil=True, no_cpython_wrapper=True)
def admit_parts(k, q, job, ep, buf, out, sc):
    """Buffer q at step k, after its reads: keep the other parts of the extents it read (parts of one chunk,
    :mod:`solar.layout.parts`; the read brought them at no storage cost) that it will use again before what
    keeping them would evict (Belady's choice, made at the read).  False on failure (``out.err``).

    A candidate is a unit all of whose extents q read at this step, that q does not need at this step, that
    no buffer holds (``owner`` -1), and whose next use (``buf.nxt``) lies after this step.  Candidates go in
    order of next use; each takes free room first, then evicts residents not used at this step whose next
    use is later than its own.  ROUTED: it is booked in ``due`` like a use (skipped if q can serve no more
    units at that step).  A kept part is a recorded load (not a miss: nothing of it is demanded now), owned
    by q, at the priority of its next use.

    Runs of neighbouring blocks (``job.runs``, :mod:`solar.layout.runs`): the extents are runs, a kept
    neighbour is read for it (its ``stored`` counted in STORED; the reader's coalescing makes one request of
    it and the read beside it), only one used within ``job.run_horizon`` steps, and no eviction takes a
    chunk's other parts along (:func:`evict_chunk`).
    """
    s = ep.step0 + k
    Q = job.n_buf
    nbytes, budget, cap_hi, bps = job.nbytes, job.budget, job.cap_hi, job.blocks_per_slot
    ext_ptr, ext_ids, xu_ptr, xu_units = job.ext_ptr, job.ext_ids, job.xu_ptr, job.xu_units
    keys, prio, used, hk, hb, hn = buf.keys, buf.prio, buf.used, buf.hk, buf.hb, buf.hn
    res_bytes, owner, stamp, n_res, due, nxt, ext_stamp = buf.res_bytes, buf.owner, buf.stamp, buf.n_res, buf.due, \
        buf.nxt, buf.ext_stamp
    n_out, record, err, load, evict = out.n, out.record, out.err, out.load, out.evict
    cand, cand_nu, loads, pinned_k, pinned_b = sc.cand, sc.cand_nu, sc.loads, sc.pinned_k, sc.pinned_b
    U = nbytes.shape[0]
    R = due.shape[0]
    S = cap_hi.shape[0]
    track_due = job.mode == ROUTED
    tag = s * Q + q
    n = 0
    for i in range(sc.ld_start[q], sc.ld_start[q + 1]):
        for a in range(ext_ptr[loads[i]], ext_ptr[loads[i] + 1]):
            x = ext_ids[a]
            for c in range(xu_ptr[x], xu_ptr[x + 1]):
                v = xu_units[c]
                if stamp[v] == tag or owner[v] >= 0 or nxt[v] <= s or nxt[v] >= INF:
                    continue
                if job.runs and nxt[v] - s > job.run_horizon:
                    continue  # a neighbour used too late to earn its room
                whole = True
                for a2 in range(ext_ptr[v], ext_ptr[v + 1]):
                    if ext_stamp[ext_ids[a2]] != tag:
                        whole = False
                        break
                if not whole or ht_find(keys, q * U + v) >= 0:
                    continue
                stamp[v] = tag  # a candidate once
                cand[n] = v
                cand_nu[n] = nxt[v]
                n += 1
    if n == 0:
        return True
    order = np.argsort(cand_nu[:n], kind="mergesort")
    # runs: the recorded loads are sized for admit_max per read (parts: -1, no bound: it never reaches 0)
    room = (sc.ld_start[q + 1] - sc.ld_start[q]) * job.admit_max if job.runs else -1
    for j in range(n):
        if room == 0:
            break
        v = cand[order[j]]
        nv = cand_nu[order[j]]
        if track_due and due[nv % R, q] >= cap_hi[(nv - ep.step0) % S] * bps:
            continue  # q could not serve it at its next use
        b = nbytes[v]
        n_pinned = 0
        while res_bytes[q] + b > budget and hn[q] > 0:
            key, u = heap_pop(hk, hb, hn, q)
            h = ht_find(keys, q * U + u)
            if h < 0 or prio[h] != key:
                continue  # stale entry
            if key <= nv:  # the farthest resident is used no later than v (parts kept at this step too): v is not
                heap_push(hk, hb, hn, q, key, u)  # kept; the heap pops the largest, so nothing later could go
                break
            if used[h] == s:  # used at this step (and farther than v: INF, or a sender's copy): stays
                pinned_k[n_pinned] = key
                pinned_b[n_pinned] = u
                n_pinned += 1
                continue
            if not evict_entry(h, u, key, q, s, track_due, record, keys, due, n_res, res_bytes, nbytes, owner, evict,
                               n_out, err):
                return False
            if not job.runs and key < ep.step0 + S and not evict_chunk(u, key, q, s, ep.step0 + S, track_due, record,
                                                                       job, keys, prio, used, due, n_res, res_bytes,
                                                                       owner, evict, n_out, err):
                return False
        for i in range(n_pinned):  # back before v goes in: the heap never holds more than before the step
            heap_push(hk, hb, hn, q, pinned_k[i], pinned_b[i])
        if res_bytes[q] + b > budget:
            continue
        if insert_entry(q * U + v, nv, s, keys, prio, used, n_res, err) < 0:
            return False
        res_bytes[q] += b
        owner[v] = q
        room -= 1
        if job.runs:  # a neighbour is read for it, in the same request
            out.st[STORED, k, q] += job.stored[v]
        if track_due:
            due[nv % R, q] += 1
        if record:
            if n_out[N_LOAD] == load.shape[0]:
                err[0] = OUT_FULL
                return False
            load[n_out[N_LOAD]] = v
        n_out[N_LOAD] += 1
        if not heap_push_room(hk, hb, hn, q, nv, v, keys, prio, U, hk.shape[1]):
            err[0] = HEAP_FULL
            err[1] = s
            err[2] = q
            return False
    return True


@nb.njit(cache=True, nogil=True, no_cpython_wrapper=True)
def run_steps(peer, job, ep, buf, out):
    """The steps ``ep.first_step .. S-1`` of one epoch, the loop both kernels run: each step's positions get
    buffers (:func:`.routing.assign_step`), grouped by buffer, then the buffers run (:func:`buffer_step`);
    ROUTED clears the step's ``due`` row after it.  ``peer`` a compile-time constant, as in
    :func:`buffer_step`.  Stops at the first failure (``out.err``)."""
    peer = literally(peer)
    sc = scratch(job)
    due = buf.due
    for k in range(ep.first_step, job.bounds.shape[0] - 1):
        assign_step(k, job, ep, buf, out, sc)
        group_by_buffer(k, job, out, sc)
        if not buffer_step(k, peer, job, ep, buf, out, sc):
            return
        if job.mode == ROUTED:
            due[(ep.step0 + k) % due.shape[0], :] = 0
