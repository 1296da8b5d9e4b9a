"""Slot pools in a device's memory (``SolarLoader(buffer_device="cuda")``): the plan's resident blocks live on
the GPU, a batch is gathered there, and a miss crosses to the device once, decoded.

The pools are the same slot pools as in process memory (:class:`~solar.buffer.pool.SlotPools`: one pool per
block size class, the same allocation), placed on a torch device: ``arrays[c]`` is a ``uint8`` tensor of
``(slots, class bytes)`` there.  What differs is how bytes get in and out:

* **in** (:meth:`DevicePools.stage`, :meth:`DevicePools.commit`): the reader reads the step's misses into host
  staging rows (pinned memory on CUDA, one ``(k, class bytes)`` buffer per class), and once the reads are done
  the rows are copied to the device in one transfer per class and put into their slots with one
  ``index_copy_``;
* **out** (:meth:`DevicePools.gather`): the batch's copies, listed on the host by the same geometry as the
  host gather (:meth:`~solar.buffer.gather.GatherTables.runs`: source offset, destination offset, length), are
  made on the device by torch indexing: the runs of one length are read with one ``index_select`` from a
  sliding-window view of the pool (``unfold``) and written with one ``index_copy_`` into the batch (a byte
  index where a run does not start at a multiple of its length).

On CUDA every device operation is queued on a side stream of the buffer's thread; a batch is handed to the
training stream with an event (:class:`DeviceBatch`), as :class:`~solar.torch.device.DeviceMover` does.  The
order of the side stream keeps a slot's old bytes until every batch gathered from them is made: a freed slot
takes a miss of a later step only after the last step that used its block was gathered (the buffer's rule for
every place), and that miss's copy is queued after that gather.  On another device (the CPU, which the tests use as the device)
the same operations run in order, synchronously.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from ..errors import SpecError
from .pool import SlotPools


def torch_device(device):
    """``device`` as a ``torch.device``; a SpecError for a name torch does not know, a type other than CUDA and the
    CPU, or a CUDA device without CUDA."""
    import torch
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise SpecError(f"buffer_device {device!r} is not a torch device: {exc}") from None
    if dev.type not in ("cuda", "cpu"):
        raise SpecError(f"buffer_device {device!r}: a buffer is kept on a CUDA device, or on the CPU (standing in "
                        f"for one); not on {dev.type!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SpecError(f"buffer_device {device!r}: CUDA is not available in this process")
        dev = rank_gpu(dev)  # plain "cuda": the rank's GPU
        if dev.index >= torch.cuda.device_count():
            raise SpecError(f"buffer_device {device!r}: this process sees {torch.cuda.device_count()} CUDA "
                            "device(s)")
    return dev


def rank_gpu(dev):
    """A CUDA ``torch.device`` with its index: ``dev`` itself where it has one; for plain ``"cuda"`` the rank's GPU
    as :func:`~solar.torch.init_distributed` picks it (and makes current): the local rank mod the GPUs this process
    sees.  The loader's device buffer and its device copies (``device=``) resolve ``"cuda"`` by this one rule, so
    that a batch gathered on the GPU is never taken for another device's and copied through the host.  Without a
    GPU to count, ``dev`` as it is."""
    import torch
    if dev.type != "cuda" or dev.index is not None:
        return dev
    count = torch.cuda.device_count()
    if count < 1:
        return dev
    from ..topology import detect
    return torch.device("cuda", detect().local_rank % count)


def side_stream(device):
    """A CUDA stream for the loader's copies and gathers on ``device``, from torch's pool of high-priority streams.
    ``torch.cuda.Stream()`` at the default priority hands out the streams of a small shared pool in turn, the pool
    ProcessGroupNCCL takes its streams from: the loader's copies could then queue behind the job's collectives,
    and a prefetch thread waiting for such a copy (it also serves the node's other ranks with a node plan) behind
    an allreduce that waits for another rank's batch would never go on."""
    import torch
    return torch.cuda.Stream(device=device, priority=-1)


class OnDevice(dict):
    """A batch dict whose tensors are on the device already (a device buffer's): ``DataLoader(pin_memory=True)``
    passes it through as it is (its pin step calls :meth:`pin_memory`, where pinning each tensor would fail: torch
    pins CPU tensors only), so a dataset of a device plan needs no other DataLoader options than a host plan's."""

    __slots__ = ()

    def pin_memory(self, device=None):
        return self


class DeviceBatch:
    """A batch gathered on the device: ``fields`` (``{name: tensor}``), the event after its copies (None off
    CUDA), and ``host`` entries (the sample ids) that stay on the host.  :meth:`hand_over` makes the current
    stream wait for the copies and returns the batch dict."""

    __slots__ = ("fields", "event", "device", "host")

    def __init__(self, fields: dict, event=None, device=None):
        self.fields, self.event, self.device, self.host = fields, event, device, {}

    def hand_over(self) -> dict:
        if self.event is not None:
            import torch
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self.event)
            for t in self.fields.values():
                t.record_stream(stream)
        return OnDevice({**self.fields, **self.host})


