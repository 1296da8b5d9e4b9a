"""``init_distributed`` on a GPU machine, without one: CUDA mocked available, ``init_process_group``
replaced by a recorder.  The group it asks for must serve CPU tensors too (gloo for CPU, NCCL for CUDA):
an NCCL-only group ends the first all-reduce of a CPU tensor ("No backend type associated with device
type cpu"), which is how the examples crashed on an H200."""
import os
import sys

import pytest
import torch
import torch.distributed as dist

import solar
from solar.torch.distributed import init_distributed

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


class Stop(Exception):
    """Raised by the recorder instead of joining a group."""


@pytest.fixture
def gpu_machine(monkeypatch):
    """Two CUDA devices (mocked), rank 1 of 2 from torchrun's variables; ``calls`` records what torch was asked."""
    calls = {"set_device": [], "init": []}
    for k in list(os.environ):
        if k.startswith(("PMI_", "OMPI_", "SLURM_", "MPI_LOCAL", "HYDRA_", "PMIX_")):
            monkeypatch.delenv(k)
    for k, v in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29999").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls["set_device"].append(d))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "is_backend_available", lambda b: b in ("gloo", "nccl", "mpi"))

    def init_process_group(backend, **kw):
        calls["init"].append((backend, kw))
        raise Stop

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    return calls


def _backend_devices(backend: str) -> dict:
    """``"cpu:gloo,cuda:nccl"`` -> ``{"cpu": "gloo", "cuda": "nccl"}``; a plain name serves what it serves."""
    if ":" not in backend:
        return {"gloo": {"cpu": "gloo", "cuda": "gloo"}, "nccl": {"cuda": "nccl"}}.get(backend, {})
    return dict(part.split(":") for part in backend.split(","))


@pytest.mark.parametrize("asked", [None, "nccl", "NCCL"])
def test_gpu_group_serves_cpu_and_cuda_tensors(gpu_machine, asked):
    with pytest.raises(Stop):
        init_distributed(asked)
    (backend, kw), = gpu_machine["init"]
    assert _backend_devices(backend) == {"cpu": "gloo", "cuda": "nccl"}, backend
    assert kw["rank"] == 1 and kw["world_size"] == 2 and kw["init_method"] == "tcp://127.0.0.1:29999"
    assert gpu_machine["set_device"] == [1]  # GPU local_rank, as before


@pytest.mark.parametrize("asked", ["gloo", "cpu:gloo,cuda:nccl", "cpu:gloo,cuda:gloo"])
def test_other_backends_are_passed_as_given(gpu_machine, asked):
    with pytest.raises(Stop):
        init_distributed(asked)
    assert gpu_machine["init"][0][0] == asked
    assert gpu_machine["set_device"] == ([1] if "nccl" in asked else [])


def test_trainer_start_up_asks_for_a_group_that_reduces_cpu_tensors(gpu_machine, monkeypatch, tmp_path):
    """examples/trainer.py's main on a (mocked) CUDA machine: the group it joins serves the CPU float64 tensors its
    loop all-reduces."""
    monkeypatch.syspath_prepend(EXAMPLES)
    import train_ptychonn
    import trainer
    with pytest.raises(Stop):
        trainer.main(train_ptychonn.Ptycho(), train_ptychonn.__doc__, [str(tmp_path)])
    (backend, _), = gpu_machine["init"]
    assert _backend_devices(backend).get("cpu") == "gloo" and _backend_devices(backend).get("cuda") == "nccl"


def test_without_cuda_the_default_is_gloo(monkeypatch):
    from solar.torch.distributed import GPU_BACKEND, process_group_backend
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert process_group_backend(None, cuda=False) == "gloo"
    assert process_group_backend("nccl", cuda=True) == GPU_BACKEND
    with pytest.raises(solar.SpecError, match="needs CUDA"):
        monkeypatch.setattr(dist, "is_backend_available", lambda b: True)
        init_distributed("nccl")


@pytest.mark.parametrize("bad", ["", "  ", 3, b"gloo"])
def test_bad_backend_values_are_named(bad):
    from solar.torch.distributed import process_group_backend
    with pytest.raises(solar.SpecError, match="backend must be a name"):
        process_group_backend(bad, cuda=False)


def test_unavailable_part_of_a_backend_list_is_named(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(solar.SpecError, match="backend 'nope' is not available in this torch build "
                                             r"\(asked for 'cpu:gloo,cuda:nope'\)"):
        init_distributed("cpu:gloo,cuda:nope")


def test_a_device_backend_list_joins_a_real_group_on_cpu(tmp_path):
    """A ``device:backend`` list is a group torch makes (one process, gloo for CPU tensors): an all-reduce of a CPU
    tensor and the object collectives the trainer uses work in it."""
    import subprocess
    code = (
        "import torch, torch.distributed as dist\n"
        "from solar.torch import init_distributed\n"
        "init_distributed('cpu:gloo')\n"
        "t = torch.ones(3, dtype=torch.float64); dist.all_reduce(t)\n"
        "out = [None]; dist.all_gather_object(out, 'x')\n"
        "print(dist.get_backend(), t.tolist(), out)\n"
        "dist.destroy_process_group()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "SLURM_", "HYDRA_", "PMIX_"))}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[1.0, 1.0, 1.0] ['x']" in r.stdout


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

