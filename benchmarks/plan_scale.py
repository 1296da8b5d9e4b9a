"""Planner speed and memory at scale (issue: planner; target 1,000,000 x 100 epochs x 64 ranks in <= 120 s, 8 GB).

    python benchmarks/plan_scale.py --samples 1000000 --world-size 64 --local-batch 32 --epochs 100

Prints wall time (numba compile measured separately), seconds per epoch, max RSS, and the steady hit
rate of `solar` next to the `torch` baseline's, measured in the same run on the first epochs.
"""
import argparse
import json
import resource
import time

from solar.scheduler.config import PlanConfig
from solar.scheduler.run import Demand, run_policy


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--sample-bytes", type=int, default=196_608)
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--local-batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--buffer-fraction", type=float, default=0.5)
    ap.add_argument("--baseline-epochs", type=int, default=3, help="epochs of the torch baseline run")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    d = Demand.synthetic(a.samples, a.sample_bytes)
    budget = int(a.buffer_fraction * a.samples * a.sample_bytes / a.world_size)
    t = time.perf_counter()
    run_policy(Demand.synthetic(1000, a.sample_bytes), PlanConfig(2, 4, 2, budget), "solar", record=True,
               on_epoch=lambda ep: None)
    compile_s = time.perf_counter() - t
    cfg = PlanConfig(a.world_size, a.local_batch, a.epochs, budget)
    t = time.perf_counter()
    ours = run_policy(d, cfg, "solar", record=True, on_epoch=lambda ep: None, progress=True)
    wall = time.perf_counter() - t
    base_cfg = PlanConfig(a.world_size, a.local_batch, min(a.epochs, a.baseline_epochs), budget)
    base = run_policy(d, base_cfg, "torch")
    out = {
        "samples": a.samples, "world_size": a.world_size, "local_batch": a.local_batch, "epochs": a.epochs,
        "buffer_fraction": a.buffer_fraction, "compile_s": round(compile_s, 2), "plan_s": round(wall, 2),
        "s_per_epoch": round(wall / a.epochs, 3),
        "max_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "solar_steady_hit_rate": ours.steady_hit_rate, "torch_steady_hit_rate": base.steady_hit_rate,
        "hit_rate_ratio": ours.steady_hit_rate / base.steady_hit_rate if base.steady_hit_rate else None,
    }
    print(json.dumps(out, indent=2) if a.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
