"""What :class:`~solar.loader.SolarLoader` checks before it runs a node plan (format version 6): that the
ranks the plan puts on one node share memory, and that the node's buffer fits what it was planned for."""
from __future__ import annotations

from typing import Dict

import numpy as np

from ..errors import SolarError


class PlacementError(SolarError):
    """The job's ranks are not placed as the node plan says (ranks of one planned node on different machines)."""


def machine_ids(comm) -> list:
    """int per rank of ``comm``: ranks that can share memory (``COMM_TYPE_SHARED``) get the same id (the
    lowest ``comm`` rank among them).  Collective over ``comm``."""
    from mpi4py import MPI
    shm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        mine = shm.allreduce(comm.Get_rank(), op=MPI.MIN)
    finally:
        shm.Free()
    return comm.allgather(mine)


def check_node_placement(nodes, comm, path: str = "the schedule") -> None:
    """PlacementError on every rank unless the ranks of each node of ``nodes`` (a
    :class:`~solar.scheduler.nodes.NodeMap`) can share memory.  Collective over ``comm`` (None: one process,
    fine for a plan of one rank)."""
    if comm is None or comm.Get_size() == 1:
        if nodes.world_size > 1:
            raise PlacementError(f"{path} is a node plan of {nodes.world_size} ranks: pass comm= (the job's "
                                 f"communicator: run under mpiexec or srun with mpi4py), or re-plan with "
                                 f"--no-node-pool for a buffer per rank")
        return
    ids = machine_ids(comm)
    L = nodes.ranks_per_node
    for n in range(nodes.n_nodes):
        ranks = list(nodes.ranks_of(n))
        apart = [r for r in ranks if ids[r] != ids[ranks[0]]]
        if apart:
            raise PlacementError(
                f"{path} plans ranks {ranks[0]}..{ranks[-1]} on one node sharing a buffer, but rank {apart[0]} runs "
                f"on another machine than rank {ranks[0]}: launch {L} ranks per node in block order (srun "
                f"--ntasks-per-node={L} --distribution=block, mpiexec -ppn {L}), or re-plan with --ranks-per-node "
                f"matching the job")


def node_rank_memory(plan, demand: Dict[str, np.ndarray], budget: int, batch_bytes: int, prefetch: int):
    """:class:`~solar.memory.NodeMemory` of the node of ``plan`` (a
    :class:`~solar.schedule.schedule.NodeRankPlan`); NodeBufferError if it is over its limit."""
    from ..buffer.node_pools import check_node_memory
    from ..memory import plan_node_memory
    L = plan.nodes.ranks_per_node
    mem = plan_node_memory(plan.node(plan.node_id), demand["block_nbytes"], np.shape(demand["sample_ptr"])[0] - 1,
                           np.shape(demand["sample_blocks"])[0], L=L, budget=int(budget), batch=int(batch_bytes),
                           prefetch=int(prefetch), io_depth=4)[0]
    check_node_memory(mem, plan.node_id, L)
    return mem
