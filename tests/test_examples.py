"""examples/train_ptychonn.py under `mpiexec -n 2` (a subprocess; no SLURM needed).

Both loaders train a few steps on a tiny PtychoNN-style file; a run stopped after k steps
and resumed from its checkpoint must train on the same next batches, with the same losses,
as an uninterrupted run; and solar's global batches must be DistributedSampler's.
"""
import json
import math
import os
import re
import shutil
import subprocess
import sys
from itertools import chain

import pytest
from helpers import make_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_ptychonn.py")
pytestmark = pytest.mark.slow  # five mpiexec launches: about 35 s on 2 idle cores

P, B, EPOCHS, STOP, TOTAL = 2, 4, 2, 3, 6  # 32 samples: 4 steps per epoch; stop mid-epoch 0, run into epoch 1


def _mpiexec():
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPI_LOCAL", "OMPI_"))}
    env.update(OMP_NUM_THREADS="1", HDF5_USE_FILE_LOCKING="FALSE", PYTHONUNBUFFERED="1")
    return env


def train(cwd, *args, timeout=120) -> str:
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec")
    cmd = [mpiexec, "-n", str(P), sys.executable, SCRIPT, *map(str, args)]
    r = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout,
                       check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}:\n{out[-4000:]}"
    return out


def read_log(path):
    steps, epochs = {}, []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if "index" in rec:
                steps[rec["step"]] = rec
            else:
                epochs.append(rec)
    return steps, epochs


def expected_batches(job, loader):
    """Sample ids per step and rank, from the schedule (solar) or DistributedSampler (baseline)."""
    S = 32 // (P * B)
    if loader == "solar":
        import solar
        with solar.Schedule.load(job["plan"]) as s:
            return [[s.batch(g // S, g % S, r).tolist() for r in range(P)] for g in range(TOTAL)]
    from torch.utils.data import DistributedSampler
    out = []
    for g in range(TOTAL):
        rows = []
        for r in range(P):
            sampler = DistributedSampler(range(32), num_replicas=P, rank=r, shuffle=True, seed=0)
            sampler.set_epoch(g // S)
            rows.append(list(sampler)[(g % S) * B:(g % S + 1) * B])
        out.append(rows)
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A tiny dataset and its schedule; per loader a run stopped after STOP steps with a checkpoint
    and its resumption up to TOTAL steps; for the baseline also an uninterrupted reference run."""
    import solar
    tmp = tmp_path_factory.mktemp("train")
    data = make_dataset(tmp, "ptychonn", samples=32, size=16)
    plan = str(tmp / "plan.h5")
    solar.plan(data, world_size=P, local_batch=B, epochs=EPOCHS, buffer_fraction=0.5, out=plan).close()
    common = [data, "--epochs", EPOCHS, "--local-batch", B, "--width", 4, "--depth", 2]
    runs = {}
    # the reference goes through real DataLoader workers (forkserver); the others read in-process
    ref = tmp / "ref-baseline.jsonl"
    runs["ref"] = (train(tmp, *common, "--loader", "baseline", "--workers", 1, "--max-steps", TOTAL,
                         "--log-json", ref), *read_log(ref))
    for loader, extra in (("baseline", ["--loader", "baseline", "--workers", 0]),
                          ("solar", ["--loader", "solar", "--plan", plan])):
        ck, part, rest = (tmp / f"{x}-{loader}" for x in ("ck.pt", "part.jsonl", "resumed.jsonl"))
        args = [*common, *extra, "--checkpoint", ck]
        out1 = train(tmp, *args, "--max-steps", STOP, "--log-json", part)
        assert ck.exists()
        out2 = train(tmp, *args, "--resume", "--max-steps", TOTAL, "--log-json", rest)
        runs[loader] = (out1, *read_log(part)), (out2, *read_log(rest))
    return dict(tmp=tmp, plan=plan, runs=runs)


def whole(job, loader):
    """Output, per-step records and per-epoch records of ``loader``'s training (0..TOTAL-1)."""
    if loader == "baseline":
        return job["runs"]["ref"]
    (out1, steps1, epochs1), (out2, steps2, epochs2) = job["runs"][loader]
    return out1 + out2, {**steps1, **steps2}, epochs1 + epochs2


@pytest.mark.parametrize("loader", ["solar", "baseline"])
def test_trains_with_finite_loss(job, loader):
    out, steps, epochs = whole(job, loader)
    assert sorted(steps) == list(range(TOTAL))
    assert sum(e["steps"] for e in epochs) == TOTAL
    for e in epochs:
        assert math.isfinite(e["loss"]) and e["loss"] > 0
        assert e["samples"] == e["steps"] * P * B
        assert e["samples_per_s"] > 0 and e["stall_s_max"] >= 0
    assert re.search(r"^epoch 0( \(steps [^)]*\))?: loss \d+\.\d+ .* samples/s .* loader stall ", out, re.MULTILINE)
    for r in range(P):
        assert f"rank {r} of {P} on " in out  # every rank trained and says so
    assert [rec["index"] for _, rec in sorted(steps.items())] == expected_batches(job, loader)


@pytest.mark.parametrize("loader", ["solar", "baseline"])
def test_resume_continues_with_the_next_batch(job, loader):
    (_, part, epochs1), (out, got, epochs2) = job["runs"][loader]
    want = expected_batches(job, loader)
    assert sorted(part) == list(range(STOP)) and sorted(got) == list(range(STOP, TOTAL))
    first = "; ".join(f"rank {r}: {ids}" for r, ids in enumerate(want[STOP]))
    assert "resumed from " in out and f"at step {STOP} (epoch 0, step {STOP} of 4)" in out
    assert f"first batch after resume (step {STOP}): {first}" in out
    for g in range(STOP, TOTAL):
        assert got[g]["index"] == want[g], f"step {g}"
    assert [(e["epoch"], e["first_step"], e["steps"]) for e in epochs1 + epochs2] == \
        [(0, 0, STOP), (0, STOP, 4 - STOP), (1, 4, TOTAL - 4)]
    if loader == "baseline":
        # model and optimizer were restored too: the same losses as the uninterrupted run
        _, ref, _ = job["runs"]["ref"]
        for g in range(TOTAL):
            rec = part.get(g) or got[g]
            assert rec["loss"] == pytest.approx(ref[g]["loss"], rel=1e-4), f"step {g}"


def test_solar_trains_on_distributed_sampler_batches(job):
    """solar's global batch at every step is DistributedSampler's (as a set of samples); when the
    plan keeps the epoch order, training is the same as the baseline's, loss for loss."""
    import solar
    _, ours, _ = whole(job, "solar")
    _, theirs, _ = job["runs"]["ref"]
    S = 32 // (P * B)
    with solar.Schedule.load(job["plan"]) as s:
        order = [s.source_epoch(e) for e in range(EPOCHS)]
    for g in range(TOTAL):
        src = order[g // S] * S + g % S
        if src in theirs:
            assert sorted(chain(*ours[g]["index"])) == sorted(chain(*theirs[src]["index"])), f"step {g}"
    if order == list(range(EPOCHS)):
        for g in range(TOTAL):  # same global batches in the same order: DDP averages the same gradients
            assert ours[g]["loss"] == pytest.approx(theirs[g]["loss"], rel=1e-4), f"step {g}"
