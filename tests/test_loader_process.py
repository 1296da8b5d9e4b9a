"""``SolarLoader(process=True)``: the buffer, reader and assembly in a loader process of their own.

The batches equal the in-process loader's bit for bit (epochs, a seek, a resume, an open-ended plan's
window edge, a transform run in the training process), batches the training loop keeps are never
overwritten, an error in the loader process is raised where the step is taken (its own class), a killed
loader process is an error naming the signal (no hang), and what cannot run in a process is a one-line
SpecError.  ``mpi``: each rank of ``mpiexec -n 2`` runs its own loader process beside the communicator.
"""
import contextlib
import os
import signal
import time

import numpy as np
import pytest

import solar
import solar.memory as mem
from solar.loader import SolarLoader

from conftest import on_root
from helpers import make_dataset, h5py_sample
from solar.layout import load_layout


def _same(a: dict, b: dict):
    assert set(a) == set(b)
    for k in b:
        if k == "weight":
            assert a[k] == b[k]
        else:
            assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k


def _compare(a, b, epochs):
    """Epochs 0..epochs-1 of loaders ``a`` and ``b``: the same batches."""
    for e in range(epochs):
        a.set_epoch(e)
        b.set_epoch(e)
        for x, y in zip(a, b):
            _same(x, y)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("proc")
    data = make_dataset(root, "ptychonn", "chunked", samples=40)
    path = str(root / "plan.h5")
    solar.plan(data, world_size=2, local_batch=3, epochs=3, buffer_fraction=0.4, out=path).close()
    return path, data


def test_batches_equal_the_in_process_loaders_and_kept_ones_stay(job):
    kept, copies = [], []
    with SolarLoader(*job, rank=1, process=True) as a, SolarLoader(*job, rank=1) as b:
        assert a.reader is None and a._proc.proc.poll() is None
        for e in range(3):
            a.set_epoch(e)
            b.set_epoch(e)
            n = 0
            for x, y in zip(a, b):
                _same(x, y)
                n += 1
                if n % 2:  # the training loop keeps every other batch: their segments must not be reused
                    kept.append(x)
                    copies.append({k: v.clone() if hasattr(v, "clone") else v for k, v in x.items()})
            assert n == len(b)
        st, ref = a.stats(), b.stats()
        for k in ("steps", "samples", "hits", "misses", "bytes_loaded", "stored_bytes", "plan_violations"):
            assert st[k] == ref[k], k
        assert st["opens"] >= 1
        child = a._proc.proc
    assert child.returncode == 0  # closed with the loader
    for x, c in zip(kept, copies):
        _same(x, c)
    layout = load_layout(job[1])
    for x in kept[:3]:
        i = int(x["index"][0])
        want = h5py_sample(layout, i)
        for k, v in want.items():
            assert np.array_equal(x[k][0].numpy(), v), k


def test_seek_and_resume_give_the_same_steps(job):
    with SolarLoader(*job, rank=0, process=True) as a, SolarLoader(*job, rank=0) as b:
        a.set_epoch(1)
        b.set_epoch(1)
        for _, (x, y) in zip(range(3), zip(a, b)):  # part of epoch 1, then a seek back to epoch 0
            _same(x, y)
        state = a.state_dict()
        a.set_epoch(0)
        b.set_epoch(0)
        for x, y in zip(a, b):
            _same(x, y)
    with SolarLoader(*job, rank=0, process=True) as a, SolarLoader(*job, rank=0) as b:
        a.load_state_dict(state)
        b.load_state_dict(state)
        for e in a.epoch_range():
            a.set_epoch(e)
            b.set_epoch(e)
            got = list(zip(a, b))
            assert got
            for x, y in got:
                _same(x, y)


