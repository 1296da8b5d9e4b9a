"""Chunk decoders outside HDF5 against HDF5's own decoding: inflate backends, decoding
into a caller's slot, Fletcher-32, plugin filters (hdf5plugin ids, numcodecs-backed),
and numba kernels cached on disk."""
import importlib
import os
import subprocess
import sys
import zlib

import h5py
import numba
import numpy as np
import pytest

from solar.io import filters as flt
from solar.io.filters import DECODERS, Filter, can_decode, decode_chunk, fletcher32
from solar.io.inflate import BACKENDS
from solar.layout import LayoutSpec, build_layout


def _pipeline(ds):
    plist = ds.id.get_create_plist()
    return tuple(Filter(int(c), int(fl), tuple(int(v) for v in vals))
                 for c, fl, vals, _ in (plist.get_filter(i) for i in range(plist.get_nfilters())))


def _check_all_chunks(ds, ref=None, out=False):
    """decode_chunk of every stored chunk equals h5py's read of that chunk (in-bounds part),
    from ``ref`` (a decoded copy of ``ds``) when given."""
    ref_ds = ds if ref is None else ref
    pipe, chunks = _pipeline(ds), ds.chunks
    nbytes = int(np.prod(chunks)) * ds.dtype.itemsize
    grid = [range(0, s, c) for s, c in zip(ds.shape, chunks)]
    for origin in np.array(np.meshgrid(*grid, indexing="ij")).reshape(ds.ndim, -1).T:
        origin = tuple(int(o) for o in origin)
        mask, raw = ds.id.read_direct_chunk(origin)
        slot = np.full(nbytes, 0xAB, dtype=np.uint8) if out else None
        got = decode_chunk(raw, pipe, mask, nbytes, ds.dtype.itemsize, **({"out": slot} if out else {}))
        if out:
            assert got is slot
        sel = tuple(slice(o, min(o + c, s)) for o, c, s in zip(origin, chunks, ds.shape))
        want = ref_ds[sel]
        block = got.view(ds.dtype).reshape(chunks)[tuple(slice(0, r) for r in want.shape)]
        np.testing.assert_array_equal(block, want, err_msg=f"{ds.name} chunk {origin}")


def _data(dtype, shape, seed=0):
    """Compressible but not constant data: a smooth ramp plus small noise."""
    rng = np.random.default_rng(seed)
    base = np.arange(int(np.prod(shape))).reshape(shape) % 251
    return (base + rng.integers(0, 3, shape)).astype(dtype)


# --- built-in filters, decoded into the caller's slot ---------------------------------

@pytest.mark.parametrize("out", [False, True])
def test_builtin_pipelines_into_slot(tmp_path, out):
    rng = np.random.default_rng(3)
    with h5py.File(tmp_path / "b.h5", "w") as f:
        f.create_dataset("gz", data=_data("<f4", (10, 33)), chunks=(4, 33), compression="gzip", compression_opts=4)
        f.create_dataset("sgz", data=_data(">i2", (10, 33)), chunks=(3, 16), shuffle=True, compression="gzip")
        f.create_dataset("lzf", data=_data("<f8", (9, 20)), chunks=(2, 20), shuffle=True, compression="lzf")
        f.create_dataset("noise", data=rng.integers(0, 255, (24, 16), dtype="u1"), chunks=(4, 16), compression="lzf")
        f.create_dataset("ck", data=_data("<i4", (7, 5)), chunks=(3, 5), fletcher32=True)
        f.create_dataset("all", data=_data("<u2", (12, 9)), chunks=(5, 4), shuffle=True, compression="gzip",
                         fletcher32=True)
        for name in f:
            _check_all_chunks(f[name], out=out)


def test_fletcher32_applied_before_lzf(tmp_path):
    """A pipeline that checksums before compressing (fletcher32 first in write order):
    the compressor's stage decodes to the chunk plus its 4 checksum bytes."""
    path = tmp_path / "fl.h5"
    data = _data("<i4", (8, 50))
    with h5py.File(path, "w") as f:
        for name, compress in (("lzf", lambda p: p.set_filter(32000, h5py.h5z.FLAG_OPTIONAL)),
                               ("gzip", lambda p: p.set_deflate(4))):
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_chunk((4, 50))
            dcpl.set_fletcher32()
            compress(dcpl)
            h5py.h5d.create(f.id, name.encode(), h5py.h5t.STD_I32LE, h5py.h5s.create_simple(data.shape), dcpl=dcpl)
            f[name][...] = data
    with h5py.File(path, "r") as f:
        for name in ("lzf", "gzip"):
            assert _pipeline(f[name])[0].id == flt.FLETCHER32
            _check_all_chunks(f[name])
            _check_all_chunks(f[name], out=True)


