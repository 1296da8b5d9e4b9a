"""Resumed node plans (issue 25, item 1): ``solar plan --resume-from STATE --ranks-per-node L`` plans the rest of
a checkpointed job as a node plan (format version 7).

* random jobs and new world sizes: from the resume step every rank gets its share of DistributedSampler's
  global batch on the new world size (torch's own sampler as the reference), the steps before are empty, every
  node's pool, staging and transfers replay from empty pools (the schedule's own checks and
  ``test_node_plan.replay_nodes``);
* the policy: a node job keeps its node policy, a per-rank job gets ``solar-peer``; other values are refused
  naming them; the ``resume`` attribute is covered by the header checksum;
* ``mpi``: a node-plan :class:`~solar.SolarLoader` on the resumed plan, serially and under ``mpiexec -n 2``,
  accepts the old job's state and delivers the remaining samples with h5py's bytes.
"""
import os

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import solar
from conftest import on_root
from helpers import h5py_sample, make_dataset
from solar.cli import main
from solar.errors import SolarError, SpecError
from solar.schedule import Schedule, ScheduleError
from solar.schedule.format import put_text
from solar.schedule.resume import write_state
from solar.scheduler import Demand
from solar.scheduler.elastic import ResumeError, ResumedRun, resume_point
from solar.scheduler.nodes import NodeMap, PeerCost
from solar.scheduler.policies import NODE_POLICIES, get_policy

from test_elastic import old_state, torch_batches
from test_node_plan import replay_nodes


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(6, 60), P=st.integers(1, 4), b=st.integers(1, 4), k=st.integers(0, 5), j=st.integers(0, 3),
       E=st.integers(1, 3), seed=st.integers(0, 3), drop_last=st.booleans(), step=st.integers(0, 80),
       spb=st.integers(1, 3), frac=st.floats(0.2, 1.0), policy=st.sampled_from(sorted(NODE_POLICIES)))
