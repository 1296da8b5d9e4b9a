"""HDF5 filter pipelines decoded outside the HDF5 library (and its global lock).

A pipeline is a tuple of :class:`Filter` in *write* order; decoding runs it in
reverse, skipping filters whose bit is set in the chunk's ``filter_mask``.
Every decoder releases the GIL (inflate: the fastest of libdeflate, ISA-L,
zlib-ng installed, else zlib, see :mod:`.inflate`; LZF, Fletcher-32: numba;
plugin filters: :mod:`.codecs`), so reader threads scale.  ``decode_chunk(...,
out=)`` decodes the last stage straight into the caller's slot.

Registry: :data:`DECODERS` maps HDF5 filter ids to decoders (plugin filters only
when numcodecs, the ``codecs`` extra, is installed); :func:`decodable` says
whether one filter's chunks can be decoded; :func:`filter_name` names any id,
known or not, for error messages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import numba
import numpy as np

from .codecs import BLOSC, blosc_compressor_ok, dest, place, plugin_decoders
from .inflate import BACKENDS, inflate
from .lzf import lzf_decompress

DEFLATE, SHUFFLE, FLETCHER32, SZIP, NBIT, SCALEOFFSET = 1, 2, 3, 4, 5, 6
LZF = 32000

KNOWN_NAMES = {
    DEFLATE: "gzip", SHUFFLE: "shuffle", FLETCHER32: "fletcher32", SZIP: "szip",
    NBIT: "nbit", SCALEOFFSET: "scaleoffset", 307: "bzip2", LZF: "lzf",
    32001: "blosc", 32004: "lz4", 32008: "bitshuffle", 32013: "zfp", 32015: "zstd",
    32017: "sz", 32026: "blosc2",
}


@dataclass(frozen=True)
class Filter:
    """One stage of an HDF5 filter pipeline: id, flags and client data values."""

    id: int
    flags: int = 0
    values: Tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return filter_name(self.id)


def filter_name(fid: int) -> str:
    return KNOWN_NAMES.get(int(fid), f"filter#{int(fid)}")


def _unshuffle(buf: np.ndarray, itemsize: int, out=None) -> np.ndarray:
    """Inverse of HDF5's byte shuffle: byte planes back to interleaved elements.

    ``buf``: uint8[n]; writes into ``out`` (uint8[n]) when given, else returns
    ``buf`` itself (itemsize 1) or a new array.
    """
    if itemsize <= 1:
        if out is None:
            return buf
        out[:] = buf
        return out
    n = buf.shape[0] // itemsize
    dst = dest(buf.shape[0], out)
    body = n * itemsize
    dst[:body].reshape(n, itemsize)[...] = buf[:body].reshape(itemsize, n).T  # (itemsize, n) -> (n, itemsize)
    dst[body:] = buf[body:]
    return dst


@numba.njit(nogil=True, cache=True)
def _fletcher32_sums(b):
    """HDF5's Fletcher-32 sums of uint8[n] ``b`` as 16-bit big-endian words
    (an odd last byte is the high byte of a last word): ``(s1, s2, nonzero)``,
    each sum modulo 65535.  int64 sums reduced every 2**20 words cannot overflow."""
    n_words = b.shape[0] // 2
    s1 = np.int64(0)
    s2 = np.int64(0)
    nonzero = np.int64(0)
    start = 0
    while start < n_words:
        stop = min(n_words, start + (1 << 20))
        for k in range(start, stop):
            w = np.int64(b[2 * k]) * 256 + np.int64(b[2 * k + 1])
            nonzero |= w
            s1 += w
            s2 += s1
        s1 %= 65535
        s2 %= 65535
        start = stop
    if b.shape[0] % 2:
        w = np.int64(b[b.shape[0] - 1]) * 256
        nonzero |= w
        s1 = (s1 + w) % 65535
        s2 = (s2 + s1) % 65535
    return s1, s2, nonzero != 0


def fletcher32(data) -> int:
    """HDF5's Fletcher-32 of a bytes-like ``data`` (uint8[n]).

    The reference folds its sums modulo 65535 as it goes, and a nonzero sum never
    folds to 0: so each half is the sum modulo 65535, with 0 -> 65535 for
    nonzero input (e.g. all 0xFF bytes).
    """
    s1, s2, nonzero = _fletcher32_sums(np.frombuffer(data, dtype=np.uint8))
    if not nonzero:
        return 0
    return ((int(s2) or 65535) << 16) | (int(s1) or 65535)


def _decode_deflate(buf, f: Filter, nbytes, itemsize: int, out=None):
    if nbytes is None:  # after another compressor (exotic): only zlib can inflate without a size
        return place(BACKENDS["zlib"](buf, 0), None)
    return place(inflate(buf, nbytes), nbytes, out)


def _decode_shuffle(buf, f: Filter, nbytes, itemsize: int, out=None):
    size = f.values[0] if f.values else itemsize
    if nbytes is not None and buf.shape[0] != nbytes:
        raise ValueError(f"shuffled chunk has {buf.shape[0]} bytes, expected {nbytes}")
    return _unshuffle(buf, int(size), out)


def _decode_lzf(buf, f: Filter, nbytes, itemsize: int, out=None):
    if nbytes is None:
        raise ValueError("LZF applied after another compressor is not supported (its output size is unknown)")
    return lzf_decompress(buf, nbytes, out)


def _decode_fletcher32(buf, f: Filter, nbytes, itemsize: int, out=None):
    if buf.shape[0] < 4:
        raise ValueError("chunk too short for its Fletcher-32 checksum")
    body, stored = buf[:-4], int.from_bytes(buf[-4:].tobytes(), "little")
    if fletcher32(body) != stored:
        raise ValueError("Fletcher-32 checksum mismatch")
    return place(body, nbytes, out)


#: HDF5 filter id -> decoder ``(buf uint8[n], filter, nbytes, itemsize, out=None) -> uint8[nbytes]``
#: (``nbytes`` None: the stage's decoded size is not known), for the filters whose decoder is
#: importable (plugin filters need the ``codecs`` extra).
DECODERS = {
    DEFLATE: _decode_deflate,
    SHUFFLE: _decode_shuffle,
    LZF: _decode_lzf,
    FLETCHER32: _decode_fletcher32,
    **plugin_decoders(),
}


def decodable(f: Filter) -> bool:
    """Whether solar can decode chunks written by filter ``f`` (id and, for Blosc, its compressor)."""
    if f.id not in DECODERS:
        return False
    return f.id != BLOSC or blosc_compressor_ok(f)


def can_decode(pipeline) -> Tuple[bool, str]:
    """Whether every filter of ``pipeline`` has a raw decoder; else the reason."""
    bad = [f.name for f in pipeline if not decodable(f)]
    if bad:
        return False, f"filter {', '.join(bad)} has no raw decoder in solar"
    return True, ""


def _stage_sizes(pipeline, active, out_nbytes: int):
    """Decoded size of each active stage (filter index -> bytes, or None when unknown):
    the chunk's, plus 4 for every Fletcher-32 applied before it on write (lower index),
    unknown once a compressor was applied before it."""
    sizes, nbytes = {}, out_nbytes
    for i in active:
        sizes[i] = nbytes
        if pipeline[i].id == FLETCHER32 and nbytes is not None:
            nbytes += 4
        elif pipeline[i].id not in (FLETCHER32, SHUFFLE):
            nbytes = None
    return sizes


def decode_chunk(raw, pipeline, filter_mask: int, out_nbytes: int, itemsize: int, out=None) -> np.ndarray:
    """Run ``pipeline`` backwards over ``raw`` (bytes-like); returns ``out_nbytes`` uint8 bytes.

    ``out``: optional writable C-contiguous uint8 array of ``out_nbytes``; the
    last stage decodes straight into it and it is returned.  Without it the
    result may be a read-only view of a decoder's buffer.

    Raises ``ValueError`` (with the failing filter's name) on corrupt input;
    callers add the file, dataset and chunk to the message.
    """
    if out is not None and (out.dtype != np.uint8 or out.shape != (out_nbytes,)
                            or not (out.flags.c_contiguous and out.flags.writeable)):
        raise ValueError(f"out must be a writable contiguous uint8[{out_nbytes}], got {out.dtype}{list(out.shape)}")
    buf = np.frombuffer(raw, dtype=np.uint8)
    active = [i for i in range(len(pipeline)) if not filter_mask & (1 << i)]
    sizes = _stage_sizes(pipeline, active, out_nbytes)
    for i in reversed(active):
        f = pipeline[i]
        try:
            dec = DECODERS[f.id]
        except KeyError:
            raise ValueError(f"no decoder for HDF5 filter {f.name} (id {f.id})") from None
        try:
            buf = dec(buf, f, sizes[i], itemsize, out if i == active[0] else None)
        except ValueError as exc:
            raise ValueError(f"{f.name} decode failed: {exc}") from None
    if buf.shape[0] != out_nbytes:
        raise ValueError(f"decoded {buf.shape[0]} bytes, expected {out_nbytes}")
    if out is not None and buf is not out:  # every stage masked: the chunk is stored as is
        return place(buf, out_nbytes, out)
    return buf
