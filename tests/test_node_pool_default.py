"""Ranks that share a node share one buffer by default (issue 25, item 1): `solar bench` finds the ranks per
node from the job's placement, `solar simulate` compares the node policy when ranks share a node."""
import json
import os
import subprocess
import sys

import pytest
from helpers import make_dataset

from solar.cli.simulate_cmd import default_policies
from solar.topology import block_ranks_per_node

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


@pytest.mark.parametrize("nodes, want", [
    ([0], 1),
    ([0, 0], 2),
    (["a", "a", "b", "b"], 2),
    ([0, 0, 0, 0, 4, 4, 4, 4], 4),
    ([0, 1, 2], 1),            # one rank per node
])
def test_block_placement_gives_the_ranks_per_node(nodes, want):
    assert block_ranks_per_node(nodes) == (want, "")


@pytest.mark.parametrize("nodes, why", [
    ([0, 1, 0, 1], "not placed in blocks of 2 per node (rank 1 runs on another node than rank 0)"),
    ([0, 0, 0, 1], "different numbers of ranks (1, 3)"),
    ([], "no ranks"),
])
def test_any_other_placement_is_named(nodes, why):
    L, said = block_ranks_per_node(nodes)
    assert L is None and why in said


def test_simulate_compares_the_node_policy_where_ranks_share_a_node():
    assert "solar-peer" not in default_policies(1)
    names = default_policies(4)
    assert names.index("solar-peer") == names.index("solar") + 1


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("npd"), "ptychonn", "gzip", samples=64)


def _bench(data, *extra):
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "solar", "bench", data, "-b", "4", "--epochs",
                        "2", "--only", "solar", "--json", *extra], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stderr


def test_bench_shares_one_buffer_between_the_ranks_of_a_node_by_default(data):
    rep, err = _bench(data)
    assert rep["solar"]["ranks_per_node"] == 2 and rep["solar"]["policy"] == "solar-peer"
    assert "solar: the 2 ranks of each node share one buffer" in err
    assert all(ep["plan_violations"] == 0 for ep in rep["solar"]["epochs"])


def test_bench_no_node_pool_gives_each_rank_its_buffer(data):
    rep, err = _bench(data, "--no-node-pool")
    assert "ranks_per_node" not in rep["solar"] and "pool_bytes_per_rank" in rep["solar"]
    assert "solar: one buffer per rank (--no-node-pool)" in err


@pytest.mark.mpi
def test_the_ranks_of_this_machine_are_one_node(comm):
    from solar.mpi import ranks_per_node
    assert ranks_per_node(comm) == (comm.size, "")


@pytest.mark.parametrize("env, want", [
    ({}, None),                                                                             # not in a job
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_NTASKS_PER_NODE": "2"}, 2),          # sbatch, 2 per node
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_NTASKS_PER_NODE": "2(x2)"}, 2),
    ({"PMI_SIZE": "4", "PMI_RANK": "0", "MPI_LOCALNRANKS": "4"}, 4),                        # mpiexec -n 4
    ({"PMI_SIZE": "8", "PMI_RANK": "0", "MPI_LOCALNRANKS": "4"}, None),                      # another job's size
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_NTASKS_PER_NODE": "1"}, None),       # one per node
    ({"WORLD_SIZE": "4", "RANK": "0", "LOCAL_WORLD_SIZE": "4"}, None),                      # torchrun: no MPI
])
def test_plan_takes_the_ranks_per_node_of_the_job_it_runs_in(env, want):
    from solar.topology import detect, job_ranks_per_node
    L, note = job_ranks_per_node(detect(env=env), 4)
    assert L == want
    if "WORLD_SIZE" in env:
        assert "needs MPI" in note and "not torchrun" in note


def _plan(tmp_path, data, env, *extra):
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "OMPI_", "MPI_", "PMIX_"))
            and k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    out = str(tmp_path / f"plan{len(os.listdir(tmp_path))}.h5")
    r = subprocess.run([sys.executable, "-m", "solar", "plan", data, "-P", "2", "-b", "4", "--buffer-fraction",
                        "0.5", "-o", out, "--json", *extra], capture_output=True, text=True, timeout=300,
                       env={**keep, **env})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stderr


