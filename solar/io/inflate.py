"""zlib-stream inflate (HDF5's deflate filter, id 1) through the fastest library installed.

Every backend takes ``(data, nbytes)`` -- a bytes-like zlib stream and the exact
size it must decode to -- and returns a bytes-like object of the decoded bytes;
corrupt input raises ``ValueError``.  All of them release the GIL while inflating.

``BACKENDS`` lists the importable ones, fastest first (``benchmarks/decode_bench.py``
measures them): libdeflate (``deflate``), ISA-L (``isal``), zlib-ng (``zlib-ng``),
then the standard library's zlib, always present.  ``pip install solar-hdf5[fast]``
adds the first, which :data:`inflate` then uses.
"""
from __future__ import annotations

import zlib
from typing import Callable, Dict


def _stdlib(data, nbytes: int):
    try:
        return zlib.decompress(data, bufsize=max(nbytes, 1))
    except zlib.error as exc:
        raise ValueError(str(exc)) from None


def _make_libdeflate():
    import deflate

    def libdeflate(data, nbytes: int):
        # libdeflate needs the output size up front; one byte more than expected
        # lets a stream that decodes to too many bytes be told apart as corrupt.
        try:
            return deflate.zlib_decompress(data, nbytes + 1)
        except deflate.DeflateError as exc:
            raise ValueError(f"corrupt zlib stream ({exc})") from None
    return libdeflate


def _make_isal():
    from isal import isal_zlib

    def isal(data, nbytes: int):
        try:
            return isal_zlib.decompress(data, bufsize=max(nbytes, 1))
        except isal_zlib.error as exc:
            raise ValueError(str(exc)) from None
    return isal


def _make_zlib_ng():
    from zlib_ng import zlib_ng

    def zlib_ng_(data, nbytes: int):
        try:
            return zlib_ng.decompress(data, bufsize=max(nbytes, 1))
        except zlib_ng.error as exc:
            raise ValueError(str(exc)) from None
    return zlib_ng_


def _available() -> Dict[str, Callable]:
    found = {}
    for name, make in (("libdeflate", _make_libdeflate), ("isal", _make_isal), ("zlib-ng", _make_zlib_ng)):
        try:
            found[name] = make()
        except ImportError:
            continue
    found["zlib"] = _stdlib
    return found


BACKENDS: Dict[str, Callable] = _available()


INFLATE_NAME = next(iter(BACKENDS))  # the fastest installed
inflate = BACKENDS[INFLATE_NAME]
