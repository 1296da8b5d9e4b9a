"""Open-ended training (issue 14): ``solar plan --epochs auto --window K`` plans the first window, the
loader plans the next ones in the background with the same deterministic planner on every rank.

The MPI test is written once and runs serially (both ranks in this process) and under
``mpiexec -n 2 python -m pytest -m mpi`` (one rank each).
"""
import logging
import os
import shutil

import h5py
import numpy as np
import pytest
from helpers import make_dataset

import solar
from solar.cli import main
from solar.errors import SpecError
from solar.loader import SolarLoader
from solar.loader.extend import WindowPlanner
from solar.schedule import Schedule, ScheduleError
from solar.schedule.format import header_digest
from solar.scheduler.sampler import batch_bounds, epoch_indices, sampler_sizes

P, B, K = 2, 3, 2  # world size, local batch, window
EPOCHS = 3 * K  # three windows


@pytest.fixture(scope="module", params=["contiguous", "gzip"])
def job(tmp_path_factory, request):
    """A 40-sample dataset, an open-ended plan (window K) and a fixed plan of more epochs than 3 windows; gzip:
    3 samples a chunk, planned as parts of chunks (:mod:`solar.layout.parts`), which the loader's next windows
    must plan the same way."""
    root = tmp_path_factory.mktemp("open")
    data = make_dataset(root, "ptychonn", request.param, samples=40)
    kw = dict(world_size=P, local_batch=B, buffer_fraction=0.3)
    solar.plan(data, epochs="auto", window=K, out=str(root / "open.h5"), **kw).close()
    solar.plan(data, epochs=EPOCHS + 1, out=str(root / "fixed.h5"), **kw).close()
    return str(root / "open.h5"), str(root / "fixed.h5"), data


def run_epochs(loader, epochs):
    """{(epoch, step): batch without weight} and {epoch: epoch_log numbers} over ``epochs``."""
    batches, logs = {}, {}
    for e in epochs:
        loader.set_epoch(e)
        first = loader.cursor
        for i, b in enumerate(loader):
            batches[(e, (first % loader.S) + i)] = {k: np.array(v) for k, v in b.items() if k != "weight"}
        logs[e] = dict(loader.epoch_log.last)
    return batches, logs


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].keys() == b[key].keys(), key
        for f in a[key]:
            assert np.array_equal(a[key][f], b[key][f]), (key, f)


@pytest.mark.parametrize("rank", range(P))
def test_three_windows_equal_a_fixed_plan_and_hit_bytes_equal_the_prediction(job, rank):
    open_path, fixed_path, _ = job
    with SolarLoader(open_path, rank=rank, as_torch=False, reader="pread") as a:
        assert a.epochs is None and a.open_ended
        got, logs = run_epochs(a, range(EPOCHS))
        assert a.windows.planned >= 3
    with SolarLoader(fixed_path, rank=rank, as_torch=False, reader="pread") as b:
        want, _ = run_epochs(b, range(EPOCHS))
        stats = b.rank_plan.stats  # (G, 5): hits, hit_bytes, misses, miss_bytes, stored_bytes
    assert_same(got, want)
    S = b.S
    for e in range(EPOCHS):
        assert logs[e]["hit_bytes"] == int(stats[e * S:(e + 1) * S, 1].sum()), e
        assert logs[e]["bytes_loaded"] == int(stats[e * S:(e + 1) * S, 3].sum()), e


def test_resume_in_window_two_and_going_back_are_bit_identical(job):
    open_path, _, _ = job
    with SolarLoader(open_path, rank=1, as_torch=False, reader="pread") as a:
        full, _ = run_epochs(a, range(EPOCHS))
        S = a.S
        state = a.state_dict()
    state["step"] = (2 * K) * S + 2  # epoch 4, step 2: inside window 2, beyond the file's first window
    with SolarLoader(open_path, rank=1, as_torch=False, reader="pread") as b:
        b.load_state_dict(state)
        assert b.epoch == 2 * K
        assert next(iter(b.epoch_range())) == 2 * K
        rest, _ = run_epochs(b, range(2 * K, EPOCHS))
        b.windows.wait(3)  # the background thread may still be planning window 3 (it failed that way once)
        assert 1 not in b.windows.slices  # dropped once window 3 was planned
        back, _ = run_epochs(b, [K])  # back to window 1: planned again from window 0
    assert_same(rest, {k: v for k, v in full.items() if k[0] * S + k[1] >= state["step"]})
    assert_same(back, {k: v for k, v in full.items() if k[0] == K})


