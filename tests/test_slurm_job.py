"""slurm/plan_and_train.sbatch on the one-machine cluster of slurm/local_cluster.sh.

The test starts a private cluster (its own state folder, munged, free ports and job ids), then
submits the batch script three times (waiting for each job to end) on a 32-sample PtychoNN-style
file, 2 tasks:

1. plan (in the job) + train, stopped after 3 of the 8 steps: both ranks trained 3 steps;
2. the same job again: it resumes from the checkpoint at step 3 and trains the schedule's
   batches of steps 3..7 on both ranks;
3. the same job once more (finished): it resumes at step 8, trains 0 steps, exits 0 and leaves
   the checkpoint as it was (what slurm/README.md says about resubmitting a finished job).

A second test runs two clusters at once (two CI runs on one machine) and kills the owner of one.

They need root (the daemons run as root).  Where slurm-wlm or munge is missing they are installed
with apt-get (timed: the test's ``slurm_install_s`` property); not root, no apt-get, or an install
that fails or takes over INSTALL_LIMIT_S (no network) skip with the reason.  A set SLURM_CONF (a
real cluster's) also skips: these tests never run beside one.  Every daemon is stopped by PID
(local_cluster.sh stop) on every exit path, and by local_cluster.sh's watcher if this process is
killed.  Deselect with -m "not slurm".
"""
import contextlib
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from helpers import make_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER = os.path.join(ROOT, "slurm", "local_cluster.sh")
BATCH = os.path.join(ROOT, "slurm", "plan_and_train.sbatch")
pytestmark = [pytest.mark.slurm, pytest.mark.slow]

P, B, EPOCHS, SAMPLES, STOP = 2, 4, 2, 32, 3
S = SAMPLES // (P * B)          # steps per epoch
TOTAL = EPOCHS * S              # steps of the whole job
INSTALL_LIMIT_S = 240           # apt-get update + install
CLUSTER_LIMIT_S = 90            # local_cluster.sh start / stop
JOB_LIMIT_S = 300               # one job, submitted and waited for (it is also given --time=5)
DAEMONS = ("munged", "slurmctld", "slurmd", "watcher")
FOREIGN = ("SLURM_", "PMI_", "PMIX_", "HYDRA_", "OMPI_", "MPI_LOCAL")  # launcher variables of an outer job


def run(cmd, env, limit, cwd=None):
    """Run ``cmd`` in a session of its own; returns (exit status, output).  Still running after
    ``limit`` s: its whole process group is killed and the status is None."""
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=limit)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return None, out


def free_ports(n: int) -> list:
    """``n`` distinct TCP ports that nothing listens on now (held open together while picked)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def first_job_id(port: int) -> int:
    """The first job id of a cluster whose controller listens on ``port``: MPICH names its shared-memory
    files after the job id, so two clusters running at once (different ports) must not share ids.
    Each port (mod 7000) gets 1000 ids of its own in [60e6, 67e6): above local_cluster.sh's
    clock-based ids (< 60e6), below SLURM's MaxJobId (67043328); within them the clock picks 10, so
    a later run on the same port does not reuse the ids of a killed task's left-over files."""
    return 60_000_000 + (port % 7000) * 1000 + int(time.time()) % 100 * 10


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie, already ended but not yet reaped, does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def daemon_pids(state: str) -> dict:
    """{name: pid} from the pid files local_cluster.sh keeps in ``state``."""
    pids = {}
    for name in DAEMONS:
        try:
            with open(os.path.join(state, f"{name}.pid")) as f:
                pids[name] = int(f.read().strip())
        except (OSError, ValueError):
            pass
    return pids


def job_steps_left(job_ids) -> list:
    """PIDs of slurmstepd processes still serving one of ``job_ids``."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        m = re.match(r"slurmstepd: \[(\d+)\.", cmd)
        if m and int(m.group(1)) in job_ids and alive(int(pid)):
            left.append(int(pid))
    return left


def read_text(path: str) -> str:
    """The file's text, or "" when it is not there."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def tail(path: str, n: int = 1500) -> str:
    return f"--- {path}:\n{read_text(path)[-n:]}"


