"""The PyTorch baseline: h5py reads in DataLoader workers, sharded by DistributedSampler.

This is the loader users write today: a map-style ``Dataset`` whose
``__getitem__`` reads ``f[name][index]`` for each field through h5py, a
``DistributedSampler`` (shuffle, ``set_epoch``) and a ``DataLoader`` with
worker processes.  :func:`run_baseline` times it epoch by epoch, loader only
(a training step is a ``sleep``).

Worker processes start with ``forkserver`` (or ``spawn``), never ``fork``:
the calling process has initialised MPI, and a forked copy of an MPI process
is unsafe.  Nothing this module imports pulls in ``mpi4py``; a script that
uses it must import ``mpi4py`` inside its ``main()``, not at the top, because
new workers import the ``__main__`` script again.
"""
from __future__ import annotations

import itertools
import multiprocessing
import os
import time
from typing import Callable, Dict, List, Optional

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from ..errors import SolarError
from ..layout import load_layout

START_METHODS = ("forkserver", "spawn")


class H5Samples(Dataset):
    """Samples of a layout read through h5py, one ``{field: tensor}`` dict each.

    Pickles to the spec path plus the small index facts (file paths, dataset
    names, sources); HDF5 files are opened lazily on first use in each process
    (``h5py.File(path, "r", locking=False)``), so no handle crosses a process.
    """

    def __init__(self, spec_path: str, layout=None):
        layout = layout if layout is not None else load_layout(spec_path)
        self.spec_path = os.fspath(spec_path)
        self.files = tuple(layout.files)
        self.dsets = tuple((d.file, d.name, len(d.shape)) for d in layout.datasets)
        self.fields = tuple(layout.field_names)
        self.sources = tuple(layout.sources)
        self.source_start = np.array(layout.source_start, dtype=np.int64)
        self._pid = None
        self._handles: Dict[int, h5py.File] = {}

    def __len__(self) -> int:
        return int(self.source_start[-1])

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_pid"], state["_handles"] = None, {}
        return state

    def where(self, i: int) -> list:
        """``[(field, file index, dataset name, index tuple)]`` of sample ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        s = int(np.searchsorted(self.source_start, i, side="right") - 1)
        src, local = self.sources[s], int(i - self.source_start[s])
        out = []
        for k, d in enumerate(src.datasets):
            fi, name, ndim = self.dsets[d]
            out.append((self.fields[k], fi, name, src.selection(k, local, ndim)))
        return out

    def _file(self, fi: int) -> h5py.File:
        pid = os.getpid()
        if self._pid != pid:  # a new process: never reuse (or close) another process's handles
            self._pid, self._handles = pid, {}
        f = self._handles.get(fi)
        if f is None:
            f = self._handles[fi] = h5py.File(self.files[fi], "r", locking=False)
        return f

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {field: torch.from_numpy(np.asarray(self._file(fi)[name][sel]))
                for field, fi, name, sel in self.where(int(i))}

    def close(self):
        """Close the files this process opened."""
        if self._pid == os.getpid():
            for f in self._handles.values():
                f.close()
        self._pid, self._handles = None, {}


class _WarmableSampler(Sampler):
    """Passes the DistributedSampler through; with ``limit`` set, only its first ``limit`` indices."""

    def __init__(self, inner: DistributedSampler):
        self.inner = inner
        self.limit: Optional[int] = None

    def __iter__(self):
        it = iter(self.inner)
        return it if self.limit is None else itertools.islice(it, self.limit)

    def __len__(self) -> int:
        n = len(self.inner)
        return n if self.limit is None else min(n, self.limit)


def _check_args(local_batch, epochs, num_workers, step_time, verify, start_method):
    for name, v, lo in (("local_batch", local_batch, 1), ("epochs", epochs, 1), ("num_workers", num_workers, 0),
                        ("verify", verify, 0)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise SolarError(f"{name} must be an integer >= {lo}, got {v!r}")
    if not isinstance(step_time, (int, float)) or not step_time >= 0:
        raise SolarError(f"step_time must be >= 0 seconds, got {step_time!r}")
    if start_method not in START_METHODS:
        raise SolarError(f"worker start method must be one of {', '.join(START_METHODS)}, got {start_method!r}")


def _mp_context(start_method: str):
    """The workers' multiprocessing context; a forkserver preloads torch, h5py and this module once."""
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["__main__", __name__])  # takes effect when the server first starts
    return ctx


def _verify(layout, picked: list) -> int:
    """Compare delivered samples with fresh h5py reads; raises SolarError on the first difference."""
    for sample, got in picked:
        for field, d, sel in layout.sample_fields(sample):
            info = layout.datasets[d]
            with h5py.File(layout.files[info.file], "r", locking=False) as f:
                ref = np.asarray(f[info.name][sel])
            arr = got[field].numpy()
            if arr.shape != ref.shape or arr.dtype != ref.dtype or not np.array_equal(arr, ref, equal_nan=True):
                raise SolarError(f"baseline delivered wrong data for sample {sample}, field {field!r} "
                                 f"(got {arr.dtype}{list(arr.shape)}, h5py reads {ref.dtype}{list(ref.shape)})")
    return len(picked)


