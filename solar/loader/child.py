"""The loader process of ``SolarLoader(process=True)``: run as ``python -m solar.loader.child FD``.

It builds a :class:`~solar.loader.SolarLoader` of the same plan and rank in process memory (no communicator,
no torch, no hooks) and ships each assembled batch to the training process over the socket ``FD``: the
batch's arrays lie in shared-memory segments (``memfd``, their descriptors passed once, then reused), so a
message carries only where each field is.  Commands and replies are in :mod:`solar.loader.process`.
"""
from __future__ import annotations

import mmap
import os
import signal
import socket
import sys
import threading
import traceback
from dataclasses import asdict
from typing import Dict, List, Optional

import numpy as np

#: A new segment's bytes are rounded up to this (a batch of a few more rows reuses it).
SEGMENT_ALIGN = 2 << 20


class _Segment:
    __slots__ = ("mm", "addr", "size", "fd", "busy", "sent")

    def __init__(self, mm, addr, size, fd):
        self.mm, self.addr, self.size, self.fd = mm, addr, size, fd
        self.busy = self.sent = False


class Segments:
    """Shared-memory segments the child's batches are assembled into (:meth:`alloc`, the assembler's hook).

    A segment is taken by one batch from :meth:`alloc` until the training process says it dropped the
    batch (:meth:`free`), or until the buffer stops without shipping it (:meth:`free_unsent`).  New segments
    are created when none free is large enough; their descriptors go out with the next batch message.  Of
    the free segments at most ``keep`` stay (batches the training loop kept, then dropped, do not hold
    their memory for the loader's life); the others are unmapped, and the next message tells the training
    process to unmap them too.  Segment ids are never reused."""

    def __init__(self, keep: int = 4):
        self._lock = threading.Lock()
        self.keep = int(keep)
        self.segs: Dict[int, _Segment] = {}
        self.next_id = 0
        self.new: List[int] = []       # created, descriptor not yet passed
        self.dropped: List[int] = []   # unmapped here, not yet told

    def alloc(self, nbytes: int) -> np.ndarray:
        nbytes = max(int(nbytes), 1)
        with self._lock:
            free = [i for i, s in self.segs.items() if not s.busy and s.size >= nbytes]
            if free:
                i = min(free, key=lambda j: self.segs[j].size)
            else:
                i = self._create(-(-nbytes // SEGMENT_ALIGN) * SEGMENT_ALIGN)
            seg = self.segs[i]
            seg.busy, seg.sent = True, False
            return np.frombuffer(seg.mm, dtype=np.uint8, count=nbytes)

    def _create(self, size: int) -> int:
        fd = os.memfd_create("solar-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            m = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        i = self.next_id
        self.next_id += 1
        self.segs[i] = _Segment(m, int(np.frombuffer(m, np.uint8, count=1).ctypes.data), size, fd)
        self.new.append(i)
        return i

    def find(self, arr: np.ndarray) -> Optional[int]:
        """The segment ``arr``'s bytes lie in, or None."""
        a = int(arr.__array_interface__["data"][0])
        with self._lock:
            for i, s in self.segs.items():
                if s.addr <= a and a + arr.nbytes <= s.addr + s.size:
                    return i
        return None

    def mark_sent(self, i: int) -> None:
        with self._lock:
            self.segs[i].sent = True

    def take_new(self) -> List[tuple]:
        """``[(segment, size, fd)]`` created since the last call (the caller closes each fd once passed)."""
        with self._lock:
            out = [(i, self.segs[i].size, self.segs[i].fd) for i in self.new]
            for i in self.new:
                self.segs[i].fd = -1
            self.new = []
            return out

    def take_dropped(self) -> List[int]:
        with self._lock:
            out, self.dropped = self.dropped, []
            return out

    def free(self, ids) -> None:
        with self._lock:
            for i in ids:
                if i in self.segs:
                    self.segs[i].busy = False
            self._trim()

    def free_unsent(self) -> None:
        with self._lock:
            for s in self.segs.values():
                if s.busy and not s.sent:
                    s.busy = False
            self._trim()

    def _trim(self) -> None:
        free = sorted((i for i, s in self.segs.items() if not s.busy), key=lambda j: self.segs[j].size)
        for i in free[:max(0, len(free) - self.keep)]:  # the smallest go first
            s = self.segs[i]
            try:
                s.mm.close()
            except BufferError:  # a view of it still alive here: keep it
                continue
            if s.fd >= 0:  # never passed: the training process never saw it
                os.close(s.fd)
                self.new.remove(i)
            else:
                self.dropped.append(i)
            del self.segs[i]


class Child:
    """The command loop (main thread) and the shipper (a thread per buffer) of the loader process."""

    def __init__(self, sock: socket.socket):
        from multiprocessing.connection import Connection
        self.sock = sock
        self.conn = Connection(os.dup(sock.fileno()))
        self.send_lock = threading.Lock()
        self.segments = Segments()
        self.loader = None
        self.gen = 0
        self.cv = threading.Condition()
        self.want = -1       # the highest step the training process has asked for
        self.stopping = False
        self.shipper: Optional[threading.Thread] = None

    def send(self, msg, fds=()) -> None:
        from multiprocessing.reduction import sendfds
        try:
            with self.send_lock:  # the message says how many descriptors follow it
                self.conn.send(msg)
                if fds:
                    sendfds(self.sock, list(fds))
        finally:
            for fd in fds:  # passed (the training process has its own copy) or the socket is gone
                os.close(fd)

    def run(self) -> int:
        parent = os.getppid()
        try:
            kwargs = self.conn.recv()
        except (EOFError, OSError):  # the training process is gone already
            return 0
        try:
            from ..schedule import ScheduleError
            from .loader import SolarLoader
            header = kwargs.pop("header_sha256")
            self.segments.keep = kwargs.pop("keep_segments")
            memory_prefetch = kwargs.pop("memory_prefetch")
            self.loader = SolarLoader(**kwargs)
            self.loader._memory_prefetch = memory_prefetch  # the pools sized for the batches alive on both sides
            if self.loader.schedule.header_sha256 != header:
                raise ScheduleError(f"{kwargs['schedule']} changed since the training process opened it (another "
                                    f"plan written there?): the loader process would follow another plan")
            self.loader.assembler.alloc = self.segments.alloc
            self.send(("ready", self.loader.reader_name, self.loader.cpus))
        except BaseException as exc:  # noqa: BLE001 - reported to the training process, which raises it
            self.send(("error", "command", 0, _portable(exc)))
            return 1
        while True:
            try:
                if not self.conn.poll(1.0):
                    if os.getppid() != parent:  # the training process died (a forked process of its keeps the
                        break                   # socket open, so no end-of-file tells this one)
                    continue
                msg = self.conn.recv()
            except (EOFError, OSError):  # the training process is gone
                break
            kind = msg[0]
            try:
                if kind == "want":
                    with self.cv:
                        self.want = max(self.want, msg[1])
                        self.cv.notify_all()
                elif kind == "free":
                    self.segments.free(msg[1])
                elif kind == "release":
                    if self.loader.buffer is not None:
                        self.loader.buffer.release(msg[1])
                elif kind == "start":
                    self._start(msg[1], msg[2])
                elif kind == "stop":
                    self._stop()
                    self.send(("stopped", self.gen))
                elif kind == "close":
                    self._stop()
                    break
            except BaseException as exc:  # noqa: BLE001 - reported; the training process raises it
                self.send(("error", "command", self.gen, _portable(exc)))
        try:
            self._stop()
            self.loader.close()
        finally:
            try:
                self.send(("closed",))
            except OSError:
                pass
        return 0

    def _start(self, cursor: int, gen: int) -> None:
        self._stop()
        self.gen = gen
        L = self.loader
        L._seek(cursor)
        startup = L.prepare()
        b = L.buffer
        with self.cv:
            self.want, self.stopping = cursor - 1, False
        self.shipper = threading.Thread(target=self._ship, args=(b, gen), name="solar-ship", daemon=True)
        self.shipper.start()
        self.send(("started", gen, startup, int(b.start), int(b.stop), int(b.pools.capacity_bytes)
                   if getattr(b, "pools", None) is not None else 0, dict(b.warmup)))

    def _stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        if self.loader is not None and self.loader.buffer is not None:
            self.loader._stop_buffer()  # wakes a shipper waiting for a step (Closed)
        if self.shipper is not None:
            self.shipper.join()
            self.shipper = None
        self.segments.free_unsent()

    def _ship(self, buffer, gen: int) -> None:
        from ..buffer.steps import StepStats
        keys = [k for k in asdict(StepStats(0)) if k != "step"]
        g = buffer.start
        while g < buffer.stop:
            with self.cv:
                while self.want < g and not self.stopping:
                    self.cv.wait()
                if self.stopping:
                    return
            t = buffer.totals
            before = [getattr(t, k) for k in keys]
            try:
                out = buffer.get(g)
            except BaseException as exc:  # noqa: BLE001 - the step's error, raised where the step is taken
                if self.stopping:
                    return
                self.send(("error", "step", gen, _portable(exc)))
                return
            st = {k: getattr(t, k) - b for k, b in zip(keys, before)}
            try:
                msg, fds = self._describe(out)
                self.send(("batch", gen, g, msg, st, self.loader.reader.open_stats()), fds)
            except BaseException as exc:  # noqa: BLE001
                self.send(("error", "step", gen, _portable(exc)))
                return
            g += 1

    def _describe(self, out: Dict[str, object]):
        """``({field: ("seg", segment, offset, shape, dtype) or the value itself}, descriptors of new segments)``."""
        fields, used = {}, set()
        for k, v in out.items():
            i = self.segments.find(v) if isinstance(v, np.ndarray) and v.nbytes else None
            if i is None:
                fields[k] = v  # pickled: the ids, samples of uneven shapes
                continue
            off = int(v.__array_interface__["data"][0]) - self.segments.segs[i].addr
            fields[k] = ("seg", i, off, v.shape, v.dtype.str, v.strides)
            used.add(i)
        if len(used) > 1:
            raise RuntimeError(f"a batch spans {len(used)} segments")
        new = self.segments.take_new()
        for i in used:
            self.segments.mark_sent(i)
        return {"fields": fields, "segment": next(iter(used), None), "new": [(i, z) for i, z, _ in new],
                "dropped": self.segments.take_dropped()}, [fd for _, _, fd in new]


def _portable(exc: BaseException):
    """``exc`` itself where it pickles (its class then raised in the training process), else its text."""
    import pickle
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickle.loads(pickle.dumps(exc))
        return exc, text
    except Exception:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}", text


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the training process, which closes this one
    sock = socket.socket(fileno=int(argv[0]))
    return Child(sock).run()


if __name__ == "__main__":
    sys.exit(main())
