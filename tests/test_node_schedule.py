"""Node plans in the schedule file (format version 6, issue 11) and the loader and bench that run them.

* the file holds exactly what :func:`~solar.scheduler.node_plan.plan_nodes` plans (every rank's samples,
  every node's lists and stats), on the Well preset and on random synthetic jobs (hypothesis);
* a damaged or inconsistent file is refused with one line; bad arguments name the bad value;
* ``mpi``: :class:`~solar.SolarLoader` on a node plan, serially and under ``mpiexec -n 2``: batches equal
  h5py's, storage bytes and transfers equal the plan's;
* ``mpiexec -n 4 solar bench --ranks-per-node 2`` (2 nodes x 2 ranks on one machine): storage bytes within
  5% of the plan (exactly, here), delivered samples checked against h5py, peer bytes reported.
"""
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import on_root
from helpers import h5py_sample, make_dataset
from solar.errors import SpecError
from solar.layout import load_layout
from solar.schedule import Schedule, ScheduleError, plan
from solar.schedule.format import array_digest, put_text
from solar.scheduler.config import PlanConfig
from solar.scheduler.node_plan import NODE_STATS, plan_nodes
from solar.scheduler.nodes import NodeMap, PeerCost
from solar.scheduler.run import BufferTooSmall, Demand

COL = {name: i for i, name in enumerate(NODE_STATS)}


@pytest.fixture(scope="module")
def well_dir(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("nodesched"), "well", "chunked", samples=4, steps=12)


def same_as_planned(sched: Schedule, demand: Demand, policy: str, cost=None):
    """Every rank's samples and every node's lists in ``sched`` equal plan_nodes' on the same job."""
    cfg = sched.config
    nodes = sched.nodes
    ref, res = plan_nodes(demand, cfg, nodes, policy, cost=cost)
    for r in range(nodes.world_size):
        got = sched.node_plan(r)
        want = ref.rank(r)
        assert np.array_equal(got.samples, want["samples"]) and np.array_equal(got.samples_ptr, want["samples_ptr"])
        assert got.n_transfers == ref.n_transfers
        n = r // nodes.ranks_per_node
        a, b = got.node(n), ref.node(n)
        assert set(a) == set(b)
        for k in b:
            assert np.array_equal(np.asarray(a[k], np.int64), np.asarray(b[k], np.int64)), (r, k)
    p = sched.predicted()
    assert p["storage_bytes"] == [int(x) for x in res.stored_bytes]
    assert p["peer_bytes"] == [int(x) for x in res.peer_bytes]
    return ref


@pytest.mark.parametrize("policy,frac", [("solar-peer", 0.25), ("solar-node", 0.5), ("nopfs-peer", 0.25)])
def test_the_file_holds_the_node_plan(well_dir, tmp_path, policy, frac):
    layout = load_layout(well_dir)
    out = str(tmp_path / "node.h5")
    s = plan(well_dir, world_size=4, local_batch=2, epochs=2, buffer_fraction=frac, ranks_per_node=2,
             policy=policy, out=out)
    s.close()
    with Schedule.load(out) as sched:
        assert sched.version == 6 and sched.nodes == NodeMap(4, 2) and sched.peer_cost == PeerCost()
        ref = same_as_planned(sched, Demand.from_layout(layout), policy)
        if policy != "solar-node":
            assert ref.n_transfers > 0  # not vacuous: blocks move between the 2 nodes
        summary = sched.summary()
        assert summary["nodes"]["ranks_per_node"] == 2 and "peer_bytes" in summary
        mem = summary["memory_per_rank"]
        assert mem["per_node"] and mem["resident"] + mem["batches"] + mem["bookkeeping"] <= mem["limit"]
        e, S = 1, sched.steps_per_epoch
        assert np.array_equal(sched.batch(e, 3, 1), ref.rank(1)["samples"][
            ref.rank(1)["samples_ptr"][e * S + 3]:ref.rank(1)["samples_ptr"][e * S + 4]])
        with pytest.raises(ScheduleError, match="node plan .* node_plan"):
            sched.rank(0)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(8, 60), spb=st.integers(1, 3), bps=st.integers(1, 2), L=st.sampled_from([1, 2, 3]),
       Q=st.integers(1, 3), b=st.integers(1, 3), frac=st.floats(0.15, 1.0), epochs=st.integers(1, 3),
       policy=st.sampled_from(["solar-peer", "solar-node", "nopfs-peer", "lru-peer"]), net=st.sampled_from([1e8, 1e10]))
