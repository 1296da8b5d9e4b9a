"""A rank's pools are faulted in by a background thread while the buffer already runs (start-up no longer
waits for it): every page ends up resident, slots are usable at once, close() stops it, and where the OS
cannot populate the pools are faulted in at once as before."""
import ctypes
import mmap
import sys

import numpy as np
import pytest

from solar.buffer import pool
from solar.buffer.pool import SlotPools

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore/madvise are Linux here")


def _resident_fraction(a: np.ndarray) -> float:
    """Fraction of ``a``'s pages mapped in this process (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = a.ctypes.data // page * page
    n = -(-(a.ctypes.data + a.nbytes - start) // page)
    vec = (ctypes.c_ubyte * n)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * page), vec) == 0
    return sum(v & 1 for v in vec) / n


@linux
def test_pools_are_faulted_in_beside_the_buffer(monkeypatch):
    if not pool.can_populate():
        pytest.skip("MADV_POPULATE_WRITE not supported by this kernel")
    monkeypatch.setattr(pool, "POPULATE_CHUNK", 1 << 20)  # many chunks: both classes side by side
    sizes, slots = np.array([1 << 16, 3 << 16]), np.array([256, 96])  # 16 MiB and 18 MiB
    p = SlotPools(sizes, slots, background=True)
    p.view(1, 5)[:] = 7  # usable at once, populated or not
    alloc = p.alloc_many(np.array([0, 1, 1]))
    assert alloc.tolist() == [0, 0, 1]
    p.populator._thread.join(timeout=30)
    assert p.populator.done()
    for a in p.arrays:
        assert _resident_fraction(a) == 1.0
    assert (p.view(1, 5) == 7).all() and not p.view(1, 4).any()  # populating writes nothing
    p.close()


@linux
def test_close_stops_the_populator_early(monkeypatch):
    import threading
    if not pool.can_populate():
        pytest.skip("MADV_POPULATE_WRITE not supported by this kernel")
    monkeypatch.setattr(pool, "POPULATE_CHUNK", 1 << 20)
    calls, go = [], threading.Event()
    real = pool.populate

    def gated(buf, lo, hi):
        assert go.wait(10)
        calls.append((lo, hi))
        return real(buf, lo, hi)
    monkeypatch.setattr(pool, "populate", gated)
    p = SlotPools(np.array([1 << 16]), np.array([512]), background=True)  # 32 MiB: 32 chunks
    p.populator._stop.set()  # what close() does first, here while the first chunk waits
    go.set()
    p.close()
    assert p.populator.done() and len(calls) == 1  # the chunk in hand, then no more


def test_without_populate_the_pools_are_faulted_in_at_once(monkeypatch):
    monkeypatch.setattr(pool, "can_populate", lambda: False)
    p = SlotPools(np.array([1 << 16]), np.array([256]), background=True)
    assert p.populator is None
    p.view(0, 3)[:] = 1
    p.close()  # nothing to stop
    if sys.platform.startswith("linux"):
        assert _resident_fraction(p.arrays[0]) == 1.0  # MAP_POPULATE, as before
