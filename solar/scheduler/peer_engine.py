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

from .kernel import INF
from .steps import run_steps


@nb.njit(cache=True, nogil=True)
def run_epoch_peer(job, ep, buf, out):
    """Process every step of one epoch over Q = ``job.n_buf`` node pools (``job.per_buf`` = L ranks each,
    ``job.ranks`` = P = Q*L ranks); the structs of :mod:`.kernel`, at node level (``cap_lo``/``cap_hi``/
    ``target`` per node, ``budget`` per node; steps before ``ep.first_step`` skipped).  Differences from
    :func:`.engine.run_epoch`:

    job.mode            ROUTED (``solar-peer``: samples routed to the node holding their bytes) or
                        STRIDED (``nopfs-peer``: DistributedSampler's split, node = rank // L)
    job.evict_kind      BELADY (priority: next use in ``nu``) or LRU (priority: minus the last use step)
    job.peer_ok         bool[U] a miss of this unit may be a transfer (the cost model's choice)
    job.refresh_holder  True: a peer's use refreshes the sender's priority (``nu`` is the global next
                        use, or LRU); False: ``nu`` is each node's own next use, which a peer's use leaves
    out.st              every row COUNT .. STAGED_BYTES
    out.stage, x_*      recorded staging reads and transfers (``x_src``/``x_dst`` nodes, ``x_blk`` units)
    out.err             on failure: (status, step, node, 0); a pool never fails for want of room: what
                        does not fit is staged
    """
    run_steps(True, job, ep, buf, out)


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