def test_random_node_plans_round_trip(n, spb, bps, L, Q, b, frac, epochs, policy, net):
    demand = Demand.synthetic(n, 1000, spb, bps)
    P = L * Q
    cost = PeerCost(net, 1e9)
    try:
        s = plan(demand, world_size=P, local_batch=b, epochs=epochs, buffer_fraction=frac, ranks_per_node=L,
                 policy=policy, peer_cost=cost)
    except (SpecError, BufferTooSmall) as exc:  # a budget too small for the batches: refused, as per-rank plans are
        assert "budget" in str(exc) or "buffer" in str(exc)
        return
    with s:
        same_as_planned(s, demand, policy, cost)


def test_bad_node_arguments_are_refused_by_name(well_dir):
    layout = load_layout(well_dir)
    kw = dict(world_size=4, local_batch=2, epochs=2, buffer_fraction=0.5)
    with pytest.raises(SpecError, match="ranks_per_node 3 does not divide world_size 4"):
        plan(layout, ranks_per_node=3, **kw)
    with pytest.raises(SpecError, match="'solar-peer' plans one buffer per node: give ranks_per_node"):
        plan(layout, policy="solar-peer", **kw)
    with pytest.raises(SpecError, match="'solar' plans one buffer per rank"):
        plan(layout, policy="solar", ranks_per_node=2, **kw)
    with pytest.raises(SpecError, match="bounded lookahead; policy 'nopfs-peer'"):  # open-ended: a bounded policy
        plan(layout, ranks_per_node=2, policy="nopfs-peer", **dict(kw, epochs="auto"))
    with pytest.raises(SpecError, match="peer_cost= needs ranks_per_node"):
        plan(layout, peer_cost=PeerCost(), **kw)
    s = plan(layout, **kw)
    with s, pytest.raises(ScheduleError, match="not a node plan"):
        s.node_plan(0)


# ---------------------------------------------------------------- damaged files
def rewrite(path, name, fn):
    """Replace dataset ``name`` by ``fn(its array)`` with a matching checksum (a consistent-looking edit)."""
    with h5py.File(path, "r+") as f:
        arr = fn(f[name][()])
        del f[name]
        ds = f.create_dataset(name, data=arr)
        put_text(ds.attrs, "sha256", array_digest(arr))


@pytest.fixture
def node_file(well_dir, tmp_path):
    out = str(tmp_path / "node.h5")
    plan(well_dir, world_size=4, local_batch=2, epochs=2, buffer_fraction=0.25, ranks_per_node=2,
         policy="solar-peer", out=out).close()
    return out


def test_receives_nobody_sends_are_refused(node_file):
    with Schedule.load(node_file) as s:
        n = next(k for k in range(2) if s.node_plan(2 * k).node(k)["recv"].shape[0])
    rewrite(node_file, f"nodes/{n}/recv", lambda a: np.roll(a, 1) if np.unique(a).size > 1 else (a + 1) % 7)
    with Schedule.load(node_file) as s, pytest.raises(ScheduleError, match=f"sends node {n} .* first differ"):
        s.node_plan(2 * n)


def test_a_send_nobody_receives_is_refused_by_the_sender(node_file):
    """The receiver's lists lose every block from the sender (checksums kept): the sender's ranks refuse
    the file (the receiver no longer names the sender; a send never received would block the sender)."""
    with Schedule.load(node_file) as s:
        n = next(k for k in range(2) if s.node_plan(2 * k).node(k)["recv"].shape[0])
        lists = s.node_plan(2 * n).node(n)
    m = 1 - n
    keep = lists["recv_from"] != m
    step = np.repeat(np.arange(lists["recv_ptr"].shape[0] - 1), np.diff(lists["recv_ptr"]))
    rewrite(node_file, f"nodes/{n}/recv", lambda a: a[keep])
    rewrite(node_file, f"nodes/{n}/recv_from", lambda a: a[keep])
    rewrite(node_file, f"nodes/{n}/recv_count", lambda a: np.bincount(step[keep], minlength=a.shape[0]).astype(a.dtype))
    with Schedule.load(node_file) as s, pytest.raises(ScheduleError, match=f"node {m} sends node {n} .* receives 0"):
        s.node_plan(2 * m)


