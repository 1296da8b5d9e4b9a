"""HDF5 filter pipelines decoded outside the HDF5 library (and its global lock).

A pipeline is a tuple of :class:`Filter` in *write* order; decoding runs it in
reverse, skipping filters whose bit is set in the chunk's ``filter_mask``.
zlib and the numba LZF decoder release the GIL, so reader threads scale.

Registry: :data:`DECODERS` maps HDF5 filter ids to decoders; :func:`filter_name`
names any id, known or not, for error messages.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Tuple

import numpy as np

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


def _unshuffle(buf: np.ndarray, itemsize: int) -> np.ndarray:
    """Inverse of HDF5's byte shuffle: byte planes back to interleaved elements."""
    if itemsize <= 1:
        return buf
    n = buf.shape[0] // itemsize
    body = buf[: n * itemsize].reshape(itemsize, n).T.reshape(-1)  # (itemsize, n) -> (n, itemsize)
    if n * itemsize == buf.shape[0]:
        return body
    return np.concatenate([body, buf[n * itemsize:]])


def fletcher32(data: np.ndarray) -> int:
    """HDF5's Fletcher-32 over 16-bit big-endian words (odd last byte padded).

    The reference folds its sums modulo 65535 as it goes (a nonzero sum never
    folds to 0); reducing modulo 65535 once, with 0 -> 65535 for nonzero input,
    gives the same value.
    """
    b = np.asarray(data, dtype=np.uint8)
    n = b.shape[0]
    words = (b[: n - n % 2 : 2].astype(np.uint64) << np.uint64(8)) | b[1 : n - n % 2 : 2].astype(np.uint64)
    if n % 2:
        words = np.append(words, np.uint64(int(b[-1]) << 8))
    if not words.size or not words.any():
        return 0
    running = np.cumsum(words % np.uint64(65535), dtype=np.uint64) % np.uint64(65535)
    s1 = int(running[-1]) or 65535
    s2 = int(np.sum(running, dtype=np.uint64) % np.uint64(65535)) or 65535
    return (s2 << 16) | s1


def _decode_deflate(buf, f: Filter, out_nbytes: int, itemsize: int):
    return np.frombuffer(zlib.decompress(buf.tobytes() if isinstance(buf, np.ndarray) else buf), dtype=np.uint8)


def _decode_shuffle(buf, f: Filter, out_nbytes: int, itemsize: int):
    size = f.values[0] if f.values else itemsize
    return _unshuffle(np.frombuffer(buf, dtype=np.uint8), int(size))


def _decode_lzf(buf, f: Filter, out_nbytes: int, itemsize: int):
    return lzf_decompress(buf, out_nbytes)


def _decode_fletcher32(buf, f: Filter, out_nbytes: int, itemsize: int):
    b = np.frombuffer(buf, dtype=np.uint8)
    if b.shape[0] < 4:
        raise ValueError("chunk too short for its Fletcher-32 checksum")
    body, stored = b[:-4], int.from_bytes(b[-4:].tobytes(), "little")
    if fletcher32(body) != stored:
        raise ValueError("Fletcher-32 checksum mismatch")
    return body


DECODERS = {
    DEFLATE: _decode_deflate,
    SHUFFLE: _decode_shuffle,
    LZF: _decode_lzf,
    FLETCHER32: _decode_fletcher32,
}


def can_decode(pipeline) -> Tuple[bool, str]:
    """Whether every filter of ``pipeline`` has a raw decoder; else the reason."""
    bad = [f.name for f in pipeline if f.id not in DECODERS]
    if bad:
        return False, f"filter {', '.join(bad)} has no raw decoder in solar"
    return True, ""


def decode_chunk(raw, pipeline, filter_mask: int, out_nbytes: int, itemsize: int) -> np.ndarray:
    """Run ``pipeline`` backwards over ``raw``; returns ``out_nbytes`` uint8 bytes.

    Raises ``ValueError`` (with the failing filter's name) on corrupt input;
    callers add the file, dataset and chunk to the message.
    """
    buf = raw
    for i in range(len(pipeline) - 1, -1, -1):
        if filter_mask & (1 << i):
            continue
        f = pipeline[i]
        try:
            dec = DECODERS[f.id]
        except KeyError:
            raise ValueError(f"no decoder for HDF5 filter {f.name} (id {f.id})") from None
        # The last stage to run knows the exact output size; inner stages do not
        # change the size except deflate/lzf/fletcher32, which carry their own.
        try:
            buf = dec(buf, f, out_nbytes, itemsize)
        except (zlib.error, ValueError) as exc:
            raise ValueError(f"{f.name} decode failed: {exc}") from None
    out = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    if out.shape[0] != out_nbytes:
        raise ValueError(f"decoded {out.shape[0]} bytes, expected {out_nbytes}")
    return out
