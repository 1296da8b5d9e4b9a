"""The :class:`Layout`: where every sample's bytes live, as blocks.

Array shapes (N samples, B blocks, D datasets, nnz = total sample->block links):

========================  =============  ==========================================
``sample_ptr``            int64[N+1]     CSR row pointers into ``sample_blocks``
``sample_blocks``         int64[nnz]     block ids of each sample, field order
``block_dataset``         int32[B]       dataset (index into ``datasets``)
``block_offset``          int64[B]       file byte offset (-1: chunk never written)
``block_stored``          int64[B]       bytes on storage
``block_nbytes``          int64[B]       decoded bytes (what a buffer holds)
``block_mask``            uint32[B]      HDF5 filter mask (bit i: filter i skipped)
``dataset_block_start``   int64[D+1]     first block id of each dataset
``source_start``          int64[S+1]     first global sample id of each source
========================  =============  ==========================================

Global sample ids run over the sources in order (files sorted by name, then
groups).  Arrays are read-only; a Layout never changes after it is built.  A schedule file of
format version 3 stores its state (:mod:`solar.layout.store`), so the ranks of a job get it with
``Schedule.layout()`` instead of building it from the HDF5 metadata.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np

from .blocks import chunk_grid
from .h5meta import DatasetInfo
from .sources import Source
from .spec import LayoutSpec


class Layout:
    """Block map of a dataset, built by :func:`solar.layout.build_layout`."""

    def __init__(self, spec: LayoutSpec, files: Tuple[str, ...], datasets: Tuple[DatasetInfo, ...],
                 block_shapes: Tuple[Tuple[int, ...], ...], sources: Tuple[Source, ...],
                 arrays: Dict[str, np.ndarray], fingerprint: str):
        self.spec = spec
        self.files = tuple(files)
        self.datasets = tuple(datasets)
        self.block_shapes = tuple(block_shapes)
        self.sources = tuple(sources)
        self.fingerprint = fingerprint
        for name, arr in arrays.items():
            arr = np.ascontiguousarray(arr)
            arr.flags.writeable = False
            setattr(self, name, arr)
        self._check()

    # ----------------------------------------------------------------- sizes
    @property
    def n_samples(self) -> int:
        return int(self.sample_ptr.shape[0] - 1)

    @property
    def n_blocks(self) -> int:
        return int(self.block_offset.shape[0])

    @property
    def field_names(self) -> Tuple[str, ...]:
        return tuple(self.spec.fields)

    def __len__(self) -> int:
        return self.n_samples

    def __repr__(self) -> str:
        return (f"Layout(kind={self.spec.kind!r}, files={len(self.files)}, samples={self.n_samples}, "
                f"blocks={self.n_blocks}, fingerprint={self.fingerprint[:12]})")

    def _check(self):
        n_b = self.block_offset.shape[0]
        for name in ("block_dataset", "block_stored", "block_nbytes", "block_mask"):
            assert getattr(self, name).shape == (n_b,), name
        assert self.dataset_block_start.shape == (len(self.datasets) + 1,)
        assert self.dataset_block_start[-1] == n_b
        assert self.source_start.shape == (len(self.sources) + 1,)
        assert self.source_start[-1] == self.sample_ptr.shape[0] - 1
        assert self.sample_ptr[-1] == self.sample_blocks.shape[0]

    # ---------------------------------------------------------------- lookups
    def blocks_of(self, sample: int) -> np.ndarray:
        """Block ids of one sample (field order)."""
        return self.sample_blocks[self.sample_ptr[sample]:self.sample_ptr[sample + 1]]

    def locate(self, sample: int) -> Tuple[Source, int]:
        """``(source, local index)`` of a global sample id."""
        if not 0 <= sample < self.n_samples:
            raise IndexError(f"sample {sample} out of range [0, {self.n_samples})")
        s = int(np.searchsorted(self.source_start, sample, side="right") - 1)
        return self.sources[s], int(sample - self.source_start[s])

    def sample_fields(self, sample: int) -> List[Tuple[str, int, tuple]]:
        """For each field: ``(name, dataset id, index tuple)`` of one sample."""
        src, local = self.locate(sample)
        out = []
        for k, d in enumerate(src.datasets):
            out.append((self.spec.fields[k], d, src.selection(k, local, len(self.datasets[d].shape))))
        return out

    def field_shapes(self, sample: int = 0) -> Dict[str, Tuple[int, ...]]:
        src, _ = self.locate(sample)
        return {self.spec.fields[k]: src.field_shape(k, self.datasets[d].shape)
                for k, d in enumerate(src.datasets)}

    def sample_shape_groups(self) -> List[Tuple[int, Dict[str, Tuple[int, ...]], Dict[str, np.dtype]]]:
        """``[(first sample, field shapes, field dtypes)]``, one entry per distinct per-sample shape and
        dtype over the sources that hold samples.  One tuple per source and no numpy call (start-up on
        datasets of many files: 20,000 sources in milliseconds, where :meth:`field_shapes` per source
        took seconds)."""
        first: Dict[tuple, int] = {}
        for i, src in enumerate(self.sources):
            if src.n_samples <= 0:
                continue
            key = (src.kind, src.window, src.roles,
                   tuple((self.datasets[d].shape, str(self.datasets[d].dtype)) for d in src.datasets))
            first.setdefault(key, int(self.source_start[i]))
        return [(s, self.field_shapes(s), self.field_dtypes(s)) for s in first.values()]

    def field_dtypes(self, sample: int = 0) -> Dict[str, np.dtype]:
        """Each field's dtype in one sample, in native byte order (as the loader delivers it).

        The builder refuses a field whose dtype differs between files other than in
        byte order, so every sample gives the same answer.
        """
        src, _ = self.locate(sample)
        return {self.spec.fields[k]: np.dtype(self.datasets[d].dtype).newbyteorder("=")
                for k, d in enumerate(src.datasets)}

    def block_grid_coords(self, block: int) -> Tuple[int, Tuple[int, ...]]:
        """``(dataset id, element origin of the block)``."""
        d = int(self.block_dataset[block])
        info = self.datasets[d]
        shp = self.block_shapes[d]
        lin = int(block - self.dataset_block_start[d])
        coords = np.unravel_index(lin, chunk_grid(info.shape, shp))
        return d, tuple(int(c) * int(s) for c, s in zip(coords, shp))

    def sample_used_nbytes(self) -> np.ndarray:
        """int64[N]: bytes each sample actually uses (sum of its fields)."""
        out = np.zeros(self.n_samples, dtype=np.int64)
        for s, src in enumerate(self.sources):
            per = sum(int(np.prod(src.field_shape(k, self.datasets[d].shape), dtype=np.int64))
                      * self.datasets[d].itemsize for k, d in enumerate(src.datasets))
            out[self.source_start[s]:self.source_start[s + 1]] = per
        return out

    def per_sample_sum(self, block_values: np.ndarray) -> np.ndarray:
        """Sum a per-block array over each sample's blocks (int64[N])."""
        vals = np.asarray(block_values, dtype=np.int64)[self.sample_blocks]
        out = np.zeros(self.n_samples, dtype=np.int64)
        nz = np.diff(self.sample_ptr) > 0
        if vals.size:
            out[nz] = np.add.reduceat(vals, self.sample_ptr[:-1][nz])
        return out
