"""``solar bench``: our schedule-driven loader against the strongest baselines a user would write,
same file, epochs, batch size and sampler, page cache dropped before each epoch; plus the disk's
cold random-read and sequential-read bandwidth measured in the same run (the physical limit).

Collective over ``comm``: every rank calls :func:`bench` together.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from typing import Callable, Optional

import numpy as np

from ..memory import DEFAULT_PREFETCH
from ..layout.parts import chunks_of, is_parts

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


def _say(log: Optional[Callable[[str], None]], text: str) -> None:
    """One progress line through ``log`` (the CLI's: rank 0's stderr), if any."""
    if log is not None:
        log(text)


def rss_bytes() -> int:
    """This process's resident set size now (Linux /proc)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def run_solar(schedule_path: str, layout, *, comm, epochs: int, step_time: float = 0.0, drop_cache=None,
              reader: Optional[str] = None, threads: int = 16, prefetch: int = DEFAULT_PREFETCH, progress: bool = False,
              abort_on_error: bool = True, reader_options: Optional[dict] = None,
              probe: Optional[Callable[[], float]] = None, replay: bool = True, consume=None,
              log: Optional[Callable[[str], None]] = None, loader_options: Optional[dict] = None,
              limit: Optional[Callable[[], None]] = None, step_sync: bool = False) -> dict:
    """Time SolarLoader epoch by epoch, measured as the baseline is (drop, barrier, timed loop).

    ``abort_on_error``: passed to SolarLoader (an error on one rank aborts the job).  ``probe``: called by
    every rank after each epoch (outside the timer), its result (the disk's cold random-read GB/s then) kept
    as the epoch's ``disk_random_read_gbps_after``.  ``replay``: where the reader records its reads
    (``pread``), every rank replays the start of its epoch's reads bare after the epoch (outside the timer,
    all ranks at once, as many in flight as the reader's threads: :func:`solar.bench.disk.replay_reads`);
    the aggregate rate is the epoch's ``replay_gbps``, the disk's speed for exactly this access pattern.
    ``consume``: a :class:`solar.bench.consume.Consumer` that each batch feeds (a training step, on its device:
    the loader then copies batches there ahead of use, ``device=``); the epoch's timer stops when the device
    has run every step, and the device-only time of the same steps is measured right after it (``au``,
    ``gpu_wait_fraction``).  Without it, ``step_time`` seconds of sleep per step.  ``progress``: a tqdm bar per
    epoch (rank 0); ``log``: called with one line after each epoch (where it is given: the CLI's rank 0).
    ``loader_options``: more SolarLoader arguments (``cpus``, ``buffer_device``: with a device buffer the
    batches are gathered there, not copied).  Before any timer a throwaway loader of the same plan takes one
    step, so that numba's first calls of the reader's and the gather's kernels (a compilation where its cache
    is cold) are in no epoch; its seconds are ``warmup_s`` (the caller drops the page cache before each
    epoch where it measures cold).  ``limit``: called by every rank once that throwaway loader is gone and
    before the timed one is built (``solar bench --equal-memory`` sets the loader's memory limit there: its
    base then holds the kernels numba loaded, as a baseline's holds its started workers).  ``step_sync``: every
    rank waits for all the others after each step, as DDP's gradient all-reduce makes a training loop do (a
    barrier that sleeps in 0.2 ms polls instead of spinning)."""
    import gc

    from ..loader import SolarLoader
    from ..mpi import sleep_barrier
    from .cache import largest_left
    from .baseline import _verify
    from .consume import epoch_au
    from .limits import os_read_bytes
    opts = dict(loader_options or {})
    cuda = consume is not None and consume.cfg.cuda and opts.get("buffer_device") is None
    # numba compiles (or loads from its cache) the reader's and the gather's kernels at their first call: a
    # throwaway loader takes one step first, so that no epoch's timer holds that one-off cost (1-2 s cold)
    warm0 = time.perf_counter()
    with SolarLoader(schedule_path, layout, comm=comm, reader=reader, threads=threads, prefetch=prefetch,
                     as_torch=True, abort_on_error=abort_on_error, reader_options=reader_options, **opts) as warm:
        next(iter(warm), None)
    warmup = comm.allreduce(time.perf_counter() - warm0, op=_max())
    del warm
    gc.collect()  # its pools and batches freed before a memory limit is measured from here
    if limit is not None:
        limit()
    rss0 = rss_bytes()
    loader = SolarLoader(schedule_path, layout, comm=comm, reader=reader, threads=threads, prefetch=prefetch,
                         as_torch=True, epoch_fence=True, abort_on_error=abort_on_error, reader_options=reader_options,
                         pin_memory=cuda, device=consume.device if cuda else None, **opts)
    gpu_buffer = loader.buffer_device if loader.buffer_device is not None and loader.buffer_device.type == "cuda" \
        else None
    out = {"reader": loader.reader_name, "reader_options": dict(reader_options or {}), "epochs": [], "warmup_s": warmup,
           "cpus": loader.cpus, "buffer_device": None if loader.buffer_device is None else str(loader.buffer_device)}
    nodes = loader.nodes is not None  # a node plan: transfers between nodes are counted too
    tracer = loader.reader if replay and hasattr(loader.reader, "trace") else None
    predicted = loader.schedule.predicted()
    peak_rss = rss0
    shapes, dtypes = layout.field_shapes(), layout.field_dtypes()
    sample_bytes = sum(int(np.prod(shapes[f], dtype=np.int64)) * np.dtype(dtypes[f]).itemsize for f in shapes)
    try:
        # the buffer built before epoch 0's timer (pools faulted in, plan loaded; nothing read: the fence),
        # its seconds (slowest rank) added to epoch 0's time for samples/s; the limit ratios leave them out
        startup = comm.allreduce(loader.prepare(), op=_max())
        out["startup_s"] = startup
        prev = {}
        for e in range(epochs):
            loader.set_epoch(e)
            left = drop_cache() if drop_cache is not None else None
            sleep_barrier(comm)
            bar = None
            if progress and comm.rank == 0:
                from tqdm import tqdm
                bar = tqdm(total=len(loader), desc=f"solar epoch {e}", unit="batch", leave=False)
            check = set(np.linspace(0, len(loader) - 1, VERIFY).round().astype(int).tolist())  # steps checked
            picked = []  # (sample id, {field: tensor}): the first sample of each checked step, checked after
            if tracer is not None:
                tracer.trace = []  # the epoch's reads (the fence: none of them was issued before its timer)
            sizes = []  # local batch size of each step (the device-only steps repeat them)
            io0 = os_read_bytes()  # solar.bench.limits
            t0 = time.perf_counter()
            samples = 0
            for i, batch in enumerate(loader):
                n = int(batch["index"].shape[0])
                samples += n
                sizes.append(n)
                if i in check and n:
                    picked.append((int(batch["index"][0]), {k: v[0].clone() for k, v in batch.items()
                                                            if k not in ("index", "weight")}))
                if consume is not None:
                    consume(batch)
                elif step_time:
                    time.sleep(step_time)
                if step_sync:
                    sleep_barrier(comm, 0.0002)
                if bar is not None:
                    bar.update()
            if consume is not None:
                consume.sync()  # the epoch ends when the device has run its last step
            if gpu_buffer is not None:  # and when the device buffer's last gather is done
                import torch
                torch.cuda.synchronize(gpu_buffer)
            secs = time.perf_counter() - t0 + (startup if e == 0 else 0.0)
            io_read = os_read_bytes() - io0
            if bar is not None:
                bar.close()
            picked = [(i, {k: v.cpu() for k, v in f.items()}) for i, f in picked]
            util = epoch_au(consume, comm, sizes, step_time, secs)
            peak_rss = max(peak_rss, rss_bytes())
            verified = _verify(layout, picked, who="solar")  # after the timer; a difference ends the job
            planned = predicted["storage_bytes"][e]  # stored bytes of the blocks the plan loads in epoch e
            st = loader.stats()
            d = {k: st[k] - prev.get(k, 0) for k in st}
            prev = st
            per_rank = comm.allgather((secs, samples, d["stall_s"], d["bytes_read"], d["bytes_loaded"], d["hits"],
                                       d["misses"], d["plan_violations"], d["read_s"], left, d.get("opens", 0),
                                       d.get("evictions", 0), verified, d.get("sent_bytes", 0),
                                       d.get("recv_bytes", 0), d.get("sent_blocks", 0), d["stored_bytes"],
                                       io_read, d["assemble_s"], samples * sample_bytes, d.get("book_wait_s", 0.0)))
            seconds = max(x[0] for x in per_rank)
            total = sum(x[1] for x in per_rank)
            read = sum(x[3] for x in per_rank)
            _say(log, f"solar epoch {e} ({e + 1} of {epochs}): {total:,} samples in {seconds:.1f} s "
                      f"({total / seconds if seconds else 0.0:.1f} samples/s)")
            out["epochs"].append(dict(
                epoch=e, global_samples=total, seconds=seconds, samples_per_s=total / seconds if seconds else 0.0,
                startup_s=startup if e == 0 else 0.0,
                stall_max_s=max(x[2] for x in per_rank), book_wait_max_s=max(x[20] for x in per_rank),
                storage_bytes=read,
                storage_bytes_per_s=read / seconds if seconds else 0.0,
                decoded_bytes_loaded=sum(x[4] for x in per_rank), block_hits=sum(x[5] for x in per_rank),
                block_misses=sum(x[6] for x in per_rank), plan_violations=sum(x[7] for x in per_rank),
                page_cache_left=largest_left(x[9] for x in per_rank), file_opens=sum(x[10] for x in per_rank),
                file_evictions=sum(x[11] for x in per_rank), verified=sum(x[12] for x in per_rank),
                block_storage_bytes=sum(x[16] for x in per_rank), predicted_storage_bytes=int(planned),
                storage_vs_plan=read / planned if planned else None,
                blocks_vs_plan=sum(x[16] for x in per_rank) / planned if planned else None,
                os_read_bytes=sum(x[17] for x in per_rank),
                # the hit path: the rate of assembling (copying) the delivered bytes, the slowest rank's (None for a
                # buffer on a device: the host only queues the gathers there, their time is the device's)
                assemble_gbps=None if loader.buffer_device is not None else
                min((x[19] / x[18] / 1e9 for x in per_rank if x[18] > 0), default=None), **util))
            if tracer is not None:
                out["epochs"][-1].update(_replay(tracer, layout, comm, threads))
            if probe is not None:
                out["epochs"][-1]["disk_random_read_gbps_after"] = probe()
            if nodes:  # decoded bytes moved between nodes, as run and as planned
                out["epochs"][-1].update(peer_bytes_sent=sum(x[13] for x in per_rank),
                                         peer_bytes_received=sum(x[14] for x in per_rank),
                                         peer_blocks_sent=sum(x[15] for x in per_rank),
                                         predicted_peer_bytes=int(predicted["peer_bytes"][e]))
        out["pool_bytes_per_node" if nodes else "pool_bytes_per_rank"] = comm.allreduce(
            loader.buffer.pools.capacity_bytes if loader.buffer else 0, op=_max())  # a node plan's: the node's window
        out["buffer_budget_per_rank"] = loader.schedule.buffer_bytes  # the planner's residency budget
        out["read_ahead_bytes"] = loader.schedule.read_ahead_bytes  # held for more reads in flight (--reads-in-flight)
        # the memory the plan needs, of the rank (node) that needs most (solar.memory), next to the RSS growth
        needs = comm.allgather(loader.memory.to_dict())
        out["memory_need_per_node" if nodes else "memory_need_per_rank"] = max(needs, key=lambda m: m["total"])
        if nodes:
            out["policy"], out["ranks_per_node"] = loader.schedule.policy, loader.nodes.ranks_per_node
        out["rss_growth_bytes_max_rank"] = comm.allreduce(peak_rss - rss0, op=_max())
    finally:
        loader.close()
    return out


