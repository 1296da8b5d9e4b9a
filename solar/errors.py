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