def _epoch(loader, order, step_time, n_verify, bar) -> dict:
    """Run one epoch through ``loader``: ``dict(samples, bytes, seconds, stall, picked)``."""
    n = len(order)
    check = set(np.linspace(0, n - 1, n_verify).round().astype(int).tolist()) if n_verify and n else set()
    picked = []  # (sample id, {field: tensor}) at the checked positions
    samples = nbytes = 0
    stall = 0.0
    t0 = time.perf_counter()
    it = iter(loader)  # persistent workers: sends this epoch's indices and starts prefetching
    while True:
        t = time.perf_counter()
        batch = next(it, None)
        stall += time.perf_counter() - t
        if batch is None:
            break
        rows = len(next(iter(batch.values())))
        for pos in range(samples, samples + rows):
            if pos in check:
                picked.append((int(order[pos]), {k: v[pos - samples].clone() for k, v in batch.items()}))
        samples += rows
        nbytes += sum(v.nbytes for v in batch.values())
        if bar is not None:
            bar.update(1)
        if step_time:
            time.sleep(step_time)
    return dict(samples=samples, bytes=nbytes, seconds=time.perf_counter() - t0, stall=stall, picked=picked)


def _warm_up(loader, sampler, wrapped, n: int, start_method: str):
    """Start every worker with one untimed batch each (the first ``n`` indices of epoch 0)."""
    sampler.set_epoch(0)
    wrapped.limit = n
    try:
        for _ in loader:
            pass
    except RuntimeError as exc:
        if "exited unexpectedly" not in str(exc):
            raise
        raise SolarError(f"DataLoader workers ({start_method}) died while starting: {exc}. One known cause "
                         "under mpiexec: the __main__ script imports mpi4py at module level, workers import "
                         "that script again and their MPI_Init fails; import mpi4py inside main() instead") from None
    finally:
        wrapped.limit = None


def run_baseline(spec_path: str, *, comm, local_batch: int, epochs: int, seed: int = 0, num_workers: int = 2,
                 step_time: float = 0.0, drop_cache: Optional[Callable[[], None]] = None, progress: bool = False,
                 verify: int = 0, start_method: str = "forkserver") -> List[dict]:
    """Time the PyTorch baseline loader for ``epochs`` epochs on every rank of ``comm``.

    ``DistributedSampler(num_replicas=comm.size, rank=comm.rank, shuffle=True,
    seed=seed, drop_last=False)`` with ``set_epoch(e)``; ``DataLoader(batch_size=
    local_batch, num_workers=num_workers, pin_memory=False)``, workers started
    with ``start_method``.  Each epoch: ``drop_cache()`` (if given), barrier,
    timed loop (per batch: wait for it = stall, then ``sleep(step_time)`` as
    the training step), then the per-rank figures are reduced over ``comm``.

    Fairness: workers are ``persistent_workers=True`` and are started and
    warmed (one batch each, untimed, before the first cache drop), so neither
    process start-up nor imports are timed; users pay those once per run
    with persistent workers (every epoch without).  Each timed epoch does
    include creating the epoch's iterator and the prefetch ramp-up, as a
    training loop does.  ``num_workers=0`` reads in the calling process.

    ``verify`` > 0 compares that many delivered samples per epoch and rank
    (evenly spread over the epoch) against fresh h5py reads after the timed
    loop, raising :class:`SolarError` on a difference.

    Returns one dict per epoch: ``epoch``, ``samples`` (this rank),
    ``global_samples``, ``seconds`` (max over ranks), ``rank_seconds``,
    ``samples_per_s`` (global samples / max seconds), ``stall_s`` (this rank),
    ``stall_max_s`` (max over ranks), ``bytes_delivered`` (this rank),
    ``global_bytes`` and ``verified`` (samples checked on this rank).
    """
    _check_args(local_batch, epochs, num_workers, step_time, verify, start_method)
    layout = load_layout(spec_path)
    dataset = H5Samples(spec_path, layout)
    sampler = DistributedSampler(dataset, num_replicas=comm.size, rank=comm.rank, shuffle=True, seed=seed,
                                 drop_last=False)
    wrapped = _WarmableSampler(sampler)
    kw = {}
    if num_workers:
        kw = dict(persistent_workers=True, multiprocessing_context=_mp_context(start_method))
    loader = DataLoader(dataset, batch_size=local_batch, sampler=wrapped, num_workers=num_workers,
                        pin_memory=False, **kw)
    results = []
    try:
        if num_workers:
            _warm_up(loader, sampler, wrapped, num_workers * local_batch, start_method)
        bar = None
        for e in range(epochs):
            sampler.set_epoch(e)
            order = np.fromiter(iter(sampler), dtype=np.int64)
            if drop_cache is not None:
                drop_cache()
            comm.Barrier()
            if progress and comm.rank == 0:
                from tqdm import tqdm
                bar = tqdm(total=len(loader), desc=f"baseline epoch {e}", unit="batch", leave=False)
            r = _epoch(loader, order, step_time, verify, bar)
            if bar is not None:
                bar.close()
            verified = _verify(layout, r["picked"]) if verify else 0
            per_rank = comm.allgather((r["seconds"], r["stall"], r["samples"], r["bytes"]))
            seconds = max(x[0] for x in per_rank)
            total = sum(x[2] for x in per_rank)
            results.append(dict(epoch=e, samples=r["samples"], global_samples=total, seconds=seconds,
                                rank_seconds=r["seconds"], samples_per_s=total / seconds if seconds > 0 else 0.0,
                                stall_s=r["stall"], stall_max_s=max(x[1] for x in per_rank),
                                bytes_delivered=r["bytes"], global_bytes=sum(x[3] for x in per_rank),
                                verified=verified))
    finally:
        del loader  # shuts persistent workers down
        dataset.close()
    return results

