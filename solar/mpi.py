"""MPI helpers: end the whole job when one rank fails, instead of leaving the others
waiting in a collective forever.

* :func:`abort_on_error` — a context manager around a block of code;
* :func:`install_abort_hooks` / :func:`remove_abort_hooks` — ``sys.excepthook`` (and
  ``threading.excepthook`` for solar's own threads) that report an uncaught exception with
  the rank and abort the job (``MPI_Abort``), as ``python -m mpi4py`` does.  ``SolarLoader``
  installs them while it is open on a communicator of more than one rank;
* :func:`sleep_barrier` / :func:`root_call` — ranks waiting for rank 0 sleep instead of
  busy-polling in a blocking collective;
* :func:`leader_call` — a check run by rank 0 (or one rank per node) whose failure is raised
  on every rank.

An abort ends the other processes of the job with SIGKILL (MPICH's hydra does not send SIGTERM first),
so they run no clean-up: before ``MPI_Abort`` the aborting process removes what it can of the job's
leftovers on its node (:func:`release_node_leftovers`).
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import time
import traceback
from typing import List, Optional, Set


ABORT_GRACE_S = 0.5
"""Seconds between printing the error and ``MPI_Abort`` (lets the launcher forward the message)."""

AGREE_S = 2.0
"""Seconds a rank that raised a :class:`~solar.errors.SolarError` inside :func:`abort_on_error` waits for every
other rank to raise one too (then no rank is left waiting, and none is aborted) before it aborts the job."""


def _describe(exc: BaseException, rank: int, prefix: str, size: int) -> str:
    """What the aborting rank prints: ``"<prefix>: error on rank R: <cause>"`` (one line for a SolarError, with
    the traceback otherwise) and ``"<prefix>: aborting all N ranks"``; for SIGTERM / Ctrl-C one line, no
    traceback: ``"<prefix>: terminated (SIGTERM) on rank R: aborting all N ranks"``."""
    from .errors import SolarError, Terminated
    if isinstance(exc, KeyboardInterrupt):
        what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted (SIGINT)"
        return f"{prefix}: {what} on rank {rank}: aborting all {size} ranks\n"
    cause = f"{exc}" if isinstance(exc, SolarError) else f"{type(exc).__name__}: {exc}"
    head = "" if isinstance(exc, SolarError) else "".join(traceback.format_exception(exc))
    return f"{head}{prefix}: error on rank {rank}: {cause}\n{prefix}: aborting all {size} ranks\n"


def report_and_abort(comm, exc: BaseException, prefix: str = "solar", status: Optional[int] = None) -> None:
    """Print ``exc`` once (with this rank) to stderr and ``comm.Abort(status)``: every rank of the job ends.

    The status is 143 after SIGTERM (:class:`~solar.errors.Terminated`), 130 after Ctrl-C, else ``status``
    (default 1); the launcher exits with it.  Before the abort, the job's leftovers on this node are removed
    (:func:`release_node_leftovers`).  MPICH's ``MPI_Abort`` returns to the caller (the process manager then
    kills the job), so this process exits with the status right after, instead of running on.
    """
    from .errors import exit_status
    status = exit_status(exc) if status is None or isinstance(exc, KeyboardInterrupt) else int(status)
    _ignore_signals()  # a second Ctrl-C or SIGTERM must not interrupt the abort
    sys.stderr.write(_describe(exc, comm.Get_rank(), prefix, comm.Get_size()))
    sys.stderr.flush()
    # the launcher forwards our stderr through a pipe; aborting at once could kill the job before it has
    # read the message (seen with MPICH's hydra: the job ended with no message about 1 run in 8)
    time.sleep(ABORT_GRACE_S)
    with contextlib.suppress(Exception):  # last, so that the others (still running) make nothing after it
        release_node_leftovers()
    try:
        comm.Abort(status)
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)


def _ignore_signals():
    """SIGINT and SIGTERM ignored from now on (main thread only: elsewhere they reach the main thread, not us)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, OSError):
            signal.signal(sig, signal.SIG_IGN)


