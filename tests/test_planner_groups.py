"""Blocks used by the same samples are planned as one unit: grouping is exact, plans
expand back to layout blocks, and the replay invariants hold on multi-block layouts."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from solar.scheduler import groups as G
from solar.scheduler.config import PlanConfig
from solar.scheduler.policies import POLICIES
from solar.scheduler.run import Demand, run_policy

from test_planner import replay


def brute_groups(sample_ptr, sample_blocks, n_blocks):
    """Reference: group = set of blocks with the same frozenset of users, numbered by smallest id."""
    users = [set() for _ in range(n_blocks)]
    for s in range(len(sample_ptr) - 1):
        for blk in sample_blocks[sample_ptr[s]:sample_ptr[s + 1]]:
            users[blk].add(s)
    by_set = {}
    for blk in range(n_blocks):
        if users[blk]:
            by_set.setdefault(frozenset(users[blk]), []).append(blk)
    return sorted(by_set.values(), key=min)


@st.composite
def layouts(draw):
    """Windows of frames over trajectories, frames chunked in time, replicated over fields
    (so fields of one frame always go together), plus unused blocks and random sizes."""
    n_traj = draw(st.integers(1, 3))
    T = draw(st.integers(1, 8))
    w = draw(st.integers(1, T))
    c = draw(st.integers(1, 3))  # frames per chunk
    F = draw(st.integers(1, 3))  # fields
    n_chunks = -(-T // c)
    base = n_traj * n_chunks
    extra = draw(st.integers(0, 3))  # blocks no sample uses
    ptr, blocks = [0], []
    for b in range(n_traj):
        for t0 in range(T - w + 1):
            ch = sorted({(t0 + i) // c for i in range(w)})
            for f in range(F):
                blocks += [f * base + b * n_chunks + x for x in ch]
            ptr.append(len(blocks))
    n_blocks = F * base + extra
    sizes = draw(st.lists(st.integers(1, 100), min_size=n_blocks, max_size=n_blocks))
    nb = np.array(sizes, dtype=np.int64)
    stored = (nb * 3) // 4 + 1
    return np.array(ptr, dtype=np.int64), np.array(blocks, dtype=np.int64), nb, stored


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_groups_match_brute_force(lay):
    sp, sb, nb, stored = lay
    group_of, gptr, gblocks = G.block_groups(sp, sb, nb.shape[0])
    ref = brute_groups(sp, sb, nb.shape[0])
    got = [gblocks[gptr[g]:gptr[g + 1]].tolist() for g in range(gptr.shape[0] - 1)]
    assert got == ref
    for g, members in enumerate(ref):
        assert (group_of[members] == g).all()
    used = np.zeros(nb.shape[0], dtype=bool)
    used[sb] = True
    assert (group_of[~used] == -1).all()
    # the group-level demand: each sample's groups in first-block order, no repeats; sizes are sums
    g = G.group_demand(sp, sb, nb, stored)
    for s in range(sp.shape[0] - 1):
        want = list(dict.fromkeys(group_of[sb[sp[s]:sp[s + 1]]].tolist()))
        assert g.g_sample_blocks[g.g_sample_ptr[s]:g.g_sample_ptr[s + 1]].tolist() == want
    for k, members in enumerate(ref):
        assert g.g_nbytes[k] == nb[members].sum() and g.g_stored[k] == stored[members].sum()
        assert g.g_count[k] == len(members)


def test_hash_collisions_are_split(monkeypatch):
    """With a hash that collides on everything, the exact check still separates the groups."""
    monkeypatch.setattr(G, "_mix", lambda x, salt: np.zeros(x.shape, dtype=np.uint64))
    sp = np.array([0, 2, 4, 6], dtype=np.int64)
    sb = np.array([0, 1, 2, 3, 4, 5], dtype=np.int64)  # three samples, two blocks each
    group_of, gptr, gblocks = G.block_groups(sp, sb, 7)
    assert group_of.tolist() == [0, 0, 1, 1, 2, 2, -1]
    assert gblocks.tolist() == [0, 1, 2, 3, 4, 5] and gptr.tolist() == [0, 2, 4, 6]


def test_expand_roundtrip():
    gptr = np.array([0, 2, 3, 6], dtype=np.int64)
    gblocks = np.array([4, 7, 1, 0, 2, 9], dtype=np.int64)
    ids = np.array([2, 0, 1, 0], dtype=np.int64)
    ptr = np.array([0, 1, 1, 4], dtype=np.int64)  # rows: [2], [], [0, 1, 0]
    blocks, nptr = G.expand(ids, ptr, gptr, gblocks)
    assert blocks.tolist() == [0, 2, 9, 4, 7, 1, 4, 7]
    assert nptr.tolist() == [0, 3, 3, 8]
    e_blocks, e_ptr = G.expand(np.zeros(0, np.int64), np.zeros(3, np.int64), gptr, gblocks)
    assert e_blocks.size == 0 and e_ptr.tolist() == [0, 0, 0]


cases = st.fixed_dictionaries(dict(
    lay=layouts(), P=st.integers(1, 4), b=st.integers(1, 4), E=st.integers(1, 3), seed=st.integers(0, 20),
    frac=st.floats(0.0, 1.3), eps=st.sampled_from([0.0, 0.0, 0.5]), policy=st.sampled_from(sorted(POLICIES))))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases)
def test_replay_on_multi_block_layouts(c):
    """Plans on grouped units replay on layout blocks: budget, residency, exact counts."""
    sp, sb, nb, stored = c["lay"]
    d = Demand(sp, sb, nb, stored)
    n, P, b = d.n_samples, c["P"], c["b"]
    sample_bytes = np.array([nb[np.unique(sb[sp[s]:sp[s + 1]])].sum() for s in range(n)])
    grow = 2 + 1 if c["policy"] == "solar2023" else 1 + c["eps"]
    budget = int(max(b * grow * sample_bytes.max() + nb.max(), c["frac"] * nb.sum() / P))
    cfg = PlanConfig(P, b, c["E"], budget, seed=c["seed"], epsilon=c["eps"])
    plans = []
    res = run_policy(d, cfg, c["policy"], record=True, on_epoch=plans.append)
    replay(d, cfg, plans, c["policy"])
    for e, ep in enumerate(plans):
        assert ep.load.max(initial=-1) < d.n_blocks and ep.evict.max(initial=-1) < d.n_blocks
        assert res.miss_bytes[e] == int(nb[ep.load].sum()) == int(ep.miss_bytes.sum())
        assert res.stored_bytes[e] == int(stored[ep.load].sum())
        assert res.hit_bytes[e] + res.miss_bytes[e] <= res.demand_bytes[e]


@pytest.mark.parametrize("policy", ["solar", "nopfs", "ideal"])
def test_grouping_changes_nothing_without_merges(policy):
    """One block per sample or no two blocks with the same users: the same plan either way."""
    for d in (Demand.synthetic(500, 100), Demand.synthetic(600, 100, samples_per_block=3)):
        cfg = PlanConfig(4, 8, 3, int(0.4 * d.block_nbytes.sum() / 4), seed=3)
        a, b = [], []
        ra = run_policy(d, cfg, policy, record=True, on_epoch=a.append)
        rb = run_policy(d, cfg, policy, record=True, on_epoch=b.append, group_blocks=False)
        assert ra.miss_bytes == rb.miss_bytes
        for x, y in zip(a, b):
            assert np.array_equal(x.load, y.load) and np.array_equal(x.evict, y.evict)


def test_grouped_fields_plan_like_one_block():
    """Three equal fields per sample plan exactly like one block of the summed size."""
    one = Demand.synthetic(2048, 300)
    three = Demand.synthetic(2048, 300, blocks_per_sample=3)
    cfg = PlanConfig(8, 16, 3, int(0.5 * 2048 * 300 / 8), seed=2)
    for policy in ("solar", "ideal", "nopfs"):
        r1, r3 = run_policy(one, cfg, policy), run_policy(three, cfg, policy)
        assert r1.miss_bytes == r3.miss_bytes and r1.stored_bytes == r3.stored_bytes
    plans = []
    run_policy(three, cfg, "solar", record=True, on_epoch=plans.append)
    assert all((ep.misses.sum() * 100 == ep.miss_bytes.sum()) for ep in plans)  # counts in layout blocks
