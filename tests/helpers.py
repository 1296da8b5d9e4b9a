"""Shared test helpers: reference reads through h5py, small generated datasets."""
import os

import h5py
import numpy as np

from solar.gen import GenConfig, Storage, generate

SMALL = {
    # preset: (GenConfig kwargs) small enough for a test, big enough for several chunks
    "ptychonn": dict(samples=10, size=16),
    "well": dict(samples=2, size=8, steps=9),
    "pdebench": dict(samples=6, size=8, steps=5, variant="single"),
    "pdebench-mult": dict(samples=3, size=8, steps=6, variant="mult"),
    "cosmoflow": dict(samples=3, size=8),
}

STORAGES = ("contiguous", "chunked", "multi", "gzip", "lzf")


def make_dataset(root, preset: str, storage: str = "contiguous", seed: int = 0, **over):
    """Generate a small preset under ``root``; returns the output folder."""
    kw = dict(SMALL[preset])
    kw.update(over)
    name = preset.split("-")[0]
    out = os.path.join(str(root), f"{preset}-{storage}-{seed}")
    st = Storage.preset(storage, chunk_samples=3 if storage in ("multi", "gzip", "lzf") else None)
    generate(name, out, GenConfig(seed=seed, storage=st, **kw))
    return out


def h5py_sample(layout, sample: int):
    """Reference: the sample's fields read through h5py with its index tuple."""
    out = {}
    src, _ = layout.locate(sample)
    for name, d, sel in layout.sample_fields(sample):
        info = layout.datasets[d]
        with h5py.File(layout.files[info.file], "r", locking=False) as f:
            out[name] = f[info.name][sel]
    return out


def assert_same_sample(got: dict, ref: dict):
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k].shape == ref[k].shape, k
        assert got[k].dtype == ref[k].dtype, k
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
