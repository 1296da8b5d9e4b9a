"""A small training-like job for the fault tests, run under ``mpiexec -n 3`` or ``srun -n 3``.

    python tests/fault_job.py PLAN DATA --mode raise|decode|kill|none --fail-rank R --fail-step K
                              [--reader pread|mpiio] [--no-abort] [--with]

Every rank iterates its SolarLoader epoch by epoch and, per step, joins an ``allreduce``
(what DDP's gradient average does), so a rank that stops leaves the others waiting in a
collective.  Rank R at global step K: ``raise`` raises RuntimeError in the training loop;
``decode`` makes its reader raise DecodeError inside the prefetch thread (an error inside
solar; with the collective ``mpiio`` reader the others wait inside solar's read);
``kill`` SIGKILLs itself.  ``--no-abort`` passes ``abort_on_error=False``; ``--with``
uses the loader as a context manager.  Prints ``fault_job: done`` on each rank that ends.
"""
import argparse
import os
import signal
import sys

from mpi4py import MPI

from solar.errors import DecodeError
from solar.loader import SolarLoader


def inject_read_fault(loader, after_calls: int):
    """Make ``loader.reader.read_blocks`` raise DecodeError from its ``after_calls``-th call on."""
    real, calls = loader.reader.read_blocks, [0]

    def read_blocks(blocks, out):
        calls[0] += 1
        if calls[0] > after_calls:
            raise DecodeError("injected fault: cannot decode chunk at (3,) of fault.h5:/data")
        return real(blocks, out)

    loader.reader.read_blocks = read_blocks


def train(loader, comm, args):
    for e in range(loader.epoch, loader.epochs):
        loader.set_epoch(e)
        for batch in loader:
            g = loader.cursor - 1
            if comm.rank == args.fail_rank and g == args.fail_step:
                if args.mode == "raise":
                    raise RuntimeError(f"injected fault at step {g}")
                if args.mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
            comm.allreduce(len(batch["index"]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("plan")
    p.add_argument("data")
    p.add_argument("--mode", choices=("raise", "decode", "kill", "none"), default="none")
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--fail-step", type=int, default=3)
    p.add_argument("--reader", default="pread")
    p.add_argument("--no-abort", action="store_true")
    p.add_argument("--with", dest="use_with", action="store_true")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    print(f"fault_job: rank {comm.rank} is pid {os.getpid()}", flush=True)
    opt_out = {"abort_on_error": False} if args.no_abort else {}  # the default is what is tested
    loader = SolarLoader(args.plan, args.data, comm=comm, reader=args.reader, as_torch=False, prefetch=2,
                         **opt_out)
    if args.mode == "decode" and comm.rank == args.fail_rank:
        inject_read_fault(loader, args.fail_step)
    if args.use_with:
        with loader:
            train(loader, comm, args)
    else:
        train(loader, comm, args)
        loader.close()
    print(f"fault_job: done on rank {comm.rank}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
