"""The examples' training step does not wait for the device (examples/step.py).

Stand-in for a GPU: the ``meta`` device.  Its tensors have shapes and dtypes but no values, so every way
a step could read a device value back to the host (``.item()``, ``float()``, ``bool()``, ``.cpu()``,
``.tolist()``, ``.numpy()``, a blocking ``.to("cpu")``) raises there.  A step that runs to the end on
``meta`` queued its work without one host synchronisation; the losses reach the host only through
``StepLosses.flush``, which the loop calls every ``--log-every`` steps and at the epoch's end.
"""
import os

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
META = torch.device("meta")


@pytest.fixture(autouse=True)
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)


class Args:
    width, depth, data = 8, 2, "unused"
    fields = None


def _ptycho_task(memory_format=torch.contiguous_format):
    import train_ptychonn as tp
    task = tp.Ptycho()
    args = Args()
    args.fields = list(tp.FIELDS)
    task.configure(args)
    task.stats = {f: (torch.zeros(1, 16, 16), torch.ones(1, 16, 16)) for f in task.fields}
    task.memory_format = memory_format
    return task, tp.PtychoNNLike(8, 2)


class BlockingCopies(TorchFunctionMode):
    """Records copies from host memory to a device that are not ``non_blocking`` (``.to``, ``.cuda``, ``copy_``,
    ``torch.tensor(..., device=)``): on a GPU each one waits until the device has run all queued work.  The meta
    stand-in lets them pass silently, so they are counted here."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("to", "cuda") and args and torch.is_tensor(args[0]) and args[0].device.type == "cpu":
            if name == "cuda":
                self.seen.append(name)
            else:
                dev, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
                if dev is not None and dev.type != "cpu" and not non_blocking:
                    self.seen.append(f"to({dev})")
        elif name == "copy_" and len(args) > 1 and args[1].device.type == "cpu" and args[0].device.type != "cpu":
            if not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)):
                self.seen.append("copy_")
        elif name in ("tensor", "as_tensor") and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type != "cpu":
            self.seen.append(name)
        return func(*args, **kwargs)


def test_meta_tensors_refuse_every_host_read():
    """The stand-in is strict: each way of reading a value back raises (so the step test can fail)."""
    x = torch.ones(3, device=META)
    for read in (lambda: x[0].item(), lambda: float(x[0]), lambda: bool(x[0] > 0), lambda: x.cpu(),
                 lambda: x.tolist(), lambda: x.numpy(), lambda: x.to("cpu"), lambda: int(x.sum())):
        with pytest.raises((RuntimeError, NotImplementedError, TypeError)):
            read()


@pytest.mark.parametrize("channels_last", [False, True])
def test_ptychonn_step_never_reads_the_device(channels_last):
    import step
    p = step.Precision(channels_last=channels_last)
    task, model = _ptycho_task(p.memory_format)
    model = model.to(META, memory_format=p.memory_format)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = {f: torch.empty(4, 16, 16, 1, device=META) for f in task.fields}
    batch["index"] = torch.arange(4)  # sample ids stay on the host
    step.train_step(task, model, opt, batch, META, 1.0, p)  # the first step copies the statistics over, once
    with BlockingCopies() as copies:
        for _ in range(3):
            parts, sums = step.train_step(task, model, opt, batch, META, 1.0, p)
    assert copies.seen == []
    assert parts == ("amplitude", "phase")
    assert sums.device.type == "meta" and sums.shape == (3,) and sums.dtype == torch.float64


def test_blocking_copies_are_counted():
    """The counter sees what the examples did before: the statistics copied to the device at every step."""
    with BlockingCopies() as copies:
        torch.zeros(3).to(META)
        torch.zeros(3).to(META, non_blocking=True)
        torch.empty(3, device=META).copy_(torch.zeros(3))
        torch.tensor([1.0], device=META)
    assert copies.seen == ["to(meta)", "copy_", "tensor"]


def test_a_step_that_reads_its_loss_fails_on_the_stand_in():
    """What the examples did before (``float(loss.sum())`` inside the step) is caught by the same stand-in."""
    import step
    task, model = _ptycho_task()
    model = model.to(META)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = {f: torch.empty(4, 16, 16, 1, device=META) for f in task.fields}

    class Reads:
        def __init__(self, inner):
            self.inner = inner

        def losses(self, *a, **kw):
            per = self.inner.losses(*a, **kw)
            float(sum(per.values()).detach().sum())  # a per-step host read
            return per

    with pytest.raises(RuntimeError, match="meta"):
        step.train_step(Reads(task), model, opt, batch, META, 1.0, step.Precision())


def test_well_step_never_reads_the_device(tmp_path):
    """train_well.py's task takes CPU batches (WellTransform runs on the host) and moves the frames itself."""
    import step
    import train_well
    from helpers import make_dataset
    data = make_dataset(tmp_path, "well", samples=2, size=8, steps=12)

    class WArgs:
        width, blocks, valid, valid_split = 8, 1, None, None
    WArgs.data = data
    task = train_well.Well()
    task.setup(WArgs, None)
    model = task.model(WArgs).to(META)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    import trainer
    read, _, ds = trainer.sample_reader(data)
    try:
        batch = read(np.arange(4))
    finally:
        ds.close()
    batch["index"] = torch.arange(4)
    parts, sums = step.train_step(task, model, opt, batch, META, 1.0, step.Precision())
    assert parts == ("next frame",) and sums.device.type == "meta"


