"""Batch assembly by gather (one numba call per field from the slot pools) equals the
per-block ``place_block`` path and h5py, bit for bit, on every preset x storage, random
sample subsets and random slot placements; the vectorised slot pools and step booking
keep their safety checks."""
import os

import h5py
import numpy as np
import pytest
from helpers import SMALL, STORAGES, h5py_sample, make_dataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import solar
from solar.bench.cache import cached_fraction
from solar.buffer import BufferError, SlotPools, StepBlocks
from solar.io import assemble_sample, get_reader
from solar.layout import LayoutSpec, build_layout
from solar.loader import BatchAssembler, SolarLoader
from solar.memory import size_classes
from solar.schedule import RankPlan

CASES = [(p, s) for p in SMALL for s in STORAGES]


@pytest.fixture(scope="module")
def resident(tmp_path_factory):
    """``get(preset, storage) -> (layout, blocks' decoded bytes)``, generated once per module."""
    root, cache = tmp_path_factory.mktemp("gather"), {}

    def get(preset, storage):
        if (preset, storage) not in cache:
            layout = solar.load_layout(make_dataset(root, preset, storage))
            outs = [np.empty(int(n), np.uint8) for n in layout.block_nbytes]
            with get_reader("pread", layout, threads=1) as r:
                r.read_blocks(np.arange(layout.n_blocks), outs)
            cache[preset, storage] = (layout, outs)
        return cache[preset, storage]
    return get


def _step_blocks(layout, outs, samples, rng):
    """The samples' blocks copied into slot pools at random slots (spare slots in every class)."""
    need = np.unique(np.concatenate([layout.blocks_of(int(s)) for s in samples]))
    class_of, class_bytes = size_classes(layout.block_nbytes)
    cls = class_of[need].astype(np.int64)
    pools = SlotPools(class_bytes, np.bincount(cls, minlength=class_bytes.shape[0]) + 3)
    for c in range(class_bytes.shape[0]):  # shuffle each free stack: blocks land anywhere
        pools.stack[c][:] = rng.permutation(pools.stack[c])
    slot = pools.alloc_many(cls)
    for b, c, i in zip(need.tolist(), cls.tolist(), slot.tolist()):
        pools.view(c, i)[:outs[b].shape[0]] = outs[b]
    return StepBlocks(0, need, cls, slot, pools, layout.block_nbytes, {})


