"""The buffer's pools on a device (``SolarLoader(buffer_device=...)``, :mod:`solar.buffer.device_pools`), with the
CPU standing in for the GPU: misses staged on the host and copied into device slots, batches gathered there by
torch indexing.  Every batch must be bit for bit the host path's (every preset and storage, evictions, a resume,
blocks the plan wrongly calls hits), and what cannot run on a device buffer is refused by name."""
import os

import numpy as np
import pytest
import torch
from helpers import SMALL, STORAGES, make_dataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import solar
from solar.buffer import SlotPools, StepBlocks
from solar.buffer.device_pools import DevicePools, copy_runs
from solar.loader import BatchAssembler, SolarLoader
from solar.memory import size_classes
from solar.schedule import RankPlan
from solar.scheduler.run import BufferTooSmall

CASES = [(p, s) for p in SMALL for s in STORAGES]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t


def _same(x: dict, y: dict, where=""):
    assert list(x) == list(y), where
    for k in x:
        if torch.is_tensor(x[k]):
            assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, (where, k)
            assert torch.equal(_bits(x[k]), _bits(y[k])), (where, k)
        else:
            assert np.array_equal(np.asarray(x[k]), np.asarray(y[k])), (where, k)


def _plan(data, path, **kw):
    """A 1-rank plan at the smallest of these fractions the data allows (evictions where it can)."""
    for f in (0.5, 0.8, 1.0):
        try:
            return solar.plan(data, world_size=1, local_batch=3, epochs=3, buffer_fraction=f, out=path, **kw).close()
        except BufferTooSmall:
            continue
    raise AssertionError("no fraction planned")


def _epochs(loader, epochs=3):
    out = []
    for e in range(epochs):
        loader.set_epoch(e)
        out += list(loader)
    return out


@pytest.mark.parametrize("preset,storage", CASES, ids=[f"{p}-{s}" for p, s in CASES])
def test_device_buffer_gives_the_host_paths_batches(tmp_path, preset, storage):
    data = make_dataset(tmp_path, preset, storage)
    path = str(tmp_path / "plan.h5")
    _plan(data, path)
    with SolarLoader(path, data, cpus=1) as host, SolarLoader(path, data, cpus=1, buffer_device="cpu") as dev:
        a, b = _epochs(host), _epochs(dev)
        assert len(a) == len(b) > 0
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"step {i}")
            assert isinstance(y["index"], torch.Tensor) and y["index"].device.type == "cpu"
        hs, ds = host.stats(), dev.stats()
        for k in ("hits", "misses", "bytes_loaded", "plan_violations"):
            assert hs[k] == ds[k], k
        from solar.buffer.device_pools import DevicePools
        assert isinstance(dev.buffer.pools, DevicePools) and not isinstance(host.buffer.pools, DevicePools)


def test_resume_on_a_device_buffer(tmp_path):
    """A state taken mid-epoch, loaded into a device-buffer loader: its warm-up reads go through the staging rows
    too, and the batches from there on are the uninterrupted host run's."""
    data = make_dataset(tmp_path, "ptychonn", "chunked", samples=30)
    path = str(tmp_path / "plan.h5")
    solar.plan(data, world_size=2, local_batch=3, epochs=3, buffer_fraction=0.4, out=path).close()
    with SolarLoader(path, data, rank=1, cpus=1) as full:
        ref = _epochs(full)
    with SolarLoader(path, data, rank=1, cpus=1, buffer_device="cpu") as a:
        a.set_epoch(0)
        it = iter(a)
        first = [next(it) for _ in range(4)]
        state = a.state_dict()
    with SolarLoader(path, data, rank=1, cpus=1, buffer_device="cpu") as b:
        b.load_state_dict(state)
        rest = list(b) + [x for e in (1, 2) for x in (b.set_epoch(e), list(b))[1]]
        assert b.buffer.warmup["blocks"] > 0 and b.stats()["plan_violations"] == 0
    got = first + rest
    assert len(got) == len(ref)
    for i, (x, y) in enumerate(zip(got, ref)):
        _same(x, y, f"step {i}")


