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

A process killed outright (SIGKILL: the launcher ending an MPI job after ``MPI_Abort``, the OOM
killer) runs no clean-up.  Where the file system supports it (Linux ``O_TMPFILE``: ext4, XFS, Btrfs,
tmpfs), :class:`AtomicH5` therefore writes a file without a name, linked in as ``<path>.tmp-<pid>``
and renamed only when complete, so such a death leaves nothing; on file systems without it (NFS,
some parallel file systems) the named temporary file is used, and :func:`in_progress` lists those of
this process for the MPI abort path (:func:`solar.mpi.release_node_leftovers`) to remove.
"""
from __future__ import annotations

import os
import re
import threading
from typing import Callable, List, Optional, Set, Tuple

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


_named: Set[str] = set()  # temporary files of this process that have a name (see in_progress)
_named_lock = threading.Lock()


def _track(path: str, named: bool):
    with _named_lock:
        (_named.add if named else _named.discard)(path)


def in_progress() -> List[str]:
    """The named temporary files this process is writing now (an abort path removes them: see the module)."""
    with _named_lock:
        return sorted(_named)


def remove_in_progress():
    """Delete every named temporary file this process is writing (for an exit that runs no clean-up)."""
    for path in in_progress():
        remove_quietly(path)
        _track(path, False)


UNNAMED = hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")
"""Whether :class:`AtomicH5` tries a file without a name first (``O_TMPFILE``, linked through /proc)."""

_unnamed_works: dict = {}  # st_dev -> whether an unnamed file there can be linked in (probed once)


def _link_unnamed(fd: int, dst: str):
    """Give the unnamed file ``fd`` the name ``dst``: ``linkat(/proc/self/fd/N, AT_SYMLINK_FOLLOW)``.  (``os.link``
    with absolute paths calls plain ``link()``, which links the /proc symlink itself and fails with EXDEV.)"""
    proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(str(fd), dst, src_dir_fd=proc, follow_symlinks=True)
    finally:
        os.close(proc)


def _open_unnamed(folder: str) -> int:
    """A new file in ``folder`` without a name (``O_TMPFILE``), or -1 where the file system has none or
    cannot link one in (probed once per file system with a file of no bytes)."""
    if not UNNAMED:
        return -1
    try:
        dev = os.stat(folder).st_dev
        fd = os.open(folder, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o666)
    except OSError:  # EOPNOTSUPP / EISDIR / EINVAL: not here (NFS, old kernels); a real error shows again below
        return -1
    if dev not in _unnamed_works:
        probe = os.path.join(folder, f".solar-probe-{os.getpid()}-{threading.get_ident()}")
        pfd = -1
        try:
            pfd = os.open(folder, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o666)
            _link_unnamed(pfd, probe)
            _unnamed_works[dev] = True
        except OSError:
            _unnamed_works[dev] = False
        finally:
            if pfd >= 0:
                os.close(pfd)
            remove_quietly(probe)
    if not _unnamed_works[dev]:
        os.close(fd)
        return -1
    return fd


class ErrorTrapFile:
    """Unbuffered file for h5py's ``fileobj`` driver; records the first OS error instead of raising it.

    Before an error, reads and writes go to the file at ``pos`` (``pread``/``pwrite``).
    After it, writes are kept as ``(offset, bytes)`` in ``lost`` (up to :data:`LOST_CAP`
    bytes) and laid over what reads return, so HDF5 keeps a consistent view until the
    file is closed and thrown away.  Reads past the end return zeros, as HDF5's sec2 driver.
    """

    def __init__(self, path: str, fd: int = -1):
        """Write ``path`` (created or truncated), or the open file ``fd`` (``path`` only names it)."""
        self.fd = fd if fd >= 0 else os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
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
        fd = _open_unnamed(os.path.dirname(os.path.abspath(path)))
        self.named = fd < 0  # False: the file has no name until commit links it in (nothing left if killed)
        try:
            if self.named:
                _track(self.tmp, True)
            self._trap = ErrorTrapFile(self.tmp, fd)
            self.file = h5py.File(self._trap, "w", **h5_kwargs)
        except BaseException as exc:
            if self._trap is not None:
                self._trap.close()
            elif fd >= 0:
                os.close(fd)
            self._remove_tmp()
            if isinstance(exc, OSError) and self._trap is None:
                raise WriteError(f"cannot write {path}: {os_reason(exc)}") from None
            raise

    def _remove_tmp(self):
        remove_quietly(self.tmp)
        _track(self.tmp, False)

    def check(self):
        """Raise :class:`WriteError` if a write has failed (call it often while writing)."""
        if self._trap.error is not None:
            raise WriteError(f"cannot write {self.path}: {os_reason(self._trap.error)}")

    def commit(self):
        """Close, flush to disk and rename to ``path``; on failure remove the temporary file and raise."""
        try:
            self.file.close()
            self._trap.sync()
            self.check()
            try:
                if not self.named:  # give the file its temporary name only now, for the rename
                    _track(self.tmp, True)
                    _link_unnamed(self._trap.fd, self.tmp)
                self._trap.close()
                self.check()
                os.replace(self.tmp, self.path)
                _track(self.tmp, False)
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
            self._remove_tmp()  # named, or unnamed and linked in just before the error

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
    _track(tmp, True)
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        remove_quietly(tmp)
        raise WriteError(f"cannot write {path}: {os_reason(exc)}") from None
    except BaseException:
        remove_quietly(tmp)
        raise
    finally:
        _track(tmp, False)
