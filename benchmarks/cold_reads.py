"""The ``pread`` reader against bare ``O_DIRECT`` reads of the same blocks, cold, interleaved pairs.

    python benchmarks/cold_reads.py data/bench-ptycho --pairs 4 --json

Each pair times two disjoint random sets of the layout's stored blocks (``--blocks`` each, never read
before in the run), in alternating order:

* ``reader``: the ``pread`` reader (``--threads`` workers, its defaults: ``O_DIRECT`` where the file
  system has it), called as the buffer manager calls it: ``--per-call`` blocks a ``read_blocks``
  call (a step's misses), ``--calls`` calls in flight, into slots of one pre-faulted pool;
* ``bare``: ``--threads`` threads each issuing ``os.preadv`` of one block's 4 KiB-aligned window into
  its own aligned buffer, ``O_DIRECT``, nothing else (what the disk gives to these reads at this depth).

Neither goes through the page cache, so nothing is dropped between runs.  ``ratio`` = reader GB/s /
bare GB/s of the same pair: the share of the disk's speed that the reader's own work leaves.  The
disk's speed drifts between minutes on shared machines, so compare within pairs, not across runs.
"""
import argparse
import json
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from solar.bench.disk import typical_block
from solar.io import get_reader
from solar.layout import load_layout

ALIGN = 4096


def bare_reads(paths, ext: np.ndarray, threads: int) -> float:
    """Seconds for ``threads`` threads to read every extent (file, offset, bytes) with O_DIRECT."""
    fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths]
    lo = ext[:, 1] - ext[:, 1] % ALIGN
    hi = -(-(ext[:, 1] + ext[:, 2]) // ALIGN) * ALIGN
    cursor, lock = [0], threading.Lock()

    def work():
        buf = memoryview(mmap.mmap(-1, int((hi - lo).max())))
        while True:
            with lock:
                k = cursor[0]
                cursor[0] += 1
            if k >= ext.shape[0]:
                return
            os.preadv(fds[ext[k, 0]], [buf[:int(hi[k] - lo[k])]], int(lo[k]))
    pool = [threading.Thread(target=work) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    seconds = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    return seconds


def reader_reads(reader, blocks: np.ndarray, slots: list, per_call: int, calls: int) -> float:
    """Seconds for ``reader`` to read ``blocks`` in calls of ``per_call``, ``calls`` in flight."""
    with ThreadPoolExecutor(calls) as ex:
        t0 = time.perf_counter()
        futs = [ex.submit(reader.read_blocks, blocks[i:i + per_call], slots[i:i + per_call])
                for i in range(0, blocks.shape[0], per_call)]
        for f in futs:
            f.result()
        return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", help="layout spec or folder with solar-layout.json (unfiltered data)")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=4000, help="blocks per timed set")
    ap.add_argument("--threads", type=int, default=16, help="reader threads = bare read depth")
    ap.add_argument("--per-call", type=int, default=96, help="blocks per read_blocks call")
    ap.add_argument("--calls", type=int, default=4, help="read_blocks calls in flight")
    ap.add_argument("--reader-options", default="{}", help="JSON options of the pread reader")
    ap.add_argument("--seed", type=int, default=None, help="block order seed (default: from the clock)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    lay = load_layout(a.data)
    ext, _ = typical_block(lay)
    on = np.flatnonzero((lay.block_offset >= 0) & (lay.block_stored > 0))  # rows of ext, in order
    if 2 * a.pairs * a.blocks + a.per_call > on.shape[0]:
        ap.error(f"{2 * a.pairs} sets of {a.blocks} blocks need {2 * a.pairs * a.blocks}, the layout stores "
                 f"{on.shape[0]}: lower --pairs or --blocks")
    rng = np.random.default_rng(a.seed if a.seed is not None else time.time_ns())
    order = rng.permutation(on.shape[0])
    big = int(lay.block_nbytes[on].max())
    pool = np.ones(a.blocks * big, np.uint8)  # pre-faulted: page faults are not the reader's
    reader = get_reader("pread", lay, threads=a.threads, **json.loads(a.reader_options))
    warm = on[order[-a.per_call:]]  # untimed: numba loads its compiled kernels, the pool starts
    reader.read_blocks(warm, [pool[i * big:i * big + int(n)] for i, n in enumerate(lay.block_nbytes[warm])])
    rows = []
    for p in range(a.pairs):
        sets = [order[(2 * p + i) * a.blocks:(2 * p + i + 1) * a.blocks] for i in range(2)]
        blocks = on[sets[p % 2]]
        slots = [pool[i * big:i * big + int(n)] for i, n in enumerate(lay.block_nbytes[blocks].tolist())]
        timed = {}
        for kind in (("reader", "bare") if p % 2 == 0 else ("bare", "reader")):
            if kind == "reader":
                timed[kind] = reader_reads(reader, blocks, slots, a.per_call, a.calls)
            else:
                timed[kind] = bare_reads(lay.files, ext[sets[1 - p % 2]], a.threads)
        nbytes = int(lay.block_stored[blocks].sum())
        bare_bytes = int(ext[sets[1 - p % 2], 2].sum())
        row = {"pair": p, "reader_gbps": nbytes / timed["reader"] / 1e9,
               "bare_gbps": bare_bytes / timed["bare"] / 1e9}
        row["ratio"] = row["reader_gbps"] / row["bare_gbps"]
        rows.append(row)
        if not a.json:
            print(f"pair {p}: reader {row['reader_gbps']:.3f} GB/s  bare {row['bare_gbps']:.3f} GB/s  "
                  f"ratio {row['ratio']:.2f}", flush=True)
    reader.close()
    ratios = sorted(r["ratio"] for r in rows)
    summary = {"data": a.data, "threads": a.threads, "per_call": a.per_call, "calls": a.calls,
               "blocks": a.blocks, "reader": repr(reader), "open_stats": reader.open_stats(), "pairs": rows,
               "ratio_min": ratios[0], "ratio_median": float(np.median(ratios)), "load_avg": os.getloadavg()}
    if a.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"ratio min {ratios[0]:.2f}, median {summary['ratio_median']:.2f}; load {os.getloadavg()}")


if __name__ == "__main__":
    main()
