"""solar.torch.H5Dataset: map-style, unshuffled evaluation over a split through solar's block
readers; every sample equals h5py's read of it, through DataLoader with workers too; fields,
transform, the h5py fallback, sharding over ranks; exported lazily from ``solar``."""
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import solar
from solar.torch import H5Dataset, shard_range

from helpers import h5py_sample, make_dataset

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 2-core machines


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("h5ds")
    return {"gzip": make_dataset(root, "ptychonn", "gzip", samples=10, size=8),
            "well": make_dataset(root, "well", "multi")}


def _assert_equal_h5py(ds, layout, ids):
    for i in ids:
        got, want = ds[i], h5py_sample(layout, i)
        assert got["index"] == i
        for k in ds.fields:
            assert got[k].numpy().dtype == want[k].dtype.newbyteorder("=")
            np.testing.assert_array_equal(got[k].numpy(), want[k], err_msg=f"{k} of sample {i}")


@pytest.mark.parametrize("name,split", [("gzip", None), ("well", None), ("well", "valid"), ("well", "test")])
def test_every_sample_equals_h5py(datasets, name, split):
    ds = H5Dataset(datasets[name], split=split)
    layout = solar.load_layout(datasets[name], split=split)
    assert len(ds) == layout.n_samples and ds.reader_name == "pread"
    if split:
        assert all(f"/data/{split}/" in p for p in ds.layout.files)
    _assert_equal_h5py(ds, layout, range(len(ds)))
    with pytest.raises(IndexError, match=f"sample {len(ds)} out of range"):
        ds[len(ds)]


def test_h5py_fallback_reader_gives_the_same_bytes(datasets):
    ds = H5Dataset(datasets["gzip"], reader="h5py")
    _assert_equal_h5py(ds, ds.layout, range(len(ds)))


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_with_workers_in_order(datasets, workers):
    ds = H5Dataset(datasets["well"], split="valid")
    want = [h5py_sample(ds.layout, i) for i in range(len(ds))]
    got = list(DataLoader(ds, batch_size=3, num_workers=workers))
    assert torch.cat([b["index"] for b in got]).tolist() == list(range(len(ds)))
    for k in ds.fields:
        np.testing.assert_array_equal(torch.cat([b[k] for b in got]).numpy(), np.stack([w[k] for w in want]))


def test_fields_read_only_their_blocks_and_transform(datasets):
    ds = H5Dataset(datasets["gzip"], fields=["Y_I_train"], transform=lambda s: {"y": s["Y_I_train"] * 2})
    read = []
    reader = ds._open_reader()
    orig = reader.read_blocks
    reader.read_blocks = lambda blocks, out: (read.extend(np.asarray(blocks).tolist()), orig(blocks, out))[1]
    got = ds[3]
    assert set(got) == {"y", "index"} and got["index"] == 3
    np.testing.assert_array_equal(got["y"].numpy(), h5py_sample(ds.layout, 3)["Y_I_train"] * 2)
    assert read and {ds.layout.datasets[ds.layout.block_dataset[b]].name.strip("/") for b in read} == {"Y_I_train"}
    with pytest.raises(solar.SpecError, match=r"unknown field\(s\) 'Y'; the spec's fields: X_train, Y_I_train"):
        H5Dataset(datasets["gzip"], fields=["Y"])
    with pytest.raises(solar.SpecError, match="unknown split 'val'; the spec's splits: train, valid, test"):
        H5Dataset(datasets["well"], split="val")
    with pytest.raises(solar.SpecError, match="unknown reader 'posix'"):
        H5Dataset(datasets["gzip"], reader="posix")


def test_shards_cover_every_sample_once():
    for n in (0, 1, 7, 10):
        for w in (1, 3, 4):
            parts = [list(shard_range(n, r, w)) for r in range(w)]
            assert sum(parts, []) == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(solar.SpecError, match="rank 3 out of range"):
        shard_range(10, 3, 3)


def test_shard_subset_and_launcher_default(datasets, monkeypatch):
    ds = H5Dataset(datasets["gzip"])
    assert list(ds.shard(rank=1, world_size=3).indices) == [3, 4, 5]
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    sub = ds.shard()
    assert list(sub.indices) == [5, 6, 7, 8, 9] and sub[0]["index"] == 5


def test_exported_lazily():
    assert solar.H5Dataset is H5Dataset
    code = "import sys, solar; assert 'torch' not in sys.modules and 'solar.torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_scalar_field_keeps_its_shape(tmp_path):
    """A label (one value per sample) came out of shape (1,), so a DataLoader batch was (B, 1) where SolarLoader
    gives (B,): a loss against a (B,) prediction then broadcast to (B, B) without an error."""
    import json
    import h5py
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f.create_dataset("x", data=np.arange(12, dtype="f4").reshape(6, 2))
        f.create_dataset("label", data=np.arange(6, dtype="i8") * 10)
    (tmp_path / "solar-layout.json").write_text(json.dumps(
        {"solar_layout_spec": 1, "kind": "rows", "files": ["d.h5"], "fields": ["x", "label"]}))
    ds = H5Dataset(str(tmp_path))
    s = ds[2]
    assert s["label"].shape == () and int(s["label"]) == 20 and s["x"].shape == (2,)
    batch = next(iter(DataLoader(ds, batch_size=3)))
    assert batch["label"].shape == (3,) and batch["x"].shape == (3, 2)