def _replay(reader, layout, comm, depth: int) -> dict:
    """Every rank replays the reads ``reader`` recorded this epoch (bare, at once); the aggregate rate."""
    from ..mpi import sleep_barrier
    from .disk import replay_reads
    trace, reader.trace = reader.trace, None
    ext = np.concatenate(trace) if trace else np.zeros((0, 3), np.int64)  # int64[reads, 3]
    sleep_barrier(comm)
    r = replay_reads(layout.files, ext, depth=depth, direct=bool(getattr(reader, "direct", False)))
    got = comm.allgather((r["bytes"], r["seconds"], r["reads"], r["direct"]))
    secs = max(g[1] for g in got)
    nbytes = sum(g[0] for g in got)
    return dict(replay_gbps=nbytes / secs / 1e9 if secs and nbytes else None, replay_bytes=nbytes,
                replay_reads=sum(g[2] for g in got), replay_direct=all(g[3] for g in got))


#: Delivered samples per epoch and rank that each baseline's run checks against h5py (after the timer).
VERIFY = 4


def _max():
    from mpi4py import MPI
    return MPI.MAX


#: Random reads in flight the disk's best cold random-read rate is looked for at (besides ``--disk-depth``).
BEST_DEPTHS = (16, 64, 256)


def measure_disk(layout, depth: int = 16, depths=BEST_DEPTHS) -> dict:
    """The physical limit, cold: random reads of the layout's stored blocks (``depth`` in flight, and each of
    ``depths``: the best of them is the disk's limit for one rank that keeps enough reads in flight) and 8 MiB
    sequential reads (4 in flight) over its files.

    Returns ``dict(bytes_per_s, method, random_read_gbps, sequential_read_gbps, block_bytes, random, sequential,
    random_by_depth, best_random_read_gbps, best_depth)``; ``bytes_per_s``/``method`` are the sequential figure
    (as before), ``random_read_gbps`` the one at ``depth``.
    """
    layout = chunks_of(layout)  # a plan on parts of chunks reads whole chunks
    from .disk import cold_parallel_sequential_read, cold_random_read, typical_block
    extents, block = typical_block(layout)
    rnd = cold_random_read(layout.files, extents, depth=depth)
    by_depth = {int(depth): rnd["bytes_per_s"] / 1e9}
    for d in sorted(set(int(x) for x in depths) - {int(depth)}):
        by_depth[d] = cold_random_read(layout.files, extents, depth=d)["bytes_per_s"] / 1e9
    best = max(by_depth, key=by_depth.get)
    seq = cold_parallel_sequential_read(layout.files)
    return dict(bytes_per_s=seq["bytes_per_s"], method=seq["method"], random_read_gbps=rnd["bytes_per_s"] / 1e9,
                sequential_read_gbps=seq["bytes_per_s"] / 1e9, block_bytes=block, random=rnd, sequential=seq,
                random_by_depth={str(d): g for d, g in sorted(by_depth.items())}, best_random_read_gbps=by_depth[best],
                best_depth=best)