def test_a_block_the_plan_wrongly_calls_a_hit_is_read_and_gathered_right(tmp_path):
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=12)
    layout = solar.load_layout(data)
    sched = solar.plan(layout, world_size=1, local_batch=4, epochs=1, buffer_fraction=1.5)
    arrays = sched.rank(0).arrays()
    arrays["load"] = arrays["load"][1:]  # the plan now calls the first block a hit
    arrays["load_count"] = arrays["load_count"].copy()
    arrays["load_count"][0] -= 1
    out = {}
    for dev in (None, "cpu"):
        loader = SolarLoader(sched, layout, rank=0, cpus=1, buffer_device=dev)
        loader.rank_plan = RankPlan(0, arrays)
        out[dev] = list(loader)
        assert loader.stats()["plan_violations"] >= 1
        loader.close()
    for x, y in zip(out[None], out["cpu"]):
        _same(x, y)


@pytest.mark.parametrize("preset,storage", CASES, ids=[f"{p}-{s}" for p, s in CASES])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_device_gather_equals_host_gather(tmp_path_factory, preset, storage, data):
    """One step's blocks at random slots, in host pools and in device pools holding the same bytes: the device
    gather (runs listed on the host, copied by torch indexing) equals the host gather bit for bit."""
    key = f"{preset}-{storage}"
    cache = test_device_gather_equals_host_gather.__dict__.setdefault("cache", {})
    if key not in cache:
        layout = solar.load_layout(make_dataset(tmp_path_factory.mktemp("g"), preset, storage))
        outs = [np.empty(int(n), np.uint8) for n in layout.block_nbytes]
        with solar.io.get_reader("pread", layout, threads=1) as r:
            r.read_blocks(np.arange(layout.n_blocks), outs)
        cache[key] = (layout, outs)
    layout, outs = cache[key]
    n = data.draw(st.integers(1, layout.n_samples), label="batch")
    samples = np.array(data.draw(st.permutations(range(layout.n_samples)))[:n], dtype=np.int64)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
    need = np.unique(np.concatenate([layout.blocks_of(int(s)) for s in samples]))
    class_of, class_bytes = size_classes(layout.block_nbytes)
    cls = class_of[need].astype(np.int64)
    slots = np.bincount(cls, minlength=class_bytes.shape[0]) + 3
    host, dev = SlotPools(class_bytes, slots), DevicePools(class_bytes, slots, "cpu")
    for c in range(class_bytes.shape[0]):
        host.stack[c][:] = rng.permutation(host.stack[c])
        dev.stack[c][:] = host.stack[c]
    slot = host.alloc_many(cls)
    assert np.array_equal(dev.alloc_many(cls), slot)
    views, pending = dev.stage(cls, slot, layout.block_nbytes[need])
    for b, c, i, v in zip(need.tolist(), cls.tolist(), slot.tolist(), views):
        host.view(c, i)[:outs[b].shape[0]] = outs[b]
        v[:] = outs[b]
    dev.commit(pending)
    asm = BatchAssembler(layout)
    assert asm.gather, asm.tables.why
    ref = asm(0, samples, StepBlocks(0, need, cls, slot, host, layout.block_nbytes, {}))
    got = asm(0, samples, StepBlocks(0, need, cls, slot, dev, layout.block_nbytes, {})).hand_over()
    _same({k: torch.from_numpy(v) for k, v in ref.items()}, got)


def test_copy_runs_aligned_and_unaligned():
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(24, dtype=torch.uint8)
    runs = np.array([[10, 0, 4], [40, 4, 4], [3, 8, 4],       # starts at multiples of 4: rows of 4
                     [20, 13, 3], [50, 18, 3], [60, 21, 2]],  # unaligned: byte indices
                    dtype=np.int64)
    copy_runs(src, dst, runs, lambda v: torch.from_numpy(np.asarray(v, np.int64)))
    want = np.zeros(24, np.uint8)
    for s, d, n in runs.tolist():
        want[d:d + n] = np.arange(64, dtype=np.uint8)[s:s + n]
    assert np.array_equal(dst.numpy(), want)


