"""``solar bench``: our schedule-driven loader against the PyTorch baseline, same file,
same epochs, same batch size, page cache dropped before each epoch; plus the disk's
cold sequential read speed measured in the same run (the physical limit).

Collective over ``comm``: every rank calls :func:`bench` together.
"""
from __future__ import annotations

import os
import time
from typing import Optional

import numpy as np


def rss_bytes() -> int:
    """This process's resident set size now (Linux /proc)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def run_solar(schedule_path: str, layout, *, comm, epochs: int, step_time: float = 0.0, drop_cache=None,
              reader: Optional[str] = None, threads: int = 16, prefetch: int = 4, progress: bool = False,
              abort_on_error: bool = True) -> dict:
    """Time SolarLoader epoch by epoch, measured as the baseline is (drop, barrier, timed loop).

    ``abort_on_error``: passed to SolarLoader (an error on one rank aborts the job)."""
    from ..loader import SolarLoader
    rss0 = rss_bytes()
    loader = SolarLoader(schedule_path, layout, comm=comm, reader=reader, threads=threads, prefetch=prefetch,
                         as_torch=True, epoch_fence=True, abort_on_error=abort_on_error)
    out = {"reader": loader.reader_name, "epochs": []}
    peak_rss = rss0
    try:
        prev = {}
        for e in range(epochs):
            loader.set_epoch(e)
            if drop_cache is not None:
                drop_cache()
            comm.Barrier()
            bar = None
            if progress and comm.rank == 0:
                from tqdm import tqdm
                bar = tqdm(total=len(loader), desc=f"solar epoch {e}", unit="batch", leave=False)
            t0 = time.perf_counter()
            samples = 0
            for batch in loader:
                samples += int(batch["index"].shape[0])
                if step_time:
                    time.sleep(step_time)
                if bar is not None:
                    bar.update()
            secs = time.perf_counter() - t0
            if bar is not None:
                bar.close()
            peak_rss = max(peak_rss, rss_bytes())
            st = loader.stats()
            d = {k: st[k] - prev.get(k, 0) for k in st}
            prev = st
            per_rank = comm.allgather((secs, samples, d["stall_s"], d["bytes_read"], d["bytes_loaded"], d["hits"],
                                       d["misses"], d["plan_violations"], d["read_s"]))
            seconds = max(x[0] for x in per_rank)
            total = sum(x[1] for x in per_rank)
            read = sum(x[3] for x in per_rank)
            out["epochs"].append(dict(
                epoch=e, global_samples=total, seconds=seconds, samples_per_s=total / seconds if seconds else 0.0,
                stall_max_s=max(x[2] for x in per_rank), storage_bytes=read,
                storage_bytes_per_s=read / seconds if seconds else 0.0,
                decoded_bytes_loaded=sum(x[4] for x in per_rank), block_hits=sum(x[5] for x in per_rank),
                block_misses=sum(x[6] for x in per_rank), plan_violations=sum(x[7] for x in per_rank)))
        out["pool_bytes_per_rank"] = loader.buffer.pools.capacity_bytes if loader.buffer else 0
        out["buffer_budget_per_rank"] = loader.schedule.buffer_bytes
        out["rss_growth_bytes_max_rank"] = comm.allreduce(peak_rss - rss0, op=_max())
    finally:
        loader.close()
    return out


def _max():
    from mpi4py import MPI
    return MPI.MAX


def bench(spec: str, *, comm, epochs: int = 3, local_batch: int = 32, buffer_fraction: Optional[float] = 0.5,
          buffer_per_rank=None, seed: int = 0, cold: bool = True, cache_mode: str = "file", step_time: float = 0.0,
          num_workers: int = 2, reader: Optional[str] = None, threads: int = 16, prefetch: int = 4,
          schedule: Optional[str] = None, loaders=("solar", "baseline"), progress: bool = False,
          abort_on_error: bool = True) -> dict:
    """Run the comparison; returns the report (the same on every rank).

    ``abort_on_error=False``: SolarLoader leaves an error on one rank to the caller (no MPI abort)."""
    from ..layout import load_layout
    from ..schedule import plan
    from .baseline import run_baseline
    from .cache import make_cache_dropper
    from .disk import cold_sequential_read
    layout = load_layout(spec)
    P = comm.Get_size()
    paths = list(layout.files)
    drop, how = make_cache_dropper(paths, cache_mode if cold else "none", comm=comm)
    report = {"spec": spec, "world_size": P, "local_batch": local_batch, "epochs": epochs, "seed": seed,
              "step_time_s": step_time, "cache": how, "dataset_file_bytes": sum(os.path.getsize(p) for p in paths),
              "n_samples": layout.n_samples}
    # 1. the plan (rank 0 writes it; every rank reads its slice)
    schedule = schedule or os.path.join(os.path.dirname(os.path.abspath(paths[0])),
                                        f".solar-bench-P{P}-b{local_batch}-E{epochs}.h5")
    err = None
    if comm.rank == 0:
        try:
            t0 = time.perf_counter()
            plan(layout, world_size=P, local_batch=local_batch, epochs=epochs, buffer_fraction=buffer_fraction,
                 buffer_per_rank=buffer_per_rank, seed=seed, out=schedule, progress=progress).close()
            report["plan_s"] = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            err = exc
    err = comm.bcast(err, root=0)
    if err is not None:
        raise err
    report["plan_s"] = comm.bcast(report.get("plan_s"), root=0)
    report["schedule"] = schedule
    # 2. the physical limit, cold (rank 0 alone, the others wait)
    disk = cold_sequential_read(paths) if comm.rank == 0 else None
    report["disk"] = comm.bcast(disk, root=0)
    comm.Barrier()
    # 3. the loaders
    if "solar" in loaders:
        report["solar"] = run_solar(schedule, layout, comm=comm, epochs=epochs, step_time=step_time,
                                    drop_cache=drop, reader=reader, threads=threads, prefetch=prefetch,
                                    progress=progress, abort_on_error=abort_on_error)
    if "baseline" in loaders:
        report["baseline"] = {"num_workers": num_workers, "epochs": run_baseline(
            spec, comm=comm, local_batch=local_batch, epochs=epochs, seed=seed, num_workers=num_workers,
            step_time=step_time, drop_cache=drop, progress=progress)}
    if "solar" in loaders and "baseline" in loaders:
        report["speedup"] = [s["samples_per_s"] / b["samples_per_s"] if b["samples_per_s"] else None
                             for s, b in zip(report["solar"]["epochs"], report["baseline"]["epochs"])]
    bw = report["disk"]["bytes_per_s"]
    if "solar" in report and bw:
        for ep in report["solar"]["epochs"]:
            ep["storage_vs_disk"] = ep["storage_bytes_per_s"] / bw
    return report


def format_report(r: dict) -> str:
    from ..layout.summary import human_bytes
    lines = [f"solar bench {r['spec']}: {r['n_samples']:,} samples, {human_bytes(r['dataset_file_bytes'])} on disk; "
             f"{r['world_size']} ranks x local batch {r['local_batch']}, {r['epochs']} epochs, step time "
             f"{r['step_time_s']} s",
             f"page cache before each epoch: {r['cache']}",
             f"disk cold sequential read: {r['disk']['bytes_per_s'] / 1e9:.2f} GB/s ({r['disk']['method']})"]
    if "solar" in r:
        s = r["solar"]
        lines.append(f"solar: reader {s['reader']}, buffer {human_bytes(s['buffer_budget_per_rank'])} per rank "
                     f"(pools {human_bytes(s['pool_bytes_per_rank'])}), RSS growth {human_bytes(s['rss_growth_bytes_max_rank'])}"
                     f" on the largest rank")
    lines.append("epoch  baseline samples/s  solar samples/s  speedup  solar stall s  solar read  read GB/s (x disk)")
    n = r["epochs"]
    for e in range(n):
        b = r.get("baseline", {}).get("epochs", [{}] * n)[e]
        s = r.get("solar", {}).get("epochs", [{}] * n)[e]
        sp = r.get("speedup", [None] * n)[e]
        lines.append(
            f"{e:5d}  {b.get('samples_per_s', float('nan')):18.1f}  {s.get('samples_per_s', float('nan')):15.1f}  "
            f"{'x%.2f' % sp if sp else '   -':>7}  {s.get('stall_max_s', float('nan')):13.2f}  "
            f"{human_bytes(s.get('storage_bytes', 0)):>10}  {s.get('storage_bytes_per_s', 0) / 1e9:6.2f} "
            f"(x{s.get('storage_vs_disk', 0):.2f})")
    return "\n".join(lines)
