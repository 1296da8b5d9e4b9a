"""``solar bench --equal-memory``: one memory cgroup per node (page cache counted), every rank in it, and each
loader limited to what its processes hold when it is up (nothing read yet) plus the node's data budget, so that
solar and every baseline run in the same memory.  Collective over the job's communicator: an error on any node
raises the same SolarError on every rank."""
from __future__ import annotations

import os
from typing import Optional


def _node_comm(comm):
    from mpi4py import MPI
    return comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)


def _enter_cgroup(comm, node) -> tuple:
    """Make one memory cgroup per node (node rank 0; no limit until :func:`_limit_loader`) and move every
    rank in: ``(cgroup, dir to go back to)``.

    Collective; a failure on any rank raises the same :class:`SolarError` on every rank.
    """
    from ..errors import SolarError
    from .memlimit import MemoryCgroup
    made, err = None, None
    if node.rank == 0:
        try:
            made = MemoryCgroup.create(f"solar-bench-{os.getpid()}", None)
        except SolarError as exc:
            err = str(exc)
    made = node.bcast(made, root=0)
    errs = [e for e in comm.allgather(err) if e]
    if errs:
        raise SolarError(errs[0])
    back, err = None, None
    try:
        back = made.join()
    except SolarError as exc:
        err = str(exc)
    errs = [e for e in comm.allgather(err) if e]
    if errs:
        _leave_cgroup(made, back, node)
        raise SolarError(errs[0])
    return made, back


def _leave_cgroup(cg, back, node):
    """Every rank goes back to ``back``; node rank 0 moves what is left (workers' servers) and removes ``cg``."""
    from ..mpi import sleep_barrier
    if back:
        cg.leave(back)
    sleep_barrier(node)
    if node.rank == 0:
        cg.remove(back)


def _limit(node, budget: int, allowance: int) -> int:
    """Bytes of one node's memory for data: the sum of its ranks' buffer budgets (``budget`` each) plus
    ``allowance``."""
    return node.allreduce(int(budget)) + int(allowance)


def _node_root(cg, node, comm, what: str, fn) -> list:
    """``fn(cg)`` on each node's rank 0, every rank of the node here before and after it: the nodes' results.
    Collective over ``comm``; an exception on any node raises the same :class:`SolarError` on every rank."""
    from ..errors import SolarError
    from ..mpi import sleep_barrier
    sleep_barrier(node)
    got, err = None, None
    if node.rank == 0:
        try:
            got = fn(cg)
        except Exception as exc:  # noqa: BLE001 - said on every rank below
            err = f"--equal-memory: cannot {what} {cg.path}: {exc}"
    every = comm.allgather((node.rank == 0, got, err))
    errs = [e for _, _, e in every if e]
    if errs:
        raise SolarError(errs[0])
    sleep_barrier(node)  # e.g. no rank reads before its node's limit holds
    return [g for root, g, _ in every if root]


def _limit_loader(cg, node, comm, data_bytes: int) -> Optional[dict]:
    """Limit each node's cgroup to what its processes hold now (the loader's base: started, nothing read
    yet) plus ``data_bytes``, and start its peak over: ``{"memory_base_bytes", "memory_cgroup_limit_bytes"}``
    (the largest over the nodes), None without a cgroup.  Collective over ``comm`` (call it when this rank's
    loader is up); an error on any node raises the same :class:`SolarError` on every rank."""
    if cg is None:
        return None

    def limit(c):
        base = c.base_bytes()
        c.set_limit(int(base + data_bytes))
        c.reset_peak()
        return base, c.limit_bytes
    got = _node_root(cg, node, comm, "limit", limit)
    return {"memory_base_bytes": max(g[0] for g in got), "memory_cgroup_limit_bytes": max(g[1] for g in got)}


def _unlimit(cg, node, comm):
    """Lift the nodes' cgroup limits once every rank of each node is done with a loader (the next one starts
    its processes without a limit).  Collective over ``comm``."""
    if cg is not None:
        _node_root(cg, node, comm, "lift the limit of", lambda c: c.set_limit(None))


def _peak(cg, node, comm):
    """Largest peak usage of the nodes' cgroups since the last reset (None without a cgroup)."""
    if cg is None:
        return None
    val = cg.peak_bytes() if node.rank == 0 else None
    vals = [v for v in comm.allgather(val) if v is not None]
    return max(vals) if vals else None


def _limit_first(drop, limited: dict, cg, node, comm, data_bytes):
    """``drop`` (called by :func:`~solar.bench.baseline.run_baseline` on every rank right before each epoch)
    that first, before the first epoch (workers up, nothing timed read yet), limits the cgroup for this
    loader (:func:`_limit_loader`; what it returns goes into ``limited``)."""
    if cg is None:
        return drop
    first = [True]

    def limit_then_drop():
        if first[0]:
            first[0] = False
            limited.update(_limit_loader(cg, node, comm, data_bytes))
        return drop() if drop is not None else None
    return limit_then_drop
