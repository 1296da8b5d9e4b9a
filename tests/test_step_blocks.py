"""The per-step helpers of the buffer's booking (solar.buffer.steps, solar.buffer.book): the distinct blocks of a
step's samples, which loads a step uses, against numpy's own ``unique``/``isin`` on any CSR table (hypothesis)."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from solar.buffer.steps import sorted_unique, step_blocks

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
@given(csr(), st.data())
def test_step_need_matches_the_numpy_booking(t, data):
    """solar.buffer.book.step_need (one kernel call) against the booking's numpy steps it replaced: the distinct
    blocks (a step without samples: its loads), their classes and slots, the loads the step uses and the hits,
    the blocks called resident that are not, and ``touched`` set for the blocks and the loads."""
    from solar.buffer.book import step_need
    ptr, blocks, samples = t
    B = 31
    g = data.draw(st.integers(0, 50), label="step")
    # resident blocks (a slot), loads among the rest (a slot taken for each), the rest not resident
    state = np.array(data.draw(st.lists(st.integers(0, 2), min_size=B, max_size=B), label="state"))
    slot_of = np.where(state == 2, -1, np.arange(B) * 3 + 1).astype(np.int64)
    load = np.flatnonzero(state == 1).astype(np.int64)
    load = np.array(data.draw(st.permutations(load.tolist()), label="load order"), dtype=np.int64)
    class_of = (np.arange(B) % 3).astype(np.int32)
    nbytes = (np.arange(B) * 7 + 5).astype(np.int64)
    touched = np.full(B, -1, np.int64)
    mark = np.array(data.draw(st.lists(st.integers(-1, max(g - 1, -1)), min_size=B, max_size=B), label="mark"),
                    dtype=np.int64)
    got = step_need(g, ptr, blocks, samples, load, slot_of, class_of, nbytes, touched, mark)
    rows = np.concatenate([np.arange(ptr[s], ptr[s + 1]) for s in samples] or [[]]).astype(np.int64)
    need = np.unique(blocks[rows]) if samples.size else np.unique(load)
    used = load[np.isin(load, need)]
    slot = slot_of[need]
    missing = need[(slot < 0) & ~np.isin(need, load)]
    assert np.array_equal(got.blocks, need) and got.blocks.dtype == np.int64
    assert np.array_equal(got.block_slot, slot) and np.array_equal(got.block_class, class_of[need])
    assert np.array_equal(got.missing, missing)
    assert (got.misses, got.bytes_loaded) == (used.shape[0], int(nbytes[used].sum()))
    assert got.hits == need.shape[0] - used.shape[0] - missing.shape[0]
    assert got.hit_bytes == int(nbytes[need].sum() - nbytes[used].sum() - nbytes[missing].sum())
    want = np.full(B, -1, np.int64)
    want[need], want[load] = g, g
    assert np.array_equal(touched, want)
