"""Buffer manager and loader: deliver exactly h5py's samples in the planned order, follow
the plan (no violation, no over-budget pools), resume from a state dict, fail clearly."""
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import solar
from solar.loader import SolarLoader
from solar.memory import size_classes, slots_needed
from solar.schedule import RankPlan, Schedule, ScheduleError
from solar.scheduler import Demand

from helpers import STORAGES, h5py_sample, make_dataset

PRESET_STORAGES = [("ptychonn", s) for s in STORAGES] + [("well", "contiguous"), ("well", "gzip"),
                                                          ("pdebench", "lzf"), ("cosmoflow", "chunked")]


def check_batch(layout, batch):
    for i, s in enumerate(np.asarray(batch["index"]).tolist()):
        ref = h5py_sample(layout, s)
        for k, v in ref.items():
            got = batch[k][i]
            got = got.numpy() if hasattr(got, "numpy") else got
            assert got.shape == v.shape and got.dtype == v.dtype, k
            np.testing.assert_array_equal(got, v, err_msg=f"sample {s} field {k}")


@pytest.mark.parametrize("preset,storage", PRESET_STORAGES)
def test_loader_delivers_h5py_samples(tmp_path, preset, storage):
    data = make_dataset(tmp_path, preset, storage)
    layout = solar.load_layout(data)
    path = str(tmp_path / "plan.h5")
    # a buffer that holds half of the dataset, or at least what two steps need (multi-sample chunks)
    per_sample = layout.per_sample_sum(layout.block_nbytes)
    budget = max(int(0.5 * layout.block_nbytes.sum() / 2), 4 * int(per_sample.max()))
    sched = solar.plan(layout, world_size=2, local_batch=2, epochs=2, buffer_per_rank=budget, out=path)
    for r in range(2):
        with SolarLoader(path, layout, rank=r, prefetch=2) as loader:
            got = []
            for e in range(2):
                loader.set_epoch(e)
                for step, batch in enumerate(loader):
                    assert np.array_equal(np.asarray(batch["index"]), sched.batch(e, step, r))
                    check_batch(layout, batch)
                    got.append(batch["weight"])
            st_ = loader.stats()
            assert st_["plan_violations"] == 0 and len(got) == 2 * sched.steps_per_epoch
            pred = sched.rank(r).predicted()
            assert st_["misses"] == pred["misses"] and st_["bytes_loaded"] == pred["miss_bytes"]
            assert st_["hits"] == pred["hits"]
            # pools: the budget, plus the evictions held while io_depth - 1 later steps' reads are in flight
            rp = sched.rank(r)
            ev = np.array([layout.block_nbytes[rp.step(g).evict].sum() for g in range(rp.n_steps)])
            W = loader.buffer.io_depth - 1
            held = max((ev[max(0, p - W + 1):p + 1].sum() for p in range(len(ev))), default=0) if W else 0
            assert loader.buffer.pools.capacity_bytes <= sched.buffer_bytes + held + max(layout.block_nbytes) * 4
    sched.close()


def test_pools_within_budget_one_size(tmp_path):
    d = Demand.synthetic(400, 1000)
    s = solar.plan(d, world_size=4, local_batch=5, epochs=3, buffer_fraction=0.3)
    class_of, sizes = size_classes(d.block_nbytes)
    for r in range(4):
        rp = s.rank(r)
        slots = slots_needed(class_of, sizes.shape[0], rp.load.astype(np.int64), rp.load_ptr,
                             rp.evict.astype(np.int64), rp.evict_ptr)
        assert int((slots * sizes).sum()) <= s.buffer_bytes


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=200))
def test_size_classes_cover_every_block(sizes):
    nb = np.array(sizes, dtype=np.int64)
    class_of, cls = size_classes(nb)
    assert (cls[class_of] >= nb).all() and (cls[class_of] < 2 * nb).all()
    if len(set(sizes)) <= 32:
        assert (cls[class_of] == nb).all()


def test_plan_violation_is_counted_and_data_stays_right(tmp_path):
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=12)
    layout = solar.load_layout(data)
    sched = solar.plan(layout, world_size=1, local_batch=4, epochs=1, buffer_fraction=1.5)
    rp = sched.rank(0)
    arrays = rp.arrays()
    arrays["load"] = arrays["load"][1:]  # drop the first load: the plan now calls that block a hit
    arrays["load_count"] = arrays["load_count"].copy()
    arrays["load_count"][0] -= 1
    loader = SolarLoader(sched, layout, rank=0)
    loader.rank_plan = RankPlan(0, arrays)
    batches = list(loader)
    assert loader.stats()["plan_violations"] >= 1
    for b in batches:
        check_batch(layout, b)


def test_resume_from_state_dict(tmp_path):
    data = make_dataset(tmp_path, "ptychonn", "chunked", samples=30)
    path = str(tmp_path / "plan.h5")
    solar.plan(data, world_size=2, local_batch=3, epochs=3, buffer_fraction=0.4, out=path).close()
    full = SolarLoader(path, data, rank=1, as_torch=False)
    ref = [b for e in range(3) for b in (full.set_epoch(e), list(full))[1]]
    full.close()
    a = SolarLoader(path, data, rank=1, as_torch=False)
    a.set_epoch(0)
    it = iter(a)
    first = [next(it) for _ in range(3)]
    state = a.state_dict()
    a.close()
    b = SolarLoader(path, data, rank=1, as_torch=False)
    b.load_state_dict(state)
    rest = list(b) + [x for e in (1, 2) for x in (b.set_epoch(e), list(b))[1]]
    got = first + rest
    assert len(got) == len(ref)
    for x, y in zip(got, ref):
        assert np.array_equal(x["index"], y["index"])
        for k in y:
            if isinstance(y[k], np.ndarray):
                np.testing.assert_array_equal(x[k], y[k])
    assert b.stats()["plan_violations"] == 0
    other = solar.plan(data, world_size=2, local_batch=3, epochs=3, buffer_fraction=0.4, seed=1)
    with pytest.raises(solar.SpecError, match="saved with another schedule"):
        SolarLoader(other, data, rank=0).load_state_dict(state)
    b.close()