def test_an_open_ended_plan_crosses_its_window_edge(tmp_path):
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=24)
    path = str(tmp_path / "auto.h5")
    solar.plan(data, world_size=1, local_batch=4, epochs="auto", window=1, buffer_fraction=0.5, out=path).close()
    with SolarLoader(path, rank=0, process=True) as a, SolarLoader(path, rank=0) as b:
        _compare(a, b, 3)  # three windows of one epoch


def test_a_transform_runs_in_the_training_process(job):
    seen = []

    def add_one(batch):  # a closure: the loader process could not unpickle it
        seen.append(os.getpid())
        batch["X_train"] = batch["X_train"] + 1
        return batch

    with SolarLoader(*job, rank=0, process=True, transform=add_one) as a, SolarLoader(*job, rank=0) as b:
        for x, y in zip(a, b):
            assert np.array_equal(x["X_train"].numpy(), y["X_train"].numpy() + 1)
            assert np.array_equal(x["index"], y["index"])
    assert seen and set(seen) == {os.getpid()}


def test_the_device_copy_runs_on_the_received_batches(job):
    """``device=`` (the CPU standing in for a GPU): the copy is staged in the training process's receiving
    thread, and the batches are the plain loader's."""
    with SolarLoader(*job, rank=1, process=True, device="cpu") as a, SolarLoader(*job, rank=1) as b:
        _compare(a, b, 2)


def test_a_read_error_in_the_loader_process_is_raised_as_in_process(tmp_path):
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=24)
    path = str(tmp_path / "plan.h5")
    solar.plan(data, world_size=1, local_batch=4, epochs=1, buffer_fraction=0.5, out=path).close()
    import shutil
    f = load_layout(data).files[0]
    shutil.copy2(f, f + ".orig")
    errors = []
    for process in (False, True):
        with SolarLoader(path, rank=0, process=process, reader="pread") as a:
            os.truncate(f, 4096)  # after the data check: the reads fail
            with pytest.raises(solar.SolarError) as info:
                for _ in a:
                    pass
            errors.append(info.value)
        shutil.copy2(f + ".orig", f)  # the file as planned again (size and mtime)
    assert type(errors[1]) is type(errors[0])
    assert str(errors[1]).split(":")[0] == str(errors[0]).split(":")[0]
    assert "in the loader process of rank 0" in str(errors[1].__cause__)


def test_a_killed_loader_process_is_an_error_not_a_hang(job):
    from solar.loader.process import LoaderProcessError
    with SolarLoader(*job, rank=0, process=True) as a:
        it = iter(a)
        next(it)
        os.kill(a.process_pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(LoaderProcessError, match="loader process of rank 0 was killed by signal 9"):
            for _ in it:
                pass
        assert time.monotonic() - t0 < 30


def test_a_process_forked_while_a_batch_is_held_never_reads_later_batches_in_it(job):
    """The loader reuses a batch's shared segment once the training process drops the batch.  A process forked
    from it while it held the batch (os.fork) must not see later batches' bytes there: the segments are not
    inherited (MADV_DONTFORK), so reading the batch there faults (before: it read whatever batch the loader had
    put there since, with no error).  The forked process reports what it read through a pipe."""
    with SolarLoader(*job, rank=0, process=True) as a:
        it = iter(a)
        x = next(it)
        copy = x["X_train"].numpy().copy()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the forked process: waits until the loader has reused the segment, then reads the batch
            import faulthandler
            faulthandler.disable()  # (the fault expected: no traceback of it in the test's output)
            os.close(r)
            time.sleep(1.0)
            same = np.array_equal(x["X_train"].numpy(), copy)
            os.write(w, b"same" if same else b"changed")
            os._exit(0)
        os.close(w)
        del x, it
        for e in range(3):
            a.set_epoch(e)
            for _ in a:
                pass
        got = os.read(r, 16)
        os.close(r)
        _, status = os.waitpid(pid, 0)
    assert got != b"changed"
    assert got == b"" and os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGSEGV, signal.SIGBUS), \
        (got, status)


