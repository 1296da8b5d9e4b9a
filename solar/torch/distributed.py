"""Initialise ``torch.distributed`` from the launcher's environment (torchrun, SLURM, MPI)."""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import SpecError
from ..topology import MPI_LAUNCH_VARS, Topology, detect, launcher

__all__ = ["init_distributed", "process_group_backend"]

#: What ``init_distributed`` asks of torch for ``nccl`` (or nothing) on a CUDA machine: NCCL for CUDA
#: tensors and gloo for CPU tensors in one process group, so that a job may reduce a CPU tensor (a loss
#: read back to the host, a count) as well as its gradients.  An nccl-only group fails on the first CPU
#: collective ("No backend type associated with device type cpu").
GPU_BACKEND = "cpu:gloo,cuda:nccl"


def process_group_backend(backend: Optional[str], cuda: bool) -> str:
    """The backend string to give ``init_process_group`` for the caller's ``backend`` (pure).

    ``None``: :data:`GPU_BACKEND` with CUDA, else ``gloo``.  ``"nccl"``: :data:`GPU_BACKEND` (CPU
    collectives go to gloo).  Anything else (``"gloo"``, ``"mpi"``, a ``"device:backend,..."`` list) is
    passed through.  A backend that is not a non-empty string is a SpecError."""
    if backend is None:
        return GPU_BACKEND if cuda else "gloo"
    if not isinstance(backend, str) or not backend.strip():
        raise SpecError(f"torch.distributed backend must be a name like 'gloo', 'nccl' or "
                        f"'cpu:gloo,cuda:nccl', got {backend!r}")
    backend = backend.strip().lower()
    return GPU_BACKEND if backend == "nccl" else backend


def _backend_names(backend: str) -> list:
    """The plain backend names in ``backend`` (``"cpu:gloo,cuda:nccl"`` -> ``["gloo", "nccl"]``)."""
    return [part.split(":", 1)[-1].strip() for part in backend.split(",")]


def _uses_nccl(backend: str) -> bool:
    return "nccl" in _backend_names(backend)


def init_distributed(backend: Optional[str] = None, timeout_s: float = 1800.0) -> Topology:
    """Initialise ``torch.distributed`` from the launcher's variables (torchrun, MPI, SLURM;
    :func:`solar.topology.detect`): rank 0 listens at ``MASTER_ADDR:MASTER_PORT`` when the port is set.
    Without ``MASTER_PORT``, in a job that MPI launched (mpiexec, ``srun --mpi=...``; mpi4py installed),
    rank 0 listens on a free port (at ``MASTER_ADDR`` if set, else 127.0.0.1 when all ranks share its host,
    else its host name) and sends it to the others over MPI; otherwise at the first host of SLURM's node list (or localhost) on a port
    derived from the SLURM job id (29500 outside SLURM).

    ``backend``: default gloo without CUDA; with CUDA (and for ``"nccl"``) one group with NCCL for
    CUDA tensors and gloo for CPU tensors (``cpu:gloo,cuda:nccl``), so CPU collectives keep working on a
    GPU machine; each rank then uses GPU ``local_rank`` (modulo the GPUs it sees).  Other names and
    ``"device:backend,..."`` lists are passed to torch as given.  Returns the topology; a no-op
    (returning it) when ``torch.distributed`` is already initialised."""
    if dist.is_initialized():
        return launcher()
    backend = process_group_backend(backend, torch.cuda.is_available())
    missing = [b for b in _backend_names(backend) if not b or not dist.is_backend_available(b)]
    if missing:
        raise SpecError(f"torch.distributed backend {missing[0]!r} is not available in this torch build"
                        + (f" (asked for {backend!r})" if backend != missing[0] else ""))
    t = detect()
    if _uses_nccl(backend):
        if not torch.cuda.is_available():
            raise SpecError(f"torch.distributed backend {backend!r} needs CUDA, which this process does not see")
        torch.cuda.set_device(t.local_rank % torch.cuda.device_count())
    timeout = timedelta(seconds=timeout_s)
    store = _mpi_rendezvous(t, timeout)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=t.rank, world_size=t.world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://{t.master_addr}:{t.master_port}", rank=t.rank,
                                world_size=t.world_size, timeout=timeout)
    return t


def _mpi_world(t: Topology):
    """MPI's world communicator when MPI launched this process (its variables are set), mpi4py is there
    and its world is the job's; else None.  Imports mpi4py (which starts MPI) only in that case."""
    if not any(v in os.environ for v in MPI_LAUNCH_VARS) or t.world_size <= 1:
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    return comm if comm.Get_size() == t.world_size else None


def _mpi_rendezvous(t: Topology, timeout: timedelta):
    """A ``TCPStore`` for the process group, or None to use ``MASTER_ADDR:MASTER_PORT``.

    Without ``MASTER_PORT`` in a job that MPI launched, rank 0 listens on a port the operating system
    gives it (no guess that another process on the node may hold) and sends its address and port to the
    other ranks over MPI; a port set by the user is always used as given.  The address: ``MASTER_ADDR``,
    else 127.0.0.1 when every rank runs on rank 0's host, else rank 0's host name.  Whatever fails on rank 0
    (a name that does not resolve, nothing to listen on) is a SpecError on every rank, never a hang."""
    if "MASTER_PORT" in os.environ:
        return None
    comm = _mpi_world(t)
    if comm is None:
        return None
    hosts = comm.allgather((socket.gethostname(), t.rank))
    if any(r != i for i, (_, r) in enumerate(hosts)):  # the launcher's ranks are not MPI's: rank 0 is unknown
        return None
    hosts = [h for h, _ in hosts]
    addr = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if len(set(hosts)) == 1 else hosts[0])
    store, why = None, ""
    if comm.Get_rank() == 0:
        try:
            socket.getaddrinfo(addr, None)
        except OSError as exc:  # the master store would retry connecting to itself until the timeout
            why = (f"rank 0's address {addr!r} for torch.distributed does not resolve ({exc}): set MASTER_ADDR "
                   f"to an address every rank reaches rank 0 at")
        if not why:
            try:
                store = dist.TCPStore(addr, 0, t.world_size, True, timeout=timeout, wait_for_workers=False)
            except Exception as exc:  # noqa: BLE001 - any failure here must reach the other ranks, or they hang
                why = f"rank 0 cannot listen at {addr!r} for torch.distributed ({exc}): set MASTER_ADDR"
    addr, port, why = comm.bcast((addr, store.port if store is not None else 0, why), root=0)
    if why:
        raise SpecError(why)
    if store is None:
        store = dist.TCPStore(addr, port, t.world_size, False, timeout=timeout)
    return store
