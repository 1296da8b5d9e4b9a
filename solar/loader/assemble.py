"""Build a step's local batch from resident decoded blocks (the layout's side of the buffer)."""
from __future__ import annotations

import threading
import warnings
import weakref
from typing import Callable, Dict, Optional, Sequence

import numpy as np

from .. import aligned
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

    ``fields``: assemble only these of the layout's fields (names; a SpecError lists the valid
    ones); the other fields' blocks may be resident (the plan loads them) but are not copied.
    ``pin_memory`` without CUDA warns (once per process, :class:`RuntimeWarning`) and allocates
    ordinary memory.

    ``cpus``: the cores assembly may keep busy.  With more than one, a batch's rows are split into runs
    (at least 1 MiB each) that threads of a pool of ``cpus`` gather at once, GIL-free; :meth:`close` ends
    the pool.
    """

    def __init__(self, layout, pin_memory: bool = False, gather: bool = True,
                 fields: Optional[Sequence[str]] = None, cpus: int = 1):
        if isinstance(cpus, bool) or not isinstance(cpus, int) or cpus < 1:
            from ..errors import SpecError
            raise SpecError(f"cpus must be an integer >= 1 (cores for batch assembly), got {cpus!r}")
        self.cpus = cpus
        self._pool = None
        #: ``alloc(nbytes) -> uint8 array``: where a batch's one allocation comes from (None: :attr:`recycled`; a
        #: loader process's shared-memory segments, :mod:`solar.loader.child`)
        self.alloc: Optional[Callable[[int], np.ndarray]] = None
        self.layout = layout
        self.pin = bool(pin_memory) and _cuda_for_pinning()
        self.fields = layout.field_names if fields is None else layout.spec.field_subset(fields)
        self.tables = GatherTables(layout)
        if self.tables.ok and self.fields != layout.field_names:
            self.tables.keep_fields(self.fields)
        self.uniform = self.tables.uniform
        self.gather = bool(gather) and self.tables.ok
        self.shapes = _only(layout.field_shapes(0), self.fields) if layout.n_samples else {}
        self.dtypes = _only(layout.field_dtypes(), self.fields) if layout.n_samples else {}
        self._geometry: dict = {}  # batch size -> where each field lies in the batch's one allocation
        #: the memory of batches the caller has let go of, handed out again (:class:`Recycled`)
        self.recycled = Recycled()

    def _empty(self, shape, dtype):
        if self.pin:
            import torch
            t = torch.empty(shape, dtype=torch.from_numpy(np.empty(0, dtype)).dtype, pin_memory=True)
            return t.numpy()
        return np.empty(shape, dtype=dtype)

    def _empty_batch(self, n: int) -> Dict[str, np.ndarray]:
        return self._new_batch(n)[0]

    def _new_batch(self, n: int):
        """``({field: array (n, *shape)}, flat)``: views into one allocation (64-byte aligned fields), and ``flat``
        ``(that allocation, int64 start of each field in the gather's field order)`` (None for pinned batches).

        One large block instead of a few, from :class:`Recycled` (the memory of a batch the caller let
        go of, else a new allocation; numpy asks for huge pages above 4 MiB).  It starts on a page
        (:mod:`solar.aligned`: a copy whose destination is a few bytes past its source modulo 4 KiB runs
        3-5x slower).
        Pinned batches get one tensor per field (pinned memory starts on a page).
        """
        if self.pin:
            return {k: self._empty((n, *self.shapes[k]), self.dtypes[k]) for k in self.shapes}, None
        geo = self._geometry.get(n)
        if geo is None:  # (per batch size: most steps have one)
            sizes = [n * int(np.prod(self.shapes[k], dtype=np.int64)) * self.dtypes[k].itemsize for k in self.shapes]
            starts = [0]
            for z in sizes:
                starts.append(starts[-1] + -(-z // 64) * 64)
            at = dict(zip(self.shapes, starts))
            geo = self._geometry[n] = [(k, a, a + z, self.dtypes[k], (n, *self.shapes[k]))
                                       for k, a, z in zip(self.shapes, starts, sizes)], starts[-1], \
                np.array([at.get(k, 0) for k in getattr(self.tables, "fields", ())], np.int64)
        fields, total, at = geo
        raw = self.recycled.take(total) if self.alloc is None else self.alloc(total)
        return {k: raw[a:b].view(dt).reshape(shape) for k, a, b, dt, shape in fields}, (raw, at)

    def __call__(self, step: int, samples: np.ndarray, lookup: Callable[[int], np.ndarray]) -> Dict[str, object]:
        n = int(samples.shape[0])
        pools = getattr(lookup, "pools", None)
        if getattr(pools, "on_device", False):  # the blocks live on a device: the batch is gathered there
            if not self.gather:
                from ..errors import SpecError
                raise SpecError(f"a buffer on a device needs the gather path, which this layout cannot take "
                                f"({self.tables.why or 'gather=False'})")
            return pools.gather(self.tables, samples, lookup, n, self.shapes, self.dtypes)
        flat = None
        if self.uniform:
            out, flat = self._new_batch(n)
        else:
            out = {k: [None] * n for k in self.fields}
        if self.gather and getattr(lookup, "in_pools", False):
            t = self.tables
            t.gather(samples, lookup.blocks, lookup.block_class, lookup.block_slot, lookup.pools, out,
                     workers=self._workers(), parts=self.cpus, flat=flat)
            t.to_native(out)
            return out
        self._place_each(samples, lookup, out)
        return out

    def _workers(self):
        """The assembly threads beside the calling one (made on first use; None with one cpu)."""
        if self.cpus > 1 and self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(self.cpus - 1, thread_name_prefix="solar-assemble")
        return self._pool

    def start(self) -> None:
        """Start the assembly threads now (else the first batch starts them, :mod:`solar.threads`), and load the
        gather kernel (:meth:`GatherTables.warm <solar.buffer.gather.GatherTables.warm>`)."""
        pool = self._workers() if self.gather else None
        if pool is not None:
            from ..threads import start_threads
            start_threads(pool, self.cpus - 1)
        if self.gather:
            try:
                self.tables.warm()
            except Exception:  # noqa: BLE001 - only a head start: the first batch loads the kernel, or fails itself
                pass

    def close(self) -> None:
        """End the assembly threads (a closed assembler makes them again if called) and drop the memory kept for
        reuse."""
        self.recycled.clear()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _place_each(self, samples: np.ndarray, lookup, out: Dict[str, object]) -> None:
        """The per-sample, per-block path: ``place_block`` for every block of every sample."""
        lay = self.layout
        for i, s in enumerate(samples.tolist()):
            fields = lay.sample_fields(s)
            by_dataset = {d: (name, sel) for name, d, sel in fields if name in out}
            if self.uniform:  # [i, ...]: a view even for scalar fields ([i] would be a copy)
                dest = {name: out[name][i, ...] for name in out}
            else:
                shp, dt = _only(lay.field_shapes(s), out), _only(lay.field_dtypes(s), out)
                dest = {name: np.empty(shp[name], dtype=dt[name]) for name in shp}
                for name, arr in dest.items():
                    out[name][i] = arr
            for b in lay.blocks_of(s).tolist():
                d, origin = lay.block_grid_coords(b)
                if d not in by_dataset:  # a field not asked for
                    continue
                name, sel = by_dataset[d]
                info = lay.datasets[d]
                blk = lookup(b).view(np.dtype(info.dtype)).reshape(lay.block_shapes[d])
                place_block(dest[name], sel, origin, blk, info.shape)


class Recycled:
    """Batch memory handed out again once nothing refers to the batch any more.

    :meth:`take` returns a uint8 array on a page boundary (:mod:`solar.aligned`) that is the base of every array
    made from it (numpy views, ``torch.from_numpy`` tensors and their views all keep it alive).  When the last of
    them goes, its memory joins a short free list (at most ``keep`` allocations, :data:`KEEP`; when it is full the
    smallest is let go), and the next :meth:`take` gets the smallest kept allocation that is large enough (batch
    sizes vary: the last step of an epoch, ``epsilon``); a take that none fits lets go of them all.  A batch larger
    than glibc's largest mmap threshold (32 MiB) is otherwise a new mapping each time, all its pages faulted in and
    zeroed while it is gathered; smaller ones come back from the heap with some of their pages returned to the
    kernel.  The kept memory is within the memory model's batches: a dropped batch is one of the two it counts
    as handed out (:data:`solar.memory.BATCHES_HANDED_OUT`), no larger than the largest batch.  After
    :meth:`clear` nothing is kept any more.
    """

    KEEP = 2

    def __init__(self, keep: int = KEEP):
        self.keep = int(keep)
        # reentrant: a finalizer may run inside a locked section (the garbage collector, started by an allocation
        # there, frees a batch caught in a reference cycle on the same thread)
        self._lock = threading.RLock()
        self._free: list = []  # kept allocations (uint8 arrays on pages), any sizes
        self._closed = False
        self.reused = 0  # takes served from the free list (tests, benchmarks)

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return sum(b.shape[0] for b in self._free)

    def take(self, nbytes: int) -> np.ndarray:
        buf = None
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.shape[0] >= nbytes]
            if fits:
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].shape[0]))
                self.reused += 1
            else:  # none large enough: the kept ones would only sit beside a new allocation
                self._free.clear()
        if buf is None:
            buf = aligned.empty(nbytes)
        # a new array object over buf (not a view of it: numpy would make buf the views' base): the batch's
        # arrays are views of this one, which lives exactly as long as the last of them
        lease = np.frombuffer(memoryview(buf)[:nbytes], dtype=np.uint8)
        done = weakref.finalize(lease, self._give, buf)
        done.atexit = False  # (nothing to give back to at exit)
        return lease

    def _give(self, buf: np.ndarray) -> None:
        with self._lock:
            if self._closed:
                return
            self._free.append(buf)
            while len(self._free) > self.keep:  # (a loop: a nested call may have added one meanwhile)
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].shape[0]))

    def clear(self) -> None:
        """Let go of the memory kept, and keep none from now on (batches still held by the caller are not
        touched)."""
        with self._lock:
            self._free.clear()
            self._closed = True


def _only(per_field: dict, names) -> dict:
    """``per_field`` restricted to ``names`` (in ``per_field``'s order)."""
    return {k: v for k, v in per_field.items() if k in names}


def _cuda_for_pinning() -> bool:
    """True when pinned (page-locked) memory can be had: torch sees CUDA.  Otherwise warns
    (Python shows a warning once per process and place) that batches stay in ordinary memory."""
    import torch
    if torch.cuda.is_available():
        return True
    warnings.warn("pin_memory=True, but CUDA is not available: batches are in ordinary (pageable) memory",
                  RuntimeWarning, stacklevel=1)
    return False