def measure_random(layout, depth: int = 16) -> float:
    """The disk's cold random-read GB/s alone, as :func:`measure_disk` measures it (between solar's epochs)."""
    layout = chunks_of(layout)  # a plan on parts of chunks reads whole chunks
    from .disk import cold_random_read, typical_block
    extents, _ = typical_block(layout)
    return cold_random_read(layout.files, extents, depth=depth)["bytes_per_s"] / 1e9


def measure_decode(layout) -> "dict | None":
    """The CPU limit of filtered data (:func:`solar.bench.decode.decode_limit`, the node's cores), with
    ``filtered_fraction``: the share of the layout's stored bytes that are filtered (what it applies to)."""
    layout = chunks_of(layout)  # a plan on parts of chunks reads whole chunks
    from .decode import decode_limit, filtered_blocks
    r = decode_limit(layout)
    if r is not None:
        on = (layout.block_offset >= 0) & (layout.block_stored > 0)
        total = int(layout.block_stored[on].sum())
        r["filtered_fraction"] = float(layout.block_stored[filtered_blocks(layout)].sum()) / total if total else 0.0
    return r


def _node_comm(comm):
    from mpi4py import MPI
    return comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)


def _enter_cgroup(comm, node) -> tuple:
    """Make one memory cgroup per node (node rank 0; no limit until :func:`_limit_loader`) and move every
    rank in: ``(cgroup, dir to go back to)``.

    Collective; a failure on any rank raises the same :class:`SolarError` on every rank.
    """
    from ..errors import SolarError
    from .memlimit import MemoryCgroup
    made, err = None, None
    if node.rank == 0:
        try:
            made = MemoryCgroup.create(f"solar-bench-{os.getpid()}", None)
        except SolarError as exc:
            err = str(exc)
    made = node.bcast(made, root=0)
    errs = [e for e in comm.allgather(err) if e]
    if errs:
        raise SolarError(errs[0])
    back, err = None, None
    try:
        back = made.join()
    except SolarError as exc:
        err = str(exc)
    errs = [e for e in comm.allgather(err) if e]
    if errs:
        _leave_cgroup(made, back, node)
        raise SolarError(errs[0])
    return made, back


