"""Open-ended node plans: each rank plans the node windows after the file's first, in the background.

The same as :mod:`solar.loader.extend` (whose :class:`~solar.loader.extend.WindowPlanner` this extends) for a
node plan (format version 6, ``open_ended``): every rank runs the deterministic node planner
(:class:`~solar.scheduler.run.PlanRun` with the file's :class:`~solar.scheduler.nodes.NodeMap` and
:class:`~solar.scheduler.nodes.PeerCost`, ``open_ended=True``) on the schedule's demand, plans every node's
routing, pool and transfers, and keeps its own samples and its node's lists; no file, no communication.  Windows
planned one after the other equal one plan made at once, so all ranks (and all nodes) agree on every transfer.

:meth:`NodeWindowPlanner.rank_plan` ``(w)`` is a :class:`~solar.schedule.schedule.NodeRankPlan` over global
steps ``0 .. (w+1)KS - 1`` whose steps before window ``w`` are empty except the last, at which the node's pool
loads the blocks its plan holds when the window begins: a :class:`~solar.buffer.NodeBufferManager` started at
the window's first step (or later) reads them as a resumed buffer does (its warm-up), then runs the window.
"""
from __future__ import annotations

from typing import Dict

import numpy as np

from ..schedule.format import NODE_LISTS, NODE_PEERS
from ..schedule.pack import csr_rank_major, samples_rank_major, split_rows
from ..schedule.schedule import NodeRankPlan
from .extend import WindowPlanner, WindowSlice


def node_epoch_part(ep, rank: int, node: int, peers=()) -> Dict[str, np.ndarray]:
    """Rank ``rank``'s samples and node ``node``'s lists in epoch plan ``ep`` (a recorded
    :class:`~solar.scheduler.node_plan.NodeEpochPlan` of S steps): ``samples`` int64[*] with ``samples_count``
    int64[S]; ``load``/``evict``/``stage``/``send``/``recv`` int64[*] with ``<name>_count`` int64[S];
    ``send_to``/``recv_from`` int64[*] (the other node of each transfer, in the plan's order); ``stats``
    int64[S, 10]; ``n_transfers`` int64[1] (blocks sent between any nodes in the epoch); for each rank q of
    ``peers``, its samples as ``peer<q>_samples`` and ``peer<q>_samples_count``.  Pure; the lists are the ones
    the schedule writer stores for that rank and node."""
    P, Q = ep.nodes.world_size, ep.nodes.n_nodes
    S = ep.bounds.shape[0] - 1
    out = {}
    samples, scount = samples_rank_major(ep.indices, ep.bounds, ep.rank_of, P)  # int64[T], int64[P, S]
    starts = split_rows(scount)
    out["samples"], out["samples_count"] = samples[starts[rank]:starts[rank + 1]], scount[rank]
    for q in peers:
        out[f"peer{q}_samples"], out[f"peer{q}_samples_count"] = samples[starts[q]:starts[q + 1]], scount[q]
    for name in ("load", "evict", "stage"):
        arr, cnt = csr_rank_major(getattr(ep, name + "_ptr"), getattr(ep, name), S, Q)  # node-major
        starts = split_rows(cnt)
        out[name], out[name + "_count"] = arr[starts[node]:starts[node + 1]], cnt[node]
    step = np.repeat(np.arange(S, dtype=np.int64), np.diff(ep.xfer_ptr))  # (X,) step of each transfer
    for name, mine, other in (("send", ep.xfer_src, ep.xfer_dst), ("recv", ep.xfer_dst, ep.xfer_src)):
        sel = np.flatnonzero(mine == node)  # the plan's order (MPI matches a pair's messages in order)
        out[name] = np.asarray(ep.xfer_block[sel], np.int64)
        out[NODE_PEERS[name]] = np.asarray(other[sel], np.int64)
        out[name + "_count"] = np.bincount(step[sel], minlength=S).astype(np.int64)
    out["stats"] = np.ascontiguousarray(ep.stats[:, node, :], dtype=np.int64)
    out["n_transfers"] = np.array([ep.xfer_block.shape[0]], dtype=np.int64)
    return out


