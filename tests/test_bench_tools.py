"""Tools of ``solar bench``: the h5py/DataLoader baseline, cold page cache, the disk's sequential speed."""
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
from conftest import on_root
from helpers import assert_same_sample, h5py_sample, make_dataset

from solar.bench import (
    H5Samples,
    cached_fraction,
    cold_sequential_read,
    drop_all_caches,
    drop_file_cache,
    make_cache_dropper,
    memlimit,
    run_baseline,
    warm_sequential_read,
)
from solar.bench import cache as cache_mod
from solar.bench.baseline import BASELINES, BatchSamples, baseline_dataset, skip_reason
from solar.bench.disk import cold_parallel_sequential_read, cold_random_read, replay_reads, typical_block
from solar.errors import SolarError
from solar.layout import load_layout
from solar.scheduler.sampler import sampler_sizes

MIB = 1 << 20


def _fs_type(path: str) -> str:
    """Filesystem type holding ``path`` (longest mount point in /proc/self/mountinfo)."""
    path = os.path.realpath(path)
    best, kind = "", "?"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            mnt = left.split()[4]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, right.split()[0]
    return kind


def _write(path, nbytes: int) -> str:
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return str(path)


# ------------------------------------------------------------------ H5Samples
@pytest.mark.parametrize("preset,storage", [("ptychonn", "contiguous"), ("ptychonn", "lzf"), ("well", "chunked")])
def test_h5samples_returns_h5py_data(tmp_path, preset, storage):
    out = make_dataset(tmp_path, preset, storage)
    layout = load_layout(out)
    ds = H5Samples(out)
    assert len(ds) == layout.n_samples
    for i in range(len(ds)):
        got = ds[i]
        assert_same_sample({k: v.numpy() for k, v in got.items()}, h5py_sample(layout, i))
    with pytest.raises(IndexError, match=str(len(ds))):
        ds[len(ds)]
    copy = pickle.loads(pickle.dumps(ds))  # after opening a handle: pickles without it
    assert copy._handles == {} and ds._handles
    assert_same_sample({k: v.numpy() for k, v in copy[1].items()}, h5py_sample(layout, 1))
    ds.close()
    copy.close()


def test_baseline_import_does_not_pull_mpi4py():
    code = "import sys, solar.bench.baseline; sys.exit(int('mpi4py' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --------------------------------------------------------------- run_baseline
@pytest.mark.mpi
@pytest.mark.parametrize("num_workers", [0, 2])
def test_run_baseline_delivers_the_sampler_share(comm, shared_tmp, num_workers):
    out = on_root(comm, lambda: make_dataset(shared_tmp, "ptychonn", samples=13))
    layout = load_layout(out)
    drop, desc = make_cache_dropper(layout.files, "file", comm=comm)
    assert "DONTNEED" in desc
    res = run_baseline(out, comm=comm, local_batch=3, epochs=2, seed=5, num_workers=num_workers,
                       drop_cache=drop, verify=1000)  # verify >= samples: every delivered sample is checked
    per_rank, total = sampler_sizes(13, comm.size, drop_last=False)
    sample_bytes = int(layout.sample_used_nbytes()[0])
    assert [r["epoch"] for r in res] == [0, 1]
    for r in res:
        assert r["samples"] == per_rank and r["global_samples"] == total
        assert r["verified"] == per_rank
        assert r["bytes_delivered"] == per_rank * sample_bytes and r["global_bytes"] == total * sample_bytes
        assert 0 < r["rank_seconds"] <= r["seconds"]
        assert r["samples_per_s"] == pytest.approx(total / r["seconds"])
        assert 0 <= r["stall_s"] <= r["stall_max_s"] <= r["seconds"]
    assert comm.allgather(res[0]["seconds"]) == [res[0]["seconds"]] * comm.size
    assert not any(r["partial"] for r in res)