# ---------------------------------------------------------------- leftovers of an aborted job
SHM_DIR = "/dev/shm"
SHM_LEFTOVERS = ("mpich_shm_", "sem.mp-")
"""/dev/shm names the job leaves when its processes are killed: MPICH's shared-memory segment (one per node,
removed by MPI_Finalize) and the named semaphores of Python's multiprocessing with the ``forkserver`` or
``spawn`` start method (DataLoader workers' queues; removed by a resource tracker, killed with the job)."""


def release_node_leftovers() -> List[str]:
    """Remove what the job's processes on this node would leave when killed: the /dev/shm segments and
    semaphores of :data:`SHM_LEFTOVERS` that they map, and the named temporary files (``<name>.tmp-<pid>``,
    :mod:`solar.atomic`) that they are writing.  The job's processes on this node are this one and those
    that map the same MPICH segment (the ranks a launcher started here).  Linux only; anything that fails
    is skipped.  Returns the paths removed.  Unlinking is safe while they run: what they have mapped or open
    stays valid until they end, which the abort makes happen now.
    """
    from .atomic import remove_in_progress
    remove_in_progress()  # this process's own, by name
    me = os.getpid()
    mine = _shm_maps(me)
    segments = {ino for ino, name in mine.items() if name.startswith("mpich_shm_")}
    peers = _job_peers(me, segments) if segments else []
    inodes: Set[int] = set(mine)
    removed = []
    for pid in [me, *peers]:
        if pid != me:
            inodes |= set(_shm_maps(pid))
        removed += _remove_temp_files(pid)
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return removed
    for entry in entries:
        if entry.name.startswith(SHM_LEFTOVERS):
            with contextlib.suppress(OSError):
                if entry.inode() in inodes:
                    os.unlink(entry.path)
                    removed.append(entry.path)
    return removed


def _shm_maps(pid: int) -> dict:
    """``{inode: name}`` of the /dev/shm files process ``pid`` maps (a semaphore appears under the temporary
    name glibc made it with, deleted since: its inode is what matches)."""
    out = {}
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith(SHM_DIR + "/"):
                    out[int(parts[4])] = os.path.basename(parts[5].rstrip("\n").removesuffix(" (deleted)"))
    except (OSError, ValueError):
        pass
    return out


def _job_peers(me: int, segments: Set[int]) -> List[int]:
    """The other processes that share the parent of ``me`` (hydra's proxy, slurmstepd or orted starts a node's
    ranks) and map one of the MPI segments ``segments``: the job's ranks on this node."""
    parent = os.getppid()
    peers = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and segments & set(_shm_maps(int(name))):
            peers.append(int(name))
    return peers


def _remove_temp_files(pid: int) -> List[str]:
    """Delete the named temporary files ``<name>.tmp-<pid>`` process ``pid`` holds open (solar's output files
    being written, :mod:`solar.atomic`)."""
    removed = []
    suffix = re.compile(rf"\.tmp-{pid}$")
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return removed
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/") and suffix.search(target) and os.path.isfile(target):
            with contextlib.suppress(OSError):
                os.unlink(target)
                removed.append(target)
    return removed


def _ends_quietly(exc: BaseException) -> bool:
    """``SystemExit(0)`` / ``SystemExit(None)``: a normal exit, not a failure."""
    return isinstance(exc, SystemExit) and not exc.code


