"""Rank and world size from any launcher: an explicit rank, else an initialised torch.distributed,
else the innermost launcher's variables (torchrun, Open MPI / PMI, SLURM); a one-line SpecError
when they disagree with the schedule.  Real 2-process jobs: torchrun with gloo, and PMI variables
with solar.torch.init_distributed."""
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

import solar
from solar.loader import SolarLoader
from solar.topology import Topology, detect, first_host, launcher_rank

from helpers import make_dataset

LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK", "SLURM_NTASKS",
                 "SLURM_PROCID", "SLURM_NODELIST", "SLURM_JOB_NODELIST", "SLURM_JOB_ID")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(solar.__file__)))


@pytest.fixture
def bare_env(monkeypatch):
    """No launcher variables (the suite itself may run under SLURM or mpiexec)."""
    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Plans for 2 ranks and for 1 rank over 12 samples, and rank r's [(sample ids)] of every step."""
    root = tmp_path_factory.mktemp("launch")
    data = make_dataset(root, "ptychonn", "contiguous", samples=12)
    plans = {}
    for world in (1, 2):
        plans[world] = str(root / f"plan{world}.h5")
        solar.plan(data, world_size=world, local_batch=2, epochs=2, buffer_fraction=0.5, out=plans[world]).close()
    ref = {r: [] for r in (0, 1)}
    for r in ref:
        with SolarLoader(plans[2], rank=r) as loader:
            for e in range(loader.epochs):
                loader.set_epoch(e)
                ref[r] += [b["index"].tolist() for b in loader]
    return plans, ref


