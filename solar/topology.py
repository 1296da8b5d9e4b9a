"""Where this process sits in the job: a plain object built from ints.

Only :func:`detect` reads the environment (SLURM, then the MPI launcher's variables,
then an mpi4py communicator if one is given).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from .errors import SpecError


@dataclass(frozen=True)
class Topology:
    """``world_size`` ranks over ``nodes`` nodes; this process is ``rank``, ``local_rank`` of
    ``local_size`` on its node."""

    world_size: int
    rank: int
    local_rank: int = 0
    local_size: int = 1
    nodes: int = 1

    def __post_init__(self):
        for k in ("world_size", "local_size", "nodes"):
            if int(getattr(self, k)) < 1:
                raise SpecError(f"{k} must be >= 1, got {getattr(self, k)!r}")
        if not 0 <= self.rank < self.world_size:
            raise SpecError(f"rank must be in [0, {self.world_size}), got {self.rank!r}")
        if not 0 <= self.local_rank < self.local_size:
            raise SpecError(f"local_rank must be in [0, {self.local_size}), got {self.local_rank!r}")

    def device(self, cuda_available: bool, gpus: int = 0) -> str:
        """``cuda:<local_rank mod gpus>`` when GPUs are there, else ``cpu``."""
        return f"cuda:{self.local_rank % gpus}" if cuda_available and gpus > 0 else "cpu"


_ENV = (  # (world size, rank, local rank, local size, nodes) variable names per launcher
    ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES"),
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
     None),
    ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", None),
    ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", None),
)


def _int(env, name: Optional[str], default: int) -> int:
    if not name or name not in env:
        return default
    v = env[name].split("(")[0].split(",")[0]  # SLURM_NTASKS_PER_NODE may read "2(x3)"
    try:
        return int(v)
    except ValueError:
        raise SpecError(f"environment variable {name}={env[name]!r} is not an integer") from None


def detect(comm=None, env=None) -> Topology:
    """Topology of this process from SLURM / MPI launcher variables or ``comm``."""
    env = os.environ if env is None else env
    if comm is not None:
        from mpi4py import MPI
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        local_rank, local_size = node.Get_rank(), node.Get_size()
        nodes = comm.allreduce(1 if local_rank == 0 else 0)
        node.Free()
        return Topology(comm.Get_size(), comm.Get_rank(), local_rank, local_size, nodes)
    for size, rank, lrank, lsize, nodes in _ENV:
        if size in env and rank in env:
            return Topology(_int(env, size, 1), _int(env, rank, 0), _int(env, lrank, 0), _int(env, lsize, 1),
                            _int(env, nodes, 1))
    return Topology(1, 0)
