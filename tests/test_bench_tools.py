"""Tools of ``solar bench``: the h5py/DataLoader baseline, cold page cache, the disk's sequential speed."""
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from conftest import on_root
from helpers import assert_same_sample, h5py_sample, make_dataset
from solar.bench import (H5Samples, cached_fraction, cold_sequential_read, drop_all_caches, drop_file_cache,
                         make_cache_dropper, run_baseline, warm_sequential_read)
from solar.bench import cache as cache_mod
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
    with open(path, "rb") as f:  # reading half brings back about half
        f.read(8 * MIB)
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