@pytest.mark.mpi
def test_baseline_time_limit_stops_an_epoch_and_says_so(comm, shared_tmp):
    """An epoch longer than the limit stops after it on every rank; its rate is over what was delivered."""
    out = on_root(comm, lambda: make_dataset(shared_tmp, "ptychonn", samples=40))
    res = run_baseline(out, comm=comm, local_batch=2, epochs=1, num_workers=0, step_time=0.05, time_limit=0.12)
    per_rank, total = sampler_sizes(40, comm.size, drop_last=False)
    r = res[0]
    assert r["partial"] and 0 < r["samples"] < per_rank and r["global_samples"] < total
    assert r["samples"] % 2 == 0 and r["samples"] <= 2 * 4  # stops at the first batch past 0.12 s: 3-4 steps of 0.05 s
    assert r["samples_per_s"] == pytest.approx(r["global_samples"] / r["seconds"])
    with pytest.raises(SolarError, match="time_limit must be > 0 seconds or None, got -1"):
        run_baseline(out, comm=comm, local_batch=2, epochs=1, num_workers=0, time_limit=-1)


def test_run_baseline_verify_catches_wrong_samples(comm, tmp_path, monkeypatch):
    out = make_dataset(tmp_path, "ptychonn")
    real = H5Samples.where
    monkeypatch.setattr(H5Samples, "where", lambda self, i: real(self, (i + 1) % len(self)))
    with pytest.raises(SolarError, match="wrong data for sample"):
        run_baseline(out, comm=comm, local_batch=4, epochs=1, num_workers=0, verify=3)


@pytest.mark.parametrize("bad,match", [(dict(local_batch=0), "local_batch.*0"), (dict(epochs=-1), "epochs.*-1"),
                                       (dict(num_workers=1.5), "num_workers.*1.5"),
                                       (dict(step_time=-0.1), "step_time.*-0.1"),
                                       (dict(start_method="fork"), "start method.*'fork'")])
def test_run_baseline_rejects_bad_arguments(comm, tmp_path, bad, match):
    kw = dict(local_batch=2, epochs=1)
    kw.update(bad)
    with pytest.raises(SolarError, match=match):
        run_baseline(str(tmp_path), comm=comm, **kw)


# ---------------------------------------------------------------- page cache
def test_fadvise_drops_what_mincore_sees(tmp_path):
    path = _write(tmp_path / "blob.bin", 16 * MIB)
    with open(path, "rb") as f:
        while f.read(4 * MIB):
            pass
    assert cached_fraction(path) > 0.95
    desc = drop_file_cache([path])
    assert "DONTNEED" in desc and "1 file" in desc
    left = cached_fraction(path)
    if left > 0.05 and _fs_type(path) in ("tmpfs", "ramfs", "overlay", "9p", "fuse"):
        pytest.skip(f"{_fs_type(path)} ignores POSIX_FADV_DONTNEED ({left:.0%} still cached)")
    assert left < 0.05
    fd = os.open(path, os.O_RDONLY)  # reading half brings back about half (no kernel readahead past it)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(fd, 8 * MIB, 0)
    finally:
        os.close(fd)
    assert 0.45 < cached_fraction(path) < 0.8


