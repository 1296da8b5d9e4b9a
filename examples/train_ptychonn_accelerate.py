#!/usr/bin/env python
"""The PtychoNN example with Hugging Face Accelerate (optional: ``pip install accelerate``): the same
model, normalisation and loss as ``train_ptychonn.py``, fed by :class:`solar.torch.SolarDataset`
through a plain ``DataLoader(batch_size=None)``.  Launch with accelerate, torchrun or mpiexec:

    solar plan data/ptychonn -P 2 -b 16 --epochs 3 --buffer-fraction 0.5 -o plan.h5
    accelerate launch --multi_gpu --num_processes 2 examples/train_ptychonn_accelerate.py plan.h5 --epochs 3
    torchrun --nproc-per-node 2 examples/train_ptychonn_accelerate.py plan.h5 --epochs 3

``accelerator.prepare`` wraps the model (DDP) and the optimizer only.  The DataLoader is not
prepared: the schedule already gives every rank its own batches, and ``prepare`` would shard them
again (for an ``IterableDataset``, rank 0 reads P batches, concatenates them and splits them over the
ranks: the other ranks' planned batches are never used).  The loss of a rank is its mean times
``batch["weight"]``.  ``accelerate launch --multi_gpu`` is torchrun's launcher and works without GPUs
too: without CUDA the script asks for Accelerate's CPU mode (gloo) itself.

Checkpoints: ``--checkpoint DIR`` is ``accelerator.save_state(DIR)`` at every epoch end and when
``--max-steps`` stops the run; ``--resume`` is ``accelerator.load_state(DIR)``.  The loader's
position and the normalisation statistics are saved with them (``register_for_checkpointing``), so a
resumed run continues with the next planned batch; ``skip_first_batches`` is not used (it would read
the skipped batches again and drop them; see examples/README.md).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.utils.data import DataLoader

import trainer
from train_ptychonn import FIELDS, Ptycho


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("plan", help="schedule file made by solar plan (its world size = the job's)")
    p.add_argument("--epochs", type=int, default=None, help="epochs (default and at most: the plan's)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--stats-samples", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0, help="model init")
    p.add_argument("--max-steps", type=int, default=None, help="stop after global step N (resumed steps included)")
    p.add_argument("--checkpoint", default=None, help="folder for accelerator.save_state")
    p.add_argument("--resume", action="store_true", help="accelerator.load_state(--checkpoint) first")
    p.add_argument("--cpu", action="store_true", help="ignore CUDA")
    p.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"), default=None,
                   help="Accelerate's mixed precision (default: accelerate launch's setting, else no); bf16 on GPUs")
    args = p.parse_args(argv)
    args.fields = list(FIELDS)
    if args.resume and not args.checkpoint:
        p.error("--resume needs --checkpoint")
    if args.max_steps is not None and args.max_steps < 1:
        p.error(f"--max-steps must be >= 1, got {args.max_steps}")
    return args


class TrainingState:
    """What ``accelerator.save_state`` keeps besides the model, optimizer and RNG states: the
    normalisation statistics and the loader's state at ``next_step``, the next global step the loop has
    not trained on.  The loop sets ``next_step``: DataLoader workers may have fetched further, so the
    loader's own cursor can be ahead of training (``SolarDataset.state_dict(step=...)``)."""

    def __init__(self, ds, task: Ptycho):
        self.ds, self.task = ds, task
        self.next_step = ds.loader.cursor

    def state_dict(self) -> dict:
        return {"stats": self.task.stats, "loader": self.ds.state_dict(step=self.next_step)}

    def load_state_dict(self, state: dict):
        self.task.stats = state["stats"]
        self.ds.load_state_dict(state["loader"])   # refused for another schedule or job
        self.next_step = self.ds.loader.cursor


def run_epoch(accelerator, model, opt, task: Ptycho, batches, state: TrainingState, stop: int) -> torch.Tensor:
    """Train on ``batches`` (the rest of one epoch) until global step ``stop``; returns float64
    ``[sum of per-sample losses, samples]`` summed over ranks."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)  # on the device: no wait per step
    n = 0
    for batch in batches:
        with accelerator.autocast():
            per_sample = sum(task.losses(model, batch, accelerator.device).values())  # (n,) on the device
        opt.zero_grad(set_to_none=True)
        accelerator.backward(per_sample.float().mean() * batch["weight"])
        opt.step()
        loss_sum += per_sample.detach().double().sum()
        n += len(per_sample)
        state.next_step = batch["step"] + 1
        if state.next_step >= stop:
            break
    total = torch.stack([loss_sum, torch.full((), float(n), dtype=torch.float64, device=accelerator.device)])
    return accelerator.reduce(total, reduction="sum").cpu()


def say(accelerator, line: str):
    """Print on the job's rank 0 only (``accelerator.print`` prints once per node)."""
    if accelerator.is_main_process:
        print(line, flush=True)


