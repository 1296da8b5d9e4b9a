"""LZF decompression (the format of h5py's ``lzf`` filter, id 32000) in numba.

The stream is a sequence of runs: a control byte ``c < 32`` starts a literal run
of ``c + 1`` bytes; otherwise ``c >> 5`` is the length (7 means "read one more
length byte") and the low 5 bits plus the next byte are the back-reference
distance minus one.  Numba releases the GIL, so reader threads decode in parallel.
"""
import numba
import numpy as np


@numba.njit(nogil=True, cache=True)
def _lzf_decode(src, dst):
    """Decode ``src`` into ``dst``; return bytes written, or -1 on corrupt input."""
    ip = 0
    op = 0
    n_in = src.shape[0]
    n_out = dst.shape[0]
    while ip < n_in:
        ctrl = np.int64(src[ip])
        ip += 1
        if ctrl < 32:
            run = ctrl + 1
            if ip + run > n_in or op + run > n_out:
                return -1
            for k in range(run):
                dst[op + k] = src[ip + k]
            ip += run
            op += run
        else:
            length = ctrl >> 5
            ref = op - ((ctrl & 0x1F) << 8) - 1
            if length == 7:
                if ip >= n_in:
                    return -1
                length += np.int64(src[ip])
                ip += 1
            if ip >= n_in:
                return -1
            ref -= np.int64(src[ip])
            ip += 1
            length += 2
            if ref < 0 or op + length > n_out:
                return -1
            for k in range(length):  # byte by byte: the ranges may overlap
                dst[op + k] = dst[ref + k]
            op += length
    return op


def lzf_decompress(data, out_nbytes: int, out=None) -> np.ndarray:
    """Decompress an LZF stream that decodes to exactly ``out_nbytes`` bytes.

    ``out``: optional writable uint8 array of ``out_nbytes`` to decode into
    (returned); else a new one is allocated.
    """
    src = np.frombuffer(data, dtype=np.uint8)
    dst = np.empty(out_nbytes, dtype=np.uint8) if out is None else out
    n = _lzf_decode(src, dst)
    if n != out_nbytes:
        raise ValueError(f"corrupt LZF stream (decoded {n} bytes, expected {out_nbytes})")
    return dst