def test_cache_tools_edge_cases(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert cached_fraction(str(empty)) == 0.0
    drop_file_cache(str(empty))
    missing = str(tmp_path / "missing.h5")
    with pytest.raises(SolarError, match="missing.h5"):
        cached_fraction(missing)
    with pytest.raises(SolarError, match="missing.h5"):
        drop_file_cache([missing])
    with pytest.raises(SolarError, match="missing.h5"):
        make_cache_dropper([missing], "file")
    with pytest.raises(SolarError, match="'cold'"):
        make_cache_dropper([str(empty)], "cold")
    drop, desc = make_cache_dropper([missing], "none")
    assert drop() is None and "none" in desc
    monkeypatch.setattr(cache_mod, "DROP_CACHES", str(tmp_path / "no-such-dir" / "drop_caches"))
    with pytest.raises(SolarError, match="drop_caches"):
        drop_all_caches()
    with pytest.raises(SolarError, match="does not exist"):
        make_cache_dropper([str(empty)], "system")


@pytest.mark.mpi
def test_system_dropper_refuses_on_every_rank(comm, tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "DROP_CACHES", str(tmp_path / "no-such-dir" / "drop_caches"))
    with pytest.raises(SolarError, match="does not exist"):
        make_cache_dropper([], "system", comm=comm)


# --------------------------------------------------------------------- disk
def test_sequential_reads(tmp_path):
    path = _write(tmp_path / "seq.bin", 6 * MIB + 123)
    cold = cold_sequential_read([path], block=MIB)
    assert cold["bytes"] == 6 * MIB + 123 and cold["bytes_per_s"] > 0 and cold["files"] == 1
    assert cold["method"].startswith("cold: posix_fadvise")
    part = cold_sequential_read([path, path], block=MIB, max_bytes=7 * MIB)
    assert part["bytes"] == 7 * MIB and part["files"] == 2
    warm = warm_sequential_read(path, max_bytes=2 * MIB)
    assert warm["bytes"] == 2 * MIB and warm["method"].startswith("warm")
    with pytest.raises(SolarError, match="100"):
        cold_sequential_read([path], block=100)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with pytest.raises(SolarError, match="0 bytes"):
        cold_sequential_read([str(empty)])


# ------------------------------------------------------------------ the baselines


@pytest.mark.parametrize("preset,storage", [("ptychonn", "contiguous"), ("ptychonn", "gzip"), ("ptychonn", "multi"),
                                            ("well", "chunked"), ("well", "contiguous")])
def test_every_baseline_equals_h5py(tmp_path, preset, storage):
    out = make_dataset(tmp_path, preset, storage)
    layout = load_layout(out)
    ran = 0
    for kind in BASELINES:
        if skip_reason(layout, kind):
            continue
        ran += 1
        ds = baseline_dataset(out, kind, layout, memory_bytes=MIB, workers=2)
        n = len(ds)
        if isinstance(ds, BatchSamples):  # a batch in sampler order, with a repeat (DistributedSampler pads)
            ids = [n - 1, 0, 2 % n, 0]
            got = ds[ids]
            for j, i in enumerate(ids):
                assert_same_sample({k: v[j].numpy() for k, v in got.items()}, h5py_sample(layout, i))
        else:
            for i in range(n):
                assert_same_sample({k: v.numpy() for k, v in ds[i].items()}, h5py_sample(layout, i))
        ds.close()
    assert ran >= 2


def test_skip_reasons(tmp_path):
    gz = load_layout(make_dataset(tmp_path, "ptychonn", "gzip"))
    flat = load_layout(make_dataset(tmp_path, "ptychonn", "contiguous"))
    well = load_layout(make_dataset(tmp_path, "well", "chunked"))
    assert "chunked and filtered" in skip_reason(gz, "memmap")
    assert "contiguous" in skip_reason(flat, "h5py-cache")
    assert "windows" in skip_reason(well, "batched")
    assert [skip_reason(flat, k) for k in ("torch", "memmap", "batched")] == [None] * 3
    with pytest.raises(SolarError, match="'nope'"):
        skip_reason(flat, "nope")
    with pytest.raises(SolarError, match="memmap does not apply.*chunked"):
        run_baseline(os.path.join(str(tmp_path), "ptychonn-gzip-0"), comm=None, local_batch=2, epochs=1,
                     num_workers=0, kind="memmap")


def test_torch_baseline_keeps_datasets_open(tmp_path, monkeypatch):
    import h5py
    out = make_dataset(tmp_path, "ptychonn", "chunked")
    opened = []
    real = h5py.Group.__getitem__
    monkeypatch.setattr(h5py.Group, "__getitem__", lambda self, name: opened.append(name) or real(self, name))
    ds = H5Samples(out)
    ds[0]
    first = len(opened)
    for i in range(len(ds)):
        ds[i]
    assert first > 0 and len(opened) == first  # datasets looked up once, not per field of every sample
    ds.close()


def test_h5py_cache_sizes_the_chunk_cache(tmp_path):
    out = make_dataset(tmp_path, "ptychonn", "gzip")
    layout = load_layout(out)
    ds = baseline_dataset(out, "h5py-cache", layout, memory_bytes=8 * MIB, workers=2)
    ds[0]
    per = 8 * MIB // (2 * len(layout.datasets))
    for d in ds._open.values():
        assert d.id.get_access_plist().get_chunk_cache()[1] == per
    ds.close()
    with pytest.raises(SolarError, match="h5py-cache needs the memory"):
        baseline_dataset(out, "h5py-cache", layout)


def test_memmap_batch_leaves_no_mapping(tmp_path):
    out = make_dataset(tmp_path, "ptychonn", "contiguous")
    layout = load_layout(out)
    ds = baseline_dataset(out, "memmap", layout)
    ds[[1, 0]]
    with open("/proc/self/maps") as f:  # a mapping held across epochs would pin the pages in the cache
        assert not any(os.path.realpath(layout.files[0]) in line for line in f)
    with pytest.raises(IndexError, match="sample ids"):
        ds[[len(ds)]]


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["memmap", "batched"])
def test_batch_baselines_deliver_the_sampler_order(comm, shared_tmp, kind):
    out = on_root(comm, lambda: make_dataset(shared_tmp, "ptychonn", samples=13))
    res = run_baseline(out, comm=comm, local_batch=3, epochs=2, seed=5, num_workers=0, kind=kind,
                       verify=1000)  # every delivered sample checked against h5py, position by position
    per_rank, total = sampler_sizes(13, comm.size, drop_last=False)
    assert [r["samples"] for r in res] == [per_rank] * 2 and [r["verified"] for r in res] == [per_rank] * 2
    assert all(r["global_samples"] == total for r in res)


