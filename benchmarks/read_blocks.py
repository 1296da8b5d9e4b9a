"""Block readers against h5py: one epoch of samples, warm page cache.

    python benchmarks/read_blocks.py --samples 2048 --size 128 --storage contiguous gzip --json

Generates a PtychoNN-style file per storage (``solar.gen``), then times one
epoch of samples in a random order (seeded; ``--order sequential`` for 0..N-1), read

* through h5py one sample at a time (``ds[i]`` per field, files opened once), and
* through the ``pread`` reader, ``--batch`` samples per ``read_blocks`` call (the
  distinct blocks of the batch), with ``--threads`` workers and coalescing on/off.

Each configuration runs once untimed (so the file is in the page cache: these
are warm-cache figures, not storage figures) and then ``--repeat`` times; the
best time is kept.  ``speedup`` is h5py seconds / reader seconds.  The reader
times cover reading and decoding blocks into caller arrays, not assembling
samples from blocks (that is the buffer manager's work); ``--assemble`` adds a
run that assembles every sample too.
"""
import argparse
import json
import os
import tempfile
import time

import h5py
import numpy as np

from solar.gen import GenConfig, Storage, generate
from solar.io import assemble_sample, get_reader
from solar.layout import load_layout


def epoch_batches(n_samples: int, batch: int, seed: int, order: str = "random"):
    """An epoch as batches of sample ids: a seeded permutation, or 0..N-1 in order."""
    if order == "random":
        order = np.random.default_rng(seed).permutation(n_samples)
    else:
        order = np.arange(n_samples)
    return [order[i:i + batch] for i in range(0, n_samples, batch)]


def time_h5py(layout, batches) -> float:
    files = {i: h5py.File(p, "r", locking=False) for i, p in enumerate(layout.files)}
    dsets = {d: files[info.file][info.name] for d, info in enumerate(layout.datasets)}
    t = time.perf_counter()
    for b in batches:
        for s in b.tolist():
            for _name, d, sel in layout.sample_fields(s):
                dsets[d][sel]
    dt = time.perf_counter() - t
    for f in files.values():
        f.close()
    return dt


def time_reader(layout, batches, assemble=False, **opts):
    """Seconds for the epoch and the summed ReadStats."""
    per_batch = [np.unique(np.concatenate([layout.blocks_of(int(s)) for s in b])) for b in batches]
    most = max(len(p) for p in per_batch)
    nbytes = int(layout.block_nbytes.max())
    pool = [np.empty(nbytes, dtype=np.uint8) for _ in range(most)]  # reused, as a buffer manager would
    total = None
    with get_reader("pread", layout, **opts) as reader:
        t = time.perf_counter()
        for b, blocks in zip(batches, per_batch):
            outs = [pool[i][: int(layout.block_nbytes[k])] for i, k in enumerate(blocks.tolist())]
            st = reader.read_blocks(blocks, outs)
            total = st if total is None else total + st
            if assemble:
                get = block_getter(layout, dict(zip(blocks.tolist(), outs)))
                for s in b.tolist():
                    assemble_sample(layout, s, get)
        dt = time.perf_counter() - t
    return dt, total


def block_getter(layout, where):
    """``get_block(id)`` for assemble_sample over ``{block id: uint8 array}``."""
    def get(k):
        d = layout.block_dataset[k]
        return where[k].view(layout.datasets[d].dtype).reshape(layout.block_shapes[d])
    return get


def best_of(repeat: int, fn, *args, **kwargs):
    """Run once to warm up (page cache, thread pools, numba), then keep the fastest of ``repeat`` runs."""
    fn(*args, **kwargs)
    runs = [fn(*args, **kwargs) for _ in range(repeat)]
    return min(runs, key=lambda r: r if isinstance(r, float) else r[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--size", type=int, default=128, help="frame side (a sample is 3 x size^2 float32)")
    ap.add_argument("--storage", nargs="+", default=["contiguous", "gzip"],
                    help="solar.gen storage presets: contiguous chunked multi gzip lzf")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--batch", type=int, default=32, help="samples per read_blocks call")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--order", choices=["random", "sequential"], default="random")
    ap.add_argument("--assemble", action="store_true", help="also time reading + assembling every sample")
    ap.add_argument("--dir", default=None, help="where to generate the files (default: a temporary folder)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    root = a.dir or tempfile.mkdtemp(prefix="solar-bench-")
    results = []
    for storage in a.storage:
        out = os.path.join(root, f"ptychonn-{storage}-{a.samples}x{a.size}")
        if not os.path.exists(os.path.join(out, "solar-layout.json")):
            generate("ptychonn", out, GenConfig(samples=a.samples, size=a.size, seed=a.seed,
                                                storage=Storage.preset(storage)))
        layout = load_layout(out)
        batches = epoch_batches(layout.n_samples, a.batch, a.seed, a.order)
        sample_mb = float(layout.sample_used_nbytes().sum()) / 2**20
        h5 = best_of(a.repeat, time_h5py, layout, batches)
        rows = [{"storage": storage, "reader": "h5py one sample at a time", "seconds": round(h5, 4),
                 "MB_per_s": round(sample_mb / h5, 1), "speedup": 1.0}]
        configs = [(t, c) for t in a.threads for c in (True, False)]
        for threads, co in configs:
            dt, st = best_of(a.repeat, time_reader, layout, batches, threads=threads, coalesce=co)
            rows.append({"storage": storage, "reader": f"pread threads={threads} coalesce={'on' if co else 'off'}",
                         "seconds": round(dt, 4), "MB_per_s": round(sample_mb / dt, 1),
                         "speedup": round(h5 / dt, 2), "n_reads": st.n_reads,
                         "read_MB": round(st.bytes_read / 2**20, 1)})
        if a.assemble:
            t = max(a.threads)
            dt, _ = best_of(a.repeat, time_reader, layout, batches, assemble=True, threads=t)
            rows.append({"storage": storage, "reader": f"pread threads={t} + assemble samples",
                         "seconds": round(dt, 4), "MB_per_s": round(sample_mb / dt, 1),
                         "speedup": round(h5 / dt, 2)})
        results.extend(rows)
    meta = {"samples": a.samples, "size": a.size, "batch": a.batch, "order": a.order, "repeat": a.repeat,
            "cache": "warm",
            "cpus": os.cpu_count(), "dir": root}
    if a.json:
        print(json.dumps({"config": meta, "results": results}, indent=2))
        return
    print(", ".join(f"{k}={v}" for k, v in meta.items()))
    print(f"{'storage':<11} {'reader':<34} {'seconds':>8} {'MB/s':>8} {'speedup':>7} {'reads':>7}")
    for r in results:
        print(f"{r['storage']:<11} {r['reader']:<34} {r['seconds']:>8.3f} {r['MB_per_s']:>8.1f} "
              f"{r['speedup']:>7.2f} {r.get('n_reads', ''):>7}")


if __name__ == "__main__":
    main()
