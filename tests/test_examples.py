"""examples/train_ptychonn.py and examples/train_well.py on 2 ranks (``mpiexec -n 2``, gloo, CPU).

On a tiny PtychoNN-style file (256 training samples of 16x16, 64 held-out samples from another
seed): the held-out loss after 3 epochs is clearly below the constant predictor's; solar and the
baseline (DataLoader + DistributedSampler over h5py) train on the same global batches and give
the same loss curve; a run stopped after k steps and resumed from its checkpoint trains on the
same next batches, with the same losses, as the uninterrupted run.  The Well example: its
next-step predictor beats the constant predictor on the valid split after a few epochs.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from itertools import chain

import pytest
from helpers import make_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
# five 2-rank launches: about a minute on 2 idle cores.  One xdist group, so that the fixture (four of those
# launches) runs once, not once on each worker (`make test` runs -n 2 --dist loadgroup: it ran twice)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("examples")]

P, B, EPOCHS, N, SIZE = 2, 8, 3, 256, 16  # 16 steps per epoch
S = N // (P * B)
STOP, TOTAL = 5, 20  # stop mid-epoch 0, resume into epoch 1


def _mpiexec():
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPI_LOCAL", "OMPI_", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", HDF5_USE_FILE_LOCKING="FALSE", PYTHONUNBUFFERED="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    return env


def _mpi_env():
    """:func:`_env` for mpiexec: no MASTER_PORT.  Rank 0 then listens on a port the OS gives it and sends it over
    MPI; a port picked here could be taken by another process before rank 0 binds it (EADDRINUSE once failed the
    whole module)."""
    env = _env()
    env.pop("MASTER_PORT")
    return env


def run_example(cwd, script, *args, timeout=180) -> str:
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec")
    cmd = [mpiexec, "-n", str(P), sys.executable, os.path.join(EXAMPLES, script), *map(str, args)]
    r = subprocess.run(cmd, cwd=cwd, env=_mpi_env(), capture_output=True, text=True, timeout=timeout, check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}:\n{out[-4000:]}"
    return out


def read_log(path):
    """Per-step records {step: rec} and per-epoch records (held-out evaluation before training included)."""
    steps, epochs = {}, []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            (steps.__setitem__(rec["step"], rec) if "index" in rec else epochs.append(rec))
    return steps, epochs


def expected_batches(plan, loader):
    """Sample ids per step and rank, from the schedule (solar) or DistributedSampler (baseline), in that order."""
    if loader == "solar":
        import solar
        with solar.Schedule.load(plan) as s:
            return [[s.batch(g // S, g % S, r).tolist() for r in range(P)] for g in range(TOTAL)]
    from torch.utils.data import DistributedSampler
    out = []
    for g in range(TOTAL):
        rows = []
        for r in range(P):
            sampler = DistributedSampler(range(N), num_replicas=P, rank=r, shuffle=True, seed=0)
            sampler.set_epoch(g // S)
            rows.append(list(sampler)[(g % S) * B:(g % S + 1) * B])
        out.append(rows)
    return out


# session, not module: xdist runs other modules' tests between this group's on the same worker, and a module
# fixture is torn down at each switch (it was made twice, ~55 s each, in one `make test`)
@pytest.fixture(scope="session")
def ptycho(tmp_path_factory):
    """Training and held-out data, a schedule; per loader an uninterrupted run with held-out evaluation;
    for solar also a run stopped after STOP steps then resumed to TOTAL."""
    import solar
    tmp = tmp_path_factory.mktemp("ptycho")
    data = make_dataset(tmp, "ptychonn", samples=N, size=SIZE)
    valid = make_dataset(tmp, "ptychonn", seed=1, samples=64, size=SIZE)
    plan = str(tmp / "plan.h5")
    solar.plan(data, world_size=P, local_batch=B, epochs=EPOCHS, buffer_fraction=0.5, out=plan).close()
    common = [data, "--epochs", EPOCHS, "--local-batch", B, "--width", 8, "--depth", 2]
    loaders = {"solar": ["--loader", "solar", "--plan", plan], "baseline": ["--loader", "baseline", "--workers", 1]}
    runs = {}
    for loader, extra in loaders.items():
        full = tmp / f"{loader}.jsonl"
        out = run_example(tmp, "train_ptychonn.py", *common, *extra, "--valid", valid, "--log-json", full,
                          "--plot", tmp / f"{loader}.png")
        runs[loader] = dict(out=out, log=read_log(full))
    # stopped after STOP steps, resumed to TOTAL (solar; the baseline's resume is the same code but its sampler)
    ck, part, rest = (tmp / x for x in ("ck.pt", "part.jsonl", "resumed.jsonl"))
    args = [*common, *loaders["solar"], "--checkpoint", ck]
    run_example(tmp, "train_ptychonn.py", *args, "--max-steps", STOP, "--log-json", part)
    out2 = run_example(tmp, "train_ptychonn.py", *args, "--resume", "--max-steps", TOTAL, "--log-json", rest)
    runs["solar"].update(part=read_log(part), rest=read_log(rest), resumed_out=out2)
    return dict(tmp=tmp, plan=plan, runs=runs, data=data)


@pytest.mark.parametrize("loader", ["solar", "baseline"])
def test_ptychonn_learns_below_the_constant_predictor(ptycho, loader):
    run = ptycho["runs"][loader]
    steps, epochs = run["log"]
    assert sorted(steps) == list(range(EPOCHS * S))
    before, trained = epochs[0], [e for e in epochs if e["epoch"] >= 0]
    assert [e["epoch"] for e in trained] == list(range(EPOCHS))
    const = trained[-1]["valid"]["constant"]["total"]
    assert const == pytest.approx(before["valid"]["constant"]["total"])  # the same samples, the same reference
    held = [e["valid"]["model"]["total"] for e in trained]
    assert held[-1] < 0.8 * const, f"held-out loss {held} vs constant predictor {const}"
    assert held[-1] < held[0] < before["valid"]["model"]["total"]
    assert trained[-1]["loss"] < trained[0]["loss"]
    for e in trained:
        assert e["samples"] == S * P * B and e["samples_per_s"] > 0 and e["stall_s_max"] >= 0
        assert ("buffer_hit_rate" in e) == (loader == "solar")
    out = run["out"]
    assert f"epoch {EPOCHS - 1}: loss " in out and "held-out " in out and "(constant " in out
    for r in range(P):
        assert f"rank {r} of {P} on " in out  # every rank trained and says so
    assert os.path.getsize(ptycho["tmp"] / f"{loader}.png") > 0


def test_solar_and_baseline_give_the_same_loss_curve(ptycho):
    """The same global batches (as sets, step for step) and the same seed: the same training up to float
    reassociation of the per-rank gradient sums (solar may split a global batch over ranks differently)."""
    import solar
    with solar.Schedule.load(ptycho["plan"]) as s:
        assert [s.source_epoch(e) for e in range(EPOCHS)] == list(range(EPOCHS))
    (ours, our_epochs), (theirs, their_epochs) = (ptycho["runs"][k]["log"] for k in ("solar", "baseline"))
    for g in range(EPOCHS * S):
        assert sorted(chain(*ours[g]["index"])) == sorted(chain(*theirs[g]["index"])), f"step {g}"
        assert ours[g]["loss"] == pytest.approx(theirs[g]["loss"], rel=2e-3), f"step {g}"
    for a, b in zip(our_epochs, their_epochs):
        assert a["epoch"] == b["epoch"]
        if a["epoch"] >= 0:
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
        assert a["valid"]["model"]["total"] == pytest.approx(b["valid"]["model"]["total"], rel=1e-3)
        assert a["valid"]["constant"]["total"] == pytest.approx(b["valid"]["constant"]["total"], rel=1e-9)


@pytest.mark.parametrize("loader", ["solar", "baseline"])
def test_batches_are_the_planned_ones(ptycho, loader):
    steps, _ = ptycho["runs"][loader]["log"]
    want = expected_batches(ptycho["plan"], loader)
    assert [steps[g]["index"] for g in range(TOTAL)] == want


def test_resume_continues_with_the_next_batch(ptycho, loader="solar"):
    run = ptycho["runs"][loader]
    (part, epochs1), (got, epochs2) = run["part"], run["rest"]
    want = expected_batches(ptycho["plan"], loader)
    assert sorted(part) == list(range(STOP)) and sorted(got) == list(range(STOP, TOTAL))
    out = run["resumed_out"]
    first = "; ".join(f"rank {r}: {ids}" for r, ids in enumerate(want[STOP]))
    assert "resumed from " in out and f"at step {STOP} (epoch 0, step {STOP} of {S})" in out
    assert f"first batch after resume (step {STOP}): {first}" in out
    for g in range(STOP, TOTAL):
        assert got[g]["index"] == want[g], f"step {g}"
    assert [(e["epoch"], e["first_step"], e["steps"]) for e in epochs1 + epochs2 if e["epoch"] >= 0] == \
        [(0, 0, STOP), (0, STOP, S - STOP), (1, S, TOTAL - S)]
    # model, optimizer and statistics were restored: the same losses as the uninterrupted run
    ref, _ = run["log"]
    for g in range(TOTAL):
        rec = part.get(g) or got[g]
        assert rec["loss"] == pytest.approx(ref[g]["loss"], rel=1e-4), f"step {g}"


def _run_failing(cwd, script, *args, timeout=120):
    cmd = [_mpiexec(), "-n", str(P), sys.executable, os.path.join(EXAMPLES, script), *map(str, args)]
    r = subprocess.run(cmd, cwd=cwd, env=_mpi_env(), capture_output=True, text=True, timeout=timeout, check=False)
    return r.returncode, r.stdout + r.stderr


def test_bad_checkpoints_and_outputs_end_the_job_with_one_line(ptycho):
    """A checkpoint that is not this trainer's (truncated, not a torch file, another task's) and an output the job
    could not write are refused before training, one line per rank and no traceback (they gave tracebacks, the
    outputs only after an epoch of training)."""
    import torch
    tmp = ptycho["tmp"]
    good = tmp / "ck.pt"
    (tmp / "trunc.pt").write_bytes(good.read_bytes()[:1000])
    (tmp / "text.pt").write_text("not a checkpoint")
    other = torch.load(good, map_location="cpu", weights_only=False)
    torch.save(dict(other, stats={"u": 1}, task="train_well"), tmp / "well.pt")
    common = ["--plan", ptycho["plan"], "--epochs", EPOCHS, "--local-batch", B, "--width", 8, "--depth", 2]
    data = ptycho["data"]
    cases = {"trunc.pt": "cannot read checkpoint", "text.pt": "cannot read checkpoint",
             "well.pt": "was written by train_well, not train_ptychonn"}
    for name, why in cases.items():
        code, out = _run_failing(tmp, "train_ptychonn.py", data, *common, "--checkpoint", tmp / name, "--resume")
        assert code != 0 and "Traceback" not in out, out[-3000:]
        assert out.count(f"train_ptychonn: error on rank") == P and why in out, out[-3000:]
    for opt, path, why in (("--checkpoint", tmp, "is a folder"), ("--plot", tmp / "no" / "x.png", "does not exist"),
                           ("--log-json", tmp / "no" / "x.jsonl", "does not exist"),
                           ("--plot", tmp / "x.txt", "end with")):
        code, out = _run_failing(tmp, "train_ptychonn.py", data, *common, opt, path)
        assert code != 0 and "Traceback" not in out and why in out and "steps per epoch" not in out, out[-3000:]


def test_well_next_step_predictor_learns(tmp_path):
    """train_well.py on `solar gen well` windows: after 3 epochs the held-out (valid split) loss is clearly
    below the constant predictor's and the persistence predictor's (its starting point)."""
    data = make_dataset(tmp_path, "well", samples=4, size=16, steps=20)  # 2 files x 4 trajectories x 16 windows
    log = tmp_path / "well.jsonl"
    out = run_example(tmp_path, "train_well.py", data, "--valid-split", "valid", "--epochs", 3, "--local-batch", 8,
                      "--width", 16, "--blocks", 2, "--log-json", log, "--plot", tmp_path / "well.png")
    _, epochs = read_log(log)
    before, last = epochs[0]["valid"], epochs[-1]["valid"]
    assert before["model"]["total"] == pytest.approx(before["persistence"]["total"])  # starts as persistence
    assert last["model"]["total"] < 0.7 * last["persistence"]["total"] < 0.7 * last["constant"]["total"], last
    assert "stats.yaml" in out and "buffer hits" in out and os.path.getsize(tmp_path / "well.png") > 0


def test_a_plan_the_example_makes_records_its_data(ptycho):
    """The example plans from the data's path, so the schedule records where the data is: the Lightning and
    Accelerate variants, which take only a schedule, find it there (a plan made from a layout object records no
    path, and they stopped with 'file not found: ')."""
    import solar
    plan = ptycho["tmp"] / "made-by-example.h5"
    run_example(ptycho["tmp"], "train_ptychonn.py", ptycho["data"], "--epochs", 1, "--local-batch", B, "--width", 8,
                "--depth", 2, "--loader", "solar", "--plan", plan, "--max-steps", 1)
    with solar.Schedule.load(str(plan)) as s:
        assert s.source and os.path.samefile(s.source, ptycho["data"])


def test_a_plan_with_the_buffer_on_the_device_trains_the_same_steps(ptycho):
    """``solar plan --device-buffer`` (the buffer in GPU memory, batches gathered there; the CPU stands in for
    the GPU here) run by the example: the same steps, sample ids and losses as the same budget on the host; the
    example plans one itself with ``--device-buffer``, and a host plan does not pass for one."""
    import solar
    tmp, data = ptycho["tmp"], ptycho["data"]
    budget = 1 << 20  # about half of the data per rank
    logs = {}
    for place in ("host", "device"):
        plan = str(tmp / f"buffer-{place}.h5")
        solar.plan(data, world_size=P, local_batch=B, epochs=2, seed=0, out=plan,
                   **({"buffer_per_rank": budget} if place == "host" else {"device_buffer": budget})).close()
        out = run_example(tmp, "train_ptychonn.py", data, "--epochs", 2, "--local-batch", B, "--width", 8,
                          "--depth", 2, "--loader", "solar", "--plan", plan, "--log-json", tmp / f"{place}.jsonl")
        logs[place] = read_log(tmp / f"{place}.jsonl")[0]
        assert "buffer hits" in out
    with solar.Schedule.load(str(tmp / "buffer-device.h5")) as s:
        assert s.buffer_place == "device"
    assert sorted(logs["host"]) == sorted(logs["device"]) == list(range(2 * S))
    for g in range(2 * S):
        assert logs["device"][g]["index"] == logs["host"][g]["index"], g
        assert logs["device"][g]["loss"] == logs["host"][g]["loss"], g  # the same bytes, the same arithmetic
    made = tmp / "made-gpubuf.h5"
    run_example(tmp, "train_ptychonn.py", data, "--epochs", 1, "--local-batch", B, "--width", 8, "--depth", 2,
                "--plan", made, "--device-buffer", "1MiB", "--max-steps", 1)
    with solar.Schedule.load(str(made)) as s:
        assert s.buffer_place == "device"
    cmd = [_mpiexec(), "-n", str(P), sys.executable, os.path.join(EXAMPLES, "train_ptychonn.py"), data, "--epochs",
           "2", "--local-batch", str(B), "--plan", str(tmp / "buffer-host.h5"), "--device-buffer", "1MiB"]
    r = subprocess.run(cmd, cwd=tmp, env=_mpi_env(), capture_output=True, text=True, timeout=180)
    assert r.returncode != 0 and "does not fit this job: planned for a buffer in host memory (job: --device-buffer)" in \
        r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]


def test_the_loader_in_a_process_of_its_own_trains_the_same_steps(ptycho):
    """``--loader-process`` (SolarLoader(process=True)): the same steps, sample ids and losses as the loader in the
    training process, on the same per-rank plan."""
    import solar
    tmp, data = ptycho["tmp"], ptycho["data"]
    plan = str(tmp / "per-rank.h5")
    solar.plan(data, world_size=P, local_batch=B, epochs=2, seed=0, out=plan, buffer_fraction=0.5).close()
    logs = {}
    for how in ("in", "process"):
        run_example(tmp, "train_ptychonn.py", data, "--epochs", 2, "--local-batch", B, "--width", 8, "--depth", 2,
                    "--loader", "solar", "--plan", plan, "--log-json", tmp / f"lp-{how}.jsonl",
                    *(["--loader-process"] if how == "process" else []))
        logs[how] = read_log(tmp / f"lp-{how}.jsonl")[0]
    assert sorted(logs["in"]) == sorted(logs["process"]) == list(range(2 * S))
    for g in range(2 * S):
        assert logs["process"][g]["index"] == logs["in"][g]["index"], g
        assert logs["process"][g]["loss"] == logs["in"][g]["loss"], g


def test_lightning_variant_trains_like_the_example(ptycho):
    """train_ptychonn_lightning.py (PyTorch Lightning's DDP under torchrun, SolarDataset in a DataLoader) on
    the same schedule: the same per-epoch training losses as train_ptychonn.py's solar run."""
    pytest.importorskip("lightning")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = _env()
    cmd = [torchrun, "--nproc-per-node", str(P), "--master-addr", "127.0.0.1", "--master-port", env["MASTER_PORT"],
           os.path.join(EXAMPLES, "train_ptychonn_lightning.py"), ptycho["plan"], "--epochs", str(EPOCHS),
           "--width", "8", "--depth", "2"]
    r = subprocess.run(cmd, cwd=ptycho["tmp"], env=env, capture_output=True, text=True, timeout=180, check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    got = [float(x) for x in re.findall(r"^epoch \d+: loss (\d+\.\d+) ", out, re.MULTILINE)]
    _, epochs = ptycho["runs"]["solar"]["log"]
    want = [e["loss"] for e in epochs if e["epoch"] >= 0]
    assert got == pytest.approx(want, rel=1e-3), out[-2000:]


def test_outputs_never_replace_what_the_job_reads(tmp_path):
    """--checkpoint, --log-json and --plot onto the data's HDF5 file, its spec or the plan: refused before any
    work, the files unchanged (a checkpoint once replaced the training data)."""
    import glob
    import hashlib

    import solar
    data = make_dataset(tmp_path, "ptychonn", samples=8, size=8)
    h5 = sorted(glob.glob(os.path.join(data, "*.h5")))[0]
    plan = str(tmp_path / "plan.h5")
    solar.plan(data, world_size=1, local_batch=4, epochs=1, buffer_fraction=1.0, out=plan).close()
    spec = os.path.join(data, "solar-layout.json")
    digest = {f: hashlib.md5(open(f, "rb").read()).hexdigest() for f in (h5, plan, spec)}
    for opt, target, why in (("--checkpoint", h5, "is an HDF5 file"), ("--log-json", spec, "which this job reads"),
                             ("--checkpoint", plan, "which this job reads")):
        r = subprocess.run([sys.executable, os.path.join(EXAMPLES, "train_ptychonn.py"), data, "--plan", plan,
                            opt, target, "--epochs", "1"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                           timeout=120, check=False)
        assert r.returncode == 2 and why in r.stderr and "refusing to replace it" in r.stderr, r.stderr[-2000:]
    assert digest == {f: hashlib.md5(open(f, "rb").read()).hexdigest() for f in digest}


def test_lightning_variant_with_a_gpu_buffer_plan_and_no_gpu_says_so_in_one_line(tmp_path):
    """A plan made with --device-buffer, run by the Lightning variant where there is no CUDA: one line naming what
    to do and exit status 2, not a traceback."""
    pytest.importorskip("lightning")
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the plan runs")
    import solar
    data = make_dataset(tmp_path, "ptychonn", samples=16, size=16)
    plan = str(tmp_path / "dev.h5")
    solar.plan(data, world_size=1, local_batch=4, epochs=1, device_buffer="1MiB", out=plan).close()
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, "train_ptychonn_lightning.py"), plan, "--epochs", "1"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=180, check=False)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert err[-1].startswith("train_ptychonn_lightning: error on rank 0: ") and "GPU memory" in err[-1], err


def test_accelerate_variant_trains_and_resumes_like_the_example(ptycho):
    """train_ptychonn_accelerate.py (Accelerate's DDP on CPU, SolarDataset in an unprepared DataLoader) on the same
    schedule: stopped after STOP steps under `accelerate launch`, resumed from accelerator.save_state under torchrun;
    each (part of an) epoch has the training loss of train_ptychonn.py's runs (stopped, resumed, uninterrupted)."""
    pytest.importorskip("accelerate")
    tmp, env = ptycho["tmp"], _env()
    env["HF_HOME"] = str(tmp / "hf")  # no accelerate config of the user's
    script = [os.path.join(EXAMPLES, "train_ptychonn_accelerate.py"), ptycho["plan"], "--width", "8", "--depth", "2",
              "--checkpoint", str(tmp / "accelerate-ck")]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(P),
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", env["MASTER_PORT"]]  # --multi_gpu: torchrun's launcher, also without GPUs
    torchrun = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", str(P),
                "--master-addr", "127.0.0.1", "--master-port", env["MASTER_PORT"]]
    epoch = re.compile(r"^epoch (\d+)(?: \(steps (\d+)\.\.(\d+) of \d+\))?: loss (\d+\.\d+) ", re.MULTILINE)
    outs = []
    for cmd in ([*launch, *script, "--max-steps", str(STOP)], [*torchrun, *script, "--resume"]):
        r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=180, check=False)
        outs.append(r.stdout + r.stderr)
        assert r.returncode == 0, outs[-1][-4000:]
    got = [[(int(e), int(a or 0), int(b or S - 1), float(x)) for e, a, b, x in epoch.findall(out)] for out in outs]
    full, part, rest = ([e["loss"] for e in ptycho["runs"]["solar"][k][1] if e["epoch"] >= 0]
                        for k in ("log", "part", "rest"))  # rest: epoch 0 from step STOP, then part of epoch 1
    assert [g[:3] for g in got[0]] == [(0, 0, STOP - 1)], outs[0][-2000:]
    assert [g[:3] for g in got[1]] == [(0, STOP, S - 1), (1, 0, S - 1), (2, 0, S - 1)], outs[1][-2000:]
    assert f"resumed from {tmp / 'accelerate-ck'} at step {STOP} (epoch 0, step {STOP} of {S})" in outs[1]
    assert f"done: {EPOCHS * S} steps" in outs[1]
    losses = [g[3] for g in got[0] + got[1]]
    assert losses == pytest.approx([part[0], rest[0], full[1], full[2]], rel=1e-3), outs[1][-2000:]
    assert (STOP * losses[0] + (S - STOP) * losses[1]) / S == pytest.approx(full[0], rel=1e-3)  # all of epoch 0


