"""Readers: raw positional reads of HDF5 blocks and their decoding outside HDF5's lock."""
from .filters import DECODERS, Filter, can_decode, decode_chunk, filter_name
from .raw import assemble_sample, decode_block, place_block, pread_exact, read_block, read_sample

__all__ = ["DECODERS", "Filter", "can_decode", "decode_chunk", "filter_name", "assemble_sample",
           "decode_block", "place_block", "pread_exact", "read_block", "read_sample"]
