"""Build a step's local batch from resident decoded blocks (the layout's side of the buffer)."""
from __future__ import annotations

from typing import Callable, Dict

import numpy as np

from ..buffer.gather import GatherTables
from ..io.raw import place_block


class BatchAssembler:
    """``assembler(step, samples, lookup) -> {field: array (n, *field shape)}``.

    Each field of each sample is copied once, straight from the buffer's block into
    the batch array (allocated in pinned memory when ``pin_memory`` and CUDA is there).
    When ``lookup`` is the buffer's :class:`~solar.buffer.StepBlocks` and every block
    sits in a pool slot, a field is copied for the whole batch in one GIL-free call
    (:mod:`solar.buffer.gather`); otherwise (blocks read outside the plan, samples of
    different shapes, a plain callable) block by block with :func:`place_block`.
    Samples of different shapes (``whole`` layouts of uneven files) come back as
    lists instead of stacked arrays.  A scalar field (dataset ``(N,)``) gives an
    array of shape ``(n,)``.  Values come out in native byte order (``torch.from_numpy``
    refuses any other): a big-endian dataset is converted while it is copied, losslessly.
    ``gather=False`` always takes the block-by-block path (tests, benchmarks).
    """

    def __init__(self, layout, pin_memory: bool = False, gather: bool = True):
        self.layout = layout
        self.pin = bool(pin_memory)
        self.tables = GatherTables(layout)
        self.uniform = self.tables.uniform
        self.gather = bool(gather) and self.tables.ok
        self.shapes = layout.field_shapes(0) if layout.n_samples else {}
        self.dtypes = layout.field_dtypes() if layout.n_samples else {}

    def _empty(self, shape, dtype):
        if self.pin:
            import torch
            if torch.cuda.is_available():
                t = torch.empty(shape, dtype=torch.from_numpy(np.empty(0, dtype)).dtype, pin_memory=True)
                return t.numpy()
        return np.empty(shape, dtype=dtype)

    def _empty_batch(self, n: int) -> Dict[str, np.ndarray]:
        """``{field: array (n, *shape)}``: views into one allocation (64-byte aligned fields).

        One large block instead of a few: glibc keeps reusing it (a field-sized block is
        returned to the kernel and faulted in again, 4 KiB at a time, on every batch) and
        numpy asks for huge pages above 4 MiB.  Pinned batches get one tensor per field.
        """
        if self.pin:
            return {k: self._empty((n, *self.shapes[k]), self.dtypes[k]) for k in self.shapes}
        sizes = [n * int(np.prod(self.shapes[k], dtype=np.int64)) * self.dtypes[k].itemsize for k in self.shapes]
        starts = np.concatenate([[0], np.cumsum([-(-z // 64) * 64 for z in sizes])])
        raw = np.empty(int(starts[-1]), np.uint8)
        return {k: raw[int(a):int(a) + z].view(self.dtypes[k]).reshape((n, *self.shapes[k]))
                for k, a, z in zip(self.shapes, starts[:-1].tolist(), sizes)}

    def __call__(self, step: int, samples: np.ndarray, lookup: Callable[[int], np.ndarray]) -> Dict[str, object]:
        n = int(samples.shape[0])
        if self.uniform:
            out = self._empty_batch(n)
        else:
            out = {k: [None] * n for k in self.shapes}
        if self.gather and getattr(lookup, "in_pools", False):
            t = self.tables
            t.gather(samples, lookup.blocks, lookup.block_class, lookup.block_slot, lookup.pools, out)
            t.to_native(out)
            return out
        self._place_each(samples, lookup, out)
        return out

    def _place_each(self, samples: np.ndarray, lookup, out: Dict[str, object]) -> None:
        """The per-sample, per-block path: ``place_block`` for every block of every sample."""
        lay = self.layout
        for i, s in enumerate(samples.tolist()):
            fields = lay.sample_fields(s)
            by_dataset = {d: (name, sel) for name, d, sel in fields}
            if self.uniform:  # [i, ...]: a view even for scalar fields ([i] would be a copy)
                dest = {name: out[name][i, ...] for name in out}
            else:
                shp, dt = lay.field_shapes(s), lay.field_dtypes(s)
                dest = {name: np.empty(shp[name], dtype=dt[name]) for name in shp}
                for name, arr in dest.items():
                    out[name][i] = arr
            for b in lay.blocks_of(s).tolist():
                d, origin = lay.block_grid_coords(b)
                name, sel = by_dataset[d]
                info = lay.datasets[d]
                blk = lookup(b).view(np.dtype(info.dtype)).reshape(lay.block_shapes[d])
                place_block(dest[name], sel, origin, blk, info.shape)
