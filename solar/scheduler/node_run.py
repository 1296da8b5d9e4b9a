"""One epoch of a node-pool policy (``policies.NODE_POLICIES``) inside
:class:`solar.scheduler.run.PlanRun`: the engine at node level, then each node's samples split over
its ranks, the counts summed into the run's result and, when recorded, the epoch's
:class:`~solar.scheduler.node_plan.NodeEpochPlan` handed to ``on_epoch``.
"""
from __future__ import annotations

import numpy as np

from . import engine as eg
from . import kernel as kn
from . import peer_engine as pe
from .groups import expand
from .node_plan import NodeEpochPlan
from .nodes import split_to_ranks


def node_epoch(run, e: int, idx, acc_ptr, nu, acc_blk, step0: int, result, on_epoch):
    """Plan epoch position ``e`` of ``run`` (a PlanRun of a node-pool policy) and record its results.  An epoch
    that starts at ``run.first_step`` > 0 (a resumed job, from empty pools) is planned and recorded as
    :meth:`~solar.scheduler.run.PlanRun.advance` says: its positions from that step on, ``bounds`` shifted so
    that the steps before are empty, zero counts and empty lists there."""
    pol, cfg, nodes = run.pol, run.cfg, run.nodes
    L, P, S = nodes.ranks_per_node, cfg.world_size, run.S
    job, ep, buf, out = run.kernel_args(acc_ptr, nu, acc_blk, step0, run.record, True)
    err = out.err
    if pol.peer:
        pe.run_epoch_peer(job, ep, buf, out)  # the accesses in position order (PlanRun.positions)
    else:
        eg.run_epoch(job, ep, buf, out)
        if err[0] == kn.TOO_SMALL:
            from .run import BufferTooSmall  # run imports this module
            raise BufferTooSmall(
                f"node buffer of {run.budget:,} bytes ({L} ranks) cannot hold the {int(err[3]):,} bytes of blocks "
                f"that node {int(err[2])} needs at step {int(err[1]) - step0} of epoch {e}: the buffer must hold "
                f"at least one local batch per rank")
    if err[0] != kn.OK:
        raise RuntimeError(f"planner engine failed with status {int(err[0])} at step {int(err[1])}")
    st, node_of, record = out.st, out.buf_of, run.record
    n_load, n_evict, n_stage, n_x = (int(v) for v in out.n)
    f, bounds = run.first_step, run.bounds
    if f:  # a resumed job's first epoch: the steps before f train nothing, keep the positions from f on
        cut = int(bounds[f])
        idx, node_of = idx[cut:], node_of[cut:]
        bounds = np.maximum(bounds - cut, 0)  # int64[S+1]: steps before f empty
    rank_of = split_to_ranks(node_of, bounds, nodes)
    step = np.repeat(np.arange(S, dtype=np.int64), np.diff(bounds))  # (T,) step of each position
    count = np.bincount(step * P + rank_of, minlength=S * P).reshape(S, P)  # (S, P) samples per rank
    miss_bytes = st[kn.MISS_BYTES]
    demand_bytes = int(run.sample_bytes[idx].sum())
    result.hit_bytes.append(int(st[kn.HIT_BYTES].sum()))
    result.miss_bytes.append(int(miss_bytes.sum()))
    result.stored_bytes.append(int(st[kn.STORED].sum()))
    result.demand_bytes.append(demand_bytes)
    result.max_local_batch.append(int(count[f:].max()))
    result.min_local_batch.append(int(count[f:].min()))
    result.rank_miss_bytes.append(miss_bytes.sum(axis=0))  # (Q,) per node
    result.peer_bytes.append(int(st[kn.PEER_BYTES].sum()))
    result.staging_bytes.append(int((st[kn.PEER_BYTES] + st[kn.STAGED_BYTES]).max()))
    if on_epoch is None:
        return
    lists = [None] * 6
    xfer = (None, None, None, None)
    if record:
        lists = [out.load[:n_load], out.load_ptr, out.evict[:n_evict], out.evict_ptr, out.stage[:n_stage],
                 out.stage_ptr]
        src, dst, blk, x_ptr = out.x_src[:n_x], out.x_dst[:n_x], out.x_blk[:n_x], out.x_ptr
        if run.groups is not None:  # back to layout block ids
            g = run.groups
            for i in (0, 2, 4):
                lists[i], lists[i + 1] = expand(lists[i], lists[i + 1], g.group_ptr, g.group_blocks)
            blk, per = expand(blk, np.arange(n_x + 1, dtype=np.int64), g.group_ptr, g.group_blocks)
            sizes = np.diff(per)  # (n_x,) layout blocks of each transferred unit
            src, dst, x_ptr = np.repeat(src, sizes), np.repeat(dst, sizes), per[x_ptr]
        xfer = (src, dst, blk, x_ptr)
    stats = np.ascontiguousarray(st.transpose(1, 2, 0))  # (NST, S, Q) -> (S, Q, NST)
    on_epoch(NodeEpochPlan(e, run.source_epoch(e), step0, idx, bounds, nodes, rank_of, count, stats,
                           demand_bytes, *lists, *xfer))