class DevicePools(SlotPools):
    """:class:`SlotPools` on ``device`` (a torch device).  ``arrays[c]``: uint8 tensor ``(slots[c],
    class_bytes[c])`` there; ``on_device`` is True."""

    on_device = True

    def __init__(self, class_bytes: np.ndarray, slots: np.ndarray, device):
        import torch
        self.device = torch_device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = side_stream(self.device) if self.cuda else None
        cb, n = np.asarray(class_bytes, np.int64), np.asarray(slots, np.int64)
        # the free-slot stacks as SlotPools keeps them; the memory is the device's (not SlotPools' host pools),
        # allocated on the side stream that alone writes and reads it: the caching allocator then waits for that
        # stream's work before it gives the memory to anyone else (see close)
        self.class_bytes, self.slots = cb, n
        with self._on_stream():
            self.arrays = [torch.empty((int(k), int(sz)), dtype=torch.uint8, device=self.device)
                           for sz, k in zip(cb, n)]
        self.stack = [np.arange(int(k) - 1, -1, -1, dtype=np.int64) for k in n]
        self.top = [int(k) for k in n]

    # ------------------------------------------------------------- in
    def _host(self, rows: int, width: int):
        """``(torch tensor, numpy view)`` of ``rows x width`` host bytes: pinned with CUDA (torch's caching host
        allocator: reused once the copies out of it are done)."""
        import torch
        t = torch.empty((rows, width), dtype=torch.uint8, pin_memory=self.cuda)
        return t, t.numpy()

    def stage(self, classes: np.ndarray, slots: np.ndarray, nbytes: np.ndarray) -> Tuple[list, list]:
        """Host rows for blocks going to ``slots`` of ``classes`` (``nbytes`` each): ``(views, pending)``, the
        uint8 views a reader fills (one per block, in order) and what :meth:`commit` copies to the device."""
        classes = np.asarray(classes, np.int64)
        views: List[Optional[np.ndarray]] = [None] * classes.shape[0]
        pending = []
        for c, pos in self._groups(classes):
            t, rows = self._host(pos.shape[0], int(self.class_bytes[c]))
            for j, p in enumerate(pos.tolist()):
                views[p] = rows[j, :int(nbytes[p])]
            pending.append((c, np.ascontiguousarray(slots[pos]), t))
        return views, pending

    def commit(self, pending: list) -> None:
        """Copy staged rows into their device slots (after the reads into them are done)."""
        with self._on_stream():
            for c, slots, rows in pending:
                dev_rows = rows.to(self.device, non_blocking=True)
                self.arrays[c].index_copy_(0, self._index(slots), dev_rows)

    # ------------------------------------------------------------- out
    def gather(self, tables, samples: np.ndarray, lookup, n: int, shapes: dict, dtypes: dict) -> DeviceBatch:
        """The batch of ``samples`` (``n`` of them) from the step's blocks (``lookup``: a
        :class:`~solar.buffer.steps.StepBlocks`), gathered on the device: ``{field: tensor (n, *shape)}``."""
        import torch
        blocks, bclass, bslot = lookup.blocks, lookup.block_class, lookup.block_slot
        arrays, class_bytes = self.arrays, self.class_bytes
        with self._on_stream():
            if lookup.extra:  # blocks the plan wrongly called hits, read on the spot: one more "class" for them
                bclass, bslot, arrays, class_bytes = self._with_extra(lookup, bclass, bslot)
            runs = tables.runs(samples, blocks, bclass, bslot, class_bytes)
            out = {name: torch.empty(n * int(tables.field_bytes[k]), dtype=torch.uint8, device=self.device)
                   for k, name in enumerate(tables.fields)}
            for c, k, r in runs:
                copy_runs(arrays[c].reshape(-1), out[tables.fields[k]], r, self._index)
            stored = {name: tables.layout.datasets[d].dtype
                      for name, d in zip(tables.fields, tables.src_ds[0].tolist())}
            fields = {name: _typed(out[name], stored[name], (n, *shapes[name])) for name in tables.fields}
            event = None
            if self.cuda:
                event = torch.cuda.Event()
                event.record(self.stream)
        return DeviceBatch(fields, event, self.device)

    def _with_extra(self, lookup, bclass, bslot):
        """``lookup``'s extra blocks (host arrays) copied to the device as class ``C`` (one past the pools'),
        slot j each: the step's class and slot arrays, pools and class sizes with it."""
        extra = sorted(lookup.extra.items())
        width = max(int(v.shape[0]) for _, v in extra)
        host, rows = self._host(len(extra), width)
        bclass, bslot = np.array(bclass, np.int64), np.array(bslot, np.int64)
        C = len(self.arrays)
        for j, (b, v) in enumerate(extra):
            rows[j, :v.shape[0]] = v
            pos = int(np.searchsorted(lookup.blocks, b))
            bclass[pos], bslot[pos] = C, j
        return bclass, bslot, [*self.arrays, host.to(self.device, non_blocking=True)], \
            np.append(self.class_bytes, width)

    def close(self) -> None:
        """Wait for the work queued on the side stream (copies into the pools, gathers out of them) before the
        pools may be dropped: their memory must not go to a new owner while a late copy still writes it."""
        if self.stream is not None:
            self.stream.synchronize()

    # ------------------------------------------------------------- helpers
    def _on_stream(self):
        import contextlib

        import torch
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _index(self, values: np.ndarray):
        """int64 ``values`` as a device tensor (from pinned memory without a wait on CUDA)."""
        import torch
        t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        if self.cuda:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)


