#!/usr/bin/env python
"""Train a PtychoNN-like surrogate (diffraction pattern -> amplitude and phase) with DDP,
fed by solar's planned loader or by the usual DataLoader + DistributedSampler + h5py.

One process per rank, started by an MPI launcher (``mpiexec``, ``srun --mpi=pmi2``):

    mpiexec -n 2 .venv/bin/python examples/train_ptychonn.py data/ptychonn --epochs 4
    mpiexec -n 2 .venv/bin/python examples/train_ptychonn.py data/ptychonn --loader baseline --epochs 4

With ``--loader solar`` (default) the schedule file ``--plan`` is used when it exists; when it
does not (or ``--replan``), rank 0 plans it first with this job's world size, local batch,
epochs, seed and ``--buffer-fraction``.  Without ``--plan`` the file is
``solar-plan-<name>-P<ranks>-b<batch>-E<epochs>-s<seed>.h5`` in the working directory,
re-planned when it no longer fits the data or the job.

Each rank's loss is its local mean times ``batch["weight"]``, so DDP's gradient average is
the mean over the global batch even when a schedule gives ranks unequal counts.

``--checkpoint PATH`` saves model, optimizer and loader position (at the end of each epoch,
every ``--checkpoint-every`` steps and when ``--max-steps`` stops the run); ``--resume``
restores them and continues with the exact next batch, mid-epoch included.

mpi4py is imported inside main(), never at module level: the baseline's DataLoader workers
start with forkserver and import this script again.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

FIELDS = ("X_train", "Y_I_train", "Y_phi_train")  # diffraction, amplitude, phase (PtychoNN names)


# ----------------------------------------------------------------------------- model
def _block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(inplace=True),
                         nn.Conv2d(c_out, c_out, 3, padding=1), nn.ReLU(inplace=True))


class Decoder(nn.Module):
    """Conv blocks with 2x upsampling back to the input size, then a 1-channel 3x3 conv."""

    def __init__(self, widths):
        super().__init__()
        ws = list(reversed(widths))  # e.g. 64, 32, 16
        self.blocks = nn.ModuleList(_block(ws[i], ws[i + 1] if i + 1 < len(ws) else ws[i]) for i in range(len(ws)))
        self.out = nn.Conv2d(ws[-1], 1, 3, padding=1)

    def forward(self, z):
        for blk in self.blocks:
            z = F.interpolate(blk(z), scale_factor=2, mode="bilinear", align_corners=False)
        return self.out(z)


class PtychoNNLike(nn.Module):
    """Shared conv encoder (``depth`` levels of two 3x3 convs + 2x2 max-pool, ``width``
    channels doubling per level) and two decoders: amplitude (around 1) and phase
    (``pi * tanh``).  Input and outputs are (n, 1, H, W); H and W divisible by 2**depth."""

    def __init__(self, width: int = 16, depth: int = 3):
        super().__init__()
        widths = [width * 2 ** i for i in range(depth)]
        enc, c = [], 1
        for w in widths:
            enc += [_block(c, w), nn.MaxPool2d(2)]
            c = w
        self.encoder = nn.Sequential(*enc)
        self.amplitude = Decoder(widths)
        self.phase = Decoder(widths)
        nn.init.constant_(self.amplitude.out.bias, 1.0)  # generated amplitudes are ~1 +- 0.25

    @staticmethod
    def prepare(diffraction: torch.Tensor) -> torch.Tensor:
        """(n, H, W, 1) far-field magnitudes normalised to max 1 -> (n, 1, H, W) log scale in ~[-1, 1]."""
        x = diffraction.permute(0, 3, 1, 2)
        return torch.log10(x.clamp_min(1e-6)) / 3.0 + 1.0

    def forward(self, x):
        z = self.encoder(x)
        return self.amplitude(z), math.pi * torch.tanh(self.phase(z))


def sample_losses(model, batch: dict, fields, device):
    """Per-sample L1 losses (mean absolute error over pixels, as PtychoNN): amplitude, phase; each (n,)."""
    x, amp, phi = (batch[f].to(device, non_blocking=True) for f in fields)
    pa, pp = model(PtychoNNLike.prepare(x))
    amp, phi = amp.permute(0, 3, 1, 2), phi.permute(0, 3, 1, 2)
    return (pa - amp).abs().mean(dim=(1, 2, 3)), (pp - phi).abs().mean(dim=(1, 2, 3))


# ----------------------------------------------------------------------------- loaders
class SolarSource:
    """solar's planned loader: each rank's local batches as the schedule file says."""

    kind = "solar"

    def __init__(self, plan_path, data, comm, pin_memory):
        from solar.loader import SolarLoader
        self.loader = SolarLoader(plan_path, data, comm=comm, pin_memory=pin_memory)
        self.steps_per_epoch = len(self.loader)
        self.epochs = self.loader.epochs
        self.local_batch = self.loader.schedule.local_batch
        self._last = {}

    def state(self) -> dict:
        return self.loader.state_dict()

    def restore(self, state: dict):
        self.loader.load_state_dict(state)

    def batches(self, e: int):
        """``(sample ids, batch, weight)`` for the rest of epoch ``e`` (from the loader's cursor)."""
        S = self.steps_per_epoch
        if not e * S <= self.loader.cursor < (e + 1) * S:
            self.loader.set_epoch(e)  # a fresh epoch; mid-epoch after a resume the cursor is kept
        for batch in self.loader:
            yield batch["index"].numpy(), batch, float(batch["weight"])

    def epoch_stats(self) -> dict:
        """Buffer hits and misses since the previous call (blocks)."""
        st = self.loader.stats()
        out = {k: st.get(k, 0) - self._last.get(k, 0) for k in ("hits", "misses")}
        self._last = st
        return out

    def close(self):
        self.loader.close()


class _FromOffset(torch.utils.data.Sampler):
    """A DistributedSampler's indices from position ``skip`` on (resume inside an epoch)."""

    def __init__(self, inner):
        self.inner, self.skip = inner, 0

    def __iter__(self):
        return iter(list(self.inner)[self.skip:])

    def __len__(self):
        return max(0, len(self.inner) - self.skip)


class BaselineSource:
    """What users write today: map-style h5py dataset, DistributedSampler, DataLoader workers."""

    kind = "baseline"

    def __init__(self, data, comm, local_batch, seed, workers, pin_memory):
        import multiprocessing

        from torch.utils.data import DataLoader, DistributedSampler

        from solar.bench.baseline import H5Samples
        self.dataset = H5Samples(data)
        self.sampler = DistributedSampler(self.dataset, num_replicas=comm.size, rank=comm.rank, shuffle=True,
                                          seed=seed, drop_last=False)
        self.view = _FromOffset(self.sampler)
        kw = {}
        if workers:
            ctx = multiprocessing.get_context("forkserver")  # never fork an MPI process
            ctx.set_forkserver_preload(["torch", "h5py", "solar.bench.baseline"])
            kw = dict(multiprocessing_context=ctx, persistent_workers=True)
        self.loader = DataLoader(self.dataset, batch_size=local_batch, sampler=self.view, num_workers=workers,
                                 pin_memory=pin_memory, **kw)
        self.local_batch = local_batch
        self.steps_per_epoch = math.ceil(len(self.sampler) / local_batch)
        self.epochs = None
        self.cursor = 0
        self.ident = dict(n_samples=len(self.dataset), world_size=comm.size, local_batch=local_batch, seed=seed)

    def state(self) -> dict:
        return dict(self.ident, step=self.cursor)

    def restore(self, state: dict):
        for k, v in self.ident.items():
            if state.get(k) != v:
                fail(f"checkpoint was saved by another baseline job ({k}: {state.get(k)!r} != {v!r})")
        self.cursor = int(state["step"])

    def batches(self, e: int):
        S, b = self.steps_per_epoch, self.local_batch
        if not e * S <= self.cursor < (e + 1) * S:
            self.cursor = e * S
        first = self.cursor - e * S
        self.sampler.set_epoch(e)
        order = np.fromiter(iter(self.sampler), dtype=np.int64)  # what the workers will read, in order
        self.view.skip = first * b
        for k, batch in enumerate(self.loader, start=first):
            self.cursor = e * S + k + 1
            yield order[k * b:(k + 1) * b], batch, 1.0

    def epoch_stats(self) -> dict:
        return {}

    def close(self):
        del self.loader  # ends persistent workers
        self.dataset.close()


# ----------------------------------------------------------------------------- helpers
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("data", help="layout spec, folder holding solar-layout.json, or the PtychoNN HDF5 file")
    p.add_argument("--loader", choices=("solar", "baseline"), default="solar")
    p.add_argument("--plan", help="schedule file (solar); planned on rank 0 when missing")
    p.add_argument("--replan", action="store_true", help="plan again even if the schedule file exists")
    p.add_argument("--buffer-fraction", type=float, default=0.5, help="aggregate buffer / dataset, when planning")
    p.add_argument("--epochs", type=int, help="epochs to train (default: the plan's, or 5)")
    p.add_argument("--local-batch", type=int, help="samples per rank per step (default: the plan's, or 32)")
    p.add_argument("--seed", type=int, default=0, help="DistributedSampler / planner seed and model init seed")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--width", type=int, default=16, help="channels of the first encoder level")
    p.add_argument("--depth", type=int, default=3, help="encoder levels (input size divisible by 2**depth)")
    p.add_argument("--fields", nargs=3, default=list(FIELDS), metavar=("INPUT", "AMPLITUDE", "PHASE"))
    p.add_argument("--max-steps", type=int, help="stop after this many training steps in total (counted from "
                                                  "the start of training, resumed steps included)")
    p.add_argument("--workers", type=int, default=1, help="baseline: DataLoader worker processes per rank")
    p.add_argument("--threads", type=int, help="torch CPU threads per rank (default: cores / ranks per node)")
    p.add_argument("--cpu", action="store_true", help="train on CPU even if CUDA is available")
    p.add_argument("--checkpoint", help="checkpoint file (model, optimizer, loader position)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="also save every N steps (0: epoch ends)")
    p.add_argument("--resume", action="store_true", help="restore --checkpoint and continue")
    p.add_argument("--log-json", help="rank 0 writes JSON lines: every step (sample ids per rank, loss) and "
                                      "every epoch summary")
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint:
        p.error("--resume needs --checkpoint")
    for k in ("epochs", "local_batch", "max_steps", "width", "depth"):
        v = getattr(args, k)
        if v is not None and v < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    return args


def fail(msg: str):
    """A job error: one line per rank instead of a traceback (then the job is aborted)."""
    from solar.errors import SolarError
    raise SolarError(msg)


def on_root(comm, fn):
    """``fn()`` on rank 0, its result (or its error) on every rank."""
    res = None
    if comm.rank == 0:
        try:
            res = ("ok", fn())
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank
            res = ("err", str(exc) if type(exc).__name__ == "SolarError" else f"{type(exc).__name__}: {exc}")
    status, val = comm.bcast(res, root=0)
    if status == "err":
        fail(f"on rank 0: {val}")
    return val


def ensure_plan(args, comm) -> str:
    """The schedule file this job runs on, planned on rank 0 when missing or stale."""
    import solar
    from solar.errors import SolarError
    P = comm.size
    explicit = args.plan is not None

    def work():
        layout = solar.load_layout(args.data)
        path = args.plan
        if path is None:
            b, E = args.local_batch or 32, args.epochs or 5
            name = os.path.basename(os.path.normpath(args.data)).split(".")[0] or "data"
            path = f"solar-plan-{name}-P{P}-b{b}-E{E}-s{args.seed}.h5"
        reason = "--replan" if args.replan else None if os.path.exists(path) else "no schedule file yet"
        if reason is None:
            try:
                with solar.Schedule.load(path, layout=layout, world_size=P) as s:
                    c = s.config
                    wrong = []
                    if args.local_batch is not None and c.local_batch != args.local_batch:
                        wrong.append(f"local batch {c.local_batch} (job: {args.local_batch})")
                    if c.seed != args.seed:
                        wrong.append(f"seed {c.seed} (job: {args.seed})")
                    if args.epochs is not None and c.epochs < args.epochs:
                        wrong.append(f"{c.epochs} epochs (job: {args.epochs})")
                    if wrong:
                        reason = "planned for " + ", ".join(wrong)
            except SolarError as exc:
                reason = str(exc)
            if reason and explicit:
                fail(f"{path} does not fit this job: {reason}; pass --replan to plan it again")
        if reason:
            t = time.perf_counter()
            print(f"planning {path} ({reason}) ...", flush=True)
            solar.plan(args.data, world_size=P, local_batch=args.local_batch or 32, epochs=args.epochs or 5,
                       buffer_fraction=args.buffer_fraction, seed=args.seed, out=path).close()
            print(f"planned in {time.perf_counter() - t:.1f} s", flush=True)
        return path

    return on_root(comm, work)


def init_distributed(comm, topo, cuda: bool):
    """torch.distributed over TCP: MASTER_ADDR (default rank 0's host name, sent over MPI), MASTER_PORT
    (default: a free port rank 0 picks)."""
    addr = os.environ.get("MASTER_ADDR") or comm.bcast(socket.gethostname() if comm.rank == 0 else None, root=0)
    port = os.environ.get("MASTER_PORT")
    if not port:
        if comm.rank == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        port = comm.bcast(port, root=0)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", world_size=comm.size, rank=comm.rank,
                            timeout=timedelta(minutes=10))
    return backend, addr, port


def default_threads(local_size: int) -> int:
    """CPUs this process is bound to; when it may use the whole node, an equal share per rank."""
    mine, node = len(os.sched_getaffinity(0)), os.cpu_count() or 1
    return max(1, mine if mine < node else node // local_size)


def atomic_save(obj, path):
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- main
def train(args, comm):
    from solar.topology import detect
    topo = detect(comm)
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device(topo.device(cuda, torch.cuda.device_count()))
    if cuda:
        torch.cuda.set_device(device)
    threads = args.threads or default_threads(topo.local_size)
    torch.set_num_threads(threads)
    backend, addr, port = init_distributed(comm, topo, cuda)
    root = comm.rank == 0

    def say(*a):
        if root:
            print(*a, flush=True)

    # ------------------------------------------------------------- data
    if args.loader == "solar":
        plan_path = ensure_plan(args, comm)
        source = SolarSource(plan_path, args.data, comm, pin_memory=cuda)
        if args.local_batch and args.local_batch != source.local_batch:
            fail(f"{plan_path} has local batch {source.local_batch}, not {args.local_batch}")
        epochs = args.epochs or source.epochs
        if epochs > source.epochs:
            fail(f"{plan_path} has {source.epochs} epochs, the job wants {epochs}; "
                             "plan more (--replan)")
    else:
        plan_path = None
        source = BaselineSource(args.data, comm, args.local_batch or 32, args.seed, args.workers, pin_memory=cuda)
        epochs = args.epochs or 5
    S = source.steps_per_epoch
    max_steps = min(args.max_steps or epochs * S, epochs * S)

    # ------------------------------------------------------------- model
    torch.manual_seed(args.seed)
    model = PtychoNNLike(args.width, args.depth).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    step = 0
    if args.resume:
        if not os.path.exists(args.checkpoint):
            fail(f"--resume: no checkpoint {args.checkpoint}")
        ck = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
        if ck["loader_kind"] != source.kind:
            fail(f"checkpoint was written with --loader {ck['loader_kind']}, not {source.kind}")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        source.restore(ck["loader"])
        step = int(ck["step"])
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"train_ptychonn: {comm.size} ranks on {topo.nodes} node(s), {backend} at {addr}:{port}, device "
        f"{device}{'' if cuda else f', {threads} thread(s) per rank'}; model {n_params / 1e6:.2f} M parameters")
    say(f"loader {source.kind}" + (f" (schedule {plan_path})" if plan_path else f" ({args.workers} worker(s))")
        + f": {S} steps per epoch of local batch {source.local_batch}, {epochs} epochs, "
        f"stop after step {max_steps}")

    def save(epoch):
        if args.checkpoint and root:
            atomic_save(dict(model=model.state_dict(), optimizer=opt.state_dict(), loader=source.state(),
                             loader_kind=source.kind, step=step, epoch=epoch, args=vars(args)), args.checkpoint)
        comm.Barrier()

    log = open(args.log_json, "w") if args.log_json and root else None
    mine = dict(steps=0, samples=0, distinct=set(), loss=float("nan"))
    resumed_at = step if args.resume else None
    if args.resume:
        say(f"resumed from {args.checkpoint} at step {step} (epoch {step // S}, step {step % S} of {S})")

    # ------------------------------------------------------------- loop
    try:
        for e in range(step // S, epochs):
            if step >= max_steps:
                break
            first_step = step
            loss_sum = amp_sum = 0.0
            n_samples = 0
            stall = 0.0
            comm.Barrier()
            t0 = time.perf_counter()
            it = source.batches(e)
            while step < max_steps:
                t = time.perf_counter()
                item = next(it, None)
                stall += time.perf_counter() - t
                if item is None:
                    break
                ids, batch, weight = item
                l_amp, l_phi = sample_losses(ddp, batch, args.fields, device)
                per_sample = l_amp + l_phi
                loss = per_sample.mean() * weight
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                ls = float(per_sample.detach().sum())
                loss_sum += ls
                amp_sum += float(l_amp.detach().sum())
                n_samples += len(ids)
                mine["distinct"].update(int(i) for i in ids)
                if step == resumed_at:
                    ids0 = comm.gather([int(i) for i in ids], root=0)
                    if root:
                        say(f"first batch after resume (step {step}): " +
                            "; ".join(f"rank {r}: {x}" for r, x in enumerate(ids0)))
                if args.log_json:
                    rec = comm.gather(([int(i) for i in ids], ls, len(ids)), root=0)
                    if log:
                        log.write(json.dumps(dict(step=step, epoch=e, index=[r[0] for r in rec],
                                                  loss=sum(r[1] for r in rec) / sum(r[2] for r in rec))) + "\n")
                step += 1
                if args.checkpoint_every and step % args.checkpoint_every == 0 and step < max_steps:
                    save(e)
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            it.close()
            extra = source.epoch_stats()
            per_rank = comm.allgather((loss_sum, n_samples, stall, extra.get("hits", 0), extra.get("misses", 0),
                                       seconds, amp_sum))
            tot = [sum(r[k] for r in per_rank) for k in range(7)]
            mx = [max(r[5] for r in per_rank), max(r[2] for r in per_rank)]
            steps = step - first_step
            rec = dict(epoch=e, steps=steps, first_step=first_step, loss=tot[0] / max(tot[1], 1),
                       amplitude_loss=tot[6] / max(tot[1], 1), phase_loss=(tot[0] - tot[6]) / max(tot[1], 1),
                       samples=int(tot[1]), seconds=mx[0], samples_per_s=tot[1] / mx[0] if mx[0] > 0 else 0.0,
                       stall_s_max=mx[1], stall_s_mean=tot[2] / comm.size)
            if tot[3] + tot[4]:
                rec["buffer_hit_rate"] = tot[3] / (tot[3] + tot[4])
            part = "" if steps == S else f" (steps {first_step % S}..{first_step % S + steps - 1} of {S})"
            say(f"epoch {e}{part}: loss {rec['loss']:.4f} (amplitude {rec['amplitude_loss']:.4f}, phase "
                f"{rec['phase_loss']:.4f})  {rec['samples_per_s']:.1f} samples/s  "
                f"{rec['seconds']:.1f} s  loader stall {rec['stall_s_max']:.2f} s (max over ranks), "
                f"{rec['stall_s_mean']:.2f} s (mean)"
                + (f"  buffer hits {rec['buffer_hit_rate']:.1%}" if "buffer_hit_rate" in rec else ""))
            if log:
                log.write(json.dumps(rec) + "\n")
                log.flush()
            mine["steps"] += steps
            mine["samples"] += n_samples
            mine["loss"] = loss_sum / max(n_samples, 1)
            save(e)
        host = socket.gethostname()
        print(f"rank {comm.rank} of {comm.size} on {host} ({device}): trained {mine['steps']} steps on "
              f"{mine['samples']} samples ({len(mine['distinct'])} distinct), local loss {mine['loss']:.4f} "
              "in its last epoch", flush=True)
        comm.Barrier()
        say(f"done: {step} steps")
    finally:
        if log:
            log.close()
    # on an error, abort_on_error ends every rank at once: no collective clean-up that could hang
    source.close()
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    from mpi4py import (
        MPI,  # here, not at the top: DataLoader workers import this script again
    )

    from solar.mpi import abort_on_error
    comm = MPI.COMM_WORLD
    with abort_on_error(comm, prefix="train_ptychonn"):
        train(args, comm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