@contextlib.contextmanager
def abort_on_error(comm=None, prefix: str = "solar", user_error_status: Optional[int] = None):
    """Run the body; on an exception print it once (with the rank) and, when ``comm``
    has more than one rank, abort it (:func:`report_and_abort`: status 1, 143 after SIGTERM, 130 after
    Ctrl-C) so every rank ends now.

    A :class:`~solar.errors.SolarError` that every rank raises (a bad option or input that each rank checks,
    or rank 0's failure that :func:`root_call`, :func:`leader_call` or :func:`agree` hand to every rank)
    leaves no rank waiting, so nothing is aborted: with ``user_error_status`` None it propagates on every
    rank, as with one rank; with a status (the CLI's 2) rank 0 prints ``"<prefix>: error: <message>"`` (a
    rank whose message differs prints its own, ``"<prefix>: error on rank R: <message>"``) and every rank
    exits with that status (``SystemExit``).  The ranks count as failing together when each of them reaches
    this point within :data:`AGREE_S` seconds (matched on a duplicate of ``comm`` made on entry, never
    against the body's own collectives); a SolarError on some ranks only aborts the job, with
    ``user_error_status`` (or 1).  Collective on entry (``comm.Dup``) when ``comm`` has more than one rank.

    With one rank (or no comm) the exception propagates normally.
    """
    size = comm.Get_size() if comm is not None else 1
    side = comm.Dup() if size > 1 else None  # where failing ranks meet: no collective of the body can match
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - re-raised, ended with a status, or the job aborted
        if size <= 1 or _ends_quietly(exc):
            raise
        from .errors import SolarError
        if isinstance(exc, SolarError):
            messages = None
            try:
                messages = _fail_together(side, str(exc), AGREE_S)
            except KeyboardInterrupt as signalled:  # SIGTERM / Ctrl-C while waiting: end the job on that
                report_and_abort(comm, signalled, prefix)
            if messages is not None:  # every rank failed: nobody waits, nobody is aborted
                with contextlib.suppress(Exception):
                    side.Free()
                if user_error_status is None:
                    raise
                _end_together(comm.Get_rank(), messages, prefix, user_error_status)
        report_and_abort(comm, exc, prefix, status=user_error_status)
    else:
        if side is not None:
            side.Free()


def _fail_together(side, message: str, wait_s: float) -> Optional[List[str]]:
    """Every rank's ``message`` (gathered over ``side``) when every rank of ``side`` calls this within
    ``wait_s`` seconds of the first, else None (the others are busy elsewhere: the caller aborts)."""
    req = side.Ibarrier()
    deadline = time.monotonic() + wait_s
    while not req.Test():
        if time.monotonic() > deadline:
            return None
        time.sleep(0.002)
    return side.allgather(message)


def _end_together(rank: int, messages: List[str], prefix: str, status: int):
    """Every rank failed with ``messages`` (by rank): print rank 0's once and what differs from it, then
    ``SystemExit(status)`` on this rank."""
    mine = messages[rank]
    if rank == 0:
        sys.stderr.write(f"{prefix}: error: {mine}\n")
    elif mine != messages[0]:
        sys.stderr.write(f"{prefix}: error on rank {rank}: {mine}\n")
    sys.stderr.flush()
    raise SystemExit(status)


# ---------------------------------------------------------------- hooks
# The active guards, newest last: (token, comm, prefix).  The hooks use the newest one; the
# hooks that were there before the first install are put back when the last is removed.
_guards: list = []
_saved: dict = {}
_lock = threading.Lock()


def _sys_hook(exc_type, exc, tb):
    if _guards and not _ends_quietly(exc):
        _, comm, prefix = _guards[-1]
        report_and_abort(comm, exc.with_traceback(tb), prefix)
    _saved.get("sys", sys.__excepthook__)(exc_type, exc, tb)


def _thread_hook(args):
    thread_name = args.thread.name if args.thread is not None else ""
    if _guards and thread_name.startswith("solar-") and not _ends_quietly(args.exc_value):
        _, comm, prefix = _guards[-1]
        report_and_abort(comm, args.exc_value, f"{prefix} (thread {thread_name})")
    _saved.get("threading", threading.__excepthook__)(args)


def install_abort_hooks(comm, prefix: str = "solar") -> object:
    """Make an uncaught exception (main thread, or a ``solar-*`` thread) abort ``comm``'s job.

    Returns a token for :func:`remove_abort_hooks`.  Nested installs stack; the newest wins.
    """
    token = object()
    with _lock:
        if not _guards:
            _saved["sys"], _saved["threading"] = sys.excepthook, threading.excepthook
            sys.excepthook, threading.excepthook = _sys_hook, _thread_hook
        _guards.append((token, comm, prefix))
    return token


def remove_abort_hooks(token) -> None:
    """Undo one :func:`install_abort_hooks` (a no-op when already removed)."""
    with _lock:
        _guards[:] = [g for g in _guards if g[0] is not token]
        if not _guards and _saved:
            if sys.excepthook is _sys_hook:
                sys.excepthook = _saved["sys"]
            if threading.excepthook is _thread_hook:
                threading.excepthook = _saved["threading"]
            _saved.clear()


