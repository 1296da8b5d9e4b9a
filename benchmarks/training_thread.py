"""Does the loader slow the training thread's own Python?  In-process loader against ``process=True``.

A training step that feeds a GPU spends CPU time in Python on the training thread: kernel launches, autocast,
the optimizer's dispatch, each holding the GIL.  Here that work is ``--ops`` tiny in-place torch operations on
the CPU per step (the same interpreter and dispatcher path as a launch, without a GPU), timed per step.  Modes,
interleaved in each of ``--rounds`` rounds: ``alone`` (the steps' work with no loader), ``in-process``
(``SolarLoader``) and ``process`` (``SolarLoader(process=True)``); one rank, a plan at ``--buffer-fraction``, the
page cache dropped before every epoch.  Printed per mode: samples/s per epoch and the median milliseconds of
one step's work, the median over rounds.

    python benchmarks/training_thread.py D --rounds 3 [--ops 400] [--batch 128] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

MODES = ("alone", "in-process", "process")


def make_work(ops: int):
    import torch
    x = torch.zeros(8)

    def work() -> float:
        t0 = time.perf_counter()
        for _ in range(ops):
            x.add_(1.0)
        return time.perf_counter() - t0
    return work


def run_alone(work, steps: int) -> dict:
    return {"work_ms": 1e3 * statistics.median([work() for _ in range(steps)])}


def run_loader(schedule: str, data: str, files, work, epochs: int, process: bool) -> dict:
    from solar.bench.cache import drop_file_cache
    from solar.loader import SolarLoader
    out = {"samples_per_s": [], "work_ms": [], "startup_s": 0.0}
    t0 = time.perf_counter()
    with SolarLoader(schedule, data, rank=0, epoch_fence=True, process=process) as loader:
        loader.prepare()
        out["startup_s"] = time.perf_counter() - t0
        for e in range(epochs):
            loader.set_epoch(e)
            drop_file_cache(files)
            ws, n = [], 0
            t0 = time.perf_counter()
            for batch in loader:
                n += int(batch["index"].shape[0])
                ws.append(work())
            out["samples_per_s"].append(n / (time.perf_counter() - t0))
            out["work_ms"].append(1e3 * statistics.median(ws))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", help="a layout spec (HDF5 file or folder), read cold")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--buffer-fraction", type=float, default=0.5)
    ap.add_argument("--ops", type=int, default=400, help="tiny torch operations per step (the step's Python)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import torch
    import solar
    from solar.layout import load_layout
    torch.set_num_threads(1)
    layout = load_layout(args.data)
    files = list(layout.files)
    work = make_work(args.ops)
    with tempfile.TemporaryDirectory(prefix="solar-tt-") as tmp:
        schedule = os.path.join(tmp, "plan.h5")
        solar.plan(args.data, world_size=1, local_batch=args.batch, epochs=args.epochs,
                   buffer_fraction=args.buffer_fraction, out=schedule).close()
        rounds = []
        for r in range(args.rounds):
            res = {}
            for mode in MODES:
                if mode == "alone":
                    res[mode] = run_alone(work, 200)
                else:
                    res[mode] = run_loader(schedule, args.data, files, work, args.epochs, mode == "process")
                print(f"round {r} {mode:10s} " + json.dumps({k: ([round(x, 3) for x in v] if isinstance(v, list)
                                                                 else round(v, 3)) for k, v in res[mode].items()}),
                      file=sys.stderr, flush=True)
            rounds.append(res)
    summary = {}
    for mode in MODES:
        w = [x[mode]["work_ms"] for x in rounds]
        if mode == "alone":
            summary[mode] = {"work_ms": statistics.median(w)}
            continue
        summary[mode] = {
            "samples_per_s": [statistics.median(x[mode]["samples_per_s"][e] for x in rounds)
                              for e in range(args.epochs)],
            "work_ms": [statistics.median(x[e] for x in w) for e in range(args.epochs)],
            "startup_s": statistics.median(x[mode]["startup_s"] for x in rounds)}
    if args.json:
        print(json.dumps({"data": args.data, "batch": args.batch, "buffer_fraction": args.buffer_fraction,
                          "ops": args.ops, "rounds": rounds, "median": summary}, indent=1))
        return 0
    print(f"one step's work ({args.ops} torch ops) alone: {summary['alone']['work_ms']:.2f} ms (median of rounds)")
    for mode in MODES[1:]:
        s = summary[mode]
        print(f"{mode:10s} samples/s " + " / ".join(f"{x:,.0f}" for x in s["samples_per_s"])
              + "   work ms " + " / ".join(f"{x:.2f}" for x in s["work_ms"]) + f"   start-up {s['startup_s']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