def test_a_bad_child_argument_is_raised_at_construction(job):
    with pytest.raises(solar.SpecError, match="bogus"):
        SolarLoader(*job, rank=0, process=True, reader_options={"bogus": 1})


@pytest.mark.parametrize("kw,msg", [
    (dict(process="yes"), "process must be True or False, got 'yes'"),
    (dict(process=True, reader="mpiio"), r"process=True cannot be used with reader='mpiio'"),
    (dict(process=True, buffer_device="cpu"), r"process=True cannot be used with buffer_device="),
    (dict(process=True, pin_memory=True), r"process=True cannot be used with pin_memory=True"),
    (dict(process=True, reader_options={"hook": lambda: 1}), r"process=True sends the loader's arguments"),
])
def test_what_cannot_run_in_a_process_is_a_spec_error(job, kw, msg):
    with pytest.raises(solar.SpecError, match=msg):
        SolarLoader(*job, rank=0, **kw)


def test_a_node_plan_and_a_plan_in_memory_are_refused_in_a_process(job):
    from solar.loader.loader import _check_process
    sched = type("S", (), {"path": job[0]})()
    with pytest.raises(solar.SpecError, match="node plan"):
        _check_process(sched, object(), None, None)
    plan = solar.plan(job[1], world_size=1, local_batch=3, epochs=1, buffer_fraction=0.4)  # no out=: in memory
    with pytest.raises(solar.SpecError, match="process=True cannot be used with a schedule that is not in a file"):
        SolarLoader(plan, job[1], rank=0, process=True)


@pytest.mark.mpi
def test_each_rank_runs_its_own_loader_process(comm, shared_tmp):
    data = on_root(comm, lambda: make_dataset(shared_tmp, "ptychonn", "contiguous", samples=32))
    path = os.path.join(shared_tmp, "plan.h5")
    if comm.rank == 0:
        solar.plan(data, world_size=comm.size, local_batch=4, epochs=2, buffer_fraction=0.5, out=path).close()
    comm.Barrier()
    with SolarLoader(path, comm=comm, process=True) as a, SolarLoader(path, comm=comm) as b:
        _compare(a, b, 2)


