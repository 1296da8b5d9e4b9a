"""Does a training loop busy in Python slow solar's loading, and does the GIL switch interval help?

One rank, a plan at ``--buffer-fraction`` (default 0.5), the page cache dropped before every epoch.  Each
step the "training loop" either sleeps ``--step-ms`` (a step that leaves the GIL free: a large model, whose
time is on the GPU) or spins in Python for as long (a step that holds the GIL: a small model's kernel
launches, autocast and optimizer), under each ``--intervals`` value of the loader's ``switch_interval``
(0: Python's own 5 ms).  Configurations run interleaved, ``--rounds`` times; samples/s per epoch.

    python benchmarks/gil_contention.py data/bench-ptycho --samples 4096 --rounds 3 [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def run(schedule: str, data: str, files, mode: str, step_ms: float, interval: float, epochs: int) -> list:
    from solar.bench.cache import drop_file_cache
    from solar.loader import SolarLoader

    def step():
        if mode == "sleep":
            time.sleep(step_ms / 1e3)
        elif mode == "spin":
            end = time.perf_counter() + step_ms / 1e3
            while time.perf_counter() < end:
                pass
    out = []
    with SolarLoader(schedule, data, rank=0, epoch_fence=True, switch_interval=interval) as loader:
        loader.prepare()
        for e in range(epochs):
            loader.set_epoch(e)
            drop_file_cache(files)
            t0, n = time.perf_counter(), 0
            for batch in loader:
                n += int(batch["index"].shape[0])
                step()
            out.append(n / (time.perf_counter() - t0))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", help="a layout spec (HDF5 file or folder), read cold")
    ap.add_argument("--samples", type=int, default=None, help="plan over the first N samples only (default all)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--buffer-fraction", type=float, default=0.5)
    ap.add_argument("--step-ms", type=float, default=8.0, help="the training step's time per batch (ms)")
    ap.add_argument("--intervals", type=float, nargs="+", default=[0.0, 0.0005],
                    help="switch_interval values (0: Python's own)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import solar
    from solar.layout import load_layout
    layout = load_layout(args.data)
    files = list(layout.files)
    configs = [("none", 0.0, 0.0)] + [(m, args.step_ms, i) for m in ("sleep", "spin") for i in args.intervals]
    with tempfile.TemporaryDirectory() as tmp:
        schedule = os.path.join(tmp, "plan.h5")
        solar.plan(layout, world_size=1, local_batch=args.batch, epochs=args.epochs,
                   buffer_fraction=args.buffer_fraction, out=schedule).close()
        runs = {c: [] for c in configs}
        for r in range(args.rounds):
            for c in configs:
                runs[c].append(run(schedule, args.data, files, *c, args.epochs))
                print(f"round {r} {c[0]} {c[1]:g} ms interval {c[2]:g}: "
                      + " / ".join(f"{x:.0f}" for x in runs[c][-1]), file=sys.stderr, flush=True)
    rows = []
    for (mode, ms, interval), rs in runs.items():
        steady = [statistics.mean(x[1:]) for x in rs] if args.epochs > 1 else [x[0] for x in rs]
        rows.append({"step": mode, "step_ms": ms, "switch_interval_s": interval or None,
                     "epoch0_samples_per_s": [x[0] for x in rs], "steady_samples_per_s": steady,
                     "steady_median": statistics.median(steady)})
    rep = {"data": args.data, "batch": args.batch, "epochs": args.epochs, "buffer_fraction": args.buffer_fraction,
           "rounds": args.rounds, "python_default_interval_s": sys.getswitchinterval(), "rows": rows}
    if args.json:
        print(json.dumps(rep, indent=1))
    else:
        print(f"{'step':6} {'ms':>4} {'interval':>9} {'epochs 1+ samples/s (median of rounds)':>40}")
        for row in rows:
            iv = "python" if row["switch_interval_s"] is None else f"{row['switch_interval_s']:g}"
            print(f"{row['step']:6} {row['step_ms']:4g} {iv:>9} {row['steady_median']:40.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
