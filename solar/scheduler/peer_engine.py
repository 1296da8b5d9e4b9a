"""The numba kernel of the peer policies: one buffer per node (the pool of its ranks), and a
miss whose unit another node holds is planned as a transfer from that node instead of a read.

Pure: arrays in, arrays out; no I/O, no MPI, no clock.

Model (docs/planner.md, "Node pools and peer transfers"), per step s and node n:

1. evict ``evict[s, n]``; 2. read ``load[s, n]`` from storage into the pool (resident, counted
against the node's budget, Belady on the next use); 3. read ``stage[s, n]`` from storage into the
staging area (used at s, not kept: only when the pool cannot make room because every resident is
needed at s by this node or a peer); 4. transfers of step s: each ``(src, dst, unit)`` sends a unit
that ``src`` holds after its steps 1-3 to ``dst``'s staging area; 5. each rank assembles its batch
from its node's pool and staging area, then the staging area is dropped.

A received copy is transient (never resident at the receiver): a *peer unit* (one that the cost
model says is cheaper to send than to read, ``peer_ok``) is resident on at most one node, its
*home* (``owner``), which keeps it as long as its Belady priority says; the units of a pool are
never duplicated in another pool, so the nodes' pools act as one cache of their summed budgets.
Units that are cheaper to read (``peer_ok`` False) are planned as by ``solar`` at node level:
read where needed, owned by their last user, a previous owner's copy evicted first.

Staging memory per node and step is at most the node's units of that step (one node batch);
the runtime holds it beside the pool, like the batches it assembles.
"""
from __future__ import annotations

import numba as nb
import numpy as np

from .engine import (BELADY, FRESH, HEAP_FULL, OUT_FULL, ROUTED, STRIDED, TABLE_FULL, TOMB, heap_pop, heap_push,
                     heap_push_room, ht_find, ht_insert)
from .routing import INF, route_step

# rows of the statistics array st int64[NST, S, Q]
COUNT, HITS, HIT_BYTES, PEER, PEER_BYTES, MISS, MISS_BYTES, STORED, STAGED, STAGED_BYTES = range(10)
NST = 10
# kinds of a node's need of a unit at a step
HIT, RECV, LOAD = 0, 1, 2


@nb.njit(cache=True, nogil=True)
def _push(hk, hb, hn, n, key, u, keys, prio, n_units, heap_cap, err, s):
    if not heap_push_room(hk, hb, hn, n, key, u, keys, prio, n_units, heap_cap):
        err[0] = HEAP_FULL
        err[1] = s
        err[2] = n
        return False
    return True