def test_a_staging_area_bigger_than_the_step_is_refused(node_file):
    """Staged blocks the node's samples do not use at that step (a huge list would size a huge window)."""
    with Schedule.load(node_file) as s:
        B = s.n_blocks
    rewrite(node_file, "nodes/0/stage", lambda a: np.concatenate([np.arange(B, dtype=a.dtype), a]))
    rewrite(node_file, "nodes/0/stage_count", lambda a: np.concatenate([[a[0] + B], a[1:]]).astype(a.dtype))
    with Schedule.load(node_file) as s, pytest.raises(ScheduleError, match="node 0 stages or receives .* at step 0"):
        s.node_plan(0)


def test_a_node_pool_over_its_budget_is_refused(node_file):
    rewrite(node_file, "nodes/0/evict_count", lambda a: np.zeros_like(a))
    rewrite(node_file, "nodes/0/evict", lambda a: a[:0])
    with Schedule.load(node_file) as s, pytest.raises(ScheduleError, match="node 0 .*(holds|loads)"):
        s.node_plan(0)


def test_a_changed_node_header_is_refused(node_file):
    with h5py.File(node_file, "r+") as f:
        put_text(f.attrs, "nodes", json.dumps({"ranks_per_node": 1, "network_bytes_per_s": 1e10,
                                                 "storage_bytes_per_s": 1e9}))
    with pytest.raises(ScheduleError, match="header checksum"):
        Schedule.load(node_file)


def test_a_missing_node_group_is_refused(node_file):
    with h5py.File(node_file, "r+") as f:
        del f["nodes/1"]
    with pytest.raises(ScheduleError, match="one group per node"):
        Schedule.load(node_file)


# ---------------------------------------------------------------- the CLI
def solar_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "solar", *args], capture_output=True, text=True, cwd=cwd)


def test_solar_plan_and_inspect_show_the_nodes(well_dir, tmp_path):
    out = str(tmp_path / "cli.h5")
    r = solar_cli("plan", well_dir, "-P", "4", "-b", "2", "--epochs", "2", "--buffer-fraction", "0.25",
                  "--ranks-per-node", "2", "--network-bandwidth", "5e9", "-o", out)
    assert r.returncode == 0, r.stderr
    assert "nodes: 2 x 2 ranks sharing one buffer" in r.stdout and "sent between nodes" in r.stdout
    assert "memory per node" in r.stdout
    j = json.loads(solar_cli("inspect", out, "--json").stdout)
    assert j["policy"] == "solar-peer" and j["nodes"]["network_bytes_per_s"] == 5e9 and j["format_version"] == 6
    bad = solar_cli("plan", well_dir, "-P", "4", "-b", "2", "--epochs", "2", "--buffer-fraction", "0.25",
                    "--storage-bandwidth", "1e9", "-o", str(tmp_path / "x.h5"))
    assert bad.returncode != 0 and "need --ranks-per-node" in bad.stderr and "Traceback" not in bad.stderr


# ---------------------------------------------------------------- the loader (mpi)
@pytest.fixture(scope="module")
def well_mpi(comm, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("nodeload")) if comm.rank == 0 else None
    return on_root(comm, lambda: make_dataset(root, "well", "chunked", samples=4, steps=12))