def test_resumed_node_plan_trains_distributed_sampler_batches_from_the_resume_step(n, P, b, k, j, E, seed, drop_last,
                                                                                   step, spb, frac, policy):
    G = P * b
    divisors = [d for d in range(1, G + 1) if G % d == 0]
    P2 = divisors[k % len(divisors)]
    per_node = [d for d in range(1, P2 + 1) if P2 % d == 0]
    L = per_node[j % len(per_node)]
    if drop_last and n < max(P, P2):
        return
    demand = Demand.synthetic(n, 100, samples_per_block=spb)
    old_S = len(torch_batches(n, P, b, seed, 0, drop_last))
    step %= E * old_S
    state = old_state(P, b, E, step, demand.fingerprint, seed, drop_last)
    try:
        s = solar.plan(demand, world_size=P2, resume_from=state, buffer_fraction=frac, ranks_per_node=L,
                       policy=policy)
    except ResumeError as exc:  # drop_last: the step's epoch is over on P2 ranks and it was the last
        assert "nothing left to train" in str(exc)
        return
    except SolarError as exc:  # a node pool without transfers must hold its ranks' batches
        assert "must hold at least one local batch" in str(exc) and not get_policy(policy).peer
        return
    b2 = G // P2
    S = s.steps_per_epoch
    with s:
        assert s.version == 7 and s.nodes == NodeMap(P2, L) and s.policy == policy and s.local_batch == b2
        assert s.start_step == resume_point(n, P, b, P2, b2, step, drop_last).global_step
        assert s.resumed_from["step"] == step
        plans = [s.node_plan(r) for r in range(P2)]  # each read is checked: pools, transfers, staging, sampler
        for p in plans:
            node = p.node(p.node_id)
            before = s.start_step
            assert p.samples_ptr[before] == 0  # nothing before the resume step
            assert all(node[x + "_ptr"][before] == 0 for x in ("load", "evict", "stage", "send", "recv"))
        for g in range(s.start_step, s.n_steps):
            e, k_ = divmod(g, S)
            want = torch_batches(n, P2, b2, seed, e, drop_last)[k_]
            parts = [p.samples[p.samples_ptr[g]:p.samples_ptr[g + 1]] for p in plans]
            assert np.array_equal(np.sort(np.concatenate(parts)), want), (e, k_)
            assert all(x.shape[0] == want.shape[0] // P2 for x in parts)
        pred = s.predicted()
        assert all(x == 0 for x in pred["demand_bytes"][:s.start_step // S])
    # the planner's epochs replay from empty pools (every block a rank trains on its node when assembled)
    cfg = s.config
    epochs = []
    ResumedRun(demand, cfg, get_policy(policy), s_point(demand, P, b, P2, b2, step, drop_last),
               NodeMap(P2, L), PeerCost()).advance(epochs.append)
    got = replay_nodes(demand, cfg, NodeMap(P2, L), epochs)
    assert [x[0] for x in got] == pred["storage_bytes"] and [x[1] for x in got] == pred["peer_bytes"]


def s_point(demand, P, b, P2, b2, step, drop_last):
    return resume_point(demand.n_samples, P, b, P2, b2, step, drop_last)


def test_a_node_job_keeps_its_node_policy_and_a_rank_job_gets_solar_peer():
    d = Demand.synthetic(40, 100)
    node_job = old_state(4, 2, 3, 7, d.fingerprint, policy="solar-node")
    with solar.plan(d, world_size=2, resume_from=node_job, buffer_fraction=0.6, ranks_per_node=2) as s:
        assert s.policy == "solar-node" and s.version == 7 and s.local_batch == 4
    with solar.plan(d, world_size=2, resume_from=node_job, buffer_fraction=0.6) as s:  # one buffer per rank
        assert s.policy == "solar" and s.version == 5 and s.nodes is None
    rank_job = old_state(4, 2, 3, 7, d.fingerprint)
    with solar.plan(d, world_size=4, resume_from=rank_job, buffer_fraction=0.6, ranks_per_node=2) as s:
        assert s.policy == "solar-peer" and s.nodes == NodeMap(4, 2) and s.start_step > 0
    with pytest.raises(SpecError, match="policy 'solar' plans one buffer per rank.*solar-node"):
        solar.plan(d, world_size=4, resume_from=rank_job, buffer_fraction=0.6, ranks_per_node=2, policy="solar")
    with pytest.raises(SpecError, match="ranks_per_node 3 does not divide world_size 4"):
        solar.plan(d, world_size=4, resume_from=rank_job, buffer_fraction=0.6, ranks_per_node=3)
    with pytest.raises(SpecError, match="window=2"):
        solar.plan(d, world_size=4, resume_from=rank_job, buffer_fraction=0.6, ranks_per_node=2, window=2)


def test_the_resume_attribute_of_a_node_plan_is_checksummed(tmp_path):
    d = Demand.synthetic(40, 100)
    out = str(tmp_path / "r.h5")
    solar.plan(d, world_size=4, resume_from=old_state(4, 2, 3, 7, d.fingerprint), buffer_fraction=0.6,
               ranks_per_node=2, out=out).close()
    with h5py.File(out, "r+") as f:
        assert f.attrs["version"] == 7
        doc = f.attrs["resume"].decode()
        put_text(f.attrs, "resume", doc.replace('"step": 7', '"step": 6'))
    with pytest.raises(ScheduleError, match="header checksum mismatch"):
        Schedule.load(out)


@pytest.fixture(scope="module")
def well_dir(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("noderesume"), "well", "chunked", samples=4, steps=12)


def test_solar_plan_resumes_a_job_as_a_node_plan(well_dir, tmp_path, capsys):
    with solar.plan(well_dir, world_size=2, local_batch=2, epochs=3, buffer_fraction=0.5) as old:
        state = {"fingerprint": old.fingerprint, "world_size": 2, "config": old.config.to_dict(),
                 "policy": old.policy, "step": old.steps_per_epoch + 2, "open_ended": False}
    path = str(tmp_path / "state.json")
    write_state(path, state)
    out = str(tmp_path / "node.h5")
    assert main(["plan", well_dir, "--resume-from", path, "-P", "4", "--ranks-per-node", "2",
                 "--buffer-fraction", "0.5", "-o", out]) == 0
    with Schedule.load(out) as s:
        assert s.version == 7 and s.policy == "solar-peer" and s.local_batch == 1
        assert s.start_step == s.steps_per_epoch + 2 and s.nodes == NodeMap(4, 2)
    capsys.readouterr()
    assert main(["plan", well_dir, "--resume-from", path, "-P", "4", "--ranks-per-node", "3",
                 "--buffer-fraction", "0.5", "-o", out]) == 2
    err = capsys.readouterr().err
    assert "--ranks-per-node 3 does not divide -P/--world-size 4" in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------ the loader (mpi)
@pytest.fixture(scope="module")
def well_mpi(comm, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("noderesumeload")) if comm.rank == 0 else None
    return on_root(comm, lambda: make_dataset(root, "well", "chunked", samples=4, steps=12))


@pytest.mark.mpi
@pytest.mark.parametrize("one_per_node,policy", [(True, "solar-peer"), (False, "solar-node")])
def test_loader_runs_a_resumed_node_plan_from_the_old_jobs_state(comm, well_mpi, tmp_path_factory, one_per_node,
                                                                 policy):
    """A job of 4 ranks x 1 checkpointed in epoch 1 resumes on this communicator's ranks (under mpiexec -n 2:
    two nodes of one rank sending each other blocks, or one node of two ranks) as a node plan."""
    from solar import SolarLoader
    P, E = comm.size, 3
    folder = str(tmp_path_factory.mktemp("nrl")) if comm.rank == 0 else None

    def make():
        with solar.plan(well_mpi, world_size=4, local_batch=1, epochs=E, buffer_fraction=0.5) as old:
            state = {"fingerprint": old.fingerprint, "world_size": 4, "config": old.config.to_dict(),
                     "policy": old.policy, "step": old.steps_per_epoch + 3, "open_ended": False}
        out = os.path.join(folder, "node.h5")
        solar.plan(well_mpi, world_size=P, resume_from=state, buffer_fraction=0.5,
                   ranks_per_node=1 if one_per_node else P, policy=policy, out=out).close()
        return out, state
    path, state = on_root(comm, make)
    got = {}
    with SolarLoader(path, comm=comm if P > 1 else None, as_torch=False) as loader:
        loader.load_state_dict(state)  # the old job's state: its step mapped to this job's
        start, S, layout = loader.cursor, len(loader), loader.layout
        assert start == loader.schedule.start_step > 0
        for e in loader.epoch_range():
            loader.set_epoch(e)
            g = loader.cursor
            for batch in loader:
                got[g] = batch["index"]
                for i, s in enumerate(batch["index"].tolist()):
                    for k, v in h5py_sample(layout, s).items():
                        assert np.array_equal(batch[k][i], v), (s, k)
                g += 1
        st = loader.stats()
        pred = loader.schedule.predicted()
        n = loader.schedule.n_samples
    assert st["plan_violations"] == 0
    assert comm.allreduce(st["stored_bytes"]) == sum(pred["storage_bytes"])
    assert comm.allreduce(st["sent_bytes"]) == sum(pred["peer_bytes"])
    if one_per_node and P > 1:
        assert sum(pred["peer_bytes"]) > 0  # not vacuous: the nodes send each other blocks
    everyone = comm.allgather(got)
    assert sorted(got) == list(range(start, E * S))  # exactly the steps the old job had left
    b = 4 // P
    for g in range(start, E * S):
        e, k = divmod(g, S)
        together = np.sort(np.concatenate([x[g] for x in everyone]))
        assert np.array_equal(together, torch_batches(n, P, b, 0, e)[k]), g
