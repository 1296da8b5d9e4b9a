"""Batches to the GPU ahead of use: :class:`DeviceMover` (what ``SolarLoader(device=...)`` runs in
its prefetch thread) and :func:`to_device` (any iterable of batches, e.g. a ``DataLoader`` over
:class:`~solar.torch.SolarDataset`).

A CUDA copy goes like this: the producer copies each CPU tensor of the batch into a pinned
(page-locked) staging buffer, one flat buffer per slot of a small ring (``ring`` slots, grown
when a batch is larger, never freed per batch), and queues the host-to-device copy on a side
CUDA stream, then records an event on it.  A slot is reused only after its event completed (the
copy out of it is done).  The consumer makes the training (current) stream wait for the event
and calls ``record_stream`` on every device tensor, so PyTorch's caching allocator does not hand
the memory to another tensor while the training stream may still use it.  Tensors that are
already pinned are copied straight from where they are (kept alive until the copy is done).
On a CPU device nothing is copied; other devices get a plain ``.to(device)``.

The top-level keys in ``host_keys`` (default ``index``: the batch's sample ids) stay on the host: the
training loop logs and checks them, and reading them back from the device would wait for the GPU.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterable, Iterator, List, Optional

import torch

from ..buffer.device_pools import rank_gpu, side_stream
from ..errors import SpecError

__all__ = ["DeviceMover", "to_device"]

ALIGN = 64  # bytes: each tensor's place in a staging buffer starts at a multiple of this
HOST_KEYS = ("index",)  # top-level batch keys that stay on the host


class CudaStreams:
    """The CUDA operations :class:`DeviceMover` uses (tests pass an object with the same methods)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = side_stream(device)

    def copy(self, src: torch.Tensor) -> torch.Tensor:
        """Queue the copy of (pinned) ``src`` to the device on the side stream; the result is
        allocated on the side stream."""
        with torch.cuda.stream(self.stream):
            return src.to(self.device, non_blocking=True)

    def record(self):
        """An event recorded on the side stream after the work queued so far."""
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def synchronize(self, event) -> None:
        """Block the calling thread until ``event`` completed."""
        event.synchronize()

    def wait(self, event) -> None:
        """The current stream waits (on the GPU) for ``event``."""
        torch.cuda.current_stream(self.device).wait_event(event)

    def hand_over(self, t: torch.Tensor) -> None:
        """``t`` (allocated on the side stream) is used on the current stream from now on."""
        t.record_stream(torch.cuda.current_stream(self.device))

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.is_pinned()


class _Slot:
    """One staging buffer of the ring, the event of the last copy out of it, and the pinned
    sources that copy reads."""

    __slots__ = ("buf", "event", "keep")

    def __init__(self):
        self.buf: Optional[torch.Tensor] = None
        self.event = None
        self.keep: List[torch.Tensor] = []


class _InFlight:
    """A batch whose device copy was queued: the batch (device tensors), the copy's event, and the
    entries kept on the host (put back into the batch when it is handed over)."""

    __slots__ = ("batch", "event", "host", "keys")

    def __init__(self, batch, event, host=None, keys=()):
        self.batch, self.event, self.host, self.keys = batch, event, host or {}, keys


