"""``SolarLoader``: the PyTorch side.  Iterates a rank's local batches as the schedule says,
through the buffer manager, with the readers doing the I/O.

    loader = SolarLoader("plan.h5", "data/ptychonn", comm=MPI.COMM_WORLD)
    # loader.load_state_dict(checkpoint["loader"])    # to resume: the loop below then goes on
    for epoch in loader.epoch_range():    # from the exact next step (open-ended: endless)
        loader.set_epoch(epoch)
        for batch in loader:              # {field: tensor (n, ...), "index": ids, "weight": float}
            loss = (criterion(model(batch["diffraction"]), ...) * batch["weight"])
"""
from __future__ import annotations

import itertools
import numbers
import os
import time
import weakref
from typing import Callable, Optional, Sequence, TYPE_CHECKING, Union

import numpy as np

from ..buffer import BufferManager, rank_memory
from ..errors import SolarError, SpecError
from ..memory import DEFAULT_IO_DEPTH, DEFAULT_PREFETCH, batch_bytes, live_batches, max_local_batch
from ..mpi import agree
from ..schedule import Schedule, ScheduleError
from ..scheduler.config import check_state_epoch
from .assemble import BatchAssembler
from .extend import WindowPlanner
from .gil import DEFAULT_SWITCH_INTERVAL, check_interval, lower
from .hooks import BatchHooks, EpochLog, bind_layout

if TYPE_CHECKING:  # annotations only
    import torch

    from ..layout import Layout


