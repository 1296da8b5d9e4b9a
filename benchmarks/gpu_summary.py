#!/usr/bin/env python
"""The summary of ``benchmarks/gpu_check.sh``: reads what its steps left in OUTDIR (``train.jsonl``,
``bench-*.json``) and the step list, writes ``summary.json`` and ``summary.md`` there and prints the latter.

    python benchmarks/gpu_summary.py OUTDIR --steps steps.tsv --gpu NAME --device cuda ...
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict
from typing import Dict, List, Optional

#: the all-resident loop's steps/s against the same loop fed one resident batch (issue 23's target)
RESIDENT_TARGET = 0.8


#: terminal escape sequences: an Open MPI ``mpiexec`` writes one (``ESC[0m``) with each rank's forwarded output,
#: so before rank 0's report where other ranks finish first
ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def parse_report(text: str):
    """The first JSON document in ``text``, escape sequences and whatever comes before its ``{`` left out."""
    text = ESCAPE.sub("", text)
    start = text.find("{")
    if start < 0:
        raise ValueError("no JSON document in the output")
    return json.JSONDecoder().raw_decode(text[start:])[0]


def load_report(path: str):
    """The JSON document a command printed first in ``path`` (see ``parse_report``)."""
    return parse_report(open(path).read())


def read_steps(path: Optional[str]) -> List[dict]:
    out = []
    if path and os.path.exists(path):
        for line in open(path):
            name, status, secs = line.rstrip("\n").split("\t")
            out.append(dict(step=name, status=status, seconds=float(secs)))
    return out


def read_epochs(path: str) -> Dict[str, List[dict]]:
    """``{run: [epoch records in order]}`` (held-out evaluation before training, epoch -1, left out)."""
    runs: Dict[str, List[dict]] = defaultdict(list)
    if os.path.exists(path):
        for line in open(path):
            rec = json.loads(line)
            if rec.get("epoch", -1) >= 0 and "samples_per_s" in rec:
                runs[rec["run"]].append(rec)
    return dict(runs)


def steps_per_s(rec: dict) -> float:
    return rec["steps"] / rec["seconds"] if rec["seconds"] > 0 else 0.0


def resident_ratio(runs: Dict[str, List[dict]]) -> Optional[dict]:
    """Epochs >= 1 of the all-resident plan against the same epochs of the loop fed one resident batch."""
    a, b = runs.get("train-all-resident", [])[1:], runs.get("train-resident-batch", [])[1:]
    if not a or not b:
        return None
    fed = sum(r["steps"] for r in a) / sum(r["seconds"] for r in a)
    ceiling = sum(r["steps"] for r in b) / sum(r["seconds"] for r in b)
    return dict(all_resident_steps_per_s=fed, resident_batch_steps_per_s=ceiling, ratio=fed / ceiling,
                target=RESIDENT_TARGET, met=fed / ceiling >= RESIDENT_TARGET)


def fidelity(runs: Dict[str, List[dict]]) -> Optional[dict]:
    """Per-epoch training and held-out losses of the fp32 deterministic runs of the two loaders."""
    a, b = runs.get("fidelity-solar"), runs.get("fidelity-baseline")
    if not a or not b:
        return None
    rows = []
    for x, y in zip(a, b):
        row = dict(epoch=x["epoch"], solar=x["loss"], baseline=y["loss"],
                   rel_diff=abs(x["loss"] - y["loss"]) / max(abs(y["loss"]), 1e-12))
        if "valid" in x and "valid" in y:
            row.update(held_out_solar=x["valid"]["model"]["total"], held_out_baseline=y["valid"]["model"]["total"])
        rows.append(row)
    return dict(epochs=rows, max_rel_diff=max(r["rel_diff"] for r in rows))


def bench_rows(rep: dict) -> List[dict]:
    """Per loader and epoch: samples/s, au, gpu_wait_fraction."""
    out = []
    loaders = [("solar", rep.get("solar", {}).get("epochs", []))]
    loaders += [(k, b["epochs"]) for k, b in rep.get("baselines", {}).items() if "epochs" in b]
    for name, eps in loaders:
        for ep in eps:
            out.append(dict(loader=name, epoch=ep["epoch"], samples_per_s=ep["samples_per_s"], au=ep.get("au"),
                            gpu_wait_fraction=ep.get("gpu_wait_fraction"), partial=bool(ep.get("partial"))))
    return out


def _report(path: str):
    """The report (or merged reports) in ``path``; None where the file is missing, empty or holds none (said on
    stderr)."""
    if not (os.path.exists(path) and os.path.getsize(path)):
        return None
    try:
        return load_report(path)
    except ValueError as e:
        print(f"gpu_summary: {os.path.basename(path)}: {e}", file=sys.stderr)
        return None


def node_rows(path: str) -> dict:
    """What the ``nodes`` section keeps of each of its ``solar bench`` reports (files ``nodes-<data>-<mode>.json``
    in ``path``): per epoch solar's samples/s, storage bytes (solar's and the OS's), the limit ratio against
    the best depth, and the best baseline's samples/s and name where baselines ran."""
    out = {}
    if not path or not os.path.isdir(path):
        return out
    for name in sorted(os.listdir(path)):
        if not (name.startswith("nodes-") and name.endswith(".json")):
            continue
        rep = _report(os.path.join(path, name))
        if rep is None:
            continue
        sol = rep.get("solar", {})
        eps = sol.get("epochs", [])
        best = rep.get("best_baseline") or [None] * len(eps)
        out[name[len("nodes-"):-len(".json")]] = dict(
            ranks=rep.get("world_size"), ranks_per_node=sol.get("ranks_per_node"), policy=sol.get("policy"),
            file_bytes=rep.get("dataset_file_bytes"),
            samples_per_s=[e["samples_per_s"] for e in eps], storage_bytes=[e.get("storage_bytes") for e in eps],
            os_read_bytes=[e.get("os_read_bytes") for e in eps],
            limit_ratio_best_depth=[e.get("limit_ratio_best_depth") for e in eps],
            best_baseline=best,
            best_baseline_samples_per_s=[rep["baselines"][b]["samples_per_s"][i] if b else None
                                         for i, b in enumerate(best)])
    return out


#: Sections whose reports gpu_check.sh merges into OUTDIR/<section>.json ({run: report}), summarised per run.
MERGED = ("depth", "gil", "reads", "sync")


def merged_rows(outdir: str) -> dict:
    """``{"<section> <run>": row}`` of the merged sections' reports (and ``eqmem.json``, one report): per epoch
    solar's samples/s, storage GB/s, limit ratio against the best depth, seconds its steps waited to be booked
    and the GPU's waits, and for eqmem each baseline's samples/s."""
    out = {}
    for sec in MERGED + ("eqmem",):
        reps = _report(os.path.join(outdir, sec + ".json"))
        if reps is None:
            continue
        for run, rep in ({"": reps} if sec == "eqmem" else reps).items():
            eps = rep.get("epochs") if isinstance(rep, dict) else None
            if isinstance(eps, list) and eps and "threads_s" in eps[0]:
                out[f"{sec} {run}".strip()] = {"threads": rep["epochs"]}  # benchmarks/thread_cpu.py's report
                continue
            eps = rep.get("solar", {}).get("epochs", [])
            if not eps:
                out[f"{sec} {run}".strip()] = {"failed": True}
                continue
            out[f"{sec} {run}".strip()] = dict(
                samples_per_s=[e["samples_per_s"] for e in eps],
                storage_gbps=[e.get("storage_bytes_per_s", 0) / 1e9 for e in eps],
                limit_ratio_best_depth=[e.get("limit_ratio_best_depth") for e in eps],
                book_wait_max_s=[e.get("book_wait_max_s") for e in eps],
                gpu_wait_fraction=[e.get("gpu_wait_fraction") for e in eps],
                baselines={k: b["samples_per_s"] for k, b in rep.get("baselines", {}).items() if "samples_per_s" in b})
    return out


def fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(s: dict) -> str:
    m = s["machine"]
    lines = [f"# solar GPU check: {m['gpu']} ({m['device']})", "",
             f"{m['samples']:,} PtychoNN samples of {m['size']}x{m['size']}, local batch {m['batch']}, "
             f"baseline DataLoader workers {m['workers']}, one rank.", "",
             "| step | exit | seconds |", "|---|---|---|"]
    lines += [f"| {r['step']} | {r['status']} | {r['seconds']:.1f} |" for r in s["steps"]]
    if s["training"]:
        lines += ["", "Training (examples/train_ptychonn.py; epoch 0 cold, page cache dropped before each run):", "",
                  "| run | epoch | samples/s | steps/s | loss | loader stall s | buffer hits |",
                  "|---|---|---|---|---|---|---|"]
        for run, eps in s["training"].items():
            for r in eps:
                hits = r.get("buffer_hit_rate")
                lines.append(f"| {run} | {r['epoch']} | {r['samples_per_s']:.0f} | {steps_per_s(r):.1f} | "
                             f"{r['loss']:.4f} | {r['stall_s_max']:.2f} | {'-' if hits is None else f'{hits:.0%}'} |")
    rr = s.get("resident_ratio")
    if rr:
        lines += ["", f"All-resident plan vs one resident batch (epochs >= 1, same loop, bf16): "
                      f"{rr['all_resident_steps_per_s']:.1f} / {rr['resident_batch_steps_per_s']:.1f} steps/s = "
                      f"**{rr['ratio']:.2f}** (target >= {rr['target']})"]
    fd = s.get("fidelity")
    if fd:
        lines += ["", "fp32, deterministic kernels: per-epoch training loss of the two loaders", "",
                  "| epoch | solar | baseline | relative difference |", "|---|---|---|---|"]
        lines += [f"| {r['epoch']} | {r['solar']:.6f} | {r['baseline']:.6f} | {r['rel_diff']:.2e} |"
                  for r in fd["epochs"]]
    hp = s.get("hit_path")
    if hp:
        lines += ["", f"Hit path of one rank, all resident (benchmarks/hit_path.py, {hp['sample_bytes'] // 1024} KiB "
                      f"samples, batch {hp['batch']}): best GB/s and ratio to a one-thread np.take of the same bytes",
                  "", "| what | GB/s | x np.take | x np.take clip x3 out | x np.take on as many threads |",
                  "|---|---|---|---|---|"]
        same, x3 = hp.get("ratio_to_np_take_same_threads") or {}, hp.get("ratio_to_np_take_x3_out") or {}
        for k, v in hp["best_gbps"].items():
            r = [hp["ratio_to_np_take"].get(k), x3.get(k), same.get(k)]
            lines.append(f"| {k} | {v:.2f} | " + " | ".join('-' if x is None else f'{x:.2f}' for x in r) + " |")
    for tier, rows in (s.get("bench_resident") or {}).items():
        lines += ["", f"`solar bench --model conv` on an all-resident plan, solar with the {tier} buffer: "
                  + ", ".join(f"epoch {r['epoch']} {r['samples_per_s']:.0f} samples/s au {fmt(r['au'])}"
                              for r in rows)]
    db = s.get("device_buffer")
    if db:
        lines += ["", "Device buffer tier vs host buffer (benchmarks/device_buffer_check.py, bare loop to the device, "
                      "epoch 0 cold):", "", "| f | equal steps (different) | host GB/s per epoch | device GB/s per epoch |",
                  "|---|---|---|---|"]
        for r in db["runs"]:
            lines.append(f"| {r['buffer_fraction']} | {r['equality']['steps']} ({r['equality']['different']}) | "
                         + ", ".join(f"{x['gbps']:.2f}" for x in r["host"]) + " | "
                         + ", ".join(f"{x['gbps']:.2f}" for x in r["device"]) + " |")
    if s.get("nodes"):
        lines += ["", "`mpiexec --bind-to none -n R solar bench --cold` on one node (section nodes; node: the default "
                      "node pool, rank: --no-node-pool), per epoch:", "",
                  "| data, mode | solar samples/s | storage / file | limit ratio (best depth) | best baseline |",
                  "|---|---|---|---|---|"]
        for k, r in s["nodes"].items():
            fb = r["file_bytes"] or 1
            base = ", ".join("-" if b is None else f"{b} {x:.0f}"
                             for b, x in zip(r["best_baseline"], r["best_baseline_samples_per_s"]))
            lines.append(f"| {k} (R={r['ranks']}, {r['policy'] or 'solar'}) | "
                         + ", ".join(f"{x:.0f}" for x in r["samples_per_s"]) + " | "
                         + ", ".join(f"{(x or 0) / fb:.2f}" for x in r["storage_bytes"]) + " | "
                         + ", ".join(fmt(x, ".2f") for x in r["limit_ratio_best_depth"]) + f" | {base} |")
    if s.get("merged"):
        lines += ["", "Sections depth, gil, reads, sync, eqmem (`<section>.json`), solar per epoch:", "",
                  "| section, run | samples/s | storage GB/s | limit ratio (best depth) | steps waiting to be booked, s "
                  "| GPU waits | baselines samples/s |", "|---|---|---|---|---|---|---|"]
        for k, r in s["merged"].items():
            if r.get("threads"):
                lines.append(f"| {k}: CPU s per epoch (wall s) | " + "; ".join(
                    f"{e['user_s'] + e['system_s']:.2f} ({e['wall_s']:.2f})"
                    + "".join(f"{', ' if i else ': '}{t} {v:.2f}" for i, (t, v) in enumerate(list(e["threads_s"].items())[:4]))
                    for e in r["threads"])
                    + " | | | | | |")
                continue
            if r.get("failed"):
                lines.append(f"| {k} | no report | | | | | |")
                continue
            base = "; ".join(f"{b} " + ", ".join(f"{x:.0f}" for x in v) for b, v in r["baselines"].items()) or "-"
            lines.append(f"| {k} | " + ", ".join(f"{x:.0f}" for x in r["samples_per_s"]) + " | "
                         + ", ".join(f"{x:.2f}" for x in r["storage_gbps"]) + " | "
                         + ", ".join(fmt(x, ".2f") for x in r["limit_ratio_best_depth"]) + " | "
                         + ", ".join(fmt(x, ".2f") for x in r["book_wait_max_s"]) + " | "
                         + ", ".join(fmt(x, ".2f") for x in r["gpu_wait_fraction"]) + f" | {base} |")
    if s["bench"]:
        b = s["bench"]
        lines += ["", f"`solar bench --device {m['device']} --model conv` cold ({b['cache']}):", "",
                  "| loader | epoch | samples/s | au | gpu_wait_fraction |", "|---|---|---|---|---|"]
        lines += [f"| {r['loader']} | {r['epoch']} | {r['samples_per_s']:.0f}{'*' if r['partial'] else ''} | "
                  f"{fmt(r['au'])} | {fmt(r['gpu_wait_fraction'])} |" for r in b["rows"]]
        if any(r["partial"] for r in b["rows"]):
            lines.append("\n\\* stopped after the baseline time limit: rate over the samples delivered until then")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outdir")
    p.add_argument("--steps", help="steps.tsv of gpu_check.sh")
    p.add_argument("--gpu", default="none")
    p.add_argument("--device", default="cuda")
    p.add_argument("--nodes-dir", help="folder of the nodes section's bench reports (nodes-*.json)")
    for k in ("samples", "size", "batch", "workers"):
        p.add_argument(f"--{k}", type=int, default=0)
    a = p.parse_args(argv)
    runs = read_epochs(os.path.join(a.outdir, "train.jsonl"))
    s = dict(machine=dict(gpu=a.gpu, device=a.device, samples=a.samples, size=a.size, batch=a.batch,
                          workers=a.workers),
             steps=read_steps(a.steps), training=runs, resident_ratio=resident_ratio(runs), fidelity=fidelity(runs),
             bench=None)
    bench = os.path.join(a.outdir, "bench-conv.json")
    if os.path.exists(bench) and os.path.getsize(bench):
        rep = load_report(bench)
        s["bench"] = dict(rows=bench_rows(rep), cache=rep.get("cache"), device=rep.get("device"),
                          disk_random_read_gbps=rep.get("limit_random_read_gbps"))
    hit = os.path.join(a.outdir, "hit-path.json")
    if os.path.exists(hit) and os.path.getsize(hit):
        s["hit_path"] = load_report(hit)
    res = os.path.join(a.outdir, "bench-resident.json")
    if os.path.exists(res) and os.path.getsize(res):
        s["bench_resident"] = {tier: bench_rows(rep) for tier, rep in load_report(res).items()}
    s["nodes"] = node_rows(a.nodes_dir)
    s["merged"] = merged_rows(a.outdir)
    dbp = os.path.join(a.outdir, "device-buffer.json")
    if os.path.exists(dbp) and os.path.getsize(dbp):
        s["device_buffer"] = load_report(dbp)
    with open(os.path.join(a.outdir, "summary.json"), "w") as f:
        json.dump(s, f, indent=1)
    md = markdown(s)
    with open(os.path.join(a.outdir, "summary.md"), "w") as f:
        f.write(md)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
