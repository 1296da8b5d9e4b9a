"""Build a step's local batch from resident decoded blocks (the layout's side of the buffer)."""
from __future__ import annotations

from typing import Callable, Dict

import numpy as np

from ..io.raw import place_block


class BatchAssembler:
    """``assembler(step, samples, lookup) -> {field: array (n, *field shape)}``.

    Each field of each sample is copied once, straight from the buffer's block into
    the batch array (allocated in pinned memory when ``pin_memory`` and CUDA is there).
    Samples of different shapes (``whole`` layouts of uneven files) come back as
    lists instead of stacked arrays.  A scalar field (dataset ``(N,)``) gives an
    array of shape ``(n,)``.  Values come out in native byte order (``torch.from_numpy``
    refuses any other): a big-endian dataset is converted while it is copied, losslessly.
    """

    def __init__(self, layout, pin_memory: bool = False):
        self.layout = layout
        self.pin = bool(pin_memory)
        shapes = {tuple(sorted(layout.field_shapes(int(layout.source_start[i])).items()))
                  for i in range(len(layout.sources))}
        self.uniform = len(shapes) == 1
        self.shapes = layout.field_shapes(0) if layout.n_samples else {}
        self.dtypes = layout.field_dtypes() if layout.n_samples else {}

    def _empty(self, shape, dtype):
        if self.pin:
            import torch
            if torch.cuda.is_available():
                t = torch.empty(shape, dtype=torch.from_numpy(np.empty(0, dtype)).dtype, pin_memory=True)
                return t.numpy()
        return np.empty(shape, dtype=dtype)

    def __call__(self, step: int, samples: np.ndarray, lookup: Callable[[int], np.ndarray]) -> Dict[str, object]:
        lay = self.layout
        n = int(samples.shape[0])
        if self.uniform:
            out = {k: self._empty((n, *self.shapes[k]), self.dtypes[k]) for k in self.shapes}
        else:
            out = {k: [None] * n for k in self.shapes}
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
        return out
