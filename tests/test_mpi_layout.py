"""MPI: every rank builds the same layout and reads its share of samples raw, equal to h5py.

Written once, run serially and under ``mpiexec -n 2 python -m pytest -m mpi``.
"""
import os

import pytest

from conftest import on_root
from helpers import assert_same_sample, h5py_sample, make_dataset
from solar.io import read_sample
from solar.layout import load_layout

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("storage", ["contiguous", "lzf"])
def test_ranks_agree_and_read_their_share(comm, shared_tmp, storage):
    out = on_root(comm, lambda: make_dataset(shared_tmp, "ptychonn", storage, samples=11))
    layout = load_layout(out)
    fps = comm.allgather(layout.fingerprint)
    assert len(set(fps)) == 1
    fd = os.open(layout.files[0], os.O_RDONLY)
    checked = 0
    try:
        for i in range(comm.rank, layout.n_samples, comm.size):
            assert_same_sample(read_sample(layout, i, {0: fd}), h5py_sample(layout, i))
            checked += 1
    finally:
        os.close(fd)
    assert comm.allreduce(checked) == layout.n_samples
