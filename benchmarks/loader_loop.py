"""Samples/s of a bare loop over SolarLoader, and what the data files leave in the page cache.

    python benchmarks/loader_loop.py data/p plan.h5 --epochs 3 --cold                  # rank 0 alone
    mpiexec -n 2 python benchmarks/loader_loop.py data/p plan.h5 --cold --mpi \\
        --reader-options '{"drop_cache": false, "readahead": true}'

Plans ``SCHEDULE`` first if it does not exist (2 ranks, local batch 32, buffer fraction
0.5).  Per epoch: with ``--cold`` rank 0 drops the data files' pages
(``posix_fadvise(DONTNEED)``) between barriers, then every rank iterates its batches
(numpy, no torch conversion, ``epoch_fence``: nothing of an epoch is read before its
timer starts); the epoch's time is the slowest rank's, with rank 0's process CPU seconds and
context switches (voluntary/involuntary, ``getrusage``) in it.  At the end it prints the loader
stats of rank 0 and how many bytes of each data file are in the page cache (``mincore``),
which is what ``drop_cache`` is about.  Without ``--mpi`` only rank 0's share is run.
"""
import argparse
import json
import os
import resource
import time


import solar
from solar.bench.cache import cached_fraction
from solar.loader import SolarLoader


def cached_bytes(path: str) -> int:
    """Bytes of ``path`` resident in the page cache (solar.bench.cache.cached_fraction: mmap + mincore)."""
    return int(cached_fraction(path) * os.path.getsize(path))


def drop_pages(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data")
    ap.add_argument("schedule")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="drop the data files' pages before every epoch")
    ap.add_argument("--mpi", action="store_true", help="every rank of MPI.COMM_WORLD (default: rank 0 alone)")
    ap.add_argument("--reader-options", default="{}", help="JSON dict, e.g. '{\"drop_cache\": false}'")
    a = ap.parse_args(argv)
    comm = None
    if a.mpi:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    rank = comm.rank if comm else 0
    if rank == 0 and not os.path.exists(a.schedule):
        solar.plan(a.data, world_size=2, local_batch=32, epochs=a.epochs, buffer_fraction=0.5, out=a.schedule).close()
    if comm:
        comm.Barrier()
    files = solar.load_layout(a.data).files
    where = {"comm": comm} if comm else {"rank": 0}
    with SolarLoader(a.schedule, a.data, as_torch=False, epoch_fence=True,
                     reader_options=json.loads(a.reader_options) or None, **where) as loader:
        for e in range(min(a.epochs, loader.epochs)):
            if comm:
                comm.Barrier()
            if a.cold and rank == 0:
                drop_pages(files)
            if comm:
                comm.Barrier()
            loader.set_epoch(e)
            t0, n, r0 = time.perf_counter(), 0, resource.getrusage(resource.RUSAGE_SELF)
            for batch in loader:
                n += len(batch["index"])
            dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
            cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
            if comm:
                dt, n = comm.allreduce(dt, op=MPI.MAX), comm.allreduce(n)
            if rank == 0:
                print(f"epoch {e}: {n / dt:8.0f} samples/s  {dt:6.2f} s  rank 0 CPU {cpu:5.2f} s, context switches "
                      f"{r1.ru_nvcsw - r0.ru_nvcsw} + {r1.ru_nivcsw - r0.ru_nivcsw}  load average "
                      f"{os.getloadavg()[0]:.2f}", flush=True)
        stats = loader.stats()
    if rank == 0:
        print("rank 0:", {k: round(v, 3) if isinstance(v, float) else v for k, v in stats.items()})
        for p in files:
            print(f"page cache: {cached_bytes(p) / 2**20:.1f} MiB of {os.path.getsize(p) / 2**20:.1f} MiB of {p}")


if __name__ == "__main__":
    main()