def test_big_endian_fields_come_out_native_from_a_device_buffer(tmp_path):
    import h5py
    rng = np.random.default_rng(3)
    x = rng.standard_normal((11, 5)).astype(">f8")
    y = rng.integers(-9, 9, 11).astype(">i2")
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f.create_dataset("x", data=x, chunks=(3, 2))
        f.create_dataset("y", data=y, chunks=(3,))
    spec = solar.LayoutSpec("rows", ("a.h5",), ("x", "y"), root=str(tmp_path))
    layout = solar.build_layout(spec)
    sched = solar.plan(layout, world_size=1, local_batch=4, epochs=2, buffer_fraction=1.0)
    with SolarLoader(sched, layout, rank=0, cpus=1, buffer_device="cpu") as loader:
        for e in range(2):
            loader.set_epoch(e)
            for b in loader:
                idx = b["index"].numpy()
                assert b["x"].dtype == torch.float64 and np.array_equal(b["x"].numpy(), x[idx].astype("f8"))
                assert np.array_equal(b["y"].numpy(), y[idx].astype("i2"))


def test_what_a_device_buffer_refuses(tmp_path):
    from solar.loader.loader import _check_buffer_device
    assert _check_buffer_device(None, None, True, None, None, None) is None
    assert _check_buffer_device("cpu", None, True, None, None, None) == torch.device("cpu")
    for kw, why in ((dict(nodes=object()), "node plan"), (dict(as_torch=False), "as_torch=False"),
                    (dict(device="cpu"), "device="), (dict(transform=lambda b: b), "transform=")):
        args = {**dict(nodes=None, as_torch=True, device=None, transform=None, sample_transform=None), **kw}
        with pytest.raises(solar.SpecError, match=why):
            _check_buffer_device("cpu", args["nodes"], args["as_torch"], args["device"], args["transform"],
                                 args["sample_transform"])
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=8)
    path = str(tmp_path / "plan.h5")
    solar.plan(data, world_size=1, local_batch=2, epochs=1, buffer_fraction=1.0, out=path).close()
    with pytest.raises(solar.SpecError, match="is not a torch device"):
        SolarLoader(path, data, buffer_device="gpu7")
    if not torch.cuda.is_available():
        with pytest.raises(solar.SpecError, match="CUDA is not available"):
            SolarLoader(path, data, buffer_device="cuda")


def test_a_layout_the_gather_cannot_take_is_refused_at_start(tmp_path):
    """Samples of different shapes (a `whole` layout over uneven files) take the per-block path on the host: a
    device buffer says so when the loader is built, not at the first batch."""
    import h5py
    for i, n in enumerate((3, 5)):
        with h5py.File(tmp_path / f"f{i}.h5", "w") as f:
            f.create_dataset("x", data=np.arange(n * 2, dtype="f4").reshape(n, 2))
    spec = solar.LayoutSpec("whole", ("f0.h5", "f1.h5"), ("x",), root=str(tmp_path))
    layout = solar.build_layout(spec)
    sched = solar.plan(layout, world_size=1, local_batch=1, epochs=1, buffer_fraction=1.0)
    with pytest.raises(solar.SpecError, match="cannot be gathered on a device .*samples differ in shape"):
        SolarLoader(sched, layout, rank=0, buffer_device="cpu")