def test_next_window_is_planned_in_the_background_and_a_wait_is_logged_once(job, monkeypatch, caplog):
    open_path, _, _ = job
    with SolarLoader(open_path, rank=0, as_torch=False, reader="pread") as a:
        a.set_epoch(0)
        next(iter(a))  # starting window 0 starts planning window 1
        assert a.windows._thread is not None
        a.windows._thread.join()
        assert a.windows.planned == 2
    real = WindowPlanner._plan_next

    def slow(self):
        import time
        time.sleep(0.3)
        real(self)
    monkeypatch.setattr(WindowPlanner, "_plan_next", slow)
    with caplog.at_level(logging.WARNING, logger="solar"):
        with SolarLoader(open_path, rank=0, as_torch=False, reader="pread") as a:
            run_epochs(a, range(EPOCHS))
    waits = [r for r in caplog.records if "planning a window takes longer than training it" in r.getMessage()]
    assert len(waits) == 1


def test_solar_dataset_goes_beyond_the_first_window(job):
    """SolarDataset (torch IterableDataset) over an open-ended schedule: epochs past the file's window."""
    from solar.torch import SolarDataset
    open_path, fixed_path, _ = job
    with SolarLoader(fixed_path, rank=0, as_torch=False, reader="pread") as b:
        want, _ = run_epochs(b, [K, K + 1])
    ds = SolarDataset(open_path, rank=0, as_torch=False, reader="pread")
    try:
        assert ds.epochs is None and next(iter(ds.epoch_range())) == 0  # endless: the loop decides
        got = {}
        for e in (K, K + 1):
            ds.set_epoch(e)
            for batch in ds:
                got[(e, batch["step"] % ds.loader.S)] = {k: np.array(v) for k, v in batch.items()
                                                        if k not in ("weight", "step")}
    finally:
        ds.loader.close()
    assert_same(got, want)


def test_inspect_says_open_ended_and_the_window(job, tmp_path, capsys):
    _, _, data = job
    out = str(tmp_path / "p.h5")
    assert main(["plan", data, "-P", "2", "-b", "3", "--epochs", "auto", "--window", "3", "--buffer-fraction",
                 "0.3", "-o", out]) == 0
    capsys.readouterr()
    assert main(["inspect", out]) == 0
    text = capsys.readouterr().out
    assert "open-ended, window 3" in text
    with Schedule.load(out) as s:
        assert s.open_ended and s.window == 3 and s.epochs == 3 and s.version == 4


def test_plan_without_epochs_is_open_ended(job, tmp_path, capsys):
    _, _, data = job
    out = str(tmp_path / "p.h5")
    assert main(["plan", data, "-P", "2", "-b", "3", "--buffer-fraction", "0.3", "-o", out]) == 0
    with Schedule.load(out) as s:
        assert s.open_ended and s.window == solar.schedule.make.DEFAULT_WINDOW


def test_fixed_schedules_are_not_open_ended(job):
    _, fixed_path, _ = job
    with Schedule.load(fixed_path) as s:
        assert not s.open_ended and s.window == 0
    with SolarLoader(fixed_path, rank=0, as_torch=False, reader="pread") as b:
        assert b.epochs == EPOCHS + 1 and b.epoch_range() == range(0, EPOCHS + 1)


