"""Readers through HDF5 itself, for datasets whose filters only HDF5 decodes.

``h5py``: plain serial h5py.  Files are opened read-only (locking off, see
:func:`solar.io.h5open.open_readonly`) on first use in the calling process
and reopened after a fork, never shared across processes.  At most
``max_open`` files are open at once (default from ``ulimit -n``, see
:mod:`solar.io.fdcache`): the least recently used one is closed, with its
dataset handles, and reopened when it is read again.  Each block is the
region ``ds[origin : origin+block_shape]`` clipped to the dataset extent, read
with ``read_direct`` into the block-shaped view of the caller's array; the part
outside the extent is zeros.

``h5py-mpio``: the same through parallel HDF5 (``driver="mpio"``).  Opening and
closing files are collective over ``comm`` (every file is opened at
construction); reads are independent, so files cannot be reopened on demand:
a layout of more files than the open-file budget is refused at construction
(use the ``pread`` reader).  Needs an h5py built against parallel
HDF5 (PyPI wheels are not).
"""
from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from functools import partial

import h5py
import numpy as np

from ..errors import DecodeError
from .block_plan import chunk_where
from .fdcache import FileCache
from .h5open import open_readonly
from .reader import BlockReader, ReadStats, check_file_budget, mpi4py_missing, register


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _open_entry(files, open_file, file: int) -> tuple:
    """``(h5py.File, {})`` of ``files[file]`` opened with ``open_file(path)``; DecodeError if it cannot be."""
    path = files[file]
    try:
        return open_file(path), {}
    except OSError as exc:
        no_files = _out_of_descriptors(exc)
        if no_files:  # the file cache closes idle files and retries (solar.io.fdcache)
            raise OSError(no_files, f"cannot open {path} with h5py: {os.strerror(no_files)}") from None
        raise DecodeError(f"cannot open {path} with h5py: {_first_line(exc)}") from None


def _out_of_descriptors(exc: OSError) -> int:
    """EMFILE / ENFILE when HDF5 failed to open a file for want of descriptors (h5py reports the errno in
    its message, not always in ``errno``), else 0."""
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return exc.errno
    text = str(exc)
    for code in (errno.EMFILE, errno.ENFILE):
        if f"errno = {code}," in text or f"[Errno {code}]" in text:
            return code
    return 0


def _close_entry(entry: tuple) -> None:
    entry[0].close()


@register
class H5pyReader(BlockReader):
    """Serial h5py; serves every layout (HDF5 decodes), one h5py read per block.  Option
    ``max_open``: files open at once (None: from ``ulimit -n``)."""

    name = "h5py"
    threaded = False
    collective = False
    needs_raw = False
    opens_collectively = False
    OPTIONS = {"max_open": None}

    def __init__(self, layout, *, comm=None, threads: int = 4, **options):
        super().__init__(layout, comm=comm, threads=threads, **options)
        from .pread_reader import max_open_option
        cap = max_open_option(self.options["max_open"], self.name)
        # file index -> (h5py.File, {dataset index: h5py.Dataset}); closing the file drops its datasets.
        # The opener holds no reference to the reader: a reader nobody closes is freed (and its files closed)
        # as soon as it is dropped, as before
        self._files = FileCache(partial(_open_entry, layout.files, open_readonly), _close_entry, cap)
        self._pid = os.getpid()

    def open_stats(self) -> dict:
        return self._files.stats()

    def _read_block(self, d: int, view: np.ndarray, src: tuple, dst: tuple) -> None:
        """``read_direct`` of dataset ``d``'s region ``src`` into ``view[dst]``, its file pinned open."""
        if os.getpid() != self._pid:  # forked: HDF5 handles of the parent are not ours to use
            if self.opens_collectively:
                raise DecodeError(f"reader {self.name!r} cannot be used in a forked process; build it there")
            self._files.forget()
            self._pid = os.getpid()
        file = self.layout.datasets[d].file
        with self._files.use(file) as (h5f, dsets):
            ds = dsets.get(d)
            if ds is None:
                ds = dsets[d] = h5f[self.layout.datasets[d].name]
            ds.read_direct(view, src, dst)

    def _read(self, blocks: np.ndarray, out: Sequence[np.ndarray]) -> ReadStats:
        lay = self.layout
        stats = ReadStats()
        for b, o in zip(blocks.tolist(), out):
            d, origin = lay.block_grid_coords(b)
            info = lay.datasets[d]
            shape = lay.block_shapes[d]
            hi = [min(a + s, n) for a, s, n in zip(origin, shape, info.shape)]
            view = o.view(np.dtype(info.dtype)).reshape(shape)
            if any(h - a < s for a, s, h in zip(origin, shape, hi)):
                o[:] = 0
            src = tuple(slice(a, h) for a, h in zip(origin, hi))
            dst = tuple(slice(0, h - a) for a, h in zip(origin, hi))
            try:
                self._read_block(d, view, src, dst)
            except (OSError, RuntimeError) as exc:
                raise DecodeError(f"HDF5 cannot read {chunk_where(lay, b)}: {_first_line(exc)}") from None
            if lay.block_offset[b] >= 0:
                stats.n_reads += 1
                stats.bytes_read += int(lay.block_stored[b])
        return stats

    def close(self) -> None:
        if os.getpid() == self._pid:
            self._files.close_all()
        else:
            self._files.forget()
        super().close()


@register
class H5pyMpioReader(H5pyReader):
    """h5py with the MPI-IO driver; constructing and closing are collective over ``comm``."""

    name = "h5py-mpio"
    opens_collectively = True

    @classmethod
    def available(cls):
        # registered_drivers() can list 'mpio' even when h5py itself was built without MPI
        if "mpio" not in h5py.registered_drivers() or not h5py.get_config().mpi:
            return False, "this h5py is not built with parallel HDF5 (no usable 'mpio' driver; PyPI wheels have none)"
        why = mpi4py_missing()
        return not why, why

    def __init__(self, layout, *, comm=None, threads: int = 4, **options):
        check_file_budget(layout, self.name, options.get("max_open"))
        super().__init__(layout, comm=comm, threads=threads, **options)
        from mpi4py import MPI
        self.comm = comm if comm is not None else MPI.COMM_SELF
        # all open, never evicted (closing is collective); no locking retry (open_readonly): a collective
        # open must be the same call on every rank
        self._files.capacity = max(1, len(layout.files))
        self._files.opener = partial(_open_entry, layout.files,
                                     partial(h5py.File, mode="r", driver="mpio", comm=self.comm, locking=False))
        for i in range(len(layout.files)):  # collective opens, same order on every rank
            try:
                self._files.acquire(i)
            except DecodeError:
                self.close()
                raise
            self._files.release(i)
