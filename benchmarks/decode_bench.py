"""Chunk decoders outside HDF5: inflate backends, whole pipelines, Fletcher-32, plugin filters.

    python benchmarks/decode_bench.py --samples 64 --repeat 7 --threads 1 2

Generates a PtychoNN-style file (``solar.gen``: 128x128 float32 frames, chunks of
4 samples = 256 KiB) twice, gzip level 4 and shuffle+gzip, takes every stored
chunk (``read_direct_chunk``) into memory, and times decoding all of them:

* ``inflate``: each installed zlib backend of :mod:`solar.io.inflate` alone
  (stdlib zlib, ISA-L, zlib-ng, libdeflate), on ``--threads`` threads each
  decoding its share of the chunks (MB/s of decoded bytes; a backend that holds
  the GIL does not scale with threads);
* ``decode_chunk``: solar's whole pipeline with the backend in use, into a new
  array and straight into a preallocated slot (``out=``), against h5py reading
  the same chunks (one ``ds[chunk]`` each);
* ``fletcher32``: solar's checksum and numcodecs' (if installed) on a 768 KiB chunk;
* plugin filters (if hdf5plugin and numcodecs are installed): the same data
  written with Blosc, LZ4, Bitshuffle and Zstd, ``decode_chunk`` against h5py.

Each figure is over ``--repeat`` runs after one warm-up: best and median MB/s,
and the ratio of best MB/s to stdlib zlib's (``x zlib``).  Data is in memory:
these are decoder figures, not storage figures.  The load average is printed so
that figures from a busy machine can be told apart.
"""
import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np

from solar.gen import GenConfig, Storage, generate
from solar.io.filters import Filter, decode_chunk, fletcher32
from solar.io.inflate import BACKENDS, INFLATE_NAME


def load_chunks(path):
    """Every stored chunk of every dataset: list of dicts (raw, mask, pipeline, nbytes, itemsize, ds, sel)."""
    chunks = []
    with h5py.File(path, "r") as f:
        for name in sorted(f):
            ds = f[name]
            plist = ds.id.get_create_plist()
            pipe = tuple(Filter(*(int(v) if i < 2 else tuple(int(x) for x in v)
                                  for i, v in enumerate(plist.get_filter(k)[:3])))
                         for k in range(plist.get_nfilters()))
            nbytes = int(np.prod(ds.chunks)) * ds.dtype.itemsize
            for start in range(0, ds.shape[0] - ds.chunks[0] + 1, ds.chunks[0]):
                origin = (start,) + (0,) * (ds.ndim - 1)
                mask, raw = ds.id.read_direct_chunk(origin)
                sel = tuple(slice(o, o + c) for o, c in zip(origin, ds.chunks))
                chunks.append(dict(raw=raw, mask=mask, pipe=pipe, nbytes=nbytes,
                                   itemsize=ds.dtype.itemsize, ds=name, sel=sel))
    return chunks


def timed(work, parts, threads: int, repeat: int):
    """Seconds of each of ``repeat`` runs of ``work(part)`` over ``parts`` on ``threads`` threads."""
    times = []
    with ThreadPoolExecutor(threads) as pool:
        for r in range(repeat + 1):
            t = time.perf_counter()
            list(pool.map(work, parts))
            if r:  # the first run warms caches and compiles numba kernels
                times.append(time.perf_counter() - t)
    return times


def split(items, threads: int):
    return [items[k::threads] for k in range(threads)]


def row(label, times, nbytes, base=None):
    best, med = nbytes / min(times) / 1e6, nbytes / statistics.median(times) / 1e6
    return dict(case=label, best_MBps=round(best, 1), median_MBps=round(med, 1),
                x_zlib=round(best / base, 2) if base else None)


def bench_inflate(chunks, label, threads, repeat):
    """Each inflate backend alone over every chunk; ``x zlib``: best MB/s over stdlib zlib's."""
    rows, total = [], sum(c["nbytes"] for c in chunks)
    for t in threads:
        times = {}
        for name, fn in BACKENDS.items():
            def work(part, fn=fn):
                for c in part:
                    fn(c["raw"], c["nbytes"])
            times[name] = timed(work, split(chunks, t), t, repeat)
        base = total / min(times["zlib"]) / 1e6
        rows += [row(f"{label} inflate {name} x{t}", ts, total, base) for name, ts in times.items()]
    return rows


