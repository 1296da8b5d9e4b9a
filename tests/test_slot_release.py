"""A buffer gives an evicted block's slot back only once no step in flight gathers from it
(solar.buffer.rank_place): no step may gather from a slot that a later read has overwritten, whatever order the
reads finish in and however far they run ahead of a consumer that lags."""
import threading
import time
from types import SimpleNamespace

import numpy as np
from hypothesis import HealthCheck, given, reject, settings, strategies as st

import solar
from solar.errors import SolarError
from solar.buffer import BufferManager
from solar.schedule import Schedule
from solar.scheduler import Demand


def _pattern(b: int, n: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 7 + b * 31) % 251).astype(np.uint8)


class TaggedReader:
    """Fills block b with its own byte pattern, each call after a random delay: calls finish in any order."""

    collective = False

    def __init__(self, seed: int, max_delay: float):
        self.rng, self.lock, self.max_delay = np.random.default_rng(seed), threading.Lock(), max_delay
        self.calls = 0

    def read_blocks(self, blocks, out):
        with self.lock:
            delay = float(self.rng.uniform(0, self.max_delay))
            self.calls += 1
        time.sleep(delay)
        for b, v in zip(np.asarray(blocks).tolist(), out):
            v[:] = _pattern(int(b), v.shape[0])
        return SimpleNamespace(n_reads=len(out), bytes_read=sum(v.nbytes for v in out))


def _plan(tmp_path, n, f, b, epochs, seed, spb=1):
    d = Demand.synthetic(n, 4096, samples_per_block=spb)
    path = str(tmp_path / f"plan-{n}-{f}-{b}-{seed}.h5")
    solar.plan(d, world_size=2, local_batch=b, epochs=epochs, buffer_fraction=f, seed=seed, out=path,
               parts=False).close()
    return path


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(24, 80), f=st.sampled_from([0.3, 0.5, 0.8]), b=st.integers(2, 5), seed=st.integers(0, 99),
       spb=st.sampled_from([1, 2]), prefetch=st.integers(1, 3), io_depth=st.integers(1, 4), overlap=st.booleans())
def test_no_step_gathers_an_overwritten_slot(tmp_path_factory, n, f, b, seed, spb, prefetch, io_depth, overlap):
    """Also with the assembly in a thread of its own (``overlap``), where the next steps are booked and read while a
    step is assembled: each assembly takes a while, and checks its blocks after it."""
    tmp = tmp_path_factory.mktemp("release")
    try:
        path = _plan(tmp, n, f, b, 2, seed, spb)
    except SolarError:  # a budget below a batch
        reject()
    with Schedule.load(path) as s:
        d, rp = s.demand(), s.rank(seed % 2)
        ptr, blocks = d["sample_ptr"], d["sample_blocks"]
        bad = []

        def assemble(g, samples, lookup):  # every block of every sample still holds its own bytes
            if overlap:
                time.sleep(0.001 * (g % 3))  # later steps' reads land meanwhile
            for smp in samples.tolist():
                for blk in blocks[ptr[smp]:ptr[smp + 1]].tolist():
                    v = lookup(int(blk))
                    if not np.array_equal(v, _pattern(int(blk), v.shape[0])):
                        bad.append((g, blk))
            return g
        with BufferManager(rp, d, TaggedReader(seed, 0.004), assemble, budget=s.memory_budget, prefetch=prefetch,
                           io_depth=io_depth, overlap=overlap) as bm:
            for g in range(rp.n_steps):
                assert bm.get(g) == g
                if g % 3 == 0:
                    time.sleep(0.002)  # the consumer lags now and then: reads run ahead
        assert bad == []


class GatedReader:
    """Fills block b with its pattern; a read of block ``gate`` waits for ``open`` to be set; records the blocks asked
    for as they are asked."""

    collective = False

    def __init__(self, gate: int):
        self.gate, self.open, self.asked = gate, threading.Event(), []

    def read_blocks(self, blocks, out):
        blocks = np.asarray(blocks).tolist()
        self.asked.extend(blocks)
        if self.gate in blocks:
            self.open.wait(10)
        for b, v in zip(blocks, out):
            v[:] = _pattern(int(b), v.shape[0])
        return SimpleNamespace(n_reads=len(out), bytes_read=sum(v.nbytes for v in out))


def test_a_slot_is_free_once_its_block_s_last_use_is_assembled():
    """Steps 0-3 each use one new block, the pools hold 3: step 3 evicts block 0 (last used at step 0).  Its slot is
    free once step 0 is assembled, so step 3's read starts while step 2's is still in flight (before: only once step
    2 was assembled, the step before the eviction, so one slow read held every read after it)."""
    from solar.schedule import RankPlan
    n, nb = 4, 4096
    one = np.ones(n, np.int32)
    arrays = {"samples": np.arange(n, dtype=np.int64), "samples_count": one,
              "load": np.arange(n, dtype=np.int64), "load_count": one,
              "evict": np.array([0], np.int64), "evict_count": np.array([0, 0, 0, 1], np.int32),
              "stats": np.zeros((n, 5), np.int64)}
    demand = {"sample_ptr": np.arange(n + 1, dtype=np.int64), "sample_blocks": np.arange(n, dtype=np.int64),
              "block_nbytes": np.full(n, nb, np.int64)}
    reader = GatedReader(gate=2)
    out = []

    def assemble(g, samples, lookup):
        v = lookup(int(samples[0]))
        out.append(bool(np.array_equal(v, _pattern(int(samples[0]), nb))))
        return g
    with BufferManager(RankPlan(0, arrays), demand, reader, assemble, budget=3 * nb, prefetch=2, io_depth=4) as bm:
        assert bm.pools.slots.tolist() == [3]  # no slot beyond the plan's residency
        assert bm.get(0) == 0 and bm.get(1) == 1
        deadline = time.monotonic() + 5
        while 3 not in reader.asked and time.monotonic() < deadline:
            time.sleep(0.005)
        started = 3 in reader.asked
        reader.open.set()
        assert [bm.get(g) for g in (2, 3)] == [2, 3]
    assert started, "step 3's read waited for step 2's"
    assert out == [True] * n
