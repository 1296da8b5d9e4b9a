"""What :class:`~solar.loader.SolarLoader` does to an assembled batch besides assembling it:
per-sample and per-batch transforms and the device copy (:class:`BatchHooks`, run in the
buffer's prefetch thread, off the training thread), and the per-epoch statistics line
(:class:`EpochLog`, ``logging.getLogger("solar.loader")``, INFO).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Dict, List, Optional

import numpy as np

from ..errors import SolarError, SpecError

log = logging.getLogger("solar.loader")


class TransformError(SolarError):
    """A user ``transform=`` / ``sample_transform=`` raised; ``__cause__`` is its exception."""


def check_hook(name: str, fn) -> Optional[Callable]:
    """``fn`` if it is None or callable; a SpecError naming ``name`` otherwise."""
    if fn is not None and not callable(fn):
        raise SpecError(f"{name} must be a callable (batch or sample dict -> dict), got {type(fn).__name__}")
    return fn


class BatchHooks:
    """Turns ``{field: array (n, ...), "index": int64 (n,)}`` into what the training loop gets.

    In the prefetch thread (:meth:`produce`): to torch when ``as_torch`` and any hook is set,
    then ``sample_transform`` on each sample (``{field: value of sample i}`` -> dict; results
    stacked per key, ragged ones as lists), then ``transform`` on the batch dict (``index``
    included), then the copy to ``device`` is started (:class:`solar.torch.device.DeviceMover`).
    In the training thread (:meth:`consume`): the training stream waits for that copy.
    """

    def __init__(self, transform=None, sample_transform=None, device=None, as_torch: bool = True,
                 to_torch: Callable[[dict], dict] = lambda out: out):
        self.transform = check_hook("transform", transform)
        self.sample_transform = check_hook("sample_transform", sample_transform)
        self.as_torch, self.to_torch = as_torch, to_torch
        self.mover = None
        if device is not None:
            if not as_torch:
                raise SpecError(f"device={device!r} needs torch tensors: leave as_torch=True")
            from ..torch.device import DeviceMover
            self.mover = DeviceMover(device)

    @property
    def active(self) -> bool:
        return bool(self.transform or self.sample_transform or self.mover)

    def produce(self, step: int, out: dict) -> dict:
        """Prefetch thread: transforms and the start of the device copy of step ``step``'s batch."""
        if not self.active:
            return out
        if self.as_torch:
            out = self.to_torch(out)
        if self.sample_transform is not None:
            out = self._per_sample(step, out)
        if self.transform is not None:
            index = out["index"]
            out = _call(self.transform, "transform", step, out)
            out.setdefault("index", index)  # the loader's weight and the user's checks need the sample ids
        if self.mover is not None:
            out = self.mover.stage(out)
        return out

    def consume(self, out):
        """Training thread: the batch, safe to use on the training (current) stream."""
        return self.mover.hand_over(out) if self.mover is not None else out

    def _per_sample(self, step: int, out: dict) -> dict:
        index = out.pop("index")
        n = len(index)
        # v[i, ...]: a scalar field's value stays a 0-d array (v[i] is a numpy scalar, which _stack would not stack)
        results = [_call(self.sample_transform, "sample_transform", step,
                         {k: v[i, ...] if isinstance(v, np.ndarray) else v[i] for k, v in out.items()})
                   for i in range(n)]
        keys = list(results[0]) if results else list(out)
        for i, r in enumerate(results):
            if list(r) != keys:
                raise TransformError(f"sample_transform returned keys {list(r)} for sample {int(index[i])} "
                                     f"but {keys} for sample {int(index[0])} (step {step})")
        batch = {k: _stack([r[k] for r in results]) for k in keys}
        batch["index"] = index
        return batch


def bind_layout(layout, *hooks) -> None:
    """Tell each hook that has a ``bind_layout(layout)`` method which layout its batches come from (a
    transform that maps sample ids to files, like :class:`solar.well.WellTransform`, checks it was built
    for this layout: a batch's ``index`` means nothing against another one)."""
    for fn in hooks:
        bind = getattr(fn, "bind_layout", None)
        if callable(bind):
            bind(layout)


def _call(fn: Callable, name: str, step: int, arg: dict) -> dict:
    """``fn(arg)``, which must return a dict; its exceptions become :class:`TransformError`."""
    try:
        res = fn(arg)
    except Exception as exc:  # noqa: BLE001 - re-raised with the step, cause kept
        raise TransformError(f"{name} failed on step {step}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(res, dict):
        raise TransformError(f"{name} must return a dict, got {type(res).__name__} (step {step})")
    return res


def _stack(values: List):
    """Samples' values of one key as a batch: torch.stack / np.stack when all have one shape and
    type, else the list itself."""
    first = values[0] if values else None
    shapes = {tuple(getattr(v, "shape", (None,))) for v in values}
    if len(shapes) == 1 and all(type(v) is type(first) for v in values):
        if isinstance(first, np.ndarray):
            return np.stack(values)
        if type(first).__module__.startswith("torch") and hasattr(first, "shape"):
            import torch
            return torch.stack(values)
    return values


class EpochLog:
    """Per-epoch statistics of a loader from its buffer's totals: one INFO line on
    ``solar.loader`` at the end of each epoch; :attr:`last` holds the numbers."""

    KEYS = ("steps", "samples", "hit_bytes", "bytes_loaded", "bytes_read", "stall_s")

    def __init__(self, rank: int):
        self.rank = rank
        self.last: Dict[str, float] = {}
        self._t0, self._base = 0.0, {}

    def begin(self, totals) -> None:
        """Iteration over an epoch (or its rest) starts: remember the totals and the time."""
        self._t0, self._base = time.perf_counter(), {k: getattr(totals, k) for k in self.KEYS}

    def end(self, epoch: int, totals) -> dict:
        """The epoch ended: its statistics (also logged)."""
        d = {k: getattr(totals, k) - self._base.get(k, 0) for k in self.KEYS}
        wall = time.perf_counter() - self._t0
        used = d["hit_bytes"] + d["bytes_loaded"]
        self.last = {"epoch": epoch, "seconds": wall, "samples_per_s": d["samples"] / wall if wall > 0 else 0.0,
                     "hit_rate": d["hit_bytes"] / used if used else 0.0, **d}
        log.info("rank %d epoch %d: %d steps, %d samples in %.2f s (%.1f samples/s), hit rate %.3f, "
                 "stall %.2f s, %d bytes read", self.rank, epoch, d["steps"], d["samples"], wall,
                 self.last["samples_per_s"], self.last["hit_rate"], d["stall_s"], d["bytes_read"])
        return self.last