def _leave_cgroup(cg, back, node):
    """Every rank goes back to ``back``; node rank 0 moves what is left (workers' servers) and removes ``cg``."""
    from ..mpi import sleep_barrier
    if back:
        cg.leave(back)
    sleep_barrier(node)
    if node.rank == 0:
        cg.remove(back)


def _limit(node, budget: int, allowance: int) -> int:
    """Bytes of one node's memory for data: the sum of its ranks' buffer budgets (``budget`` each) plus
    ``allowance``."""
    return node.allreduce(int(budget)) + int(allowance)


def _node_root(cg, node, comm, what: str, fn) -> list:
    """``fn(cg)`` on each node's rank 0, every rank of the node here before and after it: the nodes' results.
    Collective over ``comm``; an exception on any node raises the same :class:`SolarError` on every rank."""
    from ..errors import SolarError
    from ..mpi import sleep_barrier
    sleep_barrier(node)
    got, err = None, None
    if node.rank == 0:
        try:
            got = fn(cg)
        except Exception as exc:  # noqa: BLE001 - said on every rank below
            err = f"--equal-memory: cannot {what} {cg.path}: {exc}"
    every = comm.allgather((node.rank == 0, got, err))
    errs = [e for _, _, e in every if e]
    if errs:
        raise SolarError(errs[0])
    sleep_barrier(node)  # e.g. no rank reads before its node's limit holds
    return [g for root, g, _ in every if root]