def test_gpu_style_options_train(ptycho):
    """The options GPU users run with, on CPU: bf16 autocast and channels_last (the losses are read back every 3
    steps, each step still logged), the loop fed one resident batch (its own ceiling), and torch.compile, whose
    first steps give the losses of the eager fp32 run."""
    tmp, data = ptycho["tmp"], ptycho["data"]
    common = [data, "--epochs", EPOCHS, "--local-batch", B, "--width", 8, "--depth", 2]
    log = tmp / "bf16.jsonl"
    out = run_example(tmp, "train_ptychonn.py", *common, "--loader", "resident", "--amp", "bf16", "--channels-last",
                      "--log-every", 3, "--log-json", log)
    assert "amp bf16, channels_last" in out and "loader resident" in out
    steps, epochs = read_log(log)
    assert sorted(steps) == list(range(EPOCHS * S))
    assert all(steps[g]["index"] == steps[0]["index"] for g in steps)  # the same batch every step
    assert epochs[-1]["loss"] < 0.7 * epochs[0]["loss"]  # it learns that one batch
    log = tmp / "compiled.jsonl"
    out = run_example(tmp, "train_ptychonn.py", *common, "--plan", ptycho["plan"], "--compile", "--max-steps", 4,
                      "--log-every", 2, "--log-json", log, timeout=600)
    assert "compiled" in out
    got, _ = read_log(log)
    ref, _ = ptycho["runs"]["solar"]["log"]
    assert sorted(got) == [0, 1, 2, 3]
    for g in range(4):
        assert got[g]["index"] == ref[g]["index"] and got[g]["loss"] == pytest.approx(ref[g]["loss"], rel=1e-4)
