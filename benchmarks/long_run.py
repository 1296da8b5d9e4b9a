"""A long SolarLoader run under MPI: resident memory per epoch, measured vs predicted hits.

    mpiexec -n 2 python benchmarks/long_run.py --epochs 30 --buffer-fraction 0.5 --samples 512 --json

Rank 0 generates a PtychoNN-style file (``solar.gen``, chunked, in a temporary folder
unless ``--data``) and plans the job; every rank then iterates its SolarLoader for all
epochs (``as_torch=False``: no torch in the figures) and records after each epoch its
resident set size (RSS, /proc/self/statm) and its buffer statistics.  The report has
per epoch: the RSS of each rank (MiB), the hit bytes measured over all ranks and the
schedule's predicted hit bytes, and the plan violations; ``rss_growth_after_epoch2_mib``
is the largest RSS after epoch 2 minus the RSS at epoch 2, over ranks.
"""
import argparse
import json
import shutil
import tempfile

from mpi4py import MPI

import solar
from solar.bench.solar_run import rss_bytes
from solar.gen import GenConfig, Storage, generate
from solar.loader import SolarLoader


def prepare(comm, args):
    """(data folder, plan path, temporary folder or None): made on rank 0, names broadcast."""
    tmp = tempfile.mkdtemp(prefix="solar-long-run-") if comm.rank == 0 else None
    data, path = args.data, None
    if comm.rank == 0:
        if data is None:
            data = f"{tmp}/ptychonn"
            generate("ptychonn", data, GenConfig(samples=args.samples, size=args.size,
                                                 storage=Storage.preset("chunked")))
        path = f"{tmp}/plan.h5"
        solar.plan(data, world_size=comm.size, local_batch=args.local_batch, epochs=args.epochs,
                   buffer_fraction=args.buffer_fraction, out=path).close()
    return (*comm.bcast((data, path), root=0), tmp)


def run(comm, data, path, epochs):
    """Per epoch: (rss bytes of this rank, hit bytes, plan violations) of this rank."""
    rows, prev = [], {}
    with SolarLoader(path, data, comm=comm, as_torch=False) as loader:
        for e in range(loader.epoch, epochs):
            loader.set_epoch(e)
            for _ in loader:
                pass
            st = loader.stats()
            rows.append((rss_bytes(), st["hit_bytes"] - prev.get("hit_bytes", 0),
                         st["plan_violations"] - prev.get("plan_violations", 0)))
            prev = st
        predicted = loader.schedule.predicted()["hit_bytes"]
    return rows, predicted


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--buffer-fraction", type=float, default=0.5)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--size", type=int, default=64, help="diffraction image side (pixels)")
    p.add_argument("--local-batch", type=int, default=8)
    p.add_argument("--data", help="an existing layout spec or folder instead of a generated file")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    data, path, tmp = prepare(comm, args)
    try:
        rows, predicted = run(comm, data, path, args.epochs)
        every = comm.gather(rows, root=0)
    finally:
        comm.Barrier()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    if comm.rank != 0:
        return
    epochs = [{"epoch": e, "rss_mib": [round(r[e][0] / 2**20, 2) for r in every],
               "hit_bytes": sum(r[e][1] for r in every), "predicted_hit_bytes": int(predicted[e]),
               "plan_violations": sum(r[e][2] for r in every)} for e in range(args.epochs)]
    growth = max(max(r[e][0] for e in range(2, args.epochs)) - r[2][0] for r in every) / 2**20
    rep = {"ranks": comm.size, "epochs": epochs, "rss_growth_after_epoch2_mib": round(growth, 2),
           "hits_as_planned": all(x["hit_bytes"] == x["predicted_hit_bytes"] for x in epochs),
           "plan_violations": sum(x["plan_violations"] for x in epochs)}
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        for x in epochs:
            print(f"epoch {x['epoch']:3d}  RSS MiB {x['rss_mib']}  hit bytes {x['hit_bytes']:,} "
                  f"(planned {x['predicted_hit_bytes']:,})  violations {x['plan_violations']}")
        print(f"RSS growth after epoch 2: {growth:.2f} MiB; hits as planned: {rep['hits_as_planned']}; "
              f"plan violations: {rep['plan_violations']}")


if __name__ == "__main__":
    main()