def test_innermost_launcher_wins():
    """mpiexec inside an sbatch script (SLURM_PROCID=0 on every rank) and torchrun under srun."""
    batch_step = {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_NODELIST": "cn[07-08]", "SLURM_JOB_ID": "4242"}
    t = detect(env={**batch_step, "PMI_SIZE": "2", "PMI_RANK": "1"})
    assert t == Topology(2, 1) and t.source == "MPI (PMI) (PMI_RANK=1, PMI_SIZE=2)"
    assert (t.master_addr, t.master_port) == ("cn07", 20000 + 4242)
    t = detect(env={**batch_step, "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"})
    assert t.rank == 1 and t.source.startswith("Open MPI")
    t = detect(env={**batch_step, "WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                    "MASTER_ADDR": "cn08", "MASTER_PORT": "1234"})
    assert t == Topology(4, 3, 1, 2) and (t.master_addr, t.master_port) == ("cn08", 1234)
    t = detect(env=batch_step)
    assert t.rank == 0 and t.world_size == 2 and t.source.startswith("SLURM")
    assert detect(env={}).source == "" and detect(env={}).master_addr == "localhost"


@pytest.mark.parametrize("nodelist,host", [("cn07", "cn07"), ("gpu[07-09,12],cpu1", "gpu07"),
                                           ("a,b", "a"), ("rack[2-3]-n[5,1]", "rack2-n5"), ("n[9]", "n9")])
def test_first_host_of_slurm_nodelist(nodelist, host):
    assert first_host(nodelist) == host


def test_launcher_rank_checks_the_world_size():
    assert launcher_rank(2, env={"WORLD_SIZE": "2", "RANK": "1"}) == 1
    assert launcher_rank(1, env={}) == 0
    with pytest.raises(solar.SpecError, match=r"the launcher runs 3 ranks \(torchrun \(RANK=0, WORLD_SIZE=3\)\) "
                                              r"but the schedule is planned for world size 2"):
        launcher_rank(2, env={"WORLD_SIZE": "3", "RANK": "0"})
    with pytest.raises(solar.SpecError, match="planned for 2 ranks but no launcher was found"):
        launcher_rank(2, env={})
    with pytest.raises(solar.SpecError, match="PMI_RANK='x' is not an integer"):
        launcher_rank(2, env={"PMI_SIZE": "2", "PMI_RANK": "x"})


def test_loader_takes_rank_from_environment(job, bare_env):
    plans, ref = job
    bare_env.setenv("SLURM_NTASKS", "2")
    bare_env.setenv("SLURM_PROCID", "1")
    with SolarLoader(plans[2]) as loader:
        assert loader.rank == 1
        assert [b["index"].tolist() for b in loader] == ref[1][:len(loader)]
    bare_env.setenv("SLURM_NTASKS", "3")
    with pytest.raises(solar.SpecError, match="the launcher runs 3 ranks .* planned for world size 2"):
        SolarLoader(plans[2])
    with SolarLoader(plans[2], rank=0) as loader:  # an explicit rank wins
        assert loader.rank == 0


def test_loader_without_launcher(job, bare_env):
    plans, _ = job
    with SolarLoader(plans[1]) as loader:
        assert loader.rank == 0
    with pytest.raises(solar.SpecError, match="no launcher was found .*: pass rank= or comm="):
        SolarLoader(plans[2])


def test_initialised_torch_distributed_comes_first(job, bare_env, tmp_path):
    import torch.distributed as dist
    plans, _ = job
    bare_env.setenv("WORLD_SIZE", "2")
    bare_env.setenv("RANK", "1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        with SolarLoader(plans[1]) as loader:
            assert loader.rank == 0
        with pytest.raises(solar.SpecError, match=r"runs 1 ranks \(torch.distributed\)"):
            SolarLoader(plans[2])
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WORKER = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from torch.utils.data import DataLoader
    from solar.torch import SolarDataset, init_distributed
    plan, out, how = sys.argv[1:4]  # out: a name with {rank}
    if how == "init_distributed":
        init_distributed("gloo")
    else:
        dist.init_process_group("gloo")
    ds = SolarDataset(plan)
    steps = []
    for e in range(ds.epochs):
        ds.set_epoch(e)
        steps += [b["index"].tolist() for b in DataLoader(ds, batch_size=None, num_workers=2)]
    assert ds.loader.reader_name == "pread" and "mpi4py" not in sys.modules  # no MPI needed
    n = torch.tensor([sum(map(len, steps))])
    dist.all_reduce(n)
    with open(out.format(rank=dist.get_rank()), "w") as f:
        json.dump({"rank": dist.get_rank(), "steps": steps, "total": int(n)}, f)
    ds.close()
    dist.destroy_process_group()
""")


def check_outputs(outs, ref):
    got = {}
    for path in outs:
        with open(path) as f:
            r = json.load(f)
        got[r["rank"]] = r["steps"]
        assert r["total"] == sum(len(s) for steps in ref.values() for s in steps)
    assert got == ref


@pytest.mark.slow  # starts processes that import torch
def test_torchrun_two_ranks(job, bare_env, tmp_path):
    """``torchrun --nproc-per-node 2`` with gloo on CPU: SolarDataset(plan) with no rank argument."""
    plans, ref = job
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    bare_env.setenv("PYTHONPATH", REPO)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), str(script), plans[2], str(tmp_path / "out{rank}.json"), "torchrun"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_outputs([str(tmp_path / f"out{r}.json") for r in (0, 1)], ref)


@pytest.mark.slow  # starts processes that import torch
def test_init_distributed_from_mpi_variables(job, bare_env, tmp_path):
    """Two processes with the variables MPICH's mpiexec sets (inside an sbatch job whose own
    SLURM_PROCID is 0 everywhere): init_distributed + SolarDataset find their ranks."""
    plans, ref = job
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    port = str(free_port())
    procs = []
    for r in (0, 1):
        env = dict(os.environ, PYTHONPATH=REPO, PMI_RANK=str(r), PMI_SIZE="2", SLURM_PROCID="0", SLURM_NTASKS="1",
                   SLURM_NODELIST="localhost", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, str(script), plans[2], str(tmp_path / "out{rank}.json"),
                                       "init_distributed"], env=env, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    check_outputs([str(tmp_path / f"out{r}.json") for r in (0, 1)], ref)


MPI_WORKER = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    from solar.torch import init_distributed
    t = init_distributed("gloo")
    n = torch.tensor([t.rank + 1])
    dist.all_reduce(n)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {int(n)}", flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.slow  # starts processes that import torch
def test_init_distributed_under_mpi_needs_no_port(bare_env, tmp_path):
    """``mpiexec -n 2`` inside a SLURM job without MASTER_PORT: the port that the job id would give is
    taken by another process, and init_distributed still joins (rank 0 listens on a port the OS gives it
    and sends it over MPI).  A job once failed here with EADDRINUSE."""
    pytest.importorskip("mpi4py")
    script = tmp_path / "w.py"
    script.write_text(MPI_WORKER)
    held = socket.socket()  # another process's socket on the port derived from the job id
    for job_id in range(4242, 4342):
        try:
            held.bind(("", 20000 + job_id))
            break
        except OSError:
            continue
    with held:
        held.listen()
        env = dict(os.environ, PYTHONPATH=REPO, SLURM_JOB_ID=str(job_id), SLURM_NODELIST="localhost")
        env.pop("MASTER_ADDR", None)  # every rank on this host: rank 0 listens on 127.0.0.1
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        proc = subprocess.run([mpiexec, "-n", "2", sys.executable, str(script)], env=env, capture_output=True,
                              text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import re
    assert sorted(re.findall(r"rank \d of 2: \d+", proc.stdout)) == ["rank 0 of 2: 3", "rank 1 of 2: 3"], proc.stdout


@pytest.mark.slow  # starts processes that import torch
def test_init_distributed_under_mpi_names_an_address_that_does_not_resolve(bare_env, tmp_path):
    """MASTER_ADDR that does not resolve, no MASTER_PORT, under mpiexec: every rank ends with one clear error at
    once (the master store would otherwise retry connecting to itself until its timeout, 30 min by default)."""
    pytest.importorskip("mpi4py")
    script = tmp_path / "w.py"
    script.write_text(MPI_WORKER)
    env = dict(os.environ, PYTHONPATH=REPO, MASTER_ADDR="no-such-host.invalid")
    env.pop("MASTER_PORT", None)
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("'no-such-host.invalid' for torch.distributed does not resolve") == 2, proc.stderr[-2000:]


def test_init_distributed_rejects_unknown_backend():
    from solar.torch import init_distributed
    with pytest.raises(solar.SpecError, match="backend 'nope' is not available"):
        init_distributed("nope")
