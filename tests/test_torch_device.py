"""Batches to the device ahead of use (solar.torch.device).  No CUDA here: the stream logic runs
against a stand-in for the CUDA operations that logs them (events are recorded after the copies,
a staging slot is reused only after its last copy's event completed, the training stream waits
for a batch's event and every device tensor is handed over with record_stream), plus the real
``device="cpu"`` path through SolarLoader."""
import threading

import pytest
import torch

import solar
from solar.loader import SolarLoader
from solar.torch import DeviceMover, SolarDataset, to_device

from helpers import make_dataset


class FakeStreams:
    """CudaStreams' methods on the CPU; ``log``: what was called, in order."""

    def __init__(self):
        self.log, self.buffers, self.n_events = [], [], 0

    def copy(self, src):
        self.log.append(("copy", src.untyped_storage().data_ptr()))
        return src.clone()

    def record(self):
        self.n_events += 1
        self.log.append(("record", self.n_events))
        return self.n_events

    def synchronize(self, ev):
        self.log.append(("synchronize", ev))

    def wait(self, ev):
        self.log.append(("wait", ev))

    def hand_over(self, t):
        self.log.append(("hand_over", t.data_ptr()))

    def pinned(self, nbytes):
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.buffers.append(buf.data_ptr())
        return buf

    def is_pinned(self, t):
        return False


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(4, 3, generator=g), "y": torch.randint(0, 9, (4,), generator=g),
             "parts": [torch.ones(2, dtype=torch.float64) * i], "weight": 1.0, "step": i} for i in range(n)]


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        elif isinstance(a[k], list):
            assert all(torch.equal(x, y) for x, y in zip(a[k], b[k])), k
        else:
            assert a[k] == b[k], k


def test_staging_ring_is_reused_and_events_order_the_streams():
    streams = FakeStreams()
    src = _batches(7)
    mover = DeviceMover("cpu", ring=2, streams=streams)
    for i, b in enumerate(src):
        staged = mover.stage(b)
        mark = len(streams.log)
        got = mover.hand_over(staged)
        _same(got, b)
        handed = streams.log[mark:]
        assert handed[0] == ("wait", staged.event)  # the training stream waits for this batch's copies
        assert [e for e, _ in handed[1:]] == ["hand_over"] * 3  # x, y, parts[0]: record_stream each
    assert mover.staging_allocations == 2 and len(set(streams.buffers)) == 2  # a ring of 2, not one per batch
    copies = [p for e, p in streams.log if e == "copy"]
    assert len(copies) == 7 * 3 and len({p for p in copies}) == 2  # every copy reads one of the 2 staging buffers
    # slot reuse: batch k (k >= 2) first synchronizes on the event of batch k - 2, which used the same slot
    syncs = [ev for e, ev in streams.log if e == "synchronize"]
    assert syncs == list(range(1, 6))
    for k in range(2, 7):
        i_sync = streams.log.index(("synchronize", k - 1))
        first_copy_k = [j for j, (e, _) in enumerate(streams.log) if e == "copy"][3 * k]
        assert i_sync < first_copy_k
    # each batch's event is recorded after its 3 copies
    recs = [j for j, (e, _) in enumerate(streams.log) if e == "record"]
    copy_idx = [j for j, (e, _) in enumerate(streams.log) if e == "copy"]
    assert all(copy_idx[3 * k + 2] < recs[k] for k in range(7))


def test_ring_grows_for_a_larger_batch_only():
    streams = FakeStreams()
    mover = DeviceMover("cpu", ring=1, streams=streams)
    for n in (4, 4, 64, 64, 4):
        b = {"x": torch.arange(n, dtype=torch.float32)}
        _same(mover.hand_over(mover.stage(b)), b)
    assert mover.staging_allocations == 2


def test_to_device_queues_copies_ahead():
    streams = FakeStreams()
    src = _batches(5)
    pulled = []

    def source():
        for b in src:
            pulled.append(b["step"])
            yield b

    it = to_device(source(), "cpu", depth=2, streams=streams)
    first = next(it)
    assert pulled == [0, 1, 2]  # batches 1 and 2 were staged before batch 0 was handed out
    rest = list(it)
    for got, want in zip([first, *rest], src):
        _same(got, want)
    assert streams.n_events == 5 and len(streams.buffers) == 3  # a ring of depth + 1
    with pytest.raises(solar.SpecError, match="depth must be an integer >= 1"):
        next(to_device(src, "cpu", depth=0))


def test_sample_ids_stay_on_the_host():
    """``index`` is not copied (the loop reads the ids; from the device that would wait for it): the same tensor
    object comes back, in the batch's key order, and no copy of it is queued; ``host_keys=()`` moves it too."""
    streams = FakeStreams()
    mover = DeviceMover("cpu", ring=2, streams=streams)
    index = torch.arange(4)
    batch = {"x": torch.randn(4, 3), "index": index, "weight": 1.0}
    got = mover.hand_over(mover.stage(batch))
    assert got["index"] is index and list(got) == ["x", "index", "weight"]
    assert [e for e in streams.log if e[0] == "copy"] == [("copy", streams.buffers[0])]  # x alone
    assert [e for e in streams.log if e[0] == "hand_over"] == [("hand_over", got["x"].data_ptr())]
    streams = FakeStreams()
    both = DeviceMover("cpu", ring=2, streams=streams, host_keys=())
    got = both.hand_over(both.stage(batch))
    assert got["index"] is not index and torch.equal(got["index"], index)
    assert len([e for e in streams.log if e[0] == "copy"]) == 2


