"""``solar bench --equal-memory``: run every loader inside one memory cgroup per node.

The limit counts the page cache (cgroup v1 ``memory.limit_in_bytes`` and v2
``memory.max`` both charge file pages a process reads to its cgroup), so a loader
that leans on the page cache gets no more memory than solar's buffers.  The
cgroup is made as a child of the calling process's own memory cgroup (v1; v2 also
at the hierarchy's root when the own cgroup cannot delegate the controller), the
ranks of the node move into it, and children they start (DataLoader workers)
inherit it.  Root only; anything that keeps the limit from being enforced raises
:class:`~solar.errors.SolarError` with one line saying why.

Each loader gets its own limit, set once its processes are up and before it reads
(:meth:`MemoryCgroup.base_bytes`: what the cgroup holds then, file pages not
counted): that base, plus the node's solar buffers, plus :data:`ALLOWANCE_BYTES` and
:data:`ALLOWANCE_PER_RANK` for each rank of the node.
A loader's processes themselves (interpreters, torch in every DataLoader worker)
are thus not memory for data, which the limit is about; between loaders the
cgroup is unlimited, so the next loader's start-up is never what hits the limit.
"""
from __future__ import annotations

import errno
import os
import time
from typing import Optional, Tuple

from ..errors import SolarError

#: Memory allowed per node on top of a loader's processes as they start (their base) and solar's buffers:
#: what the processes' heaps grow by while they run (bytes).  Page cache within it is data memory a
#: baseline gets beyond solar's, so it is kept small.
ALLOWANCE_BYTES = 256 << 20
#: And per rank of the node: a rank's threads, stacks and scratch that the loader's start leaves to come (solar
#: measured about 15 MB a rank beyond its buffers with 8 ranks, its numba kernels already in the base).
ALLOWANCE_PER_RANK = 16 << 20
#: ``limit_bytes`` of a cgroup with no limit set (written as ``-1`` on v1, which reads back a huge number; ``max``
#: on v2).
UNLIMITED = -1
MOUNTINFO = "/proc/self/mountinfo"
PROC_CGROUP = "/proc/self/cgroup"


def _mounts() -> Tuple[Optional[str], Optional[str]]:
    """``(v1 memory mount point, v2 mount point)`` from mountinfo (None where absent)."""
    v1 = v2 = None
    try:
        with open(MOUNTINFO) as fh:
            for line in fh:
                left, right = line.split(" - ", 1)
                fstype, _src, opts = (right.split() + ["", ""])[:3]
                mnt = left.split()[4]
                if fstype == "cgroup" and "memory" in opts.split(","):
                    v1 = v1 or mnt
                elif fstype == "cgroup2":
                    v2 = v2 or mnt
    except OSError:
        pass
    return v1, v2


def _own(version: int) -> str:
    """This process's cgroup path (v1 memory hierarchy, or the v2 one), e.g. ``/a/b``."""
    with open(PROC_CGROUP) as fh:
        for line in fh:
            _hid, ctrls, path = line.rstrip("\n").split(":", 2)
            if (version == 1 and "memory" in ctrls.split(",")) or (version == 2 and _hid == "0" and not ctrls):
                return path
    return "/"


def _controllers(path: str, name: str) -> set:
    try:
        with open(os.path.join(path, name)) as fh:
            return set(fh.read().split())
    except OSError:
        return set()


def locate(name: str) -> Tuple[str, str, str]:
    """``(new cgroup dir, limit file name, method)`` where a memory cgroup ``name`` can be made here.

    Raises :class:`SolarError` (one line) when none can: not root, or no memory controller.
    """
    if os.geteuid() != 0:
        raise SolarError("--equal-memory needs root (it creates a memory cgroup to limit every loader); "
                         f"running as uid {os.geteuid()}")
    v1, v2 = _mounts()
    if v1:
        parent = os.path.join(v1, _own(1).lstrip("/"))
        return os.path.join(parent, name), "memory.limit_in_bytes", "cgroup v1 memory.limit_in_bytes"
    if v2:
        for parent in (os.path.join(v2, _own(2).lstrip("/")), v2):
            if "memory" in _controllers(parent, "cgroup.subtree_control"):
                return os.path.join(parent, name), "memory.max", "cgroup v2 memory.max"
        raise SolarError(f"--equal-memory: the cgroup v2 hierarchy at {v2} does not delegate the memory "
                         "controller (memory is not in cgroup.subtree_control of this process's cgroup or the root)")
    raise SolarError("--equal-memory: no memory cgroup controller is mounted (neither a cgroup v1 'memory' "
                     "hierarchy nor cgroup v2 in /proc/self/mountinfo)")


