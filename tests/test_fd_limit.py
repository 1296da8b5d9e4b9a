"""Bounded open files: a many-file dataset under a low ``ulimit -n`` (issue 12, item 1)."""
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import solar
from solar.errors import SpecError
from solar.io import get_reader
from solar.layout import load_layout

from helpers import make_dataset

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(solar.__file__)))
N_FILES = 300
LIMIT = 128

# one full epoch on both ranks (rank=, serially) under RLIMIT_NOFILE = LIMIT; every sample compared with h5py
EPOCH = r"""
import json, resource, sys
import numpy as np
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[3]), hard))
import solar
from solar.loader import SolarLoader
from solar.layout import load_layout
from helpers import h5py_sample
data, reader, plan = sys.argv[1], sys.argv[2], sys.argv[4]
layout = load_layout(data)
solar.plan(layout, world_size=2, local_batch=8, epochs=1, buffer_per_rank=1 << 20, out=plan).close()
seen, opens = [], []
for rank in range(2):
    with SolarLoader(plan, layout, rank=rank, reader=reader, as_torch=False, threads=8, prefetch=2) as loader:
        for batch in loader:
            for i, s in enumerate(batch["index"].tolist()):
                for name, ref in h5py_sample(layout, s).items():
                    np.testing.assert_array_equal(batch[name][i], ref, err_msg=f"sample {s} {name}")
                seen.append(s)
        opens.append(loader.stats())
print(json.dumps({"samples": sorted(set(seen)), "n": layout.n_samples, "stats": opens}))
"""


@pytest.fixture(scope="module")
def many_files(tmp_path_factory):
    """A CosmoFlow-style dataset of N_FILES one-sample HDF5 files (more than LIMIT)."""
    return make_dataset(tmp_path_factory.mktemp("fd"), "cosmoflow", samples=N_FILES, size=4)


@pytest.mark.parametrize("reader", ["pread", "h5py"])
def test_full_epoch_under_low_ulimit(many_files, reader, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", EPOCH, many_files, reader, str(LIMIT), str(tmp_path / "p.h5")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["n"] == N_FILES and out["samples"] == list(range(N_FILES))
    for st in out["stats"]:
        assert st["max_open"] == LIMIT // 2
        assert st["opens"] >= 1


def test_evicted_files_are_reopened(many_files):
    layout = load_layout(many_files)
    blocks = np.arange(layout.n_blocks)
    ref = [np.empty(layout.block_nbytes[b], np.uint8) for b in blocks]
    with get_reader("pread", layout, threads=1) as r:
        r.read_blocks(blocks, ref)
    for name in ("pread", "h5py"):
        got = [np.empty_like(a) for a in ref]
        with get_reader(name, layout, threads=4, max_open=3) as r:
            r.read_blocks(blocks, got)
            r.read_blocks(blocks[:5], got[:5])
            st = r.open_stats()
        assert st["max_open"] == 3
        assert st["opens"] >= N_FILES + 1 and st["evictions"] >= N_FILES - 3, (name, st)
        for a, b in zip(got, ref):
            np.testing.assert_array_equal(a, b)


def test_collective_readers_refuse_more_files_than_the_budget(many_files):
    layout = load_layout(many_files)
    pytest.importorskip("mpi4py")
    with pytest.raises(SpecError, match=rf"opens all {N_FILES} files .* more than the 10 .*--reader pread"):
        get_reader("mpiio", layout, max_open=10)


def test_budget_follows_the_soft_limit():
    from solar.io.fdcache import open_file_budget
    code = ("import resource; _, h = resource.getrlimit(resource.RLIMIT_NOFILE); "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, h)); "
            "from solar.io.fdcache import open_file_budget; print(open_file_budget())")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert int(out.stdout) == 128
    assert open_file_budget() >= 4


