"""Decoders of HDF5 plugin filters (the ids that hdf5plugin registers), outside HDF5.

numcodecs (``pip install solar-hdf5[codecs]``) supplies the Blosc, LZ4 and Zstd
libraries (it releases the GIL while they run).  Each decoder has the
signature of :data:`solar.io.filters.DECODERS` entries:
``(buf uint8[n], filter, nbytes, itemsize, out) -> uint8[nbytes]`` (``nbytes``
None: not known, the chunk's header says), writing into ``out`` (a writable
uint8 array of ``nbytes``) when given; corrupt input, or a header that
disagrees with ``nbytes``, raises ``ValueError``.  The chunk framing is that of each HDF5 filter:

* blosc (32001): one Blosc1 buffer (its 16-byte header holds the sizes).
* lz4 (32004): ``uint64 BE`` decoded size, ``uint32 BE`` block size, then per
  block ``uint32 BE`` stored size and the LZ4 block (stored raw when that size
  equals the block's decoded size).
* bitshuffle (32008): values ``(.., .., itemsize, block elements, compressor)``;
  compressor 0: the bit-transposed blocks as they are; 2 (lz4) / 3 (zstd): a
  12-byte header (``uint64 BE`` decoded size, ``uint32 BE`` block bytes), then
  per block ``uint32 BE`` stored size and the compressed bit-transposed block.
  Both end with the ``n % 8`` trailing elements untransposed.
* zstd (32015): one zstd frame.

Not decoded here: blosc2 (32026; numcodecs has no Blosc2), bzip2 (307), zfp, sz.
"""
from __future__ import annotations

from typing import Callable, Dict

import numba
import numpy as np

BLOSC, LZ4, BITSHUFFLE, ZSTD = 32001, 32004, 32008, 32015
BSHUF_NONE, BSHUF_LZ4, BSHUF_ZSTD = 0, 2, 3
# Blosc filter values[6] (the compressor it wrote with) -> numcodecs' name for it
BLOSC_COMPRESSORS = {0: "blosclz", 1: "lz4", 2: "lz4hc", 3: "snappy", 4: "zlib", 5: "zstd"}

try:
    from numcodecs import blosc as _blosc
except ImportError:  # optional extra not installed
    _blosc = None
try:
    from numcodecs import lz4 as _lz4
except ImportError:
    _lz4 = None
try:
    from numcodecs import zstd as _zstd
except ImportError:
    _zstd = None


def place(data, nbytes, out=None) -> np.ndarray:
    """Bytes-like ``data`` as uint8[nbytes] (an error if it is another size; None: any size),
    copied into ``out`` when given."""
    arr = np.frombuffer(data, dtype=np.uint8)
    if nbytes is not None and arr.shape[0] != nbytes:
        raise ValueError(f"decoded {arr.shape[0]} bytes, expected {nbytes}")
    if out is None:
        return arr
    out[:] = arr
    return out


def dest(nbytes: int, out=None) -> np.ndarray:
    """``out`` if given, else a new uint8[nbytes] to decode into."""
    return np.empty(nbytes, dtype=np.uint8) if out is None else out


def _be(buf: np.ndarray, pos: int, width: int) -> int:
    if pos + width > buf.shape[0]:
        raise ValueError(f"chunk ends inside a header at byte {pos}")
    return int.from_bytes(buf[pos:pos + width].tobytes(), "big")


def decode_zstd(buf, f, nbytes, itemsize: int, out=None):
    try:
        return place(_zstd.decompress(buf), nbytes, out)
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None


def blosc_compressor_ok(f) -> bool:
    """Whether numcodecs' Blosc was built with the compressor that wrote filter ``f``'s chunks."""
    if len(f.values) < 7:  # no compressor recorded: blosclz, Blosc's default
        return True
    return BLOSC_COMPRESSORS.get(int(f.values[6]), "") in _blosc.list_compressors()


def decode_blosc(buf, f, nbytes, itemsize: int, out=None):
    if buf.shape[0] < 16:
        raise ValueError(f"chunk of {buf.shape[0]} bytes is shorter than a Blosc header")
    claimed = int.from_bytes(buf[4:8].tobytes(), "little")
    stored = int.from_bytes(buf[12:16].tobytes(), "little")
    if (nbytes is not None and claimed != nbytes) or stored != buf.shape[0]:
        raise ValueError(f"Blosc header says {claimed} bytes from {stored}, expected {nbytes} "
                         f"from {buf.shape[0]}")
    dst = dest(claimed, out)
    try:
        _blosc.decompress(buf, dst)
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None
    return dst


def _lz4_block(src: np.ndarray, dst: np.ndarray):
    """Decode one raw LZ4 block into all of ``dst`` (numcodecs wants its own 4-byte LE size first)."""
    framed = np.empty(src.shape[0] + 4, dtype=np.uint8)
    framed[:4] = np.frombuffer(dst.shape[0].to_bytes(4, "little"), dtype=np.uint8)
    framed[4:] = src
    try:
        _lz4.decompress(framed, dst)
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None


def decode_lz4(buf, f, nbytes, itemsize: int, out=None):
    total, block = _be(buf, 0, 8), _be(buf, 8, 4)
    if (nbytes is not None and total != nbytes) or (block == 0 and total):
        raise ValueError(f"LZ4 header says {total} bytes in blocks of {block}, expected {nbytes}")
    dst = dest(total, out)
    pos, done = 12, 0
    while done < total:
        n = min(block, total - done)
        size = _be(buf, pos, 4)
        pos += 4
        if pos + size > buf.shape[0]:
            raise ValueError(f"LZ4 block at byte {pos} runs past the chunk end")
        if size == n:
            dst[done:done + n] = buf[pos:pos + n]
        else:
            _lz4_block(buf[pos:pos + size], dst[done:done + n])
        pos += size
        done += n
    if pos != buf.shape[0]:
        raise ValueError(f"{buf.shape[0] - pos} bytes left over after the last LZ4 block")
    return dst


