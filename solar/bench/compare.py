"""``solar bench``: our schedule-driven loader against the strongest baselines a user would write,
same file, epochs, batch size and sampler, page cache dropped before each epoch; plus the disk's
cold random-read and sequential-read bandwidth measured in the same run (the physical limit).

Collective over ``comm``: every rank calls :func:`bench` together.  This module runs the job (plan, limits,
loaders, in order); solar's own run is :mod:`solar.bench.solar_run`, the baselines' :mod:`solar.bench.baseline`,
the limits :mod:`solar.bench.limits`, ``--equal-memory`` :mod:`solar.bench.equal_memory`, and the ratios and the
printed table :mod:`solar.bench.report`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from typing import Callable, Optional

from ..memory import DEFAULT_PREFETCH
from ..layout.parts import is_parts
from ..schedule.summary import whole_data_note
from .equal_memory import (_enter_cgroup, _leave_cgroup, _limit, _limit_first, _limit_loader, _node_comm, _peak,
                           _unlimit)
from .limits import measure_decode, measure_disk, measure_random
from .report import _ratios
from .solar_run import VERIFY, _say, run_solar

#: Seconds after which a baseline's epoch is stopped and its rate taken over what it delivered.
BASELINE_TIME_LIMIT = 120.0

#: Environment variable naming the folder of solar's cached files (the bench's schedules in ``bench/``).
CACHE_ENV = "SOLAR_CACHE_DIR"


def cache_dir() -> str:
    """Solar's cache folder: ``$SOLAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/solar``, else ``~/.cache/solar``."""
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "solar")