def clean_env() -> dict:
    """This environment without any outer launcher's variables (and without SLURM_CONF)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(FOREIGN)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def require_slurm(record) -> None:
    """Skip unless this is root on Linux without a real cluster's SLURM_CONF, with slurm-wlm and munge
    installed (installed here with apt-get when missing; ``record(name, value)`` gets the time)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the one-machine SLURM cluster needs Linux")
    if os.geteuid() != 0:
        pytest.skip("the one-machine SLURM cluster runs its daemons as root (this is not root)")
    if os.environ.get("SLURM_CONF"):
        pytest.skip(f"SLURM_CONF={os.environ['SLURM_CONF']} is set (a real cluster's?): not starting a "
                    "private cluster beside it; unset SLURM_CONF to run this test")
    if not missing_programs():
        return
    if not shutil.which("apt-get"):
        pytest.skip(f"{', '.join(missing_programs())} not installed, and there is no apt-get to install them")
    failed, secs = install_once()
    record("slurm_install_s", secs)
    if failed or missing_programs():
        pytest.skip(failed or f"installed slurm-wlm and munge, but {', '.join(missing_programs())} not on PATH")


def missing_programs() -> list:
    return [b for b in ("slurmctld", "slurmd", "sbatch", "srun", "munged", "munge") if not shutil.which(b)]


@functools.cache
def install_once() -> tuple:
    """(why it failed or "", seconds) of local_cluster.sh install, tried once per session."""
    t0 = time.monotonic()
    rc, out = run([CLUSTER, "install"], clean_env(), INSTALL_LIMIT_S)
    secs = round(time.monotonic() - t0, 1)
    print(f"installed slurm-wlm and munge in {secs:.0f} s" if rc == 0 else f"install failed after {secs:.0f} s")
    if rc == 0:
        return "", secs
    why = "timed out" if rc is None else f"exited {rc}"
    return f"apt-get install slurm-wlm munge {why} after {secs:.0f} s (no network?): {out.strip()[-300:]}", secs


def stop_cluster(env: dict, state: str, job_ids) -> list:
    """local_cluster.sh stop, then make sure: returns the processes it left (killed here, by PID)."""
    pids = daemon_pids(state)
    rc, out = run([CLUSTER, "stop"], env, CLUSTER_LIMIT_S)
    left = [f"{name} {pid}" for name, pid in pids.items() if alive(pid)]
    left += [f"slurmstepd {pid}" for pid in job_steps_left(job_ids)]
    for entry in left:
        os.kill(int(entry.split()[1]), signal.SIGKILL)
    if rc != 0:
        left.append(f"local_cluster.sh stop exited {rc}: {out.strip()[-500:]}")
    return left


@contextlib.contextmanager
def local_cluster(owner_pid: int):
    """A private cluster: (env for sbatch/srun, state folder, list for submitted job ids).  Stopped by
    PID on the way out; its watcher also stops it once process ``owner_pid`` has ended."""
    base = tempfile.mkdtemp(prefix="solar-slurm-")  # short: unix socket paths are limited to 108 bytes
    state = os.path.join(base, "state")
    ctld, slurmd = free_ports(2)
    env = clean_env()
    env.update(SOLAR_SLURM_STATE=state, SOLAR_SLURM_CPUS=str(P), SOLAR_SLURM_MEMORY="2048",
               SOLAR_SLURM_CTLD_PORT=str(ctld), SOLAR_SLURM_SLURMD_PORT=str(slurmd),
               SOLAR_SLURM_FIRST_JOB_ID=str(first_job_id(ctld)), SOLAR_SLURM_OWNER_PID=str(owner_pid))
    jobs = []
    try:
        rc, out = run([CLUSTER, "start"], env, CLUSTER_LIMIT_S)
        assert rc == 0, (f"local_cluster.sh start {'timed out' if rc is None else f'exited {rc}'}:\n{out[-2000:]}\n"
                         + "\n".join(tail(os.path.join(state, f)) for f in ("slurmctld.log", "slurmd.log", "munged.log")))
        env["SLURM_CONF"] = os.path.join(state, "slurm.conf")
        yield env, state, jobs
    finally:
        left = stop_cluster(env, state, jobs)
        shutil.rmtree(base, ignore_errors=True)
        if left:
            sys.stderr.write(f"still running after local_cluster.sh stop (killed now): {left}\n")
    assert not left, f"still running after local_cluster.sh stop (killed now): {left}"


