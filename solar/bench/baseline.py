"""The baselines: DataLoader workers sharded by DistributedSampler, reading as users write it.

Every baseline is a ``DistributedSampler`` (shuffle, ``set_epoch``) and a
``DataLoader`` with worker processes; they differ in the ``Dataset``:

* ``torch`` — a map-style ``Dataset`` whose ``__getitem__`` reads ``dset[index]``
  for each field through h5py, files and datasets kept open (h5py's default chunk cache);
* ``h5py-cache`` — the same with a chunk cache sized to solar's buffer (chunked data only);
* ``memmap`` — a memory map of contiguous, unfiltered data (``numpy.memmap``'s way), a batch per
  ``__getitem__`` (fancy index of the batch's sorted rows), kernel readahead on;
* ``batched`` — h5py, a batch per ``__getitem__``: one fancy-index read of the
  batch's sorted rows per field (row layouts only).

:func:`skip_reason` says when one does not apply.  :func:`run_baseline` times one
epoch by epoch, loader only (a training step is a ``sleep``).

Worker processes start with ``forkserver`` (or ``spawn``), never ``fork``:
the calling process has initialised MPI, and a forked copy of an MPI process
is unsafe.  Nothing this module imports pulls in ``mpi4py``; a script that
uses it must import ``mpi4py`` inside its ``main()``, not at the top, because
new workers import the ``__main__`` script again.
"""
from __future__ import annotations

import itertools
import mmap
import multiprocessing
import os
import time
from typing import Callable, Dict, List, Optional

import h5py
import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, Sampler

from ..errors import SolarError
from ..layout import load_layout
from .cache import largest_left
from .consume import epoch_au

START_METHODS = ("forkserver", "spawn")
#: The baselines: per-sample h5py (``torch``, ``h5py-cache``), per-batch reads (``memmap``, ``batched``).
BASELINES = ("torch", "memmap", "h5py-cache", "batched")