def bench_schedule_path(layout, name: str = "", **job) -> str:
    """Where ``solar bench`` writes the schedule of ``layout`` planned with ``job`` (the plan's arguments) when
    no ``schedule=`` is given: ``<cache_dir()>/bench/<data folder>-P..-b..-E..-<digest>.h5``, never next to the
    data (which may be read-only or shared).  ``name``: the data's name in the file name (default: the folder
    of its first file).  The digest covers the data files, their fingerprint and every planning argument, so
    two runs share a file only when they would write the same plan."""
    folder = os.path.join(cache_dir(), "bench")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        from ..errors import WriteError
        raise WriteError(f"cannot create the bench's schedule folder {folder} ({exc.strerror or exc}): set "
                         f"{CACHE_ENV} to a writable folder that every node sees, or give --schedule") from None
    files = [os.path.abspath(f) for f in layout.files]
    key = json.dumps([files, layout.fingerprint, sorted(job.items())], default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    data = re.sub(r"[^A-Za-z0-9._-]+", "_", name or os.path.basename(os.path.dirname(files[0]))) or "data"
    tag = "" if job.get("ranks_per_node") is None and job.get("policy") is None else \
        f"-{job.get('policy') or 'solar-peer'}-L{job.get('ranks_per_node') or 1}"
    fname = f"{data}-P{job['world_size']}-b{job['local_batch']}-E{job['epochs']}{tag}-{digest}.h5"
    return os.path.join(folder, fname)


#: Root attribute of the schedules ``solar bench`` writes (not in the header checksum): the bench may replace them.
BENCH_MARK = "written_by_solar_bench"


def mark_as_bench(path: str) -> None:
    """Mark the schedule at ``path`` as the bench's own (:func:`check_replaceable` lets a later bench replace it)."""
    import h5py
    with h5py.File(path, "r+", locking=False) as f:
        f.attrs[BENCH_MARK] = True


def check_replaceable(path: str) -> None:
    """SolarError when ``--schedule PATH`` names a schedule the bench did not write (a user's plan): the bench
    replaces only its own.  Other files are refused by the planner (:func:`solar.schedule.output.check_target`)."""
    import h5py

    from ..errors import SolarError
    from ..schedule.format import FORMAT
    try:
        with h5py.File(path, "r", locking=False) as f:
            fmt, ours = f.attrs.get("format"), bool(f.attrs.get(BENCH_MARK, False))
    except (OSError, ValueError):  # not HDF5 (or no file): the planner's own check names it
        return
    if (fmt.decode(errors="replace") if isinstance(fmt, bytes) else fmt) == FORMAT and not ours:
        raise SolarError(f"--schedule {path} is a schedule that solar bench did not write (a plan of yours?); "
                         "refusing to replace it: give a new path, or delete it first")


def check_visible(comm, schedule: str) -> None:
    """Raise the same :class:`SolarError` on every rank when some rank cannot see the ``schedule`` rank 0
    wrote (a cache folder on a node-local disk).  Collective over ``comm``."""
    from ..errors import SolarError
    from ..mpi import agree
    agree(comm, None if os.path.isfile(schedule) else SolarError(
        f"rank {comm.Get_rank()} cannot see the schedule {schedule} that rank 0 wrote: give --schedule (or set "
        f"${CACHE_ENV}) in a folder every node sees"))


def _data_name(spec) -> str:
    """A short name of the data ``spec`` names: its folder, or the file's name without suffix."""
    path = os.path.normpath(os.path.abspath(os.fspath(spec)))
    if os.path.basename(path) == "solar-layout.json":
        path = os.path.dirname(path)
    return os.path.splitext(os.path.basename(path))[0]


def bench(spec: str, *, comm, epochs: int = 3, local_batch: int = 32, buffer_fraction: Optional[float] = 0.5,
          buffer_per_rank=None, seed: int = 0, cold: bool = True, cache_mode: str = "file", step_time: float = 0.0,
          num_workers: int = 2, reader: Optional[str] = None, threads: int = 16, prefetch: int = DEFAULT_PREFETCH,
          schedule: Optional[str] = None, loaders=("solar", "baseline"), baselines=None, equal_memory: bool = False,
          memory_allowance: Optional[int] = None, disk_depth: int = 16, progress: bool = False,
          abort_on_error: bool = True, baseline_time_limit: Optional[float] = BASELINE_TIME_LIMIT,
          ranks_per_node: Optional[int] = None, policy: Optional[str] = None, peer_cost=None,
          reader_options: Optional[dict] = None, device: str = "cpu", model: str = "none", amp: str = "auto",
          log: Optional[Callable[[str], None]] = None, loader_options: Optional[dict] = None,
          reads_in_flight: Optional[int] = None, step_sync: bool = False, parts: Optional[bool] = None,
          neighbours: Optional[bool] = None) -> dict:
    """Run the comparison; returns the report (the same on every rank).

    ``schedule``: the schedule file rank 0 writes (every rank must see it); default
    :func:`bench_schedule_path`, in :func:`cache_dir` (``$SOLAR_CACHE_DIR``), never next to the data.
    ``progress``: tqdm bars (give it on rank 0 only, where stderr is a terminal); ``log``: called with one
    line at each stage and after each epoch of each loader (give it on rank 0 only), so a run whose stdout
    is the JSON report still says what it is doing.

    ``loaders``: ``"solar"`` and/or ``"baseline"`` (every baseline in ``baselines``,
    default all of :data:`~solar.bench.baseline.BASELINES`; one that does not apply to
    the layout is recorded with its skip reason).  ``equal_memory``: run every loader in
    a memory cgroup per node, each loader limited to its processes' own memory once they are up (its
    base, before it reads) plus the node's solar buffers plus ``memory_allowance`` (default
    :data:`~solar.bench.memlimit.ALLOWANCE_BYTES` plus :data:`~solar.bench.memlimit.ALLOWANCE_PER_RANK` for
    each rank of the node); the ranks join it before any DataLoader starts, so
    the workers' forkserver starts inside it, and each worker checks that it is inside (a forkserver this
    process started earlier would not be).
    ``disk_depth``: random reads in flight for the disk's limit.
    ``abort_on_error=False``: SolarLoader leaves an error on one rank to the caller (no MPI abort).
    ``reader_options``: passed to solar's reader (e.g. ``{"direct_io": True}``).
    ``reads_in_flight``: :func:`solar.plan`'s (batches of the budget held for reads in flight; default 1).
    ``parts``: :func:`solar.plan`'s (None: plan parts of chunks where the policy keeps them; False: whole chunks).
    ``neighbours``: :func:`solar.plan`'s (None or False: each block read on its own; True: runs of neighbours).
    ``step_sync``: solar's ranks wait for each other after every step, as DDP training does (solar alone:
    ``loaders=("solar",)``; a baseline's epoch may stop at its time limit on each rank apart).
    ``ranks_per_node``/``policy``/``peer_cost``: solar runs a node plan (:func:`solar.plan`'s arguments;
    a test topology may put several planned nodes on one machine); its epochs then report the peer
    bytes moved next to the plan's.  Every solar epoch checks :data:`VERIFY` delivered samples per rank
    against h5py after its timer, and reports its storage bytes against the plan's
    (``storage_vs_plan``).
    ``device``/``model``/``amp``: what each loader's batches feed (:mod:`solar.bench.consume`): ``model="conv"``
    a training step of a small conv net on ``device`` (``cpu`` or ``cuda``; each rank uses GPU local rank mod
    GPUs), ``"none"`` a copy to the device (or ``step_time`` seconds of sleep).  Every epoch of every loader
    then reports ``au`` (device-only time of the same steps on one resident batch / wall time),
    ``au_min`` and ``gpu_wait_fraction`` (1 - au).
    """
    from ..errors import SolarError
    from ..layout import load_layout
    from ..mpi import root_call
    from ..schedule import plan
    from .baseline import BASELINES
    from .cache import make_cache_dropper
    from .consume import StepConfig, require_device
    from .memlimit import ALLOWANCE_BYTES, ALLOWANCE_PER_RANK
    step = StepConfig(device=device, model=model, step_time=step_time, amp=amp)  # checked before any work
    require_device(step)
    baselines = tuple(BASELINES if baselines is None else baselines)
    for b in baselines:
        if b not in BASELINES:
            raise SolarError(f"baseline must be one of {', '.join(BASELINES)}, got {b!r}")
    if not isinstance(disk_depth, int) or isinstance(disk_depth, bool) or disk_depth < 1:
        raise SolarError(f"disk depth (random reads in flight) must be an integer >= 1, got {disk_depth!r}")
    allowance = ALLOWANCE_BYTES if memory_allowance is None else int(memory_allowance)
    if allowance < 0:
        raise SolarError(f"memory allowance must be >= 0 bytes, got {memory_allowance!r}")
    from ..loader.gil import DEFAULT_SWITCH_INTERVAL, check_interval, lower
    from ..memory import check_reads_in_flight
    switch = check_interval((loader_options or {}).get("switch_interval", DEFAULT_SWITCH_INTERVAL))
    if reads_in_flight is not None:
        check_reads_in_flight(reads_in_flight)
    if not isinstance(step_sync, bool):
        raise SolarError(f"step_sync must be True or False, got {step_sync!r}")
    if step_sync and "baseline" in loaders:
        raise SolarError("--step-sync runs solar alone (--only solar): a baseline's epoch stops at its time limit "
                         "on each rank apart, so its ranks cannot wait for each other after every step")
    P = comm.Get_size()

    # 1. the plan: rank 0 builds the layout from the HDF5 metadata and writes the schedule while the others
    # sleep; every rank then takes the layout from the schedule (no rank but 0 reads HDF5 metadata)
    t_start = time.perf_counter()

    def make_plan():
        if schedule is not None:
            check_replaceable(schedule)
        _say(log, f"reading the layout of {spec}")
        lay = load_layout(spec, progress=progress)
        job = dict(world_size=P, local_batch=local_batch, epochs=epochs, buffer_fraction=buffer_fraction,
                   buffer_per_rank=buffer_per_rank, seed=seed, policy=policy, ranks_per_node=ranks_per_node,
                   peer_cost=None if peer_cost is None else peer_cost.to_dict(),
                   parts=parts, neighbours=neighbours,
                   **({} if reads_in_flight is None else {"reads_in_flight": reads_in_flight}))
        path = schedule or bench_schedule_path(lay, _data_name(spec), **job)
        _say(log, f"planning {P} rank(s) x local batch {local_batch}, {epochs} epoch(s), {lay.n_samples:,} samples")
        t0 = time.perf_counter()
        s = plan(lay, world_size=P, local_batch=local_batch, epochs=epochs, buffer_fraction=buffer_fraction,
                 buffer_per_rank=buffer_per_rank, seed=seed, out=path, progress=progress, policy=policy,
                 ranks_per_node=ranks_per_node, peer_cost=peer_cost, reads_in_flight=reads_in_flight, parts=parts,
                 neighbours=neighbours)
        try:
            whole = whole_data_note(buffer_fraction, s)
        finally:
            s.close()
        if whole:
            _say(log, whole)
        mark_as_bench(path)
        secs = time.perf_counter() - t0
        _say(log, f"schedule written to {path} in {secs:.1f} s")
        return path, secs
    schedule, plan_s = root_call(comm, make_plan)
    check_visible(comm, schedule)
    from ..schedule import Schedule
    with Schedule.load(schedule) as sch:
        layout = sch.layout() if sch.has_layout else load_layout(spec)
        run_bytes = sch.neighbour_run_bytes
    paths = list(layout.files)
    drop, how = make_cache_dropper(paths, cache_mode if cold else "none", comm=comm)
    report = {"spec": spec, "world_size": P, "local_batch": local_batch, "epochs": epochs, "seed": seed,
              "step_time_s": step_time, "cache": how,
              "buffer_fraction": buffer_fraction if buffer_per_rank is None else None,
              "dataset_file_bytes": sum(os.path.getsize(p) for p in paths),
              "n_samples": layout.n_samples, "plan_s": plan_s, "schedule": schedule, "model": model,
              "parts": is_parts(layout),  # planned on parts of chunks (solar.layout.parts)
              "neighbour_run_bytes": run_bytes}  # read runs of neighbouring blocks (solar.layout.runs); 0: not
    # 2. the physical limit, cold (rank 0 alone, the others sleep)
    _say(log, "measuring the limits: the disk's cold random and sequential reads, the cpu's decoding")
    report["disk"] = root_call(comm, lambda: measure_disk(layout, disk_depth))
    report["decode"] = root_call(comm, lambda: measure_decode(layout))  # None: nothing to decode
    if "solar" in loaders:  # the hit path's limit: copying with the cores solar's loader gets
        from ..topology import cpus_of_this_rank
        from .limits import measure_copy
        cores = (loader_options or {}).get("cpus") or cpus_of_this_rank()
        report["copy"] = root_call(comm, lambda: measure_copy(cores))
    # 3. the memory: unlimited, or one cgroup per node
    node = _node_comm(comm)
    cg = back = None
    consume = None
    # the GIL switch interval solar's loader sets (SolarLoader(switch_interval=)), for the whole run: the
    # baselines' threads in this process (the DataLoader's pinning thread) get it too
    loader_options = dict(loader_options or {}, switch_interval=switch)
    report["switch_interval_s"] = switch
    report["reads_in_flight"] = 1 if reads_in_flight is None else int(reads_in_flight)
    report["step_sync"] = step_sync
    restore_gil = lower(switch)
    try:
        if device != "cpu" or model != "none":
            consume = _consumer(step, spec, layout, local_batch, node.rank)
            report["device"] = consume.describe()
        from ..schedule.memory import schedule_memory, schedule_node_memory
        with Schedule.load(schedule) as sch:  # the memory solar may use per rank: what the baselines get too
            if sch.nodes is None:
                budget = int(schedule_memory(sch, comm.rank, layout, prefetch=prefetch).limit)
            else:  # a node plan: the node's limit shared by its ranks
                L = sch.nodes.ranks_per_node
                budget = int(schedule_node_memory(sch, comm.rank // L, layout, prefetch=prefetch).limit) // L
        data_bytes = None
        if equal_memory:
            if memory_allowance is None:  # the default: a share for each rank of the node too
                allowance = ALLOWANCE_BYTES + ALLOWANCE_PER_RANK * node.Get_size()
            data_bytes = _limit(node, budget, allowance)
            cg, back = _enter_cgroup(comm, node)
            report["memory_limit_bytes"] = data_bytes
            report["memory_allowance_bytes"] = allowance
            report["memory_method"] = f"{cg.description}, one per node, each loader and its workers inside it, " \
                                      f"limited to their own memory once started (memory_base_bytes, before " \
                                      f"any read) + {data_bytes:,} bytes: the node's solar buffers + allowance " \
                                      f"{allowance:,} bytes"
        else:
            report["memory_limit_bytes"] = None
            report["memory_method"] = "none: memory not limited (the page cache may hold the whole dataset)"
        _run_loaders(report, spec, layout, schedule, comm=comm, node=node, cg=cg, epochs=epochs,
                     local_batch=local_batch, seed=seed, step_time=step_time, drop=drop, reader=reader,
                     threads=threads, prefetch=prefetch, num_workers=num_workers, progress=progress,
                     abort_on_error=abort_on_error, loaders=loaders, baselines=baselines, budget=budget,
                     time_limit=baseline_time_limit, reader_options=reader_options, disk_depth=disk_depth,
                     consume=consume, log=log, loader_options=loader_options, data_bytes=data_bytes,
                     step_sync=step_sync)
    finally:
        restore_gil()
        if cg is not None:
            _leave_cgroup(cg, back, node)
        node.Free()
    # the limits again after the loaders: a shared disk (or busy cores) can change speed within minutes, and
    # the ratios use the faster of the two measurements (the stricter limit)
    _say(log, "measuring the disk again")
    report["disk_after"] = root_call(comm, lambda: measure_disk(layout, disk_depth))
    report["decode_after"] = root_call(comm, lambda: measure_decode(layout))
    _ratios(report)
    _say(log, f"done in {time.perf_counter() - t_start:.0f} s")
    return report


def _consumer(step, spec, layout, local_batch: int, local_rank: int):
    """The :class:`~solar.bench.consume.Consumer` of this rank, its resident batch the dataset's first
    ``local_batch`` samples (read through h5py)."""
    import torch

    from .baseline import H5Samples
    from .consume import Consumer, input_field
    resident = {}
    if step.trains:
        field = input_field(layout)
        ds = H5Samples(spec, layout)
        try:
            resident[field] = torch.stack([ds[i][field] for i in range(min(local_batch, layout.n_samples))])
        finally:
            ds.close()
    return Consumer(step, layout, resident, local_rank=local_rank)


def _run_loaders(report, spec, layout, schedule, *, comm, node, cg, epochs, local_batch, seed, step_time, drop,
                 reader, threads, prefetch, num_workers, progress, abort_on_error, loaders, baselines, budget,
                 time_limit=None, reader_options=None, disk_depth=16, consume=None, log=None,
                 loader_options=None, data_bytes=None, step_sync=False):
    """Run solar and each baseline in turn, filling ``report["solar"]``, ``["baselines"]``, ``["baseline"]``;
    ``log`` gets a line as each loader and each of its epochs starts, and each loader's samples/s.  With a
    cgroup ``cg``, each loader runs limited to its base plus ``data_bytes`` (:func:`_limit_loader`): solar's
    base is taken after its throwaway warm-up loader (numba's kernels loaded, no buffer held), a
    baseline's once its workers are up, right before its first epoch."""
    import functools

    from .baseline import BaselineFailed, run_baseline, skip_reason
    from .memlimit import check_worker_in
    if "solar" in loaders:
        limited = {}

        def limit():  # after solar's throwaway warm-up loader, before the timed one (see run_solar)
            limited.update(_limit_loader(cg, node, comm, data_bytes) or {})
        from ..mpi import root_call
        _say(log, f"solar: {epochs} epoch(s)")
        report["solar"] = run_solar(schedule, layout, comm=comm, epochs=epochs, step_time=step_time,
                                    drop_cache=drop, reader=reader, threads=threads, prefetch=prefetch,
                                    progress=progress, abort_on_error=abort_on_error, reader_options=reader_options,
                                    probe=lambda: root_call(comm, lambda: measure_random(layout, disk_depth)),
                                    consume=consume, log=log, loader_options=loader_options,
                                    limit=limit if cg is not None else None, step_sync=step_sync)
        report["solar"]["memory_peak_bytes"] = _peak(cg, node, comm)
        report["solar"].update(limited)
        _unlimit(cg, node, comm)
    if "baseline" not in loaders:
        return
    report["baselines"] = {}
    init = functools.partial(check_worker_in, cg.path, cg.limit_file) if cg is not None else None
    for kind in baselines:
        why = skip_reason(layout, kind)
        if why:
            report["baselines"][kind] = {"skipped": why}
            _say(log, f"baseline {kind}: skipped ({why})")
            continue
        limit = f", each stopped after {time_limit:g} s" if time_limit else ""
        _say(log, f"baseline {kind}: {num_workers} DataLoader worker(s) per rank, {epochs} epoch(s){limit}")
        limited = {}
        try:
            eps = run_baseline(spec, comm=comm, local_batch=local_batch, epochs=epochs, seed=seed,
                               num_workers=num_workers, step_time=step_time,
                               drop_cache=_limit_first(_epoch_lines(drop, kind, epochs, log), limited, cg,
                                                       node, comm, data_bytes),
                               progress=progress, kind=kind, memory_bytes=budget, worker_init_fn=init,
                               verify=VERIFY, time_limit=time_limit, consume=consume)
        except BaselineFailed as exc:  # e.g. its workers outgrew the --equal-memory limit: say so, go on
            report["baselines"][kind] = {"failed": str(exc) + (" (killed under the memory limit?)" if cg else ""),
                                         "memory_peak_bytes": _peak(cg, node, comm), **limited}
            _unlimit(cg, node, comm)
            _say(log, f"baseline {kind}: failed ({report['baselines'][kind]['failed']})")
            continue
        _unlimit(cg, node, comm)
        _say(log, f"baseline {kind}: " + ", ".join(f"{e['samples_per_s']:.1f}" + ("*" if e.get("partial") else "")
                                                   for e in eps) + " samples/s per epoch"
             + (" (*: stopped at the time limit)" if any(e.get("partial") for e in eps) else ""))
        report["baselines"][kind] = {"num_workers": num_workers, "epochs": eps,
                                     "samples_per_s": [e["samples_per_s"] for e in eps],
                                     "au": [e["au"] for e in eps],
                                     "memory_peak_bytes": _peak(cg, node, comm), **limited}
        if kind == "h5py-cache":
            report["baselines"][kind]["chunk_cache_bytes_per_rank"] = budget
    if "torch" in report["baselines"] and "epochs" in report["baselines"]["torch"]:
        report["baseline"] = report["baselines"]["torch"]


def _epoch_lines(drop, kind: str, epochs: int, log):
    """``drop`` (called by :func:`~solar.bench.baseline.run_baseline` right before each epoch) that first says,
    through ``log``, which epoch of baseline ``kind`` starts."""
    if log is None:
        return drop
    started = [0]

    def drop_and_say():
        log(f"baseline {kind} epoch {started[0]} ({started[0] + 1} of {epochs})")
        started[0] += 1
        return drop() if drop is not None else None
    return drop_and_say


