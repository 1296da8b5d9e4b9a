"""The hit path of one rank: SolarLoader on an all-resident plan against a one-thread numpy gather of the
same bytes, in the same run (issue 24's target).

    python benchmarks/hit_path.py data/p4k --batch 128 --epochs 3 --cpus 1 2 --repeat 3 [--json]

Plans one rank with a buffer that holds every block after epoch 0 (buffer fraction 1.0 plus the batches'
reserve, about 1.1: see ``all_resident``).  Per ``--cpus`` value, per
repeat: a SolarLoader (torch batches, as a training loop takes them) runs ``--epochs`` epochs; the hit
path is its best epoch >= 1 (samples/s and GB/s of delivered bytes).  The references, run interleaved with
the loader's repeats: every field of the dataset in memory as one array, each batch of the same sample ids
gathered with ``np.take(a, idx, axis=0, out=...)``, best of their epochs.  Prints the ratios loader / reference;
only ratios mean anything across machines.

Three one-thread references (``REFERENCES``): the issue's ``np.take`` (numpy's default mode, which buffers
``out=``), "np.take clip" (no buffering; one output batch, which may stay in the cache of a machine whose L3
holds it), "np.take clip x3 out" (three output batches written in turn, as a loader with batches queued must).  The
ceiling for ``cpus=N`` (N > 1): "np.take clip x3 out" with each batch's rows split into N runs gathered at once
by N threads (numpy's ``take`` releases the GIL), "np.take xN".  Where
that is not N times one thread, the machine's memory system, not the loader, caps what N cores can add.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np


#: The references (name: numpy ``take`` mode, batches of output written in turn).  "np.take" is issue 24's:
#: ``np.take(a, idx, axis=0, out=preallocated)``, numpy's default mode, which always buffers ``out=`` (a second
#: copy of every batch).  "np.take clip" skips that; its one 24 MiB ``out`` may stay in a 32 MiB L3, which a loader
#: whose training loop holds a batch while ``prefetch`` (2) more are made cannot count on: "np.take clip x3 out"
#: writes three batches in turn (on the 2-core VM 0.94 of one ``out``'s rate); the loader has up to four alive
#: (``solar.memory.live_batches``), so three is, if anything, kinder to the reference.
REFERENCES = {"np.take": ("raise", 1), "np.take clip": ("clip", 1), "np.take clip x3 out": ("clip", 3)}


def reference(arrays, batches, outs, mode: str = "raise") -> float:
    """Seconds to gather every batch of one epoch with np.take on one thread, into ``outs`` (one list of
    per-field arrays per output batch, written in turn)."""
    t0 = time.perf_counter()
    for i, idx in enumerate(batches):
        n = idx.shape[0]
        for a, out in zip(arrays, outs[i % len(outs)]):
            np.take(a, idx, axis=0, out=out[:n], mode=mode)
    return time.perf_counter() - t0


def reference_threads(arrays, batches, outs, pool, parts: int) -> float:
    """Seconds to gather every batch of one epoch as "np.take clip x3 out" does, each batch's rows in ``parts``
    runs copied at once by ``parts`` threads (``pool`` has ``parts - 1`` workers; the calling thread takes the
    first run)."""
    def run(idx, lo, hi, out_batch):
        for a, out in zip(arrays, out_batch):
            np.take(a, idx[lo:hi], axis=0, out=out[lo:hi], mode="clip")

    t0 = time.perf_counter()
    for i, idx in enumerate(batches):
        n = idx.shape[0]
        ob = outs[i % len(outs)]
        edges = [n * k // parts for k in range(parts + 1)]
        futs = [pool.submit(run, idx, edges[k], edges[k + 1], ob) for k in range(1, parts)]
        run(idx, edges[0], edges[1], ob)
        for f in futs:
            f.result()
    return time.perf_counter() - t0


def loader_epochs(plan: str, data: str, epochs: int, cpus) -> tuple:
    """``(seconds, faults)`` of each epoch of a bare loop over SolarLoader (torch batches): faults are the
    process's minor page faults in the epoch (a batch whose memory is new is faulted in by the threads that
    gather it, 4 KiB or 2 MiB at a time: one suspect for many gather threads being slower than a few)."""
    import resource

    from solar.loader import SolarLoader
    kw = {} if cpus is None else {"cpus": cpus}
    out, faults = [], []
    with SolarLoader(plan, data, as_torch=True, epoch_fence=True, **kw) as loader:
        loader.prepare()
        for e in range(epochs):
            loader.set_epoch(e)
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            for _ in loader:
                pass
            out.append(time.perf_counter() - t0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return out, faults


def all_resident(solar, data: str, batch: int, epochs: int, plan: str) -> float:
    """Plan one rank whose buffer holds every block after epoch 0; returns the buffer fraction it took.

    ``buffer_fraction=1.0`` is not enough: the budget also pays for the queued batches and bookkeeping
    (docs/runtime.md, "The budget is the memory used"), so at 1.0 about a tenth of the blocks are read again
    each epoch and the "hit path" would include reads.  The fraction rises by 2% until epochs >= 1 read
    nothing."""
    if epochs < 2:
        raise SystemExit("--epochs must be at least 2: the hit path is the epochs after the first")
    for fraction in np.round(np.arange(1.0, 2.0, 0.02), 2):
        if os.path.exists(plan):
            os.unlink(plan)
        solar.plan(data, world_size=1, local_batch=batch, epochs=epochs, buffer_fraction=float(fraction),
                   out=plan, progress=False).close()
        with solar.Schedule.load(plan) as s:
            if not any(s.predicted()["miss_bytes"][1:]):
                return float(fraction)
    raise SystemExit(f"no buffer fraction below 2.0 keeps every block of {data} resident")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--cpus", type=int, nargs="*", default=[None], help="cpus= values (default: the loader's default)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import h5py

    import solar
    layout = solar.load_layout(a.data)
    tmp = tempfile.mkdtemp(prefix="solar-hit-")
    plan = os.path.join(tmp, "plan.h5")
    fraction = all_resident(solar, a.data, a.batch, a.epochs, plan)
    with solar.Schedule.load(plan) as s:
        S = s.steps_per_epoch
        batches = [[np.sort(s.batch(e, g, 0)) for g in range(S)] for e in range(a.epochs)]
    arrays = []
    for d in layout.datasets:  # one array per field (a one-file rows layout: dataset = field)
        with h5py.File(layout.files[d.file], "r") as h:
            arrays.append(np.ascontiguousarray(h[d.name][()]))
    arrays = [x.reshape(x.shape[0], -1) for x in arrays]
    sample_bytes = sum(x.shape[1] * x.itemsize for x in arrays)
    outs = [[np.empty((a.batch, x.shape[1]), x.dtype) for x in arrays] for _ in range(3)]
    n = sum(b.shape[0] for b in batches[1])
    res = {"data": a.data, "samples": layout.n_samples, "buffer_fraction": fraction, "sample_bytes": sample_bytes,
           "batch": a.batch, "load": os.getloadavg(), "runs": []}
    from concurrent.futures import ThreadPoolExecutor
    threads = sorted({c for c in a.cpus if c is not None and c > 1})
    pool = ThreadPoolExecutor(max(threads) - 1) if threads else None
    for r in range(a.repeat):
        for name, (mode, n_out) in REFERENCES.items():
            ref = min(reference(arrays, batches[e], outs[:n_out], mode) for e in range(1, a.epochs))
            res["runs"].append({"what": name, "repeat": r, "samples_per_s": n / ref,
                                "gbps": n * sample_bytes / ref / 1e9})
        for c in threads:
            ref = min(reference_threads(arrays, batches[e], outs, pool, c) for e in range(1, a.epochs))
            res["runs"].append({"what": f"np.take x{c}", "repeat": r, "samples_per_s": n / ref,
                                "gbps": n * sample_bytes / ref / 1e9})
        for c in a.cpus:
            secs, faults = loader_epochs(plan, a.data, a.epochs, c)
            best = min(secs[1:])
            res["runs"].append({"what": f"solar cpus={c}", "repeat": r, "samples_per_s": n / best,
                                "gbps": n * sample_bytes / best / 1e9, "epoch_s": secs,
                                "minor_faults_per_batch": [f / S for f in faults]})
        print(" ".join(f"{x['what']}: {x['gbps']:.2f} GB/s" for x in res["runs"] if x["repeat"] == r),
              file=sys.stderr, flush=True)
    best = {}
    for x in res["runs"]:
        best[x["what"]] = max(best.get(x["what"], 0.0), x["gbps"])
    res["best_gbps"] = best
    res["ratio_to_np_take"] = {k: v / best["np.take"] for k, v in best.items() if k != "np.take"}
    res["ratio_to_np_take_x3_out"] = {k: v / best["np.take clip x3 out"] for k, v in best.items()
                                      if k.startswith("solar")}
    res["ratio_to_np_take_same_threads"] = {f"solar cpus={c}": best[f"solar cpus={c}"] / best[f"np.take x{c}"]
                                            for c in threads}
    if pool is not None:
        pool.shutdown()
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        for k, v in best.items():
            print(f"{k:>16}: {v:.2f} GB/s" + (f"  x{v / best['np.take']:.2f} of np.take" if k != "np.take" else ""))
        for k, v in res["ratio_to_np_take_x3_out"].items():
            print(f"{k:>16}: x{v:.2f} of np.take clip x3 out")
        for k, v in res["ratio_to_np_take_same_threads"].items():
            print(f"{k:>16}: x{v:.2f} of np.take on as many threads")
        print(f"load average {res['load']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