class DeviceMover:
    """``stage(batch)`` in the producer thread, ``hand_over(staged)`` in the training thread.

    ``device``: anything ``torch.device`` takes; ``"cuda"`` without CUDA is a SpecError.
    ``ring``: staging buffers (>= 1).  ``streams``: the CUDA operations (default
    :class:`CudaStreams` for a CUDA device; tests pass a stand-in).  ``staging_allocations``
    counts pinned buffers allocated (a ring reused: at most ``ring`` plus one per growth).
    ``host_keys``: top-level keys of a dict batch that are not moved (default :data:`HOST_KEYS`).
    """

    def __init__(self, device, ring: int = 3, streams=None, host_keys=HOST_KEYS):
        try:
            self.device = rank_gpu(torch.device(device))  # "cuda": the rank's GPU, as its device buffer's
        except (RuntimeError, TypeError) as exc:
            raise SpecError(f"device {device!r} is not a torch device: {exc}") from None
        if isinstance(ring, bool) or not isinstance(ring, int) or ring < 1:
            raise SpecError(f"ring must be an integer >= 1 (staging buffers), got {ring!r}")
        if streams is None and self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise SpecError(f"device {device!r}: CUDA is not available in this process")
            streams = CudaStreams(self.device)
        self.streams = streams
        self.host_keys = tuple(host_keys)
        self.ring = [_Slot() for _ in range(ring)]
        self.staged = 0
        self.staging_allocations = 0

    def stage(self, batch) -> _InFlight:
        """Start moving ``batch`` (dict / list / tuple of tensors and other values) to the device."""
        host, keys = {}, ()
        if isinstance(batch, dict) and self.host_keys:
            host = {k: batch[k] for k in self.host_keys if k in batch}
            keys = tuple(batch)
            batch = {k: v for k, v in batch.items() if k not in host}
        if self.streams is None:
            return _InFlight(_map(batch, lambda t: t.to(self.device)), None, host, keys)
        slot = self.ring[self.staged % len(self.ring)]
        self.staged += 1
        if slot.event is not None:
            self.streams.synchronize(slot.event)  # the last copy out of this slot is done
        slot.keep = []
        need = sum(_padded(t) for t in _tensors(batch)
                   if not _already(t, self.device) and not self.streams.is_pinned(t))
        if slot.buf is None or slot.buf.numel() < need:
            slot.buf = self.streams.pinned(max(need, ALIGN))
            self.staging_allocations += 1
        offset = [0]

        def move(t: torch.Tensor) -> torch.Tensor:
            if _already(t, self.device):  # a device buffer's batch: nothing to copy
                return t
            if self.streams.is_pinned(t):
                slot.keep.append(t)
                src = t
            else:
                nbytes = t.numel() * t.element_size()
                src = slot.buf[offset[0]:offset[0] + nbytes].view(t.dtype).view(t.shape)
                src.copy_(t)
                offset[0] += _padded(t)
            return self.streams.copy(src)

        moved = _map(batch, move)
        slot.event = self.streams.record()
        return _InFlight(moved, slot.event, host, keys)

    def hand_over(self, staged: _InFlight):
        """The batch, its device tensors safe to use on the current stream (the host keys put back)."""
        if staged.event is not None:
            self.streams.wait(staged.event)
            for t in _tensors(staged.batch):
                self.streams.hand_over(t)
        if staged.host:  # back in the batch's own key order
            return {k: staged.host[k] if k in staged.host else staged.batch[k] for k in staged.keys}
        return staged.batch


def to_device(batches: Iterable, device, depth: int = 2, streams=None, host_keys=HOST_KEYS) -> Iterator:
    """Iterate ``batches`` moved to ``device``, the copies of the next ``depth`` batches queued
    before a batch is handed out (staging in the calling thread; see :class:`DeviceMover`; the keys
    in ``host_keys``, default ``index``, stay on the host)::

        for batch in to_device(DataLoader(ds, batch_size=None, num_workers=2), "cuda"):
            ...
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise SpecError(f"depth must be an integer >= 1 (batches ahead), got {depth!r}")
    mover = DeviceMover(device, ring=depth + 1, streams=streams, host_keys=host_keys)
    queued: deque = deque()
    for batch in batches:
        queued.append(mover.stage(batch))
        if len(queued) > depth:
            yield mover.hand_over(queued.popleft())
    while queued:
        yield mover.hand_over(queued.popleft())


def _already(t: torch.Tensor, device: torch.device) -> bool:
    """``t`` lives on ``device`` already, an accelerator (a CPU tensor with the CPU as the device is staged: the
    tests' stand-in for a GPU)."""
    return t.device.type != "cpu" and t.device == device


def _padded(t: torch.Tensor) -> int:
    """Bytes ``t`` takes in a staging buffer (rounded up to :data:`ALIGN`)."""
    return -(-t.numel() * t.element_size() // ALIGN) * ALIGN


def _tensors(obj) -> Iterator[torch.Tensor]:
    """The tensors in ``obj`` (nested dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _map(obj, fn: Callable[[torch.Tensor], Any]):
    """``obj`` with ``fn`` applied to every tensor in it (dicts, lists and tuples rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn) for v in obj)
    return obj
