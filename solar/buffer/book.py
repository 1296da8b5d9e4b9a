"""What a step needs and where it lives, worked out in one GIL-free call when the step is booked.

The prefetch thread books every step; before, this was a dozen numpy calls on the step's few hundred block
ids (the distinct blocks of its samples, which of its loads it uses, their slots, the counts), about 35 us
alone and 75-85 us beside the training thread's Python, a quarter of a 1.5 MiB step's booking.  Pure: arrays
in, arrays out (the rank's ``touched`` and ``mark`` arrays updated in place)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit


class StepNeed(NamedTuple):
    """A booked step's blocks (int64[m] ascending), their size classes and slots (-1: not resident), the blocks
    the plan called resident that are not (int64[k]), and the counts of :class:`~solar.buffer.steps.StepStats`."""

    blocks: np.ndarray
    block_class: np.ndarray
    block_slot: np.ndarray
    missing: np.ndarray
    misses: int
    bytes_loaded: int
    hits: int
    hit_bytes: int


def step_need(g: int, sample_ptr, sample_blocks, samples, load, slot_of, class_of, block_nbytes, touched,
              mark) -> StepNeed:
    """Step ``g`` of samples ``samples`` (int64) loading ``load`` (int64, distinct, their slots taken): its
    distinct blocks (those of ``load`` when it has no samples), each one's class and slot, the misses (loads it
    uses) and hits with their decoded bytes.  ``touched[b] = g`` for its blocks and its loads; ``mark``
    (int64[B], any values below ``g`` on entry) is scratch kept from step to step."""
    need, cls, slot, missing, counts = _step_need(int(g), sample_ptr, sample_blocks, samples, load, slot_of,
                                                  class_of, block_nbytes, touched, mark)
    return StepNeed(need, cls, slot, missing, int(counts[0]), int(counts[1]), int(counts[2]), int(counts[3]))


@njit(nogil=True, cache=True)
def _step_need(g, sample_ptr, sample_blocks, samples, load, slot_of, class_of, block_nbytes, touched, mark):
    n = 0
    for i in range(samples.shape[0]):
        n += sample_ptr[samples[i] + 1] - sample_ptr[samples[i]]
    if samples.shape[0] == 0:
        ids = load.copy()
    else:
        ids = np.empty(n, np.int64)
        n = 0
        for i in range(samples.shape[0]):
            for a in range(sample_ptr[samples[i]], sample_ptr[samples[i] + 1]):
                ids[n] = sample_blocks[a]
                n += 1
    ids.sort()
    m = 0
    for i in range(ids.shape[0]):  # distinct, in place
        if i == 0 or ids[i] != ids[i - 1]:
            ids[m] = ids[i]
            m += 1
    need = ids[:m].copy()
    for i in range(load.shape[0]):
        mark[load[i]] = g
        touched[load[i]] = g
    cls = np.empty(m, np.int64)
    slot = np.empty(m, np.int64)
    counts = np.zeros(4, np.int64)  # misses, bytes loaded, hits, hit bytes
    k = 0
    for i in range(m):
        b = need[i]
        touched[b] = g
        cls[i] = class_of[b]
        slot[i] = slot_of[b]
        if mark[b] == g:
            counts[0] += 1
            counts[1] += block_nbytes[b]
        elif slot[i] < 0:
            k += 1
        else:
            counts[2] += 1
            counts[3] += block_nbytes[b]
    missing = np.empty(k, np.int64)
    k = 0
    for i in range(m):
        if slot[i] < 0 and mark[need[i]] != g:
            missing[k] = need[i]
            k += 1
    return need, cls, slot, missing, counts