def test_window_attribute_is_checksummed(job, tmp_path):
    open_path, _, _ = job
    bad = str(tmp_path / "bad.h5")
    with open(open_path, "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read())
    with h5py.File(bad, "r+") as f:
        f.attrs["window"] = 5
    with pytest.raises(ScheduleError, match="header checksum mismatch"):
        Schedule.load(bad)


def test_version_3_files_are_read_as_fixed_epoch(job, tmp_path):
    """A version-3 file (no open_ended/window attributes) still loads and trains its epochs."""
    _, fixed_path, _ = job
    old = str(tmp_path / "v3.h5")
    shutil.copy(fixed_path, old)
    with h5py.File(old, "r+") as f:
        del f.attrs["open_ended"], f.attrs["window"]
        f.attrs["version"] = 3
        f.attrs["header_sha256"] = np.array(header_digest(f.attrs, 3).encode(), dtype="S64")
    with SolarLoader(old, rank=0, as_torch=False, reader="pread") as a, \
            SolarLoader(fixed_path, rank=0, as_torch=False, reader="pread") as b:
        assert a.schedule.version == 3 and not a.open_ended and a.epochs == EPOCHS + 1
        assert_same(run_epochs(a, [EPOCHS])[0], run_epochs(b, [EPOCHS])[0])


@pytest.mark.parametrize("step", [10**12, 2**70])
def test_absurd_state_step_is_refused_before_planning_to_it(job, step):
    """Issue 26: an open-ended loader accepted any step and then planned every window up to it in the training
    thread, for ever (2**70 is an epoch DistributedSampler cannot even seed).  Refused, naming step and limit."""
    open_path, _, _ = job
    with SolarLoader(open_path, rank=0, as_torch=False, reader="pread") as a:
        state = a.state_dict()
        state["step"] = step
        with pytest.raises(SpecError) as info:
            a.load_state_dict(state)
        msg = str(info.value)
        assert f"step {step} is in epoch {step // a.S}" in msg and "1,000,000 epochs" in msg and "\n" not in msg
        assert ("64 bits" in msg) == (step == 2**70)
        assert a.cursor == 0 and a.windows.planned == 1  # nothing moved, nothing planned
        with pytest.raises(SpecError, match="epoch 1000000, beyond the 1,000,000 epochs"):
            a.set_epoch(10**6)
        state["step"] = 3 * K * a.S  # a step a job can reach is still accepted (window 3)
        a.load_state_dict(state)
        assert a.epoch == 3 * K


@pytest.mark.parametrize("opts, needle", [
    (["--epochs", "forever"], "--epochs: must be a positive integer or 'auto', got 'forever'"),
    (["--epochs", "0"], "--epochs: must be a positive integer or 'auto', got '0'"),
    (["--epochs", "auto", "--window", "0"], "--window: must be a positive integer, got '0'"),
    (["--epochs", "auto", "--window", "x"], "--window: not an integer: 'x'"),
    (["--epochs", "4", "--window", "3"], "--window 3 needs --epochs auto"),
    (["--epochs", "auto", "--policy", "nopfs"], "policy 'nopfs' looks at every epoch ahead"),
    # issue 26: a TypeError traceback (10**20), 8 GB before planning began (2**31), the same with --epochs
    (["--epochs", "auto", "--window", str(10**20)], "--window: must be at most 1,000,000 epochs"),
    (["--epochs", "auto", "--window", str(2**31)], "--window: must be at most 1,000,000 epochs"),
    (["--epochs", str(2**31)], "--epochs: must be at most 1,000,000 epochs"),
])
def test_bad_epochs_and_window_give_one_line(job, tmp_path, capsys, opts, needle):
    _, _, data = job
    out = tmp_path / "p.h5"
    try:
        rc = main(["plan", data, "-P", "2", "-b", "3", "--buffer-fraction", "0.3", *opts, "-o", str(out)])
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("solar plan: error:")]
    assert len(lines) == 1 and needle in lines[0], err
    assert not out.exists()


@pytest.mark.parametrize("kw, needle", [
    (dict(epochs="forever"), "epochs must be a positive integer or 'auto' (open-ended), got 'forever'"),
    (dict(epochs="auto", window=0), "window must be a positive integer (epochs planned at a time), got 0"),
    (dict(epochs="auto", window=2.5), "got 2.5"),
    (dict(epochs=3, window=2), "window=2 needs epochs='auto'"),
    (dict(epochs="auto", window=10**20), "window must be at most 1,000,000 (solar.scheduler.config.MAX_EPOCHS"),
    (dict(epochs=2**31), "epochs must be at most 1,000,000 (solar.scheduler.config.MAX_EPOCHS"),
])
def test_bad_epochs_and_window_in_the_api(job, kw, needle):
    _, _, data = job
    with pytest.raises(SpecError) as info:
        solar.plan(data, world_size=2, local_batch=3, buffer_fraction=0.3, **kw)
    assert needle in str(info.value) and "\n" not in str(info.value)


@pytest.mark.mpi
def test_ranks_extend_consistently_with_distributed_sampler(comm, shared_tmp):
    """Each rank plans windows 1 and 2 on its own; together their batches are DistributedSampler's."""
    plan = os.path.join(shared_tmp, "open.h5")
    if comm.rank == 0:
        data = make_dataset(shared_tmp, "ptychonn", samples=40)
        solar.plan(data, world_size=P, local_batch=B, epochs="auto", window=K, buffer_fraction=0.3, out=plan).close()
    comm.Barrier()
    mine = [comm.rank] if comm.size == P else list(range(P))
    got = {}
    for r in mine:
        opts = dict(comm=comm) if comm.size == P else dict(rank=r)
        with SolarLoader(plan, as_torch=False, reader="pread", **opts) as loader:
            got[r] = {k: v["index"] for k, v in run_epochs(loader, range(EPOCHS))[0].items()}
            S, n = loader.S, loader.schedule.n_samples
    if comm.size == P:
        got = dict(enumerate(comm.allgather(got[comm.rank])))
    _, total = sampler_sizes(n, P, False)
    bounds = batch_bounds(total, P, B)
    for e in range(K, EPOCHS):  # beyond the file's window
        idx = epoch_indices(n, P, 0, e, False)
        for s in range(S):
            together = np.sort(np.concatenate([got[r][(e, s)] for r in range(P)]))
            assert np.array_equal(together, np.sort(idx[bounds[s]:bounds[s + 1]])), (e, s)
