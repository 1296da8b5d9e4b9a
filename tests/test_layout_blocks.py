"""Block maps: shared blocks, windows, roles, filters and inspect's numbers, checked by hand."""
import os

import h5py
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from solar.io import read_sample
from solar.layout import LayoutSpec, build_layout, detect_spec, field_chunk_lists, load_layout
from solar.layout.summary import summarize
from helpers import assert_same_sample, h5py_sample, make_dataset


def _roundtrip_all(layout):
    fds = {i: os.open(p, os.O_RDONLY) for i, p in enumerate(layout.files)}
    try:
        for i in range(layout.n_samples):
            assert_same_sample(read_sample(layout, i, fds), h5py_sample(layout, i))
    finally:
        for fd in fds.values():
            os.close(fd)


def test_co_chunk_samples_share_block_ids(tmp_path):
    lay = load_layout(make_dataset(tmp_path, "ptychonn", "gzip", samples=9))  # 3 samples per chunk
    assert [list(lay.blocks_of(i)) for i in (0, 1, 2)] == [[0, 3, 6]] * 3
    assert list(lay.blocks_of(3)) == [1, 4, 7]


def test_overlapping_windows_share_frames(tmp_path):
    lay = load_layout(make_dataset(tmp_path, "well", "contiguous", steps=9))
    # 9 steps, 5-frame windows: 5 windows per trajectory, 2 trajectories per file, 3 fields
    assert lay.n_samples == 2 * 2 * 5
    b0, b1 = set(lay.blocks_of(0)), set(lay.blocks_of(1))
    assert len(b0) == 15 and len(b0 & b1) == 12  # 4 of 5 frames shared, for each of 3 fields
    assert len(set(lay.blocks_of(0)) & set(lay.blocks_of(5))) == 0  # next trajectory


def test_inspect_amplification_by_hand(tmp_path):
    """gzip, 3 samples per chunk: every per-sample read decodes 3x what it uses."""
    out = make_dataset(tmp_path, "ptychonn", "gzip", samples=12)
    s = summarize(load_layout(out))
    assert s["read_amplification"] == pytest.approx(3.0)
    # by hand: stored bytes of every chunk, each read once per sample in it
    stored, used = 0, 0
    with h5py.File(os.path.join(out, "ptychonn.h5"), "r") as f:
        for name in ("X_train", "Y_I_train", "Y_phi_train"):
            d = f[name]
            for i in range(d.id.get_num_chunks()):
                stored += 3 * d.id.get_chunk_info(i).size
            used += d.size * d.dtype.itemsize
    assert s["storage_amplification"] == pytest.approx(stored / used)
    assert s["samples_per_block"] == pytest.approx(3.0)
    assert s["blocks_per_sample"] == {"min": 3, "mean": 3.0, "max": 3}


def test_contiguous_amplification_is_one(tmp_path):
    s = summarize(load_layout(make_dataset(tmp_path, "ptychonn", "contiguous")))
    assert s["read_amplification"] == 1.0 and s["storage_amplification"] == 1.0


def test_well_roles_static_fields_and_stride(tmp_path):
    """Fields without trajectory or time axis (The Well attrs), windows with dt=2, chunked in time."""
    rng = np.random.default_rng(0)
    path = tmp_path / "w.hdf5"
    with h5py.File(path, "w") as f:
        g = f.create_group("t0_fields")
        specs = {"u": ((3, 11, 4, 5), True, True), "mask": ((4, 5), False, False),
                 "forcing": ((11, 4, 5), False, True), "param": ((3, 4, 5), True, False)}
        for name, (shape, sv, tv) in specs.items():
            d = g.create_dataset(name, data=rng.standard_normal(shape).astype("f4"),
                                 chunks=tuple(min(2, s) for s in shape), compression="gzip")
            d.attrs["sample_varying"], d.attrs["time_varying"] = sv, tv
    spec = LayoutSpec("windows", ("w.hdf5",), tuple(f"t0_fields/{n}" for n in specs), root=str(tmp_path),
                      n_steps_input=2, n_steps_output=1, dt=2)
    lay = build_layout(spec)
    assert lay.n_samples == 3 * (11 - 4)
    shapes = lay.field_shapes()
    assert shapes == {"t0_fields/u": (3, 4, 5), "t0_fields/mask": (4, 5), "t0_fields/forcing": (3, 4, 5),
                      "t0_fields/param": (4, 5)}
    _roundtrip_all(lay)


