"""Readers: raw positional reads of HDF5 blocks and their decoding outside HDF5's lock.

Block readers (``get_reader(name, layout)``) fill caller-owned arrays with
decoded blocks: ``pread``, ``mpiio``, ``h5py``, ``h5py-mpio`` (see :mod:`solar.io.reader`).
"""
from . import h5py_reader, mpiio_reader, pread_reader  # noqa: F401  (register the backends)
from .coalesce import CoalescePolicy, Ranges, coalesce
from .filters import DECODERS, Filter, can_decode, decode_chunk, filter_name
from .raw import (
    assemble_sample,
    decode_block,
    place_block,
    pread_exact,
    read_block,
    read_sample,
)
from .reader import READERS, BlockReader, ReadStats, default_reader_name, get_reader

__all__ = [
    "DECODERS", "READERS", "BlockReader", "CoalescePolicy", "Filter", "Ranges", "ReadStats",
    "assemble_sample", "can_decode", "coalesce", "decode_block", "decode_chunk", "default_reader_name",
    "filter_name", "get_reader", "place_block", "pread_exact", "read_block", "read_sample",
]