def _same_bits(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
        assert np.array_equal(np.ascontiguousarray(a[k]).view(np.uint8), np.ascontiguousarray(b[k]).view(np.uint8)), k


@pytest.mark.parametrize("preset,storage", CASES, ids=[f"{p}-{s}" for p, s in CASES])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_gather_equals_place_block_and_h5py(resident, preset, storage, data):
    layout, outs = resident(preset, storage)
    n = data.draw(st.integers(1, layout.n_samples), label="batch")
    samples = np.array(data.draw(st.permutations(range(layout.n_samples)))[:n], dtype=np.int64)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
    sb = _step_blocks(layout, outs, samples, rng)
    new, old = BatchAssembler(layout), BatchAssembler(layout, gather=False)
    assert new.gather, new.tables.why
    got, ref = new(0, samples, sb), old(0, samples, sb)
    _same_bits(got, ref)
    for i, s in enumerate(samples.tolist()):
        for k, v in h5py_sample(layout, s).items():
            assert got[k][i].dtype == v.dtype.newbyteorder("=")
            np.testing.assert_array_equal(got[k][i], v, err_msg=f"sample {s} field {k}")


@pytest.mark.parametrize("preset,storage", CASES, ids=[f"{p}-{s}" for p, s in CASES])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_gather_of_some_fields_equals_those_fields_of_all(resident, preset, storage, data):
    """``fields=`` (any non-empty subset, in any order): each field asked for is that field of the batch of all
    fields, bit for bit, and no other field is there (the kernel's tables are sliced to the subset: a review
    found them sliced after the kernel's view was taken, which gathered another field of the same size)."""
    layout, outs = resident(preset, storage)
    names = list(layout.field_names)
    subset = data.draw(st.permutations(names), label="order")[:data.draw(st.integers(1, len(names)), label="k")]
    n = data.draw(st.integers(1, layout.n_samples), label="batch")
    samples = np.array(data.draw(st.permutations(range(layout.n_samples)))[:n], dtype=np.int64)
    sb = _step_blocks(layout, outs, samples, np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed")))
    some, every = BatchAssembler(layout, fields=subset), BatchAssembler(layout)
    assert some.gather == every.gather
    got, ref = some(0, samples, sb), every(0, samples, sb)
    _same_bits(got, {k: ref[k] for k in got})
    assert set(got) == set(layout.spec.field_subset(subset))


@pytest.mark.parametrize("preset,storage", CASES, ids=[f"{p}-{s}" for p, s in CASES])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_gather_on_several_cores_equals_one(resident, preset, storage, data, monkeypatch):
    """cpus > 1: the rows split into runs that threads gather at once give the same bits as one thread (runs
    made small here so every batch splits)."""
    import solar.buffer.gather as gather
    monkeypatch.setattr(gather, "MIN_PART_BYTES", 1)
    layout, outs = resident(preset, storage)
    n = data.draw(st.integers(1, layout.n_samples), label="batch")
    samples = np.array(data.draw(st.permutations(range(layout.n_samples)))[:n], dtype=np.int64)
    sb = _step_blocks(layout, outs, samples, np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed")))
    cpus = data.draw(st.integers(2, 5), label="cpus")
    many, one = BatchAssembler(layout, cpus=cpus), BatchAssembler(layout)
    try:
        _same_bits(many(0, samples, sb), one(0, samples, sb))
        assert (many._pool is not None) == many.gather  # the threads are made on first use
    finally:
        many.close()


@pytest.mark.parametrize("preset,storage", CASES, ids=[f"{p}-{s}" for p, s in CASES])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_gather_of_all_fields_in_one_call_equals_field_by_field(resident, preset, storage, data):
    """A batch in one allocation (``flat``: every field in one kernel call) against each field on its own (the
    path of pinned batches), bit for bit, on one core and on several."""
    import solar.buffer.gather as gather
    layout, outs = resident(preset, storage)
    n = data.draw(st.integers(1, layout.n_samples), label="batch")
    samples = np.array(data.draw(st.permutations(range(layout.n_samples)))[:n], dtype=np.int64)
    sb = _step_blocks(layout, outs, samples, np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed")))
    asm = BatchAssembler(layout, cpus=data.draw(st.integers(1, 3), label="cpus"))
    try:
        one, flat = asm._new_batch(n)
        apart = {k: np.zeros_like(v) for k, v in one.items()}
        t, old = asm.tables, gather.MIN_PART_BYTES
        gather.MIN_PART_BYTES = 1
        try:
            t.gather(samples, sb.blocks, sb.block_class, sb.block_slot, sb.pools, one, asm._workers(), asm.cpus, flat)
            t.gather(samples, sb.blocks, sb.block_class, sb.block_slot, sb.pools, apart, asm._workers(), asm.cpus)
        finally:
            gather.MIN_PART_BYTES = old
        _same_bits(one, apart)
        assert np.shares_memory(one[t.fields[0]], flat[0])
    finally:
        asm.close()


def test_row_parts():
    from solar.buffer.gather import row_parts
    assert row_parts(128, 4, 196608) == [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert row_parts(10, 4, 1000) == [(0, 10)]  # 10 kB: one run (each would be under 1 MiB)
    assert row_parts(0, 4, 10**6) == [(0, 0)] and row_parts(3, 8, 10**7) == [(0, 1), (1, 2), (2, 3)]
    for n in range(0, 40):
        for parts in range(1, 6):
            runs = row_parts(n, parts, 1, 1)
            assert runs[0][0] == 0 and runs[-1][1] == n and all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
            assert len(runs) == max(1, min(parts, n)) and max(h - lo for lo, h in runs) - min(h - lo for lo, h in runs) <= 1


@pytest.mark.parametrize("which", ["first", "last"])
def test_a_missing_block_is_raised_from_any_run_after_all_runs_end(resident, monkeypatch, which):
    """cpus > 1: the calling thread gathers the first run, the workers the others; a block missing from the
    step is one ValueError whichever run meets it, raised once every run has ended."""
    import solar.buffer.gather as gather
    monkeypatch.setattr(gather, "MIN_PART_BYTES", 1)
    layout, outs = resident("ptychonn", "contiguous")
    samples = np.arange(min(8, layout.n_samples), dtype=np.int64)
    sb = _step_blocks(layout, outs, samples, np.random.default_rng(0))
    gone = int(layout.blocks_of(int(samples[0 if which == "first" else -1]))[0])
    keep = sb.blocks != gone
    partial = StepBlocks(0, sb.blocks[keep], sb.block_class[keep], sb.block_slot[keep], sb.pools,
                         layout.block_nbytes, {})
    many = BatchAssembler(layout, cpus=4)
    try:
        with pytest.raises(ValueError, match=f"block {gone} of field"):
            many(0, samples, partial)
        assert many._pool._work_queue.empty()  # no run left behind
    finally:
        many.close()


def test_assembler_cpus_is_checked(resident):
    layout, _ = resident("ptychonn", "contiguous")
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(solar.SpecError, match="cpus must be an integer >= 1"):
            BatchAssembler(layout, cpus=bad)


def _rows_file(path, fields, chunks):
    with h5py.File(path, "w") as f:
        for name, arr in fields.items():
            f.create_dataset(name, data=arr, chunks=chunks if arr.ndim == len(chunks) else chunks[:arr.ndim])


@pytest.mark.parametrize("chunks", [None, (3, 2)])
def test_gather_big_endian_and_scalar_fields(tmp_path, chunks):
    """Big-endian fields come out native with the same bits; a scalar field (N,) gives (n,)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((11, 5)).astype(">f8")
    x[3, 2] = np.frombuffer(b"\x7f\xf8\x00\x00\x00\x00\x12\x34", ">f8")[0]  # a NaN with a payload: bits kept
    y = rng.integers(-9, 9, 11).astype(">i2")
    _rows_file(tmp_path / "a.h5", {"x": x, "y": y}, chunks or (3, 2))
    if chunks is None:
        with h5py.File(tmp_path / "a.h5", "w") as f:
            f.create_dataset("x", data=x)
            f.create_dataset("y", data=y)
    layout = build_layout(LayoutSpec("rows", ("a.h5",), ("x", "y"), root=str(tmp_path)))
    outs = [np.empty(int(n), np.uint8) for n in layout.block_nbytes]
    with get_reader("pread", layout, threads=1) as r:
        r.read_blocks(np.arange(layout.n_blocks), outs)
    samples = np.array([7, 0, 10, 3, 4], np.int64)
    sb = _step_blocks(layout, outs, samples, np.random.default_rng(0))
    new = BatchAssembler(layout)
    assert new.gather
    got = new(0, samples, sb)
    _same_bits(got, BatchAssembler(layout, gather=False)(0, samples, sb))
    assert got["x"].dtype == np.dtype("f8") and got["y"].shape == (5,)
    assert np.array_equal(got["x"].view(np.uint8), x[samples].astype("f8").view(np.uint8))
    assert np.array_equal(got["y"], y[samples])


def test_gather_refuses_a_block_outside_the_step(resident):
    layout, outs = resident("ptychonn", "multi")
    samples = np.array([0, 5], np.int64)
    sb = _step_blocks(layout, outs, np.array([0]), np.random.default_rng(0))  # sample 5's blocks absent
    with pytest.raises(ValueError, match="is not among the step's blocks"):
        BatchAssembler(layout)(0, samples, sb)
    with pytest.raises(BufferError, match="is not among the step's blocks"):
        sb(int(layout.blocks_of(5)[0]))


def test_pools_alloc_many_is_all_or_nothing():
    pools = SlotPools(np.array([8, 16]), np.array([2, 3]))
    a = pools.alloc_many(np.array([1, 0, 1]))
    assert sorted(a[[0, 2]].tolist()) == [0, 1] and a[1] == 0 and pools.in_use() == 8 + 32
    with pytest.raises(MemoryError):
        pools.alloc_many(np.array([0, 0]))  # one class-0 slot left: nothing taken
    assert pools.in_use() == 40
    pools.free_many(np.array([1, 0, 1]), a)
    assert pools.in_use() == 0
    with pytest.raises(ValueError, match="more than were in use"):
        pools.free_many(np.array([0, 0, 0]), np.array([0, 1, 0]))


def test_plan_loading_a_block_twice_in_one_step_is_refused(tmp_path):
    """A damaged plan that loads one block twice in a step used to take two slots for it
    (one leaked, the pools then ran short); it is refused, naming the step and block."""
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=12)
    layout = solar.load_layout(data)
    sched = solar.plan(layout, world_size=1, local_batch=4, epochs=1, buffer_fraction=1.5)
    rp = sched.rank(0)
    arrays = rp.arrays()
    first = int(rp.load[0])
    arrays["load"] = np.concatenate([[first], rp.load])
    arrays["load_count"] = arrays["load_count"].copy()
    arrays["load_count"][0] += 1
    loader = SolarLoader(sched, layout, rank=0)
    loader.rank_plan = RankPlan(0, arrays)
    with pytest.raises(BufferError, match=f"step 0: the plan loads block {first} twice"):
        list(loader)
    loader.close()


# ------------------------------------------------------------------ page cache (pread drop_cache)
def _resident_bytes(path) -> int:
    """Bytes of ``path`` in the page cache (the bench's mincore check)."""
    return int(cached_fraction(path) * os.path.getsize(path))


@pytest.mark.parametrize("storage", ["contiguous", "gzip"])
def test_pread_drops_what_it_read_from_the_page_cache(tmp_path, storage):
    """Read through the page cache (direct_io=False): with drop_cache (the default) the bytes read
    into the buffer do not stay in the page cache a second time; with drop_cache=False they do.  With
    the default direct_io ("auto", O_DIRECT where the file system has it) nothing is cached either.
    Data equal h5py's every way."""
    layout = solar.load_layout(make_dataset(tmp_path, "ptychonn", storage, samples=24, size=64))
    path = layout.files[0]
    blocks = np.flatnonzero(layout.block_offset >= 0)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if _resident_bytes(path) > 0.05 * os.path.getsize(path):
        pytest.skip("this file system keeps pages after POSIX_FADV_DONTNEED (tmpfs?)")
    data_bytes = int(layout.block_stored[blocks].sum())
    rng = np.random.default_rng(0)
    for drop, opts in ((False, {"direct_io": False}), (True, {"direct_io": False}), (True, {})):
        outs = [np.empty(int(layout.block_nbytes[b]), np.uint8) for b in blocks]
        with get_reader("pread", layout, threads=4, drop_cache=drop, **opts) as r:
            for _ in range(3):  # passes in random order and subsets, as epochs of steps read them
                for part in np.array_split(rng.permutation(blocks.shape[0]), 7):
                    r.read_blocks(blocks[part], [outs[i] for i in part])
            assert r.direct == (not opts)
        kept = _resident_bytes(path)
        if drop:
            assert kept < 0.05 * data_bytes, f"{kept} bytes still cached after reading {data_bytes}"
        else:
            assert kept >= 0.9 * data_bytes
        got = dict(zip(blocks.tolist(), outs))

        def block(b, got=got):
            d = layout.block_dataset[b]
            return got[b].view(layout.datasets[d].dtype).reshape(layout.block_shapes[d])
        for s in (0, 23):
            sample = assemble_sample(layout, s, block)
            for k, v in h5py_sample(layout, s).items():
                np.testing.assert_array_equal(sample[k], v)
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def test_pread_page_cache_options_are_checked(resident):
    layout, _ = resident("ptychonn", "contiguous")
    for name in ("drop_cache", "readahead"):
        with pytest.raises(solar.SpecError, match=f"option {name} must be True or False, got 'yes'"):
            get_reader("pread", layout, **{name: "yes"})


def test_fadvise_ranges_merges_per_file_and_reports_failure(tmp_path):
    from solar.io.kernels import fadvise_ranges
    p = tmp_path / "f.bin"
    p.write_bytes(b"\1" * (1 << 20))
    fd = os.open(p, os.O_RDONLY)
    try:
        starts = np.array([0, 4096, 100_000, 700_000, 4000], np.int64)
        lengths = np.array([4096, 10, 5, 1, 96], np.int64)
        fds = np.full(5, fd, np.int64)
        # rounded out to 64 KiB: [0, 64K) three times and [64K, 128K) touch: [0, 128K), then [640K, 704K)
        assert fadvise_ranges(fds, starts, lengths, os.POSIX_FADV_DONTNEED, 1 << 16) == 2
        # unrounded: [0, 4096), [4000, 4096) and [4096, 4106) merge; 100000 and 700000 alone
        assert fadvise_ranges(fds, starts, lengths, os.POSIX_FADV_DONTNEED) == 3
        assert fadvise_ranges(np.array([fd, 10**6], np.int64), np.zeros(2, np.int64), np.ones(2, np.int64),
                              os.POSIX_FADV_DONTNEED) == -2  # the second descriptor is not open: one call made
    finally:
        os.close(fd)


def test_gather_refuses_a_piece_outside_its_slot(resident):
    """A slot smaller than the layout's block (pools that disagree with the geometry) is an
    error before anything is copied, never a read past the slot."""
    layout, outs = resident("ptychonn", "contiguous")
    samples = np.array([1, 2], np.int64)
    sb = _step_blocks(layout, outs, samples, np.random.default_rng(0))
    small = SlotPools(sb.pools.class_bytes // 2, sb.pools.slots)
    bad = StepBlocks(0, sb.blocks, sb.block_class, sb.block_slot, small, layout.block_nbytes, {})
    with pytest.raises(ValueError, match="falls outside its slot or the batch"):
        BatchAssembler(layout)(0, samples, bad)
