"""What the loaders' batches feed in ``solar bench``: a training step on a device, and the device-only
time of the same steps.

``--model conv``: a small convolutional encoder-decoder (:class:`ConvNet`, 32 channels) learns to
reproduce the input field, one forward, backward and Adam step per batch, the way GPU users write it
(bf16 autocast and channels_last on CUDA, no host synchronisation inside the step).  ``--model none``:
the batch is only moved to the device.  ``--step-time S`` (no model): ``S`` seconds of sleep per step, a
simulated accelerator as MLPerf Storage's DLIO uses.

The device-only time of an epoch is the same sequence of steps (the same local batch sizes) run on one
batch already on the device (the first local batch of the dataset), timed right after the epoch, all
ranks at once.  ``au = device-only time / epoch wall time`` (MLPerf Storage's accelerator utilisation),
``gpu_wait_fraction = 1 - au``: the share of the epoch in which the device had nothing to do because the
loader had not delivered.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import SpecError

MODELS = ("conv", "none")
DEVICES = ("cpu", "cuda")
WIDTH = 32  # channels of the conv model's first level
WARMUP_STEPS = 3  # untimed steps on the resident batch before anything is timed (cuDNN picks its kernels)


def image_shape(sample_shape: Sequence[int]) -> Tuple[int, int, int]:
    """``(channels, height, width)`` the conv model sees a sample as (pure): its elements in memory order as
    one channel of ``h x w``, ``h`` the largest divisor of the element count not above its square root
    (128x128x1 -> 1x128x128; 4x32x32x4 -> 1x128x128)."""
    m = int(np.prod(sample_shape, dtype=np.int64)) if len(sample_shape) else 1
    if m < 1:
        raise SpecError(f"a sample of shape {tuple(sample_shape)} has no elements to train on")
    h = next(d for d in range(math.isqrt(m), 0, -1) if m % d == 0)
    return 1, h, m // h


def input_field(layout) -> str:
    """The field the conv model trains on: the numeric field with the most bytes per sample."""
    shapes, dtypes = layout.field_shapes(), layout.field_dtypes()
    best, size = None, -1
    for f in layout.field_names:
        dt = np.dtype(dtypes[f])
        if dt.kind not in "biuf" or shapes.get(f) is None:
            continue
        n = int(np.prod(shapes[f], dtype=np.int64)) * dt.itemsize
        if n > size:
            best, size = f, n
    if best is None:
        raise SpecError("solar bench --model conv: the layout has no numeric field of fixed shape to train on "
                        f"(fields: {', '.join(layout.field_names)}); use --model none")
    return best


@dataclass(frozen=True)
class StepConfig:
    """How a batch is consumed.  ``device``: ``cpu`` or ``cuda``; ``model``: ``conv`` or ``none``;
    ``step_time``: seconds of simulated compute per step (``model`` must be ``none``); ``amp``: ``auto``
    (bf16 on CUDA), ``none``, ``bf16``; ``channels_last``: None = on with CUDA."""

    device: str = "cpu"
    model: str = "none"
    step_time: float = 0.0
    amp: str = "auto"
    channels_last: Optional[bool] = None

    def __post_init__(self):
        if self.device not in DEVICES:
            raise SpecError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.model not in MODELS:
            raise SpecError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.amp not in ("auto", "none", "bf16"):
            raise SpecError(f"amp must be auto, none or bf16, got {self.amp!r}")
        if not isinstance(self.step_time, (int, float)) or isinstance(self.step_time, bool) \
                or not self.step_time >= 0:
            raise SpecError(f"step time must be seconds >= 0, got {self.step_time!r}")
        if self.step_time and self.model != "none":
            raise SpecError("--step-time simulates the training step: give it with --model none, not with "
                            f"--model {self.model}")

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def trains(self) -> bool:
        return self.model == "conv"

    @property
    def bf16(self) -> bool:
        return self.amp == "bf16" or (self.amp == "auto" and self.cuda)

    @property
    def nhwc(self) -> bool:
        return self.cuda if self.channels_last is None else bool(self.channels_last)

    @property
    def measures_compute(self) -> bool:
        """Whether the epochs have a compute time to report ``au`` against (a model or a step time)."""
        return self.trains or self.step_time > 0


def require_device(cfg: StepConfig) -> None:
    """A SpecError when ``cfg`` wants CUDA and this process has none (checked before any work)."""
    import torch
    if cfg.cuda and not torch.cuda.is_available():
        raise SpecError("--device cuda: CUDA is not available in this process (no GPU, or a CPU build of torch)")


def torch_device(cfg: StepConfig, local_rank: int = 0):
    """The torch device of this rank: ``cuda:<local rank mod GPUs>``; a SpecError without CUDA."""
    import torch
    require_device(cfg)
    if not cfg.cuda:
        return torch.device("cpu")
    dev = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def conv_net(channels: int, width: int = WIDTH):
    """(n, c, h, w) -> (n, c, h, w): conv encoder (one stride-2 level), conv decoder with a skip."""
    import torch.nn as nn
    import torch.nn.functional as F

    class ConvNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc1 = nn.Conv2d(channels, width, 3, padding=1)
            self.enc2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
            self.mid = nn.Conv2d(2 * width, 2 * width, 3, padding=1)
            self.dec = nn.Conv2d(2 * width, width, 3, padding=1)
            self.out = nn.Conv2d(width, channels, 1)

        def forward(self, x):
            a = F.relu(self.enc1(x))
            z = F.relu(self.mid(F.relu(self.enc2(a))))
            z = F.interpolate(z, size=a.shape[-2:], mode="nearest")
            return self.out(F.relu(self.dec(z)) + a)

    return ConvNet()


class Consumer:
    """Consumes the loaders' batches (``__call__``, inside the timed loop) and measures the device-only time of
    a sequence of steps (:meth:`device_only`, outside it).

    ``resident``: ``{field: tensor (n, ...)}`` on the host, the batch the device-only steps run on (moved to
    the device here); with ``--model conv`` its input field must be there."""

    def __init__(self, cfg: StepConfig, layout, resident: Dict[str, "object"], local_rank: int = 0):
        import torch
        self.cfg = cfg
        self.device = torch_device(cfg, local_rank)
        self.field = input_field(layout) if cfg.trains else None
        self.shape = image_shape(layout.field_shapes()[self.field]) if cfg.trains else None
        self.model = self.opt = None
        self.resident = None
        if cfg.trains:
            if cfg.cuda:
                torch.backends.cudnn.benchmark = True  # fixed shapes: cuDNN's fastest kernels
            fmt = torch.channels_last if cfg.nhwc else torch.contiguous_format
            self.memory_format = fmt
            torch.manual_seed(0)
            self.model = conv_net(self.shape[0]).to(self.device, memory_format=fmt)
            self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
            self.resident = resident[self.field].to(self.device)
            for _ in range(WARMUP_STEPS):
                self._train(self.resident)
            self.sync()

    @property
    def n_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters()) if self.model is not None else 0

    def describe(self) -> dict:
        out = {"device": str(self.device), "model": self.cfg.model, "step_time_s": self.cfg.step_time}
        if self.cfg.cuda:
            import torch
            out["device_name"] = torch.cuda.get_device_name(self.device)
        if self.cfg.trains:
            out.update(field=self.field, image=list(self.shape), parameters=self.n_parameters,
                       amp="bf16" if self.cfg.bf16 else "none", channels_last=self.cfg.nhwc,
                       resident_batch=int(self.resident.shape[0]))
        return out

    def __call__(self, batch: dict) -> None:
        """One step on ``batch`` (its tensors on the device already, or moved here without waiting)."""
        if self.cfg.trains:
            self._train(batch[self.field].to(self.device, non_blocking=True))
        elif self.cfg.step_time:
            time.sleep(self.cfg.step_time)

    def _train(self, x) -> None:
        import torch
        import torch.nn.functional as F
        n = x.shape[0]
        x = x.reshape(n, *self.shape).float().contiguous(memory_format=self.memory_format)
        x = (x - x.mean()) / (x.std() + 1e-6)  # per-batch scale, on the device
        ctx = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.cfg.bf16 else contextlib.nullcontext()
        with ctx:
            y = self.model(x)
        loss = F.mse_loss(y.float(), x)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def sync(self) -> None:
        """Wait until the device has run everything queued (the end of an epoch's timed loop)."""
        if self.cfg.cuda:
            import torch
            torch.cuda.synchronize(self.device)

    def device_only(self, sizes: List[int]) -> Optional[float]:
        """Seconds the device needs for steps of local batch ``sizes`` on the resident batch (None: nothing to
        compute; ``--step-time``: ``len(sizes) * step_time``)."""
        if self.cfg.step_time:
            return len(sizes) * self.cfg.step_time
        if not self.cfg.trains:
            return None
        batches = {}
        for n in set(sizes):  # slices built before the timer (a batch larger than the resident one: tiled)
            reps = -(-n // self.resident.shape[0])
            src = self.resident if reps == 1 else self.resident.repeat(reps, *[1] * (self.resident.dim() - 1))
            batches[n] = src[:n]
        self.sync()
        t0 = time.perf_counter()
        for n in sizes:
            self._train(batches[n])
        self.sync()
        return time.perf_counter() - t0


def utilisation(device_only: Optional[float], seconds: float) -> Optional[float]:
    """``au`` of one rank's epoch: device-only time / wall time (None when there is no compute)."""
    if device_only is None or seconds <= 0:
        return None
    return device_only / seconds


def epoch_utilisation(per_rank: List[Tuple[Optional[float], float]]) -> dict:
    """Per epoch over ranks, from ``(device-only seconds, wall seconds)`` of each rank: ``au`` (mean over ranks),
    ``au_min``, ``gpu_wait_fraction`` (1 - ``au``, at least 0: the device-only steps run after the epoch and on a
    busy host can take longer than it), ``device_only_s`` (the slowest rank's)."""
    aus = [utilisation(d, s) for d, s in per_rank]
    if any(a is None for a in aus) or not aus:
        return {"au": None, "au_min": None, "gpu_wait_fraction": None, "device_only_s": None}
    au = float(np.mean(aus))
    return {"au": au, "au_min": float(min(aus)), "gpu_wait_fraction": max(0.0, 1.0 - au),
            "device_only_s": float(max(d for d, _ in per_rank))}


def epoch_au(consume, comm, sizes: List[int], step_time: float, seconds: float) -> dict:
    """:func:`epoch_utilisation` of an epoch just timed on every rank of ``comm`` (collective): the device-only
    time of its steps (local batch ``sizes``) run by ``consume`` on its resident batch, all ranks at once as in
    the epoch; without a consumer ``step_time`` per step (None: nothing to compare with)."""
    if consume is not None:
        from ..mpi import sleep_barrier
        sleep_barrier(comm)
        device_only = consume.device_only(sizes)
    else:
        device_only = len(sizes) * step_time if step_time else None
    return epoch_utilisation(comm.allgather((device_only, seconds)))
