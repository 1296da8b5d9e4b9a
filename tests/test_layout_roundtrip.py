"""Every preset x storage: blocks read raw by offset and decoded equal h5py, for every sample."""
import os

import numpy as np
import pytest

from solar.io import read_sample
from solar.layout import load_layout
from helpers import SMALL, STORAGES, assert_same_sample, h5py_sample, make_dataset


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("preset", sorted(SMALL))
def test_raw_blocks_equal_h5py(tmp_path, preset, storage):
    out = make_dataset(tmp_path, preset, storage)
    layout = load_layout(out)
    assert layout.n_samples > 1
    fds = {i: os.open(p, os.O_RDONLY) for i, p in enumerate(layout.files)}
    try:
        for i in range(layout.n_samples):
            assert_same_sample(read_sample(layout, i, fds), h5py_sample(layout, i))
    finally:
        for fd in fds.values():
            os.close(fd)


def test_generation_is_deterministic(tmp_path):
    a = load_layout(make_dataset(tmp_path / "a", "ptychonn", "gzip", seed=3))
    b = load_layout(make_dataset(tmp_path / "b", "ptychonn", "gzip", seed=3))
    c = load_layout(make_dataset(tmp_path / "c", "ptychonn", "gzip", seed=4))
    ra, rb, rc = h5py_sample(a, 5), h5py_sample(b, 5), h5py_sample(c, 5)
    for k in ra:
        np.testing.assert_array_equal(ra[k], rb[k])
        assert not np.array_equal(ra[k], rc[k])
    assert np.array_equal(a.block_stored, b.block_stored)


def test_fields_are_smooth_not_noise(tmp_path):
    lay = load_layout(make_dataset(tmp_path, "pdebench", "contiguous", size=32))
    x = h5py_sample(lay, 0)["pressure"][0]  # (32, 32)
    assert x.std() > 0
    # neighbouring pixels are strongly correlated (white noise would give ~0)
    corr = np.corrcoef(x[:, :-1].ravel(), x[:, 1:].ravel())[0, 1]
    assert corr > 0.8
