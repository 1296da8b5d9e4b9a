"""The ``solar`` command line: one module per sub-command, each with ``add_parser`` and ``run``."""
from __future__ import annotations

import argparse
import sys

from ..errors import SolarError
from . import bench_cmd, gen_cmd, inspect_cmd, plan_cmd, simulate_cmd

COMMANDS = (gen_cmd, inspect_cmd, simulate_cmd, plan_cmd, bench_cmd)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="solar",
        description="Feed HDF5 scientific data to distributed PyTorch training with a precomputed, "
                    "reuse-maximising schedule (SOLAR-style).")
    from .. import __version__
    p.add_argument("--version", action="version", version=f"solar {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for mod in COMMANDS:
        mod.add_parser(sub)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except SolarError as exc:
        print(f"solar {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("solar: interrupted", file=sys.stderr)
        return 130
