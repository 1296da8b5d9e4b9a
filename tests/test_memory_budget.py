"""The buffer budget is the memory used (issue 13): planner and runtime account memory the same way
(solar.memory), batches and reads in flight counted inside the budget, checked before reading."""
import subprocess
import sys
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import solar
import solar.memory as mem
from solar.buffer import BufferError, rank_memory
from solar.errors import SpecError
from solar.schedule.memory import schedule_memory
from solar.loader import SolarLoader

from helpers import STORAGES, make_dataset

PRESETS = ("ptychonn", "well", "pdebench", "pdebench-mult", "cosmoflow")


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """Every preset x storage variant, small (helpers.make_dataset), with its layout."""
    root = tmp_path_factory.mktemp("memory")
    return {(p, s): solar.load_layout(make_dataset(root, p, s)) for p in PRESETS for s in STORAGES}


def _budget(layout, frac: float, b: int) -> int:
    """A per-rank budget of ``frac`` of the data (2 ranks) plus what its batches and bookkeeping take."""
    n = int(layout.block_nbytes.sum())
    keep = mem.bookkeeping_bytes(layout.n_samples, layout.block_nbytes.shape[0], layout.sample_blocks.shape[0])
    per_sample = mem.demand_batch_bytes(layout.sample_ptr, layout.sample_blocks, layout.block_nbytes, 1)
    return int(frac * n / 2) + mem.reserve_bytes(mem.batch_bytes(layout, 2 * b), keep) + 2 * b * per_sample


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from([(p, s) for p in PRESETS for s in STORAGES]), b=st.integers(1, 3),
       frac=st.floats(0.1, 1.3), eps=st.sampled_from([0.0, 0.5]), seed=st.integers(0, 3), parts=st.booleans())
def test_plans_of_random_configurations_fit_the_budget(datasets, case, b, frac, eps, seed, parts):
    """Replaying each rank's plan: pools + reads in flight + queued batches + bookkeeping <= the budget
    (no allowance on top here: the whole reserve is taken from the budget), pools <= 1.05 x budget; whole chunks
    too (parts=False), where fields chunked differently make blocks of several sizes."""
    layout = datasets[case]
    budget = _budget(layout, frac, b)
    with mock.patch.object(mem.budget, "PLAN_ALLOWANCE", 0):
        s = solar.plan(layout, world_size=2, local_batch=b, epochs=3, buffer_per_rank=budget, seed=seed,
                       epsilon=eps, parts=None if parts else False)
        for r in range(2):
            need = schedule_memory(s, r, layout)
            assert need.resident <= s.memory_budget, (case, r, need)  # per-class pools within the budget
            assert need.total <= need.limit <= budget, (case, r, need, budget)
            assert need.pools <= 1.05 * budget
    s.close()


def test_well_pools_hold_no_evictions_beyond_the_budget(tmp_path):
    """The Well (blocks of two sizes, many evictions per step): the pools were 1.6-1.7x the planner's
    budget (io_depth - 1 steps of evictions held on top); now the residency plus at most one batch."""
    layout = solar.load_layout(make_dataset(tmp_path, "well", samples=4, size=16, steps=30))  # 208 windows
    path = str(tmp_path / "plan.h5")
    solar.plan(layout, world_size=2, local_batch=4, epochs=3, buffer_fraction=0.5, out=path).close()
    for r in range(2):
        with SolarLoader(path, layout, rank=r, as_torch=False) as loader:
            bb = mem.batch_bytes(layout, 4)
            for e in range(3):
                loader.set_epoch(e)
                n = sum(len(batch["index"]) for batch in loader)
                assert n > 0
            assert loader.stats()["plan_violations"] == 0
            assert loader.buffer.pools.capacity_bytes <= loader.schedule.buffer_bytes + bb


def test_plan_takes_batches_from_the_budget(datasets):
    """solar.plan plans the residency for the budget minus the queued batches, reads in flight and bookkeeping."""
    layout = datasets[("ptychonn", "contiguous")]
    budget = _budget(layout, 0.5, 2)
    keep = mem.bookkeeping_bytes(layout.n_samples, layout.block_nbytes.shape[0], layout.sample_blocks.shape[0])
    with mock.patch.object(mem.budget, "PLAN_ALLOWANCE", 0):
        s = solar.plan(layout, world_size=2, local_batch=2, epochs=2, buffer_per_rank=budget)
        assert s.buffer_bytes == budget - mem.reserve_bytes(mem.batch_bytes(layout, 2), keep)
        with pytest.raises(SpecError, match=r"budget of 1000 B per rank leaves nothing for the buffer: "
                                            r"5 batches of 2 samples"):
            solar.plan(layout, world_size=2, local_batch=2, epochs=2, buffer_per_rank=1000)


