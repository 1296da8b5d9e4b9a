"""Size classes and pool slots per class, from a rank's (or a node's) load/evict lists (pure)."""
from __future__ import annotations

import numpy as np

MAX_EXACT_CLASSES = 32


def size_classes(block_nbytes: np.ndarray):
    """``block_nbytes`` int64[B] -> ``(class_of int32[B], class_bytes int64[C])``.

    Exact sizes while there are at most 32 distinct ones; beyond that sizes are
    rounded up to powers of two (at most 2x slack for the odd-sized blocks).
    """
    nb = np.asarray(block_nbytes, dtype=np.int64)
    sizes = np.unique(nb)
    if sizes.shape[0] > MAX_EXACT_CLASSES:
        rounded = np.where(nb > 0, 1 << np.ceil(np.log2(np.maximum(nb, 1))).astype(np.int64), 0)
        sizes, class_of = np.unique(rounded, return_inverse=True)
        return class_of.astype(np.int32).reshape(-1), sizes
    class_of = np.searchsorted(sizes, nb).astype(np.int32)
    return class_of, sizes


def slots_needed(class_of: np.ndarray, n_classes: int, load: np.ndarray, load_ptr: np.ndarray,
                 evict: np.ndarray, evict_ptr: np.ndarray, window: int = 0) -> np.ndarray:
    """int64[C]: the most slots of each class in use at once over the plan's G steps.

    ``load``/``evict`` hold block ids with int64[G+1] pointers (one rank's plan).
    With reads of several steps in flight, a slot evicted at step q is reused once
    the last step that touched its block is assembled, at the latest step q-1: counted
    at that latest, ``window`` steps of evictions stay held on top of the resident
    blocks (0: the plan's own peak), an upper bound of what the buffer holds.
    """
    G = load_ptr.shape[0] - 1
    delta = np.zeros((G, n_classes), dtype=np.int64)  # (G, C) resident change per step
    step_of_load = np.repeat(np.arange(G), np.diff(load_ptr))
    step_of_evict = np.repeat(np.arange(G), np.diff(evict_ptr))
    np.add.at(delta, (step_of_load, class_of[load]), 1)
    np.add.at(delta, (step_of_evict, class_of[evict]), -1)
    resident = np.cumsum(delta, axis=0)  # (G, C) resident count after each step
    if not G:
        return np.zeros(n_classes, dtype=np.int64)
    if window > 0:
        ev = np.zeros((G + 1, n_classes), dtype=np.int64)  # (G+1, C) cumulative evictions
        np.add.at(ev, (step_of_evict + 1, class_of[evict]), 1)
        ev = np.cumsum(ev, axis=0)
        lag = np.maximum(np.arange(1, G + 1) - window, 0)  # evictions of steps (p - window, p] still held
        resident = resident + ev[1:] - ev[lag]
    return resident.max(axis=0, initial=0)


def pool_slots(base: np.ndarray, want: np.ndarray, class_bytes: np.ndarray, room: int) -> np.ndarray:
    """int64[C] slots per class: ``base`` (the plan's residency, always given), plus as much of
    ``want - base`` (slots held for reads in flight) as fits in ``room`` bytes of pools in all.

    The extra is shared in proportion to each class's wish (whole slots, rounded down), so
    ``(result * class_bytes).sum() <= max(room, (base * class_bytes).sum())``.
    """
    base = np.asarray(base, np.int64)
    extra = np.maximum(np.asarray(want, np.int64) - base, 0)
    cb = np.asarray(class_bytes, np.int64)
    wish = int((extra * cb).sum())
    free = int(room) - int((base * cb).sum())
    if wish <= free:
        return base + extra
    if free <= 0 or wish == 0:
        return base.copy()
    return base + (extra * free) // wish  # extra_c * cb_c * free / wish <= share of free, whole slots


def plan_pools(class_of, class_bytes, rank_plan, *, window: int, room: int):
    """``(base, slots)`` int64[C] each for ``rank_plan`` (a :class:`~solar.schedule.RankPlan`): the
    plan's residency, and that plus slots held for ``window`` steps of reads in flight as far as
    ``room`` bytes of pools allow."""
    args = (class_of, class_bytes.shape[0], np.asarray(rank_plan.load, np.int64), rank_plan.load_ptr,
            np.asarray(rank_plan.evict, np.int64), rank_plan.evict_ptr)
    base = slots_needed(*args, window=0)
    want = slots_needed(*args, window=window) if window > 0 else base
    return base, pool_slots(base, want, class_bytes, room)



def largest_step_load(load: np.ndarray, load_ptr: np.ndarray, nbytes: np.ndarray):
    """``(bytes, step)`` of the step whose loads take the most of ``nbytes`` (bytes per block: a device buffer
    stages them in rows of their size class's width); ``(0, 0)`` without loads."""
    load, ptr = np.asarray(load, np.int64), np.asarray(load_ptr, np.int64)
    if not load.shape[0]:
        return 0, 0
    csum = np.concatenate(([0], np.cumsum(np.asarray(nbytes, np.int64)[load])))
    per = csum[ptr[1:]] - csum[ptr[:-1]]
    g = int(per.argmax())
    return int(per[g]), g
