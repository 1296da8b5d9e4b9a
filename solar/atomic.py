"""Output files that appear complete or not at all: written as ``<path>.tmp-<pid>``, renamed when done.

HDF5 cannot recover from a failed write: after ENOSPC (disk full), EFBIG or EIO the
library's own clean-up fails, and closing the file or freeing its objects crashed the
interpreter (segmentation fault).  :class:`AtomicH5` therefore hands h5py a file object
(h5py's ``fileobj`` driver) whose writes never fail from HDF5's point of view: the first
OS error is recorded, the bytes of later writes are kept in memory so HDF5 reads back
what it wrote, :meth:`AtomicH5.check` raises the error as a one-line
:class:`~solar.errors.WriteError`, and :meth:`AtomicH5.abort` closes the file and
removes the temporary name.

A signal handler must not raise inside those write callbacks either (HDF5 would see a
failed write): :func:`in_io_callback` tells a handler that it interrupted one.
"""
from __future__ import annotations

import os
import re
from typing import Callable, List, Optional, Tuple

import h5py

from .errors import WriteError

LOST_CAP = 256 << 20  # bytes of writes after a failure kept in memory for HDF5 to read back


def os_reason(exc: BaseException) -> str:
    """The OS reason of an I/O error in a few words ('No space left on device')."""
    errno = getattr(exc, "errno", None)
    if isinstance(errno, int) and errno > 0:
        return os.strerror(errno)
    m = re.search(r"error message = '([^']*)'", str(exc))
    return m.group(1) if m else (str(exc).splitlines() or [type(exc).__name__])[0]


def temp_name(path: str) -> str:
    """``<path>.tmp-<pid>``: where ``path`` is written before it is renamed."""
    return f"{path}.tmp-{os.getpid()}"


def remove_quietly(path: Optional[str]):
    """Delete ``path`` if it exists (clean-up on an error path must not raise)."""
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


class ErrorTrapFile:
    """Unbuffered file for h5py's ``fileobj`` driver; records the first OS error instead of raising it.

    Before an error, reads and writes go to the file at ``pos`` (``pread``/``pwrite``).
    After it, writes are kept as ``(offset, bytes)`` in ``lost`` (up to :data:`LOST_CAP`
    bytes) and laid over what reads return, so HDF5 keeps a consistent view until the
    file is closed and thrown away.  Reads past the end return zeros, as HDF5's sec2 driver.
    """

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        self.pos = 0
        self.end = 0  # furthest byte written, lost writes included
        self.error: Optional[OSError] = None
        self.lost: List[Tuple[int, bytes]] = []
        self.lost_bytes = 0

    def seek(self, pos: int, whence: int = 0) -> int:
        base = (0, self.pos, self._eof())[whence]
        self.pos = base + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def _eof(self) -> int:
        return max(os.fstat(self.fd).st_size, self.end)

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = max(0, self._eof() - self.pos)
        data = bytearray(os.pread(self.fd, size, self.pos))
        data.extend(bytes(size - len(data)))
        for off, blob in self.lost:  # in write order: later writes win
            lo, hi = max(off, self.pos), min(off + len(blob), self.pos + size)
            if lo < hi:
                data[lo - self.pos:hi - self.pos] = blob[lo - off:hi - off]
        self.pos += size
        return bytes(data)

    def readinto(self, buf) -> int:
        mv = memoryview(buf).cast("B")
        mv[:] = self.read(mv.nbytes)
        return mv.nbytes

    def write(self, buf) -> int:
        mv = memoryview(buf).cast("B")
        n = mv.nbytes
        if self.error is None:
            try:
                done = 0
                while done < n:
                    done += os.pwrite(self.fd, mv[done:], self.pos + done)
            except OSError as exc:
                self.error = exc
        if self.error is not None and self.lost_bytes + n <= LOST_CAP:
            self.lost.append((self.pos, bytes(mv)))
            self.lost_bytes += n
        self.pos += n
        self.end = max(self.end, self.pos)
        return n

    def truncate(self, size: Optional[int] = None) -> int:
        size = self.pos if size is None else size
        if self.error is None:
            try:
                os.ftruncate(self.fd, size)
            except OSError as exc:
                self.error = exc
        return size

    def flush(self):
        """Nothing is buffered here (the data is in the OS); :meth:`sync` makes it durable."""

    def sync(self):
        """fsync: some file systems (NFS, Lustre) report a full disk only now."""
        if self.error is None:
            try:
                os.fsync(self.fd)
            except OSError as exc:
                self.error = exc

    def close(self):
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            try:
                os.close(fd)
            except OSError as exc:
                self.error = self.error or exc


_TRAP_CODES = frozenset(f.__code__ for f in vars(ErrorTrapFile).values() if callable(f))


def in_io_callback(frame) -> bool:
    """Whether ``frame`` (as given to a signal handler) runs inside an :class:`ErrorTrapFile` method,
    i.e. inside an HDF5 call, where raising an exception would leave HDF5 with a failed write."""
    while frame is not None:
        if frame.f_code in _TRAP_CODES:
            return True
        frame = frame.f_back
    return False


class AtomicH5:
    """A new HDF5 file written as ``<path>.tmp-<pid>`` (:attr:`file`) and renamed to ``path`` by :meth:`commit`.

    Use as a context manager (commit on success, abort on any exception) or call
    :meth:`commit` / :meth:`abort`.  Errors are :class:`~solar.errors.WriteError` naming ``path``.
    """

    def __init__(self, path: str, **h5_kwargs):
        self.path, self.tmp = path, temp_name(path)
        self._trap: Optional[ErrorTrapFile] = None
        try:
            self._trap = ErrorTrapFile(self.tmp)
            self.file = h5py.File(self._trap, "w", **h5_kwargs)
        except BaseException as exc:
            if self._trap is not None:
                self._trap.close()
            remove_quietly(self.tmp)
            if isinstance(exc, OSError) and self._trap is None:
                raise WriteError(f"cannot write {path}: {os_reason(exc)}") from None
            raise

    def check(self):
        """Raise :class:`WriteError` if a write has failed (call it often while writing)."""
        if self._trap.error is not None:
            raise WriteError(f"cannot write {self.path}: {os_reason(self._trap.error)}")

    def commit(self):
        """Close, flush to disk and rename to ``path``; on failure remove the temporary file and raise."""
        try:
            self.file.close()
            self._trap.sync()
            self._trap.close()
            self.check()
            try:
                os.replace(self.tmp, self.path)
            except OSError as exc:
                raise WriteError(f"cannot write {self.path}: {os_reason(exc)}") from None
        except BaseException:
            self.abort()
            raise

    def abort(self):
        """Close the file (h5py objects first, as h5py's close does) and delete the temporary file."""
        try:
            if self.file.id.valid:
                self.file.close()
        finally:
            self._trap.close()
            remove_quietly(self.tmp)

    def __enter__(self) -> "AtomicH5":
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def write_atomic(path: str, write: Callable[[str], object]):
    """``write(tmp)`` then rename ``tmp`` to ``path``; on any failure ``tmp`` is removed
    (an ``OSError`` becomes :class:`WriteError` naming ``path``)."""
    tmp = temp_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        remove_quietly(tmp)
        raise WriteError(f"cannot write {path}: {os_reason(exc)}") from None
    except BaseException:
        remove_quietly(tmp)
        raise
