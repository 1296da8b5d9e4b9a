"""What the buffer manager hands out and counts, whatever its place: a step's blocks and where each
lives (:class:`StepBlocks`), what a step cost (:class:`StepStats`) and the sums (:class:`BufferTotals`),
and a booked step on its way to being assembled (:class:`Booked`)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict

import numpy as np

from ..errors import SolarError


class BufferError(SolarError):
    pass


class Closed(Exception):
    """The consumer closed the buffer while the prefetch thread waited."""


@dataclass
class StepStats:
    """What one step cost (filled by the prefetch thread, ``stall_s`` by the consumer)."""

    step: int
    samples: int = 0
    hits: int = 0                # blocks the plan said were resident, and were
    hit_bytes: int = 0           # their decoded bytes
    misses: int = 0              # blocks loaded for this step
    bytes_loaded: int = 0        # decoded bytes loaded
    bytes_read: int = 0          # storage bytes read (coalescing gaps included)
    stored_bytes: int = 0        # stored bytes of the blocks loaded (what the plan counts: no gaps)
    n_reads: int = 0
    read_s: float = 0.0
    assemble_s: float = 0.0
    stall_s: float = 0.0         # time the training loop waited for this step
    plan_violations: int = 0     # blocks the plan called hits that were not resident (read anyway)
    book_wait_s: float = 0.0     # time from its place first refusing to book it (no free slots yet) to its booking


@dataclass
class BufferTotals:
    """Exact sums over every step taken; ``per_step``: the :class:`StepStats` of the last
    ``keep_step_stats`` steps only (a ring: memory stays flat however long the run)."""

    steps: int = 0
    samples: int = 0
    hits: int = 0
    hit_bytes: int = 0
    misses: int = 0
    bytes_loaded: int = 0
    bytes_read: int = 0
    stored_bytes: int = 0
    n_reads: int = 0
    read_s: float = 0.0
    assemble_s: float = 0.0
    stall_s: float = 0.0
    plan_violations: int = 0
    book_wait_s: float = 0.0
    per_step: Deque[StepStats] = field(default_factory=deque)

    def add(self, s: StepStats):
        self.steps += 1
        for k in ("samples", "hits", "hit_bytes", "misses", "bytes_loaded", "bytes_read", "stored_bytes", "n_reads",
                  "read_s", "assemble_s", "stall_s", "plan_violations", "book_wait_s"):
            setattr(self, k, getattr(self, k) + getattr(s, k))
        if self.per_step.maxlen != 0:
            self.per_step.append(s)


@dataclass
class Booked:
    """A step booked (its slots taken, its reads submitted), not yet assembled."""

    g: int
    samples: np.ndarray
    blocks: "StepBlocks"
    stats: StepStats
    fut: Any                     # the read of this rank's part (None: nothing to read)
    t0: float
    pending: Any = None          # device pools: the staged reads to copy into their slots (commit)
    recvs: list = field(default_factory=list)  # node pools: receive requests (local rank 0)
    wakes: tuple = ()            # node pools: the reads whose completion wakes the polling prefetch thread


def step_blocks(sample_ptr: np.ndarray, sample_blocks: np.ndarray, samples: np.ndarray) -> np.ndarray:
    """int64[m] ascending: the distinct blocks of ``samples`` (their CSR rows gathered).  Called once per step on
    the prefetch thread: samples with as many blocks each (the common case) take a shorter path."""
    lo, hi = sample_ptr[samples], sample_ptr[samples + 1]
    counts = hi - lo
    if not counts.shape[0]:
        return np.zeros(0, np.int64)
    k = int(counts[0])
    if (counts == k).all():
        pos = (lo[:, None] + np.arange(k, dtype=np.int64)).reshape(-1)
    else:
        run_start = np.cumsum(counts) - counts  # (n,) where each sample's run begins in the output
        pos = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(lo - run_start, counts)
    return sorted_unique(np.asarray(sample_blocks[pos], dtype=np.int64))


def sorted_unique(x: np.ndarray) -> np.ndarray:
    """``numpy.unique(x)`` for a 1-D array, with less overhead for the few hundred ids of a step."""
    x = np.sort(x)
    if x.shape[0] < 2:
        return x
    keep = np.empty(x.shape[0], dtype=bool)
    keep[0] = True
    np.not_equal(x[1:], x[:-1], out=keep[1:])
    return x[keep]


def check_distinct(g: int, blocks: np.ndarray, verb: str) -> None:
    """BufferError when a step's plan names a block twice in one list (a damaged plan)."""
    if blocks.shape[0] > 1:
        srt = np.sort(blocks)
        dup = np.flatnonzero(srt[1:] == srt[:-1])
        if dup.size:
            raise BufferError(f"step {g}: the plan {verb} block {int(srt[dup[0]])} twice (damaged plan?)")


def read_outside(reader, missing: np.ndarray, block_nbytes: np.ndarray, st: StepStats) -> Dict[int, np.ndarray]:
    """Blocks the plan said were resident and are not: counted (``plan_violations``) and read on the spot, so
    that nothing wrong is delivered; ``{block: bytes}``.  Read by this rank alone (``read_alone``): the other ranks
    make no such call, so a collective reader's sequence of calls must not see it."""
    if not missing.size:
        return {}
    st.plan_violations = int(missing.shape[0])
    bufs = [np.empty(int(block_nbytes[b]), np.uint8) for b in missing.tolist()]
    getattr(reader, "read_alone", reader.read_blocks)(missing, bufs)  # (a stand-in reader may have read_blocks only)
    return dict(zip(missing.tolist(), bufs))


class StepBlocks:
    """The blocks a step's samples need and where each lives, fixed when the step was booked.

    ``blocks`` int64[m] ascending; ``block_class``/``block_slot`` int64[m]: the slot in
    ``pools`` (slot -1: not in the pools, held in ``extra`` instead: blocks the plan
    wrongly called hits, read on the spot).  Called with a block id it returns that
    block's decoded bytes (uint8 view, ``block_nbytes`` long), as the ``lookup`` of
    :class:`~solar.buffer.BufferManager`'s ``assemble`` callable.
    """

    __slots__ = ("step", "blocks", "block_class", "block_slot", "pools", "block_nbytes", "extra")

    def __init__(self, step, blocks, block_class, block_slot, pools, block_nbytes, extra):
        self.step, self.blocks, self.block_class, self.block_slot = step, blocks, block_class, block_slot
        self.pools, self.block_nbytes, self.extra = pools, block_nbytes, extra

    @property
    def in_pools(self) -> bool:
        """Every block lives in a pool slot (none read outside the plan)."""
        return not self.extra

    def __call__(self, b: int) -> np.ndarray:
        j = int(np.searchsorted(self.blocks, b))
        if j < self.blocks.shape[0] and self.blocks[j] == b:
            if self.block_slot[j] >= 0:
                arr = self.pools.arrays[int(self.block_class[j])][int(self.block_slot[j])]
                return arr[:int(self.block_nbytes[b])]
            return self.extra[int(b)]
        raise BufferError(f"step {self.step}: block {b} is not among the step's blocks")