class SolarLoader:
    """Local batches of one rank, epoch after epoch, as planned.

    ``schedule``: path or :class:`Schedule`; ``data``: layout spec path or
    :class:`~solar.layout.Layout` (default: the path the schedule was planned
    from).  ``comm``: mpi4py communicator (its size must equal the schedule's
    world size; its rank picks the slice) or None with ``rank=``; neither: the rank of an
    initialised ``torch.distributed``, else of the launcher (torchrun, MPI, SLURM variables).
    ``reader``: a name from :data:`solar.io.READERS` (default: chosen per
    layout and file system).  Each batch has ``weight`` = n_r * P / n_step: multiply
    the rank's mean loss by it and DDP's gradient average is the exact mean over
    the global batch even when ranks get unequal counts (epsilon > 0); it is 1.0
    otherwise.  ``epoch_fence``: do not prefetch an epoch before iteration over it
    begins (benchmarks: no read-ahead across a page-cache drop).

    Start-up: a schedule of format version 3 stores the layout, so without ``data`` no rank reads
    HDF5 metadata and a rank opens only the files it reads.  ``verify_data`` says how the data is
    checked against the plan: ``"fast"`` (default: every file's size and mtime as planned, one
    ``stat`` per file), ``"strict"`` (also the block map rebuilt from the HDF5 metadata and its
    fingerprint compared), ``"off"``; with ``comm`` one rank checks (``verify_scope="job"``: rank 0;
    ``"node"``: local rank 0 of each node, for node-local copies) and a mismatch raises the same
    ScheduleError on every rank; without, each process checks.  An explicit ``data`` (or a schedule
    of format 1 or 2) is built from the HDF5 metadata on every rank and matched by fingerprint.

    ``abort_on_error`` (default True): when ``comm`` has more than one rank, an
    exception that escapes on this rank while the loader is open (from solar or
    from the training code; main thread or a solar thread) prints
    ``solar: error on rank R: <cause>`` and calls ``comm.Abort(1)``, so every rank
    ends instead of waiting in a collective forever (:mod:`solar.mpi` hooks,
    removed by :meth:`close`; leaving a ``with`` block on an exception aborts
    too).  ``abort_on_error=False`` leaves the error handling to the caller.

    Hooks (all run in the buffer's prefetch thread, off the training thread; an exception in a
    transform reaches the training loop as :class:`~solar.loader.hooks.TransformError` naming the
    step, with the original as its ``__cause__``): ``fields``: assemble only these fields (the
    plan's blocks of the others are still read and held: plan with ``fields=`` to skip them);
    ``sample_transform(sample) -> dict`` on each sample's ``{field: value}``, results stacked;
    ``transform(batch) -> dict`` on the batch (``index`` included, ``weight`` added after);
    ``device``: the batch is copied there on a side CUDA stream through reused pinned staging
    buffers as soon as it is assembled (:class:`solar.torch.device.DeviceMover`); the training
    stream waits for the copy when the batch is handed out.  At the end of each epoch one INFO
    line (hit rate, samples/s, stall) goes to ``logging.getLogger("solar.loader")``;
    ``loader.epoch_log.last`` holds its numbers.

    ``buffer_device``: the buffer's pools on that torch device (``"cuda"``: GPU memory; the plan's budget is
    then the device's; ``"cuda"`` by default for a plan made with ``solar plan --device-buffer``, where a
    ``device="cuda"`` is dropped), :mod:`solar.buffer.device_pools`: each miss is read into host staging and
    crosses to the device once, decoded; a batch is gathered on the device from the resident blocks, so a hit
    costs device memory bandwidth instead of a host copy and a PCIe transfer.  The batches are bit for bit the
    host path's, their ``index`` on the host.  Per-rank plans only (not node plans), without ``transform``,
    ``sample_transform`` or ``device`` (the batches are on ``buffer_device`` already).

    ``cpus``: the cores the loader may keep busy for batch assembly (default: this rank's share, its CPU
    affinity divided by the ranks on its node, :func:`solar.topology.cpus_of_this_rank`).  With more than one,
    a step's batch is assembled in a thread of its own while the prefetch thread books and reads the next
    steps (:class:`~solar.buffer.BufferManager`'s ``overlap``), and large batches are split into runs of rows
    gathered on ``cpus`` threads at once.  ``threads`` stays
    the reader's I/O depth (requests in flight: the ``pread`` reader's threads, or, with its native AIO, the
    reads in flight of each step's read call).  ``switch_interval`` (seconds, default
    :data:`~solar.loader.gil.DEFAULT_SWITCH_INTERVAL`, 0.5 ms; None or 0: leave Python's 5 ms): while the
    loader's threads run, the interpreter's GIL switch interval is at most this, so a training thread busy
    in Python hands the GIL to solar's threads sooner (:mod:`solar.loader.gil`; process-wide, restored by
    :meth:`close`).

    ``process=True``: the buffer, the reader and batch assembly run in a loader process of their own
    (:mod:`solar.loader.process`), so that their threads never take the GIL from the training thread (measured:
    a step's Python took 1.5-2.8x as long beside the in-process loader, ``benchmarks/training_thread.py``).  Batches
    come through shared memory, bit for bit the in-process loader's, with the same memory, resume and
    errors; transforms and the ``device`` copy run in the training process.  Not with node plans,
    ``buffer_device``, ``pin_memory`` or the ``mpiio`` reader (a SpecError says so); ``comm`` stays in the training process
    (its checks and abort guard), the loader process reads on its own.  Start-up takes about a second more.

    Resuming: after :meth:`load_state_dict` the cursor is inside epoch
    ``loader.epoch``; ``set_epoch(loader.epoch)`` keeps it, so the loop
    ``for e in loader.epoch_range(): loader.set_epoch(e); for b in loader``
    yields exactly the steps an uninterrupted run had left.

    Open-ended schedules (``solar plan --epochs auto --window K``): ``loader.epochs`` is None and
    :meth:`epoch_range` is ``itertools.count(loader.epoch)`` (the training loop breaks out when it is
    done, e.g. when the validation loss stops improving).  The file holds window 0 (epochs 0..K-1);
    when the loader starts window w it plans window w+1 in a background thread
    (:class:`~solar.loader.extend.WindowPlanner`: the same deterministic planner on every rank, no
    file, no communication), so the loop waits only if planning a window takes longer than training
    one (logged once on ``logging.getLogger("solar")``).  At a window edge the buffer is restarted:
    the new one first reads the blocks the plan holds resident there (at most the buffer budget,
    once per window; not counted as the epoch's misses), then follows the new window's plan.
    ``load_state_dict`` accepts a step in any window (the windows before it are planned first).

    Node plans (``solar plan --ranks-per-node L``, format version 6): the L ranks of each planned node share
    one buffer in an MPI shared-memory window and nodes send each other blocks as planned
    (:class:`~solar.buffer.node_manager.NodeBufferManager`).  ``comm`` is required (more than one rank), the
    ranks of a planned node must share memory (checked: launch L ranks per node in block order), and
    starting or stopping the buffer is collective: every rank iterates, seeks (``set_epoch`` to another
    epoch, ``load_state_dict``) and closes at the same points, as a DDP loop does.  :meth:`stats` adds the
    transfer counts.  An open-ended node plan goes on as above: every rank plans every node's next window
    (:class:`~solar.loader.node_windows.NodeWindowPlanner`) and at a window edge the node buffers restart
    together, each pool first reading what its plan holds there.  A node plan of a resumed job (format
    version 7) starts at its resume step with empty pools.
    """

    def __init__(self, schedule: Union[str, Schedule], data: Union[str, "Layout", None] = None, *, comm=None,
                 rank: Optional[int] = None, reader: Optional[str] = None, threads: int = 16, prefetch: int = DEFAULT_PREFETCH,
                 pin_memory: bool = False, as_torch: bool = True, verify: bool = True,
                 reader_options: Optional[dict] = None, epoch_fence: bool = False, abort_on_error: bool = True,
                 fields: Optional[Sequence[str]] = None, transform: Optional[Callable[[dict], dict]] = None,
                 sample_transform: Optional[Callable[[dict], dict]] = None,
                 device: Union[str, "torch.device", None] = None,
                 verify_data: str = "fast", verify_scope: str = "job", cpus: Optional[int] = None,
                 buffer_device: Union[str, "torch.device", None] = None,
                 switch_interval: Optional[float] = DEFAULT_SWITCH_INTERVAL, process: bool = False) -> None:
        from ..io import READERS, default_reader_name, get_reader
        from ..schedule.verify import check_mode
        if not isinstance(abort_on_error, bool):
            raise SpecError(f"abort_on_error must be True or False, got {abort_on_error!r}")
        if not isinstance(process, bool):
            raise SpecError(f"process must be True or False, got {process!r}")
        self.process = process
        self._proc = None
        self.switch_interval = check_interval(switch_interval)
        self._gil_release = None
        self._guard = _install_guard(self, comm) if abort_on_error else None
        check_mode(verify_data, verify_scope)
        self.comm = comm
        # Start-up alternates steps each rank runs on its own, which may fail on some ranks only (a file
        # missing on one node, one rank's plan over the memory limit), with collectives (the data check, an
        # MPI reader's opens): after each local part every rank learns whether any failed (mpi.agree) and
        # all raise together, so none is left waiting in a collective the failed rank never reaches.
        err, stored = None, False
        try:
            self.schedule = schedule if isinstance(schedule, Schedule) else Schedule.load(schedule)
            world = comm.Get_size() if comm is not None else self.schedule.world_size
            self.rank = _check_rank(rank, comm, world)
            self.schedule.check(world_size=world)
            self.layout, stored = _read_layout(self.schedule, data)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
            err = exc
        agree(comm, err)
        if comm is not None and comm.Get_size() > 1:  # every rank on the same plan before collectives that follow it
            heads = comm.allgather(self.schedule.header_sha256)
            if any(h != heads[0] for h in heads):
                bad = next(r for r, h in enumerate(heads) if h != heads[0])
                raise ScheduleError(f"rank {bad} opened another schedule than rank 0 (header {heads[bad][:12]} vs "
                                    f"{heads[0][:12]}): every rank must run the same plan")
        if stored:  # the stored layout against the files: one rank of comm checks, every rank gets the verdict
            from ..schedule.verify import verify_data as verify
            verify(self.schedule, self.layout, verify_data, comm, verify_scope)
        self.nodes = self.schedule.nodes  # a node plan (format version 6): the ranks of a node share a buffer
        if self.nodes is not None:
            from .nodes import check_node_placement
            check_node_placement(self.nodes, comm, self.schedule.path)  # collective; raises on every rank
        try:
            self.schedule.check(layout=self.layout)
            self.demand = self.schedule.demand()
            if self.nodes is not None and self.schedule.extent_runs:  # one rank reads a run for the node
                self.demand = dict(self.demand, block_run=self.schedule.block_extent())
            # this rank's memory (solar.memory), checked against what the plan was made for before any
            # file is opened (whether it fits does not depend on the reader: reads in flight get what is left)
            self.batch_bytes = batch_bytes(self.layout, max_local_batch(self.schedule.config))
            if self.nodes is None:
                self.rank_plan = self.schedule.rank(self.rank)
                self.memory = rank_memory(self.rank_plan, self.demand, budget=self.schedule.memory_budget,
                                          batch_bytes=self.batch_bytes, prefetch=prefetch, io_depth=DEFAULT_IO_DEPTH)[0]
            else:
                from .nodes import node_rank_memory
                self.rank_plan = self.schedule.node_plan(self.rank)
                self.memory = node_rank_memory(self.rank_plan, self.demand, self.schedule.memory_budget,
                                               self.batch_bytes, prefetch)
            if buffer_device is None and self.schedule.buffer_place == "device":  # solar plan --device-buffer
                buffer_device = _planned_device(self.schedule)
                asked = _as_device(device)
                if asked is not None and asked.type == "cuda":
                    # asked for the GPU: the planned buffer's batches are made there already; a GPU named by
                    # its index (device="cuda:1") is where the buffer goes
                    if asked.index is not None:
                        buffer_device = device
                    device = None
            self.buffer_device = _check_buffer_device(buffer_device, self.nodes, as_torch, device, transform,
                                                      sample_transform)
            if process:
                _check_process(self.schedule, self.nodes, self.buffer_device, reader, pin_memory)
            if cpus is None:  # the rank's share of the cores it may run on (affinity / ranks on the node)
                from ..topology import cpus_of_this_rank
                cpus = cpus_of_this_rank()
            self.cpus = cpus
            self.assembler = BatchAssembler(self.layout, pin_memory=pin_memory, fields=fields, cpus=cpus)
            if self.buffer_device is not None and not self.assembler.gather:
                raise SpecError(f"buffer_device={buffer_device!r}: batches of this layout cannot be gathered on a "
                                f"device ({self.assembler.tables.why}); leave the buffer in process memory")
            self.hooks = BatchHooks(transform, sample_transform, device, as_torch, to_torch=self._to_torch)
            bind_layout(self.layout, transform, sample_transform)
            self.reader_name = reader or default_reader_name(self.layout, None if process else comm)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
            err = exc
        agree(comm, err)
        if reader is None and comm is not None and comm.Get_size() > 1 and not process:  # one reader for all
            self.reader_name = comm.bcast(self.reader_name, root=0)
        reader_options = dict(reader_options or {})
        if self.nodes is not None and self.reader_name == "mpiio":  # a node's ranks each read a part of a step
            reader_options.setdefault("collective", False)
        if self.schedule.extent_runs and "max_gap" in getattr(READERS.get(self.reader_name), "OPTIONS", {}):
            # a plan that reads runs of neighbours: a neighbour it did not keep, between two it kept, would be
            # read as a gap (measured: 1.95x the plan's bytes with 16 KiB blocks); read exactly the plan
            reader_options.setdefault("max_gap", 0)
        if process:  # the buffer, reader and assembly in a process of their own (solar.loader.process)
            self.reader = None
            try:
                from .process import LoaderProcess
                # one assembled batch fewer waiting there, one received ahead here (none with prefetch=1): as many
                # batches alive as in-process (solar.loader.process)
                child = dict(schedule=os.path.abspath(self.schedule.path), data=self.layout, rank=self.rank,
                             reader=self.reader_name, threads=threads, prefetch=max(1, prefetch - 1), as_torch=False,
                             verify=verify, reader_options=reader_options, epoch_fence=epoch_fence,
                             abort_on_error=False, fields=fields, verify_data="off", cpus=self.cpus,
                             switch_interval=switch_interval, header_sha256=self.schedule.header_sha256,
                             keep_segments=live_batches(prefetch), memory_prefetch=prefetch)
                self._proc = LoaderProcess(child, self.hooks.produce, self.rank)
            except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
                err = exc
            agree(comm, err)
            self._proc_close = weakref.finalize(self, self._proc.close)  # a loader never closed: at exit
        else:
            self.reader = get_reader(self.reader_name, self.layout, comm=comm, threads=threads,
                                     **reader_options)  # last: nothing after it can fail
        self.epoch_log = EpochLog(self.rank)
        self.prefetch, self.as_torch, self.verify, self.epoch_fence = prefetch, as_torch, verify, epoch_fence
        #: the prefetch the buffer's pools are sized for (None: ``prefetch``): a loader process's child runs one batch
        #: fewer waiting and sizes them for the training process's (:mod:`solar.loader.child`)
        self._memory_prefetch = None
        if as_torch:  # now, not at the first batch: importing torch holds the GIL ~1.5 s, which the reader
            import torch  # noqa: F401  threads would wait out in epoch 0 (measured: 1,900 against 6,200 samples/s)
        if self._proc is not None:  # the loader process started meanwhile (its imports beside torch's)
            err = None
            try:
                self._proc.wait_ready()
            except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
                err = exc
            if err is not None:
                self._proc_close()
            agree(comm, err)
        self.S = self.schedule.steps_per_epoch
        self.open_ended = self.schedule.open_ended
        self.epochs: Optional[int] = None if self.open_ended else self.schedule.epochs  # None: no last epoch
        self.windows = _window_planner(self.schedule, self.rank, self.rank_plan) \
            if self.open_ended and not process else None  # (a loader process plans its own windows)
        self.cursor = self.schedule.start_step  # next global step (a resumed job's steps before its start are empty)
        self.buffer: Optional[BufferManager] = None
        self._step_total = None  # global batch size per step, read lazily (see _weight)

    @property
    def process_pid(self) -> Optional[int]:
        """The process id of the loader process (``process=True``), else None."""
        return self._proc.proc.pid if self._proc is not None else None

    # ------------------------------------------------------------- epochs
    def __len__(self) -> int:
        return self.S

    @property
    def epoch(self) -> int:
        return self.cursor // self.S

    def epoch_range(self):
        """The epoch positions left to train: ``range(loader.epoch, loader.epochs)``, or for an open-ended
        schedule ``itertools.count(loader.epoch)`` (endless: the training loop decides when to stop)."""
        return itertools.count(self.epoch) if self.open_ended else range(self.epoch, self.epochs)

    def set_epoch(self, e: int):
        """Position the loader in epoch position ``e``.

        A no-op when the cursor is already inside epoch ``e`` (at its start, or
        mid-epoch after :meth:`load_state_dict` or an interrupted iteration): the
        next ``for batch in loader`` goes on from the cursor.  Any other epoch:
        seek to its first step.
        """
        first = self.schedule.start_step // self.S  # 0, or the epoch a resumed job starts in
        if isinstance(e, bool) or not isinstance(e, numbers.Integral) or e < first or (
                not self.open_ended and e >= self.epochs):
            raise SpecError(f"epoch {e!r} out of range: the schedule has epochs "
                            + ("0, 1, ... (open-ended)" if self.open_ended else f"{first}..{self.epochs - 1}")
                            + (f" (it resumes a job at step {self.schedule.start_step})" if first else ""))
        if self.open_ended:  # windows up to epoch e are planned first: a bounded number of them
            check_state_epoch(int(e), self.schedule.config.seed)
        if self.cursor // self.S != e:
            self._seek(max(int(e) * self.S, self.schedule.start_step))

    def _seek(self, g: int):
        if g == self.cursor and (self.buffer is None or self.buffer._next_get == g):
            return
        self._stop_buffer()
        self.cursor = g

    def _batch(self, step, samples, lookup):
        """Step ``step``'s batch with its sample ids, before the hooks (with ``overlap``, in the buffer's assembly
        thread; the hooks run in its prefetch thread)."""
        out = self.assembler(step, samples, lookup)
        if self.buffer_device is not None:  # a DeviceBatch: handed over in __iter__, the ids on the host
            out.host["index"] = samples
            return out
        out["index"] = samples
        return out

    def _start_buffer(self):
        if self._proc is not None:  # the loader process starts its buffer at the cursor
            self.buffer = self._proc.start(self.cursor, 1 if self.prefetch >= 2 else 0)
            return
        if self._gil_release is None:  # solar's threads start now: the training thread hands the GIL over sooner
            # put back at close, or when a loader never closed is collected
            self._gil_release = weakref.finalize(self, lower(self.switch_interval))
        plan = self.rank_plan
        if self.open_ended:  # this window's plan (planned first if need be); the next one in the background
            w = self.cursor // (self.S * self.schedule.window)
            plan = self.windows.rank_plan(w)
            self.windows.prepare(w + 1)
        fence = self.S if self.epoch_fence else None
        # with more than one core, a step's batch is assembled beside the booking of the next steps
        overlap = self.cpus > 1 and self.buffer_device is None
        finish = (lambda g, samples, out: self.hooks.produce(g, out)) if self.hooks.active else None
        if self.buffer_device is None:  # its threads started before the buffer's (solar.threads)
            try:
                self.assembler.start()
            except RuntimeError:  # no thread could start: the first batch tries again and fails as any step would
                pass
        if self.nodes is not None:  # collective over comm: every rank starts its buffer at the same step
            from ..buffer.node_manager import NodeBufferManager
            self.buffer = NodeBufferManager(plan, self.rank, self.demand, self.reader, self._batch, comm=self.comm,
                                            budget=self.schedule.memory_budget, prefetch=self.prefetch,
                                            start=self.cursor, fence=fence, batch_bytes=self.batch_bytes,
                                            overlap=overlap, finish=finish)
            return
        self.buffer = BufferManager(plan, self.demand, self.reader, self._batch,
                                    budget=self.schedule.memory_budget, prefetch=self.prefetch, start=self.cursor,
                                    verify=self.verify, fence=fence, batch_bytes=self.batch_bytes,
                                    place=self.buffer_device, staging_limit=self.schedule.host_staging_bytes,
                                    memory_prefetch=self._memory_prefetch, overlap=overlap, finish=finish)

    def prepare(self) -> float:
        """Build the buffer now, before the first batch: its pools allocated (a rank's own are faulted in by a
        thread of their own from here on, :class:`~solar.buffer.pool.Populator`), this rank's plan
        loaded, the prefetch thread started; returns the seconds it took.  With ``epoch_fence`` nothing is
        read before the first batch is asked for, so the first epoch's time is its reads (``solar bench``
        times start-up apart this way).  Iterating prepares when this was not called.  Collective over
        ``comm`` for node plans, as iterating is."""
        t0 = time.perf_counter()
        if self.buffer is None:
            if not self.open_ended and self.cursor >= self.schedule.n_steps:
                raise SolarError(f"the schedule's {self.epochs} epochs are used up; plan more epochs")
            if self.open_ended:
                check_state_epoch(self.cursor // self.S, self.schedule.config.seed, step=self.cursor)
            self._start_buffer()
        return time.perf_counter() - t0

    def _stop_buffer(self):
        buffer, self.buffer = self.buffer, None  # dropped even where its close raises (a CUDA error in the device
        if buffer is not None:                   # buffer's synchronize): a second close does not run it again
            buffer.close()

    def _restore_gil(self):
        if self._gil_release is not None:
            self._gil_release()
            self._gil_release = None

    def __iter__(self):
        """The remaining steps of the current epoch."""
        if self.buffer is not None and self.cursor >= self.buffer.stop:  # open-ended: at a window edge
            self._stop_buffer()
        self.prepare()
        end = (self.cursor // self.S + 1) * self.S
        self.buffer.release(self.cursor)
        self.epoch_log.begin(self.buffer.totals)
        while self.cursor < end:
            g = self.cursor
            item = self.buffer.get(g)
            out = item.hand_over() if self.buffer_device is not None else self.hooks.consume(item)
            self.cursor = g + 1
            out["weight"] = self._weight(g, len(out["index"]))
            yield self._to_torch(out) if self.as_torch else out
        self.epoch_log.end(end // self.S - 1, self.buffer.totals)  # after the epoch's last step was trained

    def _weight(self, g: int, n: int) -> float:
        if self.schedule.config.epsilon == 0:
            return 1.0
        if self._step_total is None:
            # global batch size of each step: the same on every rank (from the planned counts)
            from ..scheduler.sampler import batch_bounds, sampler_sizes
            _, total = sampler_sizes(self.schedule.n_samples, self.schedule.world_size,
                                     self.schedule.config.drop_last)
            self._step_total = np.diff(batch_bounds(total, self.schedule.world_size, self.schedule.local_batch))
        return float(n * self.schedule.world_size / self._step_total[g % self.S])

    @staticmethod
    def _to_torch(out: dict) -> dict:
        import torch
        from ..buffer.device_pools import OnDevice
        res = OnDevice() if isinstance(out, OnDevice) else {}  # (a device buffer's batch stays one)
        for k, v in out.items():
            if isinstance(v, np.ndarray):
                res[k] = torch.from_numpy(v)
            elif isinstance(v, list):  # samples of different shapes; a transform's list passes through
                res[k] = [torch.from_numpy(x) if isinstance(x, np.ndarray) else x for x in v]
            else:
                res[k] = v
        return res

    # --------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """Planner identity + cursor: enough to resume exactly where training stopped, on this schedule or,
        planned with ``solar plan --resume-from``, on another number of ranks with the same global batch."""
        return {"fingerprint": self.schedule.fingerprint, "world_size": self.schedule.world_size,
                "config": self.schedule.config.to_dict(), "policy": self.schedule.policy, "step": self.cursor,
                "open_ended": self.open_ended}

    def load_state_dict(self, state: dict):
        """Move the cursor to ``state["step"]``: a :meth:`state_dict` of a loader on the same schedule, or, when
        this schedule resumes a checkpointed job on other ranks (``solar plan --resume-from``), of that job's
        loaders (its step mapped to this job's, :func:`solar.scheduler.elastic.resume_point`).  Any other
        state is refused with one line (a different global batch names both sizes)."""
        from ..scheduler import elastic
        if not isinstance(state, dict):
            raise SpecError(f"a loader state must be a dict (from state_dict()), got {type(state).__name__}")
        missing = [k for k in elastic.STATE_KEYS if k not in state]
        if missing:
            raise SpecError(f"loader state lacks {', '.join(map(repr, missing))} (not from SolarLoader.state_dict()?)")
        g = state["step"]
        if isinstance(g, bool) or not isinstance(g, numbers.Integral):
            raise SpecError(f"loader state step must be an integer, got {g!r}")
        g = int(g)
        mine, old = self.state_dict(), self.schedule.resumed_from
        if old is not None and all(state[k] == old[k] for k in elastic.IDENTITY_KEYS):  # the checkpointed job's
            if g < old["step"]:
                raise elastic.ResumeError(
                    f"state is at step {g} of the job on {old['world_size']} ranks, before step {old['step']} where "
                    f"this schedule resumes it: plan the resume from this state (solar plan --resume-from)")
            c = old["config"]
            s = self.schedule
            g = elastic.resume_point(s.n_samples, c["world_size"], c["local_batch"], s.world_size, s.local_batch, g,
                                     s.config.drop_last).global_step
        elif any(state[k] != mine[k] for k in elastic.IDENTITY_KEYS):
            raise elastic.ResumeError(elastic.state_mismatch(state, mine))
        if not self.open_ended and not 0 <= g <= self.schedule.n_steps:
            raise SpecError(f"state step {g} outside the schedule's {self.schedule.n_steps} steps")
        if g < 0:
            raise SpecError(f"state step {g} is negative (an open-ended schedule has steps 0, 1, ...)")
        if self.open_ended:  # its windows are planned from epoch 0 up to the state's, in this thread
            check_state_epoch(g // self.S, self.schedule.config.seed, step=g)
        if g < self.schedule.start_step:
            raise SpecError(f"state step {g} is before step {self.schedule.start_step}, where this schedule resumes "
                            f"a job (its steps before are not planned)")
        self._seek(g)

    # --------------------------------------------------------------- stats
    def stats(self) -> dict:
        """This rank's running totals of the buffer it runs now (from its start: a seek restarts them).
        A node plan adds ``staged``, ``recv_blocks``/``recv_bytes`` and ``sent_blocks``/``sent_bytes``
        (transfers between nodes, counted on each node's local rank 0)."""
        t = self.buffer.totals if self.buffer is not None else None
        if t is None:
            return {}
        keys = ("steps", "samples", "hits", "hit_bytes", "misses", "bytes_loaded", "bytes_read", "stored_bytes",
                "n_reads", "read_s", "assemble_s", "stall_s", "plan_violations", "book_wait_s")
        if self.nodes is not None:
            from ..buffer.node_manager import NODE_KEYS
            keys += NODE_KEYS
        out = {k: getattr(t, k) for k in keys}
        # opens, evictions, max_open (solar.io.fdcache): a loader process's as of the last batch it sent
        out.update(self._proc.reader_stats if self._proc is not None else self.reader.open_stats())
        return out

    def close(self):
        """Stop the prefetch thread, close the reader (collective for MPI readers) and the schedule,
        and remove the abort hooks."""
        try:
            self._stop_buffer()
        finally:
            self._restore_gil()
            self.assembler.close()
            if self.windows is not None:
                self.windows.close()
            if self._proc is not None:
                self._proc_close()  # ends the loader process whatever _stop_buffer met
            else:
                self.reader.close()
            self.schedule.close()
            if self._guard is not None:
                self._guard()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and self._guard is not None and self._guard.alive:
            # no collective clean-up (an MPI reader's close) while the other ranks may wait elsewhere
            from ..mpi import report_and_abort
            if not (isinstance(exc, SystemExit) and not exc.code):
                report_and_abort(self.comm, exc)
        self.close()


def _check_process(schedule, nodes, buffer_device, reader, pin_memory=False) -> None:
    """SpecError where ``process=True`` cannot run this loader (yet)."""
    why = ("a schedule that is not in a file (the loader process opens it: write it with out=)"
           if not schedule.path or not os.path.isfile(schedule.path) else
           "a node plan (its ranks share pools through MPI: plan with --no-node-pool)" if nodes is not None else
           "buffer_device= (the device buffer stays in the training process)" if buffer_device is not None else
           "reader='mpiio' (MPI-IO needs the job's communicator)" if reader == "mpiio" else
           "pin_memory=True (batches come in shared memory, not pinned: device= stages them through pinned "
           "buffers)" if pin_memory else None)
    if why:
        raise SpecError(f"process=True cannot be used with {why}")


def _window_planner(schedule, rank: int, first) -> WindowPlanner:
    """The planner of an open-ended schedule's next windows for ``rank`` (``first``: its plan of the file's)."""
    if schedule.nodes is not None:
        from .node_windows import NodeWindowPlanner
        return NodeWindowPlanner(schedule, rank, first)
    return WindowPlanner(schedule, rank, first)


def _as_device(device):
    """A device given as text or ``torch.device``, as a ``torch.device``; None if it is None or torch cannot read
    it (the loader's own checks then name it)."""
    if device is None:
        return None
    import torch
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        return None


def _planned_device(schedule) -> str:
    """The device a plan made for a device buffer (``solar plan --device-buffer``) runs on: CUDA; a SpecError
    saying what to do where there is none."""
    import torch
    if not torch.cuda.is_available():
        raise SpecError(f"{schedule.path or 'the schedule'} plans its buffer in GPU memory (solar plan "
                        "--device-buffer), and CUDA is not available here: pass buffer_device='cpu' to run it "
                        "on the CPU, or plan again with --buffer-per-rank")
    return "cuda"


def _check_buffer_device(buffer_device, nodes, as_torch, device, transform, sample_transform):
    """``buffer_device`` as a torch device (None: the buffer in process memory); SpecError for what it cannot
    be combined with."""
    if buffer_device is None:
        return None
    from ..buffer.device_pools import torch_device
    dev = torch_device(buffer_device)
    why = ("a node plan (its ranks share one buffer in node memory)" if nodes is not None else
           "as_torch=False (batches on a device are torch tensors)" if not as_torch else
           "device= (the batches are on buffer_device already)" if device is not None else
           "transform= / sample_transform= (not run on a device buffer's batches yet)"
           if transform is not None or sample_transform is not None else None)
    if why:
        raise SpecError(f"buffer_device={buffer_device!r} cannot be used with {why}")
    return dev


def _read_layout(schedule: Schedule, data):
    """``(layout, stored)``: the layout to serve: ``data`` (a Layout, or built from a spec path's HDF5
    metadata), else the one the schedule stores (``stored`` True: no data file opened; the caller checks
    it against the files as ``verify_data`` says), else built from the dataset path the schedule names
    (format versions 1, 2).  A schedule planned on parts of chunks (:mod:`solar.layout.parts`) gets ``data``
    cut into the same parts.  Its fingerprint is compared with the schedule's by the caller."""
    from ..layout import Layout, load_layout
    from ..layout.parts import is_parts, split_chunks
    if data is None and schedule.has_layout:
        return schedule.layout(), True
    if data is None:
        if not schedule.source:
            raise SpecError("the schedule does not name its dataset: pass data=<layout spec path>")
        data = schedule.source
    layout = data if isinstance(data, Layout) else load_layout(data)
    if layout.fingerprint != schedule.fingerprint and not is_parts(layout):
        cut = split_chunks(layout)
        if cut is not None and cut.fingerprint == schedule.fingerprint:
            layout = cut
    return layout, False


def _check_rank(rank, comm, world: int) -> int:
    """This loader's rank: ``comm``'s, or ``rank`` (an int in [0, world)), both given must agree; neither:
    the launcher's (:func:`solar.topology.launcher_rank`)."""
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
            raise SpecError(f"rank must be an integer, got {rank!r}")
        if not 0 <= rank < world:
            raise SpecError(f"rank {rank} out of range: the job has ranks 0..{world - 1}")
    if comm is None:
        if rank is None:  # from torch.distributed or the launcher's variables
            from ..topology import launcher_rank
            return launcher_rank(world)
        return int(rank)
    mine = comm.Get_rank()
    if rank is not None and int(rank) != mine:
        raise SpecError(f"rank={rank} disagrees with the communicator, whose rank is {mine}")
    return int(mine)


def _install_guard(loader, comm):
    """With ``comm`` of more than one rank: the :mod:`solar.mpi` abort hooks, removed when the returned
    finalizer is called (``close``) or when ``loader`` is garbage-collected (a failed constructor).
    None otherwise."""
    if comm is None or comm.Get_size() <= 1:
        return None
    from ..mpi import install_abort_hooks, remove_abort_hooks
    return weakref.finalize(loader, remove_abort_hooks, install_abort_hooks(comm))