def test_solar_plan_in_an_sbatch_script_plans_node_buffers(tmp_path, data):
    slurm = {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_NTASKS_PER_NODE": "2"}
    s, err = _plan(tmp_path, data, slurm, "--epochs", "2")
    assert s["nodes"]["ranks_per_node"] == 2 and s["policy"] == "solar-peer" and "share one buffer" in err
    s, err = _plan(tmp_path, data, slurm, "--epochs", "2", "--no-node-pool")
    assert s["nodes"] is None and err == ""
    s, err = _plan(tmp_path, data, {}, "--epochs", "2")  # outside a job: as before
    assert s["nodes"] is None and err == ""


def test_solar_plan_run_by_every_rank_of_a_job_plans_on_rank_0_only(tmp_path, data):
    """`mpiexec -n 2 solar plan ... --json` (or srun): rank 0 plans, writes -o and prints one JSON document; the
    other ranks write and print nothing (they planned and wrote the same file at once, and printed a second
    document)."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "OMPI_", "MPI_", "PMIX_"))}
    out = str(tmp_path / "rank1.h5")
    r = subprocess.run([sys.executable, "-m", "solar", "plan", data, "-P", "2", "-b", "4", "--epochs", "2",
                        "--buffer-fraction", "0.5", "-o", out, "--json"], capture_output=True, text=True, timeout=300,
                       env={**keep, "PMI_SIZE": "2", "PMI_RANK": "1", "MPI_LOCALNRANKS": "2", "MPI_LOCALRANKID": "1"})
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "" and not os.path.exists(out), r.stderr
    # a rank of another job (a process that inherited SLURM_PROCID): one line says why nothing happens
    r = subprocess.run([sys.executable, "-m", "solar", "plan", data, "-P", "2", "-b", "4", "--epochs", "2",
                        "--buffer-fraction", "0.5", "-o", out], capture_output=True, text=True, timeout=300,
                       env={**keep, "SLURM_NTASKS": "4", "SLURM_PROCID": "2"})
    assert r.returncode == 2 and not os.path.exists(out)
    assert r.stderr.strip() == "solar plan: error: this process is rank 2 of a job of 4 (SLURM (SLURM_PROCID=2, " \
                               "SLURM_NTASKS=4)), not of the -P 2 job it would plan for: run solar plan outside the " \
                               "job, or on its rank 0"
    s, err = _plan(tmp_path, data, {"PMI_SIZE": "2", "PMI_RANK": "0", "MPI_LOCALNRANKS": "2",
                                    "MPI_LOCALRANKID": "0"}, "--epochs", "2")
    assert s["nodes"]["ranks_per_node"] == 2 and err.count("share one buffer") == 1


def test_solar_plan_under_torchrun_says_what_a_node_plan_would_read(tmp_path, data):
    s, err = _plan(tmp_path, data, {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "2"}, "--epochs", "2")
    assert s["nodes"] is None and "needs MPI" in err
    assert "with a buffer per rank" in err and "as a node plan" in err


def test_predicted_storage_is_a_plan_s_reads_or_none(tmp_path, data):
    """What plan and the examples print for the other choice: the prediction of a plan made aside, or None
    (nothing said) where that plan cannot be made, never an error after the user's own plan succeeded."""
    from solar.schedule import plan
    from solar.schedule.make import predicted_storage
    kw = dict(world_size=2, local_batch=4, epochs=2, buffer_fraction=0.5)
    with plan(data, out=str(tmp_path / "p.h5"), ranks_per_node=2, **kw) as s:
        assert predicted_storage(data, ranks_per_node=2, **kw) == sum(s.predicted()["storage_bytes"])
    assert predicted_storage(data, ranks_per_node=2, **dict(kw, buffer_fraction=1e-6)) is None