def _limit_loader(cg, node, comm, data_bytes: int) -> Optional[dict]:
    """Limit each node's cgroup to what its processes hold now (the loader's base: started, nothing read
    yet) plus ``data_bytes``, and start its peak over: ``{"memory_base_bytes", "memory_cgroup_limit_bytes"}``
    (the largest over the nodes), None without a cgroup.  Collective over ``comm`` (call it when this rank's
    loader is up); an error on any node raises the same :class:`SolarError` on every rank."""
    if cg is None:
        return None

    def limit(c):
        base = c.base_bytes()
        c.set_limit(int(base + data_bytes))
        c.reset_peak()
        return base, c.limit_bytes
    got = _node_root(cg, node, comm, "limit", limit)
    return {"memory_base_bytes": max(g[0] for g in got), "memory_cgroup_limit_bytes": max(g[1] for g in got)}


def _unlimit(cg, node, comm):
    """Lift the nodes' cgroup limits once every rank of each node is done with a loader (the next one starts
    its processes without a limit).  Collective over ``comm``."""
    if cg is not None:
        _node_root(cg, node, comm, "lift the limit of", lambda c: c.set_limit(None))


def _peak(cg, node, comm):
    """Largest peak usage of the nodes' cgroups since the last reset (None without a cgroup)."""
    if cg is None:
        return None
    val = cg.peak_bytes() if node.rank == 0 else None
    vals = [v for v in comm.allgather(val) if v is not None]
    return max(vals) if vals else None


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
        plan(lay, world_size=P, local_batch=local_batch, epochs=epochs, buffer_fraction=buffer_fraction,
             buffer_per_rank=buffer_per_rank, seed=seed, out=path, progress=progress, policy=policy,
             ranks_per_node=ranks_per_node, peer_cost=peer_cost, reads_in_flight=reads_in_flight, parts=parts,
             neighbours=neighbours).close()
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
              "step_time_s": step_time, "cache": how, "dataset_file_bytes": sum(os.path.getsize(p) for p in paths),
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


def _limit_first(drop, limited: dict, cg, node, comm, data_bytes):
    """``drop`` (called by :func:`~solar.bench.baseline.run_baseline` on every rank right before each epoch)
    that first, before the first epoch (workers up, nothing timed read yet), limits the cgroup for this
    loader (:func:`_limit_loader`; what it returns goes into ``limited``)."""
    if cg is None:
        return drop
    first = [True]

    def limit_then_drop():
        if first[0]:
            first[0] = False
            limited.update(_limit_loader(cg, node, comm, data_bytes))
        return drop() if drop is not None else None
    return limit_then_drop


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


