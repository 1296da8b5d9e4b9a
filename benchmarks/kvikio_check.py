"""Unfiltered blocks read straight into device memory with KvikIO, against solar's own path to the device.

    python benchmarks/kvikio_check.py DATA [--device cuda] [--threads 16] [--step-blocks 384] [--max-bytes 1GiB] [--json]

Issue 24 asks for KvikIO (``kvikio-cu13`` on PyPI; compat mode where there is no GPUDirect Storage) where it is
measured to help.  This measures it on DATA's blocks that need no decoding (a contiguous or unfiltered chunked
dataset), the same blocks in the same random order for every method, read a step at a time (``--step-blocks``
blocks, what one step's misses are), the page cache dropped before each method:

* ``disk``: the disk's own rate for these reads (``os.preadv`` into host memory, ``--threads`` at once:
  :func:`solar.bench.disk.cold_random_read`), the limit;
* ``solar``: solar's ``pread`` reader (``O_DIRECT`` where the file system allows it, ``--threads`` workers) into
  a host staging buffer (pinned on CUDA), then one copy of the step to the device, as the device buffer tier
  moves a step's misses;
* ``kvikio``: ``kvikio.CuFile.pread`` of each block straight into its place in device memory, every block of a
  step in flight at once (KvikIO's own thread pool of ``--threads`` threads), then waited for.

Every method's bytes on the device are compared with the file's bytes (``numpy.fromfile``).  Per method the
report gives seconds, bytes and GB/s; for KvikIO its version and whether it ran in compat mode, or why it could
not run (it needs ``libcuda``, so on a machine without a GPU it reports itself unavailable and the rest still
runs: ``--device cpu``).  ``benchmarks/gpu_check.sh kvikio`` runs it on a GPU machine.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("ib").rstrip("b")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(float(t))


def pick_blocks(layout, max_bytes: int, seed: int):
    """int64[k]: DATA's blocks that need no decoding, in one random order, the first ``max_bytes`` of them."""
    import numpy as np

    from solar.errors import SolarError
    from solar.io.block_plan import direct_mask
    every = np.arange(layout.block_nbytes.shape[0], dtype=np.int64)
    on = every[(layout.block_offset >= 0) & (layout.block_stored > 0)]
    raw = on[direct_mask(layout, on)]
    if raw.shape[0] == 0:
        raise SolarError(f"{', '.join(layout.files)}: no block is stored without a filter; KvikIO reads such "
                         f"blocks only (a contiguous or unfiltered chunked dataset)")
    raw = raw[np.random.default_rng(seed).permutation(raw.shape[0])]
    keep = int(np.searchsorted(np.cumsum(layout.block_nbytes[raw]), max_bytes, side="right"))
    return raw[:max(1, keep)]


def expected(layout, blocks):
    """uint8: the blocks' bytes as the file holds them, back to back (the reference)."""
    import numpy as np
    files = np.array([layout.datasets[d].file for d in range(len(layout.datasets))], dtype=np.int64)
    parts = [np.fromfile(layout.files[int(files[layout.block_dataset[b]])], np.uint8,
                         count=int(layout.block_stored[b]), offset=int(layout.block_offset[b])) for b in blocks.tolist()]
    return np.concatenate(parts)


def steps_of(n: int, per: int):
    return [(a, min(n, a + per)) for a in range(0, n, per)]


def run_solar(layout, blocks, dst, starts, per_step: int, threads: int, device: str) -> float:
    """Seconds to read ``blocks`` step by step with the pread reader into host staging, each step copied to ``dst``."""
    import torch

    from solar.io import get_reader
    nb = layout.block_nbytes[blocks]
    most = int(max(nb[a:b].sum() for a, b in steps_of(blocks.shape[0], per_step)))
    stage = torch.empty(most, dtype=torch.uint8, pin_memory=device != "cpu")
    host = stage.numpy()
    from solar.bench.cache import drop_file_cache
    with get_reader("pread", layout, threads=threads) as reader:
        reader.start()
        reader.read_blocks(blocks[:2], [host[:int(nb[0])], host[int(nb[0]):int(nb[:2].sum())]])  # numba's kernels loaded
        drop_file_cache(layout.files)
        t0 = time.perf_counter()
        for a, b in steps_of(blocks.shape[0], per_step):
            off = starts[a:b + 1] - starts[a]
            reader.read_blocks(blocks[a:b], [host[off[i]:off[i + 1]] for i in range(b - a)])
            n = int(off[-1])
            dst[int(starts[a]):int(starts[b])].copy_(stage[:n], non_blocking=device != "cpu")
            if device != "cpu":
                torch.cuda.synchronize()  # the staging buffer is written again by the next step
        return time.perf_counter() - t0