@pytest.mark.mpi
@pytest.mark.parametrize("L,policy", [(1, "solar-peer"), (2, "solar-node"), (2, "solar-peer")])
def test_loader_runs_a_node_plan(comm, well_mpi, tmp_path_factory, L, policy):
    from solar import SolarLoader
    P = comm.size
    if P % L:
        pytest.skip(f"{P} ranks do not make nodes of {L}")
    folder = str(tmp_path_factory.mktemp("nl")) if comm.rank == 0 else None
    frac = min(0.5, 0.125 * P)  # a node holds at least its ranks' batches of this small dataset
    path = on_root(comm, lambda: plan(well_mpi, world_size=P, local_batch=2, epochs=2, buffer_fraction=frac,
                                      ranks_per_node=L, policy=policy,
                                      out=os.path.join(folder, "p.h5")).close() or os.path.join(folder, "p.h5"))
    with SolarLoader(path, comm=comm if P > 1 else None, as_torch=False) as loader:
        layout = loader.layout
        ref = {}
        got = []
        for e in loader.epoch_range():
            loader.set_epoch(e)
            for batch in loader:
                got.append(batch["index"])
                for i, s in enumerate(batch["index"].tolist()):
                    ref.setdefault(s, h5py_sample(layout, s))
                    for k, v in ref[s].items():
                        assert np.array_equal(batch[k][i], v), (s, k)
        st = loader.stats()
        plan_r = loader.schedule.node_plan(comm.rank)
        assert np.array_equal(np.concatenate(got), plan_r.samples)
        node = plan_r.node(plan_r.node_id)
        pred = loader.schedule.predicted()
    assert comm.allreduce(st["stored_bytes"]) == sum(pred["storage_bytes"])  # the plan's blocks, no more
    assert comm.allreduce(st["bytes_read"]) >= sum(pred["storage_bytes"])  # + the gaps the reader coalesces
    assert comm.allreduce(st["sent_bytes"]) == comm.allreduce(st["recv_bytes"]) == sum(pred["peer_bytes"])
    assert st["plan_violations"] == 0
    if comm.rank % L == 0:  # node totals as the node's stats say
        assert int(node["stats"][:, COL["peer"]].sum()) == st["recv_blocks"]


@pytest.mark.mpi
def test_loader_refuses_a_node_plan_for_another_world_size(comm, well_mpi, tmp_path_factory):
    from solar import SolarLoader
    folder = str(tmp_path_factory.mktemp("nw")) if comm.rank == 0 else None
    P = comm.size + 1
    path = on_root(comm, lambda: plan(well_mpi, world_size=P, local_batch=2, epochs=1, buffer_fraction=0.5,
                                      ranks_per_node=P, out=os.path.join(folder, "p.h5")).close()
                   or os.path.join(folder, "p.h5"))
    with pytest.raises(ScheduleError, match=f"world size {P}"):
        SolarLoader(path, comm=comm, abort_on_error=False)


def test_loader_without_comm_refuses_a_node_plan_of_several_ranks(well_dir, tmp_path):
    from solar import SolarLoader
    from solar.loader.nodes import PlacementError
    out = str(tmp_path / "p.h5")
    plan(well_dir, world_size=2, local_batch=2, epochs=1, buffer_fraction=0.5, ranks_per_node=2, out=out).close()
    with pytest.raises(PlacementError, match="pass comm="):
        SolarLoader(out, rank=0, abort_on_error=False)


def test_placement_check_names_the_rank_on_another_machine():
    from solar.loader import nodes as ln

    class FakeComm:
        def Get_size(self):
            return 4
    real = ln.machine_ids
    ln.machine_ids = lambda comm: [0, 0, 2, 3]  # ranks 2 and 3 on different machines
    try:
        ln.check_node_placement(NodeMap(4, 1), FakeComm())  # nodes of one rank: fine
        with pytest.raises(ln.PlacementError, match="rank 3 runs on another machine than rank 2"):
            ln.check_node_placement(NodeMap(4, 2), FakeComm(), "p.h5")
    finally:
        ln.machine_ids = real


