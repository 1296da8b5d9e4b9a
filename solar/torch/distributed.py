"""Initialise ``torch.distributed`` from the launcher's environment (torchrun, SLURM, MPI)."""
from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import SpecError
from ..topology import Topology, detect, launcher

__all__ = ["init_distributed"]


def init_distributed(backend: Optional[str] = None, timeout_s: float = 1800.0) -> Topology:
    """Initialise ``torch.distributed`` from the launcher's variables (torchrun, MPI, SLURM;
    :func:`solar.topology.detect`): rank 0 listens at ``MASTER_ADDR:MASTER_PORT`` when set, else
    at the first host of SLURM's node list (or localhost).  ``backend``: default ``nccl`` with
    CUDA (each rank then uses GPU ``local_rank``), else ``gloo``.  Returns the topology; a no-op
    (returning it) when ``torch.distributed`` is already initialised."""
    if dist.is_initialized():
        return launcher()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if not isinstance(backend, str) or not dist.is_backend_available(backend):
        raise SpecError(f"torch.distributed backend {backend!r} is not available in this torch build")
    t = detect()
    if backend == "nccl":
        torch.cuda.set_device(t.local_rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://{t.master_addr}:{t.master_port}", rank=t.rank,
                            world_size=t.world_size, timeout=timedelta(seconds=timeout_s))
    return t