def test_sorted_batch_reorders_on_the_device_without_reading_it():
    import step
    ids = np.array([5, 2, 9, 1])
    batch = {"x": torch.empty(4, 3, device=META), "index": torch.from_numpy(ids), "weight": 1.0}
    out, got = step.sorted_batch(batch, ids)
    assert got.tolist() == [1, 2, 5, 9] and out["x"].device.type == "meta" and out["x"].shape == (4, 3)
    assert out["index"].tolist() == [1, 2, 5, 9]  # the host ids, reordered on the host
    cpu = {"x": torch.arange(4.0)[:, None] * torch.ones(1, 3)}
    out, _ = step.sorted_batch(cpu, ids)
    assert out["x"][:, 0].tolist() == [3.0, 1.0, 0.0, 2.0]


def test_step_losses_read_back_every_n_steps_the_same_values():
    import step
    log = step.StepLosses(every=3)
    eager = []
    due = []
    for s in range(7):
        v = torch.tensor([s * 1.5, s, 0.5 * s], dtype=torch.float64)
        eager.append(v.numpy().copy())
        log.add(s, np.array([s]), 2, v)
        due.append(log.due)
        if log.due:
            rows = log.flush()
            assert [r[0] for r in rows] == list(range(s - 2, s + 1))
    assert due == [False, False, True, False, False, True, False]
    rest = log.flush()
    assert [r[0] for r in rest] == [6] and np.array_equal(rest[0][3], eager[6]) and log.flush() == []
    with pytest.raises(ValueError):
        step.StepLosses(0)


def test_precision_from_arguments():
    import argparse

    import step
    p = argparse.ArgumentParser()
    step.add_args(p)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    a = p.parse_args([])
    assert step.precision_from_args(a, cuda) == step.Precision("bf16", True)
    assert step.precision_from_args(a, cpu) == step.Precision("none", False)
    a = p.parse_args(["--amp", "none", "--no-channels-last", "--compile", "--deterministic"])
    assert step.precision_from_args(a, cuda) == step.Precision("none", False, True, True)
    a = p.parse_args(["--amp", "bf16", "--channels-last"])
    assert step.precision_from_args(a, cpu) == step.Precision("bf16", True)
    with pytest.raises(ValueError, match="amp"):
        step.Precision("fp8")


def test_cores_split_between_torch_and_the_loader():
    import trainer
    assert trainer.split_cores(16, cuda=True, threads=None, loader_cpus=None) == (1, 15)
    assert trainer.split_cores(1, cuda=True, threads=None, loader_cpus=None) == (1, 1)
    assert trainer.split_cores(8, cuda=False, threads=None, loader_cpus=None) == (7, 1)
    assert trainer.split_cores(1, cuda=False, threads=None, loader_cpus=None) == (1, 1)
    assert trainer.split_cores(8, cuda=False, threads=3, loader_cpus=2) == (3, 2)
    assert trainer.split_cores(8, cuda=True, threads=None, loader_cpus=4) == (1, 4)
