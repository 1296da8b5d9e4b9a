"""Reading many files' HDF5 metadata in parallel worker processes.

h5py serialises every HDF5 call on one global lock, so threads do not scan files
in parallel (measured in ``benchmarks/layout_build.py``); processes do.  The
files are cut into chunks of consecutive files; this process and up to
``workers - 1`` helper processes take the next chunk from one counter until none
is left, so small layouts are done here before a helper has even started, and a
slow chunk holds up only its own process.  Each chunk comes back as the
:class:`~solar.layout.build.FileScan` of each file, merged afterwards in file
order, so the layout does not depend on who read what.

Helpers are fresh interpreters (``python -c``, the same solar first on ``sys.path``),
not forks: nothing of this process (MPI, threads holding HDF5's lock, a training
script's top level) is copied or run again.  They talk over their stdin/stdout
pipes with pickle and import neither mpi4py nor torch.

Errors: when a chunk fails, no later chunk is handed out; every earlier chunk
was handed out before it and is finished, and the error of the first failing
file in spec order is raised, as one process reading the files in order would.
A helper that dies (a crash inside HDF5) gives its chunk back to this process.
"""
from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import threading
from collections import deque
from typing import List, Optional, Sequence

from ..errors import LayoutError, SpecError
from .build import FileScan, scan_file
from .spec import LayoutSpec

MIN_FILES_PER_WORKER = 256
"""Fewer files than this per process: the helpers' start (~0.5 s each) would cost more than they save."""
WORKERS_ENV = "SOLAR_LAYOUT_WORKERS"
"""Environment variable overriding the default number of processes."""


