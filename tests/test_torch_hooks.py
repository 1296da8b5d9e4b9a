"""SolarLoader's hooks: ``fields=`` (a subset with an existing plan), ``transform=`` (per batch) and
``sample_transform=`` (per sample) run off the training thread, their errors reach the training
loop with the cause; ``pin_memory=True`` without CUDA warns once; one INFO line per epoch on the
``solar`` logger (no handler installed)."""
import logging
import os
import threading
import warnings

import numpy as np
import pytest
import torch

import solar
from solar.io import read_block
from solar.loader import BatchAssembler, SolarLoader
from solar.loader.hooks import TransformError

from helpers import h5py_sample, make_dataset

RANK = 1


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A 2-rank, 2-epoch plan of 12 samples of ptychonn (gzip, 3 samples per chunk) and rank 1's
    reference batches [(sample ids, {field: tensor})] through a loader without hooks."""
    root = tmp_path_factory.mktemp("hooks")
    data = make_dataset(root, "ptychonn", "gzip", samples=12, size=8)
    path = str(root / "plan.h5")
    solar.plan(data, world_size=2, local_batch=2, epochs=2, buffer_per_rank=8 * 4608, out=path).close()
    with SolarLoader(path, data, rank=RANK) as loader:
        ref = [(b["index"].tolist(), {k: v.clone() for k, v in b.items() if k not in ("index", "weight")})
               for e in range(2) for b in _epoch(loader, e)]
    return path, data, ref


def _epoch(loader, e):
    loader.set_epoch(e)
    return list(loader)


def _all(loader):
    return [b for e in range(loader.epochs) for b in _epoch(loader, e)]


def test_fields_subset_of_an_existing_plan(job):
    path, data, ref = job
    with SolarLoader(path, data, rank=RANK, fields=["Y_phi_train"]) as loader:
        got = _all(loader)
    assert [b["index"].tolist() for b in got] == [ids for ids, _ in ref]
    for b, (_, want) in zip(got, ref):
        assert set(b) == {"Y_phi_train", "index", "weight"}
        assert torch.equal(b["Y_phi_train"], want["Y_phi_train"])


def test_per_block_path_looks_up_only_the_fields_asked_for(job):
    """(The loader test above takes the one-call gather path, whose tables are restricted.)"""
    _, data, _ = job
    lay = solar.load_layout(data)
    keep = lay.field_names[1:]
    asked = []
    fd = os.open(lay.files[0], os.O_RDONLY)

    def lookup(b):
        asked.append(b)
        return read_block(lay, b, fd).view(np.uint8).reshape(-1)

    try:
        asm = BatchAssembler(lay, gather=False, fields=list(reversed(keep)))
        out = asm(0, np.array([4, 1]), lookup)
    finally:
        os.close(fd)
    assert asm.fields == keep and list(out) == list(keep)  # the spec's order
    for i, s in enumerate([4, 1]):
        want = h5py_sample(lay, s)
        for k in keep:
            np.testing.assert_array_equal(out[k][i], want[k])
    assert asked and {lay.datasets[lay.block_dataset[b]].name.strip("/") for b in asked} == set(keep)


def test_unknown_field_lists_the_valid_ones(job):
    path, data, _ = job
    with pytest.raises(solar.SpecError, match=r"unknown field\(s\) 'nope'; the spec's fields: X_train, Y_I_train, "
                                              r"Y_phi_train"):
        SolarLoader(path, data, rank=RANK, fields=["X_train", "nope"])


def test_transforms_run_off_the_training_thread(job):
    path, data, ref = job
    threads = set()

    def per_sample(s):
        threads.add(threading.current_thread().name)
        return {"x": s["X_train"].float().sum().reshape(1), "y": s["Y_I_train"]}

    def per_batch(b):
        threads.add(threading.current_thread().name)
        return {**b, "y2": b["y"] * 2}

    with SolarLoader(path, data, rank=RANK, sample_transform=per_sample, transform=per_batch) as loader:
        got = _all(loader)
    assert threading.current_thread().name not in threads and all(t.startswith("solar-prefetch") for t in threads)
    for b, (ids, want) in zip(got, ref):
        assert b["index"].tolist() == ids and b["x"].shape == (len(ids), 1)
        assert torch.equal(b["x"][:, 0], want["X_train"].float().sum(dim=(1, 2, 3)))
        assert torch.equal(b["y2"], want["Y_I_train"] * 2)


def test_transform_error_reaches_the_loop_with_its_cause(job):
    path, data, _ = job

    def bad(batch):
        raise ValueError("no negative intensities")

    with SolarLoader(path, data, rank=RANK, transform=bad) as loader:
        with pytest.raises(TransformError, match="transform failed on step 0: ValueError: no negative") as err:
            next(iter(loader))
    assert isinstance(err.value, solar.SolarError) and isinstance(err.value.__cause__, ValueError)
    with pytest.raises(solar.SpecError, match="transform must be a callable"):
        SolarLoader(path, data, rank=RANK, transform="normalise")


def test_sample_transform_must_return_a_dict(job):
    path, data, _ = job
    with SolarLoader(path, data, rank=RANK, sample_transform=lambda s: s["X_train"]) as loader:
        with pytest.raises(TransformError, match="sample_transform must return a dict, got Tensor"):
            next(iter(loader))


def test_pin_memory_without_cuda_warns_once(job):
    path, data, ref = job
    if torch.cuda.is_available():
        pytest.skip("CUDA is there: memory is pinned")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for _ in range(2):
            with SolarLoader(path, data, rank=RANK, pin_memory=True) as loader:
                got = _epoch(loader, 0)
    msgs = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert msgs == ["pin_memory=True, but CUDA is not available: batches are in ordinary (pageable) memory"]
    assert [b["index"].tolist() for b in got] == [ids for ids, _ in ref[:len(got)]]


def test_one_info_line_per_epoch_and_no_handler(job, caplog):
    path, data, _ = job
    caplog.set_level(logging.INFO, logger="solar")
    with SolarLoader(path, data, rank=RANK) as loader:
        _all(loader)
        last = loader.epoch_log.last
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("solar")]
    assert len(lines) == 2, lines
    for e, line in enumerate(lines):
        assert line.startswith(f"rank {RANK} epoch {e}: 3 steps, 6 samples in ")
        assert "samples/s), hit rate " in line and ", stall " in line
    assert last["epoch"] == 1 and last["samples"] == 6 and 0.0 <= last["hit_rate"] <= 1.0
    assert logging.getLogger("solar").handlers == [] and logging.getLogger("solar.loader").handlers == []


def test_hooks_on_ragged_layouts_and_lists_from_a_transform(tmp_path):
    """Review finding: with a hook the batch was converted to torch twice (a ragged field's list of tensors,
    or a transform's list of strings, raised TypeError in the loop); a transform dropping "index" gave KeyError."""
    import json

    import h5py

    from solar.schedule import plan
    for i, n in enumerate([4, 6, 8]):
        with h5py.File(tmp_path / f"f{i}.h5", "w") as f:
            f["x"] = np.arange(n * 3, dtype="f4").reshape(n, 3) + i
    json.dump({"solar_layout_spec": 1, "kind": "whole", "files": ["f*.h5"], "fields": ["x"]},
              open(tmp_path / "solar-layout.json", "w"))
    plan(str(tmp_path), world_size=1, local_batch=2, epochs=1, buffer_fraction=1.0,
         out=str(tmp_path / "p.h5")).close()
    hooks = [dict(transform=lambda b: b), dict(transform=lambda b: {**b, "tags": ["a"] * len(b["index"])}),
             dict(transform=lambda b: {"x": b["x"]})]
    for kw in hooks:
        with SolarLoader(str(tmp_path / "p.h5"), rank=0, **kw) as loader:
            batches = list(loader)
        got = sorted(int(i) for b in batches for i in b["index"])
        assert got == [0, 1, 2]
        for b in batches:
            assert isinstance(b["x"], list) and all(isinstance(t, torch.Tensor) for t in b["x"])
            assert b["weight"] == 1.0
            for t, i in zip(b["x"], b["index"].tolist()):
                with h5py.File(tmp_path / f"f{i}.h5") as f:
                    assert np.array_equal(t.numpy(), f["x"][()])


def _labelled(folder):
    """A rows layout with a scalar field per sample (a label) beside an array field."""
    import json
    import h5py
    with h5py.File(os.path.join(folder, "d.h5"), "w") as f:
        f.create_dataset("x", data=np.arange(12, dtype="f4").reshape(6, 2))
        f.create_dataset("label", data=np.arange(6, dtype="i8") * 10)
    with open(os.path.join(folder, "solar-layout.json"), "w") as f:
        json.dump({"solar_layout_spec": 1, "kind": "rows", "files": ["d.h5"], "fields": ["x", "label"]}, f)
    return str(folder)


@pytest.mark.parametrize("as_torch", [False, True])
def test_sample_transform_keeps_a_scalar_field_a_batch_array(tmp_path, as_torch):
    """A sample_transform saw a scalar field as a numpy scalar, and the batch came back as a list of them."""
    data = _labelled(tmp_path)
    sched = solar.plan(data, world_size=1, local_batch=3, epochs=1, buffer_fraction=1.0)
    with SolarLoader(sched, rank=0, as_torch=as_torch, sample_transform=lambda s: dict(s)) as loader:
        batch = next(iter(loader))
    label = batch["label"]
    assert isinstance(label, torch.Tensor if as_torch else np.ndarray) and tuple(label.shape) == (3,)
    assert [int(v) for v in label] == [10 * int(i) for i in batch["index"]]