def _write(path: str, text: str):
    try:
        with open(path, "w") as fh:
            fh.write(text)
    except OSError as exc:
        raise SolarError(f"--equal-memory: cannot write {text.strip()!r} to {path}: {exc.strerror}") from None


class MemoryCgroup:
    """One memory cgroup with a hard limit (bytes, page cache counted).

    ``MemoryCgroup.create(name, limit)`` makes it (node rank 0; the limit rounded up to whole pages, None for
    none yet); ``set_limit(bytes)`` changes it (None: unlimited); ``join()`` moves this process in (every
    rank); ``leave(back)`` moves it back; ``remove(back)`` moves every process left (e.g. a forkserver) to
    ``back`` and deletes the cgroup.
    """

    def __init__(self, path: str, limit_file: str, method: str, limit_bytes: int):
        self.path, self.limit_file, self.method, self.limit_bytes = path, limit_file, method, int(limit_bytes)
        self._peak_fh = None  # v2: the memory.peak file reset_peak opened (node rank 0 only; never pickled open)

    @classmethod
    def create(cls, name: str, limit_bytes: Optional[int]) -> "MemoryCgroup":
        path, limit_file, method = locate(name)
        try:
            os.mkdir(path)
        except OSError as exc:
            raise SolarError(f"--equal-memory: cannot create the memory cgroup {path}: {exc.strerror}") from None
        cg = cls(path, limit_file, method, UNLIMITED)
        try:
            cg.set_limit(limit_bytes)
        except BaseException:
            cg.remove(None)
            raise
        return cg

    def set_limit(self, limit_bytes: Optional[int]):
        """Limit the cgroup to ``limit_bytes`` (rounded up to whole pages; at least 16 MiB), or lift the
        limit (None).  Raises :class:`SolarError` when the kernel does not take it as asked (e.g. a limit
        below what the cgroup holds and cannot reclaim)."""
        if limit_bytes is None:
            _write(os.path.join(self.path, self.limit_file), "-1\n" if self._v1 else "max\n")
            self.limit_bytes = UNLIMITED
            return
        if not isinstance(limit_bytes, int) or isinstance(limit_bytes, bool) or limit_bytes < (16 << 20):
            raise SolarError(f"--equal-memory: limit must be at least 16 MiB, got {limit_bytes!r} bytes")
        page = os.sysconf("SC_PAGE_SIZE")
        limit_bytes = -(-limit_bytes // page) * page  # the kernel keeps whole pages
        _write(os.path.join(self.path, self.limit_file), f"{limit_bytes}\n")
        if self.read_limit() != limit_bytes:
            raise SolarError(f"--equal-memory: {self.path}/{self.limit_file} reads {self.read_limit()} after "
                             f"writing {limit_bytes}: the limit is not enforced as asked")
        self.limit_bytes = limit_bytes

    @property
    def _v1(self) -> bool:
        return self.limit_file == "memory.limit_in_bytes"

    @property
    def description(self) -> str:
        return f"{self.method} on {self.path} (page cache counted)"

    def read_limit(self) -> int:
        with open(os.path.join(self.path, self.limit_file)) as fh:
            text = fh.read().strip()
        return -1 if text == "max" else int(text)

    def _stat(self) -> dict:
        out = {}
        try:
            with open(os.path.join(self.path, "memory.stat")) as fh:
                for line in fh:
                    k, _, v = line.partition(" ")
                    out[k] = int(v)
        except (OSError, ValueError):
            pass
        return out

    def base_bytes(self) -> int:
        """What the cgroup holds now, its file pages (page cache) not counted: the memory of the processes in
        it (anonymous memory, shared memory, kernel memory).  A loader's base, taken before it reads."""
        name = "memory.usage_in_bytes" if self._v1 else "memory.current"
        with open(os.path.join(self.path, name)) as fh:
            usage = int(fh.read().strip())
        st = self._stat()
        pre = "total_" if self._v1 else ""
        files = st.get(pre + "active_file", 0) + st.get(pre + "inactive_file", 0)
        return max(0, usage - files)

    def procs(self) -> list:
        """Process ids now in the cgroup."""
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as fh:
                return [int(x) for x in fh.read().split()]
        except OSError:
            return []

    def join(self) -> str:
        """Move this process (all its threads) into the cgroup; returns the cgroup dir it was in."""
        back = current_dir(self.limit_file)
        _write(os.path.join(self.path, "cgroup.procs"), f"{os.getpid()}\n")
        return back

    @staticmethod
    def leave(back: str):
        """Move this process back to the cgroup dir ``back`` (what :meth:`join` returned)."""
        _write(os.path.join(back, "cgroup.procs"), f"{os.getpid()}\n")

    def reset_peak(self):
        """Start a new peak-usage window: v1 ``memory.max_usage_in_bytes``; v2 ``memory.peak`` through a file
        this object keeps open (Linux 6.12+ resets the peak per open file); where v2 cannot reset it, the peak
        is unknown (:meth:`peak_bytes` None) rather than the cgroup's lifetime peak."""
        if self._v1:
            _write(os.path.join(self.path, "memory.max_usage_in_bytes"), "0\n")
            return
        self._close_peak()
        try:
            fh = open(os.path.join(self.path, "memory.peak"), "r+")
        except OSError:
            return
        try:
            fh.write("reset\n")
            fh.flush()
        except OSError:  # a kernel before 6.12: the peak since creation only
            fh.close()
            return
        self._peak_fh = fh

    def _close_peak(self):
        fh, self._peak_fh = self._peak_fh, None
        if fh is not None:
            fh.close()

    def peak_bytes(self) -> Optional[int]:
        """Peak usage (page cache included) since :meth:`reset_peak` (v1: or creation); None where unknown."""
        try:
            if self._v1:
                with open(os.path.join(self.path, "memory.max_usage_in_bytes")) as fh:
                    return int(fh.read().strip())
            fh = self._peak_fh
            if fh is None:
                return None
            fh.seek(0)
            return int(fh.read().strip())
        except (OSError, ValueError):
            return None

    def remove(self, back: Optional[str]):
        """Move what is left to the cgroup dir ``back`` (if given) and delete this one (retries while busy)."""
        self._close_peak()
        for _ in range(50):
            if back:
                for pid in self.procs():
                    try:
                        with open(os.path.join(back, "cgroup.procs"), "w") as fh:
                            fh.write(f"{pid}\n")
                    except OSError:
                        pass  # exited meanwhile
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise SolarError(f"--equal-memory: cannot remove {self.path}: {exc.strerror}") from None
            time.sleep(0.1)
        raise SolarError(f"--equal-memory: cannot remove {self.path}: processes {self.procs()} are still in it")


def current_dir(limit_file: str = "memory.limit_in_bytes") -> str:
    """This process's cgroup dir in the v1 memory hierarchy (``limit_file`` of v1) or the v2 one."""
    v1, v2 = _mounts()
    root, version = (v1, 1) if limit_file == "memory.limit_in_bytes" else (v2, 2)
    return os.path.join(root or "/", _own(version).lstrip("/")).rstrip("/")


def in_cgroup(path: str, limit_file: str = "memory.limit_in_bytes") -> bool:
    """True when this process is in the cgroup dir ``path``."""
    return current_dir(limit_file) == path.rstrip("/")


def check_worker_in(path: str, limit_file: str, _worker_id: int = 0):
    """DataLoader ``worker_init_fn`` (bind ``path``, ``limit_file``): refuse to run a worker outside the cgroup;
    make the worker the first the kernel kills when the cgroup runs out of memory (a killed worker fails
    its baseline, which the bench reports; a killed rank would end the whole job)."""
    if not in_cgroup(path, limit_file):
        raise SolarError(f"--equal-memory: DataLoader worker {os.getpid()} is not in the memory cgroup {path} "
                         "(the limit would not apply to it)")
    try:
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write("1000\n")
    except OSError:
        pass  # not Linux, or a kernel without it: the limit holds all the same
