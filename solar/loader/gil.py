"""The interpreter's GIL switch interval while solar's threads run beside the training loop.

A training loop that feeds a small model spends much of each step in Python holding the GIL (kernel
launches, autocast, the optimizer).  Each time one of solar's threads comes back from GIL-free work (a
read, a numba kernel, a wait) it must take the GIL back, and while the training thread holds it, it waits
up to the interpreter's switch interval (``sys.getswitchinterval()``, 5 ms by default) for each such
hand-over.  A buffer step comes back a few dozen times, so with the default interval the loader crawls
exactly when the GPU is busiest (measured, docs/runtime.md "The GIL beside the training loop").  A
shorter interval makes the holder give the GIL up sooner; the cost is a few microseconds per hand-over.

:func:`lower` sets the interval for as long as any loader that asked for it is open and puts the
previous value back when the last one closes (unless someone changed it in between).  Process-wide, as
the interval itself is.
"""
from __future__ import annotations

import sys
import threading
from typing import Callable, Optional

from ..errors import SpecError

#: Seconds: the switch interval a loader sets by default (``SolarLoader(switch_interval=...)``,
#: ``solar bench --switch-interval``); Python's own default is 0.005.
DEFAULT_SWITCH_INTERVAL = 0.0005

# reentrant: a loader never closed gives its hold back from its finalizer, which the garbage collector may run
# inside lower() or release() on the same thread
_lock = threading.RLock()
_users = 0
_saved: Optional[float] = None
_set: Optional[float] = None


def check_interval(value) -> Optional[float]:
    """``value`` as seconds (None or 0: leave the interpreter's interval alone); SpecError naming it
    otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise SpecError(f"switch_interval must be seconds in [0, 1] (0 or None: leave Python's), got {value!r}")
    return float(value) or None


def lower(value) -> Callable[[], None]:
    """Lower the switch interval to ``value`` seconds (never raise it) until the returned function is
    called (once; later calls do nothing)."""
    global _users, _saved, _set
    value = check_interval(value)
    if value is None:
        return lambda: None
    with _lock:
        if _users == 0:
            _saved = sys.getswitchinterval()
        _users += 1
        now = sys.getswitchinterval()
        if value < now:
            sys.setswitchinterval(value)
            _set = sys.getswitchinterval()  # as the interpreter rounds it
    done = [False]

    def release():
        global _users, _saved, _set
        with _lock:
            if done[0]:
                return
            done[0] = True
            _users = max(0, _users - 1)
            if _users == 0:
                if _set is not None and sys.getswitchinterval() == _set:  # nobody changed it since
                    sys.setswitchinterval(_saved)
                _saved = _set = None
    return release
