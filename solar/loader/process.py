"""``SolarLoader(process=True)``: the rank's buffer, reader and batch assembly in a process of their own.

In the training process, solar's threads (the prefetch thread, the reader's, the assembly workers) come
back from GIL-free work dozens of times a step and each time take the GIL from the training thread.  A
training loop that spends its step in Python (kernel launches, autocast, the optimizer's dispatch) then
runs slower beside the loader than alone.  With ``process=True`` the loader runs in a child process
(:mod:`solar.loader.child`, started with the same interpreter) and the training process keeps one light
thread that receives ready batches.

* **Batches in shared memory.** The child assembles each batch straight into a shared-memory segment
  (``memfd``; its descriptor passed once over the socket, the segment then reused), and the message says
  where each field is.  The training process maps each segment once.  A batch's arrays keep their segment
  taken until the last of them (and of any tensor made from them) is gone; only then may the child reuse
  it, so a batch kept by the training loop is never overwritten.
* **The same memory.** The child runs with one assembled batch fewer waiting (``prefetch - 1``, at least
  1), and the training process receives one batch ahead (none with ``prefetch=1``): as many batches are
  alive as with the in-process loader (at its peak prefetch + 2: those waiting, the one handed out, and the
  one before it until the training loop lets it go).
* **The same errors.** An exception in the child (a read that fails, a file that changed) is raised in the
  training process where the step is taken, as its own class where it pickles; the child ending
  unexpectedly raises :class:`LoaderProcessError` naming its exit status.  With ``comm`` the abort guard
  of the training process ends the job as before.

Protocol (pickled messages over a Unix socket; descriptors of new segments follow the message that
names them).  Training process -> child: ``("start", cursor, generation)``, ``("want", g)`` (the child may
ship steps up to ``g``), ``("free", [segments])``, ``("release", g)`` (the epoch fence), ``("stop",)``,
``("close",)``.  Child -> training process: ``("ready", reader, cpus)``, ``("started", generation, startup_s,
start, stop, pool_bytes, warmup)``, ``("batch", generation, g, fields, step stats, reader stats)``,
``("error", "step" or "command", generation, exception)``, ``("stopped", generation)``, ``("closed",)``.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from types import SimpleNamespace
from typing import Callable, Dict, Optional

import numpy as np

from ..buffer.steps import BufferTotals, StepStats
from ..errors import SolarError

#: Seconds ``close`` waits for the loader process to stop its buffer and end before it kills it (it finishes the
#: reads it has in flight first).
CLOSE_TIMEOUT_S = 120.0


class LoaderProcessError(SolarError):
    """The loader process failed or ended; the message says how."""


class LoaderProcess:
    """The child process of one :class:`~solar.loader.SolarLoader` and the thread that receives from it.

    ``kwargs``: the child's ``SolarLoader`` arguments (pickled now: a SpecError if they cannot be).
    ``produce(g, out)``: run on each received batch in the receiving thread (the loader's transforms and
    device copy)."""

    def __init__(self, kwargs: dict, produce: Callable[[int, dict], dict], rank: int):
        import pickle
        self.rank = rank
        self.produce = produce
        try:
            payload = pickle.dumps(kwargs, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - e.g. a reader option that cannot cross to another process
            from ..errors import SpecError
            raise SpecError(f"process=True sends the loader's arguments to the loader process, and one of them "
                            f"cannot be pickled: {type(exc).__name__}: {exc}") from None
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        from multiprocessing.connection import Connection
        self.sock = parent
        self.conn = Connection(os.dup(parent.fileno()))
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "solar.loader.child", str(child.fileno())],
                                         pass_fds=[child.fileno()], env=_child_env(), close_fds=True)
        except BaseException:
            self.conn.close()
            parent.close()
            raise
        finally:
            child.close()
        self.send_lock = threading.Lock()
        self.cv = threading.Condition()
        self.maps: Dict[int, mmap.mmap] = {}
        self.freed: deque = deque()  # segments whose batch the training process dropped (finalizers append)
        self.gen = 0
        self.buffer: Optional[ProcessBuffer] = None
        self.replies: deque = deque()  # control replies: ready, started, stopped, closed, command errors
        self.waiting: Optional[str] = None  # the reply _reply waits for, if it does
        self.dead: Optional[str] = None
        self.reader_stats: dict = {}
        self.reader_name = self.cpus = None
        # the receiving thread sends the arguments first: a large layout does not hold this thread up while the
        # loader process imports (it reads them once it has)
        self.thread = threading.Thread(target=self._receive, args=(payload,), name=f"solar-receive-r{rank}",
                                       daemon=True)
        self.thread.start()

    def wait_ready(self) -> None:
        """Wait for the child's loader to be built (it starts meanwhile: the training process can import torch);
        its constructor's exception is raised here."""
        if self.reader_name is None:
            ready = self._reply("ready")
            self.reader_name, self.cpus = ready[1], ready[2]

    # ------------------------------------------------------------ sending
    def _send(self, msg) -> None:
        with self.send_lock:
            try:
                self.conn.send(msg)
            except (OSError, ValueError) as exc:
                raise LoaderProcessError(self._why_dead() or f"cannot reach the loader process: {exc}") from None

    def _take_freed(self) -> list:
        ids = []
        while self.freed:
            ids.append(self.freed.popleft())
        return ids

    def send_freed(self) -> None:
        ids = self._take_freed()
        if ids:
            self._send(("free", ids))

    def _dropped(self, seg: int) -> None:
        """A batch's finalizer (any thread, also inside this module's own sends): its segment is free; told now
        where the socket is not busy, else with the next message."""
        self.freed.append(seg)
        if self.dead is None and self.send_lock.acquire(blocking=False):
            try:
                ids = self._take_freed()
                if ids:
                    self.conn.send(("free", ids))
            except (OSError, ValueError):
                pass
            finally:
                self.send_lock.release()

    # ------------------------------------------------------------ receiving (a thread)
    def _receive(self, payload: bytes) -> None:
        try:
            with self.send_lock:
                self.conn.send_bytes(payload)
            while self._receive_one():
                pass
        except (EOFError, OSError) as exc:
            why = self._why_dead(wait=True) or f"the loader process of rank {self.rank} closed its socket ({exc})"
        except BaseException as exc:  # noqa: BLE001 - whatever it is, the training loop must hear of it
            why = f"the training process's side of the loader process of rank {self.rank} failed: " \
                  f"{type(exc).__name__}: {exc}"
            self._close_socket()  # the loader process sees the end and exits
        else:
            return  # "closed"
        with self.cv:
            self.dead = why
            self.cv.notify_all()

    def _receive_one(self) -> bool:
        from multiprocessing.reduction import recvfds
        msg = self.conn.recv()
        kind = msg[0]
        if kind == "batch":
            desc = msg[3]
            if desc["new"]:
                fds = recvfds(self.sock, len(desc["new"]))
                try:
                    for (i, size), fd in zip(desc["new"], fds):
                        self.maps[i] = m = mmap.mmap(fd, size)
                        # not inherited by a process forked from this one: the loader reuses a segment once this
                        # process drops its batch, so a forked copy would see later batches' bytes (it faults
                        # instead, as any access to memory not mapped there)
                        if hasattr(mmap, "MADV_DONTFORK"):
                            m.madvise(mmap.MADV_DONTFORK)
                finally:
                    for fd in fds:
                        os.close(fd)
            for i in desc["dropped"]:  # freed here before, and unmapped there: no batch of it is alive
                m = self.maps.pop(i, None)
                if m is not None:
                    try:
                        m.close()
                    except BufferError:
                        pass
            self._batch(msg)
        elif kind == "error" and msg[1] == "step":  # raised where the step is taken; a stopped buffer's: dropped
            if self.buffer is not None and msg[2] == self.gen:
                self.buffer._fail(_rebuild(msg[3], self.rank))
        elif kind == "error" and self.waiting is None and self.buffer is not None:  # a command's, none waits
            self.buffer._fail(_rebuild(msg[3], self.rank))
        else:
            with self.cv:
                self.replies.append(msg)
                self.cv.notify_all()
        return kind != "closed"

    def _batch(self, msg) -> None:
        _, gen, g, desc, st, reader_stats = msg
        buf = self.buffer
        seg = desc["segment"]
        if buf is None or gen != self.gen:  # a stopped buffer's step: its segment back to the child
            if seg is not None:
                self.freed.append(seg)
            return
        self.reader_stats = reader_stats
        out = {}
        lease = None
        if seg is not None:
            m = self.maps[seg]
            lease = (ctypes.c_uint8 * len(m)).from_buffer(m)
            weakref.finalize(lease, self._dropped, seg)
        for k, v in desc["fields"].items():
            if isinstance(v, tuple) and len(v) == 6 and v[0] == "seg":
                _, _, off, shape, dtype, strides = v
                out[k] = np.ndarray(shape, dtype=np.dtype(dtype), buffer=lease, offset=off, strides=strides)
            else:
                out[k] = v
        del lease
        try:
            item = self.produce(g, out)
        except BaseException as exc:  # noqa: BLE001 - the step's error, raised where it is taken
            buf._fail(exc)
            return
        buf._put(g, item, StepStats(g, **st))

    def _reply(self, kind: str, timeout: Optional[float] = None):
        """The next control reply (``kind``); an error reply or the child's end raises.  Waits as long as the
        loader process lives (it may plan windows or read a resume's resident blocks first), else ``timeout``."""
        end = None if timeout is None else time.monotonic() + timeout
        with self.cv:
            self.waiting = kind
            try:
                while True:
                    if self.replies:
                        msg = self.replies.popleft()
                        if msg[0] == "error":
                            raise _rebuild(msg[3], self.rank)
                        if msg[0] == kind and (kind not in ("started", "stopped") or msg[1] == self.gen):
                            return msg
                        continue  # a stale reply (a stopped buffer's)
                    if self.dead is not None:
                        raise LoaderProcessError(self.dead)
                    if not self.thread.is_alive():
                        raise LoaderProcessError(f"the thread receiving from the loader process of rank {self.rank} "
                                                 f"ended")
                    if end is not None and time.monotonic() > end:
                        raise LoaderProcessError(f"the loader process of rank {self.rank} did not answer "
                                                 f"{kind!r} within {timeout:.0f} s")
                    self.cv.wait(1.0)
            finally:
                self.waiting = None

    def _why_dead(self, wait: bool = False) -> Optional[str]:
        code = self.proc.poll()
        if code is None and wait:
            try:
                code = self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                code = None
        if code is None:
            return None
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return f"the loader process of rank {self.rank} {how}"

    def _close_socket(self) -> None:
        for s in (self.conn, self.sock):
            try:
                s.close()
            except OSError:
                pass

    # ------------------------------------------------------------ buffers
    def start(self, cursor: int, lookahead: int) -> "ProcessBuffer":
        self.gen += 1
        buf = ProcessBuffer(self, cursor, lookahead)
        self.buffer = buf
        self._send(("start", int(cursor), self.gen))
        msg = self._reply("started")
        _, _, buf.startup_s, buf.start, buf.stop, pool_bytes, buf.warmup = msg
        buf.pools = SimpleNamespace(capacity_bytes=pool_bytes)
        if lookahead:
            buf._ask()
        return buf

    def stop(self) -> None:
        if self.buffer is None:
            return
        self.buffer._close()
        self.buffer = None
        if self.dead is None:
            self._send(("stop",))
            self._reply("stopped", CLOSE_TIMEOUT_S)

    def close(self) -> None:
        """Stop the buffer, end the loader process (killed if it does not end within :data:`CLOSE_TIMEOUT_S`)
        and unmap the segments no batch holds."""
        try:
            if self.dead is None:
                self.stop()
                self._send(("close",))
                self._reply("closed", CLOSE_TIMEOUT_S)
        except (SolarError, OSError):
            pass
        finally:
            self._close_socket()  # a loader process still running sees the end and exits
            try:
                self.proc.wait(CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.thread.join(5.0)
            for m in self.maps.values():
                try:
                    m.close()
                except BufferError:  # a batch the training loop still holds keeps its segment mapped
                    pass
            self.maps = {}


class ProcessBuffer:
    """The training process's side of one buffer of the loader process: what
    :class:`~solar.loader.SolarLoader` asks of a :class:`~solar.buffer.BufferManager` (``get``,
    ``release``, ``totals``, ``start``/``stop``)."""

    def __init__(self, proc: LoaderProcess, cursor: int, lookahead: int):
        self.proc = proc
        self.start = self.stop = int(cursor)
        self._next_get = int(cursor)
        self.lookahead = int(lookahead)  # batches received ahead of the one taken next (0: on demand)
        self.totals = BufferTotals()
        self._ready: Dict[int, tuple] = {}
        self._error: Optional[BaseException] = None
        self._closed = False
        self.startup_s = 0.0
        self.warmup: dict = {}
        self.pools = None

    def _ask(self) -> None:
        """Let the child ship steps up to ``lookahead`` past the one the training loop takes next."""
        self.proc.send_freed()
        self.proc._send(("want", self._next_get + max(self.lookahead, 1) - 1))

    def _put(self, g: int, item, st: StepStats) -> None:
        with self.proc.cv:
            self._ready[g] = (item, st)
            self.proc.cv.notify_all()

    def _fail(self, exc: BaseException) -> None:
        with self.proc.cv:
            if self._error is None:
                self._error = exc
            self.proc.cv.notify_all()

    def _close(self) -> None:
        with self.proc.cv:
            self._closed = True
            self._ready.clear()
            self.proc.cv.notify_all()

    def get(self, g: int):
        if g != self._next_get:
            raise LoaderProcessError(f"steps must be taken in order: asked for {g}, next is {self._next_get}")
        t0 = time.perf_counter()
        cv = self.proc.cv
        if self.lookahead == 0 and g < self.stop:  # on demand: asked for now
            self._ask()
        with cv:
            while g not in self._ready and self._error is None and not self._closed and self.proc.dead is None \
                    and self.proc.thread.is_alive():
                cv.wait(0.5)
            if g not in self._ready:
                if self._error is not None:
                    raise self._error
                if self._closed:
                    raise LoaderProcessError("the loader's buffer is closed")
                raise LoaderProcessError(self.proc.dead or f"the thread receiving from the loader process of rank "
                                                           f"{self.proc.rank} ended")
            item, st = self._ready.pop(g)
        self._next_get = g + 1
        st.stall_s = time.perf_counter() - t0
        self.totals.add(st)
        if self.lookahead and g + 1 < self.stop:
            self._ask()
        return item

    def release(self, g: int) -> None:
        self.proc._send(("release", int(g)))

    def fail(self, exc: BaseException) -> None:
        """(A node's ranks are told of a failure; a buffer per rank has none to tell.)"""

    def close(self) -> None:
        self.proc.stop()


def _child_env() -> dict:
    """The loader process's environment: this one's, with the folder holding this solar package first on
    PYTHONPATH where solar is not installed in site-packages (a checkout on ``sys.path``), so that the child
    imports the same solar."""
    import site
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    installed = {os.path.abspath(p) for p in site.getsitepackages() + [site.getusersitepackages()]}
    if root not in installed:
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _rebuild(payload, rank: int) -> BaseException:
    """The child's exception (``(exception or its text, traceback text)``) for the training process."""
    exc, text = payload
    if isinstance(exc, BaseException):
        exc.__cause__ = LoaderProcessError(f"in the loader process of rank {rank}:\n{text.rstrip()}")
        return exc
    return LoaderProcessError(f"the loader process of rank {rank} failed: {exc}\n{text.rstrip()}")
