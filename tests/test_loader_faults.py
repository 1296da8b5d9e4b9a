"""SolarLoader's arguments and state dicts are checked (one-line SpecError naming the value),
and the documented epoch loop resumes exactly after load_state_dict."""
import numpy as np
import pytest

import solar
from solar.loader import SolarLoader

from helpers import make_dataset


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    data = make_dataset(root, "ptychonn", "chunked", samples=30)
    path = str(root / "plan.h5")
    solar.plan(data, world_size=2, local_batch=3, epochs=3, buffer_fraction=0.4, out=path).close()
    return path, data


class Comm:
    def __init__(self, size, rank):
        self.size, self.rank = size, rank

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return self.rank

    def allgather(self, x):  # one process plays every rank: all of them agree with it
        return [x] * self.size

    def bcast(self, x, root=0):
        return x


@pytest.mark.parametrize("rank,msg", [
    (1.0, "rank must be an integer, got 1.0"), (True, "rank must be an integer, got True"),
    ("1", "rank must be an integer, got '1'"), (2, "rank 2 out of range: the job has ranks 0..1"),
    (-1, "rank -1 out of range"),
])
def test_bad_rank_is_one_line_spec_error(job, rank, msg):
    with pytest.raises(solar.SpecError, match=msg):
        SolarLoader(*job, rank=rank)


def test_numpy_rank_and_agreeing_comm(job):
    with SolarLoader(*job, rank=np.int64(1)) as a:
        assert a.rank == 1 and type(a.rank) is int
    with pytest.raises(solar.SpecError, match="rank=0 disagrees with the communicator, whose rank is 1"):
        SolarLoader(*job, comm=Comm(2, 1), rank=0, abort_on_error=False)
    with SolarLoader(*job, comm=Comm(2, 1), rank=1, abort_on_error=False) as b:
        assert b.rank == 1


@pytest.mark.parametrize("change,msg", [
    (lambda s: s.pop("step"), "loader state lacks 'step'"),
    (lambda s: s.pop("fingerprint"), "loader state lacks 'fingerprint'"),
    (lambda s: s.update(step=3.7), "step must be an integer, got 3.7"),
    (lambda s: s.update(step="3"), "step must be an integer, got '3'"),
    (lambda s: s.update(step=True), "step must be an integer, got True"),
])
def test_bad_state_dict_is_one_line_spec_error(job, change, msg):
    with SolarLoader(*job, rank=0) as loader:
        state = loader.state_dict()
        change(state)
        with pytest.raises(solar.SpecError, match=msg):
            loader.load_state_dict(state)
        with pytest.raises(solar.SpecError, match="must be a dict"):
            loader.load_state_dict([("step", 1)])
        state = loader.state_dict()
        state["step"] = np.int64(4)
        loader.load_state_dict(state)
        assert loader.cursor == 4


def documented_loop(loader):
    """The loop of SolarLoader's docstring: every batch it yields."""
    out = []
    for e in range(loader.epoch, loader.epochs):
        loader.set_epoch(e)
        out.extend(loader)
    return out


@pytest.mark.parametrize("stop", [4, 5, 12])  # mid-epoch 0, start of epoch 1, mid-epoch 2
def test_documented_loop_resumes_exactly(job, stop):
    with SolarLoader(*job, rank=1, as_torch=False) as full:
        ref = documented_loop(full)
    with SolarLoader(*job, rank=1, as_torch=False) as a:
        first = []
        for e in range(a.epochs):
            a.set_epoch(e)
            for batch in a:
                first.append(batch)
                if len(first) == stop:
                    break
            if len(first) == stop:
                break
        state = a.state_dict()
    with SolarLoader(*job, rank=1, as_torch=False) as b:
        b.load_state_dict(state)
        rest = documented_loop(b)
        assert b.stats()["plan_violations"] == 0
    got = first + rest
    assert len(got) == len(ref) == 3 * b.S
    for x, y in zip(got, ref):
        assert np.array_equal(x["index"], y["index"])
        for k in y:
            if isinstance(y[k], np.ndarray):
                np.testing.assert_array_equal(x[k], y[k])


def test_set_epoch_mid_epoch_keeps_cursor_other_epoch_seeks(job):
    with SolarLoader(*job, rank=0, as_torch=False) as loader:
        state = loader.state_dict()
        state["step"] = loader.S + 2  # inside epoch 1
        loader.load_state_dict(state)
        loader.set_epoch(1)
        assert loader.cursor == loader.S + 2
        loader.set_epoch(2)
        assert loader.cursor == 2 * loader.S
        loader.set_epoch(0)
        assert loader.cursor == 0
        with pytest.raises(solar.SpecError, match=r"epoch 1.5 out of range"):
            loader.set_epoch(1.5)


def test_book_wait_is_zero_when_every_block_stays_resident(tmp_path):
    """``book_wait_s``: time a step waited for its place to have room.  A plan that keeps every block never
    evicts, so no step waits; one that must evict counts a time >= 0 that the totals sum exactly."""
    data = make_dataset(tmp_path, "ptychonn", "chunked", samples=40)
    for f, zero in ((1.0, True), (0.3, False)):
        path = str(tmp_path / f"plan-{f}.h5")
        solar.plan(data, world_size=1, local_batch=4, epochs=2, buffer_fraction=f, out=path).close()
        with SolarLoader(path, data, rank=0) as loader:
            for e in loader.epoch_range():
                loader.set_epoch(e)
                for _ in loader:
                    pass
            st = loader.stats()
            per = [s.book_wait_s for s in loader.buffer.totals.per_step]
        assert len(per) == st["steps"] == 2 * 10  # every step's stats kept (KEEP_STEP_STATS) for the sum below
        assert st["book_wait_s"] >= 0.0 and all(w >= 0.0 for w in per)
        assert st["book_wait_s"] == pytest.approx(sum(per))
        if zero:
            assert st["book_wait_s"] == 0.0