def test_out_must_fit():
    raw = zlib.compress(bytes(range(64)))
    pipe = (Filter(flt.DEFLATE),)
    with pytest.raises(ValueError, match=r"out must be a writable contiguous uint8\[64\]"):
        decode_chunk(raw, pipe, 0, 64, 1, out=np.empty(63, dtype=np.uint8))


# --- inflate backends --------------------------------------------------------------------

@pytest.mark.parametrize("name", list(BACKENDS))
def test_inflate_backend_exact_or_error(name, monkeypatch):
    """Each installed backend decodes HDF5's zlib streams, and any corrupt, short or
    long stream is an error naming gzip, never a wrong chunk."""
    monkeypatch.setattr(flt, "inflate", BACKENDS[name])
    data = _data("<f4", (300,)).tobytes()
    raw = zlib.compress(data, 4)
    pipe = (Filter(flt.DEFLATE),)
    assert decode_chunk(raw, pipe, 0, len(data), 4).tobytes() == data
    slot = np.empty(len(data), dtype=np.uint8)
    assert decode_chunk(raw, pipe, 0, len(data), 4, out=slot) is slot and slot.tobytes() == data
    bad = bytearray(raw)
    bad[len(bad) // 2] ^= 0xFF
    cases = {"corrupt": (bytes(bad), len(data)), "truncated": (raw[:-7], len(data)),
             "longer than the chunk": (raw, len(data) - 4), "shorter than the chunk": (raw, len(data) + 4)}
    for why, (stream, n) in cases.items():
        with pytest.raises(ValueError, match="gzip decode failed"):
            decode_chunk(stream, pipe, 0, n, 4)
            pytest.fail(why)


# --- Fletcher-32 ------------------------------------------------------------------------

def _fletcher_cases():
    words_to_65535 = np.array([0x0001, 0xFFFE] * 7 + [0xFFFF], dtype=">u2").view(np.uint8)
    rng = np.random.default_rng(5)
    return {
        "random": rng.integers(0, 256, 4096, dtype=np.uint8),
        "random-odd": rng.integers(0, 256, 1001, dtype=np.uint8),
        "one-byte": np.array([7], dtype=np.uint8),
        "zeros": np.zeros(999, dtype=np.uint8),
        "all-ff": np.full(4096, 0xFF, dtype=np.uint8),
        "all-ff-odd": np.full(4097, 0xFF, dtype=np.uint8),
        "sums-at-65535": words_to_65535,
        "large-all-ff": np.full((1 << 21) + 3, 0xFF, dtype=np.uint8),  # past one 2**20-word reduction block
        "large-random": rng.integers(0, 256, (1 << 21) + 1, dtype=np.uint8),
    }


def test_fletcher32_matches_hdf5(tmp_path):
    """The checksum HDF5 stores (last 4 bytes, little-endian) on odd lengths, all-zero data,
    and sums that fold onto 65535."""
    cases = _fletcher_cases()
    with h5py.File(tmp_path / "f.h5", "w") as f:
        for name, b in cases.items():
            f.create_dataset(name, data=b, chunks=b.shape, fletcher32=True)
    with h5py.File(tmp_path / "f.h5", "r") as f:
        for name, b in cases.items():
            mask, raw = f[name].id.read_direct_chunk((0,))
            assert raw[:-4] == b.tobytes(), name
            assert fletcher32(b) == int.from_bytes(raw[-4:], "little"), name
            _check_all_chunks(f[name])
    assert fletcher32(cases["sums-at-65535"]) & 0xFFFF == 65535
    assert fletcher32(cases["zeros"]) == 0


def test_fletcher32_mismatch_is_an_error():
    b = np.arange(100, dtype=np.uint8)
    raw = b.tobytes() + (fletcher32(b) ^ 1).to_bytes(4, "little")
    with pytest.raises(ValueError, match="fletcher32 decode failed: Fletcher-32 checksum mismatch"):
        decode_chunk(raw, (Filter(flt.FLETCHER32),), 0, 100, 1)


# --- plugin filters (hdf5plugin ids, numcodecs decoders) ----------------------------------
# hdf5plugin writes the files, and HDF5 decodes the reference copies, in a child process: importing
# hdf5plugin here would register its filters with HDF5 for every later test of this session.

PLUGIN_WRITER = r"""
import sys
import h5py, hdf5plugin as hp, numpy as np

def data(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    base = np.arange(int(np.prod(shape))).reshape(shape) % 251
    return (base + rng.integers(0, 3, shape)).astype(dtype)

kinds = {}
for cname in ("blosclz", "lz4", "lz4hc", "zlib", "zstd"):
    for sh, label in ((hp.Blosc.NOSHUFFLE, "noshuffle"), (hp.Blosc.SHUFFLE, "shuffle"),
                      (hp.Blosc.BITSHUFFLE, "bitshuffle")):
        kinds[f"blosc-{cname}-{label}"] = hp.Blosc(cname=cname, clevel=5, shuffle=sh)
kinds["lz4"] = hp.LZ4()
kinds["lz4-1KiB-blocks"] = hp.LZ4(nbytes=1024)
kinds["bitshuffle"] = hp.Bitshuffle(cname="none")
kinds["bitshuffle-lz4"] = hp.Bitshuffle(cname="lz4")
kinds["bitshuffle-zstd"] = hp.Bitshuffle(cname="zstd")
kinds["zstd"] = hp.Zstd()
# partial edge chunks, element counts not a multiple of 8 (bitshuffle's untransposed tail),
# chunks of several bitshuffle blocks
shapes = [("<f4", (10, 37), (3, 37)), (">i2", (6, 1100), (2, 1100)), ("u1", (5, 41), (5, 41)),
          ("<f8", (4, 1030), (3, 1030))]
with h5py.File(sys.argv[1], "w") as f:
    for label, opts in kinds.items():
        for k, (dt, shape, chunks) in enumerate(shapes):
            f.create_dataset(f"{label}/{k}", data=data(dt, shape, k), chunks=chunks, **opts)
with h5py.File(sys.argv[1], "r") as f, h5py.File(sys.argv[2], "w") as ref:
    for label in kinds:
        for k in range(len(shapes)):
            ref[f"{label}/{k}"] = f[f"{label}/{k}"][()]
"""


@pytest.fixture(scope="module")
def plugin_files(tmp_path_factory):
    """``(filtered file, reference file)``: hdf5plugin-filtered datasets, and h5py's decoding of them."""
    for mod in ("hdf5plugin", "numcodecs"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed")
    root = tmp_path_factory.mktemp("plugins")
    paths = (str(root / "p.h5"), str(root / "ref.h5"))
    subprocess.run([sys.executable, "-c", PLUGIN_WRITER, *paths], check=True)
    return paths


def _datasets(path):
    names = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    return names


def test_plugin_filters_decode_like_h5py(plugin_files):
    path, ref_path = plugin_files
    names = _datasets(path)
    assert len(names) == 4 * 21
    with h5py.File(path, "r") as f, h5py.File(ref_path, "r") as ref:
        for name in names:
            assert can_decode(_pipeline(f[name])) == (True, ""), name
            _check_all_chunks(f[name], ref[name])
            _check_all_chunks(f[name], ref[name], out=True)


def test_plugin_filter_dataset_is_read_raw(plugin_files):
    """Zstd and Bitshuffle+LZ4 datasets stay on the raw path and read as HDF5 decodes them."""
    from solar.io import read_sample
    path, ref_path = plugin_files
    fields = ("zstd/0", "bitshuffle-lz4/0", "blosc-zstd-bitshuffle/0")
    lay = build_layout(LayoutSpec("rows", (os.path.basename(path),), fields, root=os.path.dirname(path)))
    assert [(d.raw, d.fallback) for d in lay.datasets] == [(True, "")] * 3
    fd = os.open(lay.files[0], os.O_RDONLY)
    try:
        with h5py.File(ref_path, "r") as ref:
            for i in range(lay.n_samples):
                got = read_sample(lay, i, {0: fd})
                for name, d, sel in lay.sample_fields(i):
                    np.testing.assert_array_equal(got[name], ref[lay.datasets[d].name][sel])
    finally:
        os.close(fd)


def test_corrupt_plugin_chunks_are_errors(plugin_files):
    picked = ("blosc-lz4-shuffle/0", "lz4/1", "lz4-1KiB-blocks/1", "bitshuffle/1", "bitshuffle-lz4/1",
              "bitshuffle-zstd/1", "zstd/1")
    with h5py.File(plugin_files[0], "r") as f:
        for name in picked:
            ds = f[name]
            pipe, nbytes = _pipeline(ds), int(np.prod(ds.chunks)) * ds.dtype.itemsize
            mask, raw = ds.id.read_direct_chunk((0, 0))
            cases = {"truncated": (raw[:-9], nbytes), "extended": (raw + b"\0" * 8, nbytes),
                     "decodes to fewer bytes": (raw, nbytes + 4)}
            for why, (bad, n) in cases.items():
                with pytest.raises(ValueError, match=f"{pipe[0].name} decode failed"):
                    decode_chunk(bad, pipe, mask, n, ds.dtype.itemsize)
                    pytest.fail(f"{name} {why}")


def test_blosc_without_its_compressor_is_not_read_raw(tmp_path):
    """Blosc chunks written with a compressor numcodecs' Blosc lacks (snappy) are not planned
    for the raw reader; with a compressor it has (lz4), they are."""
    numcodecs_blosc = pytest.importorskip("numcodecs.blosc")
    if "snappy" in numcodecs_blosc.list_compressors():
        pytest.skip("this numcodecs has snappy")
    from solar.errors import LayoutError
    data = np.arange(16, dtype="<f4")
    with h5py.File(tmp_path / "b.h5", "w") as f:
        for name, code in (("snappy", 3), ("lz4", 1)):
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_chunk((16,))
            dcpl.set_filter(32001, h5py.h5z.FLAG_OPTIONAL, (2, 2, 4, 64, 5, 1, code))
            h5py.h5d.create(f.id, name.encode(), h5py.h5t.IEEE_F32LE, h5py.h5s.create_simple((16,)), dcpl=dcpl)
            f[name].id.write_direct_chunk((0,), numcodecs_blosc.compress(data, b"lz4", 5, 1), filter_mask=0)
    with h5py.File(tmp_path / "b.h5", "r") as f:
        assert can_decode(_pipeline(f["snappy"]))[0] is False
    lay = build_layout(LayoutSpec("rows", ("b.h5",), ("lz4",), root=str(tmp_path)))
    assert lay.datasets[0].raw
    if h5py.h5z.filter_avail(32001):
        lay = build_layout(LayoutSpec("rows", ("b.h5",), ("snappy",), root=str(tmp_path)))
        assert not lay.datasets[0].raw and "blosc" in lay.datasets[0].fallback
    else:
        with pytest.raises(LayoutError, match=r"uses HDF5 filter blosc \(id 32001\)"):
            build_layout(LayoutSpec("rows", ("b.h5",), ("snappy",), root=str(tmp_path)))


def test_decoders_listed_only_when_importable(monkeypatch):
    """Without numcodecs, no plugin filter is listed (h5meta then falls back to h5py)."""
    import builtins
    import solar.io.codecs as codecs
    real_import = builtins.__import__

    def no_numcodecs(name, *a, **kw):
        if name.startswith("numcodecs"):
            raise ImportError(name)
        return real_import(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_numcodecs)
    try:
        importlib.reload(codecs)
        assert codecs.plugin_decoders() == {}
    finally:
        monkeypatch.setattr(builtins, "__import__", real_import)
        importlib.reload(codecs)
    if importlib.util.find_spec("numcodecs") is not None:
        assert {32001, 32004, 32008, 32015} <= set(DECODERS)


# --- numba kernels cached on disk -----------------------------------------------------------

def test_every_numba_kernel_is_cached():
    """cache=True on every njit kernel, so a second process loads them instead of compiling."""
    import pathlib

    import solar
    root = pathlib.Path(solar.__file__).parent
    uncached, seen = [], 0
    for src in sorted(root.rglob("*.py")):
        if "njit" not in src.read_text():
            continue
        m = importlib.import_module(".".join(("solar",) + src.relative_to(root).with_suffix("").parts))
        for name, obj in vars(m).items():
            if isinstance(obj, numba.core.registry.CPUDispatcher) and obj.__module__ == m.__name__:
                seen += 1
                if type(obj._cache).__name__ == "NullCache":
                    uncached.append(f"{m.__name__}.{name}")
    assert seen >= 10 and not uncached