class H5Samples(Dataset):
    """Samples of a layout read through h5py, one ``{field: tensor}`` dict each (baselines ``torch``, ``h5py-cache``).

    Pickles to the spec path plus the small index facts (file paths, dataset
    names, sources); HDF5 files are opened lazily on first use in each process
    (``h5py.File(path, "r", locking=False)``), so no handle crosses a process.
    The ``h5py.Dataset`` objects are kept open too, so HDF5's chunk cache (one
    per open dataset) survives between samples.  ``chunk_cache_bytes``: that
    cache's size per dataset (``rdcc_nbytes``; None: h5py's default, 1 MiB).
    """

    def __init__(self, spec_path: str, layout=None, chunk_cache_bytes: Optional[int] = None):
        layout = layout if layout is not None else load_layout(spec_path)
        self.spec_path = os.fspath(spec_path)
        self.files = tuple(layout.files)
        self.dsets = tuple((d.file, d.name, len(d.shape)) for d in layout.datasets)
        self.fields = tuple(layout.field_names)
        self.sources = tuple(layout.sources)
        self.source_start = np.array(layout.source_start, dtype=np.int64)
        self.file_kw = _chunk_cache_kw(layout, chunk_cache_bytes)
        self._pid = None
        self._handles: Dict[int, h5py.File] = {}
        self._open: Dict[int, h5py.Dataset] = {}

    def __len__(self) -> int:
        return int(self.source_start[-1])

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_pid"], state["_handles"], state["_open"] = None, {}, {}
        return state

    def where(self, i: int) -> list:
        """``[(field, dataset id, index tuple)]`` of sample ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        s = int(np.searchsorted(self.source_start, i, side="right") - 1)
        src, local = self.sources[s], int(i - self.source_start[s])
        return [(self.fields[k], d, src.selection(k, local, self.dsets[d][2])) for k, d in enumerate(src.datasets)]

    def _dataset(self, d: int) -> h5py.Dataset:
        pid = os.getpid()
        if self._pid != pid:  # a new process: never reuse (or close) another process's handles
            self._pid, self._handles, self._open = pid, {}, {}
        ds = self._open.get(d)
        if ds is None:
            fi, name, _ = self.dsets[d]
            f = self._handles.get(fi)
            if f is None:
                f = self._handles[fi] = h5py.File(self.files[fi], "r", locking=False, **self.file_kw)
            ds = self._open[d] = f[name]
        return ds

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {field: torch.from_numpy(_native(self._dataset(d)[sel])) for field, d, sel in self.where(int(i))}

    def close(self):
        """Close the files this process opened."""
        if self._pid == os.getpid():
            for f in self._handles.values():
                f.close()
        self._pid, self._handles, self._open = None, {}, {}


def _native(a) -> np.ndarray:
    """``a`` as an array in native byte order (torch refuses others); values unchanged."""
    a = np.asarray(a)
    return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))


def _chunk_cache_kw(layout, per_dataset: Optional[int]) -> dict:
    """``h5py.File`` keywords for a chunk cache of ``per_dataset`` bytes (``{}``: h5py's default)."""
    if per_dataset is None:
        return {}
    chunk = max((int(np.prod(d.chunks)) * d.itemsize for d in layout.datasets if d.chunks), default=1)
    fit = max(1, per_dataset // max(chunk, 1))
    return dict(rdcc_nbytes=int(per_dataset), rdcc_nslots=int(100 * fit) | 1, rdcc_w0=1.0)


class BatchSamples(Dataset):
    """Whole batches of a layout: ``dataset[list of sample ids]`` -> ``{field: tensor[n, ...]}``.

    Used with ``DataLoader(sampler=BatchSampler(...), batch_size=None)``, as a user who reads a
    batch at a time writes it.  Per field and source, the batch's ids are sorted and made
    unique and read in one call (:meth:`_read`), then put back in the sampler's order.
    ``how``: ``"memmap"`` (a read-only memory map of the file viewed as the dataset's array,
    as ``numpy.memmap`` makes it; contiguous, unfiltered data; mapped per batch, readahead left on) or ``"batched"`` (h5py fancy index of the sorted rows, datasets kept open).
    """

    def __init__(self, spec_path: str, how: str, layout=None):
        self.samples = H5Samples(spec_path, layout)
        self.how = how
        layout = layout if layout is not None else load_layout(spec_path)
        self.meta = tuple((d.offset, tuple(d.shape), d.dtype) for d in layout.datasets)

    def __len__(self) -> int:
        return len(self.samples)

    def _read(self, s: int, k: int, d: int, local: np.ndarray) -> np.ndarray:
        """Field ``k`` of source ``s`` for sorted unique local ids (array ``[n, ...]``)."""
        src = self.samples.sources[s]
        if self.how == "batched":
            return np.asarray(self.samples._dataset(d)[local])
        offset, shape, dtype = self.meta[d]
        with open(self.samples.files[self.samples.dsets[d][0]], "rb") as fh:
            m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            arr = np.frombuffer(m, np.dtype(dtype), count=int(np.prod(shape)), offset=offset).reshape(shape)
            if src.kind == "rows" and src.roles[k] == "s":
                got = np.array(arr[local])
            else:
                got = np.stack([np.array(arr[src.selection(k, int(i), len(shape))]) for i in local])
            del arr
        finally:
            m.close()  # unmapped now: the next cache drop can evict these pages
        return got

    def __getitem__(self, ids) -> Dict[str, torch.Tensor]:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0 or ids.min() < 0 or ids.max() >= len(self):
            raise IndexError(f"batch {ids.tolist()} is not a non-empty list of sample ids in [0, {len(self)})")
        starts = self.samples.source_start
        src_of = np.searchsorted(starts, ids, side="right") - 1
        out: Dict[str, np.ndarray] = {}
        for s in np.unique(src_of):
            pos = np.flatnonzero(src_of == s)
            local, inv = np.unique(ids[pos] - starts[s], return_inverse=True)
            for k, d in enumerate(self.samples.sources[s].datasets):
                got = _native(self._read(int(s), k, d, local))
                field = self.samples.fields[k]
                if field not in out:
                    out[field] = np.empty((ids.size,) + got.shape[1:], dtype=got.dtype)
                out[field][pos] = got[inv]
        return {f: torch.from_numpy(a) for f, a in out.items()}

    def close(self):
        self.samples.close()


def skip_reason(layout, kind: str) -> Optional[str]:
    """Why baseline ``kind`` does not apply to ``layout`` (None: it does)."""
    if kind not in BASELINES:
        raise SolarError(f"baseline must be one of {', '.join(BASELINES)}, got {kind!r}")
    ds = layout.datasets
    if kind == "memmap":
        for d in ds:
            if d.chunks is not None:
                return f"dataset {d.name} is chunked{' and filtered' if d.filters else ''}: numpy.memmap needs " \
                       "contiguous, unfiltered data"
            if d.offset is None:
                return f"dataset {d.name} has no contiguous data in its file (never written or external)"
    if kind == "h5py-cache" and not any(d.chunks for d in ds):
        return "contiguous data: HDF5 has no chunk cache for it (the torch baseline is this loader)"
    if kind == "batched":
        for src in layout.sources:
            if src.kind != "rows" or any(r != "s" for r in src.roles):
                return f"samples of {layout.files[src.file]} are {src.kind} (not one row per sample): no single " \
                       "fancy index per field selects a batch"
    return None


def baseline_dataset(spec_path: str, kind: str, layout=None, memory_bytes: Optional[int] = None, workers: int = 0):
    """The ``Dataset`` of baseline ``kind`` (see :data:`BASELINES`).

    ``memory_bytes``: the rank's memory for ``h5py-cache`` (solar's buffer per rank),
    split evenly over the reading processes (``max(1, workers)``) and the datasets each opens.
    """
    layout = layout if layout is not None else load_layout(spec_path)
    if kind in ("torch", "h5py-cache"):
        per = None
        if kind == "h5py-cache":
            if memory_bytes is None or memory_bytes < 1:
                raise SolarError(f"h5py-cache needs the memory to size its chunk cache, got {memory_bytes!r}")
            per = max(1, int(memory_bytes) // (max(1, workers) * len(layout.datasets)))
        return H5Samples(spec_path, layout, chunk_cache_bytes=per)
    return BatchSamples(spec_path, kind, layout)


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


def _wait_all(comm):
    """Barrier in which waiting ranks sleep (:func:`solar.mpi.sleep_barrier`) when ``comm`` supports it."""
    if hasattr(comm, "Ibarrier"):
        from ..mpi import sleep_barrier
        sleep_barrier(comm)
    else:
        comm.Barrier()


def _verify(layout, picked: list, who: str = "baseline") -> int:
    """Compare delivered samples (``(id, {field: tensor})``) with fresh h5py reads; raises SolarError on
    the first difference."""
    for sample, got in picked:
        for field, d, sel in layout.sample_fields(sample):
            info = layout.datasets[d]
            with h5py.File(layout.files[info.file], "r", locking=False) as f:
                ref = _native(f[info.name][sel])
            arr = got[field].numpy()
            if arr.shape != ref.shape or arr.dtype != ref.dtype or not np.array_equal(arr, ref, equal_nan=True):
                raise SolarError(f"{who} delivered wrong data for sample {sample}, field {field!r} "
                                 f"(got {arr.dtype}{list(arr.shape)}, h5py reads {ref.dtype}{list(ref.shape)})")
    return len(picked)


class BaselineFailed(SolarError):
    """A baseline's DataLoader workers died mid-run (raised on every rank at the same epoch)."""


def _epoch(loader, order, step_time, n_verify, bar, time_limit: Optional[float] = None, consume=None) -> dict:
    """Run one epoch through ``loader`` (stopped after ``time_limit`` seconds if given):
    ``dict(samples, bytes, seconds, stall, picked, partial, sizes)``.

    ``consume``: what each batch feeds (:class:`solar.bench.consume.Consumer`); on a CUDA device the batches
    (pinned by the DataLoader) are copied there ahead of use on a side stream (:func:`solar.torch.to_device`),
    the transfer solar's loader does too, and the timer stops when the device has run every step.
    Without it, ``step_time`` seconds of sleep per step."""
    n = len(order)
    check = set(np.linspace(0, n - 1, n_verify).round().astype(int).tolist()) if n_verify and n else set()
    picked = []  # (sample id, {field: tensor}) at the checked positions
    samples = nbytes = 0
    stall = 0.0
    sizes = []
    cuda = consume is not None and consume.cfg.cuda
    t0 = time.perf_counter()
    it = iter(loader)  # persistent workers: sends this epoch's indices and starts prefetching
    if cuda:
        from ..torch.device import to_device
        it = to_device(it, consume.device, depth=2)
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
        sizes.append(rows)
        nbytes += sum(v.nbytes for v in batch.values())
        if bar is not None:
            bar.update(1)
        if consume is not None:
            consume(batch)
        elif step_time:
            time.sleep(step_time)
        if time_limit is not None and time.perf_counter() - t0 > time_limit:
            break
    if consume is not None:
        consume.sync()
    seconds = time.perf_counter() - t0
    if cuda:
        it.close()  # the staging generator, before the DataLoader's iterator goes
    picked = [(i, {k: v.cpu() for k, v in f.items()}) for i, f in picked]
    return dict(samples=samples, bytes=nbytes, seconds=seconds, stall=stall, picked=picked,
                partial=samples < n, sizes=sizes)


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
                 verify: int = 0, start_method: str = "forkserver", kind: str = "torch",
                 memory_bytes: Optional[int] = None, worker_init_fn: Optional[Callable[[int], None]] = None,
                 time_limit: Optional[float] = None, consume=None) -> List[dict]:
    """Time baseline loader ``kind`` (see :data:`BASELINES`) for ``epochs`` epochs on every rank of ``comm``.

    ``DistributedSampler(num_replicas=comm.size, rank=comm.rank, shuffle=True,
    seed=seed, drop_last=False)`` with ``set_epoch(e)``; ``DataLoader(batch_size=
    local_batch, num_workers=num_workers, pin_memory=False)``, workers started
    with ``start_method``.  Each epoch: ``drop_cache()`` (if given), barrier,
    timed loop (per batch: wait for it = stall, then ``sleep(step_time)`` as
    the training step), then the per-rank figures are reduced over ``comm``.
    ``memmap`` and ``batched`` read a batch per ``__getitem__`` (``BatchSampler``
    over the same sampler, ``batch_size=None``): the same global batches.
    ``memory_bytes`` sizes ``h5py-cache``'s chunk cache (see :func:`baseline_dataset`);
    ``worker_init_fn`` runs in each worker as it starts.  ``time_limit``: each rank stops an epoch after
    that many seconds (a loader collapsing under a memory limit need not take minutes per epoch); the
    epoch's rate is then over the samples delivered (``partial`` True in its figures).

    Fairness: workers are ``persistent_workers=True`` and are started and
    warmed (one batch each, untimed, before the first cache drop), so neither
    process start-up nor imports are timed; users pay those once per run
    with persistent workers (every epoch without).  Each timed epoch does
    include creating the epoch's iterator and the prefetch ramp-up, as a
    training loop does.  ``num_workers=0`` reads in the calling process.

    ``consume``: a :class:`solar.bench.consume.Consumer` each batch feeds instead of the sleep (a training step
    on its device; with CUDA the DataLoader pins its batches, ``pin_memory=True``, and they are copied to the
    device ahead of use); after each epoch's timer every rank runs the same steps on its resident batch
    (the device-only time): ``au``, ``au_min``, ``gpu_wait_fraction``, ``device_only_s`` per epoch.

    ``verify`` > 0 compares that many delivered samples per epoch and rank
    (evenly spread over the epoch) against fresh h5py reads after the timed
    loop, raising :class:`SolarError` on a difference.

    Returns one dict per epoch: ``epoch``, ``samples`` (this rank),
    ``global_samples``, ``seconds`` (max over ranks), ``rank_seconds``,
    ``samples_per_s`` (global samples / max seconds), ``stall_s`` (this rank),
    ``stall_max_s`` (max over ranks), ``bytes_delivered`` (this rank),
    ``global_bytes``, ``verified`` (samples checked on this rank) and
    ``page_cache_left`` (what ``drop_cache()`` returned: the largest fraction of a
    data file still cached after the drop, None when not measured).
    Raises :class:`SolarError` when ``kind`` does not apply to the layout (:func:`skip_reason`).
    """
    _check_args(local_batch, epochs, num_workers, step_time, verify, start_method)
    if time_limit is not None and not (isinstance(time_limit, (int, float)) and time_limit > 0):
        raise SolarError(f"time_limit must be > 0 seconds or None, got {time_limit!r}")
    layout = load_layout(spec_path)
    why = skip_reason(layout, kind)
    if why:
        raise SolarError(f"baseline {kind} does not apply to {spec_path}: {why}")
    dataset = baseline_dataset(spec_path, kind, layout, memory_bytes=memory_bytes, workers=num_workers)
    sampler = DistributedSampler(dataset, num_replicas=comm.size, rank=comm.rank, shuffle=True, seed=seed,
                                 drop_last=False)
    wrapped = _WarmableSampler(sampler)
    kw = {}
    if num_workers:
        kw = dict(persistent_workers=True, multiprocessing_context=_mp_context(start_method),
                  worker_init_fn=worker_init_fn)
    if isinstance(dataset, BatchSamples):
        kw.update(sampler=BatchSampler(wrapped, local_batch, drop_last=False), batch_size=None)
    else:
        kw.update(sampler=wrapped, batch_size=local_batch)
    cuda = consume is not None and consume.cfg.cuda
    loader = DataLoader(dataset, num_workers=num_workers, pin_memory=cuda, **kw)
    results = []
    try:
        if num_workers:
            _warm_up(loader, sampler, wrapped, num_workers * local_batch, start_method)
        bar = None
        for e in range(epochs):
            sampler.set_epoch(e)
            order = np.fromiter(iter(sampler), dtype=np.int64)
            left = drop_cache() if drop_cache is not None else None
            _wait_all(comm)
            if progress and comm.rank == 0:
                from tqdm import tqdm
                bar = tqdm(total=len(loader), desc=f"{kind} epoch {e}", unit="batch", leave=False)
            try:
                r, died = _epoch(loader, order, step_time, verify, bar, time_limit, consume), ""
            except RuntimeError as exc:  # a worker killed (e.g. by a memory limit): every rank learns it below
                if "exited unexpectedly" not in str(exc):
                    raise
                r, died = None, f"rank {comm.rank}: {str(exc).splitlines()[0]}"
            if bar is not None:
                bar.close()
            deaths = [d for d in comm.allgather(died) if d]
            if deaths:
                raise BaselineFailed(f"{kind} failed in epoch {e}: {'; '.join(deaths)}")
            verified = _verify(layout, r["picked"]) if verify else 0
            util = epoch_au(consume, comm, r["sizes"], step_time, r["seconds"])
            per_rank = comm.allgather((r["seconds"], r["stall"], r["samples"], r["bytes"], left, r["partial"]))
            seconds = max(x[0] for x in per_rank)
            total = sum(x[2] for x in per_rank)
            results.append(dict(epoch=e, samples=r["samples"], global_samples=total, seconds=seconds,
                                rank_seconds=r["seconds"], samples_per_s=total / seconds if seconds > 0 else 0.0,
                                stall_s=r["stall"], stall_max_s=max(x[1] for x in per_rank),
                                bytes_delivered=r["bytes"], global_bytes=sum(x[3] for x in per_rank),
                                verified=verified, page_cache_left=largest_left(x[4] for x in per_rank),
                                partial=any(x[5] for x in per_rank), **util))
    finally:
        del loader  # shuts persistent workers down
        dataset.close()
    return results