def abort_hooks_active() -> bool:
    """True while some install is in effect (tests, diagnostics)."""
    return bool(_guards)


# ---------------------------------------------------------------- waiting
def sleep_barrier(comm, poll_s: float = 0.002) -> None:
    """A barrier that waits in ``poll_s``-second sleeps instead of spinning.

    MPICH (and Open MPI by default) busy-poll inside blocking collectives: a rank
    waiting for rank 0 (planning, measuring the disk) burns a whole core, which on a
    small node is the core rank 0 needs.  This posts ``comm.Ibarrier()`` and tests it,
    sleeping between tests, so a waiting rank costs almost no CPU; the wake-up comes
    at most ``poll_s`` late.  Collective: every rank of ``comm`` calls it.
    """
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll_s)


def root_call(comm, fn, root: int = 0):
    """Run ``fn()`` on ``root`` while the other ranks sleep-wait; return its result on every rank.

    An exception on ``root`` is raised on every rank (the same object, pickled).
    Collective over ``comm``.
    """
    res, err = None, None
    if comm.Get_rank() == root:
        try:
            res = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            err = exc
    sleep_barrier(comm)
    res, err = comm.bcast((res, err), root=root)
    if err is not None:
        raise err
    return res


def leader_call(comm, fn, per_node: bool = False) -> None:
    """Run ``fn()`` on one leader while the other ranks sleep-wait: rank 0 of ``comm``, or with
    ``per_node`` rank 0 of each node (``Split_type(COMM_TYPE_SHARED)``).  An exception on a leader
    is raised on every rank (the first by rank): a SolarError as its own class and message, any
    other as a SolarError naming its type and rank.  Collective over ``comm``; no rank is left
    waiting, whatever ``fn`` raises (short of ending the process).
    """
    leader = _node_rank(comm) == 0 if per_node else comm.Get_rank() == 0
    err = None
    if leader:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            err = exc
    sleep_barrier(comm)
    sent = comm.allgather(None if err is None else _portable(err, comm.Get_rank()))
    first = next((i for i, p in enumerate(sent) if p is not None), None)
    if first is None:
        return
    if first == comm.Get_rank():
        raise err
    raise _rebuild(*sent[first])


def ranks_per_node(comm) -> "tuple[Optional[int], str]":
    """``(L, why)``: :func:`solar.topology.block_ranks_per_node` of ``comm``'s placement (an MPI
    shared-memory split names each rank's node).  Collective."""
    from mpi4py import MPI

    from .topology import block_ranks_per_node
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        leader = node.bcast(comm.Get_rank(), root=0)  # the node's lowest world rank names it
    finally:
        node.Free()
    return block_ranks_per_node(comm.allgather(leader))


def agree(comm, err: Optional[BaseException]) -> None:
    """After a step every rank ran on its own (``err``: what it raised there, or None): raise on every
    rank of ``comm`` when any rank failed, before anyone goes on into a collective that the failed rank
    will never reach.  A failed rank raises its own exception; the others a SolarError of the first
    failed rank's class and message (naming its type and rank when it is not a SolarError).
    Collective over ``comm`` (None or one rank: just raises ``err``)."""
    if comm is None or comm.Get_size() <= 1:
        if err is not None:
            raise err
        return
    sent = comm.allgather(None if err is None else _portable(err, comm.Get_rank()))
    first = next((i for i, p in enumerate(sent) if p is not None), None)
    if first is None:
        return
    if err is not None:
        raise err
    raise _rebuild(*sent[first])


def _node_rank(comm) -> int:
    """This process's rank among the ranks of ``comm`` on its node."""
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def _portable(exc: BaseException, rank: int):
    """``(class, message)`` of ``exc`` that every rank can rebuild (class objects pickle by name)."""
    from .errors import SolarError
    if isinstance(exc, SolarError):
        return type(exc), str(exc)
    return SolarError, f"{type(exc).__name__} on rank {rank}: {exc}"


def _rebuild(cls, message: str) -> BaseException:
    from .errors import SolarError
    try:
        return cls(message)
    except Exception:  # noqa: BLE001 - a SolarError subclass with another constructor
        return SolarError(message)
