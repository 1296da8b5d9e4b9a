"""``solar gen PRESET OUTDIR``: write a realistic synthetic dataset and its layout spec."""
from __future__ import annotations

import json
import os
import time

from ..gen import PRESETS, STORAGE_PRESETS, GenConfig, Storage, generate
from ..errors import SpecError
from .argtypes import non_negative_int, positive_int

HELP = """\
presets:
  ptychonn   one file, X_train/Y_I_train/Y_phi_train float32 [N,S,S,1] (default N=2048, S=128)
  well       The Well layout, train/valid/test folders, one file per parameter set,
             t0_fields/{density,pressure} [B,T,S,3S], t1_fields/velocity [B,T,S,3S,2];
             --samples = trajectories per train file (default 4), --steps T (default 101, >= 5
             for the spec's 4+1-frame windows); real file names, The Well's attributes and
             boundary masks (passes its format checker), and stats.yaml (train-split mean/std/rms)
  pdebench   --variant single: root density/pressure/Vx/Vy [N,T,S,S] (default N=100, T=21);
             --variant mult: one group per seed with data [T,S,S,2], lzf (default N=50, T=101)
  cosmoflow  one file per sample: full int16 [S,S,S,4] + unitPar [4] (default N=32, S=128)

storage (--storage):
  contiguous  no chunking (default, except pdebench mult: lzf)
  chunked     one sample (or frame) per chunk
  multi       --chunk-samples K (default 4) samples per chunk
  gzip        multi + gzip level 4
  lzf         multi + lzf + shuffle

example:
  solar gen ptychonn data/ptycho --samples 512 --size 64 --storage gzip
"""


def add_parser(sub):
    p = sub.add_parser("gen", help="generate a realistic synthetic HDF5 dataset",
                       description="Write a seeded synthetic dataset with a real project's HDF5 layout, "
                                   "plus OUTDIR/solar-layout.json for later commands.",
                       epilog=HELP, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("preset", choices=sorted(PRESETS), metavar="PRESET", help=", ".join(sorted(PRESETS)))
    p.add_argument("outdir", metavar="OUTDIR", help="output folder (created)")
    p.add_argument("--samples", type=positive_int, help="samples (trajectories per train file for well)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="random seed (default 0)")
    p.add_argument("--size", type=positive_int, help="spatial edge S (scale down for tests)")
    p.add_argument("--steps", type=positive_int, help="time steps T (well, pdebench)")
    p.add_argument("--variant", choices=("single", "mult"), help="pdebench variant (default single)")
    p.add_argument("--storage", choices=sorted(STORAGE_PRESETS), help="storage layout (see below)")
    p.add_argument("--chunk-samples", type=positive_int, help="samples per chunk for multi/gzip/lzf (default 4)")
    p.add_argument("--fletcher32", action="store_true", default=None, help="add Fletcher-32 checksums")
    p.add_argument("--overwrite", action="store_true",
                   help="write into OUTDIR even if it holds files (those of the same name are replaced)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (default: a bar on a terminal; in a log file or pipe a line at most "
                        "every 10 s of long work)")
    p.add_argument("--json", action="store_true", help="print the written spec as JSON")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    there = os.listdir(args.outdir) if os.path.isdir(args.outdir) else []
    if there and not args.overwrite:
        raise SpecError(f"{args.outdir} is not empty ({len(there)} entries): give an empty or new folder, or "
                        f"--overwrite to replace its files of the same names")
    storage = None
    if args.variant is not None and args.preset != "pdebench":
        raise SpecError(f"--variant is pdebench's (single or mult), not {args.preset}'s")
    if args.steps is not None and args.preset not in ("well", "pdebench"):
        raise SpecError(f"--steps (time steps a trajectory) is for well and pdebench; {args.preset} has none")
    if args.chunk_samples is not None and args.storage in ("contiguous", "chunked"):
        fixed = "no chunks" if args.storage == "contiguous" else "one sample a chunk"
        raise SpecError(f"--chunk-samples {args.chunk_samples} does not apply to --storage {args.storage} ({fixed}); "
                        f"use --storage multi, gzip or lzf for chunks of several samples")
    if args.storage or args.chunk_samples is not None or args.fletcher32:
        storage = Storage.preset(args.storage or ("multi" if args.chunk_samples else "chunked"),
                                 chunk_samples=args.chunk_samples, fletcher32=args.fletcher32)
    cfg = GenConfig(samples=args.samples, seed=args.seed, size=args.size, steps=args.steps, storage=storage,
                    variant=args.variant, progress=not args.no_progress)
    t = time.perf_counter()
    spec = generate(args.preset, args.outdir, cfg)
    dt = time.perf_counter() - t
    if args.json:
        print(json.dumps({**spec.to_dict(), "root": spec.root, "seconds": round(dt, 3)}, indent=2))
    else:
        print(f"wrote {args.preset} to {args.outdir} in {dt:.1f} s; spec: {spec.root}/solar-layout.json")
        print(f"next: solar inspect {args.outdir}")
    return 0
