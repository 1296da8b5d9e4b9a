"""The training loop the examples share: DDP over ``torch.distributed``, fed by solar or by the
usual ``DataLoader`` + ``DistributedSampler`` over h5py; per-epoch loss, held-out loss against
reference predictors, samples/s, loader stall, buffer hit rate; checkpoint/resume; a loss plot.

An example supplies a :class:`Task` (what to read, how to normalise, the model, the per-sample
losses and the reference predictors) and calls :func:`main`.  Launch with any launcher that
sets rank variables: ``torchrun``, ``mpiexec`` (MPICH / Open MPI), ``srun``.  Rank, world size and
the rendezvous come from :func:`solar.torch.init_distributed` (``MASTER_ADDR``/``MASTER_PORT`` when
the port is set; under MPI with mpi4py, else, a free port of rank 0 sent over MPI; torchrun's own).

Determinism: inside a local batch samples are put in sample-id order before the forward pass,
and every reported loss is a sum over samples reduced over ranks, so two loaders that give the
same global batches (solar and the baseline: the same sets of samples per step) train the same
model up to float reassociation of the gradient sums.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
import warnings
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

import step as stepping
from step import sorted_batch


# ----------------------------------------------------------------------------- errors
def fail(msg: str):
    """A job error: one line per rank instead of a traceback."""
    from solar.errors import SolarError
    raise SolarError(msg)


# ----------------------------------------------------------------------------- collectives
class Group:
    """The job's ranks over ``torch.distributed`` (object collectives on the default group).

    Works in any default group: solar's ``cpu:gloo,cuda:nccl`` (CPU tensors reduced by gloo), or an
    NCCL-only group that a framework made (Lightning, Accelerate), where :meth:`allreduce` goes through
    this rank's GPU; without one (a framework running a single process), a job of one rank."""

    def __init__(self):
        self.alone = not dist.is_initialized()
        if self.alone:
            self.rank, self.size, self.device = 0, 1, torch.device("cpu")
            return
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        nccl_only = str(dist.get_backend()).lower() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl_only else torch.device("cpu")

    def barrier(self):
        if not self.alone:
            dist.barrier()

    def bcast(self, obj):
        if self.alone:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def allgather(self, obj) -> list:
        if self.alone:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def allreduce(self, values) -> np.ndarray:
        """Element-wise sum over ranks of a float64 vector (a CPU tensor where the group reduces them)."""
        if self.alone:
            return np.asarray(values, dtype=np.float64).copy()
        t = torch.as_tensor(np.asarray(values, dtype=np.float64)).to(self.device)
        dist.all_reduce(t)
        return t.cpu().numpy()


def on_root(g: Group, fn):
    """``fn()`` on rank 0, its result (or its error) on every rank."""
    res = None
    if g.rank == 0:
        try:
            res = ("ok", fn())
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank
            res = ("err", str(exc) if type(exc).__name__ == "SolarError" else f"{type(exc).__name__}: {exc}")
    status, val = g.bcast(res)
    if status == "err":
        fail(val if g.rank == 0 else f"rank 0 failed: {val}")
    return val


# ----------------------------------------------------------------------------- map-style reads
def sample_reader(path: str, split: Optional[str] = None) -> Tuple[Callable[[np.ndarray], Dict[str, torch.Tensor]],
                                                                   int, object]:
    """``(read, n_samples, dataset)`` of ``path`` (its split ``split`` when given): ``read(ids)`` ->
    ``{field: tensor (len(ids), ...)}`` through h5py, one fancy-index read per field (solar's ``batched``
    baseline) where the layout allows it, else sample by sample (the ``torch`` baseline)."""
    from solar.bench.baseline import H5Samples, baseline_dataset, skip_reason
    from solar.layout import load_layout
    layout = load_layout(path, split=split) if split else load_layout(path)
    if skip_reason(layout, "batched") is None:
        ds = baseline_dataset(path, "batched", layout)
        return (lambda ids: ds[np.asarray(ids, dtype=np.int64)]), len(ds), ds
    ds = H5Samples(path, layout)

    def read(ids):
        rows = [ds[int(i)] for i in ids]
        return {f: torch.stack([r[f] for r in rows]) for f in rows[0]}
    return read, len(ds), ds


def chunks(ids: np.ndarray, size: int) -> Iterator[np.ndarray]:
    for lo in range(0, len(ids), size):
        yield ids[lo:lo + size]