def train(accelerator, args) -> None:
    from solar.torch import SolarDataset

    # rank and world size from torch.distributed (set up by Accelerator); with CUDA the batches are built in pinned
    # memory, so DataLoader's pin_memory passes them through and the copy to the GPU can overlap the step
    ds = SolarDataset(args.plan, pin_memory=accelerator.device.type == "cuda")
    P, S = ds.loader.schedule.world_size, len(ds)
    if accelerator.num_processes != P:
        trainer.fail(f"{args.plan} is planned for {P} ranks but Accelerate runs {accelerator.num_processes} "
                     "process(es); launch with accelerate launch --multi_gpu --num_processes or torchrun")
    epochs = args.epochs or ds.epochs
    if not 1 <= epochs <= ds.epochs:
        trainer.fail(f"{args.plan} has {ds.epochs} epochs, the job wants {epochs}; plan more")
    if args.resume and not os.path.isdir(args.checkpoint):
        trainer.fail(f"--resume: no checkpoint folder {args.checkpoint}")
    args.data = ds.loader.schedule.source
    if not args.data:  # planned from a Layout object: the per-pixel statistics need the data's path
        trainer.fail(f"{args.plan} records no dataset path (it was planned from a layout object); plan it "
                     "from the data's path: solar plan DATA -P RANKS -b BATCH --epochs E -o PLAN")
    task = Ptycho()
    task.configure(args)
    trainer.quiet_grad_strides()
    task.setup(args, trainer.Group())      # per-pixel statistics (a resumed run gets the saved ones below)
    torch.manual_seed(args.seed)
    model = task.model(args)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    model, opt = accelerator.prepare(model, opt)  # not the DataLoader: the schedule already shards it
    state = TrainingState(ds, task)
    accelerator.register_for_checkpointing(state)
    if args.resume:
        accelerator.load_state(args.checkpoint)
        say(accelerator, f"resumed from {args.checkpoint} at step {state.next_step} "
                         f"(epoch {state.next_step // S}, step {state.next_step % S} of {S})")
    stop = min(args.max_steps or epochs * S, epochs * S)
    on_gpu = ds.loader.buffer_device is not None  # solar plan --device-buffer: batches already on the GPU
    dl = DataLoader(ds, batch_size=None, num_workers=0, pin_memory=accelerator.device.type == "cuda" and not on_gpu)
    seen = ds.stats()                      # the buffer's hit and miss counts at the last epoch end
    for epoch in range(state.next_step // S, epochs):
        if state.next_step >= stop:
            break
        first, t = state.next_step, time.perf_counter()
        ds.set_epoch(epoch)                # a no-op mid-epoch after a resume: the loader keeps its cursor
        loss, n = run_epoch(accelerator, model, opt, task, dl, state, stop).tolist()
        st = ds.stats()
        hits, misses = (st.get(k, 0) - seen.get(k, 0) for k in ("hits", "misses"))
        seen = st
        part = "" if state.next_step - first == S else f" (steps {first % S}..{(state.next_step - 1) % S} of {S})"
        say(accelerator, f"epoch {epoch}{part}: loss {loss / max(n, 1):.4f}  {n / (time.perf_counter() - t):.1f} "
                         f"samples/s  buffer hits {hits / max(1, hits + misses):.1%} (rank 0)")
        if args.checkpoint:
            accelerator.save_state(args.checkpoint)
    say(accelerator, f"done: {state.next_step} steps")
    ds.close()


def main(argv=None) -> int:
    from accelerate import Accelerator

    from solar.errors import SolarError

    args = parse_args(argv)
    # Accelerate runs DDP on CPU only with cpu=True (gloo): a plain Accelerator() without CUDA leaves
    # every launched process alone, each training its own model
    kw = {} if args.mixed_precision is None else dict(mixed_precision=args.mixed_precision)
    accelerator = Accelerator(cpu=args.cpu or not torch.cuda.is_available(), **kw)
    try:
        train(accelerator, args)
    except SolarError as exc:
        # the other ranks see this rank's sockets close and fail in their next collective
        print(f"train_ptychonn_accelerate: error on rank {accelerator.process_index}: {exc}", file=sys.stderr,
              flush=True)
        return 2
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    trainer.end_process(main())
