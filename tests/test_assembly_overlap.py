"""A step's batch assembled in a thread of its own while the prefetch thread books the next steps
(``BufferManager(overlap=True)``, the loader's default with more than one core): the same batches, in order, as
assembling in the prefetch thread; the hooks (transforms, the device copy) still run in the prefetch thread; an
assembly that raises ends the loop with an error at that step.  That no slot is reused while a step is being
assembled is checked by the property tests of tests/test_slot_release.py and tests/test_node_buffer.py, which
run with and without ``overlap``."""
import threading
import time

import numpy as np
import pytest

import solar
from solar.buffer import BufferManager
from solar.buffer.steps import BufferError
from solar.loader import SolarLoader
from solar.scheduler import Demand

from helpers import h5py_sample, make_dataset


def _check(layout, batch):
    for i, s in enumerate(np.asarray(batch["index"]).tolist()):
        for k, v in h5py_sample(layout, s).items():
            np.testing.assert_array_equal(np.asarray(batch[k][i]), v, err_msg=f"sample {s} field {k}")


@pytest.mark.parametrize("preset,storage", [("ptychonn", "contiguous"), ("ptychonn", "gzip"), ("well", "chunked"),
                                            ("cosmoflow", "chunked")])
def test_batches_are_the_same_with_the_assembly_beside_the_booking(tmp_path, preset, storage):
    data = make_dataset(tmp_path, preset, storage)
    layout = solar.load_layout(data)
    path = str(tmp_path / "plan.h5")
    per_sample = int(layout.per_sample_sum(layout.block_nbytes).max())
    budget = max(int(0.5 * layout.block_nbytes.sum() / 2), 16 * per_sample)  # half the data, or a few batches
    solar.plan(layout, world_size=2, local_batch=3, epochs=2, buffer_per_rank=budget, out=path).close()
    threads = set()

    def transform(batch):  # runs in the prefetch thread whatever the cpus
        threads.add(threading.current_thread().name)
        return dict(batch, n=len(batch["index"]))
    for r in range(2):
        runs = {}
        for cpus, tf in ((1, None), (2, None), (3, None), (2, transform)):
            with SolarLoader(path, layout, rank=r, cpus=cpus, as_torch=False, transform=tf, prefetch=2) as loader:
                loader.prepare()
                assert loader.buffer._overlap == (cpus > 1)
                got = []
                for e in range(2):
                    loader.set_epoch(e)
                    for batch in loader:
                        _check(layout, batch)
                        if tf is not None:
                            assert batch["n"] == len(batch["index"])
                        got.append({k: np.array(v) for k, v in batch.items() if k != "n"})
                st = loader.stats()
                assert st["plan_violations"] == 0
                runs[(cpus, tf is not None)] = (got, st["misses"], st["hits"], st["bytes_loaded"])
        ref = runs[(1, False)]
        for key, (got, *counts) in runs.items():
            assert counts == list(ref[1:]), key
            assert len(got) == len(ref[0])
            for a, b in zip(got, ref[0]):
                assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), key
    assert threads and all(t.startswith("solar-prefetch") for t in threads), threads


def _synthetic(tmp_path, n=48, b=4, f=0.4):
    d = Demand.synthetic(n, 4096)
    s = solar.plan(d, world_size=1, local_batch=b, epochs=2, buffer_fraction=f, out=str(tmp_path / "p.h5"))
    return s, d


class _Reader:
    collective = False

    def read_blocks(self, blocks, out):
        from types import SimpleNamespace
        for b, v in zip(np.asarray(blocks).tolist(), out):
            v[:] = b % 251
        return SimpleNamespace(n_reads=len(out), bytes_read=sum(v.nbytes for v in out))


