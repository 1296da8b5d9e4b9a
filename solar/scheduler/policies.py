"""Registry of loading policies; all run on the same engine with the same inputs.

=============  =============================  ===============  =========================
name           assignment                     eviction         next use known
=============  =============================  ===============  =========================
``torch``      DistributedSampler (strided)   LRU per rank     no
``nopfs``      DistributedSampler (strided)   Belady per rank  per-rank future, all
                                                               epochs ahead (memory
                                                               bound, ``run.py``)
``solar2023``  holder-first in the first      FIFO per rank    no
               buffer/global-batch steps of
               an epoch, misses dealt evenly
``solar``      every step: to the rank that   Belady, global   global future,
               holds the sample's bytes       next use         next epoch
``ideal``      one global buffer of P x       Belady           global future,
               budget, no balance constraint                   next epoch
=============  =============================  ===============  =========================

Node-pool policies (:data:`NODE_POLICIES`): the L ranks of a node share one buffer of L x the
per-rank budget (``nodes=NodeMap(P, L)``, :mod:`.nodes`); a block anywhere in the pool is a hit
for every rank of the node.  Samples are routed to nodes, then split over the node's ranks.

==============  ============================  ===============  ==========================
name            assignment                    eviction         misses
==============  ============================  ===============  ==========================
``solar-node``  ``solar`` at node level       Belady per node  read from storage
``solar-peer``  ``solar`` at node level       Belady per node  from the node holding the
                                              (global next     block when the cost model
                                              use)             says so (:mod:`.peer_engine`)
``nopfs-peer``  DistributedSampler, node =    Belady per node  from any node holding it
                rank // L                     on the node's    (no global plan: NoPFS /
                                              own future       DDStore-like)
``lru-peer``    DistributedSampler, node =    LRU per node     from any node holding it
                rank // L                     (a peer's use    (no future known at all)
                                              counts)
==============  ============================  ===============  ==========================

With uniform reshuffling every sample is used in every epoch, so the next global use
of a block is always within the next epoch and one epoch of lookahead is exact for
``solar`` and ``ideal``.  Under the strided split a block returns to the same rank
only after ~P epochs on average, so ``nopfs`` (which knows its whole seeded access
stream) looks as far ahead as memory allows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import SpecError
from .kernel import BELADY, BOUNDARY, FIFO, LRU, ROUTED, STRIDED


@dataclass(frozen=True)
class Policy:
    name: str
    mode: int
    evict: int
    next_use: str  # "none", "global", "rank", "node" (per node under the strided split)
    single_buffer: bool = False
    epoch_order: str = "identity"
    description: str = ""
    lookahead: Optional[int] = 1  # epochs ahead the next-use computation sees; None: all (memory bound)
    node_pools: bool = False  # one buffer per node (needs a NodeMap)
    peer: bool = False  # a miss may be a transfer from another node (needs a PeerCost)


POLICIES = {
    "torch": Policy("torch", STRIDED, LRU, "none", description="DistributedSampler + per-rank LRU"),
    "nopfs": Policy("nopfs", STRIDED, BELADY, "rank", lookahead=None,
                    description="DistributedSampler + per-rank Belady, seeing the whole future"),
    "solar2023": Policy("solar2023", BOUNDARY, FIFO, "none", epoch_order="greedy",
                        description="SOLAR's published algorithm: boundary reassignment, FIFO, epoch order"),
    "solar": Policy("solar", ROUTED, BELADY, "global", description="ours: routed every step + global Belady"),
    "ideal": Policy("ideal", STRIDED, BELADY, "global", single_buffer=True,
                    description="one buffer of P x budget, Belady (upper bound)"),
}


# node-pool policies: planned per node (schedules record per-rank plans only, so `solar plan` offers
# POLICIES; `solar simulate --policies` and :func:`solar.scheduler.node_plan.plan_nodes` take these)
NODE_POLICIES = {
    "solar-node": Policy("solar-node", ROUTED, BELADY, "global", node_pools=True,
                         description="solar per node: one Belady pool per node, samples routed to nodes"),
    "solar-peer": Policy("solar-peer", ROUTED, BELADY, "global", node_pools=True, peer=True,
                         description="solar-node + misses sent by the node holding the block (cost model)"),
    "nopfs-peer": Policy("nopfs-peer", STRIDED, BELADY, "node", node_pools=True, peer=True, lookahead=None,
                         description="DistributedSampler + per-node Belady on its own future + peer fetch"),
    "lru-peer": Policy("lru-peer", STRIDED, LRU, "none", node_pools=True, peer=True,
                       description="DistributedSampler + per-node LRU + peer fetch (no knowledge of the future)"),
}

ALL_POLICIES = {**POLICIES, **NODE_POLICIES}


def admits_parts(policy: Policy) -> bool:
    """Whether ``policy`` keeps the parts of a chunk it reads that it uses again soon (Belady on a global next
    use: ``solar``, ``ideal``, ``solar-node``, ``solar-peer``), so that a plan on parts of chunks
    (:mod:`solar.layout.parts`) reads each chunk once where the memory allows.  The others would read a chunk
    for each part: plan them on whole chunks."""
    return policy.evict == BELADY and policy.next_use == "global"


def get_policy(name: str) -> Policy:
    try:
        return ALL_POLICIES[name]
    except KeyError:
        raise SpecError(f"unknown policy {name!r}; valid policies: {', '.join(ALL_POLICIES)}") from None
