"""Coalescing block byte ranges into reads: exact cases and properties."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solar.errors import SpecError
from solar.io.coalesce import CoalescePolicy, coalesce


def _c(offs, lens, gap, read):
    r = coalesce(np.array(offs, dtype=np.int64), np.array(lens, dtype=np.int64), gap, read)
    return r.starts.tolist(), r.lengths.tolist(), r.range_of.tolist(), r.offset_in_range.tolist()


def test_adjacent_blocks_merge_in_any_input_order():
    assert _c([20, 0, 10], [10, 10, 10], 0, 100) == ([0], [30], [0, 0, 0], [20, 0, 10])


def test_gap_limit():
    # gaps of 5 and 6 bytes: max_gap=5 bridges the first only
    assert _c([0, 15, 31], [10, 10, 10], 5, 1000) == ([0, 31], [25, 10], [0, 0, 1], [0, 15, 0])
    assert _c([0, 15, 31], [10, 10, 10], 6, 1000) == ([0], [41], [0, 0, 0], [0, 15, 31])


def test_read_limit_cuts_a_run():
    starts, lens, rof, _ = _c([0, 10, 20, 30, 40], [10] * 5, 0, 25)
    assert starts == [0, 20, 40] and lens == [20, 20, 10] and rof == [0, 0, 1, 1, 2]


def test_oversized_block_gets_its_own_range():
    assert _c([0, 10, 1010], [10, 1000, 10], 0, 100) == ([0, 10, 1010], [10, 1000, 10], [0, 1, 2], [0, 0, 0])


def test_off_gives_one_range_per_block():
    r = CoalescePolicy(enabled=False).apply(np.arange(5) * 8, np.full(5, 8))
    assert r.n_ranges == 5 and r.nbytes == 40
    assert CoalescePolicy().apply(np.arange(5) * 8, np.full(5, 8)).n_ranges == 1


def test_duplicates_share_a_range_even_past_max_read():
    starts, lens, rof, inr = _c([100, 0, 100], [50, 10, 50], 0, 0)
    assert starts == [0, 100] and lens == [10, 50] and rof == [1, 0, 1] and inr == [0, 0, 0]


def test_empty_and_bad_input():
    r = coalesce(np.zeros(0, np.int64), np.zeros(0, np.int64), 10, 10)
    assert r.n_ranges == 0 and r.range_of.shape == (0,)
    with pytest.raises(ValueError, match="offsets must be >= 0, got -1"):
        coalesce(np.array([-1]), np.array([4]), 0, 0)
    with pytest.raises(ValueError, match="3 entries but lengths has 2"):
        coalesce(np.arange(3), np.ones(2), 0, 0)
    with pytest.raises(SpecError, match="max_gap must be an integer >= 0 .*got -5"):
        CoalescePolicy(max_gap=-5)
    with pytest.raises(SpecError, match="max_read must be an integer .*got 1.5"):
        CoalescePolicy(max_read=1.5)


@st.composite
def _requests(draw):
    """Disjoint byte ranges (blocks of one file) in shuffled order, plus limits."""
    n = draw(st.integers(0, 40))
    lens = draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
    gaps = draw(st.lists(st.integers(0, 200), min_size=n, max_size=n))
    offs = np.cumsum(np.array(gaps, dtype=np.int64)) + np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64) \
        if n else np.zeros(0, np.int64)
    perm = draw(st.permutations(range(n)))
    return (offs[list(perm)], np.array(lens, dtype=np.int64)[list(perm)],
            draw(st.integers(0, 250)), draw(st.integers(0, 1200)))


@settings(max_examples=200, deadline=None)
@given(_requests())
def test_properties(req):
    offs, lens, max_gap, max_read = req
    r = coalesce(offs, lens, max_gap, max_read)
    starts, rl = r.starts, r.lengths
    # ranges sorted and disjoint
    assert np.all(starts[1:] >= starts[:-1] + rl[:-1])
    # every input lies exactly where its range says
    assert np.all(r.range_of >= 0) and np.all(r.range_of < r.n_ranges)
    np.testing.assert_array_equal(starts[r.range_of] + r.offset_in_range, offs)
    assert np.all(r.offset_in_range + lens <= rl[r.range_of])
    # each range starts at an input and ends at one (no byte read beyond the inputs)
    for k in range(r.n_ranges):
        mine = r.range_of == k
        assert mine.any()
        assert offs[mine].min() == starts[k] and (offs + lens)[mine].max() == starts[k] + rl[k]
        # limits: within max_read unless a lone oversized block; inner gaps within max_gap
        if mine.sum() > 1:
            assert rl[k] <= max_read
        o = np.sort(offs[mine])
        e = (offs + lens)[mine][np.argsort(offs[mine], kind="stable")]
        assert np.all(o[1:] - e[:-1] <= max_gap)
    # greedy: neighbouring ranges could not have been merged
    for k in range(r.n_ranges - 1):
        gap = starts[k + 1] - (starts[k] + rl[k])
        assert gap > max_gap or starts[k + 1] + rl[k + 1] - starts[k] > max_read
