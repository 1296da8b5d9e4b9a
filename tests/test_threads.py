"""Threads started before the first step (solar.threads): the pools' threads exist once a buffer is built,
a read starts none, and a reader whose threads cannot start fails the first batch with an error, not a hang."""
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import solar
from solar.buffer.manager import BufferError
from solar.io import get_reader
from solar.loader import SolarLoader
from solar.threads import start_threads

from helpers import h5py_sample, make_dataset


def _named(prefix: str) -> set:
    return {t.ident for t in threading.enumerate() if t.name.startswith(prefix)}


def test_start_threads_starts_n_threads_each_set_up_once():
    seen, lock = [], threading.Lock()

    def each():
        with lock:
            seen.append(threading.get_ident())
    with ThreadPoolExecutor(5, thread_name_prefix="t-start-five") as ex:
        start_threads(ex, 5, each)
        assert len(_named("t-start-five")) == 5
        assert sorted(seen) == sorted(_named("t-start-five"))  # once on each thread
        start_threads(ex, 5)  # again: the threads are reused, none added
        assert len(_named("t-start-five")) == 5


def test_start_threads_more_than_the_pool_has_and_failing_setup():
    with ThreadPoolExecutor(2, thread_name_prefix="t-start-two") as ex:
        start_threads(ex, 4)  # two wait for a thread: no hang
        assert len(_named("t-start-two")) == 2

        def boom():
            raise OSError("no scratch")
        with pytest.raises(OSError, match="no scratch"):
            start_threads(ex, 2, boom)


def test_pread_reader_start_makes_every_worker_and_a_read_adds_none(tmp_path):
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=64)
    lay = solar.load_layout(data)
    with get_reader("pread", lay, threads=6) as r:
        before = _named("solar-pread")
        r.start()
        workers = _named("solar-pread") - before
        assert len(workers) == 6
        blocks = np.arange(lay.n_blocks, dtype=np.int64)[::-1]
        out = [np.empty(int(n), np.uint8) for n in lay.block_nbytes[blocks]]
        r.read_blocks(blocks, out)
        assert _named("solar-pread") - before == workers
    with get_reader("pread", lay, threads=1) as one:  # the same bytes as a reader that never started threads
        ref = [np.empty(int(n), np.uint8) for n in lay.block_nbytes[blocks]]
        one.read_blocks(blocks, ref)
    for a, b in zip(out, ref):
        np.testing.assert_array_equal(a, b)


def test_buffer_starts_its_threads_before_the_first_batch(tmp_path):
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=48)
    path = str(tmp_path / "plan.h5")
    solar.plan(data, world_size=1, local_batch=8, epochs=1, buffer_fraction=0.5, out=path).close()
    with SolarLoader(path, data, as_torch=False, epoch_fence=True, threads=4, cpus=2) as loader:
        loader.prepare()  # fenced: nothing is read yet
        assert len(_named("solar-pread")) >= 4 and len(_named("solar-io-r0")) >= 1
        assert len(_named("solar-assemble")) >= 1
        before = {t.ident for t in threading.enumerate()}
        batches = list(loader)
        assert {t.ident for t in threading.enumerate()} <= before  # the epoch started no thread
    lay = solar.load_layout(data)
    for b in batches:
        for i, s in enumerate(b["index"].tolist()):
            ref = h5py_sample(lay, s)
            for k, v in ref.items():
                np.testing.assert_array_equal(b[k][i], v)


def test_a_reader_whose_threads_cannot_start_fails_the_first_batch(tmp_path):
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=24)
    path = str(tmp_path / "plan.h5")
    solar.plan(data, world_size=1, local_batch=4, epochs=1, buffer_fraction=0.5, out=path).close()
    with SolarLoader(path, data, as_torch=False) as loader:
        def cannot():
            raise RuntimeError("can't start new thread")
        loader.reader.start = cannot
        with pytest.raises(BufferError, match="can't start new thread"):
            next(iter(loader))