def test_a_plan_for_a_device_buffer(tmp_path, capsys):
    """solar plan --device-buffer: the residency planned with the device's budget (the same plan as that budget on
    the host), the file says where the buffer lives, the loader keeps its pools there by default (CUDA; here it
    names what to do without it) and runs it on the CPU stand-in; --buffer-per-rank is the host's budget for the
    staged reads."""
    from solar.cli import main
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=24)
    dev, host = str(tmp_path / "dev.h5"), str(tmp_path / "host.h5")
    assert main(["plan", data, "-P", "2", "-b", "3", "--epochs", "2", "--device-buffer", "300KiB", "-o", dev]) == 0
    assert main(["plan", data, "-P", "2", "-b", "3", "--epochs", "2", "--buffer-per-rank", "300KiB", "-o", host]) == 0
    capsys.readouterr()
    with solar.Schedule.load(dev) as d, solar.Schedule.load(host) as h:
        assert d.buffer_place == "device" and h.buffer_place == "host"
        assert d.config == h.config
        for r in range(2):
            a, b = d.rank(r).arrays(), h.rank(r).arrays()
            assert all(np.array_equal(a[k], b[k]) for k in a)
    if not torch.cuda.is_available():
        with pytest.raises(solar.SpecError, match="plans its buffer in GPU memory .* buffer_device='cpu'"):
            SolarLoader(dev, data, rank=0)
    with SolarLoader(dev, data, rank=0, buffer_device="cpu", cpus=1) as a, SolarLoader(host, data, rank=0, cpus=1) as b:
        for x, y in zip(_epochs(a, 2), _epochs(b, 2)):
            _same(x, y)
        assert isinstance(a.buffer.pools, DevicePools)
    assert main(["plan", data, "-P", "2", "-b", "3", "--epochs", "2", "--device-buffer", "300KiB",
                 "--buffer-per-rank", "1KiB", "-o", str(tmp_path / "x.h5")]) == 2
    assert "cannot stage a device buffer's reads" in capsys.readouterr().err
    for extra, why in ((["--buffer-fraction", "0.5"], "the device budget is in bytes"),
                       (["--ranks-per-node", "2"], "--device-buffer plans one buffer per rank on its GPU: not with --ranks-per-node")):
        assert main(["plan", data, "-P", "2", "-b", "3", "--epochs", "2", "--device-buffer", "300KiB", *extra,
                     "-o", str(tmp_path / "y.h5")]) == 2
        assert why in capsys.readouterr().err
    assert main(["plan", data, "-P", "2", "-b", "3", "--epochs", "2", "-o", str(tmp_path / "z.h5")]) == 2
    assert "--buffer-per-rank, --buffer-fraction or --device-buffer" in capsys.readouterr().err


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 12)), min_size=1, max_size=12), st.integers(0, 3))
def test_copy_runs_equals_a_copy_per_run(runs, pad):
    """Runs of any lengths at any source offsets, laid end to end (with ``pad`` bytes between) in the destination:
    the same bytes as copying each run on its own (the row width is the gcd of the length and the starts)."""
    src = torch.from_numpy(np.random.default_rng(len(runs)).integers(0, 256, 256, dtype=np.uint8))
    rows, d = [], 0
    for s, n in runs:
        rows.append((s, d, n))
        d += n + pad
    dst = torch.zeros(d + 16, dtype=torch.uint8)
    want = dst.numpy().copy()
    for s, dd, n in rows:
        want[dd:dd + n] = src.numpy()[s:s + n]
    copy_runs(src, dst, np.array(rows, np.int64), lambda v: torch.from_numpy(np.asarray(v, np.int64)))
    assert np.array_equal(dst.numpy(), want)


def test_a_device_buffers_resume_stages_its_reads_in_parts(tmp_path, monkeypatch):
    """The warm-up of a resumed device buffer reads the resident blocks in parts of bounded host staging (all at
    once it would pin as much host memory as the GPU buffer holds), and the batches are the same."""
    import solar.buffer.rank_place as rank_place
    monkeypatch.setattr(rank_place, "WARMUP_STAGING", 4096)  # a few blocks a part
    staged = []
    orig = DevicePools.stage

    def stage(self, classes, slots, nbytes):
        staged.append(int(np.sum(nbytes)))
        return orig(self, classes, slots, nbytes)
    monkeypatch.setattr(DevicePools, "stage", stage)
    data = make_dataset(tmp_path, "ptychonn", "chunked", samples=30)
    path = str(tmp_path / "plan.h5")
    solar.plan(data, world_size=1, local_batch=3, epochs=2, buffer_fraction=0.6, out=path).close()
    with SolarLoader(path, data, rank=0, cpus=1) as full:
        ref = _epochs(full, 2)
    with SolarLoader(path, data, rank=0, cpus=1) as a:
        a.set_epoch(0)
        it = iter(a)
        [next(it) for _ in range(6)]
        state = a.state_dict()
    staged.clear()
    with SolarLoader(path, data, rank=0, cpus=1, buffer_device="cpu") as b:
        b.load_state_dict(state)
        got = list(b) + [x for x in (b.set_epoch(1), list(b))[1]]
        warm = b.buffer.warmup["blocks"]
    assert warm > 2 and len(staged) >= 2 and max(staged[:2]) <= 4096 + 1024  # the first parts: the warm-up's
    for i, (x, y) in enumerate(zip(got, ref[6:])):
        _same(x, y, f"step {i + 6}")


