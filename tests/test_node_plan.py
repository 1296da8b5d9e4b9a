"""Node pools (issue 11): the ranks of a node share one buffer; plans replayed independently.

A node plan is replayed step by step from its lists alone (evict, load, stage, transfers) and
checked against the layout: global batches are DistributedSampler's, every rank gets its local
batch, a node's pool never exceeds the node's budget, every block a rank's samples need is in its
node's pool or staging area (or received) when the batch is assembled, a block is sent only by a
node that holds it, and the recorded counts are exactly the replayed ones.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from solar.errors import SpecError
from solar.scheduler.config import PlanConfig
from solar.scheduler.kernel import ROUTED
from solar.scheduler.node_plan import NODE_STATS, plan_nodes
from solar.scheduler.nodes import NodeMap, PeerCost, split_to_ranks
from solar.scheduler.policies import NODE_POLICIES, get_policy
from solar.scheduler.run import BufferTooSmall, Demand, run_policy
from solar.scheduler.sampler import epoch_indices
from solar.topology import Topology

from test_planner import reference_batches

COL = {name: i for i, name in enumerate(NODE_STATS)}


def windows(traj: int, steps: int, frames: int = 5, frame_bytes: int = 64) -> Demand:
    """Well-like windows: sample i of a trajectory uses its frames i .. i+frames-1 (one block each)."""
    per = steps - frames + 1
    t = np.repeat(np.arange(traj, dtype=np.int64), per)  # (traj*per,) trajectory of each sample
    i = np.tile(np.arange(per, dtype=np.int64), traj)  # (traj*per,) first frame of each sample
    blocks = ((t * steps + i)[:, None] + np.arange(frames)).reshape(-1)  # (traj*per*frames,)
    nb = np.full(traj * steps, frame_bytes, dtype=np.int64)
    ptr = np.arange(0, blocks.shape[0] + 1, frames, dtype=np.int64)
    return Demand(ptr, blocks, nb, nb.copy())


def replay_nodes(demand, cfg, nodes, epochs, unique=None):
    """Replay node plans from their lists; per epoch (storage bytes, peer bytes, most bytes a node stages).

    ``unique``: bool[B], blocks that may be resident in at most one node pool at a time."""
    Q, L, P = nodes.n_nodes, nodes.ranks_per_node, nodes.world_size
    budget = cfg.buffer_bytes * L
    nb, st_b = demand.block_nbytes, demand.block_stored
    sp, sb = demand.sample_ptr, demand.sample_blocks
    resident = [set() for _ in range(Q)]
    used = np.zeros(Q, dtype=np.int64)
    out = []
    for ep in epochs:
        S = ep.bounds.shape[0] - 1
        storage = peer = staging = 0
        assert ep.rank_of.dtype == np.int32 and ((ep.rank_of >= 0) & (ep.rank_of < P)).all()
        for k in range(S):
            lo, hi = ep.bounds[k], ep.bounds[k + 1]
            need = [set() for _ in range(Q)]
            for p in range(lo, hi):
                smp = ep.indices[p]
                need[ep.rank_of[p] // L].update(sb[sp[smp]:sp[smp + 1]].tolist())
            staged = []
            hits = []
            for n in range(Q):
                row = k * Q + n
                hits.append(len(need[n] & resident[n]))
                for blk in ep.evict[ep.evict_ptr[row]:ep.evict_ptr[row + 1]].tolist():
                    assert blk in resident[n] and blk not in need[n], "evicted a block not resident or needed now"
                    resident[n].remove(blk)
                    used[n] -= nb[blk]
                loads = ep.load[ep.load_ptr[row]:ep.load_ptr[row + 1]].tolist()
                for blk in loads:
                    assert blk not in resident[n] and blk in need[n], "loaded a block resident or not needed"
                    resident[n].add(blk)
                    used[n] += nb[blk]
                assert used[n] <= budget, "node pool over budget"
                stg = set(ep.stage[ep.stage_ptr[row]:ep.stage_ptr[row + 1]].tolist())
                assert not (stg & resident[n]) and stg <= need[n]
                staged.append(stg)
                storage += int(st_b[loads].sum()) + int(st_b[sorted(stg)].sum())
            recv = [set() for _ in range(Q)]
            for x in range(ep.xfer_ptr[k], ep.xfer_ptr[k + 1]):
                src, dst, blk = int(ep.xfer_src[x]), int(ep.xfer_dst[x]), int(ep.xfer_block[x])
                assert src != dst
                assert blk in resident[src] or blk in staged[src], "a block sent by a node not holding it"
                assert blk in need[dst] and blk not in resident[dst] and blk not in recv[dst]
                recv[dst].add(blk)
                peer += int(nb[blk])
            for n in range(Q):
                assert need[n] <= resident[n] | staged[n] | recv[n], "a needed block is not on the node"
                row = ep.stats[k, n]
                assert row[COL["hits"]] == hits[n]
                assert row[COL["peer"]] == len(recv[n])
                assert row[COL["misses"]] == len(need[n]) - hits[n] - len(recv[n])
                assert row[COL["staged"]] == len(staged[n])
                assert row[COL["staged_bytes"]] == int(nb[sorted(staged[n])].sum())
                assert row[COL["peer_bytes"]] == int(nb[sorted(recv[n])].sum())
                staging = max(staging, int(nb[sorted(staged[n] | recv[n])].sum()))
                assert row[COL["samples"]] == ep.count[k, n * L:(n + 1) * L].sum()
            if unique is not None:
                seen = set()
                for n in range(Q):
                    mine = {x for x in resident[n] if unique[x]}
                    assert not (seen & mine), "a block resident in two node pools"
                    seen |= mine
        out.append((storage, peer, staging))
    return out


def check_batches(ep, n, P, b, seed, drop_last, eps):
    assert np.array_equal(ep.indices, epoch_indices(n, P, seed, ep.source_epoch, drop_last))
    ref = reference_batches(n, P, b, seed, ep.source_epoch, drop_last)
    S = ep.bounds.shape[0] - 1
    assert S == len(ref)
    for k in range(S):
        assert sorted(ep.indices[ep.bounds[k]:ep.bounds[k + 1]].tolist()) == ref[k]
    share = np.diff(ep.bounds) // P
    lo = np.maximum(1, np.ceil(share * (1 - eps) - 1e-9))
    hi = np.floor(share * (1 + eps) + 1e-9)
    assert (ep.count >= lo[:, None]).all() and (ep.count <= hi[:, None]).all()
    assert (ep.count.sum(axis=1) == np.diff(ep.bounds)).all()
    # each rank's count is its positions' count
    step = np.repeat(np.arange(S), np.diff(ep.bounds))
    assert np.array_equal(np.bincount(step * P + ep.rank_of, minlength=S * P).reshape(S, P), ep.count)


configs = st.fixed_dictionaries(dict(
    n=st.integers(1, 100), PL=st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2), (4, 1), (6, 3), (6, 2), (4, 4)]),
    b=st.integers(1, 5), E=st.integers(1, 3), drop_last=st.booleans(), seed=st.integers(0, 50),
    frac=st.floats(0.0, 1.4), kind=st.sampled_from(["synthetic", "windows"]), spb=st.integers(1, 3),
    bps=st.integers(1, 2), eps=st.sampled_from([0.0, 0.0, 0.25, 0.5]), policy=st.sampled_from(sorted(NODE_POLICIES))))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs)
def test_node_plan_replays(c):
    (P, L), b, pol = c["PL"], c["b"], get_policy(c["policy"])
    if c["kind"] == "windows":
        d = windows(max(1, c["n"] // 20), 20 if c["n"] >= 20 else c["n"] + 4, frames=1 + c["bps"] * 2)
    else:
        d = Demand.synthetic(c["n"], 64 * c["spb"], samples_per_block=c["spb"], blocks_per_sample=c["bps"])
    n = d.n_samples
    if c["drop_last"] and n < P:
        return
    eps = c["eps"] if pol.mode == ROUTED else 0.0
    sample_max = int(max(d.block_nbytes[d.sample_blocks[d.sample_ptr[s]:d.sample_ptr[s + 1]]].sum()
                         for s in range(n)))
    budget = int(c["frac"] * d.block_nbytes.sum() / P)
    if not pol.peer:  # the engine needs room for a local batch per rank; peer plans stage what does not fit
        budget = max(budget, int(b * (1 + eps) + 1) * sample_max)
    cfg = PlanConfig(P, b, c["E"], budget, seed=c["seed"], drop_last=c["drop_last"], epsilon=c["eps"])
    nodes = NodeMap(P, L)
    plan, res = plan_nodes(d, cfg, nodes, c["policy"])
    epochs = []
    run_policy(d, cfg, c["policy"], record=True, on_epoch=epochs.append, nodes=nodes)
    assert len(epochs) == c["E"]
    for ep in epochs:
        check_batches(ep, n, P, b, c["seed"], c["drop_last"], eps)
        if not c["drop_last"]:
            assert set(ep.indices.tolist()) == set(range(n))  # every sample in every epoch
        if not pol.peer:
            assert ep.xfer_block.size == 0 and ep.stage.size == 0
    got = replay_nodes(d, cfg, nodes, epochs, unique=np.ones(d.n_blocks, bool) if pol.peer else None)
    assert [g[0] for g in got] == res.stored_bytes
    assert [g[1] for g in got] == res.peer_bytes
    if pol.peer:
        assert [g[2] for g in got] == res.staging_bytes
    for e, ep in enumerate(epochs):
        assert res.miss_bytes[e] == int(ep.stats[:, :, COL["miss_bytes"]].sum())
        assert res.miss_bytes[e] + res.peer_bytes[e] + res.hit_bytes[e] <= res.demand_bytes[e]
    # the joined plan holds the same lists, and per-rank slices give each rank's samples
    S = epochs[0].bounds.shape[0] - 1
    assert plan.n_steps == S * c["E"]
    assert plan.predicted()["stored_bytes"] == sum(res.stored_bytes)
    for r in range(P):
        mine = plan.rank(r)
        for e, ep in enumerate(epochs):
            for k in range(S):
                g = e * S + k
                pos = np.arange(ep.bounds[k], ep.bounds[k + 1])
                want = ep.indices[pos[ep.rank_of[pos] == r]]
                assert mine["samples"][mine["samples_ptr"][g]:mine["samples_ptr"][g + 1]].tolist() == want.tolist()
    for q in range(nodes.n_nodes):
        mine = plan.node(q)
        assert mine["load_ptr"].shape == (plan.n_steps + 1,)
        assert int(mine["recv_ptr"][-1]) == int((plan.xfer_dst == q).sum())
        assert int(mine["send_ptr"][-1]) == int((plan.xfer_src == q).sum())


@pytest.mark.parametrize("d", [Demand.synthetic(600, 100), Demand.synthetic(500, 100, samples_per_block=2),
                               windows(6, 30)])
def test_one_rank_per_node_is_solar(d):
    """solar-node with one rank per node is solar itself, list for list."""
    cfg = PlanConfig(4, 3, 3, int(0.5 * d.block_nbytes.sum() / 4), seed=2, epsilon=0.25)
    a, b = [], []
    ra = run_policy(d, cfg, "solar", record=True, on_epoch=a.append)
    rb = run_policy(d, cfg, "solar-node", record=True, on_epoch=b.append, nodes=NodeMap(4, 1))
    assert ra.miss_bytes == rb.miss_bytes and ra.stored_bytes == rb.stored_bytes
    for x, y in zip(a, b):
        assert np.array_equal(x.rank_of, y.rank_of)
        assert np.array_equal(x.load, y.load) and np.array_equal(x.load_ptr, y.load_ptr)
        assert np.array_equal(x.evict, y.evict) and np.array_equal(x.evict_ptr, y.evict_ptr)


@pytest.mark.parametrize("policy", ["solar-node", "solar-peer"])
@pytest.mark.parametrize("d", [Demand.synthetic(640, 100), windows(8, 40)])
def test_one_node_is_the_ideal(policy, d):
    """All ranks on one node: one Belady pool of P x budget, exactly the ideal's storage bytes."""
    for f in (0.3, 0.6):
        cfg = PlanConfig(4, 4, 3, int(f * d.block_nbytes.sum() / 4), seed=5)
        ideal = run_policy(d, cfg, "ideal")
        ours = run_policy(d, cfg, policy, nodes=NodeMap(4, 4))
        assert ours.stored_bytes == ideal.stored_bytes and ours.miss_bytes == ideal.miss_bytes
        assert ours.peer_bytes == [0, 0, 0]


