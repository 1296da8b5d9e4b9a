"""Unfiltered blocks read straight into device memory with KvikIO, against solar's own path to the device.

    python benchmarks/kvikio_check.py DATA [--device cuda] [--threads 16] [--step-blocks 384] [--max-bytes 1GiB] [--json]

Issue 24 asks for KvikIO (``kvikio-cu13`` on PyPI; compat mode where there is no GPUDirect Storage) where it is
measured to help.  This measures it on DATA's blocks that need no decoding (a contiguous or unfiltered chunked
dataset), the same blocks in the same random order for every method, read a step at a time (``--step-blocks``
blocks, what one step's misses are), the page cache dropped before each method:

* ``disk``: the disk's own rate for these blocks (``os.preadv`` into host memory, ``--threads`` at once, in an
  order of its own: :func:`solar.bench.disk.cold_random_read`), the limit;
* ``solar``: solar's ``pread`` reader (``O_DIRECT`` where the file system allows it, ``--threads`` workers) into
  a host staging buffer (pinned on CUDA), then one copy of the step to the device, as the device buffer tier
  moves a step's misses;
* ``kvikio``: ``kvikio.CuFile.pread`` of each block straight into its place in device memory, every block of a
  step in flight at once (KvikIO's own thread pool of ``--threads`` threads), then waited for.

The bytes solar and KvikIO put on the device are compared with the file's bytes (``numpy.fromfile``, checked
against h5py for the first blocks).  Per method the report gives seconds, bytes and GB/s; for KvikIO its
version, its compat-mode setting and whether it reads with ``O_DIRECT`` (``auto_direct_io_read``); for solar
whether it did.  KvikIO that cannot start (not installed; it needs ``libcuda``, so on a machine without a GPU it
is unavailable and the rest still runs: ``--device cpu``) is reported as ``unavailable``; KvikIO that fails
while reading, or delivers other bytes, as ``failed``, and the exit status is 1.
``benchmarks/gpu_check.sh kvikio`` runs it on a GPU machine.
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


def h5py_agrees(layout, blocks) -> bool:
    """The first blocks' bytes as :func:`expected` reads them equal h5py's (the reference's own check: a
    wrong block map would read wrong bytes for every method alike)."""
    import numpy as np

    from solar.io import get_reader
    nb = layout.block_nbytes[blocks]
    out = [np.empty(int(n), np.uint8) for n in nb]
    with get_reader("h5py", layout) as h5:
        h5.read_blocks(blocks, out)
    return bool(np.array_equal(np.concatenate(out), expected(layout, blocks)))


def expected(layout, blocks):
    """uint8: the blocks' bytes as the file holds them, back to back (the reference)."""
    import numpy as np
    files = np.array([layout.datasets[d].file for d in range(len(layout.datasets))], dtype=np.int64)
    parts = [np.fromfile(layout.files[int(files[layout.block_dataset[b]])], np.uint8,
                         count=int(layout.block_stored[b]), offset=int(layout.block_offset[b])) for b in blocks.tolist()]
    return np.concatenate(parts)


def steps_of(n: int, per: int):
    return [(a, min(n, a + per)) for a in range(0, n, per)]


def run_solar(layout, blocks, dst, starts, per_step: int, threads: int, device: str) -> tuple:
    """(seconds, info) to read ``blocks`` step by step with the pread reader into host staging, each step copied
    to ``dst``."""
    import torch

    from solar.bench.cache import drop_file_cache
    from solar.io import get_reader
    nb = layout.block_nbytes[blocks]
    most = int(max(nb[a:b].sum() for a, b in steps_of(blocks.shape[0], per_step)))
    stage = torch.empty(most, dtype=torch.uint8, pin_memory=device != "cpu")
    host = stage.numpy()
    with get_reader("pread", layout, threads=threads) as reader:
        reader.start()
        reader.read_blocks(blocks[:1], [host[:int(nb[0])]])  # numba's kernels loaded, outside the timer
        drop_file_cache(layout.files)
        info = {"o_direct": bool(getattr(reader, "direct", False))}
        t0 = time.perf_counter()
        for a, b in steps_of(blocks.shape[0], per_step):
            off = starts[a:b + 1] - starts[a]
            reader.read_blocks(blocks[a:b], [host[off[i]:off[i + 1]] for i in range(b - a)])
            n = int(off[-1])
            dst[int(starts[a]):int(starts[b])].copy_(stage[:n], non_blocking=device != "cpu")
            if device != "cpu":
                torch.cuda.synchronize()  # the staging buffer is written again by the next step
        return time.perf_counter() - t0, info


class Unavailable(Exception):
    """KvikIO cannot start here (not installed, no libcuda, no cuFile): said, not a failure of the check."""


