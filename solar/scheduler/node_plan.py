"""The plan of a node-pool policy: per node per step loads/evictions, per rank per step samples,
per step transfers between nodes.  Pure: arrays in, arrays out.

Shapes (S steps of an epoch, G = E*S steps of the job, P ranks, Q = P/L nodes, T positions of an
epoch; every id is a layout block id, every count in layout blocks, every byte a layout byte):

=====================  ============  =====================================================
``samples``            int64[M]      sample ids each rank trains on, CSR over (step, rank):
``samples_ptr``        int64[G*P+1]  rank r at step g: ``samples[ptr[g*P+r]:ptr[g*P+r+1]]``
                                     (index order; the step's global batch is theirs united)
``load``, ``_ptr``     int64[*], int64[G*Q+1]  read from storage into node n's pool at g
``evict``, ``_ptr``    int64[*], int64[G*Q+1]  dropped from node n's pool at g (before loads)
``stage``, ``_ptr``    int64[*], int64[G*Q+1]  read from storage into n's staging area at g, not
                                     kept (only when every resident is needed at g)
``xfer_src``           int32[X]      node sending, ``xfer_dst`` int32[X] node receiving,
``xfer_block``         int64[X]      block sent; CSR over steps ``xfer_ptr`` int64[G+1]
``stats``              int64[G,Q,10]  per step and node, columns :data:`NODE_STATS`
=====================  ============  =====================================================

Order of a step g at node n (what a runtime executes): evict, load, stage, then the transfers of
g (a sender holds the block: in its pool after its loads, or in its staging area), then every rank
of n assembles its samples from n's pool and staging area; the staging area is then dropped.
Received blocks are never resident at the receiver (see :mod:`.peer_engine`).

:meth:`NodePlan.node` and :meth:`NodePlan.rank` slice one node / rank with int64[G+1] pointers,
like :class:`solar.schedule.schedule.RankPlan`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from ..errors import SpecError
from .config import PlanConfig
from .nodes import NodeMap, PeerCost

NODE_STATS = ("samples", "hits", "hit_bytes", "peer", "peer_bytes", "misses", "miss_bytes", "stored_bytes",
              "staged", "staged_bytes")


@dataclass
class NodeEpochPlan:
    """One epoch of a node-pool policy (what ``on_epoch`` receives).

    ``indices`` int64[T], ``bounds`` int64[S+1], ``rank_of`` int32[T] rank of each position,
    ``count`` int64[S, P] samples per rank, ``stats`` int64[S, Q, 10] (:data:`NODE_STATS`),
    with recording ``load``/``evict``/``stage`` + ``*_ptr`` int64[S*Q+1] over (step, node) and
    ``xfer_src``/``xfer_dst`` int32[X], ``xfer_block`` int64[X], ``xfer_ptr`` int64[S+1].
    """

    position: int
    source_epoch: int
    step0: int
    indices: np.ndarray
    bounds: np.ndarray
    nodes: NodeMap
    rank_of: np.ndarray
    count: np.ndarray
    stats: np.ndarray
    demand_bytes: int
    load: Optional[np.ndarray] = None
    load_ptr: Optional[np.ndarray] = None
    evict: Optional[np.ndarray] = None
    evict_ptr: Optional[np.ndarray] = None
    stage: Optional[np.ndarray] = None
    stage_ptr: Optional[np.ndarray] = None
    xfer_src: Optional[np.ndarray] = None
    xfer_dst: Optional[np.ndarray] = None
    xfer_block: Optional[np.ndarray] = None
    xfer_ptr: Optional[np.ndarray] = None


def _concat_csr(parts: List[np.ndarray], ptrs: List[np.ndarray]):
    """Concatenate CSR lists (each ``ptr`` starting at 0) into one list with one pointer array."""
    out_ptr = [np.zeros(1, dtype=np.int64)]
    off = 0
    for ptr in ptrs:
        out_ptr.append(ptr[1:] + off)
        off += int(ptr[-1])
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return ids, np.concatenate(out_ptr)


def _rows(ids: np.ndarray, ptr: np.ndarray, rows: np.ndarray):
    """The CSR rows ``rows`` (int64[G]) of ``ids``/``ptr`` as ``(ids, int64[G+1] pointers)``."""
    lens = ptr[rows + 1] - ptr[rows]  # (G,)
    out_ptr = np.zeros(rows.shape[0] + 1, dtype=np.int64)
    np.cumsum(lens, out=out_ptr[1:])
    take = np.repeat(ptr[rows], lens) + (np.arange(int(out_ptr[-1]), dtype=np.int64) - np.repeat(out_ptr[:-1], lens))
    return ids[take], out_ptr


@dataclass(frozen=True)
class NodePlan:
    """A whole job's node-pool plan (shapes in the module table)."""

    nodes: NodeMap
    policy: str
    steps_per_epoch: int
    samples: np.ndarray
    samples_ptr: np.ndarray
    load: np.ndarray
    load_ptr: np.ndarray
    evict: np.ndarray
    evict_ptr: np.ndarray
    stage: np.ndarray
    stage_ptr: np.ndarray
    xfer_src: np.ndarray
    xfer_dst: np.ndarray
    xfer_block: np.ndarray
    xfer_ptr: np.ndarray
    stats: np.ndarray

    @property
    def n_steps(self) -> int:
        return int(self.xfer_ptr.shape[0] - 1)

    @property
    def n_transfers(self) -> int:
        """Blocks sent between nodes over the job."""
        return int(self.xfer_block.shape[0])

    def identity(self) -> tuple:
        """What every rank of a job running this plan must agree on (compared by the runtime)."""
        return (self.policy, self.nodes.world_size, self.nodes.ranks_per_node, self.n_steps,
                int(self.load.shape[0]), self.n_transfers)

    def rank(self, r: int) -> Dict[str, np.ndarray]:
        """Rank r's samples per step: ``{"samples": int64[*], "samples_ptr": int64[G+1]}``."""
        P, G = self.nodes.world_size, self.n_steps
        if not 0 <= r < P:
            raise IndexError(f"rank {r} out of range [0, {P})")
        rows = np.arange(G, dtype=np.int64) * P + r
        s, p = _rows(self.samples, self.samples_ptr, rows)
        return {"samples": s, "samples_ptr": p}

    def node(self, n: int) -> Dict[str, np.ndarray]:
        """Node n's lists with int64[G+1] pointers: ``load``, ``evict``, ``stage``, ``send`` (blocks
        sent, with ``send_to`` int32 receivers) and ``recv`` (blocks received, ``recv_from`` senders),
        and ``stats`` int64[G, 10]."""
        Q, G = self.nodes.n_nodes, self.n_steps
        if not 0 <= n < Q:
            raise IndexError(f"node {n} out of range [0, {Q})")
        rows = np.arange(G, dtype=np.int64) * Q + n
        out = {}
        for name in ("load", "evict", "stage"):
            out[name], out[name + "_ptr"] = _rows(getattr(self, name), getattr(self, name + "_ptr"), rows)
        step = np.repeat(np.arange(G, dtype=np.int64), np.diff(self.xfer_ptr))  # (X,) step of each transfer
        for name, mine, other in (("send", self.xfer_src, self.xfer_dst), ("recv", self.xfer_dst, self.xfer_src)):
            sel = np.flatnonzero(mine == n)
            out[name] = self.xfer_block[sel]
            out[name + ("_to" if name == "send" else "_from")] = other[sel]
            ptr = np.zeros(G + 1, dtype=np.int64)
            np.cumsum(np.bincount(step[sel], minlength=G), out=ptr[1:])
            out[name + "_ptr"] = ptr
        out["stats"] = self.stats[:, n, :]
        return out

    def predicted(self) -> Dict[str, int]:
        """Job totals of :data:`NODE_STATS`."""
        tot = self.stats.sum(axis=(0, 1))
        return {k: int(v) for k, v in zip(NODE_STATS, tot)}