def copy_runs(src, dst, runs: np.ndarray, index) -> None:
    """``dst[d:d+n] = src[s:s+n]`` for every run ``(s, d, n)`` of ``runs`` (int64[r, 3]); ``src``/``dst`` 1-D
    uint8 tensors on one device, ``index(values)`` makes an int64 index tensor there.  Runs of one length ``L``
    go in one ``index_select`` from a sliding-window view of ``src`` and one ``index_copy_`` into ``dst`` viewed
    as rows of ``g`` bytes, ``g`` the greatest common divisor of ``L`` and every destination start (``L`` when
    the runs start at multiples of it): ``L / g`` row indices a run."""
    lengths = runs[:, 2]
    for L in np.unique(lengths).tolist():
        sel = runs[lengths == L]
        got = src.unfold(0, L, 1).index_select(0, index(sel[:, 0]))  # (k, L): each run's bytes
        starts = sel[:, 1]
        g = int(np.gcd.reduce(np.append(starts, L)))
        rows = (starts[:, None] // g + np.arange(L // g, dtype=np.int64)[None, :]).reshape(-1)
        dst[:(dst.shape[0] // g) * g].view(-1, g).index_copy_(0, index(rows), got.reshape(-1, g))


def _typed(flat, dtype, shape):
    """A uint8 tensor's bytes, values of the stored ``dtype`` (the file's byte order), as that type in native
    order in ``shape``: a view, or for a field stored in the other byte order each value's bytes reversed (a
    copy; lossless)."""
    import torch
    dt = np.dtype(dtype)
    if dt.itemsize > 1 and not dt.isnative:
        flat = flat.view(-1, dt.itemsize).flip(1).reshape(-1)
    tdt = torch.from_numpy(np.empty(0, dt.newbyteorder("="))).dtype
    return flat.view(tdt).reshape(shape)
