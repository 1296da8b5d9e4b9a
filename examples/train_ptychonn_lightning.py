#!/usr/bin/env python
"""The PtychoNN example with PyTorch Lightning (optional: ``pip install lightning``): the same model,
normalisation and loss as ``train_ptychonn.py``, fed by :class:`solar.torch.SolarDataset` through a
plain ``DataLoader(batch_size=None)``.  Lightning runs DDP; launch with torchrun:

    solar plan data/ptychonn -P 2 -b 16 --epochs 3 --buffer-fraction 0.5 -o plan.h5
    torchrun --nproc-per-node 2 examples/train_ptychonn_lightning.py plan.h5 --epochs 3

Each pass over the dataset is the schedule's next epoch (solar's epochs run in plan order), so
nothing needs ``set_epoch``; ``use_distributed_sampler=False`` because the schedule already says
which rank reads which samples.  The loss of a rank is its mean times ``batch["weight"]``.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

import trainer
from train_ptychonn import FIELDS, Ptycho


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("plan", help="schedule file made by solar plan (its world size = the job's)")
    p.add_argument("--epochs", type=int, default=3, help="epochs (at most the plan's)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--stats-samples", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", default="32-true",
                   help="Lightning's precision, e.g. bf16-mixed on GPUs (default 32-true)")
    args = p.parse_args(argv)
    args.fields = list(FIELDS)
    return args


def main(argv=None) -> int:
    from solar.errors import SolarError

    args = parse_args(argv)
    try:
        return train(args)
    except SolarError as exc:  # one line, not a traceback; the other ranks fail in their next collective
        print(f"train_ptychonn_lightning: error on rank {os.environ.get('RANK', '0')}: {exc}", file=sys.stderr,
              flush=True)
        return 2


def train(args) -> int:
    import lightning as L

    from solar.torch import SolarDataset

    # rank from torchrun's RANK / WORLD_SIZE; with CUDA the batches are built in pinned memory (Lightning's copy to
    # the GPU is then asynchronous)
    ds = SolarDataset(args.plan, pin_memory=torch.cuda.is_available())
    args.data = ds.loader.schedule.source
    if not args.data:  # planned from a Layout object: the per-pixel statistics need the data's path
        trainer.fail(f"{args.plan} records no dataset path (it was planned from a layout object); plan it "
                     "from the data's path: solar plan DATA -P RANKS -b BATCH --epochs E -o PLAN")
    task = Ptycho()
    task.configure(args)
    trainer.quiet_grad_strides()
    seen: dict = {}  # the buffer's hit and miss counts at the last epoch end

    class Module(L.LightningModule):
        def setup(self, stage):
            task.setup(args, trainer.Group())      # per-pixel statistics: torch.distributed is up here
            torch.manual_seed(args.seed)
            self.net = task.model(args)

        def training_step(self, batch, _):
            per = task.losses(self.net, batch, self.device)
            total = sum(per.values())
            # logged detached: the epoch's running mean must not keep this step's autograd graph alive (on an
            # H200 torch warned of an AccumulateGrad node kept alive across steps)
            self.log("loss", total.detach().mean(), on_step=False, on_epoch=True, sync_dist=True,
                     batch_size=len(total))
            return total.mean() * batch["weight"]

        def on_train_epoch_end(self):
            st = ds.stats()
            hits, misses = (st.get(k, 0) - seen.get(k, 0) for k in ("hits", "misses"))
            seen.update(st)
            if self.global_rank == 0:
                print(f"epoch {self.current_epoch}: loss {float(self.trainer.callback_metrics['loss']):.4f}  "
                      f"buffer hits {hits / max(1, hits + misses):.1%} (rank 0)", flush=True)

        def configure_optimizers(self):
            return torch.optim.Adam(self.net.parameters(), lr=args.lr)

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun: processes on this node
    fit = L.Trainer(max_epochs=args.epochs, accelerator="auto", devices=local, strategy="ddp",
                    num_nodes=int(os.environ.get("WORLD_SIZE", str(local))) // local,
                    use_distributed_sampler=False, logger=False, enable_checkpointing=False, precision=args.precision,
                    enable_progress_bar=False, enable_model_summary=False)
    fit.fit(Module(), torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0))
    ds.close()
    return 0


if __name__ == "__main__":
    trainer.end_process(main())