def _ratios(report: dict):
    """``speedup`` (vs torch), ``speedup_vs_best``/``best_baseline`` (per epoch), ``limit_ratio``, ``storage_vs_disk``."""
    n = report["epochs"]
    ran = {k: v["epochs"] for k, v in report.get("baselines", {}).items() if "epochs" in v}
    if "solar" in report and "baseline" in report:
        report["speedup"] = [s["samples_per_s"] / b["samples_per_s"] if b["samples_per_s"] else None
                             for s, b in zip(report["solar"]["epochs"], report["baseline"]["epochs"])]
    if ran:
        report["best_baseline"] = [max(ran, key=lambda k: ran[k][e]["samples_per_s"]) for e in range(n)]
    if "solar" in report and ran:
        report["speedup_vs_best"] = []
        for e, best in enumerate(report["best_baseline"]):
            b = ran[best][e]["samples_per_s"]
            report["speedup_vs_best"].append(report["solar"]["epochs"][e]["samples_per_s"] / b if b else None)
    aus = {k: [ep.get("au") for ep in eps] for k, eps in
           ([("solar", report["solar"]["epochs"])] if "solar" in report else []) + list(ran.items())}
    if any(a is not None for v in aus.values() for a in v):
        report["au"] = aus  # per loader and epoch: device-only time / wall time
        report["gpu_wait_fraction"] = {k: [None if a is None else 1.0 - a for a in v] for k, v in aus.items()}
    if "solar" not in report:
        return
    after = report.get("disk_after") or report["disk"]
    seq = max(report["disk"]["bytes_per_s"], after["bytes_per_s"])
    rnd = max(report["disk"]["random_read_gbps"], after["random_read_gbps"]) * 1e9
    report["limit_random_read_gbps"], report["limit_sequential_read_gbps"] = rnd / 1e9, seq / 1e9
    dec = report.get("decode")
    if dec and report.get("decode_after"):
        dec = dict(dec, bytes_per_s=max(dec["bytes_per_s"], report["decode_after"]["bytes_per_s"]))
        report["limit_decode_gbps"] = dec["bytes_per_s"] / 1e9
    before = report["disk"]["random_read_gbps"]  # the probe right before epoch 0
    for ep in report["solar"]["epochs"]:
        ep["storage_vs_disk"] = ep["storage_bytes_per_s"] / seq if seq else None
        secs = ep["seconds"] - ep.get("startup_s", 0.0)  # the epoch's reads: epoch 0 without the buffer's start-up
        ep["limit_ratio"] = (ep["storage_bytes"] / rnd) / secs if rnd and secs > 0 else None
        # against the faster of the two probes next to this epoch (the one before it, the one after it): a
        # shared disk's speed drifts within minutes, and the run-wide probes may be far from an epoch
        after_ep = ep.get("disk_random_read_gbps_after")
        near = max(before, after_ep if after_ep is not None else after["random_read_gbps"]) * 1e9
        ep["limit_ratio_adjacent"] = (ep["storage_bytes"] / near) / secs if secs > 0 else None
        before = after_ep if after_ep is not None else before
        # against the same reads replayed bare right after the epoch (the disk's speed for this very pattern)
        rep = ep.get("replay_gbps")
        ep["limit_ratio_replay"] = (ep["storage_bytes"] / (rep * 1e9)) / secs if rep and secs > 0 else None
        # against the disk's best depth (16, 64, 256 reads in flight): what one rank could read with reads enough
        best = max(report["disk"].get("best_random_read_gbps") or 0.0, after.get("best_random_read_gbps") or 0.0)
        ep["limit_ratio_best_depth"] = (ep["storage_bytes"] / (best * 1e9)) / secs if best and secs > 0 else None
        if report.get("copy") and ep.get("assemble_gbps"):  # the hit path against copying with the same cores
            ep["assemble_vs_copy"] = ep["assemble_gbps"] / report["copy"]["gbps"]
        if dec and dec["bytes_per_s"] and secs > 0:
            # the slower of the two physical limits: the disk's random reads, the node's cores decoding
            cpu_s = ep["storage_bytes"] * dec["filtered_fraction"] / dec["bytes_per_s"]
            ep["decode_limit_ratio"] = cpu_s / secs
            ep["physical_limit_ratio"] = max(cpu_s, ep["storage_bytes"] / rnd if rnd else 0.0) / secs
    report["limit_ratio"] = [ep["limit_ratio"] for ep in report["solar"]["epochs"]]
    report["limit_ratio_adjacent"] = [ep["limit_ratio_adjacent"] for ep in report["solar"]["epochs"]]
    report["limit_ratio_replay"] = [ep["limit_ratio_replay"] for ep in report["solar"]["epochs"]]
    report["limit_ratio_best_depth"] = [ep["limit_ratio_best_depth"] for ep in report["solar"]["epochs"]]
    if dec:
        report["physical_limit_ratio"] = [ep.get("physical_limit_ratio") for ep in report["solar"]["epochs"]]