def test_filter_mask_incompressible_chunk_and_checksums(tmp_path):
    """lzf gives up on white noise (chunk stored raw, mask bit set); fletcher32 is verified."""
    rng = np.random.default_rng(1)
    path = tmp_path / "f.h5"
    smooth = np.repeat(np.arange(24, dtype="f8"), 16).reshape(24, 16)
    with h5py.File(path, "w") as f:
        f.create_dataset("noise", data=rng.integers(0, 255, (24, 16), dtype="u1"), chunks=(4, 16),
                         compression="lzf")
        f.create_dataset("ck", data=smooth, chunks=(3, 16), shuffle=True, compression="gzip", fletcher32=True)
        f.create_dataset("be", data=smooth.astype(">i4"), chunks=(5, 8), fletcher32=True)
        f.create_dataset("odd", data=np.arange(24 * 3, dtype="u1").reshape(24, 3), chunks=(7, 3), fletcher32=True)
    lay = build_layout(LayoutSpec("rows", ("f.h5",), ("noise", "ck", "be", "odd"), root=str(tmp_path)))
    noise = lay.datasets[0]
    lo, hi = lay.dataset_block_start[0], lay.dataset_block_start[1]
    assert (lay.block_mask[lo:hi] != 0).any(), "expected lzf to skip incompressible chunks"
    assert noise.filters[0].name == "lzf"
    _roundtrip_all(lay)
    # a flipped byte in a checksummed chunk is caught
    from solar.errors import DecodeError
    from solar.io import read_block
    b = int(lay.blocks_of(0)[3])  # "odd": chunk of rows 0..6
    with open(path, "r+b") as fh:
        fh.seek(int(lay.block_offset[b]))
        fh.write(b"\xff")  # the chunk starts with byte 0
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(DecodeError, match="fletcher32 decode failed: Fletcher-32 checksum mismatch"):
            read_block(lay, b, fd)
    finally:
        os.close(fd)


def test_unwritten_chunks_read_as_fill_value(tmp_path):
    with h5py.File(tmp_path / "u.h5", "w") as f:
        d = f.create_dataset("X", shape=(8, 3), dtype="i2", chunks=(2, 3), fillvalue=-7)
        d[0:2] = 1
        d[6:8] = 2
    lay = build_layout(LayoutSpec("rows", ("u.h5",), ("X",), root=str(tmp_path)))
    assert (lay.block_offset < 0).sum() == 2
    _roundtrip_all(lay)


def test_detect_spec(tmp_path):
    out = make_dataset(tmp_path, "pdebench", "contiguous")
    spec = detect_spec(os.path.join(out, "2D_CFD_Rand_M0.1_Eta0.01_Zeta0.01_periodic_Train.hdf5"))
    assert spec.kind == "rows" and set(spec.fields) == {"density", "pressure", "Vx", "Vy"}
    out = make_dataset(tmp_path, "pdebench-mult", "contiguous")
    spec = detect_spec(os.path.join(out, "2D_diff-react_NA_NA.h5"))
    assert (spec.kind, spec.groups, spec.fields) == ("whole", "*", ("data",))
    out = make_dataset(tmp_path, "well")
    f = sorted(os.listdir(os.path.join(out, "turbulent_radiative_layer_2D/data/train")))[0]
    spec = detect_spec(os.path.join(out, "turbulent_radiative_layer_2D/data/train", f))
    assert spec.kind == "windows" and spec.fields == LayoutSpec.load(out).fields


def test_fingerprint_changes_with_data(tmp_path):
    out = make_dataset(tmp_path, "ptychonn", "contiguous")
    a = load_layout(out).fingerprint
    assert load_layout(out).fingerprint == a
    path = os.path.join(out, "ptychonn.h5")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert load_layout(out).fingerprint != a


def _brute_chunks(shape, chunks, roles, index, t0, window, dt):
    """Reference: enumerate every element the sample selects, collect its chunk."""
    grid = [-(-s // c) for s, c in zip(shape, chunks)]
    per_axis = []
    for a, n in enumerate(shape):
        r = roles[a] if a < len(roles) else ""
        if r in "sb" and r:
            per_axis.append({index // chunks[a]})
        elif r == "t":
            per_axis.append({(t0 + dt * j) // chunks[a] for j in range(window)})
        else:
            per_axis.append(set(range(grid[a])))
    import itertools
    return sorted(int(np.ravel_multi_index(c, grid)) for c in itertools.product(*map(sorted, per_axis)))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_field_chunk_lists_match_brute_force(data):
    roles = data.draw(st.sampled_from(["", "s", "b", "t", "bt"]))
    ndim = data.draw(st.integers(max(1, len(roles)), 4))
    shape = [data.draw(st.integers(1, 9)) for _ in range(ndim)]
    chunks = [data.draw(st.integers(1, s)) for s in shape]
    window, dt = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3))
    t_ax = roles.find("t")
    if t_ax >= 0:
        shape[t_ax] = max(shape[t_ax], dt * (window - 1) + 1)
        chunks[t_ax] = min(chunks[t_ax], shape[t_ax])
    S = data.draw(st.integers(1, 6))
    index = np.array([data.draw(st.integers(0, shape[0] - 1)) for _ in range(S)])
    t0 = None
    if t_ax >= 0:
        t0 = np.array([data.draw(st.integers(0, shape[t_ax] - dt * (window - 1) - 1)) for _ in range(S)])
    counts, lin = field_chunk_lists(shape, chunks, roles, index, t0, window, dt, n_samples=S)
    pos = 0
    for i in range(S):
        got = sorted(lin[pos:pos + counts[i]].tolist())
        pos += counts[i]
        assert got == _brute_chunks(shape, chunks, roles, int(index[i]), None if t0 is None else int(t0[i]),
                                    window, dt)
    assert pos == len(lin)
