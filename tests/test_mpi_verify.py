"""MPI: the data is checked against the stored layout by one rank and a mismatch raises the same
ScheduleError on every rank (none hangs); the others make no stat of the data files.

Written once, run serially and under ``mpiexec -n 2 python -m pytest -m mpi``.
"""
import os

import pytest
from conftest import on_root
from helpers import assert_same_sample, h5py_sample, make_dataset

import solar
from solar.errors import SolarError
from solar.layout import load_layout
from solar.loader import SolarLoader
from solar.mpi import leader_call
from solar.schedule import ScheduleError

pytestmark = pytest.mark.mpi


def make_job(comm, root):
    """On rank 0: a 4-file dataset and a plan for this communicator's size; returns (plan, data)."""
    def make():
        data = make_dataset(root, "cosmoflow", "contiguous", samples=4)
        plan = os.path.join(root, "plan.h5")
        solar.plan(data, world_size=comm.size, local_batch=1, epochs=1, buffer_per_rank="64MiB", out=plan).close()
        return plan, data
    return on_root(comm, make)


def count_data_stats(monkeypatch, files):
    """A list that grows by one at each ``os.stat`` of one of ``files``."""
    calls, real, files = [], os.stat, set(files)

    def stat(path, *a, **k):
        if path in files:
            calls.append(path)
        return real(path, *a, **k)
    monkeypatch.setattr(os, "stat", stat)
    return calls


@pytest.mark.parametrize("scope", ["job", "node"])
def test_good_data_checked_by_one_rank_and_batches_equal_h5py(comm, shared_tmp, monkeypatch, scope):
    plan, data = make_job(comm, shared_tmp)
    ref = load_layout(data)
    stats = count_data_stats(monkeypatch, ref.files)
    with SolarLoader(plan, comm=comm, reader="pread", as_torch=False, verify_scope=scope) as loader:
        checked = len(stats)
        loader.set_epoch(0)
        for batch in loader:
            for i, s in enumerate(batch["index"]):
                want = h5py_sample(ref, int(s))
                assert_same_sample({k: batch[k][i] for k in want}, want)
    assert comm.allgather(checked) == [len(ref.files)] + [0] * (comm.size - 1)  # one node: one checker


@pytest.mark.parametrize("scope", ["job", "node"])
def test_changed_file_raises_the_same_error_on_every_rank(comm, shared_tmp, scope):
    plan, data = make_job(comm, shared_tmp)
    victim = sorted(load_layout(data).files)[2]
    on_root(comm, lambda: os.utime(victim, ns=(0, 10**18)))
    with pytest.raises(ScheduleError) as err:
        SolarLoader(plan, comm=comm, abort_on_error=False, verify_scope=scope)
    msgs = comm.allgather(str(err.value))
    assert len(set(msgs)) == 1 and f"data file {victim} was modified since planning" in msgs[0]


def test_a_leader_crash_is_a_solar_error_on_the_others(comm):
    def fail():
        raise ValueError("bad value 42")
    with pytest.raises((ValueError, SolarError)) as err:
        leader_call(comm, fail)
    if comm.rank == 0:
        assert type(err.value) is ValueError
    else:
        assert type(err.value) is SolarError and str(err.value) == "ValueError on rank 0: bad value 42"
    leader_call(comm, lambda: None)  # and the communicator is still usable


@pytest.mark.parametrize("where", ["_read_layout", "rank_memory"])
def test_a_start_up_error_on_one_rank_is_raised_on_every_rank(comm, shared_tmp, monkeypatch, where):
    """Review finding: a step each rank runs on its own (reading the stored layout: the data folder missing
    on one node; one rank's plan over its memory limit) failed on the last rank only, the caller caught it,
    and the other ranks waited forever in the next collective (the data check, an MPI reader's opens)."""
    from solar.loader import loader as mod
    plan, _ = make_job(comm, shared_tmp)
    real = getattr(mod, where)

    def fails_on_last_rank(*a, **k):
        if comm.rank == comm.size - 1:
            raise ScheduleError("data folder missing on this node")
        return real(*a, **k)
    monkeypatch.setattr(mod, where, fails_on_last_rank)
    with pytest.raises(SolarError, match="data folder missing on this node"):
        SolarLoader(plan, comm=comm, reader="pread", abort_on_error=False)
    comm.Barrier()  # every rank got here: none is left in a collective
