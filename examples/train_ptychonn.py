#!/usr/bin/env python
"""Train a PtychoNN-like surrogate (diffraction pattern -> amplitude and phase) with DDP,
fed by solar's planned loader or by the usual DataLoader + DistributedSampler + h5py.

One process per rank, from any launcher (torchrun, mpiexec, srun); gloo on CPU, NCCL on GPUs:

    solar gen ptychonn data/ptychonn --samples 2048
    solar gen ptychonn data/ptychonn-valid --samples 256 --seed 1          # held-out samples
    mpiexec -n 2 .venv/bin/python examples/train_ptychonn.py data/ptychonn \\
        --valid data/ptychonn-valid --epochs 4 --plot loss.png
    torchrun --nproc-per-node 2 examples/train_ptychonn.py data/ptychonn --loader baseline --epochs 4

Inputs and targets are standardised per pixel with the mean and standard deviation of the
training data (computed once at the start from ``--stats-samples`` evenly spaced samples,
saved in checkpoints).  The loss is the mean squared error in those units, amplitude plus
phase: predicting the training mean everywhere (the constant predictor) scores about 1 + 1,
and the held-out loss of both is printed every epoch.

The network is a small residual U-Net: ``--depth`` stride-2 levels of ``--width`` channels
doubling per level, one shared encoder and two decoders with skip connections, the last conv
of each residual branch initialised to zero (so the untrained network passes its input
through instead of collapsing it to a constant).
"""
from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F

import trainer

FIELDS = ("X_train", "Y_I_train", "Y_phi_train")  # diffraction, amplitude, phase (PtychoNN names)


# ----------------------------------------------------------------------------- model
def conv3(c_in: int, c_out: int) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 3, padding=1)


class Residual(nn.Module):
    """``x + conv(relu(conv(relu(x))))``, the second conv zero-initialised (identity at start)."""

    def __init__(self, c: int):
        super().__init__()
        self.a, self.b = conv3(c, c), conv3(c, c)
        nn.init.zeros_(self.b.weight)
        nn.init.zeros_(self.b.bias)

    def forward(self, x):
        return x + self.b(F.relu(self.a(F.relu(x))))


class Decoder(nn.Module):
    """Transposed-conv 2x upsampling per level, plus the encoder's skip, a residual block; 1-channel output."""

    def __init__(self, widths):
        super().__init__()
        self.up = nn.ModuleList(nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2)
                                for i in reversed(range(len(widths) - 1)))
        self.res = nn.ModuleList(Residual(widths[i]) for i in reversed(range(len(widths) - 1)))
        self.out = conv3(widths[0], 1)

    def forward(self, z, skips):
        for up, res, skip in zip(self.up, self.res, reversed(skips)):
            z = res(up(z) + skip)
        return self.out(F.relu(z))


class PtychoNNLike(nn.Module):
    """(n, 1, H, W) standardised diffraction -> standardised amplitude and phase, each (n, 1, H, W);
    H and W divisible by ``2**depth``."""

    def __init__(self, width: int = 16, depth: int = 3):
        super().__init__()
        widths = [width * 2 ** i for i in range(depth + 1)]
        self.inp = conv3(1, width)
        self.down = nn.ModuleList(nn.Sequential(Residual(widths[i]), nn.Conv2d(widths[i], widths[i + 1], 2, stride=2))
                                  for i in range(depth))
        self.mid = Residual(widths[-1])
        self.amplitude, self.phase = Decoder(widths), Decoder(widths)

    def forward(self, x):
        z, skips = self.inp(x), []
        for down in self.down:
            skips.append(z)
            z = down(z)
        z = self.mid(z)
        return self.amplitude(z, skips), self.phase(z, skips)


# ----------------------------------------------------------------------------- task
def channels_first(field: str, x: torch.Tensor) -> torch.Tensor:
    """(n, H, W, 1) as stored -> (n, 1, H, W) float32 (one channel: the same bytes in either memory format)."""
    return x.permute(0, 3, 1, 2).float().contiguous()


class Ptycho(trainer.Task):
    name = "train_ptychonn"

    def add_args(self, p):
        p.add_argument("--width", type=int, default=16, help="channels of the first level")
        p.add_argument("--depth", type=int, default=3, help="stride-2 levels (input size divisible by 2**depth)")
        p.add_argument("--fields", nargs=3, default=list(FIELDS), metavar=("INPUT", "AMPLITUDE", "PHASE"),
                       help="dataset names of the input (diffraction) and of the amplitude and phase targets")

    def configure(self, args):
        if args.width < 1 or args.depth < 1:
            trainer.fail(f"--width and --depth must be >= 1, got {args.width} and {args.depth}")
        self.fields = tuple(args.fields)

    def setup(self, args, g):
        read, n, ds = trainer.sample_reader(args.data)
        try:
            self.stats = trainer.field_moments(g, read, n, self.fields, channels_first, args.stats_samples)
        finally:
            ds.close()
        return f"per pixel, from {min(n, args.stats_samples)} of the {n} training samples"

    def model(self, args) -> nn.Module:
        h, w = self.stats[self.fields[0]][0].shape[-2:]
        if h % 2 ** args.depth or w % 2 ** args.depth:
            trainer.fail(f"{args.data}: {h}x{w} inputs are not divisible by 2**depth = {2 ** args.depth} (--depth)")
        return PtychoNNLike(args.width, args.depth)

    def _stats_on(self, device) -> dict:
        """``{field: (mean, std clamped)}`` on ``device``, copied there once (a per-step copy of the
        statistics from pageable memory would make every step wait for the device)."""
        device = torch.device(device)
        cache = self.__dict__.setdefault("_on", {})
        if cache.get("stats") is not self.stats:  # new statistics (setup, or a checkpoint's): copy again
            cache.clear()
            cache["stats"] = self.stats
        if device not in cache:
            cache[device] = {f: (m.to(device), s.to(device).clamp_min(1e-6)) for f, (m, s) in self.stats.items()}
        return cache[device]

    def standardised(self, batch: dict, device) -> list:
        """Diffraction, amplitude, phase of the batch, each (n, 1, H, W) in training-data z units, in the
        trainer's memory format."""
        out = []
        stats = self._stats_on(device)
        for f in self.fields:
            mean, std = stats[f]
            x = channels_first(f, batch[f].to(device, non_blocking=True))
            out.append(((x - mean) / std).contiguous(memory_format=self.memory_format))
        return out

    def losses(self, model, batch, device, split="train"):
        x, amp, phi = self.standardised(batch, device)
        pa, pp = model(x)
        return {"amplitude": ((pa - amp) ** 2).mean(dim=(1, 2, 3)), "phase": ((pp - phi) ** 2).mean(dim=(1, 2, 3))}

    def references(self, batch, split):
        _, amp, phi = self.standardised(batch, torch.device("cpu"))
        return {"constant": {"amplitude": (amp ** 2).mean(dim=(1, 2, 3)), "phase": (phi ** 2).mean(dim=(1, 2, 3))}}


if __name__ == "__main__":
    trainer.end_process(trainer.main(Ptycho(), __doc__))
