"""Registry of loading policies; all run on the same engine with the same inputs.

=============  =============================  ===============  =========================
name           assignment                     eviction         next use known
=============  =============================  ===============  =========================
``torch``      DistributedSampler (strided)   LRU per rank     no
``nopfs``      DistributedSampler (strided)   Belady per rank  per-rank future
``solar2023``  holder-first in the first      FIFO per rank    no
               buffer/global-batch steps of
               an epoch, misses dealt evenly
``solar``      every step: to the rank that   Belady, global   global future
               holds the sample's bytes       next use
``ideal``      one global buffer of P x       Belady           global future
               budget, no balance constraint
=============  =============================  ===============  =========================
"""
from __future__ import annotations

from dataclasses import dataclass

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


POLICIES = {
    "torch": Policy("torch", STRIDED, LRU, "none", description="DistributedSampler + per-rank LRU"),
    "nopfs": Policy("nopfs", STRIDED, BELADY, "rank", description="DistributedSampler + per-rank Belady"),
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
