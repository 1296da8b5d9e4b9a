"""Where ranks sit (nodes) and what a peer transfer costs: the inputs of node-pool planning.

``NodeMap(world_size, ranks_per_node)``: ranks ``n*L .. n*L + L - 1`` share node ``n``
(L = ``ranks_per_node``), the block placement of ``mpiexec``/``srun`` by default.  The ranks of a
node keep one shared buffer (one Belady cache of L x the per-rank budget); see docs/planner.md.

``PeerCost(network_bytes_per_s, storage_bytes_per_s)``: a block may be planned as a transfer from
another node instead of a storage read when sending its decoded bytes over the network takes less
time than reading its stored bytes.  Defaults: 12.5e9 B/s network (100 Gb/s, one InfiniBand HDR100 or
Slingshot-10 port) and 1e9 B/s storage (cold random 4 MiB reads on this project's machines:
0.8-1.1 GB/s, ../shared/brief/MACHINE.md; a parallel file system per client is of the same order).

Pure: ints and arrays in, arrays out.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numba as nb
import numpy as np

from ..errors import SpecError
from .config import check_count

DEFAULT_NETWORK_BPS = 12.5e9
DEFAULT_STORAGE_BPS = 1e9


@dataclass(frozen=True)
class NodeMap:
    """``world_size`` ranks on ``world_size // ranks_per_node`` nodes, ranks contiguous per node."""

    world_size: int
    ranks_per_node: int = 1

    def __post_init__(self):
        check_count("world_size", self.world_size)
        check_count("ranks_per_node", self.ranks_per_node)
        if self.world_size % self.ranks_per_node:
            raise SpecError(f"ranks_per_node {self.ranks_per_node} does not divide world_size {self.world_size}: "
                            f"every node must run the same number of ranks")

    @property
    def n_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node_of_rank(self) -> np.ndarray:
        """int64[P]: the node of each rank."""
        return np.arange(self.world_size, dtype=np.int64) // self.ranks_per_node

    def ranks_of(self, node: int) -> range:
        if not 0 <= node < self.n_nodes:
            raise SpecError(f"node must be in [0, {self.n_nodes}), got {node!r}")
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    @classmethod
    def from_topology(cls, topo) -> "NodeMap":
        """From a :class:`solar.topology.Topology` (its ints only); the nodes must be equal."""
        if topo.world_size != topo.nodes * topo.local_size:
            raise SpecError(f"topology of {topo.world_size} ranks on {topo.nodes} nodes of {topo.local_size} "
                            f"ranks: node planning needs the same number of ranks on every node")
        return cls(topo.world_size, topo.local_size)


def _check_rate(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value > 0):
        raise SpecError(f"{name} must be a finite number of bytes per second > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class PeerCost:
    """Network and storage bandwidths (bytes/s) deciding transfer vs storage read, per block."""

    network_bytes_per_s: float = DEFAULT_NETWORK_BPS
    storage_bytes_per_s: float = DEFAULT_STORAGE_BPS

    def __post_init__(self):
        object.__setattr__(self, "network_bytes_per_s", _check_rate("network_bytes_per_s", self.network_bytes_per_s))
        object.__setattr__(self, "storage_bytes_per_s", _check_rate("storage_bytes_per_s", self.storage_bytes_per_s))

    def peer_ok(self, nbytes: np.ndarray, stored: np.ndarray) -> np.ndarray:
        """bool[B]: sending a block's ``nbytes`` (decoded) is faster than reading its ``stored`` bytes.

        Compared as ``nbytes * storage_bps < stored * network_bps`` (no division)."""
        nb = np.asarray(nbytes, dtype=np.float64)
        st = np.asarray(stored, dtype=np.float64)
        return nb * self.storage_bytes_per_s < st * self.network_bytes_per_s

    def to_dict(self) -> dict:
        return {"network_bytes_per_s": self.network_bytes_per_s, "storage_bytes_per_s": self.storage_bytes_per_s}


def split_to_ranks(node_of_pos: np.ndarray, bounds: np.ndarray, nodes: NodeMap) -> np.ndarray:
    """int32[T]: the rank of each position, from its node, splitting each node's samples of a step
    over its L ranks as evenly as possible (the first ``c % L`` ranks take one more), in index order.

    ``node_of_pos`` int32[T] (node of each position), ``bounds`` int64[S+1] (global batches).  A node
    that took c samples with ``L*lo <= c <= L*hi`` gives each rank ``floor(c/L)`` or ``ceil(c/L)``
    samples, both within ``[lo, hi]``: node-level count bounds give rank-level ones.
    """
    L = nodes.ranks_per_node
    node_of_pos = np.asarray(node_of_pos)
    if L == 1:
        return node_of_pos.astype(np.int32)
    rank = np.empty(node_of_pos.shape[0], dtype=np.int32)
    _split_steps(node_of_pos, np.asarray(bounds, dtype=np.int64), nodes.n_nodes, L, rank)
    return rank


@nb.njit(cache=True, nogil=True)
def _split_steps(node_of_pos, bounds, Q, L, rank):
    """split_to_ranks' loop: one pass over each step's positions to count each node's samples, one to give
    each its rank (a single O(T) pass over the epoch in order; a sort of (step, node) keys took 0.2 s per
    epoch at 1M samples)."""
    cnt = np.zeros(Q, np.int64)
    seen = np.zeros(Q, np.int64)
    for k in range(bounds.shape[0] - 1):
        cnt[:] = 0
        seen[:] = 0
        for p in range(bounds[k], bounds[k + 1]):
            cnt[node_of_pos[p]] += 1
        for p in range(bounds[k], bounds[k + 1]):
            n = node_of_pos[p]
            j = seen[n]  # rank of the position among its node's samples of the step, index order
            seen[n] = j + 1
            q, rem = cnt[n] // L, cnt[n] % L
            big = rem * (q + 1)  # positions taken by the first `rem` ranks (q + 1 each)
            rank[p] = n * L + (j // (q + 1) if j < big else rem + (j - big) // max(q, 1))
