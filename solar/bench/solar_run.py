"""``solar bench``'s run of solar itself: SolarLoader timed epoch by epoch as the baselines are (page cache
dropped, barrier, timed loop), its delivered samples checked against h5py, its reads replayed bare, and what it
held in memory."""
from __future__ import annotations

import os
import time
from typing import Callable, Optional

import numpy as np

from ..memory import DEFAULT_PREFETCH


def _say(log: Optional[Callable[[str], None]], text: str) -> None:
    """One progress line through ``log`` (the CLI's: rank 0's stderr), if any."""
    if log is not None:
        log(text)


def rss_bytes(pid=None, shmem: bool = True) -> int:
    """This process's (or process ``pid``'s) resident set size now (Linux /proc).  ``shmem=False``: without its
    resident shared memory (``RssShmem``), which another process counted already maps too (a loader process's
    batch segments, mapped by the training process that reads them)."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as fh:
            rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        if not shmem:
            with open(f"/proc/{pid or 'self'}/status") as fh:
                for line in fh:
                    if line.startswith("RssShmem:"):
                        rss -= int(line.split()[1]) * 1024
        return max(rss, 0)
    except (OSError, ValueError, IndexError):
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
                         pin_memory=cuda and not opts.get("process"),  # (a loader process's batches: device= stages)
                         device=consume.device if cuda else None, **opts)
    gpu_buffer = loader.buffer_device if loader.buffer_device is not None and loader.buffer_device.type == "cuda" \
        else None
    # a loader process (process=True) reads and holds the buffer: its reads and memory count with this process's
    child = loader.process_pid
    if child:  # its interpreter and imports (the training process's were in rss0 already), not its buffer yet
        rss0 += rss_bytes(child, shmem=False)

    def read_bytes():
        return os_read_bytes() + (os_read_bytes(child) if child else 0)

    def rss():  # the batch segments both map counted once (in the training process, which reads all of them)
        return rss_bytes() + (rss_bytes(child, shmem=False) if child else 0)
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
            io0 = read_bytes()  # solar.bench.limits
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
            io_read = read_bytes() - io0
            if bar is not None:
                bar.close()
            picked = [(i, {k: v.cpu() for k, v in f.items()}) for i, f in picked]
            util = epoch_au(consume, comm, sizes, step_time, secs)
            peak_rss = max(peak_rss, rss())
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
        st = loader.reader.open_stats() if hasattr(loader.reader, "open_stats") else loader.stats()
        # how this rank's reader read (rank 0's: O_DIRECT or not, native AIO or threads)
        keys = ("direct_io", "buffered_files", "aio", "aio_files", "aio_refused", "aio_submit_refused")
        out["reader_io"] = {k: st[k] for k in keys if k in st}
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