def test_node_pools_pool_fractional_budgets():
    """A rank budget of 2.5 blocks holds 2; a node of 4 ranks holds 10: node pools hit more."""
    d = Demand.synthetic(512, 1000)
    cfg = PlanConfig(8, 2, 3, 2500, seed=0)
    solar = run_policy(d, cfg, "solar").steady_hit_rate
    node = run_policy(d, cfg, "solar-node", nodes=NodeMap(8, 4)).steady_hit_rate
    assert node > solar


def test_split_to_ranks_exact():
    bounds = np.array([0, 7, 12], dtype=np.int64)
    node_of = np.array([1, 0, 1, 1, 0, 1, 1, 0, 0, 0, 1, 1], dtype=np.int32)  # step 0: node 1 x5, node 0 x2
    rank = split_to_ranks(node_of, bounds, NodeMap(4, 2))
    # step 0: node 1 positions 0,2,3,5,6 -> ranks 2,2,2,3,3; node 0 positions 1,4 -> ranks 0,1
    # step 1: node 0 positions 7,8,9 -> 0,0,1; node 1 positions 10,11 -> 2,3
    assert rank.tolist() == [2, 0, 2, 2, 1, 3, 3, 0, 0, 1, 2, 3]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.lists(st.integers(0, 20), min_size=1, max_size=12), st.integers(0, 99))
