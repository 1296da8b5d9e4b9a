"""argparse ``type=`` functions: a bad value is refused with one line naming it (no traceback).

The same limits guard the Python API (:class:`solar.scheduler.config.PlanConfig`,
``parse_bytes``); here a :class:`~solar.errors.SpecError` becomes argparse's error, so the CLI prints
``solar <cmd>: error: argument --opt: <why>`` and exits with status 2.
"""
from __future__ import annotations

import argparse
import math

from ..errors import SpecError
from ..scheduler.config import MAX_EPOCHS, check_fraction, parse_bytes


def _argtype(check, name: str):
    def convert(text: str):
        try:
            return check(text)
        except SpecError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = name
    return convert


def _to_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise SpecError(f"not an integer: {text!r}") from None


def _to_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise SpecError(f"not a number: {text!r}") from None


def _positive(text: str) -> int:
    v = _to_int(text)
    if v < 1:
        raise SpecError(f"must be a positive integer, got {text!r}")
    return v


def _non_negative(text: str) -> int:
    v = _to_int(text)
    if v < 0:
        raise SpecError(f"must be an integer >= 0, got {text!r}")
    return v


def _epochs(text: str) -> int:
    v = _positive(text)
    if v > MAX_EPOCHS:
        raise SpecError(f"must be at most {MAX_EPOCHS:,} epochs (solar.scheduler.config.MAX_EPOCHS: planning is "
                        f"sequential, epoch after epoch), got {text!r}")
    return v


def _epsilon(text: str) -> float:
    v = _to_float(text)
    if not (math.isfinite(v) and 0 <= v < 1):
        raise SpecError(f"must be a number in [0, 1), got {text!r}")
    return v


def _seconds(text: str) -> float:
    v = _to_float(text)
    if not (math.isfinite(v) and v >= 0):
        raise SpecError(f"must be a number of seconds >= 0, got {text!r}")
    return v


def check_output_path(path: str, what: str, suffixes=()) -> str:
    """``path`` if a file can be written there (its folder exists and it is not a folder; ``suffixes``: the
    endings allowed), else a SpecError naming it: checked before long work, not after it."""
    import os
    if not path:
        raise SpecError(f"{what} needs a file name, got an empty one")
    folder = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        raise SpecError(f"{what} {path!r} is a folder, not a file name")
    if not os.path.isdir(folder):
        raise SpecError(f"{what} {path!r}: folder {folder} does not exist")
    if suffixes and not path.lower().endswith(tuple(suffixes)):
        raise SpecError(f"{what} {path!r} must end with {' or '.join(suffixes)}")
    return path


def check_plot_path(path: str, what: str = "--plot") -> str:
    """:func:`check_output_path` for a figure (.png, .pdf, .svg), and matplotlib importable (the extra ``plot``)."""
    import os
    import tempfile
    check_output_path(path, what, (".png", ".pdf", ".svg"))
    folder = os.path.dirname(os.path.abspath(path))
    try:  # a file of our own in its folder, removed at once (the user's file, if there is one, is not touched)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".solar-plot-check-"):
            pass
    except OSError as exc:
        raise SpecError(f"{what} {path!r}: cannot write in {folder} ({exc.strerror or exc})") from None
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise SpecError(f"{what} {path!r}: the file exists and is not writable")
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise SpecError(f"{what} needs matplotlib ({exc}): pip install 'solar-hdf5[plot]'") from None
    return path


positive_int = _argtype(_positive, "positive_int")
seconds = _argtype(_seconds, "seconds")
non_negative_int = _argtype(_non_negative, "non_negative_int")
epoch_count = _argtype(_epochs, "epoch_count")
fraction = _argtype(lambda t: check_fraction("buffer fraction", _to_float(t)), "fraction")
byte_size = _argtype(parse_bytes, "byte_size")
epsilon = _argtype(_epsilon, "epsilon")


#: The API's argument names and the CLI options that give them (solar.plan's errors name the former).
API_FLAGS = {"device_buffer": "--device-buffer", "buffer_fraction": "--buffer-fraction",
             "buffer_per_rank": "--buffer-per-rank", "ranks_per_node": "--ranks-per-node",
             "reads_in_flight": "--reads-in-flight", "resume_from": "--resume-from", "world_size": "-P/--world-size",
             "local_batch": "-b/--local-batch", "peer_cost": "--network-bandwidth/--storage-bandwidth",
             "network_bytes_per_s": "--network-bandwidth", "storage_bytes_per_s": "--storage-bandwidth"}


def as_flags(message: str) -> str:
    """``message`` (an error of the Python API) with the arguments it names as ``name=`` written as the CLI's
    options: ``"device_buffer= with buffer_fraction="`` -> ``"--device-buffer with --buffer-fraction"``.  Only that
    form: a name inside a path, a key list or a value (``world_size=3``) stays as it is."""
    import re
    pattern = re.compile(r"(?<![\w./'\"-])(" + "|".join(API_FLAGS) + r")=(?![\w=.'\"/-])")
    return pattern.sub(lambda m: API_FLAGS[m.group(1)], message)