def format_report(r: dict) -> str:
    from ..layout.summary import human_bytes
    d = r["disk"]
    a = r.get("disk_after") or d
    dev = r.get("device")
    if dev and dev.get("model") == "conv":
        step = (f"training step: conv net ({dev['parameters']:,} parameters, {dev['amp']}, "
                f"{'channels_last' if dev['channels_last'] else 'contiguous'}) on {dev['device']}"
                + (f" ({dev['device_name']})" if dev.get("device_name") else "")
                + f", input field {dev['field']} as {'x'.join(map(str, dev['image']))}")
    elif dev:
        step = f"training step: none (batches copied to {dev['device']}" + \
            (f" ({dev['device_name']})" if dev.get("device_name") else "") + ")"
    else:
        step = f"step time {r['step_time_s']} s"
    lines = [f"solar bench {r['spec']}: {r['n_samples']:,} samples, {human_bytes(r['dataset_file_bytes'])} on disk; "
             f"{r['world_size']} ranks x local batch {r['local_batch']}, {r['epochs']} epochs, {step}",
             f"page cache before each epoch: {r['cache']}",
             f"memory: {r['memory_method']}",
             f"disk cold random read: {d['random_read_gbps']:.2f} GB/s before the loaders, "
             f"{a['random_read_gbps']:.2f} after ({human_bytes(d['block_bytes'])} blocks, "
             f"{d['random']['depth']} in flight; the ratios use the faster)",
             f"disk cold sequential read: {d['sequential_read_gbps']:.2f} GB/s before, "
             f"{a['sequential_read_gbps']:.2f} after "
             f"({human_bytes(d['sequential']['request_bytes'])} requests, {d['sequential']['depth']} in flight)"]
    dec = r.get("decode")
    if dec:
        da = r.get("decode_after") or dec
        lines.append(f"cpu decode of the filtered blocks: {dec['bytes_per_s'] / 1e9:.2f} GB/s stored before, "
                     f"{da['bytes_per_s'] / 1e9:.2f} after "
                     f"({dec['decoded_bytes_per_s'] / 1e9:.2f} GB/s decoded, {dec['threads']} threads, "
                     f"{dec['filtered_fraction']:.0%} of the stored bytes are filtered)")
    if "solar" in r:
        s = r["solar"]
        pools = f"pools {human_bytes(s['pool_bytes_per_rank'])}" if "pool_bytes_per_rank" in s else \
            f"pools {human_bytes(s['pool_bytes_per_node'])} per node, shared"
        lines.append(f"solar: reader {s['reader']}, buffer {human_bytes(s['buffer_budget_per_rank'])} per rank "
                     f"({pools}), RSS growth {human_bytes(s['rss_growth_bytes_max_rank'])} on the largest rank")
        if "ranks_per_node" in s:
            lines.append(f"solar node plan: {s['policy']}, {s['ranks_per_node']} ranks per node sharing one buffer; "
                         f"node memory {human_bytes(s['memory_need_per_node']['total'])} on the largest node")
        if "memory_need_per_rank" in s:
            from ..memory import MemoryNeed
            from ..schedule.summary import format_memory
            m = s["memory_need_per_rank"]
            need = MemoryNeed(**{k: m[k] for k in ("resident", "staging", "batches", "bookkeeping", "limit",
                                                   "prefetch")})
            lines.append(f"solar memory per rank: {format_memory(need)}; RSS growth "
                         f"{human_bytes(s['rss_growth_bytes_max_rank'])} against that + "
                         f"{human_bytes(m['fixed_overhead'])} fixed overhead")
    for kind, b in r.get("baselines", {}).items():
        if "skipped" in b:
            lines.append(f"baseline {kind}: skipped ({b['skipped']})")
        elif "failed" in b:
            lines.append(f"baseline {kind}: failed ({b['failed']})")
    ran = [k for k, b in r.get("baselines", {}).items() if "epochs" in b]
    lines.append("samples/s per epoch; speedup = solar / torch, vs best = solar / fastest baseline that epoch, "
                 "limit_ratio = (solar's storage bytes / random-read GB/s) / solar's epoch time"
                 + ("; with decode = the slower of that and the cpu decode limit" if dec else ""))
    lines.append("epoch  " + "".join(f"{k:>13}" for k in ran) + "     solar  speedup       vs best (name)"
                 "  limit_ratio" + (" with decode" if dec else "") + "  stall s  solar read")
    n = r["epochs"]
    for e in range(n):
        s = r.get("solar", {}).get("epochs", [{}] * n)[e]
        sp = r.get("speedup", [None] * n)[e]
        sb = r.get("speedup_vs_best", [None] * n)[e]
        best = r.get("best_baseline", [None] * n)[e]
        lr = s.get("limit_ratio")
        lines.append(
            f"{e:5d}  " + "".join(f"{r['baselines'][k]['samples_per_s'][e]:12.1f}"
                                  + ("*" if r['baselines'][k]['epochs'][e].get("partial") else " ") for k in ran)
            + f"  {s.get('samples_per_s', float('nan')):8.1f}  {'x%.2f' % sp if sp else '-':>7}"
            + f"  {('x%.2f (%s)' % (sb, best)) if sb else '-':>19}  {'%.2f' % lr if lr is not None else '-':>11}"
            + (f"  {'%.2f' % s['physical_limit_ratio'] if s.get('physical_limit_ratio') is not None else '-':>11}"
               if dec else "")
            + f"  {s.get('stall_max_s', float('nan')):7.2f}  {human_bytes(s.get('storage_bytes', 0)):>10}")
    if "solar" in r:
        eps = r["solar"]["epochs"]
        lines.append("solar storage bytes read / planned per epoch: "
                     + ", ".join(f"{ep['storage_vs_plan']:.3f}" if ep.get("storage_vs_plan") else "-" for ep in eps)
                     + " (blocks loaded, without the gaps reads coalesce: "
                     + ", ".join(f"{ep['blocks_vs_plan']:.3f}" if ep.get("blocks_vs_plan") else "-" for ep in eps)
                     + f"); {sum(ep.get('verified', 0) for ep in eps)} delivered samples equal to h5py's")
        if any(ep.get("book_wait_max_s") for ep in eps):
            lines.append("solar steps waiting to be booked (s per epoch, the slowest rank: their reads need slots the "
                         "steps before them still hold; node pools: also the other ranks): "
                         + ", ".join(f"{ep.get('book_wait_max_s', 0.0):.2f}" for ep in eps))
        if all(ep.get("disk_random_read_gbps_after") is not None for ep in eps):
            lines.append("disk cold random read after each solar epoch: "
                         + ", ".join(f"{ep['disk_random_read_gbps_after']:.2f}" for ep in eps)
                         + " GB/s; limit_ratio against the faster probe next to each epoch: "
                         + ", ".join(f"{ep['limit_ratio_adjacent']:.2f}" if ep.get("limit_ratio_adjacent") is not None
                                     else "-" for ep in eps))
        if any(ep.get("replay_gbps") for ep in eps):
            lines.append("solar's own reads of each epoch replayed bare right after it: "
                         + ", ".join(f"{ep['replay_gbps']:.2f}" if ep.get("replay_gbps") else "-" for ep in eps)
                         + " GB/s; limit_ratio against that: "
                         + ", ".join(f"{ep['limit_ratio_replay']:.2f}" if ep.get("limit_ratio_replay") is not None
                                     else "-" for ep in eps))
        d0 = r["disk"]
        if d0.get("random_by_depth"):
            lines.append("disk cold random read by reads in flight: "
                         + ", ".join(f"{k}: {v:.2f}" for k, v in d0["random_by_depth"].items())
                         + " GB/s; limit_ratio against the best depth: "
                         + ", ".join(f"{ep['limit_ratio_best_depth']:.2f}" if ep.get("limit_ratio_best_depth")
                                     is not None else "-" for ep in eps))
        if r.get("copy"):
            lines.append(f"hit path: batches assembled at "
                         + ", ".join(f"{ep['assemble_gbps']:.2f}" if ep.get("assemble_gbps") else "-" for ep in eps)
                         + f" GB/s per epoch (slowest rank; {r['solar'].get('cpus', '?')} cpu(s) each), memory copy "
                         f"with those cores {r['copy']['gbps']:.2f} GB/s; storage read per the OS: "
                         + ", ".join(human_bytes(ep.get("os_read_bytes", 0)) for ep in eps))
        if "ranks_per_node" in r["solar"] and r["world_size"] > r["solar"]["ranks_per_node"]:  # several nodes
            lines.append("solar bytes sent between nodes per epoch (as run / planned): "
                         + ", ".join(f"{human_bytes(ep['peer_bytes_sent'])} / {human_bytes(ep['predicted_peer_bytes'])}"
                                     for ep in eps))
    if r.get("au"):
        names = list(r["au"])
        lines.append("au = device-only time of the same steps on one batch already on the device / wall time "
                     "(mean over ranks); the device waits for the loader 1 - au of the time")
        lines.append("epoch  " + "".join(f"{k:>13}" for k in names))
        for e in range(n):
            lines.append(f"{e:5d}  " + "".join(f"{r['au'][k][e]:13.3f}" if r["au"][k][e] is not None else f"{'-':>13}"
                                                for k in names))
    if any(ep.get("partial") for k in ran for ep in r["baselines"][k]["epochs"]):
        lines.append("* stopped after the baseline time limit: rate over the samples delivered until then")
    return "\n".join(lines)
