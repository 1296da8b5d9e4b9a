"""Pieces of ``solar bench``: the baseline loaders, cold page cache, the disk's own speed, memory cgroups.

``baseline`` (imports torch) is loaded on first use of its names, so that
importing ``solar.bench`` stays cheap.  Nothing here imports ``mpi4py`` at
import time: DataLoader workers import these modules.
"""
from .cache import cached_fraction, drop_all_caches, drop_file_cache, make_cache_dropper
from .disk import (
    cold_parallel_sequential_read,
    cold_random_read,
    cold_sequential_read,
    typical_block,
    warm_sequential_read,
)

_LAZY = {"H5Samples", "BatchSamples", "BASELINES", "baseline_dataset", "run_baseline", "skip_reason"}


def __getattr__(name):
    if name in _LAZY:
        from . import baseline
        return getattr(baseline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BASELINES",
    "BatchSamples",
    "H5Samples",
    "baseline_dataset",
    "cached_fraction",
    "cold_parallel_sequential_read",
    "cold_random_read",
    "cold_sequential_read",
    "drop_all_caches",
    "drop_file_cache",
    "make_cache_dropper",
    "run_baseline",
    "skip_reason",
    "typical_block",
    "warm_sequential_read",
]