def test_page_cache_left_is_reported(tmp_path):
    out = make_dataset(tmp_path, "ptychonn")
    drop, _ = make_cache_dropper(load_layout(out).files, "file")
    res = run_baseline(out, comm=_Serial(), local_batch=4, epochs=1, num_workers=0, drop_cache=drop)
    assert 0.0 <= res[0]["page_cache_left"] <= 1.0


class _Serial:
    """The communicator calls run_baseline makes, for one process without MPI."""
    size, rank = 1, 0

    def Barrier(self):
        pass

    def allgather(self, x):
        return [x]


# ------------------------------------------------------------------ deep-queue disk reads


def test_cold_random_read_reads_the_blocks(tmp_path):
    path = _write(tmp_path / "r.bin", 2 * MIB)
    ext = np.array([[0, off, 64 << 10] for off in range(0, 2 * MIB, 64 << 10)], dtype=np.int64)
    r = cold_random_read([path], ext, depth=4)
    assert r["bytes"] == 2 * MIB and r["reads"] == 32 and r["block_bytes"] == 64 << 10 and r["depth"] == 4
    assert r["bytes_per_s"] > 0 and "POSIX_FADV_RANDOM" in r["method"]
    capped = cold_random_read([path], ext, depth=2, max_bytes=256 << 10)
    assert 256 << 10 <= capped["bytes"] < 2 * MIB
    with pytest.raises(SolarError, match="in flight.*0"):
        cold_random_read([path], ext, depth=0)
    with pytest.raises(SolarError, match="no extents"):
        cold_random_read([path], np.zeros((0, 3), dtype=np.int64))


@pytest.mark.parametrize("direct", [True, False])
def test_replay_reads_the_recorded_extents(tmp_path, direct):
    """Unaligned extents of two files, in their order; bytes count the extents' own bytes."""
    paths = [_write(tmp_path / "a.bin", MIB + 100), _write(tmp_path / "b.bin", 3000)]
    ext = np.array([[0, 5, 70_000], [1, 0, 3000], [0, MIB - 4000, 4100], [0, 200_000, 1]], dtype=np.int64)
    r = replay_reads(paths, ext, depth=3, direct=direct)
    assert r["bytes"] == int(ext[:, 2].sum()) and r["reads"] == 4 and r["depth"] == 3 and r["bytes_per_s"] > 0
    assert r["direct"] in ((True, False) if direct else (False,))  # a file system without O_DIRECT: buffered
    assert ("O_DIRECT" in r["method"]) == r["direct"]
    capped = replay_reads(paths, np.repeat(ext[:1], 64, axis=0), depth=2, max_bytes=200_000, direct=direct)
    assert 200_000 <= capped["bytes"] < 64 * 70_000 and capped["reads"] < 64
    assert replay_reads(paths, np.zeros((0, 3), np.int64))["bytes"] == 0