def field_moments(g: Group, read, n: int, fields, transform, max_samples: int, chunk: int = 64) -> dict:
    """Per-element mean and std (float32 tensors shaped like one transformed sample) of each field over
    ``min(n, max_samples)`` evenly spaced training samples; ranks read disjoint shares, sums in float64."""
    ids = np.unique(np.linspace(0, n - 1, min(n, max_samples)).round().astype(np.int64))
    mine = ids[g.rank::g.size]
    sums: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
    for part in chunks(mine, chunk):
        batch = read(part)
        for f in fields:
            x = transform(f, batch[f]).double()
            s, q = sums.get(f, (0.0, 0.0))
            sums[f] = (x.sum(0) + s, (x * x).sum(0) + q)
    out = {}
    for f in fields:
        shape = tuple(transform(f, read(ids[:1])[f]).shape[1:])
        s, q = sums.get(f, (torch.zeros(shape, dtype=torch.float64),) * 2)
        tot = g.allreduce(torch.cat([torch.as_tensor(s).reshape(-1), torch.as_tensor(q).reshape(-1)]).numpy())
        m = len(ids)
        mean = tot[:tot.size // 2] / m
        var = np.maximum(tot[tot.size // 2:] / m - mean * mean, 0.0)
        out[f] = (torch.from_numpy(mean.reshape(shape)).float(), torch.from_numpy(np.sqrt(var).reshape(shape)).float())
    return out


# ----------------------------------------------------------------------------- tasks
class Task:
    """What an example trains.  ``fields``: the dataset fields a batch must hold.  Subclasses set
    :attr:`stats` in :meth:`setup` (saved in checkpoints), build :meth:`model`, and give per-sample
    losses of the model (:meth:`losses`) and of reference predictors (:meth:`references`), each a dict
    ``{part: tensor (n,)}`` whose sum over parts is the loss."""

    name = "task"
    fields: Tuple[str, ...] = ()
    stats: dict = {}
    stats_per_field = True  # setup computes ``stats[field]`` for every field (a checkpoint must hold them)
    #: the loader puts batches on the training device ahead of use (False: :meth:`losses` takes CPU batches,
    #: e.g. for a CPU transform, and moves what it needs itself)
    device_batches = True
    #: memory format of the model's inputs (the trainer sets it: channels_last with ``--channels-last``)
    memory_format = torch.contiguous_format

    def add_args(self, p: argparse.ArgumentParser):
        pass

    def configure(self, args):
        """Take the task's options (before any data is read)."""

    def setup(self, args, g: Group) -> str:
        """Compute or read the normalisation statistics; returns where they come from (one line)."""
        raise NotImplementedError

    def model(self, args) -> nn.Module:
        raise NotImplementedError

    def losses(self, model, batch: dict, device, split: str = "train") -> Dict[str, torch.Tensor]:
        """``{part: per-sample loss (n,)}`` of ``model`` on ``batch`` (a batch of ``split``: train or held-out)."""
        raise NotImplementedError

    def references(self, batch: dict, split: str) -> Dict[str, Dict[str, torch.Tensor]]:
        """``{predictor: {part: per-sample loss (n,)}}``; ``"constant"`` at least."""
        raise NotImplementedError


# ----------------------------------------------------------------------------- loaders
class SolarSource:
    """solar's planned loader: each rank's local batches as the schedule file says."""

    kind = "solar"

    def __init__(self, plan_path: str, data: str, rank: int, pin_memory: bool, device=None, cpus: int = 1,
                 process: bool = False):
        from solar.loader import SolarLoader
        from solar.schedule import Schedule
        schedule, comm = Schedule.load(plan_path), None
        if schedule.nodes is not None:  # a node plan (solar plan --ranks-per-node): the node's ranks share a buffer
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
            if comm.Get_size() != schedule.world_size:
                fail(f"{plan_path} is a node plan (ranks of a node share one buffer through MPI): run the job "
                     f"under mpiexec or srun with {schedule.world_size} MPI ranks ({comm.Get_size()} here)")
        if schedule.buffer_place == "device":  # solar plan --device-buffer: the buffer in GPU memory, batches
            # gathered there (on the training device: the CPU stands in for the GPU with --cpu)
            if device is None and pin_memory:  # on CUDA, a task that takes CPU batches (a CPU transform first)
                fail(f"{plan_path} keeps its buffer in GPU memory (solar plan --device-buffer), and this example "
                     f"takes its batches on the CPU: plan it without --device-buffer")
            on = "cpu" if device is None else device
            self.loader = SolarLoader(schedule, data, comm=comm, rank=rank, buffer_device=on, cpus=cpus)
        elif process:  # the loader in a process of its own (its batches in shared memory, device= stages them)
            if schedule.nodes is not None:
                fail(f"{plan_path} is a node plan (ranks of a node share one buffer through MPI); --loader-process "
                     f"runs a buffer per rank: plan again without --ranks-per-node (--replan)")
            self.loader = SolarLoader(schedule.path, data, rank=rank, device=device, cpus=cpus, process=True)
            schedule.close()
        else:  # device: each batch copied to the GPU in the loader's prefetch thread, on a side stream, ahead of use
            self.loader = SolarLoader(schedule, data, comm=comm, rank=rank, pin_memory=pin_memory, device=device,
                                      cpus=cpus)
        self.steps_per_epoch = len(self.loader)
        self.epochs = self.loader.epochs
        self.local_batch = self.loader.schedule.local_batch
        self._last: dict = {}

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
        """Buffer hits and misses (blocks) since the previous call."""
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
    """What users write: ``DistributedSampler`` + ``DataLoader`` over a map-style h5py dataset, a batch per
    read (one fancy index per field, solar's ``batched`` baseline) where the layout allows, else per sample."""

    kind = "baseline"

    def __init__(self, data: str, g: Group, local_batch: int, seed: int, workers: int, pin_memory: bool,
                 device=None):
        import multiprocessing

        from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

        from solar.bench.baseline import H5Samples
        _, n, self.dataset = sample_reader(data)
        self.sampler = DistributedSampler(range(n), num_replicas=g.size, rank=g.rank, shuffle=True, seed=seed,
                                          drop_last=False)
        self.view = _FromOffset(self.sampler)
        kw = {}
        if workers:
            ctx = multiprocessing.get_context("forkserver")  # never fork a process that may hold MPI or threads
            ctx.set_forkserver_preload(["torch", "h5py", "solar.bench.baseline"])
            kw = dict(multiprocessing_context=ctx, persistent_workers=True)
        if isinstance(self.dataset, H5Samples):
            self.read_kind = "per sample"
            self.loader = DataLoader(self.dataset, batch_size=local_batch, sampler=self.view,
                                     num_workers=workers, pin_memory=pin_memory, **kw)
        else:
            self.read_kind = "batched"
            self.loader = DataLoader(self.dataset, batch_size=None, sampler=BatchSampler(self.view, local_batch, False),
                                     num_workers=workers, pin_memory=pin_memory, **kw)
        self.local_batch = local_batch
        self.device = device  # batches copied there ahead of use (solar.torch.to_device: a side stream)
        self.steps_per_epoch = math.ceil(len(self.sampler) / local_batch)
        self.epochs = None
        self.cursor = 0
        self.ident = dict(n_samples=n, world_size=g.size, local_batch=local_batch, seed=seed)

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
        order = np.fromiter(iter(self.sampler), dtype=np.int64)  # what the loader will read, in order
        self.view.skip = first * b
        batches = self.loader
        if self.device is not None:
            from solar.torch import to_device
            batches = to_device(self.loader, self.device, depth=2)
        for k, batch in enumerate(batches, start=first):
            self.cursor = e * S + k + 1
            yield order[k * b:(k + 1) * b], batch, 1.0

    def epoch_stats(self) -> dict:
        return {}

    def close(self):
        del self.loader  # ends persistent workers
        self.dataset.close()


class ResidentSource:
    """No loader: the same loop fed one local batch (this rank's first of epoch 0, in sample-id order) that
    sits on the device, at every step.  Its steps/s is the loop's own ceiling, what a loader can at best let
    it reach (``--loader resident``); it trains on that one batch only."""

    kind = "resident"

    def __init__(self, data: str, g: Group, local_batch: int, seed: int, device, on_device: bool):
        from torch.utils.data import DistributedSampler
        read, n, ds = sample_reader(data)
        sampler = DistributedSampler(range(n), num_replicas=g.size, rank=g.rank, shuffle=True, seed=seed,
                                     drop_last=False)
        self.ids = np.sort(np.fromiter(iter(sampler), dtype=np.int64)[:local_batch])
        try:
            batch = read(self.ids)
        finally:
            ds.close()
        self.batch = {k: (v.to(device) if on_device else v) for k, v in batch.items()}
        self.local_batch = local_batch
        self.steps_per_epoch = math.ceil(len(sampler) / local_batch)
        self.epochs = None
        self.cursor = 0
        self.ident = dict(n_samples=n, world_size=g.size, local_batch=local_batch, seed=seed, resident=True)

    def state(self) -> dict:
        return dict(self.ident, step=self.cursor)

    def restore(self, state: dict):
        if any(state.get(k) != v for k, v in self.ident.items()):
            fail("checkpoint was saved by another --loader resident job")
        self.cursor = int(state["step"])

    def batches(self, e: int):
        S = self.steps_per_epoch
        if not e * S <= self.cursor < (e + 1) * S:
            self.cursor = e * S
        for k in range(self.cursor - e * S, S):
            self.cursor = e * S + k + 1
            yield self.ids, self.batch, 1.0

    def epoch_stats(self) -> dict:
        return {}

    def close(self):
        self.batch = None


# ----------------------------------------------------------------------------- arguments
class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Options' defaults in their help, where they have one the text does not already give."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


def parse_args(task: Task, doc: str, argv=None):
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=_HelpWithDefaults)
    p.add_argument("data", help="layout spec, or the folder holding solar-layout.json (training data)")
    p.add_argument("--valid", help="held-out data (layout spec or folder, same fields): loss per epoch against "
                                   "the reference predictors")
    p.add_argument("--valid-split", help="held-out data: this split of the training data's spec (e.g. valid)")
    p.add_argument("--valid-samples", type=int, default=512, help="held-out samples evaluated (the first N)")
    p.add_argument("--loader", choices=("solar", "baseline", "resident"), default="solar",
                   help="solar's planned loader; baseline: DataLoader + DistributedSampler over h5py; resident: no "
                        "loader, one batch kept on the device fed at every step (the loop's own ceiling)")
    p.add_argument("--plan", help="schedule file (solar); planned on rank 0 when missing")
    p.add_argument("--replan", action="store_true", help="plan again even if the schedule file exists")
    p.add_argument("--ranks-per-node", type=int,
                   help="when planning: node-shared buffers, this many ranks per node (solar plan --ranks-per-node; "
                        "runs with mpiexec/srun); 1: a buffer per rank; default: the job's ranks per node where "
                        "MPI started them, else a buffer per rank")
    p.add_argument("--buffer-fraction", type=float, default=0.5, help="aggregate buffer / dataset, when planning")
    p.add_argument("--device-buffer", metavar="BYTES",
                   help="when planning: the buffer in GPU memory, BYTES per rank (e.g. 40GiB; solar plan "
                        "--device-buffer), batches gathered there; a buffer per rank (not with --ranks-per-node); "
                        "with --cpu the CPU stands in for the GPU. A plan made so is run that way")
    p.add_argument("--epochs", type=int, help="epochs to train (default: the plan's, or 5)")
    p.add_argument("--local-batch", type=int, help="samples per rank per step (default: the plan's, or 32)")
    p.add_argument("--seed", type=int, default=0, help="DistributedSampler / planner seed and model init seed")
    p.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate")
    p.add_argument("--stats-samples", type=int, default=4096,
                   help="training samples (evenly spaced) the normalisation statistics are computed from, where the "
                        "task computes them (The Well's are read from its stats.yaml)")
    p.add_argument("--max-steps", type=int, help="stop after this many training steps in total (counted from "
                                                  "the start of training, resumed steps included)")
    p.add_argument("--workers", type=int, default=1, help="baseline: DataLoader worker processes per rank")
    p.add_argument("--threads", type=int, help="torch CPU threads per rank (default: on CUDA 1; on CPU the rank's "
                                               "cores (affinity / ranks per node) less the loader's)")
    p.add_argument("--loader-cpus", type=int, help="cores solar's loader may keep busy assembling batches (default: "
                                                   "on CUDA the rank's cores less one; on CPU 1)")
    p.add_argument("--loader-process", action="store_true",
                   help="solar's buffer, reader and assembly in a process of their own per rank, so that their "
                        "threads never take the GIL from the training loop (a buffer per rank)")
    p.add_argument("--cpu", action="store_true", help="train on CPU even if CUDA is available")
    p.add_argument("--checkpoint", help="checkpoint file (model, optimizer, loader position, statistics)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="also save every N steps (0: epoch ends)")
    p.add_argument("--resume", action="store_true", help="restore --checkpoint and continue")
    p.add_argument("--log-json", help="rank 0 writes JSON lines: every step (sample ids per rank as the loader "
                                      "gave them, loss) and every epoch summary")
    p.add_argument("--plot", help="rank 0 writes the loss curves here (PNG; needs matplotlib)")
    stepping.add_args(p)
    task.add_args(p)
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint:
        p.error("--resume needs --checkpoint")
    if args.valid and args.valid_split:
        p.error("give --valid or --valid-split, not both")
    for k in ("epochs", "local_batch", "max_steps", "stats_samples", "valid_samples", "log_every", "threads",
              "loader_cpus"):
        v = getattr(args, k)
        if v is not None and v < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    # outputs written after training: checked now, not after an epoch's work
    from solar.cli.argtypes import check_output_path
    from solar.errors import SpecError
    for opt, path, suffixes in (("--checkpoint", args.checkpoint, ()), ("--log-json", args.log_json, ()),
                                ("--plot", args.plot, (".png", ".pdf", ".svg"))):
        try:
            if path is not None:
                check_output_path(path, opt, suffixes)
                check_not_an_input(path, opt, args)
        except SpecError as exc:
            p.error(str(exc))
    return args


def check_not_an_input(path: str, opt: str, args) -> None:
    """SpecError when the output ``path`` of option ``opt`` would replace a file the job reads: the data's or the
    held-out data's spec, the plan, or any HDF5 file (data files are HDF5; a checkpoint or log never is)."""
    import h5py

    from solar.errors import SpecError
    if not os.path.exists(path):  # (nothing there, or a dangling link: written through as any new file)
        return
    inputs = [args.plan] + [os.path.join(d, "solar-layout.json") if os.path.isdir(d) else d
                            for d in (args.data, args.valid) if d]
    for f in inputs:
        if f and os.path.exists(f) and os.path.samefile(path, f):
            raise SpecError(f"{opt} {path} is {f}, which this job reads; refusing to replace it")
    if os.path.isfile(path) and h5py.is_hdf5(path):
        raise SpecError(f"{opt} {path} is an HDF5 file (data or a plan?); refusing to replace it with this "
                        "job's output: choose another path")


# ----------------------------------------------------------------------------- set-up
def split_cores(share: int, cuda: bool, threads: Optional[int], loader_cpus: Optional[int]) -> Tuple[int, int]:
    """``(torch threads, loader cpus)`` out of the rank's ``share`` of cores, so that the two do not
    oversubscribe them: on CUDA the model runs on the GPU (1 torch thread) and the loader gets the rest; on
    CPU the model's kernels get the cores and the loader one.  Given values are kept."""
    if cuda:
        loader = loader_cpus or max(1, share - 1)
        return threads or 1, loader
    loader = loader_cpus or 1
    return threads or max(1, share - loader), loader


def node_pool_choice(g: Group, env=None) -> Tuple[Optional[int], int, Optional[str]]:
    """``(ranks per node for the plan or None, ranks per node found, a line for the user or None)``: where the
    job's ranks share
    nodes (the same number on each, placed in blocks, found from the hosts' names) and MPI launched them,
    the node's ranks share one buffer; without MPI each rank gets its own, and the line says so.
    Collective."""
    import socket

    from solar.topology import MPI_LAUNCH_VARS, block_ranks_per_node
    env = os.environ if env is None else env
    L, why = block_ranks_per_node(g.allgather(socket.gethostname()))
    if L is None:
        return None, 1, f"one buffer per rank: {why}"
    if L == 1:
        return None, 1, None
    if any(v in env for v in MPI_LAUNCH_VARS):  # MPI started the ranks (a node plan needs MPI)
        return L, L, f"the {L} ranks of each node share one buffer (a node plan; --ranks-per-node 1: one per rank)"
    return None, L, (f"one buffer per rank: the {L} ranks of each node could share one (a node plan), which needs "
                  f"MPI (launch with mpiexec or srun, with mpi4py)")


def ensure_plan(args, g: Group) -> str:
    """The schedule file this job runs on, planned on rank 0 when missing or stale.  Without
    ``--ranks-per-node``, :func:`node_pool_choice` decides between a node plan and per-rank buffers for a new
    plan; an existing file is taken as it was planned."""
    import solar
    from solar.errors import SolarError
    explicit = args.plan is not None
    device_buffer = getattr(args, "device_buffer", None)
    if device_buffer is not None and (args.ranks_per_node or 1) > 1:
        fail("--device-buffer plans one buffer per rank on its GPU: not with --ranks-per-node")
    process = getattr(args, "loader_process", False)
    if process and (args.ranks_per_node or 1) > 1:
        fail("--loader-process runs one buffer per rank in its loader process: not with --ranks-per-node")
    L, found, note = (args.ranks_per_node, 1, None) \
        if args.ranks_per_node is not None or device_buffer is not None or process else node_pool_choice(g)
    if L == 1:
        L = None  # one rank per node: a buffer per rank

    def work():
        layout = solar.load_layout(args.data)
        path = args.plan
        if path is None:
            b, E = args.local_batch or 32, args.epochs or 5
            name = os.path.basename(os.path.normpath(args.data)).split(".")[0] or "data"
            path = f"solar-plan-{name}-P{g.size}-b{b}-E{E}-s{args.seed}{'-gpubuf' if device_buffer else ''}.h5"
        reason = "--replan" if args.replan else None if os.path.exists(path) else "no schedule file yet"
        if reason is None:
            try:
                with solar.Schedule.load(path, layout=layout, world_size=g.size) as s:
                    reason = _misfit(s.config, args, s.nodes, s.buffer_place)  # ranks per node: only when given
            except SolarError as exc:
                reason = str(exc)
            if reason and explicit:
                fail(f"{path} does not fit this job: {reason}; pass --replan to plan it again")
        if reason:
            t = time.perf_counter()
            print(f"planning {path} ({reason}) ...", flush=True)
            # from the path, not the layout object: the file records where its data is (examples that take only a
            # schedule, such as the Lightning and Accelerate ones, find the data through it)
            budget = dict(buffer_fraction=args.buffer_fraction) if device_buffer is None else \
                dict(device_buffer=device_buffer)
            with solar.plan(args.data, world_size=g.size, local_batch=args.local_batch or 32,
                            epochs=args.epochs or 5, seed=args.seed, out=path, ranks_per_node=L, **budget) as s:
                mine = sum(s.predicted()["storage_bytes"])
            print(f"planned in {time.perf_counter() - t:.1f} s", flush=True)
            line = note
            if L is None and found > 1:  # what a node plan (MPI) would have saved
                from solar.layout.summary import human_bytes
                from solar.schedule.make import predicted_storage
                node = predicted_storage(layout, world_size=g.size, local_batch=args.local_batch or 32,
                                         epochs=args.epochs or 5, buffer_fraction=args.buffer_fraction, seed=args.seed,
                                         ranks_per_node=found)
                if node is not None:
                    line += (f"; predicted storage reads: {human_bytes(mine)} per-rank, {human_bytes(node)} as a "
                             f"node plan")
            if line:
                print(f"solar: {line}", flush=True)
        return path

    return on_root(g, work)


def _misfit(c, args, nodes=None, place: str = "host") -> Optional[str]:
    """Why a schedule's config (node map, buffer place) does not fit the job (None: it fits)."""
    wrong = []
    if getattr(args, "device_buffer", None) is not None and place != "device":
        wrong.append("a buffer in host memory (job: --device-buffer)")
    L = nodes.ranks_per_node if nodes is not None else None
    given = getattr(args, "ranks_per_node", None)
    if given is not None and (given if given > 1 else None) != (L if L and L > 1 else None):
        wrong.append(f"{L or 'no'} ranks per node (job: {getattr(args, 'ranks_per_node', None) or 'none'})")
    if args.local_batch is not None and c.local_batch != args.local_batch:
        wrong.append(f"local batch {c.local_batch} (job: {args.local_batch})")
    if c.seed != args.seed:
        wrong.append(f"seed {c.seed} (job: {args.seed})")
    if args.epochs is not None and c.epochs < args.epochs:
        wrong.append(f"{c.epochs} epochs (job: {args.epochs})")
    return "planned for " + ", ".join(wrong) if wrong else None


def atomic_save(obj, path: str):
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)  # no half-written checkpoint left behind
        raise


# ----------------------------------------------------------------------------- held-out
class HeldOut:
    """This rank's share of the first ``--valid-samples`` held-out samples, evaluated in batches."""

    def __init__(self, path: str, split: Optional[str], g: Group, limit: int, batch: int):
        self.read, n, self.dataset = sample_reader(path, split)
        self.fields = tuple(getattr(self.dataset, "fields", None) or self.dataset.samples.fields)
        self.n = min(n, limit)
        self.ids = np.arange(self.n, dtype=np.int64)[g.rank::g.size]
        self.batch, self.g = batch, g

    def evaluate(self, per_sample: Callable[[dict], Dict[str, Dict[str, torch.Tensor]]]) -> Dict[str, dict]:
        """``{predictor: {part: mean loss over the held-out samples}}``, summed over ranks."""
        sums: Dict[str, Dict[str, float]] = {}
        for part in chunks(self.ids, self.batch):
            batch = self.read(part)
            batch["index"] = torch.from_numpy(part)
            for who, parts in per_sample(batch).items():
                acc = sums.setdefault(who, {})
                for k, v in parts.items():
                    acc[k] = acc.get(k, 0.0) + float(v.double().sum())
        keys = sorted((w, k) for w, parts in sums.items() for k in parts)
        keys = self.g.bcast(keys)
        tot = self.g.allreduce([sums.get(w, {}).get(k, 0.0) for w, k in keys])
        out: Dict[str, dict] = {}
        for (w, k), v in zip(keys, tot):
            out.setdefault(w, {})[k] = float(v) / self.n
        for parts in out.values():
            parts["total"] = sum(parts.values())
        return out

    def close(self):
        self.dataset.close()


# ----------------------------------------------------------------------------- plot
def plot(path: str, title: str, epochs: List[dict], step_losses: List[Tuple[int, float]], steps_per_epoch: int,
         before: Optional[dict] = None):
    """Training loss per step and per epoch, held-out loss per epoch (and ``before`` training, at 0), the
    reference predictors' held-out loss."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if step_losses:
        s, v = zip(*step_losses)
        ax.plot(np.asarray(s) / steps_per_epoch, v, color="0.75", lw=0.8, label="training loss per step")
    ends = [(e["epoch"] * steps_per_epoch + e["first_step"] % steps_per_epoch + e["steps"]) / steps_per_epoch
            for e in epochs]
    ax.plot(ends, [e["loss"] for e in epochs], "o-", color="C0", label="training loss (epoch mean)")
    held = [(0.0, before["model"]["total"])] if before else []
    held += [(x, e["valid"]["model"]["total"]) for x, e in zip(ends, epochs) if "valid" in e]
    if held:
        ax.plot(*zip(*held), "s-", color="C1", label="held-out loss")
        for k, (who, parts) in enumerate(sorted(epochs[-1]["valid"].items())):
            if who != "model":
                ax.axhline(parts["total"], color=f"C{k + 2}", ls="--", label=f"held-out: {who} predictor")
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- training
def describe_valid(v: Dict[str, dict]) -> str:
    """``held-out 0.812 (constant 2.110, ...)``."""
    refs = ", ".join(f"{w} {p['total']:.4f}" for w, p in sorted(v.items()) if w != "model")
    return f"held-out {v['model']['total']:.4f} ({refs})"


def epoch_record(e, first_step, steps, tot, mx, parts, g: Group) -> dict:
    """The epoch's summary over ranks: ``tot`` sums (loss, samples, stall, hits, misses, seconds, *parts)."""
    n = max(tot[1], 1)
    rec = dict(epoch=e, steps=steps, first_step=first_step, loss=tot[0] / n, samples=int(tot[1]), seconds=mx[0],
               samples_per_s=tot[1] / mx[0] if mx[0] > 0 else 0.0, stall_s_max=mx[1], stall_s_mean=tot[2] / g.size,
               parts={k: tot[6 + i] / n for i, k in enumerate(parts)})
    if tot[3] + tot[4]:
        rec["buffer_hit_rate"] = tot[3] / (tot[3] + tot[4])
    return rec


def check_fields(task: Task, data: str, held: Optional[HeldOut], held_name: str):
    """A SolarError naming the data and the fields the task needs that it lacks."""
    from solar.layout import load_layout
    train = load_layout(data)
    for name, have in ((data, train.field_names), (held_name, held.fields if held else None)):
        missing = [f for f in task.fields if have is not None and f not in have]
        if missing:
            fail(f"{name} has no field(s) {', '.join(missing)} (it has {', '.join(have)})")
    if held is not None and os.path.exists(held_name):  # --valid: another dataset, its samples must fit the model
        valid = load_layout(held_name)
        for f in task.fields:
            a = (train.field_shapes().get(f), train.field_dtypes().get(f))
            b = (valid.field_shapes().get(f), valid.field_dtypes().get(f))
            if a != b:
                fail(f"field {f} of {held_name} is {b[0]} {b[1]} per sample, of {data} {a[0]} {a[1]}")


def quiet_grad_strides():
    """A 1-channel conv's weight gradient comes back in an equivalent layout with other strides; DDP's
    warning about it is about speed only (the values are the same): not shown."""
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")


def train(args, task: Task, g: Group, device: torch.device, threads: int, topo):
    cuda = device.type == "cuda"
    quiet_grad_strides()
    root = g.rank == 0
    precision = stepping.precision_from_args(args, device)
    stepping.configure(precision, device)
    task.memory_format = precision.memory_format
    on_device = cuda and task.device_batches  # the loader puts batches on the GPU ahead of use

    def say(*a):
        if root:
            print(*a, flush=True)

    # ------------------------------------------------------------- data
    if args.loader == "solar":
        plan_path = ensure_plan(args, g)
        source = SolarSource(plan_path, args.data, g.rank, pin_memory=cuda, device=device if on_device else None,
                             cpus=args.loader_cpus, process=args.loader_process)
        if args.local_batch and args.local_batch != source.local_batch:
            fail(f"{plan_path} has local batch {source.local_batch}, not {args.local_batch}")
        epochs = args.epochs or source.epochs
        if epochs > source.epochs:
            fail(f"{plan_path} has {source.epochs} epochs, the job wants {epochs}; plan more (--replan)")
        how = f"schedule {plan_path}, reader {source.loader.reader_name}, {source.loader.cpus} assembly cpu(s)"
    elif args.loader == "baseline":
        plan_path = None
        source = BaselineSource(args.data, g, args.local_batch or 32, args.seed, args.workers, pin_memory=cuda,
                                device=device if on_device else None)
        epochs = args.epochs or 5
        how = f"DataLoader, {args.workers} worker(s), h5py {source.read_kind}"
    else:
        plan_path = None
        source = ResidentSource(args.data, g, args.local_batch or 32, args.seed, device, on_device)
        epochs = args.epochs or 5
        how = "one batch resident on the device, fed at every step"
    S = source.steps_per_epoch
    max_steps = min(args.max_steps or epochs * S, epochs * S)
    held = HeldOut(args.valid or args.data, args.valid_split, g, args.valid_samples, source.local_batch) \
        if args.valid or args.valid_split else None
    held_name = args.valid or f"split {args.valid_split} of {args.data}"
    task.configure(args)
    check_fields(task, args.data, held, held_name if held else "")

    # ------------------------------------------------------------- model
    ck = None
    if args.resume:
        if not os.path.exists(args.checkpoint):
            fail(f"--resume: no checkpoint {args.checkpoint}")
        try:
            ck = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001 - truncated, not a torch file, a folder...
            fail(f"--resume: cannot read checkpoint {args.checkpoint}: {type(exc).__name__}: "
                 f"{str(exc).splitlines()[0] if str(exc) else ''}")
        keys = ("loader_kind", "stats", "model", "optimizer", "loader", "step")
        if not isinstance(ck, dict) or any(k not in ck for k in keys):
            fail(f"--resume: {args.checkpoint} is not a checkpoint of this trainer (it needs the keys "
                 f"{', '.join(keys)})")
        if ck.get("task", task.name) != task.name:  # checkpoints from before 2026-11-23 do not say
            fail(f"--resume: {args.checkpoint} was written by {ck['task']}, not {task.name}")
        if not isinstance(ck["stats"], dict) or (task.stats_per_field and any(f not in ck["stats"]
                                                                              for f in task.fields)):
            fail(f"--resume: {args.checkpoint} holds statistics of other fields than {', '.join(task.fields)} "
                 f"(another task's checkpoint?)")
        if ck["loader_kind"] != source.kind:
            fail(f"checkpoint was written with --loader {ck['loader_kind']}, not {source.kind}")
        task.stats = ck["stats"]
    else:
        t = time.perf_counter()
        where = task.setup(args, g)
        say(f"normalisation statistics: {where} ({time.perf_counter() - t:.1f} s)")
    torch.manual_seed(args.seed)
    model = task.model(args).to(device, memory_format=precision.memory_format)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    step = 0
    if ck is not None:
        try:
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            fail(f"--resume: {args.checkpoint} does not fit this model: {str(exc).splitlines()[0]}")
        source.restore(ck["loader"])
        step = int(ck["step"])
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    net = torch.compile(ddp) if precision.compile else ddp
    n_params = sum(p.numel() for p in model.parameters())
    say(f"{task.name}: {g.size} ranks on {topo.nodes} node(s) ({topo.source or 'one process'}), "
        f"{dist.get_backend()}, device {device}, {threads} torch thread(s) per rank; "
        f"model {n_params / 1e6:.3f} M parameters; {precision.describe()}")
    say(f"loader {source.kind} ({how}): {S} steps per epoch of local batch {source.local_batch}, {epochs} epochs, "
        f"stop after step {max_steps}" + (f"; held-out: {held.n} samples of {held_name}" if held else ""))

    def save(epoch):
        if args.checkpoint and root:
            atomic_save(dict(model=model.state_dict(), optimizer=opt.state_dict(), loader=source.state(),
                             loader_kind=source.kind, step=step, epoch=epoch, stats=task.stats, args=vars(args),
                             task=task.name),
                        args.checkpoint)
        g.barrier()

    def evaluate() -> Optional[dict]:
        if held is None:
            return None
        model.eval()
        with torch.no_grad():
            v = held.evaluate(lambda b: {"model": task.losses(model, b, device, "held-out"),
                                         **task.references(b, "held-out")})
        model.train()
        return v

    log = open(args.log_json, "w" if not args.resume else "a") if args.log_json and root else None
    mine = dict(steps=0, samples=0, distinct=set(), loss=float("nan"))
    resumed_at = step if args.resume else None
    if args.resume:
        say(f"resumed from {args.checkpoint} at step {step} (epoch {step // S}, step {step % S} of {S})")
    v0 = None
    if held is not None and step == 0:
        v0 = evaluate()
        say(f"before training: {describe_valid(v0)}")
        if log:
            log.write(json.dumps(dict(epoch=-1, valid=v0)) + "\n")
    history: List[dict] = []
    step_losses: List[Tuple[int, float]] = []
    parts: Tuple[str, ...] = ()
    pending = stepping.StepLosses(args.log_every)  # per-step loss sums, on the device until read back
    try:
        for e in range(step // S, epochs):
            if step >= max_steps:
                break
            first_step = step
            sums = np.zeros(0)
            stall = 0.0

            def drain():
                """Read the pending steps' losses back to the host (one wait for the device), reduce them
                over ranks in one collective, log them.  Every rank drains at the same steps."""
                nonlocal sums
                rows = pending.flush()
                if not rows:
                    return
                vals = np.stack([r[3] for r in rows])
                sums = vals.sum(0) if not sums.size else sums + vals.sum(0)
                k = len(rows)
                both = g.allreduce(np.concatenate([vals[:, 0], [r[2] for r in rows]]))
                for (s_, _, _, _), tot, cnt in zip(rows, both[:k], both[k:]):
                    step_losses.append((s_ + 1, float(tot / cnt)))
                if args.log_json:
                    ids = g.allgather([[int(i) for i in r[1]] for r in rows])  # per rank: per step
                    if log:
                        for j, (s_, _, _, _) in enumerate(rows):
                            log.write(json.dumps(dict(step=s_, epoch=e, index=[x[j] for x in ids],
                                                      loss=float(both[j] / both[k + j]))) + "\n")

            g.barrier()
            t0 = time.perf_counter()
            it = source.batches(e)
            n_e = 0
            while step < max_steps:
                t = time.perf_counter()
                item = next(it, None)
                stall += time.perf_counter() - t
                if item is None:
                    break
                delivered, batch, weight = item  # sample ids in the loader's order (logged as such)
                batch, ids = sorted_batch(batch, delivered)
                batch.setdefault("index", torch.from_numpy(ids))  # the baseline's batches hold fields only
                parts, sums_dev = stepping.train_step(task, net, opt, batch, device, weight, precision)
                pending.add(step, delivered, len(ids), sums_dev)
                n_e += len(ids)
                mine["distinct"].update(int(i) for i in ids)
                if step == resumed_at:
                    ids0 = g.allgather([int(i) for i in delivered])
                    say(f"first batch after resume (step {step}): " +
                        "; ".join(f"rank {r}: {x}" for r, x in enumerate(ids0)))
                step += 1
                if pending.due:
                    drain()
                if args.checkpoint_every and step % args.checkpoint_every == 0 and step < max_steps:
                    drain()
                    save(e)
            drain()
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            it.close()
            extra = source.epoch_stats()
            if not sums.size:
                sums = np.zeros(1 + len(parts))
            tot = g.allreduce([sums[0], n_e, stall, extra.get("hits", 0), extra.get("misses", 0), seconds,
                               *sums[1:]])
            per_rank = g.allgather((seconds, stall))
            mx = [max(r[0] for r in per_rank), max(r[1] for r in per_rank)]
            steps = step - first_step
            rec = epoch_record(e, first_step, steps, tot, mx, parts, g)
            v = evaluate()
            if v is not None:
                rec["valid"] = v
            part = "" if steps == S else f" (steps {first_step % S}..{first_step % S + steps - 1} of {S})"
            say(f"epoch {e}{part}: loss {rec['loss']:.4f} ("
                + ", ".join(f"{k} {x:.4f}" for k, x in rec["parts"].items()) + ")"
                + (f"  {describe_valid(v)}" if v else "")
                + f"  {rec['samples_per_s']:.1f} samples/s  {rec['seconds']:.1f} s  loader stall "
                f"{rec['stall_s_max']:.2f} s (max over ranks), {rec['stall_s_mean']:.2f} s (mean)"
                + (f"  buffer hits {rec['buffer_hit_rate']:.1%}" if "buffer_hit_rate" in rec else ""))
            history.append(rec)
            if log:
                log.write(json.dumps(rec) + "\n")
                log.flush()
            mine["steps"] += steps
            mine["samples"] += n_e
            mine["loss"] = sums[0] / max(n_e, 1)
            save(e)
        # one write with its newline (print writes the line and its end apart: under PYTHONUNBUFFERED two ranks'
        # lines could run together in mpiexec's output)
        print(f"rank {g.rank} of {g.size} on {socket.gethostname()} ({device}): trained {mine['steps']} steps on "
              f"{mine['samples']} samples ({len(mine['distinct'])} distinct), local loss {mine['loss']:.4f} "
              "in its last epoch\n", end="", flush=True)
        g.barrier()
        if args.plot and root and history:
            plot(args.plot, f"{task.name}, loader {source.kind}, {g.size} ranks", history, step_losses, S, v0)
            say(f"loss plot: {args.plot}")
        say(f"done: {step} steps")
    finally:
        if log:
            log.close()
    source.close()
    if held is not None:
        held.close()


def end_process(status: int):
    """Leave the process with ``status`` once ``main`` is done, without the interpreter's finalization.

    DDP keeps references to the gloo process group that ``destroy_process_group`` does not drop, so
    gloo's worker threads outlive ``main``.  One of them may still be releasing its last collective
    (``all_gather_object`` tensors whose Python objects it owns) when the interpreter shuts down: it
    then needs the GIL, Python ends the thread, and the unwind aborts the process ("terminate called
    without an active exception", about 1 run in 25 here), failing a job that finished.  So: flush,
    finalize MPI where mpi4py started it (as its exit hook would), and ``os._exit``."""
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(status)


def main(task: Task, doc: str, argv=None) -> int:
    """Parse, join the job (``torch.distributed``), train; a SolarError ends this rank with one line, status 2."""
    from solar.errors import SolarError
    args = parse_args(task, doc, argv)
    rank = "?"
    try:
        from solar.torch import init_distributed
        cuda = torch.cuda.is_available() and not args.cpu
        # with CUDA: NCCL for the model's gradients, gloo for the CPU tensors the loop reduces (one group)
        topo = init_distributed(backend=None if cuda else "gloo")
        rank = topo.rank
        device = torch.device(topo.device(cuda, torch.cuda.device_count()))
        from solar.topology import cpus_of_this_rank
        threads, args.loader_cpus = split_cores(cpus_of_this_rank(topo), cuda, args.threads, args.loader_cpus)
        torch.set_num_threads(threads)
        train(args, task, Group(), device, threads, topo)
        dist.destroy_process_group()
    except SolarError as exc:
        # the other ranks see this rank's sockets close and fail in their next collective
        print(f"{task.name}: error on rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0
