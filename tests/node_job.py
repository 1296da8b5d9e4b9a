"""A training-like job over node-shared buffers, run by tests/test_node_buffer.py under ``mpiexec -n 4``.

    python tests/node_job.py DATA [--ranks-per-node 2] [--policy solar-peer] [--mode none|raise|read|leave]
                             [--fail-rank R] [--fail-step K] [--abort] [--slow-rank R] [--slow-s X]

Rank 0 plans (``plan_nodes``) and broadcasts the plan; every rank runs a NodeBufferManager and takes
every step, checking each batch against h5py.  ``raise``: rank R raises RuntimeError in its loop at
step K (inside ``with manager``); ``read``: rank R's reader raises DecodeError from its K-th call
(inside the prefetch thread); ``leave``: rank R stops after step K and closes its manager (a loop that
breaks while the others go on).  Without ``--abort`` each rank that gets an exception prints
``node_job: rank r raised <Type>: <message>`` and ends with status 3 on its own (no collective:
that every rank gets there proves none waits for the failed one).  With ``--abort`` the loop runs
under :func:`solar.mpi.abort_on_error` with an ``allreduce`` per step, as a DDP job under the
loader's abort hooks.  ``--linger S``: a rank that raised waits S seconds before it exits (hydra
kills the job when one rank leaves; the others may still be finishing).  ``--slow-rank``: that rank
sleeps ``--slow-s`` seconds per step.  Prints
``node_job: rank r done <steps> <bytes read>`` on a rank that ends normally.
"""
import argparse
import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import h5py_sample  # noqa: E402
from solar.buffer.node_manager import NodeBufferManager  # noqa: E402
from solar.errors import DecodeError  # noqa: E402
from solar.io import get_reader  # noqa: E402
from solar.layout import load_layout  # noqa: E402
from solar.loader.assemble import BatchAssembler  # noqa: E402
from solar.mpi import abort_on_error  # noqa: E402
from solar.scheduler.config import PlanConfig  # noqa: E402
from solar.scheduler.node_plan import plan_nodes  # noqa: E402
from solar.scheduler.nodes import NodeMap  # noqa: E402
from solar.scheduler.run import Demand  # noqa: E402


def build(args, comm):
    layout = load_layout(args.data)
    P = comm.size
    cfg = PlanConfig(world_size=P, local_batch=2, epochs=2,
                     buffer_bytes=int(layout.block_nbytes.sum() * args.fraction / P))
    plan = plan_nodes(Demand.from_layout(layout), cfg, NodeMap(P, args.ranks_per_node), args.policy)[0] \
        if comm.rank == 0 else None
    return layout, cfg, comm.bcast(plan, root=0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--policy", default="solar-peer")
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--mode", choices=("none", "raise", "read", "leave"), default="none")
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--fail-step", type=int, default=3)
    p.add_argument("--abort", action="store_true")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-s", type=float, default=0.0)
    p.add_argument("--linger", type=float, default=0.0)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    layout, cfg, plan = build(args, comm)
    reader = get_reader("pread", layout, threads=2, max_gap=0)
    if args.mode == "read" and comm.rank == args.fail_rank:
        real, calls = reader.read_blocks, [0]

        def read_blocks(blocks, out):
            calls[0] += 1
            if calls[0] >= args.fail_step:
                raise DecodeError("injected fault: cannot decode chunk (0, 0) of node_job.h5:/data")
            return real(blocks, out)
        reader.read_blocks = read_blocks
    asm = BatchAssembler(layout)
    ref = {}

    def assemble(g, samples, lookup):
        out = asm(g, samples, lookup)
        out["index"] = samples
        return out

    demand = {"sample_ptr": layout.sample_ptr, "sample_blocks": layout.sample_blocks,
              "block_nbytes": layout.block_nbytes, "block_stored": layout.block_stored}

    def loop(mgr):
        for g in range(plan.n_steps):
            batch = mgr.get(g)
            for i, s in enumerate(batch["index"].tolist()):
                if s not in ref:
                    ref[s] = h5py_sample(layout, s)
                for k, v in ref[s].items():
                    if not np.array_equal(batch[k][i], v):
                        raise AssertionError(f"rank {comm.rank} step {g} sample {s} field {k} differs from h5py")
            if comm.rank == args.fail_rank and g == args.fail_step and args.mode == "raise":
                raise RuntimeError(f"injected fault at step {g}")
            if comm.rank == args.fail_rank and g == args.fail_step and args.mode == "leave":
                return None
            if comm.rank == args.slow_rank:
                time.sleep(args.slow_s)
            if args.abort:
                comm.allreduce(len(batch["index"]))
        return mgr.totals

    if args.abort:
        with abort_on_error(comm, prefix="node_job"):
            mgr = NodeBufferManager(plan, comm.rank, demand, reader, assemble, comm=comm, budget=cfg.buffer_bytes)
            with mgr:
                tot = loop(mgr)
    else:
        try:
            mgr = NodeBufferManager(plan, comm.rank, demand, reader, assemble, comm=comm, budget=cfg.buffer_bytes,
                                    timeout=60)
            with mgr:
                tot = loop(mgr)
            if tot is None:  # --mode leave: this rank closed its buffer early, as a loop that breaks
                print(f"node_job: rank {comm.rank} left after step {args.fail_step}", flush=True)
                time.sleep(args.linger)
                leave()
        except Exception as exc:  # noqa: BLE001 - reported, then this rank ends on its own
            print(f"node_job: rank {comm.rank} raised {type(exc).__name__}: {exc}", flush=True)
            time.sleep(args.linger)  # the launcher ends the job when a rank leaves: let the others finish first
            leave()
    print(f"node_job: rank {comm.rank} done {tot.steps} {tot.bytes_read}", flush=True)


def leave():
    """End this rank at once (no interpreter teardown, no buffer clean-up), but through MPI_Finalize: the other ranks
    finalize as they exit, and MPICH's Finalize waits for every rank; a rank that never reached it left them waiting
    until the test's time limit (the job "still ran", 2 runs in 10)."""
    from mpi4py import MPI
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