def test_pread_reader_trace_is_what_it_read(tmp_path):
    """The reader's trace (what `solar bench` replays) holds each call's ranges: their bytes are its bytes_read."""
    from solar.io import get_reader
    layout = load_layout(make_dataset(tmp_path, "ptychonn", "gzip"))
    rd = get_reader("pread", layout, threads=2)
    try:
        rd.trace = []
        blocks = np.arange(0, layout.block_stored.shape[0], 2, dtype=np.int64)
        out = [np.empty(int(n), np.uint8) for n in layout.block_nbytes[blocks]]
        st = rd.read_blocks(blocks, out)
        ext = np.concatenate(rd.trace)
        assert ext.shape[1] == 3 and int(ext[:, 2].sum()) == st.bytes_read > 0
        on = layout.block_offset[blocks] >= 0
        lo, hi = ext[:, 1], ext[:, 1] + ext[:, 2]  # every block on storage lies inside a traced range of its file
        for b in blocks[on].tolist():
            f = layout.datasets[int(layout.block_dataset[b])].file
            off, n = int(layout.block_offset[b]), int(layout.block_stored[b])
            assert ((ext[:, 0] == f) & (lo <= off) & (off + n <= hi)).any(), b
    finally:
        rd.close()


def test_cold_parallel_sequential_read(tmp_path):
    path = _write(tmp_path / "s.bin", 5 * MIB + 7)
    r = cold_parallel_sequential_read([path, path], request=MIB, depth=3)
    assert r["bytes"] == 2 * (5 * MIB + 7) and r["depth"] == 3 and r["request_bytes"] == MIB
    assert 2 * MIB <= cold_parallel_sequential_read([path], request=MIB, depth=2, max_bytes=2 * MIB)["bytes"] <= 4 * MIB


def test_typical_block_of_a_layout(tmp_path):
    layout = load_layout(make_dataset(tmp_path, "ptychonn", "gzip"))
    ext, block = typical_block(layout)
    on = layout.block_offset >= 0
    assert ext.shape == (int(on.sum()), 3) and block == int(np.median(layout.block_stored[on]))
    assert set(ext[:, 0].tolist()) <= set(range(len(layout.files)))


@pytest.mark.parametrize("storage", ["gzip", "contiguous", "chunked"])
def test_decode_limit_decodes_the_filtered_blocks(tmp_path, storage, monkeypatch):
    """The cpu limit decodes real blocks of the layout (every one it read, bytes counted exactly) and is
    None when nothing is filtered."""
    from solar.bench import decode as dec
    layout = load_layout(make_dataset(tmp_path, "ptychonn", storage))
    blocks = dec.filtered_blocks(layout)
    if storage != "gzip":
        assert blocks.size == 0 and dec.decode_limit(layout) is None
        return
    assert blocks.size == int((layout.block_stored > 0).sum())
    seen = []
    from solar.io import filters
    orig = filters.decode_chunk

    def spy(raw, pipe, mask, nb, isz, out=None):
        r = orig(raw, pipe, mask, nb, isz, out=out)
        seen.append((len(raw), nb))
        return r
    monkeypatch.setattr(filters, "decode_chunk", spy)
    r = dec.decode_limit(layout, threads=2, max_seconds=60)
    assert r["blocks"] == blocks.size == len(seen) and r["threads"] == 2
    st, nb = sum(a for a, _ in seen), sum(b for _, b in seen)
    assert st == int(layout.block_stored[blocks].sum()) and nb == int(layout.block_nbytes[blocks].sum())
    assert r["bytes_per_s"] == pytest.approx(st / r["seconds"]) and r["decoded_bytes_per_s"] > r["bytes_per_s"] > 0
    with pytest.raises(SolarError, match="decode threads must be >= 1, got 0"):
        dec.decode_limit(layout, threads=0)


# ------------------------------------------------------------------ ranks waiting for rank 0
@pytest.mark.mpi
def test_waiting_ranks_sleep(comm):
    import time

    from solar.mpi import root_call, sleep_barrier
    cpu0 = time.process_time()
    if comm.rank == 0:
        time.sleep(0.6)
    sleep_barrier(comm)
    assert time.process_time() - cpu0 < 0.1  # rank 0 slept; the others slept too (comm.Barrier spins: ~0.3 s)
    assert root_call(comm, lambda: comm.rank + 41) == 41
    with pytest.raises(SolarError, match="only on root"):
        root_call(comm, lambda: (_ for _ in ()).throw(SolarError("only on root")))


