"""Planner speed and memory at scale (issue: planner; target 1,000,000 x 100 epochs x 64 ranks in <= 120 s, 8 GB).

    python benchmarks/plan_scale.py --samples 1000000 --world-size 64 --local-batch 32 --epochs 100

Plans with `solar.plan` and writes the schedule file (to --out, default a temporary file that is
deleted afterwards; --no-file plans without writing).  Prints wall time (numba compile measured
separately), seconds per epoch, schedule file size, max RSS, and the steady hit rate of `solar` next
to the `torch` baseline's, measured in the same run on the first epochs.
"""
import argparse
import json
import os
import resource
import tempfile
import time

import solar

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
    ap.add_argument("--out", help="schedule file to write (default: a temporary file, removed afterwards)")
    ap.add_argument("--no-file", action="store_true", help="plan only, do not write a schedule file")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    d = Demand.synthetic(a.samples, a.sample_bytes)
    budget = int(a.buffer_fraction * a.samples * a.sample_bytes / a.world_size)
    t = time.perf_counter()
    run_policy(Demand.synthetic(1000, a.sample_bytes), PlanConfig(2, 4, 2, budget), "solar", record=True,
               on_epoch=lambda ep: None)
    cfg = PlanConfig(a.world_size, a.local_batch, a.epochs, budget)
    solar.plan(Demand.synthetic(1000, a.sample_bytes), world_size=2, local_batch=4, epochs=2,
               buffer_per_rank=budget).close()  # compiles the file packing kernels too
    compile_s = time.perf_counter() - t
    out_path = a.out or os.path.join(tempfile.mkdtemp(prefix="solar-scale-"), "plan.h5")
    t = time.perf_counter()
    if a.no_file:
        ours = run_policy(d, cfg, "solar", record=True, on_epoch=lambda ep: None, progress=True)
        file_bytes = 0
    else:
        sched = solar.plan(d, world_size=a.world_size, local_batch=a.local_batch, epochs=a.epochs,
                           buffer_per_rank=budget, out=out_path, progress=True)
        ours = sched.predicted()
        sched.close()
        file_bytes = os.path.getsize(out_path)
        if not a.out:
            os.unlink(out_path)
            os.rmdir(os.path.dirname(out_path))
    wall = time.perf_counter() - t
    ours_steady = ours["steady_hit_rate"] if isinstance(ours, dict) else ours.steady_hit_rate
    base_cfg = PlanConfig(a.world_size, a.local_batch, min(a.epochs, a.baseline_epochs), budget)
    base = run_policy(d, base_cfg, "torch")
    out = {
        "samples": a.samples, "world_size": a.world_size, "local_batch": a.local_batch, "epochs": a.epochs,
        "buffer_fraction": a.buffer_fraction, "compile_s": round(compile_s, 2), "plan_s": round(wall, 2),
        "s_per_epoch": round(wall / a.epochs, 3), "schedule_file_bytes": file_bytes,
        "max_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "solar_steady_hit_rate": ours_steady, "torch_steady_hit_rate": base.steady_hit_rate,
        "hit_rate_ratio": ours_steady / base.steady_hit_rate if base.steady_hit_rate else None,
    }
    print(json.dumps(out, indent=2) if a.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
