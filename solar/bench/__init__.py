"""Pieces of ``solar bench``: the PyTorch baseline loader, cold page cache, the disk's own speed.

``baseline`` (imports torch) is loaded on first use of its names, so that
importing ``solar.bench`` stays cheap.  Nothing here imports ``mpi4py`` at
import time: DataLoader workers import these modules.
"""
from .cache import cached_fraction, drop_all_caches, drop_file_cache, make_cache_dropper
from .disk import cold_sequential_read, warm_sequential_read

_LAZY = {"H5Samples", "run_baseline"}


def __getattr__(name):
    if name in _LAZY:
        from . import baseline
        return getattr(baseline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["H5Samples", "run_baseline", "cached_fraction", "drop_all_caches", "drop_file_cache",
           "make_cache_dropper", "cold_sequential_read", "warm_sequential_read"]
