"""Readers through HDF5 itself, for datasets whose filters only HDF5 decodes.

``h5py``: plain serial h5py.  Files are opened read-only (locking off, see
:func:`solar.io.h5open.open_readonly`) on first use in the calling process
and reopened after a fork, never shared across processes.  Each block is the
region ``ds[origin : origin+block_shape]`` clipped to the dataset extent, read
with ``read_direct`` into the block-shaped view of the caller's array; the part
outside the extent is zeros.

``h5py-mpio``: the same through parallel HDF5 (``driver="mpio"``).  Opening and
closing files are collective over ``comm`` (every file is opened at
construction); reads are independent.  Needs an h5py built against parallel
HDF5 (PyPI wheels are not).
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import h5py
import numpy as np

from ..errors import DecodeError
from .block_plan import chunk_where
from .h5open import open_readonly
from .reader import BlockReader, ReadStats, mpi4py_missing, register


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


@register
class H5pyReader(BlockReader):
    """Serial h5py; serves every layout (HDF5 decodes), one h5py read per block."""

    name = "h5py"
    threaded = False
    collective = False
    needs_raw = False
    opens_collectively = False

    def __init__(self, layout, *, comm=None, threads: int = 4, **options):
        super().__init__(layout, comm=comm, threads=threads, **options)
        self._files = {}
        self._dsets = {}
        self._pid = os.getpid()

    def _open(self, path: str) -> h5py.File:
        return open_readonly(path)

    def _dataset(self, d: int):
        if os.getpid() != self._pid:  # forked: HDF5 handles of the parent are not ours to use
            if self.opens_collectively:
                raise DecodeError(f"reader {self.name!r} cannot be used in a forked process; build it there")
            self._files, self._dsets, self._pid = {}, {}, os.getpid()
        ds = self._dsets.get(d)
        if ds is None:
            info = self.layout.datasets[d]
            f = self._files.get(info.file)
            if f is None:
                path = self.layout.files[info.file]
                try:
                    f = self._files[info.file] = self._open(path)
                except OSError as exc:
                    raise DecodeError(f"cannot open {path} with h5py: {_first_line(exc)}") from None
            ds = self._dsets[d] = f[info.name]
        return ds

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
            ds = self._dataset(d)
            try:
                ds.read_direct(view, src, dst)
            except (OSError, RuntimeError) as exc:
                raise DecodeError(f"HDF5 cannot read {chunk_where(lay, b)}: {_first_line(exc)}") from None
            if lay.block_offset[b] >= 0:
                stats.n_reads += 1
                stats.bytes_read += int(lay.block_stored[b])
        return stats

    def close(self) -> None:
        if os.getpid() == self._pid:
            for f in self._files.values():
                f.close()
        self._files, self._dsets = {}, {}
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
        super().__init__(layout, comm=comm, threads=threads, **options)
        from mpi4py import MPI
        self.comm = comm if comm is not None else MPI.COMM_SELF
        for i, p in enumerate(layout.files):  # collective opens, same order on every rank
            try:
                self._files[i] = self._open(p)
            except OSError as exc:
                self.close()
                raise DecodeError(f"cannot open {p} with h5py (mpio): {_first_line(exc)}") from None

    def _open(self, path: str) -> h5py.File:
        # no locking retry (open_readonly): a collective open must be the same call on every rank
        return h5py.File(path, "r", driver="mpio", comm=self.comm, locking=False)