# ---------------------------------------------------------------- solar bench, 2 nodes x 2 ranks
@pytest.mark.slow
def test_bench_on_two_test_nodes_reads_what_the_plan_says(well_dir, tmp_path):
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    cmd = [mpiexec, "-n", "4", sys.executable, "-m", "solar", "bench", well_dir, "--ranks-per-node", "2",
           "-b", "2", "--epochs", "2", "--buffer-fraction", "0.25", "--only", "solar", "--json",
           "--schedule", str(tmp_path / "bench.h5")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rep = json.loads(r.stdout)
    s = rep["solar"]
    assert s["ranks_per_node"] == 2 and s["policy"] == "solar-peer"
    for ep in s["epochs"]:
        assert ep["blocks_vs_plan"] == 1.0 and ep["block_storage_bytes"] == ep["predicted_storage_bytes"]
        assert ep["storage_vs_plan"] >= 1.0  # + the gaps between the blocks that reads coalesce
        assert ep["peer_bytes_sent"] == ep["peer_bytes_received"] == ep["predicted_peer_bytes"]
        assert ep["verified"] > 0
    assert sum(ep["peer_bytes_sent"] for ep in s["epochs"]) > 0


def test_a_node_job_resumes_on_other_ranks_with_per_rank_buffers(node_file, well_dir):
    with Schedule.load(node_file) as s:
        state = {"fingerprint": s.fingerprint, "world_size": 4, "config": s.config.to_dict(), "policy": s.policy,
                 "step": s.steps_per_epoch + 1, "open_ended": False}
        old_batches = [np.sort(np.concatenate([s.batch(1, k, r) for r in range(4)])) for k in range(2, 4)]
    r = plan(well_dir, resume_from=state, world_size=2, buffer_fraction=0.5)
    with r:
        assert r.version == 5 and r.policy == "solar" and r.nodes is None and r.local_batch == 4
        for k, want in zip(range(2, 4), old_batches):  # the same global batches as the node job would train
            assert np.array_equal(np.sort(np.concatenate([r.batch(1, k, q) for q in range(2)])), want)


@pytest.mark.mpi
def test_loader_on_a_node_plan_resumes_mid_epoch_with_the_same_batches(comm, well_mpi, tmp_path_factory):
    from solar import SolarLoader
    P = comm.size
    folder = str(tmp_path_factory.mktemp("nr")) if comm.rank == 0 else None
    path = on_root(comm, lambda: plan(well_mpi, world_size=P, local_batch=2, epochs=2, buffer_fraction=min(0.5, 0.125 * P),
                                      ranks_per_node=P, policy="solar-node",
                                      out=os.path.join(folder, "p.h5")).close() or os.path.join(folder, "p.h5"))
    kw = dict(comm=comm if P > 1 else None, as_torch=False)

    def take(loader, n=None):
        out = []
        for e in loader.epoch_range():
            loader.set_epoch(e)
            for batch in loader:
                out.append({k: v.copy() for k, v in batch.items() if isinstance(v, np.ndarray)})
                if n is not None and len(out) == n:
                    return out
        return out
    with SolarLoader(path, **kw) as loader:
        whole = take(loader)
        S = len(loader)
    with SolarLoader(path, **kw) as loader:
        first = take(loader, S + 3)  # into epoch 1
        state = loader.state_dict()
    with SolarLoader(path, **kw) as loader:
        loader.load_state_dict(state)
        assert loader.epoch == 1
        rest = take(loader)
    got = first + rest
    assert len(got) == len(whole)
    for a, b in zip(got, whole):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def small_presets(tmp_path_factory):
    from helpers import STORAGES
    root = tmp_path_factory.mktemp("nodemem")
    return {(p, s): load_layout(make_dataset(root, p, s)) for p in ("ptychonn", "well", "cosmoflow")
            for s in STORAGES}


def test_node_plans_fit_their_memory_staging_included(small_presets):
    """A node's pool, staging area (staged and received blocks of a step), its ranks' batches and bookkeeping
    stay within the memory its ranks' budgets make (no allowance on top: the whole reserve comes out of the
    budget), on every preset x storage with random jobs (fixed seed)."""
    from unittest import mock
    import solar.memory as mem
    from solar.memory.node import NODE_BLOCK_BYTES
    from solar.schedule.memory import schedule_node_memory
    rng = np.random.default_rng(7)
    checked = 0
    from solar.layout.parts import split_chunks
    for (p, s), lay in sorted(small_presets.items()):
        lay = split_chunks(lay) or lay  # what the node policies plan on (parts of chunks where there are any)
        keep = mem.bookkeeping_bytes(lay.n_samples, lay.block_nbytes.shape[0], lay.sample_blocks.shape[0])
        per_sample = mem.demand_batch_bytes(lay.sample_ptr, lay.sample_blocks, lay.block_nbytes, 1)
        for _ in range(2):
            b, frac, L = int(rng.integers(1, 4)), float(rng.uniform(0.1, 1.2)), int(rng.choice([2, 4]))
            P = L * int(rng.integers(1, 3))
            budget = int(frac * lay.block_nbytes.sum() / P) + mem.reserve_bytes(mem.batch_bytes(lay, 2 * b), keep) \
                + 2 * b * per_sample
            policy = str(rng.choice(["solar-peer", "solar-node"]))
            with mock.patch.object(mem.budget, "PLAN_ALLOWANCE", 0):
                sched = plan(lay, world_size=P, local_batch=b, epochs=3, buffer_per_rank=budget, ranks_per_node=L,
                             policy=policy)
                with sched:
                    for n in range(P // L):
                        m = schedule_node_memory(sched, n, lay)
                        assert m.resident <= L * sched.buffer_bytes
                        assert m.resident + m.staging + m.batches + m.bookkeeping <= m.limit, (p, s, policy, m)
                        # the runtime keeps more bytes per block than the planner counts (its slot tables and
                        # who read each block: solar.memory.node.NODE_BLOCK_BYTES)
                        assert m.limit <= L * (budget + NODE_BLOCK_BYTES * lay.block_nbytes.shape[0])
                        checked += 1
    assert checked >= 30


@pytest.mark.mpi
def test_ranks_with_different_prefetch_are_refused_on_every_rank(comm, well_mpi, tmp_path_factory):
    """The slots of the shared window depend on prefetch: ranks that disagree would use each other's
    slots, so every rank raises (none waits for the others)."""
    from solar import SolarLoader
    from solar.buffer import NodeBufferError
    P = comm.size
    if P < 2:
        pytest.skip("needs ranks that share a node")
    folder = str(tmp_path_factory.mktemp("np")) if comm.rank == 0 else None
    path = on_root(comm, lambda: plan(well_mpi, world_size=P, local_batch=2, epochs=1, buffer_fraction=0.5,
                                      ranks_per_node=P, out=os.path.join(folder, "p.h5")).close()
                   or os.path.join(folder, "p.h5"))
    with SolarLoader(path, comm=comm, prefetch=1 + comm.rank, abort_on_error=False) as loader:
        with pytest.raises(NodeBufferError, match="rank 1 runs prefetch = 2, rank 0 1"):
            next(iter(loader))
    comm.Barrier()


@pytest.mark.mpi
def test_a_loader_closed_mid_plan_leaves_no_transfer_for_the_next_one(comm, tmp_path_factory):
    """Nodes that send each other blocks (one rank per node): a loader closed after a few steps, then a whole run.
    The closed manager's transfer communicator, freed, gave its context id to the next manager's, whose first
    receives then took the stale blocks of the same step tags: another sample's bytes, no error, in about a third
    of the rounds on one rank or the other.  Every delivered sample is compared with h5py, on every rank."""
    from solar import SolarLoader
    P = comm.size
    root = str(tmp_path_factory.mktemp("stale")) if comm.rank == 0 else None
    data = on_root(comm, lambda: make_dataset(root, "ptychonn", "chunked", samples=20))
    path = on_root(comm, lambda: plan(data, world_size=P, local_batch=3, epochs=2, seed=9, buffer_fraction=1.0,
                                      policy="nopfs-peer", ranks_per_node=1,
                                      out=os.path.join(root, "p.h5")).close() or os.path.join(root, "p.h5"))
    kw = dict(comm=comm if P > 1 else None, as_torch=False)
    ref, wrong = {}, 0
    for _ in range(12):
        with SolarLoader(path, **kw) as early:
            it = iter(early)
            for _ in range(3):
                next(it)
            del it
        with SolarLoader(path, **kw) as whole:
            for e in whole.epoch_range():
                whole.set_epoch(e)
                for batch in whole:
                    for j, s in enumerate(batch["index"].tolist()):
                        ref.setdefault(s, h5py_sample(whole.layout, s))
                        wrong += sum(not np.array_equal(batch[k][j], v) for k, v in ref[s].items())
    assert (comm.allreduce(wrong) if P > 1 else wrong) == 0