def test_bench_runs_solar_in_loader_processes(tmp_path):
    """``solar bench --loader-process`` runs, reads and checks the delivered samples against h5py as always."""
    import json
    import subprocess
    import sys
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=32)
    r = subprocess.run([sys.executable, "-m", "solar", "bench", data, "--epochs", "2", "--only", "solar", "-b", "4",
                        "--buffer-fraction", "0.5", "--loader-process", "--json", "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)["solar"]
    e0 = rep["epochs"][0]
    assert e0["verified"] > 0 and e0["plan_violations"] == 0
    assert e0["block_misses"] > 0 and e0["storage_bytes"] > 0
    assert rep["epochs"][1]["global_samples"] == 32


@pytest.mark.parametrize("prefetch", [1, 2])
def test_segments_are_the_in_process_loaders_batches_and_dropped_ones_are_unmapped(job, prefetch):
    """A loop that keeps nothing uses prefetch + 2 segments: the in-process loader's batches alive at its peak
    (prefetch waiting, the one handed out, the one before it until the loop lets it go).  Batches kept and then
    dropped do not hold their memory: the free segments beyond prefetch + 2 are unmapped on both sides."""
    import gc
    with SolarLoader(*job, rank=0, process=True, prefetch=prefetch) as a:
        for e in range(2):
            a.set_epoch(e)
            for _ in a:
                pass
        assert len(a._proc.maps) <= mem.live_batches(prefetch)
        a.set_epoch(2)
        kept = list(a)
        assert len(a._proc.maps) >= len(kept) > mem.live_batches(prefetch)
        del kept
        gc.collect()
        a.set_epoch(0)
        for _ in a:
            pass
        assert len(a._proc.maps) <= 2 * mem.live_batches(prefetch)


def test_a_failure_on_the_receiving_side_is_an_error_not_a_hang(job, monkeypatch):
    from solar.loader.process import LoaderProcess, LoaderProcessError

    def broken(self, msg):
        raise RuntimeError("injected")

    monkeypatch.setattr(LoaderProcess, "_batch", broken)
    with SolarLoader(*job, rank=0, process=True) as a:
        t0 = time.monotonic()
        with pytest.raises(LoaderProcessError, match="failed: RuntimeError: injected"):
            next(iter(a))
        assert time.monotonic() - t0 < 30
        child = a._proc.proc
    assert child.poll() is not None  # ended with the loader


FORKED = """
import os, sys, time
sys.path.insert(0, {tests!r})
from solar.loader import SolarLoader
a = SolarLoader({plan!r}, {data!r}, rank=0, process=True)
next(iter(a))
helper = os.fork()
if helper == 0:  # a forked helper (a DataLoader worker) keeps the socket open, not the test's pipes
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    time.sleep(30)
    os._exit(0)
print(a.process_pid, helper, flush=True)
os._exit(0)  # the training process dies without closing anything
"""


def test_the_loader_process_ends_when_the_training_process_dies_even_if_it_forked(job):
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", FORKED.format(tests=here, plan=job[0], data=job[1])],
                       capture_output=True, text=True, timeout=120)
    pid, helper = map(int, r.stdout.split()[:2])  # returns at once: the helper holds none of the test's pipes
    def running(p=pid):  # a zombie (ended, not reaped yet: its new parent may be slow to) counts as ended
        try:
            with open(f"/proc/{p}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 20:
            if not running():
                break
            time.sleep(0.2)
        else:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the loader process outlived the training process")
        assert running(helper)  # the helper still holds the socket: the loader process did not wait for it
    finally:
        with contextlib.suppress(OSError):
            os.kill(helper, signal.SIGKILL)


@pytest.mark.parametrize("prefetch", [2, 3])
def test_the_loader_process_sizes_its_pools_as_the_in_process_loader(tmp_path, prefetch):
    """The child runs one batch fewer waiting, yet as many batches are alive as in-process: its pools are sized for
    the training process's prefetch (were one batch larger at prefetch 3, over the plan's limit)."""
    from unittest import mock

    import solar.memory.budget
    data = make_dataset(tmp_path, "ptychonn", "contiguous")
    layout = load_layout(data)
    n = int(layout.block_nbytes.sum())
    keep = mem.bookkeeping_bytes(layout.n_samples, layout.block_nbytes.shape[0], layout.sample_blocks.shape[0])
    path = str(tmp_path / "plan.h5")
    with mock.patch.object(solar.memory.budget, "PLAN_ALLOWANCE", 0):  # a budget the pools fill
        solar.plan(layout, world_size=2, local_batch=2, epochs=1, out=path,
                   buffer_per_rank=int(0.6 * n / 2) + mem.reserve_bytes(mem.batch_bytes(layout, 2), keep)).close()
    pools = {}
    for proc in (False, True):
        with SolarLoader(path, layout, rank=0, prefetch=prefetch, reader="pread", process=proc) as ld:
            next(iter(ld))
            pools[proc] = ld.buffer.pools.capacity_bytes
            assert pools[proc] == ld.memory.pools and ld.memory.fits
    assert pools[True] == pools[False]


def test_the_bench_counts_shared_batch_memory_once():
    """``solar bench --loader-process`` adds the loader process's RSS to the training process's without its shared
    memory (the batch segments, which the training process maps and counts too)."""
    import mmap

    from solar.bench.solar_run import rss_bytes
    seg = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)  # shmem, as a memfd segment
    seg.write(b"\1" * (64 << 20))  # faulted in
    full, private = rss_bytes(), rss_bytes(shmem=False)
    assert full - private >= 64 << 20 and private > 0
    seg.close()