def default_workers(n_files: int, env=None) -> int:
    """Processes that scan ``n_files`` files: ``$SOLAR_LAYOUT_WORKERS`` if set, else the CPUs this process
    may run on divided by the ranks on this node (launcher variables, :mod:`solar.topology`), at most one
    per :data:`MIN_FILES_PER_WORKER` files, at least 1."""
    env = os.environ if env is None else env
    if env.get(WORKERS_ENV, "").strip():
        return check_workers(env[WORKERS_ENV].strip(), WORKERS_ENV)
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    from ..topology import detect
    try:
        local = detect(env=env).local_size
    except SpecError:
        local = 1
    return max(1, min(cpus // max(1, local), n_files // MIN_FILES_PER_WORKER))


def check_workers(value, name: str = "workers") -> int:
    """``value`` as an integer >= 1, else a SpecError naming ``name``."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if isinstance(value, bool) or n < 1 or (isinstance(value, float) and value != n):
        raise SpecError(f"{name} must be an integer >= 1, got {value!r}")
    return n


def chunk_bounds(n_files: int, workers: int) -> List[tuple]:
    """``[(lo, hi), ...]`` consecutive file ranges: ~16 per process, 8..64 files each (a chunk's reply,
    ~1 KiB per file, then fits in a pipe's buffer: the helper goes on while this process is busy)."""
    size = max(8, min(64, -(-n_files // (16 * workers))))
    return [(lo, min(n_files, lo + size)) for lo in range(0, n_files, size)]


def scan_chunk(spec: LayoutSpec, paths: Sequence[str]):
    """``("ok", [FileScan, ...])``, or ``("err", exception)`` at the first file that fails."""
    out = []
    for p in paths:
        try:
            out.append(scan_file(spec, p))
        except Exception as exc:  # noqa: BLE001 - re-raised by the parent, in file order
            return "err", exc
    return "ok", out


class _Pool:
    """The shared state of one parallel scan: chunk counter, results, helper processes."""

    def __init__(self, spec: LayoutSpec, paths: Sequence[str], workers: int, bar):
        self.spec, self.paths, self.bar = spec, list(paths), bar
        self.chunks = chunk_bounds(len(paths), workers)
        self.results: list = [None] * len(self.chunks)
        self.returned: List[int] = []  # chunks a dead helper gave back
        self.next, self.stop = 0, False
        self.lock = threading.Lock()
        self.procs: list = []

    def take(self) -> Optional[int]:
        with self.lock:
            if self.stop or self.next >= len(self.chunks):
                return None
            self.next += 1
            return self.next - 1

    def store(self, i: int, result) -> None:
        with self.lock:
            self.results[i] = result
            if result[0] != "ok":
                self.stop = True
            if self.bar is not None:
                lo, hi = self.chunks[i]
                self.bar.update(hi - lo)

    def run_here(self, i: int) -> None:
        lo, hi = self.chunks[i]
        self.store(i, scan_chunk(self.spec, self.paths[lo:hi]))

    def helper(self) -> None:
        """Start one helper process and feed it chunks until none is left (runs in a thread)."""
        try:
            proc = subprocess.Popen([sys.executable, "-c", _helper_code()], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE)
        except OSError:
            return  # this process does the work
        with self.lock:
            self.procs.append(proc)
        pending: deque = deque()  # chunks sent, oldest first: two queued, so the helper never waits for us
        try:
            pickle.dump((self.spec, self.paths), proc.stdin)
            for _ in range(2):
                self._send_next(proc, pending)
            while pending:
                result = _receive(proc.stdout)
                self.store(pending.popleft(), result)
                self._send_next(proc, pending)
            pickle.dump(None, proc.stdin)
            proc.stdin.close()
        except Exception:  # noqa: BLE001 - whatever ended the helper (pipe, bad reply): its chunks are read here
            with self.lock:
                self.returned.extend(pending)
        finally:
            _end(proc)

    def _send_next(self, proc, pending: deque) -> None:
        i = self.take()
        if i is not None:
            pending.append(i)  # before sending: a helper that dies mid-send gives it back too
            pickle.dump(self.chunks[i], proc.stdin)
            proc.stdin.flush()

    def kill(self) -> None:
        with self.lock:
            procs = list(self.procs)
        for p in procs:
            if p.poll() is None:
                p.kill()


def _helper_code() -> str:
    """A helper's ``python -c`` program: this solar first on ``sys.path`` (before the current folder,
    which may hold another ``solar``), then :func:`serve`."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return f"import sys; sys.path.insert(0, {root!r}); from solar.layout.scan_pool import serve; serve()"


def _receive(stream):
    """One length-prefixed pickle from a helper (read whole, then unpickled: few GIL round trips)."""
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("helper ended")
    n = struct.unpack("<Q", head)[0]
    data = stream.read(n)
    if len(data) < n:
        raise EOFError("helper ended mid-reply")
    return pickle.loads(data)


def _end(proc) -> None:
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def scan_files(spec: LayoutSpec, paths: Sequence[str], workers: Optional[int] = None,
               progress: bool = False) -> List[FileScan]:
    """The :class:`FileScan` of each of ``paths``, in order, read by ``workers`` processes (this one
    included; None: :func:`default_workers`).  Raises the first failing file's error in path order."""
    workers = default_workers(len(paths)) if workers is None else check_workers(workers)
    bar = None
    if progress and len(paths) > 20:
        from ..progress import counter
        bar = counter(len(paths), "layout", "file", progress)
    pool = _Pool(spec, paths, max(1, min(workers, len(paths))), bar)
    threads = [threading.Thread(target=pool.helper, daemon=True, name=f"solar-scan-{k}")
               for k in range(min(workers, len(pool.chunks)) - 1)]
    try:
        for t in threads:
            t.start()
        while (i := pool.take()) is not None:
            pool.run_here(i)
        for t in threads:
            t.join()
        for i in sorted(pool.returned):  # a helper died: read its chunk here
            pool.run_here(i)
    finally:
        pool.kill()
        for t in threads:
            t.join()
        if bar is not None:
            bar.close()
    scans: List[FileScan] = []
    for res in pool.results:
        if res is None:  # after a failure: a chunk never handed out
            continue
        if res[0] != "ok":
            raise res[1]
        scans.extend(res[1])
    if len(scans) != len(paths):  # pragma: no cover - every chunk is read here or by a helper
        raise LayoutError(f"layout scan lost files: {len(scans)} of {len(paths)} read (a bug: please report it)")
    return scans


def serve() -> None:
    """A helper's main loop: read ``(spec, paths)``, then chunk bounds until None; answer each chunk with
    :func:`scan_chunk`'s result.  Replies go to the original stdout; anything printed goes to stderr."""
    reply = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    spec, paths = pickle.load(inp)
    while True:
        bounds = pickle.load(inp)
        if bounds is None:
            return
        lo, hi = bounds
        result = scan_chunk(spec, paths[lo:hi])
        try:
            data = pickle.dumps(result)
        except (pickle.PickleError, TypeError, AttributeError):
            data = pickle.dumps(("err", RuntimeError(f"{type(result[1]).__name__}: {result[1]}")))
        reply.write(struct.pack("<Q", len(data)) + data)
        reply.flush()
