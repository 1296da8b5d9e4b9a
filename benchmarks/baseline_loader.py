"""One baseline loader (DistributedSampler + DataLoader; see solar.bench.baseline) next to the disk's cold speed.

    mpiexec -n 2 python benchmarks/baseline_loader.py data/bench-ptycho --kind memmap --epochs 2 --cold file

Rank 0 first measures the disk's cold random-read (the layout's blocks, 16 in flight)
and sequential-read bandwidth on the data files (the physical limit), then every rank
runs :func:`solar.bench.baseline.run_baseline` with ``--kind``, dropping the page cache
before each epoch as ``--cold`` says.  mpi4py is imported
inside ``main()`` only: DataLoader workers import this script again.
"""
import argparse
import json
import os


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", help="layout spec, folder with solar-layout.json, or HDF5 file")
    ap.add_argument("--local-batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--kind", default="torch", help="baseline: torch, memmap, h5py-cache or batched")
    ap.add_argument("--memory", type=int, default=None, help="h5py-cache: chunk-cache bytes per rank")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-time", type=float, default=0.0, help="seconds of simulated training per batch")
    ap.add_argument("--cold", choices=("file", "system", "none"), default="file",
                    help="page cache drop before each epoch: file = fadvise on the data files (default), "
                         "system = echo 3 > /proc/sys/vm/drop_caches (root), none = warm")
    ap.add_argument("--start-method", choices=("forkserver", "spawn"), default="forkserver")
    ap.add_argument("--verify", type=int, default=4, help="delivered samples per epoch and rank checked against h5py")
    ap.add_argument("--no-disk", action="store_true", help="skip the cold reads of the data files")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    from mpi4py import MPI

    from solar.bench import make_cache_dropper
    from solar.bench.baseline import run_baseline
    from solar.bench.limits import measure_disk
    from solar.layout import load_layout

    comm = MPI.COMM_WORLD
    layout = load_layout(a.data)
    disk = None
    if not a.no_disk:
        if comm.rank == 0:
            disk = measure_disk(layout)
        disk = comm.bcast(disk, root=0)
    drop, how = make_cache_dropper(layout.files, a.cold, comm=comm)
    epochs = run_baseline(a.data, comm=comm, local_batch=a.local_batch, epochs=a.epochs, seed=a.seed,
                          num_workers=a.workers, step_time=a.step_time,
                          drop_cache=None if a.cold == "none" else drop, progress=not a.json,
                          verify=a.verify, start_method=a.start_method, kind=a.kind, memory_bytes=a.memory)
    if comm.rank != 0:
        return
    out = {
        "data": a.data, "files": len(layout.files), "samples": layout.n_samples,
        "data_bytes": int(sum(os.path.getsize(p) for p in layout.files)),
        "kind": a.kind, "ranks": comm.size, "local_batch": a.local_batch, "workers": a.workers, "start_method": a.start_method,
        "step_time": a.step_time, "cache": how,
        "disk_random_read_gbps": round(disk["random_read_gbps"], 3) if disk else None,
        "disk_sequential_read_gbps": round(disk["sequential_read_gbps"], 3) if disk else None,
        "disk_method": [disk["random"]["method"], disk["sequential"]["method"]] if disk else None,
        "epochs": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in e.items()} for e in epochs],
    }
    for e in out["epochs"]:
        e["gb_per_s"] = round(e["global_bytes"] / e["seconds"] / 1e9, 3)
        if disk:
            e["fraction_of_random_read"] = round(e["global_bytes"] / e["seconds"] / disk["random_read_gbps"] / 1e9, 3)
    if a.json:
        print(json.dumps(out, indent=2))
        return
    for k, v in out.items():
        if k != "epochs":
            print(f"{k}: {v}")
    for e in out["epochs"]:
        print(f"epoch {e['epoch']}: {e['global_samples']} samples in {e['seconds']:.2f} s = "
              f"{e['samples_per_s']:.0f} samples/s, {e['gb_per_s']:.3f} GB/s"
              + (f" ({e['fraction_of_random_read']:.0%} of the disk's random reads)" if disk else "")
              + f", stall max {e['stall_max_s']:.2f} s, verified {e['verified']} on rank 0")


if __name__ == "__main__":
    main()
