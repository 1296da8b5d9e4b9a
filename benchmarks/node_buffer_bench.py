"""Node-shared buffers at run time: storage bytes read per node against the plan, transfers, time.

    mpiexec -n 4 python benchmarks/node_buffer_bench.py DATA [--ranks-per-node 2] [--policy solar-peer]
        [--fraction 0.25] [--epochs 3] [--local-batch 8] [--split spread] [--threads 2] [--json OUT]

DATA: a folder made by ``solar gen`` (its solar-layout.json).  Rank 0 plans with
:func:`solar.scheduler.node_plan.plan_nodes` (and, for comparison, the per-rank ``solar`` policy's
predicted storage bytes with the same per-rank budget) and broadcasts the node plan; every rank runs a
:class:`~solar.buffer.node_manager.NodeBufferManager` with the ``pread`` reader (``max_gap=0``: bytes
read = stored bytes of the blocks asked for) and the loader's BatchAssembler over every step.  Page
cache warm (no drop): this measures the runtime's overheads and its storage-byte accounting, not a
disk.  Rank 0 prints one JSON object.
"""
import argparse
import json
import sys
import time

from mpi4py import MPI

from solar.buffer.node_manager import NodeBufferManager
from solar.io import get_reader
from solar.layout import load_layout
from solar.loader.assemble import BatchAssembler
from solar.memory import batch_bytes
from solar.scheduler.config import PlanConfig
from solar.scheduler.node_plan import NODE_STATS, plan_nodes
from solar.scheduler.nodes import NodeMap
from solar.scheduler.run import Demand, run_policy


def main():
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--policy", default="solar-peer")
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--local-batch", type=int, default=8)
    p.add_argument("--split", default="spread")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    P, L = comm.size, args.ranks_per_node
    layout = load_layout(args.data)
    demand = Demand.from_layout(layout)
    cfg = PlanConfig(world_size=P, local_batch=args.local_batch, epochs=args.epochs,
                     buffer_bytes=int(layout.block_nbytes.sum() * args.fraction / P))
    plan, per_rank, plan_s = None, None, 0.0
    if comm.rank == 0:
        t0 = time.perf_counter()
        plan, res = plan_nodes(demand, cfg, NodeMap(P, L), args.policy)
        plan_s = time.perf_counter() - t0
        per_rank = run_policy(demand, cfg, "solar").stored_bytes
    plan = comm.bcast(plan, root=0)
    asm = BatchAssembler(layout)

    def assemble(g, samples, lookup):
        out = asm(g, samples, lookup)
        out["index"] = samples
        return out
    reader = get_reader("pread", layout, threads=args.threads, max_gap=0)
    d = {"sample_ptr": layout.sample_ptr, "sample_blocks": layout.sample_blocks, "block_nbytes": layout.block_nbytes,
         "block_stored": layout.block_stored}
    S = plan.steps_per_epoch
    comm.Barrier()
    t0 = time.perf_counter()
    epoch_s = []
    with NodeBufferManager(plan, comm.rank, d, reader, assemble, comm=comm, budget=cfg.buffer_bytes,
                           batch_bytes=batch_bytes(layout, args.local_batch), read_split=args.split,
                           prefetch=args.prefetch) as mgr:
        init_s = time.perf_counter() - t0
        te = time.perf_counter()
        for g in range(plan.n_steps):
            mgr.get(g)
            if (g + 1) % S == 0:
                epoch_s.append(time.perf_counter() - te)
                te = time.perf_counter()
        tot, mem = mgr.totals, mgr.memory
    wall = time.perf_counter() - t0
    reader.close()
    n = comm.rank // L
    node = plan.node(n)
    planned = int(node["stats"][:, NODE_STATS.index("stored_bytes")].sum())
    rows = comm.gather({"rank": comm.rank, "node": n, "bytes_read": tot.bytes_read, "reads": tot.n_reads,
                        "stall_s": round(tot.stall_s, 3), "read_s": round(tot.read_s, 3), "wall_s": round(wall, 3),
                        "init_s": round(init_s, 3), "epoch_s": [round(x, 3) for x in epoch_s],
                        "recv_bytes": tot.recv_bytes, "sent_bytes": tot.sent_bytes, "planned_node_storage": planned,
                        "node_memory": mem.to_dict()}, root=0)
    if comm.rank == 0:
        per_node = {}
        for r in rows:
            per_node.setdefault(r["node"], {"bytes_read": 0, "planned": r["planned_node_storage"]})
            per_node[r["node"]]["bytes_read"] += r["bytes_read"]
        out = {"P": P, "ranks_per_node": L, "policy": args.policy, "fraction": args.fraction, "epochs": args.epochs,
               "local_batch": args.local_batch, "split": args.split, "steps": plan.n_steps, "plan_s": round(plan_s, 3),
               "storage_read": sum(r["bytes_read"] for r in rows), "storage_planned": plan.predicted()["stored_bytes"],
               "per_rank_solar_planned": int(sum(per_rank)), "peer_bytes_moved": sum(r["recv_bytes"] for r in rows),
               "peer_bytes_planned": plan.predicted()["peer_bytes"], "per_node": per_node,
               "dataset_bytes": int(layout.block_nbytes.sum()), "ranks": rows}
        text = json.dumps(out, indent=1)
        print(text)
        if args.json:
            with open(args.json, "w") as f:
                f.write(text)


if __name__ == "__main__":
    sys.exit(main())