@nb.njit(cache=True, nogil=True)
def run_epoch_peer(idx, bounds, acc_ptr, nu, step0, Q, L, P, cap_lo, cap_hi, target, mode, evict_kind, budget,
                   sample_ptr, sample_blocks, block_nbytes, block_stored, block_count, peer_ok, refresh_holder,
                   keys, prio, used, hk, hb, hn, res_bytes, owner, stamp, n_res, due, blocks_per_slot,
                   node_of, st, record, load_blk, load_ptr, evict_blk, evict_ptr, stage_blk, stage_ptr,
                   x_src, x_dst, x_blk, x_ptr, err):
    """Process every step of one epoch over Q node pools (L ranks each, P = Q*L ranks).

    Inputs as :func:`.engine.run_epoch` at node level (``cap_lo``/``cap_hi``/``target`` int64[S]
    per node, ``budget`` per node, units = planning units), plus:

    mode            ROUTED (``solar-peer``: samples routed to the node holding their bytes) or
                    STRIDED (``nopfs-peer``: DistributedSampler's split, node = rank // L)
    evict_kind      BELADY (priority: next use in ``nu``) or LRU (priority: minus the last use step)
    peer_ok         bool[B]   a miss of this unit may be a transfer (the cost model's choice)
    refresh_holder  True: a peer's use refreshes the sender's priority (``nu`` is the global next
                    use, or LRU); False: ``nu`` is each node's own next use, which a peer's use leaves
    node_of         int32[T]  out: node of each position
    st              int64[NST, S, Q]  out: rows COUNT .. STAGED_BYTES (units counted in layout blocks)
    load/evict/stage_blk, *_ptr       out (if record): unit ids, CSR over (step, node), ptr int64[S*Q+1]
    x_src, x_dst    int32[X]  out (if record): transfers, sender and receiver node
    x_blk           int64[X]  out (if record): the unit sent; CSR over steps, ``x_ptr`` int64[S+1]
    err             int64[4]  out on failure: (status, step, node, 0)

    Returns ``(n_load, n_evict, n_stage, n_transfers)``.
    """
    U = block_nbytes.shape[0]
    S = bounds.shape[0] - 1
    unit_blocks = block_count.shape[0] == 0
    R = due.shape[0]
    cnt = np.zeros(Q, np.int64)
    lim = np.zeros(Q, np.int64)
    rr = np.zeros(1, np.int64)
    aff_rank = np.empty(64, np.int64)
    aff_val = np.empty(64, np.int64)
    width = bounds[S] - bounds[0] + 1
    pos_by_node = np.empty(width, np.int64)
    node_start = np.zeros(Q + 1, np.int64)
    resv = np.empty(width, np.int64)
    resv_r = np.empty(width, np.int64)
    qfar = np.empty(width, np.int64)
    qpos = np.empty(width, np.int64)
    qkey = np.empty(width, np.int64)
    qord = np.empty(width, np.int64)
    bcnt = np.zeros(width + 2, np.int64)
    # the needs of one step over all nodes, and the holders' refreshes: at most 2 per unit access
    gmax = (np.max(bounds[1:] - bounds[:-1]) if S > 0 else 0) * blocks_per_slot + 1
    nd_node = np.empty(2 * gmax, np.int64)
    nd_unit = np.empty(2 * gmax, np.int64)
    nd_nu = np.empty(2 * gmax, np.int64)
    nd_kind = np.empty(2 * gmax, np.int64)
    nd_start = np.zeros(Q + 1, np.int64)
    pinned_k = np.empty(2 * gmax + 1, np.int64)
    pinned_b = np.empty(2 * gmax + 1, np.int64)
    heap_cap = hk.shape[1]
    n_load = 0
    n_evict = 0
    n_stage = 0
    n_x = 0
    for k in range(S):
        s = step0 + k
        lo = bounds[k]
        hi = bounds[k + 1]
        cnt[:] = 0
        # ------------------------------------------------------------ assignment (node level)
        if mode == STRIDED:
            for p in range(lo, hi):
                n = ((p - lo) % P) // L
                node_of[p] = n
                cnt[n] += 1
        else:
            route_step(k, s, lo, hi, step0, S, Q, idx, acc_ptr, nu, cap_lo, cap_hi, target, sample_ptr,
                       sample_blocks, block_nbytes, owner, node_of, due, blocks_per_slot, cnt, lim, rr, aff_rank,
                       aff_val, resv, resv_r, qfar, qpos, qkey, qord, bcnt)
        node_start[:] = 0
        for p in range(lo, hi):
            node_start[node_of[p] + 1] += 1
        for n in range(Q):
            node_start[n + 1] += node_start[n]
            st[COUNT, k, n] = node_start[n + 1] - node_start[n]
        for n in range(Q):
            lim[n] = node_start[n]
        for p in range(lo, hi):
            n = node_of[p]
            pos_by_node[lim[n]] = p
            lim[n] += 1
        # ------------------------------------------------------------ needs of every node
        # a unit resident on the node is a hit; a peer unit homed elsewhere (resident there, or
        # read there at this step) is received; anything else is read here (a peer unit with no
        # home gets this node as its home: the node that claimed it in routing, else the first
        # node needing it).  Holders of received units are pinned for the step.
        m = 0
        for n in range(Q):
            nd_start[n] = m
            tag = s * Q + n
            for q in range(node_start[n], node_start[n + 1]):
                p = pos_by_node[q]
                smp = idx[p]
                base = sample_ptr[smp]
                for a in range(base, sample_ptr[smp + 1]):
                    u = sample_blocks[a]
                    if stamp[u] == tag:
                        continue
                    stamp[u] = tag
                    unu = nu[acc_ptr[p] + a - base]
                    nblk = 1 if unit_blocks else block_count[u]
                    h = ht_find(keys, n * U + u)
                    kind = LOAD
                    if h >= 0:
                        used[h] = s
                        kind = HIT
                        st[HITS, k, n] += nblk
                        st[HIT_BYTES, k, n] += block_nbytes[u]
                    elif peer_ok[u]:
                        o = owner[u]
                        if o < 0:
                            owner[u] = n
                        elif o != n:
                            kind = RECV
                            st[PEER, k, n] += nblk
                            st[PEER_BYTES, k, n] += block_nbytes[u]
                            if record:
                                x_src[n_x] = o
                                x_dst[n_x] = n
                                x_blk[n_x] = u
                            n_x += 1
                    nd_node[m] = n
                    nd_unit[m] = u
                    nd_nu[m] = unu
                    nd_kind[m] = kind
                    m += 1
        nd_start[Q] = m
        m_needs = m
        # pin the senders' copies (resident before this step) and queue their refreshes
        for i in range(m_needs):
            if nd_kind[i] != RECV:
                continue
            u = nd_unit[i]
            o = owner[u]
            h = ht_find(keys, o * U + u)
            if h >= 0:
                used[h] = s
                if refresh_holder:
                    nd_node[m] = o
                    nd_unit[m] = u
                    nd_nu[m] = nd_nu[i]
                    nd_kind[m] = HIT
                    m += 1
        # ------------------------------------------------------------ pools: evict, read
        for n in range(Q):
            load_bytes = 0
            for i in range(nd_start[n], nd_start[n + 1]):
                if nd_kind[i] == LOAD:
                    load_bytes += block_nbytes[nd_unit[i]]
            n_pinned = 0
            while res_bytes[n] + load_bytes > budget and hn[n] > 0:
                key, u = heap_pop(hk, hb, hn, n)
                h = ht_find(keys, n * U + u)
                if h < 0 or prio[h] != key:
                    continue  # stale entry
                if used[h] == s:  # needed at this step, here or by a peer
                    pinned_k[n_pinned] = key
                    pinned_b[n_pinned] = u
                    n_pinned += 1
                    continue
                keys[h] = TOMB
                if mode == ROUTED and s < key < INF:
                    due[key % R, n] -= 1
                n_res[0] -= 1
                n_res[1] += 1
                res_bytes[n] -= block_nbytes[u]
                if owner[u] == n:
                    owner[u] = -1
                if record:
                    if n_evict == evict_blk.shape[0]:
                        err[0] = OUT_FULL
                        return n_load, n_evict, n_stage, n_x
                    evict_blk[n_evict] = u
                n_evict += 1
            for j in range(n_pinned):
                heap_push(hk, hb, hn, n, pinned_k[j], pinned_b[j])
            for i in range(nd_start[n], nd_start[n + 1]):
                if nd_kind[i] != LOAD:
                    continue
                u = nd_unit[i]
                nblk = 1 if unit_blocks else block_count[u]
                st[MISS, k, n] += nblk
                st[MISS_BYTES, k, n] += block_nbytes[u]
                st[STORED, k, n] += block_stored[u]
                if res_bytes[n] + block_nbytes[u] > budget:  # no room left: read into staging only
                    st[STAGED, k, n] += nblk
                    st[STAGED_BYTES, k, n] += block_nbytes[u]
                    if owner[u] == n and peer_ok[u]:
                        owner[u] = -1
                    if record:
                        stage_blk[n_stage] = u
                    n_stage += 1
                    continue
                if n_res[0] + n_res[1] + 1 > (keys.shape[0] * 7) // 10:
                    err[0] = TABLE_FULL
                    err[1] = s
                    return n_load, n_evict, n_stage, n_x
                h = ht_insert(keys, n * U + u)
                if h < 0:
                    h = -h - 1
                    n_res[1] -= 1  # reused a tombstone
                n_res[0] += 1
                prio[h] = FRESH
                used[h] = s
                res_bytes[n] += block_nbytes[u]
                if record:
                    load_blk[n_load] = u
                n_load += 1
            if record:
                load_ptr[k * Q + n + 1] = n_load
                evict_ptr[k * Q + n + 1] = n_evict
                stage_ptr[k * Q + n + 1] = n_stage
        if record:
            x_ptr[k + 1] = n_x
        # ------------------------------------------------------------ priorities
        for i in range(m):
            if nd_kind[i] == RECV:
                continue
            n = nd_node[i]
            u = nd_unit[i]
            h = ht_find(keys, n * U + u)
            if h < 0:
                continue  # staged, not kept
            newp = nd_nu[i] if evict_kind == BELADY else -s
            if peer_ok[u]:
                if prio[h] == newp:
                    continue  # already refreshed at this step (the home used it too)
                if mode == ROUTED and newp < INF:
                    due[newp % R, n] += 1
            elif mode == ROUTED:
                # as the solar engine: the unit follows its last user, a previous owner's copy goes first
                o = owner[u]
                if o != n:
                    if o >= 0:
                        h2 = ht_find(keys, o * U + u)
                        if h2 >= 0 and prio[h2] < INF:
                            if prio[h2] > s:
                                due[prio[h2] % R, o] -= 1
                            prio[h2] = INF
                            if not _push(hk, hb, hn, o, INF, u, keys, prio, U, heap_cap, err, s):
                                return n_load, n_evict, n_stage, n_x
                    owner[u] = n
                if newp < INF:
                    slot = newp % R
                    if due[slot, n] < cap_hi[(newp - step0) % S] * blocks_per_slot:
                        due[slot, n] += 1
                    else:
                        newp = INF  # this node cannot serve another unit at that step
            else:
                owner[u] = n
            if prio[h] == newp:
                continue
            prio[h] = newp
            if not _push(hk, hb, hn, n, newp, u, keys, prio, U, heap_cap, err, s):
                return n_load, n_evict, n_stage, n_x
        if mode == ROUTED:
            due[s % R, :] = 0
    return n_load, n_evict, n_stage, n_x


