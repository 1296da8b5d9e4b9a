#!/usr/bin/env python
"""The one-screen report that ends ``make demo``: what ``solar bench`` measured (loader only, cold page
cache: solar against the DataLoader baselines), what the 2-rank training of ``train_ptychonn.py``
through solar did (buffer hit rate against the ideal policy's for the same job, samples/s, held-out
loss against the constant predictor's), and where the plots are.

    python examples/demo_report.py --bench bench.json --simulate train-simulate.json \\
        --train train.jsonl --plots hit-rate.png train-loss.png
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def load_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        sys.exit(f"demo_report: error: cannot read {path}: {exc}")


def load_train(path: str) -> list:
    """The per-epoch records of a ``--log-json`` file (the held-out evaluation before training is epoch -1)."""
    try:
        with open(path) as f:
            recs = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as exc:
        sys.exit(f"demo_report: error: cannot read {path}: {exc}")
    return [r for r in recs if "index" not in r]


def ideal_hit_rates(sim: dict) -> dict:
    """``{policy: hit rate per epoch}`` of the first buffer size ``solar simulate --json`` reports."""
    row = sim["rows"][0]
    return {name: res["hit_rate_per_epoch"] for name, res in row["results"].items()}


def bench_lines(bench: dict) -> list:
    """solar vs the best baseline, loader only, per epoch."""
    out = [f"loader only (solar bench, {bench['world_size']} ranks, page cache dropped before each epoch):"]
    base = {k: b["samples_per_s"] for k, b in bench.get("baselines", {}).items() if "samples_per_s" in b}
    for e, s in enumerate(bench.get("solar", {}).get("epochs", [])):
        best = max(base, key=lambda k: base[k][e]) if base else None
        vs = f"best baseline {best} {base[best][e]:8.1f} samples/s, x{s['samples_per_s'] / base[best][e]:.2f}" \
            if best and base[best][e] else "no baseline ran"
        out.append(f"  epoch {e}: solar {s['samples_per_s']:8.1f} samples/s;  {vs}")
    return out


def train_lines(epochs: list, hits: dict) -> list:
    before = next((r for r in epochs if r.get("epoch") == -1), None)
    trained = [r for r in epochs if r.get("epoch", -1) >= 0]
    out = [f"training (examples/train_ptychonn.py through solar, {len(trained)} epochs):"]
    for r in trained:
        e = r["epoch"]
        hit = r.get("buffer_hit_rate")
        ideal = hits.get("ideal", [None] * (e + 1))[e] if e < len(hits.get("ideal", [])) else None
        mine = hits.get("solar-peer") or hits.get("solar") or []  # the node plan's policy where ranks share a node
        planned = mine[e] if e < len(mine) else None
        h = "-" if hit is None else f"{hit:.1%}"
        # solar simulate plans with the whole budget; the training's plan keeps the queued batches inside it
        h += "" if ideal is None else f" (simulated at the whole budget: solar {planned:.1%}, ideal {ideal:.1%})"
        v = r.get("valid", {})
        loss = f"held-out {v['model']['total']:.4f} vs constant {v['constant']['total']:.4f}" if v else ""
        out.append(f"  epoch {e}: buffer hits {h};  {r['samples_per_s']:.1f} samples/s;  loader stall "
                   f"{r['stall_s_max']:.2f} s;  train loss {r['loss']:.4f};  {loss}")
    if before and trained and "valid" in trained[-1]:
        b, a, c = (before["valid"]["model"]["total"], trained[-1]["valid"]["model"]["total"],
                   trained[-1]["valid"]["constant"]["total"])
        verdict = "learns" if a < 0.9 * c else "does NOT beat the constant predictor"
        out.append(f"  held-out loss {b:.4f} -> {a:.4f}; constant predictor {c:.4f} ({a / c:.0%} of it): {verdict}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", help="solar bench --json output")
    p.add_argument("--simulate", help="solar simulate --json output for the training job (policies solar, ideal)")
    p.add_argument("--train", required=True, help="train_ptychonn.py --log-json output")
    p.add_argument("--plots", nargs="*", default=[], help="plot files to list")
    args = p.parse_args(argv)
    lines = ["", "=" * 30 + " solar demo " + "=" * 30]
    if args.bench:
        lines += bench_lines(load_json(args.bench))
    lines += train_lines(load_train(args.train), ideal_hit_rates(load_json(args.simulate)) if args.simulate else {})
    lines.append("plots: " + ", ".join(f"{x}{'' if os.path.exists(x) else ' (missing)'}" for x in args.plots))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
