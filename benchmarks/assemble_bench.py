"""Batch assembly from resident buffer slots: the gather path, the per-block path, and memcpy.

    python benchmarks/assemble_bench.py                      # PtychoNN: 3 fields x 32 samples x 64 KiB
    python benchmarks/assemble_bench.py --storage multi --json

Generates a PtychoNN-style file (``solar.gen``, ``--samples`` x 128x128 float32 per field),
reads every block into :class:`~solar.buffer.SlotPools` slots (the buffer, fully resident),
then assembles random local batches of ``--batch`` samples (every batch checked equal
between both paths first):

* ``gather``: :class:`~solar.loader.BatchAssembler` with the buffer's slot table (one
  numba call per field, :mod:`solar.buffer.gather`);
* ``per-block``: the same assembler with ``gather=False`` (``place_block`` per block);
* ``memcpy``: ``np.copyto`` of the same number of bytes from one contiguous run of the
  pool (a random slot per batch, so the source is as cold as the gather's) into a fresh
  ``np.empty`` batch (``memcpy-prealloc``: into one array allocated once).

Prints microseconds per batch (min and median of ``--repeat`` passes of ``--batches``
batches each, the methods' passes interleaved), the ratios to memcpy, and the load average.  Assembly is memory
bound: only the ratio means anything across machines.
"""
import argparse
import json
import os
import tempfile
import time

import numpy as np

from solar.buffer import SlotPools, StepBlocks
from solar.gen import GenConfig, Storage, generate
from solar.io import get_reader
from solar.layout import load_layout
from solar.loader import BatchAssembler
from solar.memory import size_classes


def resident_buffer(layout):
    """Every block read into a slot: ``(pools, class_of int64[B], slot_of int64[B])``."""
    class_of, class_bytes = size_classes(layout.block_nbytes)
    class_of = class_of.astype(np.int64)
    pools = SlotPools(class_bytes, np.bincount(class_of, minlength=class_bytes.shape[0]))
    slot_of = pools.alloc_many(class_of)
    blocks = np.arange(layout.n_blocks, dtype=np.int64)
    views = [pools.view(int(c), int(i))[:int(n)] for c, i, n in zip(class_of, slot_of, layout.block_nbytes)]
    with get_reader("pread", layout, threads=2) as r:
        r.read_blocks(blocks, views)
    return pools, class_of, slot_of


def step_blocks(layout, samples, pools, class_of, slot_of):
    """The :class:`StepBlocks` the buffer manager would hand the assembler for ``samples``."""
    need = np.unique(np.concatenate([layout.blocks_of(int(s)) for s in samples]))
    return StepBlocks(0, need, class_of[need], slot_of[need], pools, layout.block_nbytes, {})


def time_interleaved(methods: dict, repeat: int) -> dict:
    """``{name: [us per item, one per pass]}``; ``methods``: ``{name: (fn, items)}``.

    Passes alternate between the methods (pass r of every method, then pass r + 1), so
    that each sees the same load on a shared machine.
    """
    out = {k: [] for k in methods}
    for _ in range(repeat):
        for k, (fn, items) in methods.items():
            t = time.perf_counter()
            for it in items:
                fn(it)
            out[k].append((time.perf_counter() - t) / len(items) * 1e6)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=50, help="batches per timed pass")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--storage", default="contiguous", choices=["contiguous", "chunked", "multi"])
    ap.add_argument("--data", help="an existing PtychoNN folder (default: generate one in a temp folder)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="solar-assemble-") as tmp:
        data = a.data
        if data is None:
            data = os.path.join(tmp, "p")
            st = Storage.preset(a.storage, chunk_samples=4 if a.storage == "multi" else None)
            generate("ptychonn", data, GenConfig(samples=a.samples, storage=st))
        layout = load_layout(data)
        pools, class_of, slot_of = resident_buffer(layout)
        rng = np.random.default_rng(0)
        batches = [np.sort(rng.choice(layout.n_samples, a.batch, replace=False)).astype(np.int64)
                   for _ in range(a.batches)]
        steps = [(s, step_blocks(layout, s, pools, class_of, slot_of)) for s in batches]
        new, old = BatchAssembler(layout), BatchAssembler(layout, gather=False)
        assert new.gather, new.tables.why
        for s, sb in steps:  # both paths agree, bit for bit, before anything is timed
            x, y = new(0, s, sb), old(0, s, sb)
            assert all(np.array_equal(x[k].view(np.uint8), y[k].view(np.uint8)) for k in x)
        nbytes = sum(v.nbytes for v in new(0, *steps[0]).values())
        flat = max(pools.arrays, key=lambda x: x.nbytes).reshape(-1)
        if flat.shape[0] < nbytes:
            raise SystemExit(f"--samples too small: the largest pool holds {flat.shape[0]} bytes < one batch")
        starts = rng.integers(0, flat.shape[0] - nbytes + 1, len(steps)).tolist()
        src = [flat[o:o + nbytes] for o in starts]
        dst = np.empty(nbytes, np.uint8)
        idx = list(range(len(steps)))
        runs = time_interleaved({
            "gather": (lambda it: new(0, *it), steps),
            "per-block": (lambda it: old(0, *it), steps),
            "memcpy": (lambda i: np.copyto(np.empty(nbytes, np.uint8), src[i]), idx),
            "memcpy-prealloc": (lambda i: np.copyto(dst, src[i]), idx),
        }, a.repeat)
    res = {"batch_bytes": nbytes, "batch": a.batch, "fields": len(layout.field_names), "storage": a.storage,
           "loadavg": os.getloadavg(),
           "us_per_batch": {k: {"min": min(v), "median": float(np.median(v))} for k, v in runs.items()}}
    for k in ("gather", "per-block"):
        res[f"{k}_vs_memcpy"] = {m: res["us_per_batch"][k][m] / res["us_per_batch"]["memcpy"][m]
                                 for m in ("min", "median")}
    if a.json:
        print(json.dumps(res, indent=1))
        return
    print(f"batch: {a.batch} samples x {res['fields']} fields, {nbytes / 2**20:.2f} MiB, {a.storage}; "
          f"load average {' '.join(f'{x:.2f}' for x in res['loadavg'])}")
    for k, v in res["us_per_batch"].items():
        print(f"  {k:16s} min {v['min']:9.1f} us  median {v['median']:9.1f} us")
    for k in ("gather", "per-block"):
        r = res[f"{k}_vs_memcpy"]
        print(f"  {k} / memcpy: min {r['min']:.2f}x  median {r['median']:.2f}x")


if __name__ == "__main__":
    main()