def node_plan_from_epochs(epochs: List[NodeEpochPlan], policy: str) -> NodePlan:
    """Concatenate recorded epochs (in order) into one :class:`NodePlan`."""
    if not epochs:
        raise ValueError("no epoch plans to join")
    nodes = epochs[0].nodes
    P = nodes.world_size
    samples, sptrs = [], []
    for ep in epochs:
        S = ep.bounds.shape[0] - 1
        step = np.repeat(np.arange(S, dtype=np.int64), np.diff(ep.bounds))  # (T,) step of each position
        key = step * P + ep.rank_of  # (T,) (step, rank) row of each position
        order = np.argsort(key, kind="stable")
        samples.append(ep.indices[order])
        ptr = np.zeros(S * P + 1, dtype=np.int64)
        np.cumsum(np.bincount(key, minlength=S * P), out=ptr[1:])
        sptrs.append(ptr)
    lists = {}
    for name in ("samples",):
        lists[name], lists[name + "_ptr"] = _concat_csr(samples, sptrs)
    for name in ("load", "evict", "stage"):
        lists[name], lists[name + "_ptr"] = _concat_csr([getattr(ep, name) for ep in epochs],
                                                        [getattr(ep, name + "_ptr") for ep in epochs])
    blk, xptr = _concat_csr([ep.xfer_block for ep in epochs], [ep.xfer_ptr for ep in epochs])
    return NodePlan(nodes, policy, int(epochs[0].bounds.shape[0] - 1), lists["samples"], lists["samples_ptr"],
                    lists["load"], lists["load_ptr"], lists["evict"], lists["evict_ptr"], lists["stage"],
                    lists["stage_ptr"], np.concatenate([ep.xfer_src for ep in epochs]).astype(np.int32),
                    np.concatenate([ep.xfer_dst for ep in epochs]).astype(np.int32), blk, xptr,
                    np.concatenate([ep.stats for ep in epochs]))


def plan_nodes(demand, cfg: PlanConfig, nodes: NodeMap, policy: str = "solar-peer",
               cost: Optional[PeerCost] = None, group_blocks: bool = True):
    """Plan the job ``cfg`` on ``demand`` with a node-pool policy; ``(NodePlan, PolicyResult)``.

    Holds the whole job's lists in memory (a schedule-sized amount): for tests, tools and
    moderate jobs.  ``solar simulate`` runs the same planner without recording.
    """
    from .policies import NODE_POLICIES, get_policy
    from .run import run_policy  # run imports this module's NodeEpochPlan (through node_run)
    pol = get_policy(policy)
    if not pol.node_pools:
        raise SpecError(f"policy {policy!r} plans a buffer per rank, not per node; node-pool policies: "
                        f"{', '.join(NODE_POLICIES)}")
    epochs: List[NodeEpochPlan] = []
    res = run_policy(demand, cfg, pol, record=True, on_epoch=epochs.append, group_blocks=group_blocks,
                     nodes=nodes, cost=cost)
    return node_plan_from_epochs(epochs, pol.name), res
