#!/usr/bin/env python
"""Train a next-step predictor on The Well's windows (``solar gen well``) with DDP, fed by solar's
planned loader or by DataLoader + DistributedSampler + h5py.

Each sample is a window of ``n_steps_input`` + ``n_steps_output`` frames of every field (the
layout spec's ``windows``); :class:`solar.well.WellTransform` turns a batch into The Well's
``input_fields`` (n, Ti, H, W, C) and ``output_fields`` (n, To, H, W, C), z-scored per field
with the mean and std of ``stats.yaml`` (The Well's training-split statistics).  The model maps
the Ti input frames (stacked as channels) to the To next frames, as a correction to the last
input frame (its output conv starts at zero: the untrained model is the persistence
predictor).  Loss: mean squared error in z units.  Held-out: the spec's ``valid`` split.

    solar gen well data/well --samples 4 --steps 40 --size 32
    mpiexec -n 2 .venv/bin/python examples/train_well.py data/well --valid-split valid \\
        --epochs 4 --plot well-loss.png

References on the held-out windows: ``constant`` (the training mean: 0 in z units) and
``persistence`` (the last input frame repeated).
"""
from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F

import trainer
from train_ptychonn import Residual, conv3


class NextStep(nn.Module):
    """(n, Ti*C, H, W) z-scored input frames -> (n, To*C, H, W): the last input frame (repeated To
    times) plus a residual CNN's correction, ``blocks`` residual blocks of ``width`` channels."""

    def __init__(self, c: int, t_in: int, t_out: int, width: int = 32, blocks: int = 3):
        super().__init__()
        self.c, self.t_out = c, t_out
        self.inp = conv3(t_in * c, width)
        self.body = nn.Sequential(*(Residual(width) for _ in range(blocks)))
        self.out = conv3(width, t_out * c)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x):
        last = x[:, -self.c:].repeat(1, self.t_out, 1, 1)
        return last + self.out(F.relu(self.body(self.inp(x))))


def frames_as_channels(x: torch.Tensor) -> torch.Tensor:
    """(n, T, H, W, C) -> (n, T*C, H, W), frame-major."""
    n, t, h, w, c = x.shape
    return x.permute(0, 1, 4, 2, 3).reshape(n, t * c, h, w).contiguous()


class Well(trainer.Task):
    name = "train_well"
    stats_per_field = False  # stats.yaml's, read by WellTransform
    device_batches = False  # WellTransform works on CPU batches; the frames go to the device after it

    def add_args(self, p):
        p.add_argument("--width", type=int, default=32, help="channels of the residual blocks")
        p.add_argument("--blocks", type=int, default=3, help="residual blocks")

    def setup(self, args, g):
        self.stats = {}  # the statistics are stats.yaml's (WellTransform reads it); nothing to compute
        self._transforms(args)
        return f"per field, z-score from {self.transform['train'].stats_path}"

    def _transforms(self, args):
        from solar.layout import load_layout
        from solar.well import WellTransform
        self.transform = {"train": WellTransform(load_layout(args.data), normalization="zscore", return_grid=False)}
        if args.valid or args.valid_split:
            held = load_layout(args.valid, split=args.valid_split) if args.valid else \
                load_layout(args.data, split=args.valid_split)
            self.transform["held-out"] = WellTransform(held, normalization="zscore", return_grid=False)
        t = self.transform["train"]
        self.t_in, self.t_out = t.n_steps_input, t.n_steps_output

    def configure(self, args):
        if args.width < 1 or args.blocks < 0:
            trainer.fail(f"--width must be >= 1 and --blocks >= 0, got {args.width} and {args.blocks}")

    def model(self, args) -> nn.Module:
        if not hasattr(self, "transform"):  # resumed: setup() was not called
            self._transforms(args)
        probe = self.transform["train"](self.first_batch(args))
        c = probe["input_fields"].shape[-1]
        return NextStep(c, self.t_in, self.t_out, args.width, args.blocks)

    @staticmethod
    def first_batch(args) -> dict:
        read, _, ds = trainer.sample_reader(args.data)
        try:
            batch = read([0])
        finally:
            ds.close()
        batch["index"] = torch.zeros(1, dtype=torch.int64)
        return batch

    def frames(self, batch: dict, split: str, device):
        """Input frames (n, Ti*C, H, W) and target frames (n, To*C, H, W), z-scored."""
        cpu = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in batch.items()}
        w = self.transform[split](cpu)
        return tuple(frames_as_channels(w[k]).to(device, non_blocking=True).contiguous(memory_format=self.memory_format)
                     for k in ("input_fields", "output_fields"))

    def losses(self, model, batch, device, split="train"):
        x, y = self.frames(batch, split, device)
        return {"next frame": ((model(x) - y) ** 2).mean(dim=(1, 2, 3))}

    def references(self, batch, split):
        x, y = self.frames(batch, split, torch.device("cpu"))
        last = x[:, -(y.shape[1] // self.t_out):].repeat(1, self.t_out, 1, 1)
        return {"constant": {"next frame": (y ** 2).mean(dim=(1, 2, 3))},
                "persistence": {"next frame": ((last - y) ** 2).mean(dim=(1, 2, 3))}}


if __name__ == "__main__":
    trainer.end_process(trainer.main(Well(), __doc__))