def test_bad_devices_are_refused():
    with pytest.raises(solar.SpecError, match="is not a torch device"):
        DeviceMover("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(solar.SpecError, match="'cuda': CUDA is not available in this process"):
            DeviceMover("cuda")


def test_cuda_without_an_index_is_the_rank_s_gpu(monkeypatch):
    """``device="cuda"`` is the rank's GPU (local rank mod the GPUs seen), as for a device buffer's batches: a batch
    gathered on cuda:1 is then the mover's own (passed through), where plain "cuda" compared unequal to cuda:1 and
    sent every such batch through pinned host memory and back.  CUDA is mocked: only the GPUs are counted."""
    from types import SimpleNamespace

    import solar.topology
    from solar.torch.device import _already
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(solar.topology, "detect", lambda: SimpleNamespace(local_rank=5))
    mover = DeviceMover("cuda", streams=FakeStreams())
    assert mover.device == torch.device("cuda", 1)
    on_gpu1 = SimpleNamespace(device=torch.device("cuda", 1))  # stands in for a tensor the device buffer made
    assert _already(on_gpu1, mover.device)
    assert DeviceMover("cuda:2", streams=FakeStreams()).device == torch.device("cuda", 2)  # an index is kept
    assert not _already(on_gpu1, DeviceMover("cuda:2", streams=FakeStreams()).device)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert DeviceMover("cpu", streams=FakeStreams()).device == torch.device("cpu")
    assert DeviceMover("cuda", streams=FakeStreams()).device == torch.device("cuda")  # no GPU to count


def test_the_side_streams_are_not_from_the_pool_nccl_takes_its_streams_from(monkeypatch):
    """The loader's copy and gather streams come from torch's high-priority pool (priority < 0): the default pool
    is shared with ProcessGroupNCCL, and a copy queued behind a collective could wait on another rank's batch."""
    from solar.buffer.device_pools import side_stream
    from solar.torch.device import CudaStreams
    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda **kw: made.append(kw) or object())
    CudaStreams(torch.device("cuda", 0))
    side_stream(torch.device("cuda", 1))
    assert [k["device"] for k in made] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert all(k.get("priority", 0) < 0 for k in made), made


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("device")
    data = make_dataset(root, "ptychonn", "chunked", samples=12, size=8)
    path = str(root / "plan.h5")
    solar.plan(data, world_size=2, local_batch=2, epochs=1, buffer_fraction=0.5, out=path).close()
    return path, data


def test_loader_device_cpu_gives_the_same_batches(job):
    path, data = job
    with SolarLoader(path, data, rank=0) as plain, SolarLoader(path, data, rank=0, device="cpu") as moved:
        for a, b in zip(plain, moved):
            assert a["index"].tolist() == b["index"].tolist() and a["weight"] == b["weight"]
            for k in ("X_train", "Y_I_train", "Y_phi_train"):
                assert b[k].device.type == "cpu" and torch.equal(a[k], b[k])
        assert moved.state_dict()["step"] == plain.state_dict()["step"] == 3


def test_loader_stages_in_the_prefetch_thread_and_hands_over_in_the_loop(job):
    """SolarLoader(device=...) with the stand-in streams: the copies are queued in the prefetch
    thread, the wait and record_stream happen in the training thread, once per step."""
    path, data = job
    streams = FakeStreams()
    where = []

    class Logged(DeviceMover):
        def stage(self, batch):
            where.append(("stage", threading.current_thread().name))
            return super().stage(batch)

        def hand_over(self, staged):
            where.append(("hand_over", threading.current_thread().name))
            return super().hand_over(staged)

    with SolarLoader(path, data, rank=0, device="cpu") as ref_loader:
        ref = [b["X_train"].clone() for b in ref_loader]
    with SolarLoader(path, data, rank=0, device="cpu") as loader:
        loader.hooks.mover = Logged("cpu", streams=streams)
        got = [b["X_train"] for b in loader]
    assert len(got) == 3 and streams.n_events == 3 and all(torch.equal(a, b) for a, b in zip(got, ref))
    assert {t for e, t in where if e == "stage"} == {"solar-prefetch-r0"}
    assert {t for e, t in where if e == "hand_over"} == {threading.main_thread().name}


def test_dataset_refuses_device_and_points_to_to_device(job):
    path, data = job
    with pytest.raises(solar.SpecError, match=r"wrap the DataLoader instead: solar.torch.to_device"):
        SolarDataset(path, data, rank=0, device="cpu")
    with pytest.raises(solar.SpecError, match="needs torch tensors"):
        SolarLoader(path, data, rank=0, device="cpu", as_torch=False)
