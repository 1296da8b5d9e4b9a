"""Where one rank's CPU goes, per thread: a bare loop over SolarLoader (torch batches) with the page cache
dropped before every epoch, and each epoch's CPU seconds of each of the loader's thread groups (readers and
decoders ``solar-pread``, the I/O pool ``solar-io``, the prefetch thread, the assembly workers), read from
``/proc/self/task/*/stat`` (Linux).

    python benchmarks/thread_cpu.py data/gz2k --world-size 2 --rank 0 -b 32 --epochs 3 --buffer-fraction 0.5

One process plays rank ``--rank`` of a ``--world-size`` plan with a buffer of its own (no MPI), so the CPU it
reports is that rank's share.  Prints one line per epoch: wall seconds, the process's CPU seconds (user, system),
and the CPU seconds of each thread group; ``--json`` prints them as JSON.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import resource
import sys
import tempfile
import threading
import time


def thread_cpu() -> dict:
    """CPU seconds (user + system) of this process's threads so far, summed per thread name without its
    rank and number (``solar-pread_7`` -> ``solar-pread``, ``solar-io-r0_3`` -> ``solar-io``); threads Python does not know are ``other``."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out = collections.Counter()
    for d in glob.glob(f"/proc/{os.getpid()}/task/*"):
        try:
            with open(d + "/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        name = re.sub(r"[-_]?r?\d+(_\d+)?$", "", names.get(int(d.rsplit("/", 1)[1]), "other"))
        out[name] += (int(fields[11]) + int(fields[12])) / tick
    return dict(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("-b", "--local-batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--buffer-fraction", type=float, default=0.5)
    ap.add_argument("--warm", action="store_true", help="leave the page cache as it is (default: drop the data "
                                                        "files' pages before every epoch)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import solar
    import torch  # noqa: F401 - imported before the loader, as a training script does
    from solar.bench.cache import drop_file_cache
    from solar.loader import SolarLoader
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        plan = os.path.join(tmp, "plan.h5")
        solar.plan(a.data, world_size=a.world_size, local_batch=a.local_batch, epochs=a.epochs,
                   buffer_fraction=a.buffer_fraction, out=plan).close()
        files = list(solar.load_layout(a.data).files)
        with SolarLoader(plan, a.data, rank=a.rank, as_torch=True, epoch_fence=True) as loader:
            loader.prepare()
            for e in range(a.epochs):
                if not a.warm:
                    drop_file_cache(files)
                c0, r0, t0 = thread_cpu(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                loader.set_epoch(e)
                for _ in loader:
                    pass
                wall, r1, c1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF), thread_cpu()
                per = {k: round(v - c0.get(k, 0.0), 3) for k, v in c1.items() if v - c0.get(k, 0.0) > 0.005}
                rows.append({"epoch": e, "wall_s": round(wall, 3), "user_s": round(r1.ru_utime - r0.ru_utime, 3),
                             "system_s": round(r1.ru_stime - r0.ru_stime, 3),
                             "threads_s": dict(sorted(per.items(), key=lambda kv: -kv[1]))})
    if a.json:
        print(json.dumps({"data": a.data, "world_size": a.world_size, "rank": a.rank, "local_batch": a.local_batch,
                          "buffer_fraction": a.buffer_fraction, "cold": not a.warm, "cpus": os.cpu_count(),
                          "epochs": rows}, indent=2))
    else:
        for r in rows:
            cpu = r["user_s"] + r["system_s"]
            print(f"epoch {r['epoch']}: {r['wall_s']:.2f} s wall, CPU {cpu:.2f} s (user {r['user_s']:.2f}, "
                  f"system {r['system_s']:.2f}): " + ", ".join(f"{k} {v:.2f}" for k, v in r["threads_s"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
