"""Reading parts of chunks (:mod:`solar.layout.parts`): a reader of the whole chunks underneath.

A part is one sample's rows of a chunk, a contiguous slice of the decoded chunk.  :class:`PartReader`
reads each chunk a request's parts come from once (all the parts of one ``read_blocks`` call that share a
chunk cost one read and one decode) and copies every part out of it.  :func:`solar.io.get_reader` builds
it for a layout of parts, so no backend ever sees a part: every backend, its options and its capabilities
serve parts unchanged, and a part equals the same rows of h5py's chunk.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from .. import aligned
from ..layout.parts import chunks_of
from .kernels import copy_out
from .reader import BlockReader, ReadStats

SCRATCH_BYTES = 8 << 20
"""Decoded chunks one inner call holds at most: a request of more is read in several calls (a collective
reader's in one, as every rank must make the same calls; a chunk larger than this in a call of its own).
With the buffer's reads in flight (``io_depth``, 4) that is up to 32 MiB per rank outside the plan's budget,
within :data:`solar.memory.FIXED_OVERHEAD` (measured: docs/runtime.md, "Parts of chunks").  4, 8, 16 and 64 MiB
read the 2,048-sample gzip file at the same speed on the 2-core VM."""
KEEP = 4
"""Scratch buffers of SCRATCH_BYTES kept for the next calls (smaller and larger ones are freed)."""


class PartReader(BlockReader):
    """A :class:`~solar.io.reader.BlockReader` of a layout of parts over ``inner``, a reader of its chunks
    (:func:`~solar.layout.parts.chunks_of`).  Its name, capabilities, threads and options are the inner
    reader's; closing it closes the inner reader."""

    name = "parts"

    def __init__(self, layout, inner: BlockReader):  # noqa: the base __init__ checks what `inner` checked
        self.layout = layout
        self.inner = inner
        self.name = inner.name
        self.threaded, self.collective, self.needs_raw = inner.threaded, inner.collective, inner.needs_raw
        self.comm, self.threads, self.options = inner.comm, inner.threads, inner.options
        self._closed = False
        self._parent = np.asarray(layout.block_parent)
        self._offset = np.asarray(layout.part_offset)
        self._chunk_nbytes = np.asarray(chunks_of(layout).block_nbytes)
        self._nbytes = np.asarray(layout.block_nbytes, dtype=np.int64)
        self._free: list = []  # scratch buffers of SCRATCH_BYTES not in use (calls may run at once)
        self._inner_called = False
        self._lock = threading.Lock()

    def _scratch(self, nbytes: int) -> np.ndarray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.shape[0] >= nbytes:
                    return self._free.pop(i)
        # a small request (tiny data, a step of few misses) gets its own size; the others SCRATCH_BYTES, reused
        # (on a page, as the slots the parts are copied into: see solar.aligned)
        return aligned.empty(nbytes if nbytes < SCRATCH_BYTES // 8 else max(nbytes, SCRATCH_BYTES))

    def _give(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < KEEP and buf.shape[0] == SCRATCH_BYTES:
                self._free.append(buf)

    def read_blocks(self, blocks, out: Sequence[np.ndarray]) -> ReadStats:
        if not self.collective:
            return super().read_blocks(blocks, out)
        self._inner_called = False  # a collective inner reader: one inner call per call, every rank
        try:
            return super().read_blocks(blocks, out)
        except Exception as exc:
            if self._inner_called or not hasattr(self.inner, "fail_call"):
                raise
            self.inner.fail_call(exc)  # failed before the inner call (a refused request, no scratch memory)
            raise

    def read_alone(self, blocks, out: Sequence[np.ndarray]) -> ReadStats:
        return self._request(blocks, out, lambda b, o: self._read(b, o, alone=True))

    def _read(self, blocks: np.ndarray, out: Sequence[np.ndarray], alone: bool = False) -> ReadStats:
        inner = self.inner.read_alone if alone else self.inner.read_blocks

        def read(chunks, views):
            if not alone:
                self._inner_called = True
            return inner(chunks, views)

        parent = self._parent[blocks]
        chunks, where = np.unique(parent, return_inverse=True)  # where[i]: chunk of blocks[i] in `chunks`
        where = where.reshape(-1)
        size = self._chunk_nbytes[chunks]
        end = np.cumsum(size)
        # groups of chunks of at most SCRATCH_BYTES decoded (one group: a collective reader, or one big chunk)
        cut = [0]
        if not self.collective:
            base = 0
            for j in range(1, chunks.shape[0]):
                if end[j] - base > SCRATCH_BYTES:
                    cut.append(j)
                    base = int(end[j - 1])
        cut.append(chunks.shape[0])
        order = np.argsort(where, kind="stable")  # parts by chunk
        bounds = np.searchsorted(where[order], np.asarray(cut))
        stats = ReadStats()
        for g in range(len(cut) - 1):
            a, b = cut[g], cut[g + 1]
            base = int(end[a - 1]) if a else 0
            total = int(end[b - 1]) - base if b > a else 0
            buf = self._scratch(total)
            try:
                views = [buf[int(end[j] - size[j]) - base:int(end[j]) - base] for j in range(a, b)]
                stats += read(chunks[a:b], views)
                mine = order[bounds[g]:bounds[g + 1]]  # the parts of these chunks: where each lies in buf
                src = end[where[mine]] - size[where[mine]] - base + self._offset[blocks[mine]]
                dst = np.fromiter((out[i].ctypes.data for i in mine.tolist()), np.int64, mine.shape[0])
                copy_out(buf.ctypes.data, src, dst, self._nbytes[blocks[mine]])
            finally:
                self._give(buf)
        return stats

    def open_stats(self) -> dict:
        return self.inner.open_stats()

    @property
    def trace(self):
        """The inner reader's trace of its reads (:mod:`solar.bench`), read and set through."""
        return getattr(self.inner, "trace", None)

    @trace.setter
    def trace(self, value):
        self.inner.trace = value

    def __getattr__(self, name):  # the inner reader's other attributes (``direct``...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def start(self) -> None:
        self.inner.start()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._free.clear()
            self.inner.close()

    def __repr__(self) -> str:
        return f"PartReader({self.inner!r})"
