"""Where this process sits in the job: a plain object built from ints.

Only :func:`detect` reads the environment: an mpi4py communicator if one is given, else
the innermost launcher's variables (torchrun, then Open MPI / PMI, then SLURM: ``srun
torchrun`` and ``mpiexec`` inside ``sbatch`` leave the outer launcher's variables set
too, naming the wrong rank).  :func:`launcher` puts an initialised ``torch.distributed``
before that; :func:`launcher_rank` checks the result against a schedule's world size.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from typing import Optional

from .errors import SpecError


@dataclass(frozen=True)
class Topology:
    """``world_size`` ranks over ``nodes`` nodes; this process is ``rank``, ``local_rank`` of
    ``local_size`` on its node.  ``source`` names where the numbers came from (``""``: nothing
    found, a single process); ``master_addr``/``master_port``: where rank 0 listens for
    ``torch.distributed``'s rendezvous."""

    world_size: int
    rank: int
    local_rank: int = 0
    local_size: int = 1
    nodes: int = 1
    source: str = field(default="", compare=False)
    master_addr: str = field(default="localhost", compare=False)
    master_port: int = field(default=29500, compare=False)

    def __post_init__(self):
        for k in ("world_size", "local_size", "nodes"):
            if int(getattr(self, k)) < 1:
                raise SpecError(f"{k} must be >= 1, got {getattr(self, k)!r}")
        if not 0 <= self.rank < self.world_size:
            raise SpecError(f"rank must be in [0, {self.world_size}), got {self.rank!r}")
        if not 0 <= self.local_rank < self.local_size:
            raise SpecError(f"local_rank must be in [0, {self.local_size}), got {self.local_rank!r}")

    def cpu_share(self, affinity: int, cpu_count: int) -> int:
        """The cores this rank may keep busy (pure): its CPU affinity when the launcher bound it to fewer
        than the node's cores (its binding is its share), else the node's cores divided among its
        ``local_size`` ranks; at least 1."""
        affinity, cpu_count = max(1, int(affinity)), max(1, int(cpu_count))
        return affinity if affinity < cpu_count else max(1, cpu_count // self.local_size)

    def binding_note(self, affinity: int, cpu_count: int) -> Optional[str]:
        """A line for the user when the launcher bound this rank to one core while its share of the node is
        4 or more (pure; None otherwise): Open MPI's ``mpiexec`` does so by default for jobs of one or two
        ranks, and solar's assembly (and a DataLoader's workers) then share that one core."""
        affinity, cpu_count = max(1, int(affinity)), max(1, int(cpu_count))
        share = cpu_count // self.local_size
        if affinity > 1 or share < 4:
            return None
        return (f"this rank may run on 1 of the node's {cpu_count} cores (its CPU affinity; {self.local_size} "
                f"rank(s) on the node): solar's batch assembly gets that one core. If the launcher bound it "
                f"(Open MPI's mpiexec binds jobs of 1-2 ranks to one core each by default), widen the binding: "
                f"mpiexec --bind-to none, srun --cpu-bind=none or --cpus-per-task")

    def device(self, cuda_available: bool, gpus: int = 0) -> str:
        """``cuda:<local_rank mod gpus>`` when GPUs are there, else ``cpu``."""
        return f"cuda:{self.local_rank % gpus}" if cuda_available and gpus > 0 else "cpu"


def block_ranks_per_node(node_of_rank) -> "tuple[Optional[int], str]":
    """``(L, why)`` from the node each rank runs on (any label per rank, in rank order; pure): ``L`` when
    every node runs L ranks placed in blocks (ranks ``n*L .. n*L+L-1`` on one node: what a node plan
    assumes, as ``srun --distribution=block`` or ``mpiexec -ppn L`` place them), else ``None`` and ``why``
    names what differs."""
    labels = list(node_of_rank)
    if not labels:
        return None, "no ranks"
    sizes: dict = {}
    for x in labels:
        sizes[x] = sizes.get(x, 0) + 1
    if len(set(sizes.values())) > 1:
        counts = sorted(set(sizes.values()))
        return None, f"the nodes run different numbers of ranks ({', '.join(map(str, counts))})"
    L = next(iter(sizes.values()))
    for r, x in enumerate(labels):
        if x != labels[r - r % L]:
            return None, (f"ranks are not placed in blocks of {L} per node (rank {r} runs on another node than "
                          f"rank {r - r % L})")
    return L, ""


#: variables that say MPI launched this process (MPICH/PMI-2, PMIx, Open MPI)
MPI_LAUNCH_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")

#: launchers (:attr:`Topology.source`) whose ranks can carry a node plan's shared buffer (MPI starts them)
MPI_SOURCES = ("mpi4py", "Open MPI", "MPI (PMI)", "SLURM")


def job_ranks_per_node(t: "Topology", world_size: int) -> "tuple[Optional[int], Optional[str]]":
    """``(L or None, a line or None)`` for planning ``world_size`` ranks from inside a job ``t`` (pure): the
    job's ranks per node when it runs that many ranks, more than one per node, in whole nodes, under a
    launcher that MPI drives; under torchrun (no MPI to share a node's buffer) None and a line saying so;
    outside a job, or for another job's size, None and no line."""
    if not t.source or t.world_size != world_size or t.local_size <= 1 or world_size % t.local_size:
        return None, None
    L = t.local_size
    if t.source.startswith(MPI_SOURCES):
        return L, f"the job's {L} ranks per node share one buffer on each node ({t.source})"
    return None, (f"a buffer per rank: the job's {L} ranks per node could share one (--ranks-per-node {L}), "
                  f"which needs MPI to run (mpiexec or srun with mpi4py), not {t.source.split(' (')[0]}")


_ENV = (  # (launcher, world size, rank, local rank, local size, nodes) variable names, innermost first
    ("torchrun", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", None),
    ("Open MPI", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", None),
    ("MPI (PMI)", "PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", None),
    ("SLURM", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES"),
)


def _int(env, name: Optional[str], default: int) -> int:
    if not name or name not in env:
        return default
    v = env[name].split("(")[0].split(",")[0]  # SLURM_NTASKS_PER_NODE may read "2(x3)"
    try:
        return int(v)
    except ValueError:
        raise SpecError(f"environment variable {name}={env[name]!r} is not an integer") from None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[07-09,12],cpu1"`` -> ``"gpu07"``."""
    item = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], item)


def _rendezvous(env) -> tuple:
    """(address, port) of rank 0: ``MASTER_ADDR``/``MASTER_PORT`` when set, else the first host of
    SLURM's node list (or localhost) and a port derived from the SLURM job id (or 29500)."""
    nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    addr = env.get("MASTER_ADDR") or (first_host(nodes) if nodes else "localhost")
    # below Linux's ephemeral ports (32768-60999), which any process's outgoing connections may hold
    port = 29500 if "SLURM_JOB_ID" not in env else 20000 + _int(env, "SLURM_JOB_ID", 0) % 12000
    return addr, _int(env, "MASTER_PORT", port)


def detect(comm=None, env=None) -> Topology:
    """Topology of this process from ``comm`` or the launcher's variables (innermost launcher first)."""
    env = os.environ if env is None else env
    addr, port = _rendezvous(env)
    if comm is not None:
        from mpi4py import MPI
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        local_rank, local_size = node.Get_rank(), node.Get_size()
        nodes = comm.allreduce(1 if local_rank == 0 else 0)
        node.Free()
        return Topology(comm.Get_size(), comm.Get_rank(), local_rank, local_size, nodes, "mpi4py", addr, port)
    for name, size, rank, lrank, lsize, nodes in _ENV:
        if size in env and rank in env:
            return Topology(_int(env, size, 1), _int(env, rank, 0), _int(env, lrank, 0), _int(env, lsize, 1),
                            _int(env, nodes, 1), f"{name} ({rank}={env[rank]}, {size}={env[size]})", addr, port)
    return Topology(1, 0, master_addr=addr, master_port=port)


def launcher(env=None) -> Topology:
    """This process's place in the job: ``torch.distributed``'s rank and world size when it is
    initialised (torch is not imported for the check), else :func:`detect` from the environment."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return Topology(dist.get_world_size(), dist.get_rank(), source="torch.distributed")
    return detect(env=env)


def launcher_rank(world_size: int, env=None) -> int:
    """The rank of this process in a job planned for ``world_size`` ranks, from :func:`launcher`.

    Raises :class:`SpecError` when the launcher runs another number of ranks, or when none is
    found and ``world_size`` > 1."""
    t = launcher(env)
    if not t.source:
        if world_size == 1:
            return 0
        raise SpecError(f"the schedule is planned for {world_size} ranks but no launcher was found "
                        "(torch.distributed, torchrun, MPI or SLURM variables): pass rank= or comm=")
    if t.world_size != world_size:
        raise SpecError(f"the launcher runs {t.world_size} ranks ({t.source}) but the schedule is planned "
                        f"for world size {world_size}: plan with world_size={t.world_size} or pass rank=")
    return t.rank


def cpus_of_this_rank(topology: Optional[Topology] = None) -> int:
    """:meth:`Topology.cpu_share` of this process (``topology`` default: :func:`detect`, the launcher's
    variables, which say how many ranks share the node), from its CPU affinity and the machine's core count."""
    t = topology if topology is not None else detect()
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        affinity = os.cpu_count() or 1
    count = os.cpu_count() or affinity
    note = t.binding_note(affinity, count)
    if note is not None and note not in _SAID:  # once per process
        _SAID.add(note)
        import warnings
        warnings.warn(note, RuntimeWarning, stacklevel=2)
    return t.cpu_share(affinity, count)


_SAID: set = set()
