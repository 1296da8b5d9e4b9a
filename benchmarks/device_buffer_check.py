"""The device buffer tier on a GPU: the same batches as the host buffer, and how fast each delivers them there.

    python benchmarks/device_buffer_check.py data/p4k --batch 128 --epochs 3 --fractions 1.0 0.5 [--json]

Per buffer fraction, one rank's plan; then

* **equality**: ``SolarLoader(device=DEV, pin_memory=True)`` (pools in host memory, batches copied to the
  device) and ``SolarLoader(buffer_device=DEV)`` (pools on the device, batches gathered there) run in lockstep
  over every epoch; every field of every batch compared on the device (``torch.equal`` of the bytes);
* **speed**: each alone, a bare loop over its batches on the device (the device synchronised at each epoch's
  end), page cache dropped (``posix_fadvise``) before epoch 0: samples/s and GB/s per epoch.

``--device cpu`` runs the same on the CPU (the device tier's stand-in; a dry run where there is no GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def drop(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def loader(plan, data, tier: str, device: str):
    from solar.loader import SolarLoader
    if tier == "device":
        return SolarLoader(plan, data, buffer_device=device, epoch_fence=True)
    return SolarLoader(plan, data, device=None if device == "cpu" else device, pin_memory=device != "cpu",
                       epoch_fence=True)


def equal(plan, data, epochs: int, device: str) -> dict:
    import torch
    steps = diff = 0
    with loader(plan, data, "host", device) as a, loader(plan, data, "device", device) as b:
        for e in range(epochs):
            a.set_epoch(e)
            b.set_epoch(e)
            for x, y in zip(a, b):
                steps += 1
                for k, v in x.items():
                    if torch.is_tensor(v) and k != "index":
                        w = y[k]
                        if v.shape != w.shape or v.dtype != w.dtype or not torch.equal(
                                v.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)):
                            diff += 1
                if not torch.equal(x["index"].cpu(), y["index"].cpu()):
                    diff += 1
    return {"steps": steps, "different": diff}


def speed(plan, data, epochs: int, device: str, tier: str, sample_bytes: int, files) -> list:
    import torch
    out = []
    with loader(plan, data, tier, device) as ld:
        ld.prepare()
        for e in range(epochs):
            ld.set_epoch(e)
            if e == 0:
                drop(files)
            n = 0
            t0 = time.perf_counter()
            for b in ld:
                n += int(b["index"].shape[0])
            if device != "cpu":
                torch.cuda.synchronize()
            s = time.perf_counter() - t0
            out.append({"epoch": e, "seconds": s, "samples_per_s": n / s, "gbps": n * sample_bytes / s / 1e9})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import numpy as np

    import solar
    layout = solar.load_layout(a.data)
    sample_bytes = sum(int(np.prod(s)) * np.dtype(layout.field_dtypes()[f]).itemsize
                       for f, s in layout.field_shapes().items())
    res = {"data": a.data, "batch": a.batch, "device": a.device, "sample_bytes": sample_bytes, "runs": []}
    if a.device != "cpu":
        import torch
        res["device_name"] = torch.cuda.get_device_name(0)
    tmp = tempfile.mkdtemp(prefix="solar-devbuf-")
    for f in a.fractions:
        plan = os.path.join(tmp, f"plan-{f}.h5")
        solar.plan(a.data, world_size=1, local_batch=a.batch, epochs=a.epochs, buffer_fraction=f, out=plan).close()
        run = {"buffer_fraction": f, "equality": equal(plan, a.data, a.epochs, a.device)}
        for tier in ("host", "device"):
            run[tier] = speed(plan, a.data, a.epochs, a.device, tier, sample_bytes, layout.files)
        res["runs"].append(run)
        print(f"f={f}: equal steps {run['equality']['steps']}, different {run['equality']['different']}; "
              + "; ".join(f"{t}: " + ", ".join(f"{x['samples_per_s']:.0f}" for x in run[t]) + " samples/s"
                          for t in ("host", "device")), file=sys.stderr, flush=True)
    print(json.dumps(res, indent=1) if a.json else "\n".join(
        f"f={r['buffer_fraction']}: equal {r['equality']}; host {[round(x['gbps'], 2) for x in r['host']]} GB/s; "
        f"device {[round(x['gbps'], 2) for x in r['device']]} GB/s" for r in res["runs"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