@pytest.fixture
def cluster(record_property):
    """(env for sbatch, submitted job ids) of a private cluster that this process owns."""
    require_slurm(record_property)
    with local_cluster(os.getpid()) as (env, _, jobs):
        yield env, jobs


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE")


def wait_for_job(env: dict, job: int, limit: float) -> tuple:
    """(exit status of the batch script or None if it did not end within ``limit`` s, scontrol's line).
    Polled every 0.5 s: ``sbatch --wait`` returned up to 30 s after the job had ended (its own polling)."""
    deadline = time.monotonic() + limit
    line = ""
    while time.monotonic() < deadline:
        rc, line = run(["scontrol", "--oneliner", "show", "job", str(job)], env, 30)
        state = re.search(r"\bJobState=(\w+)", line or "")
        if rc == 0 and state and state.group(1) in ENDED:
            code = re.search(r"\bExitCode=(\d+):(\d+)", line)
            return (int(code.group(1)) or int(code.group(2)) if code else -1), line
        time.sleep(0.5)
    run(["scancel", str(job)], env, 30)
    return None, line


def submit(env: dict, jobs: list, work, name: str, **variables) -> str:
    """sbatch plan_and_train.sbatch (2 tasks on the one node) with ``variables`` in its environment and
    wait for it to end; returns the job's output, after asserting that it succeeded."""
    cmd = ["sbatch", "--parsable", f"--job-name=solar-test-{name}", "--nodes=1", f"--ntasks={P}",
           f"--ntasks-per-node={P}", "--cpus-per-task=1", "--gpus-per-node=0", "--time=5",
           f"--output={work}/{name}-%j.out", BATCH]
    job_env = dict(env, SOLAR_DIR=ROOT, PYTHON=sys.executable, PYTHONPATH=ROOT, **variables)
    t0 = time.monotonic()
    rc, out = run(cmd, job_env, JOB_LIMIT_S, cwd=ROOT)
    ids = [int(i) for i in re.findall(r"^(\d+)", out or "", re.MULTILINE)[:1]]  # --parsable: the id first
    assert rc == 0 and ids, f"sbatch ({name}) {'did not end in time' if rc is None else f'exited {rc}'}:\n{out[-1500:]}"
    jobs.extend(ids)
    rc, out = wait_for_job(env, ids[0], JOB_LIMIT_S - (time.monotonic() - t0))
    log = "".join(read_text(os.path.join(work, f))
                  for f in sorted(os.listdir(work)) if f.startswith(f"{name}-") and f.endswith(".out"))
    status = "did not end in time" if rc is None else f"exited {rc}"
    assert rc == 0, f"job {name} {status}:\n{out[-1500:]}\n--- job output:\n{log[-4000:]}"
    return log


def read_steps(path) -> dict:
    """{step: sample ids per rank} from train_ptychonn.py's --log-json file."""
    with open(path) as f:
        recs = [json.loads(line) for line in f]
    return {r["step"]: r["index"] for r in recs if "index" in r}


def assert_ranks_trained(out: str, steps: int):
    """Both tasks (srun --label prefixes) report their own rank of a 2-rank world and ``steps`` steps."""
    for r in range(P):
        assert re.search(rf"^{r}: rank {r} of {P} on .*: trained {steps} steps ", out, re.MULTILINE), \
            f"task {r} did not report {steps} steps as rank {r} of {P}:\n{out[-3000:]}"