def test_too_deep_prefetch_refused_before_reading(datasets, tmp_path):
    """A prefetch queue the plan has no room for: BufferError naming the figures and the prefetch that
    fits, at SolarLoader construction, before any block is read."""
    layout = datasets[("ptychonn", "contiguous")]
    path = str(tmp_path / "plan.h5")
    with mock.patch.object(mem.budget, "PLAN_ALLOWANCE", 0):
        solar.plan(layout, world_size=2, local_batch=2, epochs=2, buffer_per_rank=_budget(layout, 0.5, 2),
                   out=path).close()
    from solar.io.pread_reader import PreadReader
    with mock.patch.object(PreadReader, "read_blocks", side_effect=AssertionError("read")):
        with pytest.raises(BufferError, match=r"rank 0 needs .*: pools .* 40 \+ 2 batches .* lower prefetch to") as exc:
            SolarLoader(path, layout, rank=0, prefetch=40, reader="pread")
        best = int(str(exc.value).split("lower prefetch to ")[1].split()[0])
        assert 3 <= best < 40  # the plan holds 2 + 2 batches and 1 of reads: one more fits, taken from the reads
        SolarLoader(path, layout, rank=0, prefetch=best, reader="pread").close()
        with pytest.raises(BufferError):
            SolarLoader(path, layout, rank=0, prefetch=best + 1, reader="pread")


def test_rank_memory_counts_what_the_buffer_allocates(datasets, tmp_path):
    """The figures the buffer reports are the ones it allocates: pools = slots x slot sizes."""
    layout = datasets[("pdebench", "chunked")]
    s = solar.plan(layout, world_size=2, local_batch=2, epochs=2, buffer_per_rank=_budget(layout, 0.5, 2))
    bb = mem.batch_bytes(layout, 4)
    need, slots, class_of, class_bytes = rank_memory(s.rank(1), s.demand(), budget=s.buffer_bytes,
                                                     batch_bytes=bb, prefetch=2, io_depth=4)
    assert need.pools == int((slots * class_bytes).sum())
    assert need.batches == 4 * bb and need.total <= need.limit
    s.close()


