"""Preallocated slot pools, one per block size class: the buffer's memory."""
from __future__ import annotations

import numpy as np


class SlotPools:
    """``slots[c]`` fixed-size slots of ``class_bytes[c]`` bytes each, allocated once.

    ``view(c, i)`` is a writable uint8 view of slot i of class c; ``alloc``/``free``
    are O(1) (a free-list stack per class).  Pages are touched only when first
    written, so resident memory grows to what the plan really holds at once.
    """

    def __init__(self, class_bytes: np.ndarray, slots: np.ndarray):
        self.class_bytes = np.asarray(class_bytes, dtype=np.int64)
        self.slots = np.asarray(slots, dtype=np.int64)
        self.arrays = [np.empty((int(n), int(sz)), dtype=np.uint8) for sz, n in zip(self.class_bytes, self.slots)]
        self.free_list = [list(range(int(n) - 1, -1, -1)) for n in self.slots]

    @property
    def capacity_bytes(self) -> int:
        return int((self.class_bytes * self.slots).sum())

    def alloc(self, c: int) -> int:
        fl = self.free_list[c]
        if not fl:
            raise MemoryError(f"no free slot of {int(self.class_bytes[c])} bytes ({int(self.slots[c])} in the pool)")
        return fl.pop()

    def free(self, c: int, i: int) -> None:
        self.free_list[c].append(i)

    def view(self, c: int, i: int) -> np.ndarray:
        return self.arrays[c][i]

    def in_use(self) -> int:
        return int(sum((n - len(fl)) * int(sz) for n, fl, sz in zip(self.slots, self.free_list, self.class_bytes)))
