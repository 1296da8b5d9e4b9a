"""Open-ended node plans (issue 25, item 1): ``solar plan --ranks-per-node L --epochs auto``.

* the node planner goes on from its state window after window, as the per-rank one does
  (``test_planner_windows.py``): windows planned one after the other equal one call, and the first E
  epochs equal those of any longer fixed-epoch node plan; the plans replay (every sample once per epoch,
  DistributedSampler's global batches, pools within budget, transfers from a node holding the block);
* the file (format version 6, ``open_ended``) holds the first window, and what every rank plans of the next
  windows (:class:`~solar.loader.node_windows.NodeWindowPlanner`) is bit for bit the file of a longer first
  window;
* ``mpi``: a :class:`~solar.SolarLoader` on an open-ended node plan goes across window edges, serially and
  under ``mpiexec -n 2``, and delivers h5py's bytes and the one-shot plan's samples.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import on_root
from helpers import h5py_sample, make_dataset
from solar.errors import SpecError
from solar.schedule import Schedule, plan
from solar.scheduler.config import PlanConfig
from solar.scheduler.nodes import NodeMap
from solar.scheduler.run import Demand, PlanRun, run_policy

from test_node_plan import check_batches, replay_nodes, windows
from test_planner_windows import _windows

NODE_OPEN_POLICIES = ["solar-node", "solar-peer", "lru-peer"]  # nopfs-peer looks at every epoch ahead


def key(ep):
    """Everything a node epoch plan decides, as plain lists."""
    return (ep.position, ep.source_epoch, ep.indices.tolist(), ep.rank_of.tolist(), ep.count.tolist(),
            ep.stats.tolist(), *(getattr(ep, n).tolist() for n in (
                "load", "load_ptr", "evict", "evict_ptr", "stage", "stage_ptr", "xfer_src", "xfer_dst",
                "xfer_block", "xfer_ptr")))


cases = st.fixed_dictionaries(dict(
    n=st.integers(8, 70), PL=st.sampled_from([(2, 1), (2, 2), (4, 2), (6, 3), (4, 1)]), b=st.integers(1, 4),
    kind=st.sampled_from(["synthetic", "windows"]), spb=st.integers(1, 3), frac=st.floats(0.05, 1.2),
    seed=st.integers(0, 50), drop_last=st.booleans(), eps=st.sampled_from([0.0, 0.25]),
    policy=st.sampled_from(NODE_OPEN_POLICIES), sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3)))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases)
def test_node_windows_equal_one_call_and_a_longer_fixed_plan(c):
    (P, L), b = c["PL"], c["b"]
    if c["kind"] == "windows":
        d = windows(max(1, c["n"] // 20), 20 if c["n"] >= 20 else c["n"] + 4, frames=1 + c["spb"])
    else:
        d = Demand.synthetic(c["n"], 64, c["spb"], 1)
    n = d.n_samples
    if c["drop_last"] and n < P:
        return
    eps = c["eps"] if c["policy"] != "lru-peer" else 0.0
    sample_max = int(max(d.block_nbytes[d.sample_blocks[d.sample_ptr[s]:d.sample_ptr[s + 1]]].sum()
                         for s in range(n)))
    budget = max(int(c["frac"] * d.block_nbytes.sum() / P), int(b * (1 + c["eps"]) + 1) * sample_max)
    E = sum(c["sizes"])
    cfg = PlanConfig(P, b, E, budget, c["seed"], c["drop_last"], c["eps"])
    nodes = NodeMap(P, L)
    windowed = _windows(d, cfg, c["policy"], c["sizes"], nodes=nodes)
    one = []
    PlanRun(d, cfg, c["policy"], record=True, open_ended=True, nodes=nodes).advance(E, on_epoch=one.append)
    assert [key(p) for p in windowed] == [key(p) for p in one]
    longer = []  # the first E epochs of a fixed node plan of E + 2 epochs (its epoch E - 1 sees the future too)
    run_policy(d, PlanConfig(P, b, E + 2, budget, c["seed"], c["drop_last"], c["eps"]), c["policy"], record=True,
               on_epoch=longer.append, nodes=nodes)
    assert [key(p) for p in windowed] == [key(p) for p in longer[:E]]
    for ep in windowed:  # DistributedSampler's global batches, every sample once per epoch
        check_batches(ep, n, P, b, c["seed"], c["drop_last"], eps)
        if not c["drop_last"]:
            assert set(ep.indices.tolist()) == set(range(n))
    replay_nodes(d, cfg, nodes, windowed)  # pools within budget, residency and transfers hold across window edges


@pytest.mark.parametrize("policy", ["solar-node", "solar-peer"])
def test_a_fixed_node_plan_differs_only_in_its_last_epoch(policy):
    d = Demand.synthetic(96, 1000, 2, 1)
    cfg = PlanConfig(4, 4, 4, 12_000, 3)
    nodes = NodeMap(4, 2)
    fixed, open_ = [], []
    run_policy(d, cfg, policy, record=True, on_epoch=fixed.append, nodes=nodes)
    PlanRun(d, cfg, policy, record=True, open_ended=True, nodes=nodes).advance(4, on_epoch=open_.append)
    assert [key(p) for p in fixed[:3]] == [key(p) for p in open_[:3]]
    assert key(fixed[3]) != key(open_[3])  # the fixed plan's last epoch keeps blocks nobody will use


# ------------------------------------------------------------------------------------------ the file
@pytest.fixture(scope="module")
def well_dir(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("nodewin"), "well", "chunked", samples=4, steps=12)


def lists_of(p, r):
    """Rank r's samples and its node's lists in NodeRankPlan ``p``, per global step (lists of lists)."""
    def rows(ids, ptr):
        ids, ptr = np.asarray(ids, np.int64), np.asarray(ptr)
        return [ids[ptr[g]:ptr[g + 1]].tolist() for g in range(ptr.shape[0] - 1)]
    node = p.node(p.node_id)
    out = {"samples": rows(p.samples, p.samples_ptr), "stats": node["stats"].tolist()}
    for name in ("load", "evict", "stage", "send", "recv"):
        out[name] = rows(node[name], node[name + "_ptr"])
    for name, other in (("send", "send_to"), ("recv", "recv_from")):
        out[other] = rows(node[other], node[name + "_ptr"])
    return out


@pytest.mark.parametrize("policy", ["solar-peer", "solar-node"])
def test_windows_planned_by_the_ranks_equal_the_file_of_a_longer_window(well_dir, tmp_path, policy):
    from solar.loader.node_windows import NodeWindowPlanner
    from solar.buffer.warmup import resident_at
    P, L, K = 4, 2, 1
    frac = 0.25 if policy == "solar-peer" else 0.5  # a node pool without transfers holds its ranks' batches
    kw = dict(world_size=P, local_batch=2, buffer_fraction=frac, ranks_per_node=L, policy=policy, seed=5)
    first = plan(well_dir, epochs="auto", window=K, out=str(tmp_path / "w1.h5"), **kw)
    whole = plan(well_dir, epochs="auto", window=3 * K, out=str(tmp_path / "w3.h5"), **kw)
    with first, whole:
        assert first.version == 6 and first.open_ended and first.window == K and first.nodes == NodeMap(P, L)
        S = first.steps_per_epoch
        transfers = 0
        for r in range(P):
            planner = NodeWindowPlanner(first, r, first.node_plan(r))
            want = lists_of(whole.node_plan(r), r)
            assert planner.rank_plan(0) is first.node_plan(r)
            for w in range(3):
                got_plan = planner.rank_plan(w)
                got = lists_of(got_plan, r)
                lo, hi = w * K * S, (w + 1) * K * S
                assert got_plan.n_steps == hi
                for name in want:
                    assert got[name][lo:hi] == want[name][lo:hi], (r, w, name)
                for q in first.nodes.ranks_of(r // L):  # every rank of the node's samples (the read split "need")
                    theirs, ref = got_plan.rank(q), whole.node_plan(q).rank(q)
                    ptr = theirs["samples_ptr"]
                    assert ptr.shape == (hi + 1,) and ptr[lo] == 0
                    assert np.array_equal(np.asarray(theirs["samples"]),
                                          np.asarray(ref["samples"])[ref["samples_ptr"][lo]:ref["samples_ptr"][hi]])
                    if name != "load":  # before the window: nothing but the pool's blocks at its start
                        assert not np.any(got[name][:lo]) if name == "stats" else not any(got[name][:lo])
                lists = whole.node_plan(r).node(r // L)
                held = resident_at(lists["load"], lists["load_ptr"], lists["evict"], lists["evict_ptr"], lo,
                                   whole.n_blocks)
                assert sorted(sum(got["load"][:lo], [])) == held.tolist()  # loaded at the step before the window
                assert all(not x for x in got["load"][:max(0, lo - 1)])
            transfers += sum(len(x) for x in want["send"])
            planner.close()
        if policy == "solar-peer":
            assert transfers > 0  # not vacuous: the windows have transfers between the nodes


def test_open_ended_node_plans_refuse_a_policy_that_looks_at_every_epoch(well_dir):
    with pytest.raises(SpecError, match="bounded lookahead.*nopfs-peer"):
        plan(well_dir, world_size=4, local_batch=2, epochs="auto", buffer_fraction=0.25, ranks_per_node=2,
             policy="nopfs-peer")


def test_solar_plan_makes_an_open_ended_node_plan_by_default(well_dir, tmp_path):
    out = str(tmp_path / "open.h5")
    run = subprocess.run([sys.executable, "-m", "solar", "plan", well_dir, "-P", "4", "-b", "2", "--window", "2",
                          "--buffer-fraction", "0.25", "--ranks-per-node", "2", "-o", out],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    with Schedule.load(out) as s:
        assert s.open_ended and s.window == 2 and s.epochs == 2 and s.nodes == NodeMap(4, 2)
    bad = subprocess.run([sys.executable, "-m", "solar", "plan", well_dir, "-P", "4", "-b", "2", "--buffer-fraction",
                          "0.25", "--ranks-per-node", "2", "--policy", "nopfs-peer", "-o", out],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "nopfs-peer" in bad.stderr and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------ the loader (mpi)
@pytest.fixture(scope="module")
def well_mpi(comm, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("nodewinload")) if comm.rank == 0 else None
    return on_root(comm, lambda: make_dataset(root, "well", "chunked", samples=4, steps=12))


@pytest.mark.mpi
@pytest.mark.parametrize("one_per_node,policy", [(True, "solar-peer"), (False, "solar-peer"), (False, "solar-node")])
def test_loader_runs_an_open_ended_node_plan_across_window_edges(comm, well_mpi, tmp_path_factory, one_per_node,
                                                                  policy):
    """Under mpiexec -n 2: two nodes of one rank (blocks sent between them), or one node of two ranks."""
    from solar import SolarLoader
    P, E = comm.size, 3
    folder = str(tmp_path_factory.mktemp("nwl")) if comm.rank == 0 else None
    kw = dict(world_size=P, local_batch=2, buffer_fraction=min(0.5, 0.125 * P), policy=policy, epochs="auto",
              ranks_per_node=1 if one_per_node else P)

    def make():
        for name, k in (("w1.h5", 1), ("w3.h5", E)):
            plan(well_mpi, window=k, out=os.path.join(folder, name), **kw).close()
        return folder
    folder = on_root(comm, make)
    with Schedule.load(os.path.join(folder, "w3.h5")) as whole:
        want = whole.node_plan(comm.rank).samples
        pred = whole.predicted()
    with SolarLoader(os.path.join(folder, "w1.h5"), comm=comm if P > 1 else None, as_torch=False) as loader:
        assert loader.epochs is None and loader.schedule.window == 1
        layout, got, stored = loader.layout, [], 0
        for e in loader.epoch_range():
            if e == E:
                break
            loader.set_epoch(e)
            for batch in loader:
                got.append(batch["index"])
                for i, s in enumerate(batch["index"].tolist()):
                    for k, v in h5py_sample(layout, s).items():
                        assert np.array_equal(batch[k][i], v), (s, k)
            stored += loader.stats()["stored_bytes"]  # one buffer per window: its totals start at 0
            assert loader.stats()["plan_violations"] == 0
        assert loader.windows.planned >= E  # windows 1 and 2 (and maybe 3, ahead) were planned by the ranks
        sent = loader.stats()["sent_bytes"]  # the last window's
        S = len(loader)
        state = dict(loader.state_dict(), step=(E - 1) * S + 1)  # inside window 2, after its first step
    with SolarLoader(os.path.join(folder, "w1.h5"), comm=comm if P > 1 else None, as_torch=False) as loader:
        loader.load_state_dict(state)  # windows 1 and 2 planned again, the pool warmed up mid-window
        loader.set_epoch(E - 1)
        rest = [batch["index"] for batch in loader]
        assert loader.stats()["plan_violations"] == 0
    assert len(rest) == S - 1 and all(np.array_equal(a, b) for a, b in zip(rest, got[-(S - 1):]))
    assert np.array_equal(np.concatenate(got), want)  # the samples of the plan made in one window
    assert comm.allreduce(stored) == sum(pred["storage_bytes"])  # the plan's reads (warm-ups apart)
    assert comm.allreduce(sent) == pred["peer_bytes"][-1]
    if one_per_node and P > 1:
        assert sum(pred["peer_bytes"][1:]) > 0  # not vacuous: the windows the ranks planned send blocks


def test_solar_plan_inside_a_job_plans_open_ended_and_resumed_node_plans(well_dir, tmp_path):
    """Node pools by default (``solar plan`` run inside the job it plans for takes its ranks per node) now with
    ``--epochs auto`` (the default) and ``--resume-from`` too, where it used to fall back to a buffer per rank."""
    from test_node_pool_default import _plan
    slurm = {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_NTASKS_PER_NODE": "2"}
    s, err = _plan(tmp_path, well_dir, slurm, "--window", "2")
    assert s["nodes"]["ranks_per_node"] == 2 and s["open_ended"] and s["window"] == 2 and s["format_version"] == 6
    assert "share one buffer" in err
    with Schedule.load(str(tmp_path / "plan0.h5")) as old:
        state = {"fingerprint": old.fingerprint, "world_size": 2, "config": dict(old.config.to_dict(), epochs=3),
                 "policy": old.policy, "step": old.steps_per_epoch + 1, "open_ended": False}
    from solar.schedule.resume import write_state
    write_state(str(tmp_path / "state.json"), state)
    s, err = _plan(tmp_path, well_dir, slurm, "--resume-from", str(tmp_path / "state.json"))
    assert s["nodes"]["ranks_per_node"] == 2 and s["format_version"] == 7 and s["policy"] == "solar-peer"
