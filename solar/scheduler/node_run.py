"""One epoch of a node-pool policy (``policies.NODE_POLICIES``) inside
:class:`solar.scheduler.run.PlanRun`: the engine at node level, then each node's samples split over
its ranks, the counts summed into the run's result and, when recorded, the epoch's
:class:`~solar.scheduler.node_plan.NodeEpochPlan` handed to ``on_epoch``.
"""
from __future__ import annotations

import numpy as np

from . import engine as eg
from . import peer_engine as pe
from .groups import expand
from .node_plan import NodeEpochPlan
from .nodes import split_to_ranks


def node_epoch(run, e: int, idx, acc_ptr, nu, acc_blk, step0: int, result, on_epoch):
    """Plan epoch position ``e`` of ``run`` (a PlanRun of a node-pool policy) and record its results."""
    pol, cfg, nodes = run.pol, run.cfg, run.nodes
    Q, L, P, S = run.P_eng, nodes.ranks_per_node, cfg.world_size, run.S
    A = int(acc_ptr[-1])
    record = run.record
    node_of = np.empty(run.total, dtype=np.int32)
    st = np.zeros((pe.NST, S, Q), dtype=np.int64)  # rows pe.COUNT .. pe.STAGED_BYTES
    i64 = np.zeros(0, dtype=np.int64)
    i32 = np.zeros(0, dtype=np.int32)
    load = evict = stage = x_blk = i64
    x_src = x_dst = i32
    load_ptr, evict_ptr, stage_ptr = (np.zeros(S * Q + 1, dtype=np.int64) if record else i64 for _ in range(3))
    x_ptr = np.zeros(S + 1, dtype=np.int64) if record else i64
    if record:
        load, stage, x_blk = np.empty(A, np.int64), np.empty(A, np.int64), np.empty(A, np.int64)
        evict = np.empty(A + int(run.n_res[0]) + 1, dtype=np.int64)
        x_src, x_dst = np.empty(A, np.int32), np.empty(A, np.int32)
    err = run.err
    err[:] = 0
    n_stage = n_x = 0
    if pol.peer:
        # the engines take the accesses in position order: see PlanRun.positions
        n_load, n_evict, n_stage, n_x = pe.run_epoch_peer(
            run.positions(), run.bounds, acc_ptr, nu, step0, Q, L, P, run.cap_lo, run.cap_hi, run.share, pol.mode,
            pol.evict, run.budget, acc_ptr, acc_blk, run.nb, run.stored_nb, run.unit_count, run.peer_ok,
            pol.next_use != "node", run.keys, run.prio, run.used, run.hk, run.hbk, run.hn, run.res_bytes, run.owner,
            run.stamp, run.n_res, run.due,
            run.max_blocks_sample, node_of, st, record, load, load_ptr, evict, evict_ptr, stage, stage_ptr,
            x_src, x_dst, x_blk, x_ptr, err)
    else:
        rows = [st[pe.COUNT], st[pe.HITS], st[pe.HIT_BYTES], st[pe.MISS], st[pe.MISS_BYTES], st[pe.STORED]]
        n_load, n_evict = eg.run_epoch(  # accesses in position order (PlanRun.positions)
            run.positions(), run.bounds, acc_ptr, nu, step0, Q, run.cap_lo, run.cap_hi, run.share, pol.mode,
            pol.evict, run.budget, run.boundary_steps, acc_ptr, acc_blk, run.nb, run.stored_nb, run.unit_count,
            run.keys, run.prio, run.used, run.hk, run.hbk, run.hn, run.res_bytes, run.owner, run.stamp, run.n_res,
            node_of,
            *rows, record, load, load_ptr, evict, evict_ptr, err, run.due, run.max_blocks_sample)
        if err[0] == eg.TOO_SMALL:
            from .run import BufferTooSmall  # run imports this module
            raise BufferTooSmall(
                f"node buffer of {run.budget:,} bytes ({L} ranks) cannot hold the {int(err[3]):,} bytes of blocks "
                f"that node {int(err[2])} needs at step {int(err[1]) - step0} of epoch {e}: the buffer must hold "
                f"at least one local batch per rank")
    if err[0] != eg.OK:
        raise RuntimeError(f"planner engine failed with status {int(err[0])} at step {int(err[1])}")
    rank_of = split_to_ranks(node_of, run.bounds, nodes)
    step = np.repeat(np.arange(S, dtype=np.int64), np.diff(run.bounds))  # (T,) step of each position
    count = np.bincount(step * P + rank_of, minlength=S * P).reshape(S, P)  # (S, P) samples per rank
    miss_bytes = st[pe.MISS_BYTES]
    demand_bytes = int(run.sample_bytes[idx].sum())
    result.hit_bytes.append(int(st[pe.HIT_BYTES].sum()))
    result.miss_bytes.append(int(miss_bytes.sum()))
    result.stored_bytes.append(int(st[pe.STORED].sum()))
    result.demand_bytes.append(demand_bytes)
    result.max_local_batch.append(int(count.max()))
    result.min_local_batch.append(int(count.min()))
    result.rank_miss_bytes.append(miss_bytes.sum(axis=0))  # (Q,) per node
    result.peer_bytes.append(int(st[pe.PEER_BYTES].sum()))
    result.staging_bytes.append(int((st[pe.PEER_BYTES] + st[pe.STAGED_BYTES]).max()))
    if on_epoch is None:
        return
    lists = [None] * 6
    xfer = (None, None, None, None)
    if record:
        lists = [load[:n_load], load_ptr, evict[:n_evict], evict_ptr, stage[:n_stage], stage_ptr]
        src, dst, blk = x_src[:n_x], x_dst[:n_x], x_blk[:n_x]
        if run.groups is not None:  # back to layout block ids
            g = run.groups
            for i in (0, 2, 4):
                lists[i], lists[i + 1] = expand(lists[i], lists[i + 1], g.group_ptr, g.group_blocks)
            blk, per = expand(blk, np.arange(n_x + 1, dtype=np.int64), g.group_ptr, g.group_blocks)
            sizes = np.diff(per)  # (n_x,) layout blocks of each transferred unit
            src, dst, x_ptr = np.repeat(src, sizes), np.repeat(dst, sizes), per[x_ptr]
        xfer = (src, dst, blk, x_ptr)
    stats = np.ascontiguousarray(st.transpose(1, 2, 0))  # (NST, S, Q) -> (S, Q, NST)
    on_epoch(NodeEpochPlan(e, run.source_epoch(e), step0, idx, run.bounds, nodes, rank_of, count, stats,
                           demand_bytes, *lists, *xfer))