def run_kvikio(layout, blocks, dst, starts, per_step: int, threads: int) -> tuple:
    """(seconds, info) of ``kvikio.CuFile.pread`` of every block into its place in ``dst``, a step at a time."""
    import kvikio
    import kvikio.defaults as kd
    kd.set({"num_threads": int(threads)})
    files = [layout.datasets[d].file for d in range(len(layout.datasets))]
    handles = {}
    try:
        for f in sorted({files[int(d)] for d in set(layout.block_dataset[blocks].tolist())}):
            handles[f] = kvikio.CuFile(layout.files[f], "r")
        info = {"version": kvikio.__version__, "compat_mode": str(kd.get("compat_mode")),
                "compat_mode_preferred": bool(kd.is_compat_mode_preferred()), "num_threads": int(kd.get("num_threads"))}
        t0 = time.perf_counter()
        for a, b in steps_of(blocks.shape[0], per_step):
            futs = []
            for i in range(a, b):
                k = int(blocks[i])
                n = int(layout.block_stored[k])
                futs.append(handles[files[int(layout.block_dataset[k])]].pread(
                    dst[int(starts[i]):int(starts[i]) + n], n, int(layout.block_offset[k])))
            got = sum(f.get() for f in futs)
            if got != int(starts[b] - starts[a]):
                raise RuntimeError(f"KvikIO read {got} bytes of a step of {int(starts[b] - starts[a])}")
        return time.perf_counter() - t0, info
    finally:
        for h in handles.values():
            h.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", help="layout spec or folder (solar gen ptychonn D: a contiguous file)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run: KvikIO cannot run there)")
    ap.add_argument("--threads", type=int, default=16, help="reads in flight for each method (default 16)")
    ap.add_argument("--step-blocks", type=int, default=384, help="blocks read a step at a time (default 384)")
    ap.add_argument("--max-bytes", default="1GiB", help="bytes each method reads (default 1GiB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import numpy as np
    import torch

    from solar.bench.cache import drop_file_cache
    from solar.bench.disk import cold_random_read
    from solar.errors import SolarError
    from solar.layout import load_layout
    try:
        layout = load_layout(a.data)
        blocks = pick_blocks(layout, parse_bytes(a.max_bytes), a.seed)
    except SolarError as exc:
        print(f"kvikio_check: {exc}", file=sys.stderr)
        return 2
    nb = layout.block_stored[blocks].astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(nb)])
    total = int(starts[-1])
    ref = torch.from_numpy(expected(layout, blocks)).to(a.device)
    res = {"data": a.data, "device": a.device, "threads": a.threads, "step_blocks": a.step_blocks,
           "blocks": int(blocks.shape[0]), "bytes": total, "block_bytes": int(np.median(nb)), "methods": {}}
    if a.device != "cpu":
        res["device_name"] = torch.cuda.get_device_name(0)
    files = np.array([layout.datasets[d].file for d in range(len(layout.datasets))], dtype=np.int64)
    ext = np.stack([files[layout.block_dataset[blocks]], layout.block_offset[blocks], nb], axis=1)
    disk = cold_random_read(layout.files, ext, depth=a.threads, max_bytes=total, max_seconds=30.0, seed=a.seed)
    res["methods"]["disk"] = {"seconds": disk["seconds"], "bytes": disk["bytes"],
                              "gbps": disk["bytes"] / disk["seconds"] / 1e9, "method": disk["method"]}
    dst = torch.empty(total, dtype=torch.uint8, device=a.device)
    for name in ("solar", "kvikio"):
        dst.zero_()
        drop_file_cache(layout.files)
        try:
            if name == "solar":
                secs, info = run_solar(layout, blocks, dst, starts, a.step_blocks, a.threads, a.device), {}
            else:
                secs, info = run_kvikio(layout, blocks, dst, starts, a.step_blocks, a.threads)
        except Exception as exc:  # noqa: BLE001 - KvikIO missing or without a GPU: said, the rest still runs
            if name == "solar":
                raise
            res["methods"][name] = {"unavailable": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
            continue
        if a.device != "cpu":
            torch.cuda.synchronize()
        res["methods"][name] = {"seconds": secs, "bytes": total, "gbps": total / secs / 1e9,
                                "equal_to_file": bool(torch.equal(dst, ref)), **info}
    m = res["methods"]
    if "gbps" in m.get("kvikio", {}):
        res["kvikio_vs_solar"] = m["kvikio"]["gbps"] / m["solar"]["gbps"]
    for k, v in m.items():
        print(f"{k}: " + (f"{v['gbps']:.2f} GB/s ({v['bytes'] / 2**20:.0f} MiB in {v['seconds']:.2f} s)"
                          + ("" if "equal_to_file" not in v else f", equal to the file: {v['equal_to_file']}")
                          if "gbps" in v else v["unavailable"]), file=sys.stderr, flush=True)
    if a.json:
        print(json.dumps(res, indent=1))
    return 0 if all(v.get("equal_to_file", True) for v in m.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