@pytest.mark.parametrize("overlap", [False, True])
def test_where_assembly_and_finish_run(tmp_path, overlap):
    s, d = _synthetic(tmp_path)
    names, fin, blocks = [], [], []

    def assemble(g, samples, lookup):
        names.append(threading.current_thread().name)
        time.sleep(0.001)
        blocks.append(all(int(lookup(int(b))[0]) == int(b) % 251 for b in lookup.blocks.tolist()))
        return g

    def finish(g, samples, out):
        fin.append(threading.current_thread().name)
        return (out, g)
    rp = s.rank(0)
    with BufferManager(rp, s.demand(), _Reader(), assemble, budget=s.memory_budget, prefetch=2, overlap=overlap,
                       finish=finish) as bm:
        assert [bm.get(g) for g in range(rp.n_steps)] == [(g, g) for g in range(rp.n_steps)]
        assert bm.totals.steps == rp.n_steps and bm.totals.plan_violations == 0
    assert all(blocks) and len(blocks) == rp.n_steps
    assert all(n.startswith("solar-prefetch") for n in fin)
    if overlap:
        assert all("assemble" in n for n in names), set(names)
    else:
        assert all(n.startswith("solar-prefetch") for n in names), set(names)
    s.close()


def test_an_assembly_that_raises_ends_the_loop_at_its_step(tmp_path):
    s, d = _synthetic(tmp_path)

    def assemble(g, samples, lookup):
        if g == 3:
            raise RuntimeError("gather broke")
        return g
    rp = s.rank(0)
    bm = BufferManager(rp, s.demand(), _Reader(), assemble, budget=s.memory_budget, prefetch=2, overlap=True)
    try:
        assert [bm.get(g) for g in range(3)] == [0, 1, 2]
        with pytest.raises(BufferError, match="gather broke"):
            bm.get(3)
    finally:
        t0 = time.monotonic()
        bm.close()
        assert time.monotonic() - t0 < 10
    assert bm._stage is None and not bm._thread.is_alive()
    s.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_batches_assembled_before_a_failure_are_handed_out_first(tmp_path, overlap):
    """A consumer slower than the buffer: step 3's assembly fails while steps 0-2 wait assembled in the queue.  They
    are handed out, in order, and the error comes at step 3 (before, at the first get after the failure)."""
    s, d = _synthetic(tmp_path)

    def assemble(g, samples, lookup):
        if g == 3:
            raise RuntimeError("gather broke")
        return g
    got = []
    with BufferManager(s.rank(0), s.demand(), _Reader(), assemble, budget=s.memory_budget, prefetch=3,
                       overlap=overlap) as bm:
        with pytest.raises(BufferError, match="gather broke"):
            for g in range(5):
                time.sleep(0.05)  # the failure happens meanwhile
                got.append(bm.get(g))
    assert got == [0, 1, 2]
    s.close()


def test_a_read_failing_while_a_step_is_assembled_comes_after_that_step(tmp_path):
    """With the assembly thread handing batches over itself (no ``finish``): a later step's read fails while step
    2 is being assembled (and others may wait queued behind it).  Every step queued before the failure is still
    handed out, and the error comes at the failing step (before: at step 2, whose assembly had not ended when the
    error was set)."""
    s, d = _synthetic(tmp_path, n=80)
    rp = s.rank(0)
    bad_step = next(g for g in range(3, rp.n_steps) if len(rp.step(g).load))
    bad = int(rp.step(bad_step).load[0])

    class Failing(_Reader):
        def read_blocks(self, blocks, out):
            if bad in np.asarray(blocks).tolist():
                raise OSError(5, "injected read failure")
            return super().read_blocks(blocks, out)

    def assemble(g, samples, lookup):
        if g == 2:
            time.sleep(0.3)  # the failing read lands meanwhile
        return g
    got = []
    with BufferManager(rp, s.demand(), Failing(), assemble, budget=s.memory_budget, prefetch=3, io_depth=4,
                       overlap=True) as bm:
        with pytest.raises(BufferError, match="injected read failure"):
            for g in range(rp.n_steps):
                got.append(bm.get(g))
    assert got == list(range(bad_step))
    s.close()


