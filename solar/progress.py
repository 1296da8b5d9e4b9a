"""Progress of long work on stderr: a bar on a terminal, plain lines in a log file or pipe (a SLURM job's output).

``progress`` arguments across solar take ``False`` (nothing), ``True`` (a bar where stderr is a terminal, lines
otherwise), ``"bar"`` or ``"lines"``.  Lines come at most every :data:`LINE_EVERY_S` seconds, counted across the
counters of the process (a command that plans several policies one after the other prints as often as one that
plans one), each when a unit of work (an epoch, a file, a sample) is done; work shorter than that prints nothing.
A counter that printed says at its end how long it took, or where it stopped.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Dict, Optional, Union

#: Seconds between two plain progress lines.
LINE_EVERY_S = 10.0

#: Seconds of numba compiling before :func:`compile_notice` says so (as long as progress lines wait).
COMPILE_NOTICE_S = LINE_EVERY_S

Mode = Union[bool, str, None]

#: clock -> when the last line was printed (or the first counter of that clock was made): shared by counters
_LAST: Dict[object, float] = {}


def resolve(mode: Mode, stream=None) -> Optional[str]:
    """``"bar"``, ``"lines"`` or None for a ``progress`` argument (true: a bar on a terminal, else lines; false:
    nothing); ValueError naming any other text."""
    if isinstance(mode, str):
        if mode in ("bar", "lines"):
            return mode
        raise ValueError(f"progress must be True, False, 'bar' or 'lines', got {mode!r}")
    if not mode:
        return None
    stream = sys.stderr if stream is None else stream
    try:
        return "bar" if stream.isatty() else "lines"
    except (AttributeError, ValueError):  # replaced or closed
        return "lines"


def check(mode: Mode) -> Mode:
    """``mode`` if it is a ``progress`` argument (see :func:`resolve`), else a SpecError naming it."""
    try:
        resolve(mode)
    except ValueError as exc:
        from .errors import SpecError
        raise SpecError(str(exc)) from None
    return mode


class Lines:
    """A tqdm-like counter (``update``, ``close``, a context manager) that prints ``"<desc>: n/total unit (s)"`` on
    ``stream`` (default stderr) at most every ``every_s`` seconds (default :data:`LINE_EVERY_S`) since the last
    line of any counter on the same ``clock``."""

    def __init__(self, total: Optional[int], desc: str, unit: str, stream=None, every_s: Optional[float] = None,
                 clock=time.monotonic):
        self.total, self.desc, self.unit, self.n = total, desc, unit, 0
        self.stream, self.clock = stream, clock
        self.every_s = float(LINE_EVERY_S if every_s is None else every_s)
        self.t0 = clock()
        _LAST.setdefault(clock, self.t0)
        self.printed = False

    def _print(self, text: str) -> None:
        stream = sys.stderr if self.stream is None else self.stream
        print(f"{self.desc}: {text}", file=stream, flush=True)
        self.printed = True

    def _count(self) -> str:
        of = f"/{self.total:,}" if self.total is not None else ""
        return f"{self.n:,}{of} {self.unit}{'' if self.n == 1 and not of else 's'}"

    def update(self, n: int = 1) -> None:
        self.n += int(n)
        now = self.clock()
        if now - _LAST[self.clock] >= self.every_s:
            _LAST[self.clock] = now
            self._print(f"{self._count()} ({now - self.t0:.0f} s)")

    def close(self, stopped: bool = False) -> None:
        """The closing line, where a line was printed: the time it took, or where it stopped (``stopped``: ended by
        an exception, or short of ``total``)."""
        if self.printed:
            secs = self.clock() - self.t0
            if stopped or (self.total is not None and self.n < self.total):
                self._print(f"stopped at {self._count()} after {secs:.0f} s")
            else:
                self._print(f"{self._count()}, done in {secs:.0f} s")
            self.printed = False

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(stopped=exc_type is not None)


class _Nothing:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def counter(total: Optional[int], desc: str, unit: str, mode: Mode):
    """A counter for ``mode`` (see :func:`resolve`): a tqdm bar, :class:`Lines`, or one that shows nothing."""
    how = resolve(mode)
    if how == "bar":
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, unit=unit, leave=False)
    if how == "lines":
        return Lines(total, desc, unit)
    return _Nothing()


def each(iterable, total: Optional[int], desc: str, unit: str, mode: Mode):
    """``iterable``'s items, counted on a :func:`counter` as each one is done (the next one asked for)."""
    with counter(total, desc, unit, mode) as c:
        for x in iterable:
            yield x
            c.update(1)


@contextlib.contextmanager
def compile_notice(desc: str, mode: Mode, after_s: Optional[float] = None):
    """Around work whose numba kernels may have to be compiled (the first run after an install or an upgrade, or
    with a new ``NUMBA_CACHE_DIR``: up to a minute or two, with nothing else to show): where numba has been
    compiling for ``after_s`` seconds (default :data:`COMPILE_NOTICE_S`; a compile still under way then) and the
    work is not done, one line on stderr says so.  Kernels loaded from numba's cache compile nothing and print
    nothing; so does ``mode`` off."""
    how = resolve(mode)
    if how is None:
        yield
        return
    from numba.core import event

    under_way, done = [0], threading.Event()  # compiles started and not ended (numba's events nest)
    lock = threading.Lock()

    class _Listener(event.Listener):
        def on_start(self, ev):
            with lock:
                under_way[0] += 1

        def on_end(self, ev):
            with lock:
                under_way[0] -= 1

    def notice():
        if under_way[0] > 0 and not done.is_set():
            line = (f"{desc}: compiling numba kernels (after an install or upgrade only: up to a minute or two; "
                    "numba caches them for later runs)")
            if how == "bar":
                from tqdm import tqdm
                tqdm.write(line, file=sys.stderr)
            else:
                print(line, file=sys.stderr, flush=True)

    timer = threading.Timer(COMPILE_NOTICE_S if after_s is None else float(after_s), notice)
    timer.daemon = True
    with event.install_listener("numba:compile", _Listener()):
        timer.start()
        try:
            yield
        finally:
            done.set()
            timer.cancel()