def _counts(ptr) -> np.ndarray:
    return np.diff(np.asarray(ptr, np.int64))


class NodeWindowPlanner(WindowPlanner):
    """Plans window after window of an open-ended node plan ``schedule`` for rank ``rank`` (``first``: its
    :class:`~solar.schedule.schedule.NodeRankPlan` of the file's window): see the module docstring."""

    PARTS = ("samples", "samples_count", *NODE_LISTS, *(n + "_count" for n in NODE_LISTS), *NODE_PEERS.values(),
             "stats", "n_transfers")

    def __init__(self, schedule, rank: int, first: NodeRankPlan):
        self.first, self.node = first, int(rank) // schedule.nodes.ranks_per_node
        # the node's other ranks' samples too (who reads which block for the node: solar.buffer.node_place)
        self.peers = [q for q in schedule.nodes.ranks_of(self.node) if q != int(rank)]
        self.PARTS = self.PARTS + tuple(f"peer{q}_{x}" for q in self.peers for x in ("samples", "samples_count"))
        super().__init__(schedule, rank, first)

    def _first_slice(self, first) -> WindowSlice:
        mine, lists = first.rank(first.rank_id), first.node(first.node_id)
        arrays = {"samples": mine["samples"], "samples_count": _counts(mine["samples_ptr"])}
        for name in NODE_LISTS:
            arrays[name], arrays[name + "_count"] = lists[name], _counts(lists[name + "_ptr"])
        for other in NODE_PEERS.values():
            arrays[other] = lists[other]
        arrays["stats"] = lists["stats"]
        arrays["n_transfers"] = np.array([first.n_transfers], dtype=np.int64)
        for q in self.peers:
            theirs = first.rank(q)
            arrays[f"peer{q}_samples"] = theirs["samples"]
            arrays[f"peer{q}_samples_count"] = _counts(theirs["samples_ptr"])
        return WindowSlice(0, arrays, np.zeros(0, np.int64))

    def _keep(self, ep, parts: Dict[str, list]):
        """Append this rank's samples and its node's lists of node epoch plan ``ep`` to ``parts``."""
        for name, arr in node_epoch_part(ep, self.rank, self.node, self.peers).items():
            parts[name].append(arr)

    def rank_plan(self, w: int) -> NodeRankPlan:
        """This rank's node plan of window ``w`` (planned first if need be) over global steps
        ``0 .. (w+1)KS - 1``: see the module docstring.  Window 0 is the file's."""
        if w == 0:
            return self.first
        self.wait(w)
        sl = self.slices[w]
        base = w * self.K * self.S
        s = self.schedule
        idt = s.id_dtype

        def lead(arr, cnt, first=None):  # the window's list behind `base` empty steps (the last loads `first`)
            pre = np.zeros(base, dtype=np.int32)
            head = np.zeros(0, np.int64) if first is None else first
            pre[-1] = head.shape[0]
            return (np.concatenate([head, np.asarray(arr, np.int64)]).astype(idt),
                    np.concatenate([pre, np.asarray(cnt, np.int32)]))

        a = sl.arrays
        samples, samples_count = lead(a["samples"], a["samples_count"])
        node = {}
        for name in NODE_LISTS:
            node[name], node[name + "_count"] = lead(a[name], a[name + "_count"],
                                                     sl.resident if name == "load" else None)
        for other in NODE_PEERS.values():
            node[other] = np.asarray(a[other], np.int32)
        node["stats"] = np.concatenate([np.zeros((base, a["stats"].shape[1]), np.int64), a["stats"]])
        peers = {}
        for q in self.peers:
            arr, cnt = lead(a[f"peer{q}_samples"], a[f"peer{q}_samples_count"])
            peers[q] = {"samples": arr, "samples_count": cnt}
        return NodeRankPlan(s, self.rank, {"samples": samples, "samples_count": samples_count}, node,
                            int(a["n_transfers"].sum()), n_steps=base + self.K * self.S, peers=peers)
