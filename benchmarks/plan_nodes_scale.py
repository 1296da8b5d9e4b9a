"""Planner speed and memory of the node-pool policies next to `solar` (issue 11; target as the planner's:
1,000,000 samples x 100 epochs x 64 ranks in <= 120 s and <= 8 GB).

    python benchmarks/plan_nodes_scale.py --epochs 6 --ranks-per-node 8 --policies solar solar-node solar-peer

Plans each policy with its lists recorded (as `solar plan` records them; no file written), after a
small run that compiles the kernels; prints seconds per epoch (epochs >= 1: epoch 0 has no
evictions; wall and CPU seconds: on a shared machine CPU time varies less), the extrapolation to
--target-epochs, max RSS, and the steady hit rates.
"""
import argparse
import json
import resource
import time

from solar.scheduler.config import PlanConfig
from solar.scheduler.nodes import NodeMap
from solar.scheduler.run import Demand, PlanRun


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--sample-bytes", type=int, default=196_608)
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--local-batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--target-epochs", type=int, default=100)
    ap.add_argument("--buffer-fraction", type=float, default=0.5)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--policies", nargs="+", default=["solar", "solar-node", "solar-peer"])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    budget = int(a.buffer_fraction * a.samples * a.sample_bytes / a.world_size)
    nodes = NodeMap(a.world_size, a.ranks_per_node)
    t = time.perf_counter()
    for pol in a.policies:  # compile
        PlanRun(Demand.synthetic(1000, a.sample_bytes), PlanConfig(a.world_size, 2, 2, budget), pol, record=True,
                nodes=nodes).advance(2, on_epoch=lambda ep: None)
    out = {"samples": a.samples, "world_size": a.world_size, "ranks_per_node": a.ranks_per_node,
           "local_batch": a.local_batch, "epochs": a.epochs, "buffer_fraction": a.buffer_fraction,
           "compile_s": round(time.perf_counter() - t, 2), "policies": {}}
    d = Demand.synthetic(a.samples, a.sample_bytes)
    cfg = PlanConfig(a.world_size, a.local_batch, a.epochs, budget)
    for pol in a.policies:
        run = PlanRun(d, cfg, pol, record=True, nodes=nodes)
        t0, c0 = time.perf_counter(), time.process_time()
        first = run.advance(1, on_epoch=lambda ep: None)
        t1, c1 = time.perf_counter(), time.process_time()
        rest = run.advance(a.epochs, on_epoch=lambda ep: None)
        t2, c2 = time.perf_counter(), time.process_time()
        per = (t2 - t1) / max(1, a.epochs - 1)
        cpu = (c2 - c1) / max(1, a.epochs - 1)
        res = first
        for k in ("miss_bytes", "demand_bytes", "peer_bytes"):
            getattr(res, k).extend(getattr(rest, k))
        out["policies"][pol] = {
            "epoch0_s": round(t1 - t0, 2), "s_per_epoch": round(per, 3), "cpu_s_per_epoch": round(cpu, 3),
            "extrapolated_s": round((t1 - t0) + per * (a.target_epochs - 1), 1),
            "extrapolated_cpu_s": round((c1 - c0) + cpu * (a.target_epochs - 1), 1),
            "steady_hit_rate": res.steady_hit_rate, "steady_peer_hit_rate": res.steady_peer_hit_rate,
        }
        del run
    out["max_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    print(json.dumps(out, indent=2) if a.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