def open_kvikio(layout, blocks, threads: int) -> tuple:
    """(kvikio module, {file index: CuFile}, info); Unavailable when KvikIO cannot start here."""
    try:
        import kvikio
        import kvikio.defaults as kd
        kd.set({"num_threads": int(threads)})
        files = [layout.datasets[d].file for d in range(len(layout.datasets))]
        handles = {}
        for f in sorted({files[int(d)] for d in set(layout.block_dataset[blocks].tolist())}):
            handles[f] = kvikio.CuFile(layout.files[f], "r")
    except Exception as exc:  # noqa: BLE001 - any failure to start: KvikIO is not usable here
        raise Unavailable(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}") from exc
    info = {"version": kvikio.__version__, "compat_mode": str(kd.get("compat_mode")),
            "compat_mode_preferred": bool(kd.is_compat_mode_preferred()), "num_threads": int(kd.get("num_threads")),
            "o_direct": bool(kd.get("auto_direct_io_read"))}
    return kvikio, handles, info


def run_kvikio(layout, blocks, dst, starts, per_step: int, handles) -> float:
    """Seconds of ``CuFile.pread`` of every block into its place in ``dst``, a step at a time (every read of a
    step waited for, also when one fails, before the next step or the error)."""
    files = [layout.datasets[d].file for d in range(len(layout.datasets))]

    def step(a, b):
        futs = []
        for i in range(a, b):
            k = int(blocks[i])
            n = int(layout.block_stored[k])
            futs.append(handles[files[int(layout.block_dataset[k])]].pread(
                dst[int(starts[i]):int(starts[i]) + n], n, int(layout.block_offset[k])))
        got, first = 0, None
        for f in futs:
            try:
                got += f.get()
            except Exception as exc:  # noqa: BLE001 - raised once all of the step's reads are over
                first = first or exc
        if first is not None:
            raise first
        if got != int(starts[b] - starts[a]):
            raise RuntimeError(f"KvikIO read {got} bytes of a step of {int(starts[b] - starts[a])}")

    from solar.bench.cache import drop_file_cache
    step(0, 1)  # KvikIO's own first-use set-up (thread pool, bounce buffers), outside the timer as solar's
    drop_file_cache(layout.files)
    t0 = time.perf_counter()
    for a, b in steps_of(blocks.shape[0], per_step):
        step(a, b)
    return time.perf_counter() - t0


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
    if a.step_blocks < 1 or a.threads < 1:
        ap.error(f"--step-blocks and --threads must be at least 1, got {a.step_blocks} and {a.threads}")
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
    if not h5py_agrees(layout, blocks[:8]):
        print(f"kvikio_check: {a.data}: the blocks' bytes at the layout's offsets differ from h5py's", file=sys.stderr)
        return 1
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

    def fresh():
        dst.zero_()
        if a.device != "cpu":
            torch.cuda.synchronize()  # zeroed before any read lands (KvikIO does not use torch's stream)
        drop_file_cache(layout.files)

    fresh()
    secs, info = run_solar(layout, blocks, dst, starts, a.step_blocks, a.threads, a.device)
    if a.device != "cpu":
        torch.cuda.synchronize()
    res["methods"]["solar"] = {"seconds": secs, "bytes": total, "gbps": total / secs / 1e9,
                               "equal_to_file": bool(torch.equal(dst, ref)), **info}
    try:
        kvikio, handles, info = open_kvikio(layout, blocks, a.threads)
    except Unavailable as exc:
        res["methods"]["kvikio"] = {"unavailable": str(exc)}
    else:
        try:
            fresh()
            secs = run_kvikio(layout, blocks, dst, starts, a.step_blocks, handles)
            if a.device != "cpu":
                torch.cuda.synchronize()
            res["methods"]["kvikio"] = {"seconds": secs, "bytes": total, "gbps": total / secs / 1e9,
                                        "equal_to_file": bool(torch.equal(dst, ref)), **info}
        except Exception as exc:  # noqa: BLE001 - a failure while reading: reported, the check fails
            res["methods"]["kvikio"] = {"failed": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}",
                                        **info}
        finally:
            for h in handles.values():
                h.close()
    m = res["methods"]
    if "gbps" in m.get("kvikio", {}):
        res["kvikio_vs_solar"] = m["kvikio"]["gbps"] / m["solar"]["gbps"]
    for k, v in m.items():
        print(f"{k}: " + (f"{v['gbps']:.2f} GB/s ({v['bytes'] / 2**20:.0f} MiB in {v['seconds']:.2f} s)"
                          + ("" if "equal_to_file" not in v else f", equal to the file: {v['equal_to_file']}")
                          if "gbps" in v else f"unavailable: {v['unavailable']}" if "unavailable" in v else
                          f"FAILED: {v['failed']}"), file=sys.stderr, flush=True)
    if a.json:
        print(json.dumps(res, indent=1))
    return 0 if all(v.get("equal_to_file", True) and "failed" not in v for v in m.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
