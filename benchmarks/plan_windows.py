"""Open-ended planning (issue 14): what planning in windows of K epochs costs and changes.

    python benchmarks/plan_windows.py --samples 16384 --world-size 2 --local-batch 32 --epochs 12 --window 3

Plans the same job three ways with :class:`solar.scheduler.run.PlanRun` and prints, per way, wall
time (numba already compiled), seconds per epoch and the hit rate of every epoch:

* ``fixed``: one call, the job ends at ``--epochs`` (its last epoch sees no future);
* ``one-call open``: one call, open-ended (every epoch sees the next one);
* ``windows``: open-ended, ``--window`` epochs per call, state kept between calls.

``windows`` and ``one-call open`` are equal by construction (the test suite checks it on random
jobs); the comparison with ``fixed`` shows the only difference an open end makes: its last epoch.
The seconds per window tell what a rank pays to plan the next window itself instead of reading a
plan made by rank 0.
"""
import argparse
import json
import time

from solar.scheduler.config import PlanConfig
from solar.scheduler.run import Demand, PlanRun


def _plan(d, cfg, open_ended, window):
    run = PlanRun(d, cfg, "solar", record=True, open_ended=open_ended)
    rates, t0 = [], time.perf_counter()
    stops = list(range(window, cfg.epochs, window)) + [cfg.epochs]
    per_window = []
    for stop in stops:
        t = time.perf_counter()
        rates += run.advance(stop, on_epoch=lambda ep: None).hit_rate_per_epoch
        per_window.append(time.perf_counter() - t)
    return {"seconds": time.perf_counter() - t0, "seconds_per_window_max": max(per_window),
            "hit_rate_per_epoch": [round(r, 5) for r in rates]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=16384)
    ap.add_argument("--sample-bytes", type=int, default=196_608)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--local-batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--window", type=int, default=3)
    ap.add_argument("--buffer-fraction", type=float, default=0.5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    d = Demand.synthetic(a.samples, a.sample_bytes)
    budget = int(a.buffer_fraction * a.samples * a.sample_bytes / a.world_size)
    cfg = PlanConfig(a.world_size, a.local_batch, a.epochs, budget)
    PlanRun(Demand.synthetic(1000, a.sample_bytes), PlanConfig(2, 4, 2, budget), record=True).advance(2)  # compile
    out = {"fixed": _plan(d, cfg, False, a.epochs), "one_call_open": _plan(d, cfg, True, a.epochs),
           "windows": _plan(d, cfg, True, a.window)}
    out["windows_equal_one_call"] = out["windows"]["hit_rate_per_epoch"] == out["one_call_open"]["hit_rate_per_epoch"]
    if a.json:
        print(json.dumps(out, indent=1))
        return
    for k in ("fixed", "one_call_open", "windows"):
        r = out[k]
        print(f"{k:14s} {r['seconds']:6.2f} s ({r['seconds'] / a.epochs:.3f} s/epoch, slowest call "
              f"{r['seconds_per_window_max']:.2f} s)  hit rate per epoch: {r['hit_rate_per_epoch']}")
    print(f"windows equal one call: {out['windows_equal_one_call']}")


if __name__ == "__main__":
    main()
