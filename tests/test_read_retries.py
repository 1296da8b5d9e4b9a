"""Storage reads that come back short or fail (EIO, EAGAIN, EINTR, zero bytes) are retried a
bounded number of times; then the read fails with a DecodeError naming file, dataset, chunk
and byte range, and the loader step fails instead of delivering a partly filled sample."""
import errno
import os

import numpy as np
import pytest

import solar
from solar.io import get_reader
from solar.io import pread_reader
from solar.loader import SolarLoader

from helpers import h5py_sample, make_dataset


class FlakyPreadv:
    """``os.preadv`` that misbehaves on calls ``first .. first + times - 1`` (1-based), then reads."""

    def __init__(self, kind: str, times: int, first: int = 1):
        self.kind, self.times, self.first, self.calls = kind, times, first, 0
        self.real = os.preadv

    def __call__(self, fd, bufs, offset):
        self.calls += 1
        if self.first <= self.calls < self.first + self.times:
            if self.kind in ("eio", "eagain", "eintr"):
                code = {"eio": errno.EIO, "eagain": errno.EAGAIN, "eintr": errno.EINTR}[self.kind]
                raise OSError(code, os.strerror(code))
            if self.kind == "zero":
                bufs[0][:] = b"\xee" * len(bufs[0])  # junk in the buffer, nothing reported read
                return 0
            if self.kind == "short":  # a real read of half the first buffer
                return self.real(fd, [memoryview(bufs[0])[:max(1, len(bufs[0]) // 2)]], offset)
        return self.real(fd, bufs, offset)


def all_blocks(layout):
    blocks = np.flatnonzero(layout.block_offset >= 0)
    return blocks, [np.empty(int(layout.block_nbytes[b]), np.uint8) for b in blocks]


@pytest.fixture
def layout(tmp_path):
    return solar.load_layout(make_dataset(tmp_path, "ptychonn", "gzip", samples=9))


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(pread_reader, "RETRY_BACKOFF_S", 0.0, raising=False)  # absent before retries
    # the Python read path (os.preadv) on these gzip files: without this, libdeflate's GIL-free kernel reads
    # them (libc pread; its retries are tested by test_direct_kernel_reads_copies_and_reports_failures)
    monkeypatch.setattr(pread_reader, "LIBDEFLATE", "")


@pytest.mark.parametrize("kind", ["eio", "eagain", "eintr", "zero", "short"])
def test_pread_retries_transient_failures(layout, monkeypatch, kind):
    blocks, ref = all_blocks(layout)
    with get_reader("pread", layout, threads=1) as r:
        r.read_blocks(blocks, ref)
    flaky = FlakyPreadv(kind, times=2)  # within the bound (READ_RETRIES = 3)
    monkeypatch.setattr(os, "preadv", flaky)
    blocks, got = all_blocks(layout)
    with get_reader("pread", layout, threads=1) as r:
        r.read_blocks(blocks, got)
    assert flaky.calls > 2
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["eio", "zero"])
def test_pread_gives_up_after_bounded_retries(layout, monkeypatch, kind):
    flaky = FlakyPreadv(kind, times=10**9)
    monkeypatch.setattr(os, "preadv", flaky)
    blocks, out = all_blocks(layout)
    with get_reader("pread", layout, threads=1, coalesce=False) as r:
        with pytest.raises(solar.DecodeError, match=r"chunk at \(0(, 0)*\) of .*\.h5:/\w+.*bytes \[\d+, \d+\)"):
            r.read_blocks(blocks[:1], out[:1])
    assert flaky.calls == 1 + pread_reader.READ_RETRIES


class FailingKernel:
    """``read_direct_ranges`` whose calls from the ``first``-th on report EIO after 4 tries on their first
    range (what the compiled kernel returns then), the calls before it real."""

    def __init__(self, first: int):
        self.first, self.calls, self.real = first, 0, pread_reader.read_direct_ranges

    def __call__(self, io, ranges, r0, r1):
        self.calls += 1
        if self.calls < self.first:
            return self.real(io, ranges, r0, r1)
        ranges.got[r0], ranges.err[r0] = 0, errno.EIO
        return r0


class FailingAio(FailingKernel):
    """``aio_read_ranges`` (native AIO) failing as :class:`FailingKernel` does, on the first range it is given."""

    def __init__(self, first: int):
        self.first, self.calls, self.real = first, 0, pread_reader.aio_read_ranges

    def __call__(self, ring, ranges, fds, rs, *args):
        self.calls += 1
        if self.calls < self.first:
            return self.real(ring, ranges, fds, rs, *args)
        r = int(rs[0])
        ranges.got[r], ranges.err[r] = 0, errno.EIO
        return r


@pytest.mark.parametrize("direct_io,aio", [(False, False), (True, False), (True, True)],
                         ids=["buffered", "direct", "direct-aio"])
def test_failed_read_fails_the_step_not_the_sample(tmp_path, monkeypatch, direct_io, aio):
    """Reads start failing for good mid-run: every batch delivered before is h5py's, then the step raises.
    Through the page cache (each range one ``os.preadv``), with O_DIRECT (ranges of unfiltered blocks read
    by the GIL-free kernel, :func:`solar.io.kernels.read_direct_ranges`) and with native AIO
    (:func:`solar.io.aio.aio_read_ranges`)."""
    if aio and not solar.io.aio.aio_available()[0]:
        pytest.skip(f"native AIO: {solar.io.aio.aio_available()[1]}")
    data = make_dataset(tmp_path, "ptychonn", "chunked", samples=24)
    layout = solar.load_layout(data)
    path = str(tmp_path / "plan.h5")
    solar.plan(layout, world_size=1, local_batch=2, epochs=1, buffer_fraction=0.3, out=path).close()
    if direct_io:
        failing = FailingAio(first=6) if aio else FailingKernel(first=6)
        monkeypatch.setattr(pread_reader, "aio_read_ranges" if aio else "read_direct_ranges", failing)
    else:
        monkeypatch.setattr(os, "preadv", FlakyPreadv("eio", times=10**9, first=6))
    delivered = []
    with SolarLoader(path, layout, rank=0, as_torch=False, prefetch=1, threads=1,
                     reader_options={"direct_io": direct_io, "aio": aio}) as loader:
        with pytest.raises(solar.DecodeError, match=r"failed \(4 tries\): Input/output error"):
            for batch in loader:
                delivered.append(batch)
        assert loader.cursor < loader.S
    assert delivered, "some steps were read before the storage failed"
    if direct_io:
        assert failing.calls >= failing.first
    for batch in delivered:
        for i, s in enumerate(batch["index"].tolist()):
            for k, v in h5py_sample(layout, s).items():
                np.testing.assert_array_equal(batch[k][i], v)


class FlakyFile:
    """An ``MPI.File`` stand-in whose first ``times`` reads come back short (half) or fail (ERR_IO)."""

    def __init__(self, fh, kind: str, times: int):
        self.fh, self.kind, self.left, self.reads = fh, kind, times, 0

    def __getattr__(self, name):
        return getattr(self.fh, name)

    def _misbehave(self) -> bool:
        self.reads += 1
        if self.left <= 0:
            return False
        self.left -= 1
        return True

    def Read_at(self, offset, buf, status):
        from mpi4py import MPI
        if not self._misbehave():
            return self.fh.Read_at(offset, buf, status)
        if self.kind == "fail":
            raise MPI.Exception(MPI.ERR_IO)
        arr, dtype = buf
        return self.fh.Read_at(offset, [arr[:max(1, arr.shape[0] // 2)], dtype], status)

    def Read_all(self, buf, status):
        from mpi4py import MPI
        self.fh.Read_all(buf, status)
        if self._misbehave():
            if self.kind == "fail":
                raise MPI.Exception(MPI.ERR_IO)
            status.Set_elements(MPI.BYTE, status.Get_count(MPI.BYTE) // 2)


@pytest.mark.parametrize("collective", [True, False])
@pytest.mark.parametrize("kind", ["short", "fail"])
def test_mpiio_retries_short_and_failed_reads(layout, collective, kind):
    blocks, ref = all_blocks(layout)
    with get_reader("pread", layout, threads=1) as r:
        r.read_blocks(blocks, ref)
    blocks, got = all_blocks(layout)
    with get_reader("mpiio", layout, threads=1, collective=collective) as r:
        r._fh = [FlakyFile(fh, kind, times=1) for fh in r._fh]
        r.read_blocks(blocks, got)
        # independent: the same handle again; collective: this rank's own COMM_SELF handle
        assert (len(r._self_fh) > 0) if collective else sum(f.reads for f in r._fh) > 1
        r._fh = [f.fh for f in r._fh]
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("collective", [True, False])
def test_mpiio_gives_up_after_bounded_retries(layout, collective):
    blocks, out = all_blocks(layout)
    with get_reader("mpiio", layout, threads=1, collective=collective, coalesce=False) as r:
        real_fh, real_retry = r._fh, r._retry_handle
        r._fh = [FlakyFile(fh, "fail", times=10**9) for fh in real_fh]
        flaky_retry = {}
        r._retry_handle = lambda f: flaky_retry.setdefault(f, FlakyFile(real_retry(f), "fail", times=10**9))
        with pytest.raises(solar.DecodeError, match=r"chunk at \(0(, 0)*\) of .*\.h5:/\w+: bytes \[\d+, \d+\) "
                                                    r"failed \(4 tries\)"):
            r.read_blocks(blocks[:1], out[:1])
        r._fh = real_fh


def test_failures_are_counted_in_a_row_not_over_a_whole_read(tmp_path, monkeypatch):
    """A long read that moves on (short reads) while meeting a transient failure between them, never more than
    ``READ_RETRIES`` in a row, reads everything: before, the failures of the whole read counted together and it
    failed once there were more than 3 ("truncated?")."""
    path = str(tmp_path / "f")
    data = np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8)
    data.tofile(path)
    real = os.preadv
    state = {"n": 0}

    def bumpy(fd, bufs, offset):  # every other call fails, the others read 64 KiB at most
        state["n"] += 1
        if state["n"] % 2:
            raise OSError(errno.EINTR, os.strerror(errno.EINTR))
        return real(fd, [memoryview(bufs[0])[:64 << 10]], offset)
    monkeypatch.setattr(pread_reader.os, "preadv", bumpy)
    fd = os.open(path, os.O_RDONLY)
    try:
        out = np.zeros(data.shape[0], np.uint8)
        done, calls = pread_reader.preadv_full(fd, [out], 0)
        assert done == data.shape[0] and np.array_equal(out, data) and calls > 2 * pread_reader.READ_RETRIES
        from solar import aligned
        buf = aligned.empty(data.shape[0])  # (pread_direct reads into page-aligned memory)
        state["n"] = 0
        assert pread_reader.pread_direct(fd, memoryview(buf), 0, data.shape[0]) == data.shape[0]
        assert np.array_equal(np.frombuffer(buf, np.uint8)[:data.shape[0]], data)
    finally:
        os.close(fd)
    state["n"] = 0

    def stuck(fd, bufs, offset):  # failures in a row beyond the retries: still an error
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(pread_reader.os, "preadv", stuck)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError):
            pread_reader.preadv_full(fd, [np.zeros(16, np.uint8)], 0)
    finally:
        os.close(fd)