def test_an_assembly_that_ends_before_the_prefetch_thread_waits_wakes_it(tmp_path, monkeypatch):
    """The prefetch thread finds the oldest assembly still running, cannot book the next step, and goes idle; the
    assembly ends (and wakes it) in between.  The idle wait must see that, not sleep its 0.5 s: each get waited
    about that long before (a delay before idle forces the order)."""
    from solar.buffer import rank_place
    idle = rank_place.RankPlace.idle

    def late_idle(self, q, *args):
        time.sleep(0.005)
        return idle(self, q, *args)
    monkeypatch.setattr(rank_place.RankPlace, "idle", late_idle)
    s, d = _synthetic(tmp_path, n=120)

    def assemble(g, samples, lookup):
        time.sleep(0.002)
        return g
    rp = s.rank(0)
    waits = []
    with BufferManager(rp, s.demand(), _Reader(), assemble, budget=s.memory_budget, prefetch=1, io_depth=1,
                       overlap=True, finish=lambda g, samples, out: out) as bm:
        for g in range(rp.n_steps):
            t0 = time.perf_counter()
            assert bm.get(g) == g
            waits.append(time.perf_counter() - t0)
    assert max(waits) < 0.3, sorted(waits)[-5:]
    s.close()


def test_close_drops_the_assemblies_still_queued(tmp_path):
    """close() while one step is being assembled and more are queued: the one under way ends, the queued ones are
    not run (nobody takes them), every thread ends."""
    s, d = _synthetic(tmp_path)
    ran = []

    def assemble(g, samples, lookup):
        ran.append(g)
        time.sleep(0.3)
        return g
    bm = BufferManager(s.rank(0), s.demand(), _Reader(), assemble, budget=s.memory_budget, prefetch=3, overlap=True)
    assert bm.get(0) == 0
    time.sleep(0.1)  # step 1 being assembled, the next ones queued behind it
    bm.close()
    assert ran == [0, 1]
    assert bm._stage is None and not bm._thread.is_alive()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("solar-") and "-r0" in t.name]
    s.close()


def test_a_node_buffer_waiting_for_its_own_assembly_is_not_stuck():
    """A node buffer's ``timeout`` (no progress while waiting for other ranks) does not count the time its prefetch
    thread waits for its own assembly thread: one assembly of 1.5 s under a 0.5 s timeout (before: a
    NodeBufferError "made no progress ... waiting for rank 0")."""
    from solar.buffer.node_manager import NodeBufferManager
    from solar.scheduler.config import PlanConfig
    from solar.scheduler.node_plan import plan_nodes
    from solar.scheduler.nodes import NodeMap
    from test_node_buffer import PatternReader, demand_dict
    d = Demand.synthetic(40, 96, samples_per_block=1, blocks_per_sample=2)
    cfg = PlanConfig(world_size=1, local_batch=2, epochs=2, buffer_bytes=int(d.block_nbytes.sum() * 0.05) + 96 * 4)
    plan, _ = plan_nodes(d, cfg, NodeMap(1, 1), "solar-node")

    def assemble(g, samples, lookup):
        if g == 3:
            time.sleep(1.5)
        return g
    with NodeBufferManager(plan, 0, demand_dict(d), PatternReader(d.block_nbytes, d.block_stored, 0), assemble,
                           comm=None, budget=cfg.buffer_bytes, prefetch=2, io_depth=2, timeout=0.5,
                           overlap=True) as m:
        assert [m.get(g) for g in range(plan.n_steps)] == list(range(plan.n_steps))


def test_a_device_buffer_assembles_in_the_prefetch_thread(tmp_path):
    pytest.importorskip("torch")
    data = make_dataset(tmp_path, "ptychonn", "contiguous")
    layout = solar.load_layout(data)
    path = str(tmp_path / "plan.h5")
    per_sample = int(layout.per_sample_sum(layout.block_nbytes).max())
    solar.plan(layout, world_size=1, local_batch=4, epochs=1, out=path,
               buffer_per_rank=max(int(0.5 * layout.block_nbytes.sum()), 24 * per_sample)).close()
    with SolarLoader(path, layout, cpus=2, buffer_device="cpu", prefetch=2) as loader:
        loader.prepare()
        assert loader.buffer._overlap is False and loader.buffer._stage is None
        assert sum(len(b["index"]) for b in loader) == layout.n_samples
