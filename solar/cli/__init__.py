"""The ``solar`` command line: one module per sub-command, each with ``add_parser`` and ``run``."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading

from ..atomic import in_io_callback
from ..errors import SolarError, Terminated
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
    """Run one command; user errors, interrupts and a closed stdout end with one line on stderr, no traceback.

    Exit status: 0 ok, 2 error, 130 Ctrl-C, 143 SIGTERM, 141 stdout closed early (``| head``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    prefix = f"solar {args.command}"
    try:
        with _signals_raise():
            rc = int(args.run(args) or 0)
            sys.stdout.flush()  # a closed pipe shows up here, not at exit
        return rc
    except SolarError as exc:  # (the API's argument names in it written as this CLI's options)
        from .argtypes import as_flags
        print(f"{prefix}: error: {as_flags(str(exc))}", file=sys.stderr)
        return 2
    except MemoryError as exc:  # sizes beyond the machine (solar gen --size 99999, solar plan -P 10**9)
        why = str(exc) or "an allocation failed"
        print(f"{prefix}: error: out of memory: {why}; the sizes given need more memory than this process can "
              "have", file=sys.stderr)
        return 2
    except BrokenPipeError:
        _discard_stdout()
        return 128 + signal.SIGPIPE
    except Terminated:
        print(f"{prefix}: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130


def _on_signal(signum, frame):
    """SIGTERM raises :class:`Terminated`, SIGINT ``KeyboardInterrupt`` -- but not inside an HDF5 write
    callback (HDF5 cannot recover from a failed write): there the signal is sent again a moment later."""
    if in_io_callback(frame):
        _send_again(signum)
        return
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _send_again(signum):
    """Send ``signum`` to this process in 5 ms, from a timer thread (so no handler is re-entered at once)."""
    t = threading.Timer(0.005, os.kill, (os.getpid(), signum))
    t.daemon = True
    t.start()


@contextlib.contextmanager
def _signals_raise():
    """Install :func:`_on_signal` for SIGTERM and SIGINT (main thread only), restore the old handlers after.

    An exception raised where Python cannot propagate it (a ``__del__`` or weakref callback, e.g. in
    numba's compiler) would be printed and dropped; the unraisable hook sends the signal again instead.
    """
    try:
        old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    except ValueError:  # not the main thread: leave signals alone
        old = {}
    old_hook = sys.unraisablehook

    def hook(unraisable):
        exc = unraisable.exc_value
        if old and isinstance(exc, KeyboardInterrupt):
            _send_again(signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)
        else:
            old_hook(unraisable)
    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = old_hook
        for s, h in old.items():
            signal.signal(s, h)


def _discard_stdout():
    """Point stdout at /dev/null so that Python's flush at exit does not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout replaced (tests) or already closed
        pass
