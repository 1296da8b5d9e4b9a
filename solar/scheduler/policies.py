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
from .engine import BELADY, BOUNDARY, FIFO, LRU, ROUTED, STRIDED


@dataclass(frozen=True)
class Policy:
    name: str
    mode: int
    evict: int
    next_use: str  # "none", "global", "rank"
    single_buffer: bool = False
    epoch_order: str = "identity"
    description: str = ""
    lookahead: Optional[int] = 1  # epochs ahead the next-use computation sees; None: all (memory bound)


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


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise SpecError(f"unknown policy {name!r}; valid policies: {', '.join(POLICIES)}") from None
