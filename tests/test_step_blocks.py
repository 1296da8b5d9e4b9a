"""The per-step helpers of the buffer's booking (solar.buffer.steps): the distinct blocks of a step's samples,
which loads a step uses, against numpy's own ``unique``/``isin`` on any CSR table (hypothesis)."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from solar.buffer.steps import member, sorted_unique, step_blocks

ids = st.lists(st.integers(0, 60), max_size=40)


@st.composite
def csr(draw):
    """``(sample_ptr, sample_blocks, samples)``: samples with 0-5 blocks each (all the same count, or not), block
    ids shared between samples, and a step's samples (any order, repeats allowed)."""
    n = draw(st.integers(1, 12))
    same = draw(st.booleans())
    k = draw(st.integers(0, 5))
    counts = [k] * n if same else draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    rows = [draw(st.lists(st.integers(0, 30), min_size=c, max_size=c)) for c in counts]
    ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    blocks = np.array([b for r in rows for b in r], dtype=np.int64)
    samples = np.array(draw(st.lists(st.integers(0, n - 1), max_size=10)), dtype=np.int64)
    return ptr, blocks, samples


@settings(max_examples=300, deadline=None)
@given(csr())
def test_step_blocks_are_the_distinct_blocks_of_the_samples(t):
    ptr, blocks, samples = t
    got = step_blocks(ptr, blocks, samples)
    rows = [blocks[ptr[s]:ptr[s + 1]] for s in samples.tolist()]
    ref = np.unique(np.concatenate(rows)) if rows else np.zeros(0, np.int64)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, ref.astype(np.int64))


@settings(max_examples=300, deadline=None)
@given(ids)
def test_sorted_unique_is_numpy_unique(x):
    x = np.array(x, dtype=np.int64)
    np.testing.assert_array_equal(sorted_unique(x), np.unique(x))


@settings(max_examples=300, deadline=None)
@given(ids, ids)
def test_member_is_numpy_isin(a, x):
    a, x = np.unique(np.array(a, dtype=np.int64)), np.array(x, dtype=np.int64)
    got = member(a, x)
    assert got.dtype == bool and got.shape == x.shape
    np.testing.assert_array_equal(got, np.isin(x, a))