def test_split_to_ranks_matches_its_definition(L, Q, sizes, seed):
    """Each step's samples of node n go, in index order, to ranks n*L .. n*L+L-1: the first c % L ranks take
    ceil(c/L), the others floor(c/L) (c: the node's samples at that step)."""
    bounds = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    node_of = np.random.default_rng(seed).integers(0, Q, int(bounds[-1])).astype(np.int32)
    rank = split_to_ranks(node_of, bounds, NodeMap(Q * L, L))
    assert rank.dtype == np.int32
    for k in range(len(sizes)):
        for n in range(Q):
            pos = [p for p in range(bounds[k], bounds[k + 1]) if node_of[p] == n]
            c = len(pos)
            want = [n * L + r for r in range(L) for _ in range(c // L + (1 if r < c % L else 0))]
            assert rank[pos].tolist() == want


def test_node_map_and_cost_validation():
    with pytest.raises(SpecError, match="ranks_per_node 3 does not divide world_size 8"):
        NodeMap(8, 3)
    with pytest.raises(SpecError, match="ranks_per_node must be a positive integer, got 0"):
        NodeMap(8, 0)
    assert NodeMap.from_topology(Topology(8, 3, 1, 4, 2)) == NodeMap(8, 4)
    with pytest.raises(SpecError, match="same number of ranks on every node"):
        NodeMap.from_topology(Topology(6, 0, 0, 4, 2))
    with pytest.raises(SpecError, match="network_bytes_per_s must be a finite number .* got -1"):
        PeerCost(-1)
    with pytest.raises(SpecError, match="storage_bytes_per_s .* got nan"):
        PeerCost(1e9, float("nan"))
    ok = PeerCost(10.0, 1.0).peer_ok(np.array([100, 100, 100]), np.array([5, 10, 20]))
    assert ok.tolist() == [False, False, True]  # 100/10 < 5/1? no; 10 < 10? no; 10 < 20 yes
    d = Demand.synthetic(64, 10)
    with pytest.raises(SpecError, match="pass nodes=NodeMap"):
        run_policy(d, PlanConfig(2, 4, 1, 400), "solar-node")
    with pytest.raises(SpecError, match="node map has 4 ranks but the job's world size is 2"):
        run_policy(d, PlanConfig(2, 4, 1, 400), "solar-peer", nodes=NodeMap(4, 2))
    with pytest.raises(SpecError, match="unknown policy 'nope'; valid policies: .*solar-peer"):
        get_policy("nope")
    with pytest.raises(SpecError, match="plans a buffer per rank"):
        plan_nodes(d, PlanConfig(2, 4, 1, 400), NodeMap(2, 1), "solar")


def test_node_buffer_too_small_names_the_node():
    d = Demand.synthetic(100, 1000)
    with pytest.raises(BufferTooSmall, match="node buffer of 14,000 bytes \\(2 ranks\\)"):
        run_policy(d, PlanConfig(4, 8, 1, 7000), "solar-node", nodes=NodeMap(4, 2))