def bench_pipeline(path, chunks, label, threads, repeat):
    """decode_chunk into new arrays and into preallocated slots, against h5py's read of each chunk."""
    rows, total = [], sum(c["nbytes"] for c in chunks)
    slots = [np.empty(c["nbytes"], dtype=np.uint8) for c in chunks]
    idx = list(range(len(chunks)))
    for t in threads:
        def new(part):
            for i in part:
                c = chunks[i]
                decode_chunk(c["raw"], c["pipe"], c["mask"], c["nbytes"], c["itemsize"])

        def into(part):
            for i in part:
                c = chunks[i]
                decode_chunk(c["raw"], c["pipe"], c["mask"], c["nbytes"], c["itemsize"], out=slots[i])
        rows.append(row(f"{label} decode_chunk ({INFLATE_NAME}) new array x{t}", timed(new, split(idx, t), t, repeat),
                        total))
        rows.append(row(f"{label} decode_chunk ({INFLATE_NAME}) out= x{t}", timed(into, split(idx, t), t, repeat),
                        total))
        with h5py.File(path, "r") as f:
            def ref(part):
                for i in part:
                    f[chunks[i]["ds"]][chunks[i]["sel"]]
            rows.append(row(f"{label} h5py ds[chunk] x{t}", timed(ref, split(idx, t), t, repeat), total))
    return rows


def bench_fletcher32(repeat):
    data = np.random.default_rng(0).integers(0, 256, 768 * 1024, dtype=np.uint8)
    rows = [row("fletcher32 solar 768 KiB", timed(lambda _: fletcher32(data), [0], 1, repeat), data.nbytes)]
    try:
        from numcodecs import Fletcher32
    except ImportError:
        return rows
    codec = Fletcher32()
    rows.append(row("fletcher32 numcodecs 768 KiB", timed(lambda _: codec.encode(data), [0], 1, repeat),
                    data.nbytes))
    return rows


def plugin_files(src, tmp):
    """The gzip file's datasets rewritten with hdf5plugin filters: {label: path}; {} without hdf5plugin."""
    try:
        import hdf5plugin
    except ImportError:
        return {}
    kinds = {
        "blosc-lz4-shuffle": hdf5plugin.Blosc(cname="lz4", shuffle=hdf5plugin.Blosc.SHUFFLE),
        "blosc-zstd-bitshuffle": hdf5plugin.Blosc(cname="zstd", shuffle=hdf5plugin.Blosc.BITSHUFFLE),
        "lz4": hdf5plugin.LZ4(),
        "bitshuffle-lz4": hdf5plugin.Bitshuffle(cname="lz4"),
        "zstd": hdf5plugin.Zstd(),
    }
    out = {}
    with h5py.File(src, "r") as f:
        for label, opts in kinds.items():
            path = os.path.join(tmp, f"{label}.h5")
            with h5py.File(path, "w") as g:
                for name in f:
                    g.create_dataset(name, data=f[name][()], chunks=f[name].chunks, **opts)
            out[label] = path
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    load0 = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for label, st in (("gzip", Storage(4, "gzip")), ("shuffle+gzip", Storage(4, "gzip", shuffle=True))):
            out = os.path.join(tmp, label)
            generate("ptychonn", out, GenConfig(samples=args.samples, size=args.size, storage=st, progress=False))
            files[label] = os.path.join(out, "ptychonn.h5")
        for label, path in files.items():
            chunks = load_chunks(path)
            rows += bench_inflate(chunks, label, args.threads, args.repeat)
            rows += bench_pipeline(path, chunks, label, args.threads, args.repeat)
        rows += bench_fletcher32(args.repeat)
        for label, path in plugin_files(files["gzip"], tmp).items():
            rows += bench_pipeline(path, load_chunks(path), label, args.threads[:1], args.repeat)
    report = dict(inflate_in_use=INFLATE_NAME, backends=list(BACKENDS), samples=args.samples, size=args.size,
                  repeat=args.repeat, loadavg_start=[round(x, 2) for x in load0],
                  loadavg_end=[round(x, 2) for x in os.getloadavg()], rows=rows)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"inflate in use: {INFLATE_NAME}; installed: {', '.join(BACKENDS)}; load average "
          f"{report['loadavg_start']} -> {report['loadavg_end']}")
    print(f"{'case':58s} {'best MB/s':>10s} {'median':>10s} {'x zlib':>7s}")
    for r in rows:
        x = "" if r["x_zlib"] is None else f"{r['x_zlib']:.2f}"
        print(f"{r['case']:58s} {r['best_MBps']:10.1f} {r['median_MBps']:10.1f} {x:>7s}")


if __name__ == "__main__":
    main()