def test_device_given_with_a_planned_gpu_buffer_is_where_the_batches_are(tmp_path, monkeypatch):
    """A plan made with --device-buffer and SolarLoader(device='cuda'): the batches are gathered on the GPU
    already, so device= is dropped instead of refused (the user never named buffer_device); with CUDA mocked and
    the CPU standing in for the GPU's memory."""
    import solar.loader.loader as ld
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=12)
    path = str(tmp_path / "dev.h5")
    solar.plan(data, world_size=1, local_batch=3, epochs=1, device_buffer="200KiB", out=path).close()
    monkeypatch.setattr(ld, "_planned_device", lambda schedule: "cpu")
    with SolarLoader(path, data, rank=0, cpus=1, device="cuda") as a:
        assert a.buffer_device == torch.device("cpu") and a.hooks.mover is None
        assert len(list(a)) == 4
    # a GPU named by its index is where the buffer goes (not the rank's default GPU)
    import solar.buffer.device_pools as dp
    asked = []
    monkeypatch.setattr(dp, "torch_device", lambda d: asked.append(str(d)) or torch.device("cpu"))
    with SolarLoader(path, data, rank=0, cpus=1, device="cuda:1") as a:
        assert asked[0] == "cuda:1" and a.hooks.mover is None
        assert len(list(a)) == 4


def test_a_buffer_device_of_another_kind_is_refused(tmp_path):
    """Only CUDA and the CPU (standing in for a GPU) hold a buffer: other torch devices are refused by name when
    the loader is built, not at the first batch (meta would hand out tensors without data)."""
    from solar.buffer.device_pools import torch_device
    for name in ("meta", "xpu", "mps", "hpu"):
        with pytest.raises(solar.SpecError, match=f"not on '{name}'"):
            torch_device(name)
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=8)
    path = str(tmp_path / "plan.h5")
    solar.plan(data, world_size=1, local_batch=2, epochs=1, buffer_fraction=1.0, out=path).close()
    with pytest.raises(solar.SpecError, match="not on 'meta'"):
        SolarLoader(path, data, buffer_device="meta")


def test_host_staging_stays_within_the_host_budget_the_plan_was_made_for(tmp_path, monkeypatch):
    """A device plan on parts of chunks (a step also loads the rows of its chunks that later steps use) with the
    smallest host budget solar plan accepts: the host rows staged at once never exceed the plan's
    host_staging_bytes (they reached 3.3x it before the loader booked steps by their staged bytes), and the
    batches are the host path's."""
    import weakref

    import solar.buffer.device_pools as dp
    from solar.memory import DEFAULT_IO_DEPTH, bookkeeping_bytes, demand_batch_bytes
    data = make_dataset(tmp_path, "ptychonn", "gzip", samples=60)
    probe = str(tmp_path / "probe.h5")
    solar.plan(data, world_size=1, local_batch=4, epochs=2, device_buffer="64MiB", out=probe).close()
    with solar.Schedule.load(probe) as s:
        d = s.demand()
        assert s.host_staging_bytes == 0 and s.summary()["parts_of_chunks"]
    keep = bookkeeping_bytes(d["sample_ptr"].shape[0] - 1, d["block_nbytes"].shape[0], d["sample_blocks"].shape[0])
    host = DEFAULT_IO_DEPTH * demand_batch_bytes(d["sample_ptr"], d["sample_blocks"], d["block_nbytes"], 4) + keep
    path = str(tmp_path / "dev.h5")
    solar.plan(data, world_size=1, local_batch=4, epochs=2, device_buffer="64MiB", buffer_per_rank=host,
               out=path).close()
    with pytest.raises(solar.SpecError, match="cannot stage a device buffer's reads"):
        solar.plan(data, world_size=1, local_batch=4, epochs=2, device_buffer="64MiB", buffer_per_rank=host - 1,
                   out=str(tmp_path / "small.h5")).close()
    live, peak = {}, [0]
    made = dp.DevicePools._host

    def host_rows(self, rows, width):
        t, v = made(self, rows, width)
        live[id(t)] = rows * width
        peak[0] = max(peak[0], sum(live.values()))
        weakref.finalize(t, live.pop, id(t), None)
        return t, v
    monkeypatch.setattr(dp.DevicePools, "_host", host_rows)
    ref = str(tmp_path / "host.h5")
    solar.plan(data, world_size=1, local_batch=4, epochs=2, buffer_per_rank="64MiB", out=ref).close()
    with SolarLoader(path, data, cpus=1, buffer_device="cpu") as dev, SolarLoader(ref, data, cpus=1) as hst:
        limit = dev.schedule.host_staging_bytes
        assert limit == host - keep
        got, want = _epochs(dev, 2), _epochs(hst, 2)
    loads = [int(ld.sum()) for ld in _step_load_bytes(path)]
    assert max(loads) <= limit < sum(sorted(loads)[-2:])  # two steps' loads would not fit: the bound is tested
    assert 0 < peak[0] <= limit, (peak[0], limit)
    for i, (x, y) in enumerate(zip(got, want)):
        _same({k: v for k, v in x.items() if k != "weight"}, {k: v for k, v in y.items() if k != "weight"}, i)