# ------------------------------------------------------------------ memory cgroup


def _cgroup_or_skip():
    try:
        memlimit.locate("probe")
    except SolarError as exc:
        pytest.skip(str(exc))


def test_memory_cgroup_limits_the_page_cache(tmp_path):
    _cgroup_or_skip()
    path = _write(tmp_path / "big.bin", 96 * MIB)
    drop_file_cache([path])
    cg = memlimit.MemoryCgroup.create(f"solar-test-{os.getpid()}", 32 * MIB)
    try:
        code = ("import os, sys; open(os.path.join(sys.argv[1], 'cgroup.procs'), 'w').write(str(os.getpid()));"
                "f = open(sys.argv[2], 'rb')\nwhile f.read(1 << 20): pass")
        subprocess.run([sys.executable, "-c", code, cg.path, path], check=True)
        assert cg.read_limit() == 32 * MIB
        assert cached_fraction(path) < 0.4  # 96 MiB read, at most 32 MiB of it kept
    finally:
        cg.remove(None)
    assert not os.path.exists(cg.path)


def test_memory_cgroup_base_counts_processes_not_the_page_cache(tmp_path):
    """A loader's base (what its processes hold as they start) counts their anonymous memory, not the file
    pages they read; the limit is lifted (None) and set again around it."""
    _cgroup_or_skip()
    path = _write(tmp_path / "big.bin", 64 * MIB)
    drop_file_cache([path])
    cg = memlimit.MemoryCgroup.create(f"solar-test-{os.getpid()}", None)
    try:
        assert cg.read_limit() > 1 << 50 or cg.read_limit() == -1  # no limit yet
        code = ("import os, sys; open(os.path.join(sys.argv[1], 'cgroup.procs'), 'w').write(str(os.getpid()));"
                "f = open(sys.argv[2], 'rb')\nwhile f.read(1 << 20): pass\n"
                "a = bytearray(48 << 20); sys.stdout.write('up\\n'); sys.stdout.flush(); sys.stdin.read()")
        proc = subprocess.Popen([sys.executable, "-c", code, cg.path, path], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline() == "up\n"
            assert cached_fraction(path) > 0.9  # the file's pages are charged to the cgroup ...
            base = cg.base_bytes()
            assert 48 * MIB <= base < 48 * MIB + 40 * MIB  # ... but the base is the process's memory
            cg.set_limit(base + 32 * MIB)
            assert cg.read_limit() >= base + 32 * MIB and cg.limit_bytes == cg.read_limit()
            cg.set_limit(None)
            assert cg.read_limit() > 1 << 50 or cg.read_limit() == -1
        finally:
            proc.communicate("")
    finally:
        cg.remove(None)
    with pytest.raises(SolarError, match="at least 16 MiB"):
        memlimit.MemoryCgroup(cg.path, cg.limit_file, cg.method, -1).set_limit(1 << 20)


def test_a_worker_in_the_cgroup_is_the_first_the_kernel_kills():
    """Under the limit the OOM killer takes a DataLoader worker (its baseline fails, reported) before a rank
    (which would end the job)."""
    if not os.path.exists("/proc/self/oom_score_adj"):
        pytest.skip("no /proc/self/oom_score_adj here")
    code = ("import sys; from solar.bench import memlimit; d = memlimit.current_dir();"
            "memlimit.check_worker_in(d, 'memory.limit_in_bytes', 0); print(open('/proc/self/oom_score_adj').read())")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "1000"


def test_memory_cgroup_refuses_clearly(tmp_path, monkeypatch):
    monkeypatch.setattr(memlimit, "MOUNTINFO", str(tmp_path / "no-mountinfo"))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(SolarError, match="no memory cgroup controller is mounted"):
        memlimit.MemoryCgroup.create("x", 64 * MIB)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SolarError, match="needs root.*uid 1000"):
        memlimit.locate("x")
    with pytest.raises(SolarError, match="not in the memory cgroup"):
        memlimit.check_worker_in(str(tmp_path / "elsewhere"), "memory.limit_in_bytes", 0)
