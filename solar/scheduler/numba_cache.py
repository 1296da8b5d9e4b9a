"""numba's on-disk cache of solar's compiled kernels, made optional: a cache folder that cannot be written
(``NUMBA_CACHE_DIR`` on a full disk or over its quota, a read-only install) is left aside with one warning
line, and the kernels are compiled in memory as if ``cache=True`` were not given.

numba raises such an ``OSError`` out of the first call of a jitted function, wherever that happens: in
``solar plan`` a 58-line traceback, in the loader inside reading the schedule (which then called the good
file "damaged or truncated").  :func:`install` wraps numba's ``Cache.save_overload`` / ``load_overload`` for
functions defined in solar's modules only (a user's own ``cache=True`` functions behave as numba makes them).
The price of the fallback is compile time: each process compiles solar's kernels again (~20 s).
"""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("solar")

_lock = threading.Lock()
_failed = []  # the first OSError, once the cache is off for solar's functions


def _ours(cache) -> bool:
    """Whether numba ``Cache`` object ``cache`` belongs to a function of solar's own modules."""
    mod = getattr(getattr(cache, "_py_func", None), "__module__", None) or ""
    return mod == "solar" or mod.startswith("solar.")


def _give_up(cache, exc: OSError):
    """Turn the cache off for solar's functions; say so once, naming the folder and the OS error."""
    from ..atomic import os_reason
    with _lock:
        first = not _failed
        if first:
            _failed.append(exc)
    if first:
        env = os.environ.get("NUMBA_CACHE_DIR")
        where = f"NUMBA_CACHE_DIR={env}" if env else f"numba's cache folder {getattr(cache, 'cache_path', '?')}"
        log.warning("solar: cannot use %s (%s): compiling solar's kernels without the cache (each process "
                    "compiles them again)", where, os_reason(exc))


def install():
    """Wrap numba's cache once per process (idempotent); nothing changes for functions outside solar."""
    from numba.core import caching
    cls = caching.Cache
    if getattr(cls.save_overload, "_solar_guard", False):
        return
    real_save, real_load = cls.save_overload, cls.load_overload

    def save_overload(self, sig, data):
        if not _ours(self):
            return real_save(self, sig, data)
        if _failed:
            return None
        try:
            return real_save(self, sig, data)
        except OSError as exc:  # ENOSPC, EDQUOT, EROFS, EACCES, EIO: the kernel is compiled; only its copy is lost
            _give_up(self, exc)
            return None

    def load_overload(self, sig, target_context):
        if not _ours(self):
            return real_load(self, sig, target_context)
        if _failed:
            return None
        try:
            return real_load(self, sig, target_context)
        except OSError as exc:  # an unreadable index: compile instead
            _give_up(self, exc)
            return None

    save_overload._solar_guard = load_overload._solar_guard = True
    cls.save_overload, cls.load_overload = save_overload, load_overload