def test_inspect_reports_memory_per_rank(datasets, tmp_path):
    layout = datasets[("well", "chunked")]
    path = str(tmp_path / "plan.h5")
    solar.plan(layout, world_size=2, local_batch=2, epochs=2, buffer_per_rank=_budget(layout, 0.5, 2),
               out=path).close()
    with solar.Schedule.load(path) as s:
        m = s.summary()["memory_per_rank"]
    assert m["total"] == m["resident"] + m["staging"] + m["batches"] + m["bookkeeping"] <= m["limit"]
    out = subprocess.run([sys.executable, "-m", "solar", "inspect", path], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "memory per rank:" in out.stdout and "2 + 2 batches" in out.stdout


def test_memory_of_every_rank_keeps_no_slice(tmp_path):
    """schedule_memory(keep=False) (what `solar inspect` runs over every rank) leaves no rank slice cached."""
    layout = solar.load_layout(make_dataset(tmp_path, "ptychonn"))
    with solar.plan(layout, world_size=2, local_batch=2, epochs=2, buffer_fraction=0.5) as s:
        schedule_memory(s, 1, layout, keep=False)
        assert not s._ranks
        schedule_memory(s, 1, layout)
        assert list(s._ranks) == [1]


def _two_sizes(tmp_path):
    """A file of two fields chunked differently (img: one sample a block; aux: gzip chunks of 3): whole chunks of
    two sizes whose resident counts peak at different steps."""
    import h5py
    import numpy as np
    from solar.layout.build import build_layout
    rng = np.random.default_rng(0)
    with h5py.File(tmp_path / "sc.h5", "w") as f:
        f.create_dataset("img", data=rng.standard_normal((600, 24, 24)).astype(np.float32))
        f.create_dataset("aux", data=rng.standard_normal((600, 5, 7)).astype(np.float32), chunks=(3, 5, 7),
                         compression="gzip")
    return build_layout(solar.LayoutSpec("rows", ("sc.h5",), ("img", "aux"), root=str(tmp_path)))


@pytest.mark.parametrize("frac, b, seed", [(0.1, 5, 0), (0.15, 7, 0), (0.2, 5, 1), (0.3, 7, 1)])
def test_open_ended_whole_chunks_of_several_sizes_fit_in_the_loader_s_next_windows(tmp_path, frac, b, seed):
    """An open-ended plan's later windows are planned by the loader with the file's residency: their pools must fit
    too (only window 0 was checked, and the loader refused window 1 mid-training)."""
    from solar.buffer.rank_place import rank_memory
    from solar.loader.extend import WindowPlanner
    layout = _two_sizes(tmp_path)
    with solar.plan(layout, world_size=2, local_batch=b, epochs="auto", window=1, buffer_fraction=frac, parts=False,
                    seed=seed, out=str(tmp_path / "oe.h5")) as s:
        d, bb = s.demand(), mem.batch_bytes(layout, mem.max_local_batch(s.config))
        for r in range(2):
            wp = WindowPlanner(s, r, s.rank(r))
            for w in range(4):
                rank_memory(wp.rank_plan(w), d, budget=s.memory_budget, batch_bytes=bb,
                            prefetch=mem.DEFAULT_PREFETCH, io_depth=mem.DEFAULT_IO_DEPTH)  # BufferError if over


def test_node_plans_of_several_sizes_fit_on_every_node(tmp_path):
    """The node furthest over its limit decides the slack (the one with the most memory in all, staging
    included, fitted while another was over)."""
    from solar.schedule.memory import schedule_node_memory
    layout = _two_sizes(tmp_path)
    for seed in range(3):
        with solar.plan(layout, world_size=4, local_batch=5, epochs=3, buffer_fraction=0.1, parts=False, seed=seed,
                        ranks_per_node=2, out=str(tmp_path / "node.h5")) as s:
            for n in range(2):
                assert schedule_node_memory(s, n, layout).fits, (seed, n)


def test_whole_chunks_of_several_sizes_are_planned_so_that_the_loader_runs_them(tmp_path):
    """Whole chunks (parts=False) of two fields chunked differently: the pools (slots per block size, each size's
    own peak) came to 2-35% over the plan's peak and the loader refused the plan solar.plan had made.  Now the plan
    holds that back from the residency (pool_slack_bytes), the loader runs it, and it delivers h5py's bytes."""
    import h5py
    import numpy as np
    from helpers import assert_same_sample, h5py_sample
    rng = np.random.default_rng(0)
    with h5py.File(tmp_path / "sc.h5", "w") as f:
        f.create_dataset("img", data=rng.standard_normal((600, 24, 24)).astype(np.float32))
        f.create_dataset("aux", data=rng.standard_normal((600, 5, 7)).astype(np.float32), chunks=(3, 5, 7),
                         compression="gzip")
    from solar.layout.build import build_layout
    layout = build_layout(solar.LayoutSpec("rows", ("sc.h5",), ("img", "aux"), root=str(tmp_path)))
    slack = []
    for frac in (0.1, 0.3):
        path = str(tmp_path / f"p{frac}.h5")
        with solar.plan(layout, world_size=2, local_batch=7, epochs=2, buffer_fraction=frac, parts=False,
                        out=path) as s:
            want = solar.plan(layout, world_size=2, local_batch=7, epochs=2, buffer_fraction=frac, parts=False)
            assert s.memory_budget == want.buffer_bytes + want.pool_slack_bytes  # the user's budget still
            want.close()
            slack.append(s.pool_slack_bytes)
            for r in range(2):
                need = schedule_memory(s, r, layout)
                assert need.total <= need.limit, (frac, r, need)
        with SolarLoader(path, layout, rank=1, as_torch=False) as ld:
            for e in range(2):
                ld.set_epoch(e)
                for batch in ld:
                    for i, j in enumerate(batch["index"].tolist()):
                        assert_same_sample({k: batch[k][i] for k in ("img", "aux")}, h5py_sample(layout, j))
    assert max(slack) > 0  # the case the fix is for did occur


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_the_batches_the_model_counts_are_the_batches_alive(datasets, tmp_path, prefetch):
    """At most :func:`solar.memory.live_batches` assembled batches are alive at once for a loop that keeps
    nothing: ``prefetch`` waiting, the one handed out and the one before it, which a ``for`` loop's variable holds
    while it asks for the next.  That moment is short in a ``for`` loop; held longer (the second loop), the loader
    fills its queue meanwhile and the count reaches the bound, so the model cannot count one batch fewer."""
    import threading
    import time
    import weakref

    import numpy as np
    layout = datasets[("ptychonn", "contiguous")]
    path = str(tmp_path / "plan.h5")
    solar.plan(layout, world_size=2, local_batch=1, epochs=2, buffer_fraction=0.5, out=path).close()
    lock, live, peak = threading.Lock(), [0], [0]

    def gone():
        with lock:
            live[0] -= 1

    def alloc(nbytes):
        a = np.empty(nbytes, np.uint8)
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        weakref.finalize(a, gone)
        return a

    with SolarLoader(path, layout, rank=0, prefetch=prefetch, reader="pread") as loader:
        loader.assembler.alloc = alloc
        loader.set_epoch(0)
        steps = 0
        for batch in loader:
            time.sleep(0.02)
            steps += 1
        assert steps >= 4 and peak[0] <= mem.live_batches(prefetch)
        del batch  # (the loop's variable: a batch kept)
        loader.set_epoch(1)
        it = iter(loader)
        before = next(it)
        for batch in it:
            time.sleep(0.1)  # the batch before still held: the loader fills its queue meanwhile
            before = batch
        del before, batch
    assert peak[0] == mem.live_batches(prefetch)
