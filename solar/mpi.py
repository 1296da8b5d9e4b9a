"""MPI helpers: end the whole job when one rank fails, instead of leaving the others
waiting in a collective forever."""
from __future__ import annotations

import contextlib
import sys
import traceback


@contextlib.contextmanager
def abort_on_error(comm=None, prefix: str = "solar"):
    """Run the body; on an exception print it once (with the rank) and, when ``comm``
    has more than one rank, ``comm.Abort(1)`` so every rank ends now.

    With one rank (or no comm) the exception propagates normally.
    """
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - re-raised or the job aborted
        size = comm.Get_size() if comm is not None else 1
        if size <= 1 or isinstance(exc, (SystemExit,)) and not exc.code:
            raise
        from .errors import SolarError
        rank = comm.Get_rank()
        if isinstance(exc, SolarError):
            msg = f"{prefix}: error on rank {rank}: {exc}\n"
        else:
            msg = f"{prefix}: rank {rank} failed:\n{''.join(traceback.format_exception(exc))}"
        sys.stderr.write(msg + f"{prefix}: aborting all {size} ranks\n")
        sys.stderr.flush()
        comm.Abort(1)
