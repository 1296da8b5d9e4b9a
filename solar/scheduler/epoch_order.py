"""Orders in which the E source epochs' permutations are trained (registry).

``identity``  source epoch e at position e (what DistributedSampler does);
``greedy``    SOLAR's idea with a cheap solver: the cost of following epoch i by
              epoch j is the number of the first ``cache`` samples of j that are
              not among the last ``cache`` samples of i (a FIFO buffer's misses);
              nearest-neighbour tour from epoch 0 instead of a particle swarm.
"""
from __future__ import annotations

from typing import Callable, Dict

import numpy as np

from ..errors import SpecError


def identity_order(perms, cache: int) -> np.ndarray:
    return np.arange(len(perms), dtype=np.int64)


def greedy_order(perms, cache: int) -> np.ndarray:
    E = len(perms)
    if E <= 2 or cache <= 0:
        return np.arange(E, dtype=np.int64)
    n = int(max(int(p.max()) for p in perms)) + 1
    cost = np.zeros((E, E), dtype=np.int64)
    for i in range(E):
        held = np.zeros(n, dtype=bool)
        held[perms[i][-cache:]] = True
        for j in range(E):
            if i != j:
                cost[i, j] = cache - int(held[perms[j][:cache]].sum())
    order = [0]
    left = set(range(1, E))
    while left:
        cur = order[-1]
        nxt = min(left, key=lambda j: (cost[cur, j], j))
        order.append(nxt)
        left.remove(nxt)
    return np.array(order, dtype=np.int64)


EPOCH_ORDERS: Dict[str, Callable] = {"identity": identity_order, "greedy": greedy_order}


def get_epoch_order(name: str) -> Callable:
    try:
        return EPOCH_ORDERS[name]
    except KeyError:
        raise SpecError(f"unknown epoch order {name!r}; valid: {', '.join(EPOCH_ORDERS)}") from None
