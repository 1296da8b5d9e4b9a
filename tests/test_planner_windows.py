"""Open-ended planning (issue 14): the planner goes on from its state, window after window.

A plan made in windows of K epochs must equal the one made in a single call, and the first E
epochs of an open-ended plan must equal those of any longer fixed-length plan of the same job.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from solar.errors import SpecError
from solar.scheduler.config import PlanConfig
from solar.scheduler.run import Demand, PlanRun, run_policy

from test_planner import replay


def _key(ep):
    """Everything an epoch plan decides, as plain lists."""
    return (ep.position, ep.source_epoch, ep.rank_of.tolist(), ep.load.tolist(), ep.load_ptr.tolist(),
            ep.evict.tolist(), ep.evict_ptr.tolist(), ep.hits.tolist(), ep.miss_bytes.tolist())


def _windows(demand, cfg, policy, sizes, nodes=None):
    """The epoch plans of an open-ended run advanced window by window (``sizes``: epochs per window)."""
    run = PlanRun(demand, cfg, policy, record=True, open_ended=True, nodes=nodes)
    plans, stop = [], 0
    for k in sizes:
        stop += k
        run.advance(stop, on_epoch=plans.append)
    return plans


cases = st.fixed_dictionaries(dict(
    n=st.integers(8, 90), P=st.integers(1, 4), b=st.integers(1, 6), spb=st.integers(1, 3),
    bps=st.integers(1, 2), frac=st.floats(0.05, 1.2), seed=st.integers(0, 50), drop_last=st.booleans(),
    eps=st.sampled_from([0.0, 0.25]), policy=st.sampled_from(["solar", "torch", "ideal"]),
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases)
def test_windows_equal_one_call_and_longer_fixed_plan(c):
    d = Demand.synthetic(c["n"], 64, c["spb"], c["bps"])
    need = 64 * c["spb"] * c["b"] * 2 * (c["P"] if c["eps"] else 1) * 2  # >= one local batch of blocks
    budget = max(need, int(c["frac"] * c["n"] * 64 / max(1, c["P"])))
    E = sum(c["sizes"])
    cfg = PlanConfig(c["P"], c["b"], E, budget, c["seed"], c["drop_last"], c["eps"])
    windowed = _windows(d, cfg, c["policy"], c["sizes"])
    one = []
    PlanRun(d, cfg, c["policy"], record=True, open_ended=True).advance(E, on_epoch=one.append)
    assert [_key(p) for p in windowed] == [_key(p) for p in one]
    # the first E epochs of a fixed plan of E + 3 epochs (its epoch E - 1 sees the future too)
    longer = []
    run_policy(d, PlanConfig(c["P"], c["b"], E + 3, budget, c["seed"], c["drop_last"], c["eps"]), c["policy"],
               record=True, on_epoch=longer.append)
    assert [_key(p) for p in windowed] == [_key(p) for p in longer[:E]]
    replay(d, cfg, windowed, c["policy"])  # budget and residency hold across window edges


def test_fixed_plan_differs_only_in_its_last_epoch():
    d = Demand.synthetic(96, 1000, 2, 1)
    cfg = PlanConfig(2, 4, 4, 30_000, 3)
    fixed, open_ = [], []
    run_policy(d, cfg, "solar", record=True, on_epoch=fixed.append)
    PlanRun(d, cfg, "solar", record=True, open_ended=True).advance(4, on_epoch=open_.append)
    assert [_key(p) for p in fixed[:3]] == [_key(p) for p in open_[:3]]
    assert _key(fixed[3]) != _key(open_[3])  # the fixed plan's last epoch keeps blocks nobody will use


@pytest.mark.parametrize("policy, why", [("solar2023", "identity epoch order"), ("nopfs", "bounded lookahead")])
def test_open_ended_refuses_policies_that_need_every_epoch(policy, why):
    with pytest.raises(SpecError, match=f"{why}.*{policy}"):
        PlanRun(Demand.synthetic(10, 8), PlanConfig(1, 2, 3, 64), policy, open_ended=True)


@pytest.mark.parametrize("stop", [-1, 2.0, True, 5])
def test_advance_refuses_bad_stops(stop):
    run = PlanRun(Demand.synthetic(10, 8), PlanConfig(1, 2, 3, 64), "solar")
    run.advance(1)
    with pytest.raises(SpecError, match="cannot plan up to epoch"):
        run.advance(0 if stop == -1 else stop)