def test_pinned_handle_is_never_closed_while_in_use():
    from solar.io.fdcache import FileCache
    closed, lock = [], threading.Lock()

    def closer(h):
        with lock:
            closed.append(h)

    serial = iter(range(10**9))
    cache = FileCache(lambda k: (k, next(serial)), closer, capacity=2)  # a new handle per open
    errors = []

    def worker(keys):
        try:
            for k in keys:
                with cache.use(k) as h:
                    time.sleep(0.0005)
                    with lock:
                        assert h not in closed, f"{h} closed while pinned"
        except AssertionError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=([(i * 7 + j) % 5 for j in range(60)],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(cache) <= 2 and cache.peak <= 2
    assert cache.opens == cache.evictions + len(cache)


def test_emfile_closes_idle_files_and_shrinks():
    from solar.io.fdcache import FileCache
    opened, closed = [], []

    def opener(k):
        if len(opened) - len(closed) >= 3:  # the process may hold only 3 more descriptors
            raise OSError(errno.EMFILE, "Too many open files")
        opened.append(k)
        return k

    cache = FileCache(opener, closed.append, capacity=10)
    for k in range(6):
        with cache.use(k):
            pass
    assert cache.capacity < 10 and len(cache) <= 3 and cache.opens == 6
    cache.close_all()
    opened.clear(), closed.clear()
    pinned = FileCache(opener, closed.append, capacity=10)
    for k in range(3):
        pinned.acquire(k)
    with pytest.raises(OSError, match="Too many open files"):
        pinned.acquire(3)  # every handle pinned: nothing left to close


# descriptors used up by something else in the process while max_open is above what the OS allows
EMFILE_RUN = r"""
import json, os, resource, sys
import numpy as np
from solar.io import get_reader
from solar.layout import load_layout
layout = load_layout(sys.argv[1])
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
ref = [np.empty(int(layout.block_nbytes[b]), np.uint8) for b in range(layout.n_blocks)]
with get_reader("pread", layout, threads=1, max_open=4) as rd:
    rd.read_blocks(np.arange(layout.n_blocks), ref)
hog = []
while len(os.listdir("/proc/self/fd")) < 44:
    hog.append(os.open("/dev/null", os.O_RDONLY))
out = [np.empty_like(r) for r in ref]
with get_reader(sys.argv[2], layout, threads=1, max_open=1000) as rd:
    rd.read_blocks(np.arange(layout.n_blocks), out)
    stats = rd.open_stats()
print(json.dumps({"same": all(np.array_equal(a, b) for a, b in zip(ref, out)), **stats}))
"""


@pytest.mark.parametrize("reader", ["pread", "h5py"])
def test_descriptors_used_up_elsewhere_close_idle_files_and_go_on(tmp_path, reader):
    """Review finding: the h5py reader turned HDF5's EMFILE into a DecodeError, so the file cache never
    closed idle files and retried (the pread reader did)."""
    data = make_dataset(tmp_path, "cosmoflow", samples=40, size=4)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", EMFILE_RUN, data, reader], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["same"] and out["evictions"] > 0


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_file_replaced_while_the_cache_had_it_closed_is_not_read(tmp_path, direct_io):
    """A reader's file cache closes files and opens them again by path.  If the file there is no longer the one it
    read (replaced, or modified in place: same size, other bytes), the blocks' offsets may point anywhere in it:
    a DecodeError names the file instead (before: the new file's bytes at the old offsets, silently)."""
    from solar.errors import DecodeError
    from helpers import h5py_sample
    data = make_dataset(tmp_path, "cosmoflow", "chunked", samples=4)
    layout = load_layout(data)
    sizes = [os.path.getsize(f) for f in layout.files]
    first = [int(layout.blocks_of(s)[0]) for s in range(layout.n_samples)]
    file_of = [layout.datasets[int(layout.block_dataset[b])].file for b in first]
    assert len(set(file_of)) >= 3 and sizes[file_of[0]] == sizes[file_of[2]]

    def read(r, b):
        out = [np.empty(int(layout.block_nbytes[b]), np.uint8)]
        r.read_blocks(np.array([b], np.int64), out)
        return out[0]
    with get_reader("pread", layout, max_open=1, direct_io=direct_io) as r:
        a = read(r, first[0])
        read(r, first[1])  # the cache closes sample 0's file
        assert np.array_equal(read(r, first[0]), a)  # the same file opened again: read as before
        read(r, first[1])
        path = layout.files[file_of[0]]
        tmp = path + ".new"
        shutil.copyfile(layout.files[file_of[2]], tmp)  # same size, another sample's bytes
        os.replace(tmp, path)
        with pytest.raises(DecodeError, match="replaced by another file"):
            read(r, first[0])
    with get_reader("pread", layout, max_open=1, direct_io=direct_io) as r:
        read(r, first[0])
        read(r, first[1])
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # modified in place
        with pytest.raises(DecodeError, match="modified"):
            read(r, first[0])
