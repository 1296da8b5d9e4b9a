"""What h5py does not expose of HDF5's C API, called through ctypes on the library h5py loaded.

Only :func:`chunk_opts` so far: ``H5Pget_chunk_opts``, whose ``H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS``
bit says that a dataset's partial edge chunks are stored unfiltered (with filter mask 0 in the chunk
index: the mask alone does not tell).
"""
from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional

DONT_FILTER_PARTIAL_CHUNKS = 0x0002  # H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS

def _loaded_hdf5() -> Optional[str]:
    """The path of the HDF5 C library in this process (h5py's wheel copy or the site's), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                name = os.path.basename(path)
                if path.startswith("/") and name.startswith("libhdf5") and "_hl" not in name and ".so" in name:
                    return path
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=None)
def _hdf5():
    """HDF5's C library as h5py loaded it (ctypes), or None where it cannot be found."""
    import h5py  # noqa: F401  (loads the library)
    path = _loaded_hdf5()
    try:
        return ctypes.CDLL(path) if path else None
    except OSError:
        return None


def chunk_opts(plist) -> Optional[int]:
    """``H5Pget_chunk_opts`` of a dataset creation property list (h5py ``PropDCID``): 0 where HDF5 predates the
    option (1.8: no such chunks); None where HDF5's library cannot be reached from here (not Linux)."""
    lib = _hdf5()
    if lib is None:
        return None
    try:
        fn = lib.H5Pget_chunk_opts
    except AttributeError:
        return 0
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_uint)]
    opts = ctypes.c_uint(0)
    if fn(plist.id, ctypes.byref(opts)) < 0:
        return None
    return int(opts.value)
