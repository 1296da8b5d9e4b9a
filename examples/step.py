"""The training step of the examples, written the way GPU users write it, and what it needs.

* :func:`train_step`: forward (under bf16 autocast with ``--amp bf16``), backward, optimizer step; the
  per-sample losses are summed on the device and handed back as a device tensor.  Nothing in the step
  waits for the device: no ``.item()``, ``float()``, ``.cpu()`` or ``.tolist()`` of a device tensor, no
  blocking copy (tests/test_gpu_step.py runs it on the ``meta`` device, where any of those raises).
* :class:`StepLosses`: those device tensors, read back to the host in one copy every ``--log-every``
  steps and at the epoch's end (the loop's only waits for the device).
* :func:`sorted_batch`: a local batch in sample-id order, reordered where its tensors are (on the device:
  the permutation crosses from pinned memory without a wait).
* :class:`Precision` / :func:`configure`: ``--amp``, ``--channels-last``, ``--compile``,
  ``--deterministic`` turned into torch settings.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Dict, List, Tuple

import numpy as np
import torch


# ----------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Precision:
    """How the step runs on ``device``: ``amp`` (``"none"`` or ``"bf16"``: autocast to bfloat16 for the
    forward pass, losses and weights in float32), ``channels_last`` (model and inputs in NHWC memory
    order, what cuDNN's fast convolutions take), ``compile`` (``torch.compile`` the model),
    ``deterministic`` (deterministic kernels, no TF32, no cuDNN autotuning: runs repeat bit for bit)."""

    amp: str = "none"
    channels_last: bool = False
    compile: bool = False
    deterministic: bool = False

    def __post_init__(self):
        if self.amp not in ("none", "bf16"):
            raise ValueError(f"amp must be 'none' or 'bf16', got {self.amp!r}")

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

    def autocast(self, device: torch.device):
        """The forward pass's autocast context (a no-op without ``amp``)."""
        if self.amp == "bf16":
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def describe(self) -> str:
        words = [f"amp {self.amp}", "channels_last" if self.channels_last else "contiguous"]
        if self.compile:
            words.append("compiled (its first steps compile it)")
        if self.deterministic:
            words.append("deterministic")
        return ", ".join(words)


def precision_from_args(args, device: torch.device) -> Precision:
    """``--amp auto`` is bf16 on CUDA and none elsewhere; ``--channels-last`` unset is on with CUDA."""
    cuda = device.type == "cuda"
    amp = args.amp if args.amp != "auto" else ("bf16" if cuda else "none")
    cl = args.channels_last if args.channels_last is not None else cuda
    return Precision(amp=amp, channels_last=cl, compile=args.compile, deterministic=args.deterministic)


def configure(p: Precision, device: torch.device) -> None:
    """Process-wide torch settings for ``p`` (before the model is built)."""
    if p.deterministic:
        # cuBLAS needs a fixed workspace for deterministic results; read when cuBLAS first starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick its fastest kernels


def add_args(p) -> None:
    """The step's command-line options."""
    import argparse
    p.add_argument("--amp", choices=("auto", "none", "bf16"), default="auto",
                   help="mixed precision of the forward pass: bf16 autocast, or none (float32); auto: bf16 on "
                        "CUDA, none on CPU")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="model and inputs in channels_last (NHWC) memory order (default: on with CUDA)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (the first steps compile it)")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8), "
                        "no TF32 and no cuDNN autotuning: two runs on the same batches give the same losses")
    p.add_argument("--log-every", type=int, default=50,
                   help="steps between reads of the losses back to the host (each read waits for the device)")


# ----------------------------------------------------------------------------- the step
def train_step(task, model, opt, batch: dict, device: torch.device, weight: float,
               precision: Precision) -> Tuple[Tuple[str, ...], torch.Tensor]:
    """One optimisation step on ``batch``: ``loss = mean per-sample loss * weight``.

    Returns the loss parts' names and a detached float64 tensor on the device, ``[sum over samples of the
    loss, sum of each part]``.  Nothing here waits for the device."""
    with precision.autocast(device):
        per = task.losses(model, batch, device)
    per_sample = sum(per.values())
    loss = per_sample.float().mean() * weight
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sums = torch.stack([per_sample.detach().double().sum(), *(v.detach().double().sum() for v in per.values())])
    return tuple(per), sums


class StepLosses:
    """Per-step loss sums kept where they were computed, read back to the host in one copy by
    :meth:`flush`: ``(step, delivered sample ids, samples, [loss sum, part sums...] float64)`` per step."""

    def __init__(self, every: int):
        if every < 1:
            raise ValueError(f"log every must be >= 1 step, got {every}")
        self.every = every
        self.pending: List[Tuple[int, np.ndarray, int, torch.Tensor]] = []

    def add(self, step: int, delivered: np.ndarray, n: int, sums: torch.Tensor) -> None:
        self.pending.append((step, delivered, n, sums))

    @property
    def due(self) -> bool:
        return len(self.pending) >= self.every

    def flush(self) -> List[Tuple[int, np.ndarray, int, np.ndarray]]:
        """The pending steps with their sums on the host (one wait for the device), oldest first."""
        if not self.pending:
            return []
        vals = torch.stack([p[3] for p in self.pending]).cpu().numpy()
        out = [(s, d, n, v) for (s, d, n, _), v in zip(self.pending, vals)]
        self.pending = []
        return out


# ----------------------------------------------------------------------------- batches
def _permutation(order: np.ndarray, device: torch.device, cache: Dict[torch.device, torch.Tensor]) -> torch.Tensor:
    """``order`` as an index tensor on ``device``; for a GPU it crosses from pinned memory without a wait
    (the pinned block is not reused before the copy is done: torch's host allocator records it)."""
    if device not in cache:
        t = torch.from_numpy(order)
        if device.type == "cuda":
            t = t.pin_memory()
        cache[device] = t.to(device, non_blocking=True)
    return cache[device]


def sorted_batch(batch: dict, ids: np.ndarray) -> Tuple[dict, np.ndarray]:
    """The local batch in sample-id order (tensors of the batch's length reordered on their own device;
    others kept)."""
    order = np.argsort(ids, kind="stable")
    if np.all(order[:-1] < order[1:]):
        return batch, ids
    n, cache = len(ids), {}
    out = {k: (v.index_select(0, _permutation(order, v.device, cache))
               if torch.is_tensor(v) and v.dim() and len(v) == n else v) for k, v in batch.items()}
    return out, ids[order]
