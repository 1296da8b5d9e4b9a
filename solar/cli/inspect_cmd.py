"""``solar inspect PATH``: an HDF5 file's tree and what a sample is; a layout's blocks per sample and read
amplification; or a schedule's planned job."""
from __future__ import annotations

import json
import os

from ..errors import SpecError
from ..layout import load_layout
from ..layout.summary import format_summary, summarize
from .argtypes import _argtype, _positive


def add_parser(sub):
    p = sub.add_parser("inspect", help="describe an HDF5 file, a dataset layout or a schedule",
                       description="Given an HDF5 file: its datasets (shape, dtype, chunking, filters), what a "
                                   "sample is (the best guess, with the spec that selects it, and the "
                                   "alternatives), and the chosen spec's samples, blocks per sample, bytes per "
                                   "sample and read amplification; --save-spec writes that spec for solar plan.  "
                                   "Given a spec or a folder holding solar-layout.json: the same figures for its "
                                   "layout.  Given a schedule file (solar plan -o): the planned job.  A file "
                                   "with no numeric dataset of 2+ values is refused with one line (exit 2).")
    p.add_argument("path", metavar="PATH",
                   help="an HDF5 data file, a solar-layout.json (or a folder holding one), or a schedule")
    p.add_argument("--json", action="store_true",
                   help="machine-readable output (for an HDF5 file: also every object of the file under 'tree' "
                        "and each choice's spec)")
    p.add_argument("--alternative", type=_argtype(_positive, "alternative"), metavar="K",
                   help="HDF5 file only: use alternative K of the listed ones instead of the best guess (its "
                        "layout is summarised, and saved with --save-spec)")
    p.add_argument("--save-spec", metavar="SPEC",
                   help="HDF5 file only: write the chosen spec to SPEC (a .json file, or a folder: "
                        "SPEC/solar-layout.json), its file path relative to SPEC's folder, ready for "
                        "'solar plan SPEC'; an existing file is kept unless --overwrite")
    p.add_argument("--overwrite", action="store_true", help="let --save-spec replace an existing file")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress on stderr (default: a bar on a terminal; in a log file or pipe a line at most "
                        "every 10 s of long work)")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    file_only = [opt for opt, given in (("--alternative", args.alternative is not None),
                                        ("--save-spec", args.save_spec is not None),
                                        ("--overwrite", args.overwrite)) if given]
    if _is_schedule(args.path):
        _no_file_options(file_only, f"{args.path} is a schedule")
        from ..schedule import Schedule
        from ..schedule.summary import format_schedule
        with Schedule.load(args.path) as sched:
            s = sched.summary()
        print(json.dumps(s, indent=2) if args.json else format_schedule(s))
        return 0
    if os.path.isdir(args.path) or args.path.endswith(".json") or not os.path.exists(args.path):
        if os.path.exists(args.path):  # a missing path: load_layout names it
            _no_file_options(file_only, f"{args.path} is a spec or a folder, not one")
        layout = load_layout(args.path, progress=args.progress)
        s = summarize(layout)
        print(json.dumps(s, indent=2) if args.json else format_summary(s))
        return 0
    return _describe(args)


def _describe(args) -> int:
    from ..errors import LayoutError
    from ..layout.describe import chosen_spec, describe_file, format_description, save_spec, spec_destination
    if args.overwrite and args.save_spec is None:
        raise SpecError("--overwrite goes with --save-spec")
    dest = spec_destination(args.save_spec, args.overwrite) if args.save_spec is not None else None
    d = describe_file(args.path, alternative=args.alternative or 0, progress=args.progress)
    if dest is not None and "layout_error" not in d:
        d["saved_spec"] = save_spec(chosen_spec(d, os.path.dirname(os.path.abspath(dest))), dest)
    print(json.dumps(d, indent=2) if args.json else format_description(d))
    if "layout_error" in d:  # described, but the chosen spec cannot be used: say so in the exit status
        raise LayoutError(d["layout_error"] + (f" (nothing written to {dest})" if dest else ""))
    return 0


def _no_file_options(given, why: str):
    if given:
        raise SpecError(f"{' and '.join(given)}: only for an HDF5 data file, and {why}")


def _is_schedule(path: str) -> bool:
    import h5py
    from ..schedule.format import FORMAT
    try:
        with h5py.File(path, "r", locking=False) as f:
            return f.attrs.get("format") in (FORMAT, FORMAT.encode())  # str (version 1) or fixed-length bytes
    except (OSError, ValueError):
        return False