@nb.njit(cache=True, nogil=True)
def next_use_nodes(idx, bounds, step0, idx_f, n_future, acc_ptr, P, L, sample_ptr, sample_blocks, last, nu):
    """As :func:`.engine.next_use` with ``per_rank``, but per node under the strided split: position
    p of a batch starting at lo goes to rank (p - lo) % P on node ((p - lo) % P) // L, and the next
    use of an access is the next step at which the same node uses the unit (INF: never)."""
    Q = P // L
    S = bounds.shape[0] - 1
    T = idx.shape[0]
    for g in range(Q):
        for j in range(n_future - 1, -1, -1):
            off = j * T
            for k in range(S - 1, -1, -1):
                for m0 in range(bounds[k] + g * L, bounds[k + 1], P):
                    for p in range(m0, min(m0 + L, bounds[k + 1])):
                        smp = idx_f[off + p]
                        for a in range(sample_ptr[smp], sample_ptr[smp + 1]):
                            last[sample_blocks[a]] = step0 + (j + 1) * S + k
        for k in range(S - 1, -1, -1):
            for m0 in range(bounds[k] + g * L, bounds[k + 1], P):
                for p in range(m0, min(m0 + L, bounds[k + 1])):
                    smp = idx[p]
                    base = sample_ptr[smp]
                    for a in range(base, sample_ptr[smp + 1]):
                        nu[acc_ptr[p] + a - base] = last[sample_blocks[a]]
            for m0 in range(bounds[k] + g * L, bounds[k + 1], P):
                for p in range(m0, min(m0 + L, bounds[k + 1])):
                    smp = idx[p]
                    for a in range(sample_ptr[smp], sample_ptr[smp + 1]):
                        last[sample_blocks[a]] = step0 + k
        for j in range(-1, n_future):  # reset what this group touched
            src = idx if j < 0 else idx_f[j * T:(j + 1) * T]
            for k in range(S):
                for m0 in range(bounds[k] + g * L, bounds[k + 1], P):
                    for p in range(m0, min(m0 + L, bounds[k + 1])):
                        smp = src[p]
                        for a in range(sample_ptr[smp], sample_ptr[smp + 1]):
                            last[sample_blocks[a]] = INF
