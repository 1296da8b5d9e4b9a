"""``solar inspect PATH``: datasets, blocks per sample and read amplification of a layout."""
from __future__ import annotations

import json
import sys

from ..layout import load_layout
from ..layout.summary import format_summary, summarize


def add_parser(sub):
    p = sub.add_parser("inspect", help="describe a dataset layout (or a schedule)",
                       description="Print datasets, shapes, dtypes, chunking, filters, samples, blocks per "
                                   "sample, bytes per sample and the read amplification of naive per-sample "
                                   "reads.  PATH: a solar-layout.json, a folder holding one, or an HDF5 file.  Given a "
                                   "schedule file (solar plan -o), summarise the planned job instead.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    if _is_schedule(args.path):
        from ..schedule import Schedule
        from ..schedule.summary import format_schedule
        with Schedule.load(args.path) as sched:
            s = sched.summary()
        print(json.dumps(s, indent=2) if args.json else format_schedule(s))
        return 0
    layout = load_layout(args.path, progress=sys.stderr.isatty())
    s = summarize(layout)
    print(json.dumps(s, indent=2) if args.json else format_summary(s))
    return 0


def _is_schedule(path: str) -> bool:
    import h5py
    from ..schedule.format import FORMAT
    try:
        with h5py.File(path, "r", locking=False) as f:
            return f.attrs.get("format") in (FORMAT, FORMAT.encode())  # str (version 1) or fixed-length bytes
    except (OSError, ValueError):
        return False
