"""solar.torch.SolarDataset under torch's DataLoader: every planned batch exactly once, in plan
order, for num_workers 0..4 (fork and spawn), with the rank's one buffer in the main process;
set_epoch / len / state_dict as SolarLoader's; `import solar` stays free of torch."""
import os
import pickle
import subprocess
import sys
import threading

import pytest
import torch
from torch.utils.data import DataLoader

import solar
from solar.loader import SolarLoader
from solar.torch import SolarDataset, _StepRef

from helpers import make_dataset

RANK = 1
pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),  # 2-core machines
              pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")]  # no GPU


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A 2-rank, 2-epoch plan of 30 samples (local batch 2: 8 steps per epoch) and its reference:
    [(global step, sample ids, first field's tensor)] of rank 1 through SolarLoader directly."""
    root = tmp_path_factory.mktemp("torchds")
    data = make_dataset(root, "ptychonn", "chunked", samples=30)
    path = str(root / "plan.h5")
    solar.plan(data, world_size=2, local_batch=2, epochs=2, buffer_fraction=0.4, out=path).close()
    ref = []
    with SolarLoader(path, data, rank=RANK) as loader:
        for e in range(loader.epochs):
            loader.set_epoch(e)
            ref += [(loader.cursor - 1, b["index"].tolist(), b["X_train"].clone()) for b in loader]
    return path, data, ref


def epochs(ds, dl):
    """The documented epoch loop over DataLoader ``dl`` of ``ds``: [(step, ids, X_train)]."""
    out = []
    for e in range(ds.epoch, ds.epochs):
        ds.set_epoch(e)
        out += [(b["step"], b["index"].tolist(), b["X_train"]) for b in dl]
    return out


def assert_same(got, ref):
    assert [(g, ids) for g, ids, _ in got] == [(g, ids) for g, ids, _ in ref]
    for (_, _, a), (_, _, b) in zip(got, ref):
        assert torch.equal(a, b)


def batches(ds, **kw):
    """DataLoader over ``ds`` as the docs use it."""
    return DataLoader(ds, batch_size=None, **kw)


@pytest.mark.parametrize("workers", [0, 1, 2, 3, 4])
def test_each_batch_once_in_plan_order_one_buffer(job, workers, tmp_path, monkeypatch):
    path, data, ref = job
    log = tmp_path / "buffers"
    start = SolarLoader._start_buffer

    def logged_start(self):  # every buffer started, by process id (inherited by forked workers)
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        start(self)

    monkeypatch.setattr(SolarLoader, "_start_buffer", logged_start)
    with SolarDataset(path, data, rank=RANK) as ds:
        assert len(ds) == 8
        got = epochs(ds, batches(ds, num_workers=workers, pin_memory=True))
        assert ds.stats()["steps"] > 0
    assert_same(got, ref)
    assert log.read_text().split() == [str(os.getpid())]  # one buffer for both epochs, in this process


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_process_behind_the_dataset(job, workers):
    """``SolarDataset(..., process=True)``: the loader in a process of its own, forked DataLoader workers handing
    out step references as ever; the batches are the in-process loader's."""
    path, data, ref = job
    with SolarDataset(path, data, rank=RANK, process=True) as ds:
        assert ds.loader._proc is not None
        got = epochs(ds, batches(ds, num_workers=workers))
        child = ds.loader._proc.proc
    assert_same(got, ref)
    assert child.returncode == 0


@pytest.mark.slow  # starts processes that import torch
def test_spawned_workers(job):
    """Spawned workers get a pickled copy without the loader (one pass: each worker imports torch)."""
    path, data, ref = job
    with SolarDataset(path, data, rank=RANK) as ds:
        ds.set_epoch(1)
        dl = batches(ds, num_workers=2, multiprocessing_context="spawn")
        got = [(b["step"], b["index"].tolist(), b["X_train"]) for b in dl]
    assert_same(got, ref[8:])


def test_wraps_a_loader_and_exports(job):
    path, data, ref = job
    with SolarDataset(SolarLoader(path, data, rank=RANK)) as ds:
        assert_same(epochs(ds, ds), ref)
    assert solar.SolarLoader is SolarLoader and solar.SolarDataset is SolarDataset
    with pytest.raises(solar.SpecError, match="takes no other arguments"):
        SolarDataset(SolarLoader(path, data, rank=RANK), data)
    code = "import sys, solar; assert 'torch' not in sys.modules and 'solar.loader' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_resume_without_workers_is_exact(job):
    path, data, ref = job
    with SolarDataset(path, data, rank=RANK) as ds:
        it = iter(batches(ds, num_workers=0))
        seen = [next(it) for _ in range(3)]
        state = ds.state_dict()
    assert state["step"] == 3 and [b["step"] for b in seen] == [0, 1, 2]
    with SolarDataset(path, data, rank=RANK) as ds:
        ds.load_state_dict(state)
        assert ds.epoch == 0
        assert_same(epochs(ds, batches(ds, num_workers=2)), ref[3:])


def test_mid_epoch_state_with_workers_needs_the_step(job):
    path, data, ref = job
    with SolarDataset(path, data, rank=RANK) as ds:
        it = iter(batches(ds, num_workers=2))
        batch = next(it)
        batch = next(it)
        with pytest.raises(solar.SolarError, match=r"state_dict\(step=batch\['step'\] \+ 1\)"):
            ds.state_dict()
        with pytest.raises(solar.SpecError, match="step must be an integer in"):
            ds.state_dict(step=99)
        state = ds.state_dict(step=batch["step"] + 1)
        del it
    with SolarDataset(path, data, rank=RANK) as ds:
        ds.load_state_dict(state)
        assert_same(epochs(ds, batches(ds, num_workers=3)), ref[2:])


def test_state_with_workers_near_an_epochs_end_is_never_ahead_of_the_loop(job, monkeypatch):
    """Worker 0 is slow to send its last step (6 of 8), so DataLoader receives step 7 first and the main process
    takes steps 6 and 7 from the buffer (fetched = the epoch's end) while the loop has trained steps 0..6.  The
    state must not claim step 8 (the old rule, "fetched to an epoch's end: trained to it", skipped step 7)."""
    import time
    refs = SolarDataset._references

    def slow(self, worker, workers):  # forked workers inherit the patch
        for k, r in enumerate(refs(self, worker, workers)):
            if worker == 0 and k == 3:
                time.sleep(0.5)
            yield r
    monkeypatch.setattr(SolarDataset, "_references", slow)
    path, data, ref = job
    with SolarDataset(path, data, rank=RANK) as ds:
        it = iter(batches(ds, num_workers=2))
        seen = [next(it)["step"] for _ in range(7)]
        assert seen == list(range(7))
        with pytest.raises(solar.SolarError, match=r"may be ahead of the training loop"):
            ds.state_dict()
        state = ds.state_dict(step=seen[-1] + 1)
        del it
    monkeypatch.setattr(SolarDataset, "_references", refs)
    with SolarDataset(path, data, rank=RANK) as ds:
        ds.load_state_dict(state)
        assert_same(epochs(ds, batches(ds, num_workers=2)), ref[7:])
    with SolarDataset(path, data, rank=RANK) as ds:
        ds.set_epoch(0)
        assert_same([(b["step"], b["index"].tolist(), b["X_train"]) for b in batches(ds, num_workers=2)], ref[:8])
        with pytest.raises(solar.SolarError, match=r"may be ahead of the training loop"):
            ds.state_dict()
        ds.set_epoch(1)  # the next epoch begun: the loop has seen the last one whole
        assert ds.state_dict()["step"] == 8


def test_set_epoch_seeks_and_used_up_epochs_say_so(job):
    path, data, ref = job
    with SolarDataset(path, data, rank=RANK) as ds:
        dl = batches(ds, num_workers=2)
        ds.set_epoch(1)
        assert_same([(b["step"], b["index"].tolist(), b["X_train"]) for b in dl], ref[8:])
        with pytest.raises(solar.SolarError, match=r"may be ahead of the training loop"):
            ds.state_dict()  # fetched to the epoch's end: the loop may not have trained all of it
        assert ds.state_dict(step=16)["step"] == 16
        ds.set_epoch(0)
        assert_same([(b["step"], b["index"].tolist(), b["X_train"]) for b in dl], ref[:8])
        ds.set_epoch(1)
        list(dl)
        with pytest.raises(solar.SolarError, match="epochs are used up"):
            list(dl)
        with pytest.raises(solar.SolarError, match="epochs are used up"):
            list(batches(ds, num_workers=0))


def test_a_pickled_copy_outside_a_dataloader_says_what_it_is(job):
    """Issue 26: a pickled SolarDataset (what spawned DataLoader workers get) used as a dataset gave
    `AttributeError: '_lock'` (iterating) and `'NoneType' object has no attribute 'S'` (len).  Now each use
    is one SolarError saying it is a pickled copy; closing the copy leaves the original open."""
    path, data, ref = job
    with SolarDataset(path, data, rank=RANK) as ds:
        copy = pickle.loads(pickle.dumps(ds))
        uses = {"__len__": lambda: len(copy), "__iter__": lambda: iter(copy), "epoch": lambda: copy.epoch,
                "epochs": lambda: copy.epochs, "epoch_range": copy.epoch_range, "set_epoch": lambda: copy.set_epoch(0),
                "state_dict": copy.state_dict, "load_state_dict": lambda: copy.load_state_dict(ds.state_dict()),
                "stats": copy.stats}
        for name, use in uses.items():
            with pytest.raises(solar.SolarError) as info:
                use()
            msg = str(info.value)
            assert msg.startswith(f"SolarDataset.{name}: this SolarDataset is a pickled copy") and "\n" not in msg
        with copy:
            pass
        copy.close()
        assert len(ds) == 8 and assert_same(epochs(ds, ds), ref) is None  # the original still works
        assert pickle.loads(pickle.dumps(copy))._span == copy._span  # and a copy pickles again (a worker's)


def test_persistent_workers_are_refused(job):
    path, data, _ = job
    with SolarDataset(path, data, rank=RANK) as ds:
        dl = batches(ds, num_workers=1, persistent_workers=True)
        assert len(list(dl)) == 8
        with pytest.raises(solar.SpecError, match="persistent_workers=True"):
            list(dl)


def test_loader_error_reaches_the_training_loop(job, monkeypatch):
    path, data, _ = job

    def broken(self):
        raise solar.DecodeError("block 3 of x.h5: bad data")

    with SolarDataset(path, data, rank=RANK) as ds:
        monkeypatch.setattr(SolarLoader, "_start_buffer", broken)
        with pytest.raises(solar.DecodeError, match="block 3 of x.h5: bad data"):
            list(batches(ds, num_workers=2))



def test_references_resolve_out_of_order_in_any_thread(job):
    """What DataLoader's pin-memory thread does with CUDA: unpickle worker references as they
    arrive; the batches still come from the buffer in plan order (early ones wait in the stash)."""
    path, data, ref = job
    with SolarDataset(path, data, rank=RANK) as ds:
        sent = [pickle.dumps(_StepRef(ds._token, g)) for g in (2, 0, 3, 1)]
        got = {}

        def unpickle_all():
            for msg in sent:
                b = pickle.loads(msg)
                got[b["step"]] = b["index"].tolist()

        t = threading.Thread(target=unpickle_all)
        t.start()
        t.join()
        assert got == {g: ref[g][1] for g in range(4)} and ds._stash == {}
        with pytest.raises(solar.SolarError, match="step 1 was already handed out"):
            pickle.loads(sent[3]).reraise()
    with pytest.raises(solar.SolarError, match="step 0 of a SolarDataset that is closed"):
        pickle.loads(sent[1]).reraise()