def _step_load_bytes(path):
    with solar.Schedule.load(path) as s:
        p, nb = s.rank(0), s.demand()["block_nbytes"]
        return [nb[np.asarray(p.load[p.load_ptr[g]:p.load_ptr[g + 1]], np.int64)] for g in range(s.n_steps)]


def test_a_step_that_alone_stages_more_than_the_host_budget_is_refused_by_solar_plan(tmp_path):
    """16 samples a chunk, planned on parts: a step loads the rows of its chunks that later steps use, up to 16
    local batches' blocks, beyond the 4 steps' worth solar plan first checks.  solar plan refuses such a host
    budget naming the step and the budget that holds it, and leaves no file; that budget plans and runs."""
    import re

    from solar.gen import GenConfig, Storage, generate
    data = str(tmp_path / "d")
    generate("ptychonn", data, GenConfig(seed=0, samples=128, size=8, storage=Storage.preset("gzip", chunk_samples=16)))
    probe = str(tmp_path / "probe.h5")
    solar.plan(data, world_size=1, local_batch=4, epochs=2, device_buffer="64MiB", out=probe).close()
    with solar.Schedule.load(probe) as s:
        d = s.demand()
    from solar.memory import DEFAULT_IO_DEPTH, bookkeeping_bytes, demand_batch_bytes
    keep = bookkeeping_bytes(d["sample_ptr"].shape[0] - 1, d["block_nbytes"].shape[0], d["sample_blocks"].shape[0])
    host = DEFAULT_IO_DEPTH * demand_batch_bytes(d["sample_ptr"], d["sample_blocks"], d["block_nbytes"], 4) + keep
    path = str(tmp_path / "dev.h5")
    with pytest.raises(solar.SpecError, match=r"cannot stage the device buffer's reads of step \d+ of rank 0: .*"
                                              r"raise buffer_per_rank= to at least") as ei:
        solar.plan(data, world_size=1, local_batch=4, epochs=2, device_buffer="64MiB", buffer_per_rank=host,
                   out=path)
    assert sorted(os.listdir(tmp_path)) == ["d", "probe.h5"]  # nothing written, nothing left
    before = open(probe, "rb").read()  # -o an existing schedule: a refused plan leaves it as it was
    for epochs in (2, "auto"):
        with pytest.raises(solar.SpecError, match="cannot stage the device buffer's reads"):
            solar.plan(data, world_size=1, local_batch=4, epochs=epochs, device_buffer="64MiB", buffer_per_rank=host,
                       out=probe)
        assert open(probe, "rb").read() == before and sorted(os.listdir(tmp_path)) == ["d", "probe.h5"]
    need = int(re.search(r"at least ([\d,]+) bytes", str(ei.value)).group(1).replace(",", ""))
    solar.plan(data, world_size=1, local_batch=4, epochs=2, device_buffer="64MiB", buffer_per_rank=need,
               out=path).close()
    with SolarLoader(path, data, cpus=1, buffer_device="cpu") as ld:
        assert sum(len(b["index"]) for b in _epochs(ld, 2)) == 2 * 128


def test_a_device_buffer_s_batches_pass_dataloader_s_pin_memory_step_as_they_are(tmp_path):
    """DataLoader(pin_memory=True), as SolarDataset's docs show it, over a device plan: its pin step hands the
    batch on untouched (pinning a CUDA tensor raises), the same dict with the same tensors."""
    from torch.utils.data._utils.pin_memory import pin_memory
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=8)
    path = str(tmp_path / "plan.h5")
    solar.plan(data, world_size=1, local_batch=4, epochs=1, device_buffer="1MiB", out=path).close()
    with SolarLoader(path, data, cpus=1, buffer_device="cpu") as dev:
        b = next(iter(dev))
        assert pin_memory(b) is b and isinstance(b, dict)
