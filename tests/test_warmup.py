"""A resumed buffer reads only the resident blocks that the plan uses before evicting them
(:mod:`solar.buffer.warmup`), and still delivers exactly the uninterrupted run's batches."""
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import solar
from solar.buffer.warmup import resident_at, used_before_evicted
from solar.loader import SolarLoader
from solar.scheduler import Demand
from solar.scheduler.run import BufferTooSmall

from helpers import make_dataset


def _brute_force(plan, demand: Demand, start: int, resident: np.ndarray) -> np.ndarray:
    """Walk the plan step by step from ``start``: evicted first (within a step the plan evicts, then trains)
    means not needed, used first means needed; neither: not needed."""
    need = []
    for b in resident.tolist():
        verdict = False
        for g in range(start, plan.n_steps):
            sp = plan.step(g)
            if b in set(np.asarray(sp.evict).tolist()):
                break
            used = {int(x) for s in np.asarray(sp.samples).tolist()
                    for x in demand.sample_blocks[demand.sample_ptr[s]:demand.sample_ptr[s + 1]]}
            if b in used:
                verdict = True
                break
        need.append(verdict)
    return np.array(need, dtype=bool)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(8, 60), spb=st.integers(1, 3), bps=st.integers(1, 2), P=st.integers(1, 3),
       b=st.integers(1, 4), E=st.integers(1, 3), frac=st.floats(0.1, 0.9), seed=st.integers(0, 5),
       policy=st.sampled_from(["solar", "nopfs", "torch", "solar2023"]), data=st.data())
def test_needed_blocks_are_those_used_before_their_eviction(n, spb, bps, P, b, E, frac, seed, policy, data):
    demand = Demand.synthetic(n, 1000, samples_per_block=spb, blocks_per_sample=bps)
    try:
        sched = solar.plan(demand, world_size=P, local_batch=b, epochs=E, seed=seed, policy=policy,
                           buffer_per_rank=max(int(frac * demand.block_nbytes.sum() / P), b * bps * 1000))
    except BufferTooSmall:  # solar2023 may give a rank more than a local batch
        assume(False)
    r = data.draw(st.integers(0, P - 1))
    plan = sched.rank(r)
    start = data.draw(st.integers(0, plan.n_steps - 1))
    B = demand.n_blocks
    resident = resident_at(plan.load, plan.load_ptr, plan.evict, plan.evict_ptr, start, B)
    got = used_before_evicted(resident, start, samples=plan.samples, samples_ptr=plan.samples_ptr,
                              evict=plan.evict, evict_ptr=plan.evict_ptr, sample_ptr=demand.sample_ptr,
                              sample_blocks=demand.sample_blocks, n_blocks=B)
    np.testing.assert_array_equal(got, _brute_force(plan, demand, start, resident))
    # a horizon too short to decide: the undecided blocks are read (never skipped on a guess)
    short = used_before_evicted(resident, start, samples=plan.samples, samples_ptr=plan.samples_ptr,
                                evict=plan.evict, evict_ptr=plan.evict_ptr, sample_ptr=demand.sample_ptr,
                                sample_blocks=demand.sample_blocks, n_blocks=B, horizon=1)
    assert (short >= got).all()


@pytest.mark.parametrize("stop", [5, 23, 41])
def test_resume_reads_only_what_it_uses_and_gives_the_same_batches(tmp_path, stop):
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=64)
    path = str(tmp_path / "plan.h5")
    solar.plan(data, world_size=1, local_batch=4, epochs=3, buffer_fraction=0.4, out=path).close()
    with SolarLoader(path, data, rank=0, as_torch=False) as full:
        ref = [x for e in range(3) for x in (full.set_epoch(e), list(full))[1]]
    a = SolarLoader(path, data, rank=0, as_torch=False)
    it = (x for e in range(3) for x in (a.set_epoch(e), a)[1])
    first = [next(it) for _ in range(stop)]
    state = a.state_dict()
    a.close()
    with SolarLoader(path, data, rank=0, as_torch=False) as b:
        b.load_state_dict(state)
        S = len(ref) // 3  # steps per epoch
        rest = list(b) + [x for e in range(stop // S + 1, 3) for x in (b.set_epoch(e), list(b))[1]]
        warm, st_ = b.buffer.warmup, b.stats()
        sched, layout = b.schedule, b.layout
    assert len(first) + len(rest) == len(ref)
    for x, y in zip(first + rest, ref):
        assert np.array_equal(x["index"], y["index"])
        for k in y:
            if isinstance(y[k], np.ndarray):
                np.testing.assert_array_equal(x[k], y[k])
    assert st_["plan_violations"] == 0
    plan = sched.rank(0)
    resident = resident_at(plan.load, plan.load_ptr, plan.evict, plan.evict_ptr, stop, layout.n_blocks)
    assert warm["blocks"] + warm["skipped"] == resident.shape[0]
    assert warm["skipped"] > 0  # this plan keeps blocks it evicts unused: they were not read
