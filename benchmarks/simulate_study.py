"""Re-run the planner study tables of docs/planner.md (deterministic; seed 0).

    python benchmarks/simulate_study.py                    # every table (about 1 min on 2 cores)
    python benchmarks/simulate_study.py --tables eps scale --json > study.json

Tables:
  paper      one-block samples at the size of SOLAR.md's reference table (N=16384, P=8, b=32, 5 epochs):
             steady hit rate of every policy
  scale      solar / ideal, one-block samples, P in {8, 64, 512}, f in {0.1, 0.25, 0.5, 0.75}, eps = 0,
             including realistic N for 512 ranks
  eps        what eps in {0, 0.05, 0.1} buys at f in {0.9, 0.95, 1.0}, P in {8, 64}, b = 32:
             steady hit rate of solar and ideal, largest local batch
  layouts    storage bytes per epoch (mean over epochs >= 2) of every policy on a windowed layout
             (The Well) and multi-sample-chunk layouts (PtychoNN multi/gzip, PDEBench multi); generates
             them under --data (default data/study, git-ignored) when missing
  groups     the PtychoNN demo (`make demo` data) with and without grouping the blocks of one sample
  lookahead  nopfs with 1, 2, 4 epochs and the whole job of lookahead, at the paper size
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from solar.scheduler.config import PlanConfig
from solar.scheduler.policies import POLICIES
from solar.scheduler.run import Demand, run_policy
from solar.scheduler.simulate import dataset_bytes, simulate

LAYOUTS = {  # name: (gen arguments, P, b)
    "well": (["well", "--samples", "8", "--size", "32"], 8, 4),
    "well-multi": (["well", "--samples", "8", "--size", "32", "--storage", "multi"], 8, 4),
    "ptychonn-multi": (["ptychonn", "--samples", "4096", "--size", "32", "--storage", "multi"], 8, 8),
    "ptychonn-gzip": (["ptychonn", "--samples", "4096", "--size", "32", "--storage", "gzip"], 8, 8),
    "pdebench-multi": (["pdebench", "--samples", "1024", "--size", "32", "--storage", "multi"], 8, 4),
}


def _fractions(demand, P, fractions):
    total = dataset_bytes(demand)
    return [(f, int(f * total / P)) for f in fractions]


def table_paper(a):
    d = Demand.synthetic(16384, 1000)
    rows = []
    for f, budget in _fractions(d, 8, [0.1, 0.25, 0.5, 0.9]):
        res = simulate(d, 8, 32, 5, budget, policies=POLICIES)
        rows.append({"f": f, **{k: v.get("steady_hit_rate") for k, v in res.items()}})
    return {"command": "solar simulate --samples 16384 --sample-bytes 1000 -P 8 -b 32 --epochs 5 "
                       "--buffer-fraction 0.1 0.25 0.5 0.9", "rows": rows}


def table_scale(a):
    fr = [0.1, 0.25, 0.5, 0.75]
    # (512, 65536): f = 0.1 is 12.8 blocks per rank; f = 0.09375 is exactly 12
    cases = [(8, 16384, 32, 5, fr), (64, 65536, 8, 4, fr), (512, 65536, 8, 4, [0.09375] + fr),
             (512, 524288, 8, 3, fr), (512, 524288, 16, 3, fr)]
    rows = []
    for P, n, b, E, fractions in cases:
        d = Demand.synthetic(n, 1000)
        for f, budget in _fractions(d, P, fractions):
            res = simulate(d, P, b, E, budget, policies=["solar", "ideal"])
            s, i = res["solar"]["steady_hit_rate"], res["ideal"]["steady_hit_rate"]
            rows.append({"P": P, "N": n, "b": b, "epochs": E, "f": f, "blocks_per_rank": budget / 1000,
                         "solar": s, "ideal": i, "ratio": s / i if i else None})
    return {"command": "solar simulate --samples N --sample-bytes 1000 -P P -b b --epochs E "
                       "--buffer-fraction 0.1 0.25 0.5 0.75 --policies solar ideal", "rows": rows}


def table_eps(a):
    rows = []
    for P, n in ((8, 16384), (64, 131072)):
        d = Demand.synthetic(n, 1000)
        for f, budget in _fractions(d, P, [0.9, 0.95, 1.0]):
            ideal = simulate(d, P, 32, 4, budget, policies=["ideal"])["ideal"]["steady_hit_rate"]
            for eps in (0.0, 0.05, 0.1):
                r = simulate(d, P, 32, 4, budget, epsilon=eps, policies=["solar"])["solar"]
                rows.append({"P": P, "N": n, "b": 32, "f": f, "eps": eps, "solar": r["steady_hit_rate"],
                             "ideal": ideal, "ratio": r["steady_hit_rate"] / ideal,
                             "max_local_batch": r["max_local_batch"], "min_local_batch": r["min_local_batch"]})
    return {"command": "solar simulate --samples N --sample-bytes 1000 -P P -b 32 --epochs 4 "
                       "--buffer-fraction 0.9 0.95 1.0 --epsilon EPS --policies solar ideal", "rows": rows}


def _layout(a, name):
    from solar.layout import load_layout
    out = os.path.join(a.data, name)
    if not os.path.exists(os.path.join(out, "solar-layout.json")):
        gen, _, _ = LAYOUTS[name]
        subprocess.run([sys.executable, "-m", "solar", "gen", gen[0], out, *gen[1:], "--no-progress"], check=True,
                       stdout=subprocess.DEVNULL)
    return out, Demand.from_layout(load_layout(out))


def table_layouts(a):
    rows = []
    for name, (gen, P, b) in LAYOUTS.items():
        path, d = _layout(a, name)
        for f, budget in _fractions(d, P, [0.25, 0.5]):
            res = simulate(d, P, b, 3, budget, policies=POLICIES)
            st = {k: (float(np.mean(v["storage_bytes_per_epoch"][1:])) if "error" not in v else None)
                  for k, v in res.items()}
            hr = {k: v.get("steady_hit_rate") for k, v in res.items()}
            others = [v for k, v in st.items() if k not in ("solar", "ideal") and v is not None]
            rows.append({"layout": name, "path": path, "P": P, "b": b, "f": f, "storage_bytes": st,
                         "steady_hit_rate": hr, "solar_lowest_non_ideal": st["solar"] <= min(others)})
    return {"command": "solar gen ...; solar simulate DATA -P 8 -b B --epochs 3 --buffer-fraction 0.25 0.5",
            "generate": {k: "solar gen " + " ".join([v[0][0], os.path.join(a.data, k)] + v[0][1:])
                         for k, v in LAYOUTS.items()}, "rows": rows}


def table_groups(a):
    from solar.layout import load_layout
    path = a.ptychonn
    if not os.path.exists(os.path.join(path, "solar-layout.json")):
        subprocess.run([sys.executable, "-m", "solar", "gen", "ptychonn", path, "--samples", "2048",
                        "--no-progress"], check=True, stdout=subprocess.DEVNULL)
    d = Demand.from_layout(load_layout(path))
    rows = []
    for f, budget in _fractions(d, 8, [0.25, 0.5, 0.9]):
        row = {"f": f}
        for g in (False, True):
            res = simulate(d, 8, 32, 4, budget, policies=["solar", "ideal"], group_blocks=g)
            row["grouped" if g else "per_block"] = res["solar"]["steady_hit_rate"] / res["ideal"]["steady_hit_rate"]
        rows.append(row)
    return {"command": f"solar simulate {path} -P 8 -b 32 --epochs 4 --buffer-fraction 0.25 0.5 0.9 "
                       f"[--no-group-blocks]", "rows": rows}


def table_lookahead(a):
    import dataclasses
    d = Demand.synthetic(16384, 1000)
    rows = []
    for f, budget in _fractions(d, 8, [0.1, 0.25, 0.5, 0.9]):
        cfg = PlanConfig(8, 32, 5, budget)
        row = {"f": f}
        for K in (1, 2, 4, None):
            pol = dataclasses.replace(POLICIES["nopfs"], lookahead=K)
            row[f"nopfs_K{K or 'all'}"] = run_policy(d, cfg, pol).steady_hit_rate
        rows.append(row)
    return {"command": "nopfs with Policy.lookahead = K (run_policy)", "rows": rows}


TABLES = {"paper": table_paper, "scale": table_scale, "eps": table_eps, "layouts": table_layouts,
          "groups": table_groups, "lookahead": table_lookahead}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", nargs="+", choices=list(TABLES), default=list(TABLES))
    ap.add_argument("--data", default="data/study", help="where the layouts table generates its datasets")
    ap.add_argument("--ptychonn", default="data/ptychonn", help="the demo dataset (generated when missing)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    out = {}
    for name in a.tables:
        t = time.perf_counter()
        out[name] = TABLES[name](a)
        out[name]["seconds"] = round(time.perf_counter() - t, 1)
        if not a.json:
            print(f"== {name} ({out[name]['seconds']} s): {out[name]['command']}")
            for row in out[name]["rows"]:
                print("  " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items() if k != "path"))
            sys.stdout.flush()
    if a.json:
        print(json.dumps(out, indent=2))


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) + "}"
    return str(v)


if __name__ == "__main__":
    main()
