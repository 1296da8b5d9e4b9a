"""Layout build over many small files: one file at a time vs threads vs worker processes (issue 12, item 4).

    python benchmarks/layout_build.py DATA [--modes serial,threads,processes] [--repeat 1]

DATA: a spec folder of many files, e.g. ``solar gen cosmoflow DATA --samples 20000 --size 4``.
``serial``: ``build_layout(spec, workers=1)`` (one process reads the files one after the other);
``threads``: the per-file scans in a thread pool of ``--workers`` threads (h5py's global lock serialises
them); ``processes``: ``build_layout(spec, workers=N)`` (:mod:`solar.layout.scan_pool`).  Prints seconds,
files per second and the fingerprint of each (all equal, or the script fails).  The page cache is left
as it is: run once before to measure warm, drop caches (root) before each mode to measure cold.
"""
import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from solar.layout import find_spec
from solar.layout.build import Layout, build_layout, check_fields, fingerprint, merge_scans, scan_file


def build_threads(spec, workers: int) -> Layout:
    """The layout with the per-file scans in ``workers`` threads (same merge as build_layout)."""
    paths = spec.resolve_files()
    with ThreadPoolExecutor(workers) as ex:
        scans = list(ex.map(lambda p: scan_file(spec, p), paths, chunksize=64))
    files, stats, datasets, shapes, sources, arrays = merge_scans(spec, scans)
    check_fields(spec, files, datasets, sources)
    return Layout(spec, tuple(files), tuple(datasets), tuple(shapes), tuple(sources), arrays,
                  fingerprint(spec, files, datasets, arrays, stats))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data")
    ap.add_argument("--modes", default="serial,threads,processes")
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    spec = find_spec(a.data)
    n = len(spec.resolve_files())
    runs = {"serial": lambda: build_layout(spec, workers=1),
            "threads": lambda: build_threads(spec, a.workers),
            "processes": lambda: build_layout(spec, workers=a.workers)}
    out = {"files": n, "workers": a.workers, "cpus": len(os.sched_getaffinity(0)),
           "load_avg_1min": os.getloadavg()[0], "modes": {}}
    prints = set()
    for mode in a.modes.split(","):
        best = None
        for _ in range(a.repeat):
            t = time.perf_counter()
            lay = runs[mode]()
            s = time.perf_counter() - t
            best = s if best is None else min(best, s)
            prints.add(lay.fingerprint)
        out["modes"][mode] = {"seconds": round(best, 3), "files_per_s": round(n / best, 1)}
        if not a.json:
            print(f"{mode:>10}: {best:7.2f} s  {n / best:9.0f} files/s  fingerprint {lay.fingerprint[:16]}",
                  flush=True)
    if len(prints) != 1:
        sys.exit(f"fingerprints differ between modes: {sorted(prints)}")
    if "serial" in out["modes"]:
        for m in out["modes"].values():
            m["speedup"] = round(out["modes"]["serial"]["seconds"] / m["seconds"], 2)
    print(json.dumps(out, indent=None if not a.json else 2))


if __name__ == "__main__":
    main()