def test_prepare_builds_the_buffer_and_reads_nothing_before_the_first_batch(tmp_path):
    """SolarLoader.prepare with the epoch fence: the buffer (pools, prefetch thread) is built, no block is
    read until the first batch is asked for, and the batches are those of a loader that was not prepared."""
    import time
    data = make_dataset(tmp_path, "ptychonn", "chunked", samples=30)
    path = str(tmp_path / "plan.h5")
    solar.plan(data, world_size=2, local_batch=3, epochs=2, buffer_fraction=0.4, out=path).close()
    with SolarLoader(path, data, rank=1, as_torch=False) as plain:
        ref = [b for e in range(2) for b in (plain.set_epoch(e), list(plain))[1]]
    with SolarLoader(path, data, rank=1, as_torch=False, epoch_fence=True) as loader:
        calls, real = [], loader.reader.read_blocks
        loader.reader.read_blocks = lambda blocks, out: calls.append(len(blocks)) or real(blocks, out)
        assert loader.prepare() >= 0 and loader.buffer is not None
        time.sleep(0.3)  # the prefetch thread had time to read, had it not been fenced
        assert calls == [] and loader.stats()["bytes_read"] == 0
        built = loader.buffer
        got = [b for e in range(2) for b in (loader.set_epoch(e), list(loader))[1]]
        loader.prepare()
        assert calls and loader.buffer is built  # built once, by prepare
    assert len(got) == len(ref)
    for x, y in zip(got, ref):
        assert x.keys() == y.keys()
        for k in y:
            if isinstance(y[k], np.ndarray):
                np.testing.assert_array_equal(x[k], y[k])


def test_bad_inputs(tmp_path):
    data = make_dataset(tmp_path, "ptychonn", "gzip", samples=12)
    path = str(tmp_path / "plan.h5")
    solar.plan(data, world_size=2, local_batch=2, epochs=1, buffer_fraction=2.0, out=path).close()
    with pytest.raises(ScheduleError, match="planned for world size 2, the job has 3"):
        SolarLoader(path, data, comm=type("C", (), {"Get_size": lambda s: 3, "Get_rank": lambda s: 0,
                                                     "allgather": lambda s, x: [x] * 3})())
    # corrupt one gzip chunk: the error names file, dataset and chunk, nothing is delivered
    layout = solar.load_layout(data)
    blk = int(np.flatnonzero(layout.block_offset >= 0)[0])
    fname = layout.files[layout.datasets[layout.block_dataset[blk]].file]
    st_ = os.stat(fname)
    with open(fname, "r+b") as f:
        f.seek(int(layout.block_offset[blk]) + 2)
        f.write(b"\xff" * 16)
    os.utime(fname, ns=(st_.st_atime_ns, st_.st_mtime_ns))  # same size and mtime: the fingerprint cannot tell
    with pytest.raises(solar.DecodeError, match=r"cannot decode chunk .* of .*ptychonn.*\.h5:/"):
        for r in range(2):
            with SolarLoader(path, data, rank=r) as loader:
                for _ in loader:
                    pass
    # a file changed after planning: fingerprint mismatch
    with open(fname, "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(ScheduleError, match="planned for another dataset"):
        SolarLoader(path, data, rank=0)


@pytest.mark.mpi
def test_ranks_together_train_on_global_batches(comm, shared_tmp):
    from conftest import on_root
    data = on_root(comm, lambda: make_dataset(shared_tmp, "ptychonn", "multi", samples=20))
    path = os.path.join(shared_tmp, "plan.h5")
    P = comm.size
    if comm.rank == 0:
        solar.plan(data, world_size=P, local_batch=3, epochs=2, buffer_fraction=1.0, out=path).close()
    comm.Barrier()
    layout = solar.load_layout(data)
    ref = Schedule.load(path)
    with SolarLoader(path, layout, comm=comm) as loader:
        for e in range(2):
            loader.set_epoch(e)
            for k, batch in enumerate(loader):
                check_batch(layout, batch)
                everyone = np.concatenate(comm.allgather(np.asarray(batch["index"])))
                planned = np.concatenate([ref.batch(e, k, r) for r in range(P)])
                assert sorted(everyone.tolist()) == sorted(planned.tolist())


def test_one_failing_rank_ends_the_job(tmp_path):
    """abort_on_error: rank 1 raises, rank 0 waits in a barrier; the job must end, not hang."""
    code = ("from mpi4py import MPI\nfrom solar.mpi import abort_on_error\nimport solar\n"
            "c = MPI.COMM_WORLD\nwith abort_on_error(c):\n"
            "    if c.rank == 1:\n        raise solar.SpecError('bad input on one rank')\n    c.Barrier()\n")
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    r = subprocess.run([mpiexec, "-n", "2", sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "error on rank 1: bad input on one rank" in r.stderr and "aborting all 2 ranks" in r.stderr
