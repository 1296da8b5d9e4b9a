"""``solar bench``: loader-only benchmark of solar against DataLoader + DistributedSampler + h5py."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys

from ..scheduler.config import parse_bytes

EPILOG = """\
Run under MPI, one process per training rank:
  mpiexec -n 2 solar bench data/ptychonn --epochs 3 --buffer-fraction 0.5 --cold --json
The training step is replaced by --step-time seconds of sleep (default 0: loader only).
--cold drops the dataset files' pages (posix_fadvise DONTNEED, no root needed) before each
epoch, on one rank per node; --cache-mode system drops the whole page cache (root).
The JSON has per-epoch samples/s of both loaders and their ratio as "speedup".
An error on one rank prints "solar bench: error on rank R: ..." and aborts every rank
(MPI_Abort), so no rank waits in a collective forever; --no-abort-on-error turns that off.
"""


def add_parser(sub):
    p = sub.add_parser("bench", help="benchmark the solar loader against the PyTorch baseline (under mpiexec)",
                       description="Loader-only benchmark: solar (plan + buffer + readers) vs DataLoader + "
                                   "DistributedSampler + h5py, same file, epochs and batch size.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", metavar="SPEC", help="layout spec, folder holding solar-layout.json, or HDF5 file")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("-b", "--local-batch", type=int, default=32)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--buffer-fraction", type=float, help="aggregate buffer / dataset bytes (default 0.5)")
    g.add_argument("--buffer-per-rank", type=parse_bytes)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cold", action="store_true", help="drop the page cache before each epoch")
    p.add_argument("--cache-mode", choices=("file", "system"), default="file",
                   help="with --cold: drop the dataset files' pages (default) or the whole page cache (root)")
    p.add_argument("--step-time", type=float, default=0.0, help="seconds of simulated training per step")
    p.add_argument("--num-workers", type=int, default=2, help="baseline DataLoader workers per rank")
    p.add_argument("--reader", help="solar reader backend (default: chosen for the layout and file system)")
    p.add_argument("--threads", type=int, default=16, help="solar reader threads per rank (I/O depth)")
    p.add_argument("--prefetch", type=int, default=4, help="solar steps prefetched ahead")
    p.add_argument("--schedule", help="schedule file to write (default: next to the data)")
    p.add_argument("--only", choices=("solar", "baseline"), help="run one loader only")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-abort-on-error", dest="abort_on_error", action="store_false",
                   help="do not MPI_Abort every rank when one fails (the default does, so none waits forever)")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    from mpi4py import MPI
    from ..bench.compare import bench, format_report
    from ..mpi import abort_on_error
    comm = MPI.COMM_WORLD
    guard = abort_on_error(comm, prefix="solar bench") if args.abort_on_error else contextlib.nullcontext()
    with guard:
        frac = args.buffer_fraction if args.buffer_fraction is not None or args.buffer_per_rank else 0.5
        rep = bench(args.spec, comm=comm, epochs=args.epochs, local_batch=args.local_batch, buffer_fraction=frac,
                    buffer_per_rank=args.buffer_per_rank, seed=args.seed, cold=args.cold,
                    cache_mode=args.cache_mode, step_time=args.step_time, num_workers=args.num_workers,
                    reader=args.reader, threads=args.threads, prefetch=args.prefetch, schedule=args.schedule,
                    loaders=(args.only,) if args.only else ("solar", "baseline"),
                    progress=sys.stderr.isatty() and comm.rank == 0, abort_on_error=args.abort_on_error)
    if comm.rank == 0:
        print(json.dumps(rep, indent=2) if args.json else format_report(rep))
    return 0
