""":class:`H5Dataset`: map-style, unshuffled evaluation and inference over a split, read through
solar's block readers (``pread`` when every dataset is raw-readable, else ``h5py``), and
:func:`shard_range` to split an evaluation over ranks without ``DistributedSampler``'s padding.

    ds = H5Dataset("data/well", split="valid", fields=["t0_fields/density"])
    for batch in DataLoader(ds.shard(), batch_size=8, num_workers=2):   # this rank's share
        ...                        # {field: tensor (B, ...), "index": tensor (B,)}
"""
from __future__ import annotations

import numbers
import os
from typing import Callable, Dict, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from ..errors import SpecError

__all__ = ["H5Dataset", "shard_range"]


class H5Dataset(Dataset):
    """``ds[i]`` -> ``{field: tensor (field shape), "index": i}`` of sample ``i`` (global id in the
    layout of ``split``); ``len(ds)`` samples.  Works with ``DataLoader(ds, batch_size=B,
    num_workers=k)``: each process opens its own reader on first use (fork or spawn).

    ``data``: layout spec path, folder, HDF5 file or a :class:`~solar.layout.Layout`;
    ``split``: a split of the spec (default: its ``train`` or first split; a Layout is taken as
    is); ``fields``: only these fields (and only their blocks are read); ``transform(sample) ->
    dict`` on each sample's ``{field: tensor}`` in the worker (``index`` is added after);
    ``reader``: a name of :data:`solar.io.READERS` (default :func:`~solar.io.default_reader_name`);
    ``threads``: the reader's threads (1: read in the calling thread).  Values equal h5py's reads
    of the same sample, in native byte order.
    """

    def __init__(self, data, split: Optional[str] = None, fields: Optional[Sequence[str]] = None,
                 transform: Optional[Callable[[Dict[str, torch.Tensor]], dict]] = None,
                 reader: Optional[str] = None, threads: int = 1, reader_options: Optional[dict] = None):
        from ..io import default_reader_name
        from ..layout import Layout, load_layout
        from ..loader.assemble import BatchAssembler
        from ..loader.hooks import check_hook
        if isinstance(data, Layout):
            if split is not None:
                raise SpecError("split= selects from a layout spec path; a Layout is used as it is")
            self.layout = data
        else:
            self.layout = load_layout(data, split=split)
        self.assembler = BatchAssembler(self.layout, gather=False, fields=fields)
        self.fields = tuple(self.assembler.fields)
        self.transform = check_hook("transform", transform)
        self.reader_name = reader or default_reader_name(self.layout)
        self.reader_opts = dict(threads=threads, **(reader_options or {}))
        self._datasets = {name: d for name, d, _ in self.layout.sample_fields(0)} if len(self.layout) else {}
        self._reader, self._pid = None, None
        self._open_reader()  # bad reader names and options fail here, not in a worker

    def __len__(self) -> int:
        return self.layout.n_samples

    def _open_reader(self):
        """This process's reader (a forked or spawned worker opens its own)."""
        if self._reader is None or self._pid != os.getpid():
            from ..io import get_reader
            self._reader, self._pid = get_reader(self.reader_name, self.layout, **self.reader_opts), os.getpid()
        return self._reader

    def _blocks(self, i: int) -> np.ndarray:
        """Distinct blocks of sample ``i`` that hold the asked-for fields."""
        lay = self.layout
        wanted = [d for name, d, _ in lay.sample_fields(i) if name in self.fields]
        blocks = np.unique(lay.blocks_of(i))
        return blocks[np.isin(lay.block_dataset[blocks], wanted)]

    def __getitem__(self, i) -> dict:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"H5Dataset index must be an integer, got {type(i).__name__}")
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range: the dataset has {n} samples")
        i = int(i) % n
        blocks = self._blocks(i)
        bufs = [np.empty(int(self.layout.block_nbytes[b]), np.uint8) for b in blocks.tolist()]
        self._open_reader().read_blocks(blocks, bufs)
        by_id = dict(zip(blocks.tolist(), bufs))
        batch = self.assembler(0, np.array([i], np.int64), by_id.__getitem__)
        # v[0, ...]: a scalar field stays 0-d (v[0] is a numpy scalar, which ascontiguousarray makes shape (1,))
        sample = {k: torch.from_numpy(np.asarray(v[0, ...] if isinstance(v, np.ndarray) else v[0], order="C"))
                  for k, v in batch.items()}
        if self.transform is not None:
            sample = self.transform(sample)
            if not isinstance(sample, dict):
                raise SpecError(f"transform must return a dict, got {type(sample).__name__} (sample {i})")
        sample.setdefault("index", i)
        return sample

    def shard(self, rank: Optional[int] = None, world_size: Optional[int] = None) -> Subset:
        """This rank's contiguous share (:func:`shard_range`) as a ``Subset``; rank and world size
        default to the launcher's (:func:`solar.topology.launcher`: torch.distributed, torchrun, MPI,
        SLURM; one process: the whole dataset)."""
        if rank is None or world_size is None:
            from ..topology import launcher
            t = launcher()
            rank = t.rank if rank is None else rank
            world_size = t.world_size if world_size is None else world_size
        return Subset(self, shard_range(len(self), rank, world_size))

    def close(self) -> None:
        if self._reader is not None and self._pid == os.getpid():
            self._reader.close()
        self._reader = None

    def __getstate__(self) -> dict:
        """For spawned workers: everything but the reader (each process opens its own)."""
        state = dict(self.__dict__)
        state["_reader"], state["_pid"] = None, None
        return state


def shard_range(n: int, rank: int, world_size: int) -> range:
    """Samples ``[n * rank // world_size, n * (rank + 1) // world_size)``: every sample on exactly
    one rank, shares differing by at most one, none repeated (``DistributedSampler`` pads with
    repeats, which biases an evaluation mean); reduce sums and counts across ranks."""
    for name, v, lo in (("n", n, 0), ("world_size", world_size, 1)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
            raise SpecError(f"{name} must be an integer >= {lo}, got {v!r}")
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < world_size:
        raise SpecError(f"rank {rank!r} out of range: the job has ranks 0..{world_size - 1}")
    return range(n * rank // world_size, n * (rank + 1) // world_size)