# the 8x8 bit-matrix transpose: masks and shifts of its three swap steps
_MASKS = (np.uint64(0x00AA00AA00AA00AA), np.uint64(0x0000CCCC0000CCCC), np.uint64(0x00000000F0F0F0F0))
_SHIFTS = (np.uint64(7), np.uint64(14), np.uint64(28))


@numba.njit(nogil=True, cache=True)
def _bit_untranspose(src, dst, elem_size):
    """Undo bitshuffle's transpose of one block of ``m = len(src) // elem_size``
    elements (m % 8 == 0) into ``dst`` (uint8[m * elem_size]).

    ``src`` holds ``8 * elem_size`` rows of ``m / 8`` bytes: row ``8j + b`` has bit
    b of byte j of every element, LSB first.  The 8 bytes at column c of rows
    8j..8j+7 form an 8x8 bit matrix whose transpose is byte j of elements 8c..8c+7.
    """
    cols = src.shape[0] // (8 * elem_size)
    rows = src.reshape(8 * elem_size, cols)
    out = dst.reshape(cols, 8, elem_size)
    m1, m2, m3 = _MASKS
    s1, s2, s3 = _SHIFTS
    for j in range(elem_size):
        for c in range(cols):
            x = np.uint64(0)
            for b in range(8):
                x |= np.uint64(rows[8 * j + b, c]) << np.uint64(8 * b)
            t = (x ^ (x >> s1)) & m1
            x = x ^ t ^ (t << s1)
            t = (x ^ (x >> s2)) & m2
            x = x ^ t ^ (t << s2)
            t = (x ^ (x >> s3)) & m3
            x = x ^ t ^ (t << s3)
            for k in range(8):
                out[c, k, j] = np.uint8(x >> np.uint64(8 * k))


def _bshuf_block_sizes(n_elems: int, block: int):
    """Element counts of bitshuffle's blocks: full blocks, then the rest rounded down to 8."""
    sizes = [block] * (n_elems // block)
    rest = n_elems % block
    if rest - rest % 8:
        sizes.append(rest - rest % 8)
    return sizes


def _bshuf_default_block(elem_size: int) -> int:
    """bitshuffle's default block: 8 KiB of elements, a multiple of 8, at least 128."""
    return max(8192 // elem_size // 8 * 8, 128)


def _bshuf_header(buf, nbytes, elem: int):
    """``(decoded bytes, block elements)`` from a compressed bitshuffle chunk's 12-byte header."""
    total, block_bytes = _be(buf, 0, 8), _be(buf, 8, 4)
    if (nbytes is not None and total != nbytes) or not block_bytes or block_bytes % elem:
        raise ValueError(f"bitshuffle header says {total} bytes in blocks of {block_bytes}, expected {nbytes}")
    return total, block_bytes // elem


def _bshuf_block(buf, pos: int, n: int, kind: int, f):
    """The bit-transposed block of ``n`` bytes at ``pos`` (after its size, when compressed), and the next pos."""
    if kind == BSHUF_NONE:
        return buf[pos:pos + n], pos + n
    size = _be(buf, pos, 4)
    pos += 4
    if pos + size > buf.shape[0]:
        raise ValueError(f"bitshuffle block at byte {pos} runs past the chunk end")
    src = np.empty(n, dtype=np.uint8)
    if kind == BSHUF_LZ4:
        _lz4_block(buf[pos:pos + size], src)
    else:
        decode_zstd(buf[pos:pos + size], f, n, 0, src)
    return src, pos + size


def decode_bitshuffle(buf, f, nbytes, itemsize: int, out=None):
    vals = tuple(f.values) + (0,) * 5
    elem, kind = int(vals[2]) or itemsize, int(vals[4])
    if kind == BSHUF_NONE:
        total, block, pos = buf.shape[0] if nbytes is None else nbytes, int(vals[3]) or _bshuf_default_block(elem), 0
    elif kind in (BSHUF_LZ4, BSHUF_ZSTD):
        (total, block), pos = _bshuf_header(buf, nbytes, elem), 12
    else:
        raise ValueError(f"bitshuffle compressor {kind} is not supported")
    if total % elem or block % 8:
        raise ValueError(f"{total} bytes in blocks of {block} elements: not whole {elem}-byte elements "
                         f"in blocks of a multiple of 8")
    dst = dest(total, out)
    done = 0
    for m in _bshuf_block_sizes(total // elem, block):
        n = m * elem
        src, pos = _bshuf_block(buf, pos, n, kind, f)
        if src.shape[0] != n:
            raise ValueError(f"bitshuffle chunk ends inside a block at byte {pos}")
        _bit_untranspose(src, dst[done:done + n], elem)
        done += n
    if pos + total - done != buf.shape[0]:
        raise ValueError(f"bitshuffle chunk has {buf.shape[0]} bytes, expected {pos + total - done}")
    dst[done:] = buf[pos:]
    return dst


def plugin_decoders() -> Dict[int, Callable]:
    """``{filter id: decoder}`` for the plugin filters whose library is importable."""
    found = {}
    if _blosc is not None:
        found[BLOSC] = decode_blosc
    if _lz4 is not None:
        found[LZ4] = decode_lz4
    if _zstd is not None:
        found[ZSTD] = decode_zstd
    if _lz4 is not None and _zstd is not None:  # either may have written the blocks
        found[BITSHUFFLE] = decode_bitshuffle
    return found