def test_plan_train_and_resume_by_resubmission(cluster, tmp_path):
    import solar
    env, jobs = cluster
    data = make_dataset(tmp_path, "ptychonn", samples=SAMPLES, size=16)
    plan, ck = tmp_path / "plan.h5", tmp_path / "ck.pt"
    common = {"DATA": data, "EPOCHS": str(EPOCHS), "LOCAL_BATCH": str(B), "PLAN": str(plan), "CHECKPOINT": str(ck)}
    model = "--width 4 --depth 2"

    out = submit(env, jobs, tmp_path, "first", **common,
                 TRAIN_ARGS=f"{model} --max-steps {STOP} --log-json {tmp_path / 'first.jsonl'}")
    assert plan.exists() and ck.exists(), out[-3000:]  # the job planned (there was no plan before)
    assert "using the existing schedule" not in out
    assert_ranks_trained(out, STOP)
    assert sorted(read_steps(tmp_path / "first.jsonl")) == list(range(STOP))

    out = submit(env, jobs, tmp_path, "again", **common, TRAIN_ARGS=f"{model} --log-json {tmp_path / 'again.jsonl'}")
    assert "using the existing schedule" in out and f"resuming from {ck}" in out
    assert f"resumed from {ck} at step {STOP} (epoch {STOP // S}, step {STOP % S} of {S})" in out, out[-3000:]
    assert_ranks_trained(out, TOTAL - STOP)
    got = read_steps(tmp_path / "again.jsonl")
    assert sorted(got) == list(range(STOP, TOTAL))
    with solar.Schedule.load(str(plan)) as s:
        for g in range(STOP, TOTAL):
            assert got[g] == [s.batch(g // S, g % S, r).tolist() for r in range(P)], f"step {g}"
    saved = ck.read_bytes()

    out = submit(env, jobs, tmp_path, "finished", **common, TRAIN_ARGS=model)
    assert f"resumed from {ck} at step {TOTAL} (epoch {EPOCHS}, step 0 of {S})" in out, out[-3000:]
    assert_ranks_trained(out, 0)
    assert f"done: {TOTAL} steps" in out
    assert ck.read_bytes() == saved


def srun_true(env: dict) -> tuple:
    """(status, output) of a one-task job step: the controller, slurmd and munged all answer."""
    return run(["srun", "--nodes=1", "--ntasks=1", "--mpi=none", "--time=1", "true"], env, 60)


def test_clusters_side_by_side_keep_their_own_daemons(record_property):
    """Two clusters at once (two CI runs on one machine): each has its own munged, ports and job ids;
    stopping one leaves the other working.  A cluster whose owner process is killed (a CI job's
    time-out) is stopped by its watcher."""
    require_slurm(record_property)
    owner = subprocess.Popen(["sleep", "600"])
    try:
        with local_cluster(owner.pid) as (env_a, state_a, _), local_cluster(os.getpid()) as (env_b, state_b, _):
            a, b = daemon_pids(state_a), daemon_pids(state_b)
            assert set(a) == set(b) == set(DAEMONS), (a, b)  # munged too: started by each, not shared
            assert not set(a.values()) & set(b.values())
            conf = [read_text(os.path.join(st, "slurm.conf")) for st in (state_a, state_b)]
            ids = [re.search(r"^FirstJobId=(\d+)$", c, re.MULTILINE).group(1) for c in conf]
            assert ids == [e["SOLAR_SLURM_FIRST_JOB_ID"] for e in (env_a, env_b)] and ids[0] != ids[1]
            for env in (env_a, env_b):
                rc, out = srun_true(env)
                assert rc == 0, out[-2000:]
            owner.kill()  # cluster A's owner ends: its watcher stops A within a few seconds
            owner.wait()
            deadline = time.monotonic() + 60
            while any(alive(p) for p in a.values()) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert not [n for n, p in a.items() if alive(p)], read_text(os.path.join(state_a, "watcher.log"))
            assert not os.path.exists(state_a)
            assert all(alive(p) for p in b.values()), b
            rc, out = srun_true(env_b)
            assert rc == 0, f"cluster B stopped working when A stopped:\n{out[-2000:]}"
    finally:
        owner.kill()
        owner.wait()
