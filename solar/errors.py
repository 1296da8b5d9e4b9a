"""Exceptions raised by solar.

Every error that a user can cause (bad paths, bad data, bad options) is a
:class:`SolarError` with a one-line message naming the culprit.  The CLI prints
``solar <command>: error: <message>`` and exits with status 2 instead of a traceback
(130 on Ctrl-C, 143 on SIGTERM, 141 when stdout is a closed pipe).
"""


class SolarError(Exception):
    """Base class of all user-facing solar errors (one-line message)."""


class SpecError(SolarError, ValueError):
    """A layout spec (or a CLI option that builds one) is invalid."""


class LayoutError(SolarError):
    """The HDF5 files do not match what the spec describes."""


class DecodeError(SolarError):
    """Stored bytes of a block could not be decoded (corrupt or unsupported)."""


class WriteError(SolarError):
    """An output file or folder could not be written (disk full, read-only, missing folder)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what ``scancel`` and ``kill`` send) turned into an exception by the CLI, so clean-up code runs.

    Not a :class:`SolarError`: like ``KeyboardInterrupt`` (Ctrl-C, SIGINT) it ends the command with its own
    exit status, 143 (128 + SIGTERM); 130 for Ctrl-C.
    """


def exit_status(exc: BaseException) -> int:
    """The exit status a process ends with after ``exc``: 143 for :class:`Terminated`, 130 for Ctrl-C, else 1."""
    if isinstance(exc, Terminated):
        return 143
    if isinstance(exc, KeyboardInterrupt):
        return 130
    return 1
