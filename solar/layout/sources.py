"""Sources: a group of field datasets in one file that share one sample grid.

A :class:`Source` maps its local sample index to a hyperslab of each field:
``rows`` picks row ``i``; ``windows`` picks trajectory ``b`` and frames
``t0, t0+dt, ...``; ``whole`` takes every dataset whole.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np


@dataclass(frozen=True)
class Source:
    """One file's (or group's) fields and how samples index them.

    ``datasets[k]`` indexes ``Layout.datasets``; ``roles[k]`` names its leading
    axes (see :mod:`solar.layout.blocks`).
    """

    kind: str
    file: int
    group: str
    datasets: Tuple[int, ...]
    roles: Tuple[str, ...]
    n_samples: int
    n_traj: int = 1
    n_steps: int = 1
    window: int = 1
    dt: int = 1

    @property
    def windows_per_traj(self) -> int:
        return self.n_steps - self.dt * (self.window - 1)

    def coords(self, local: np.ndarray) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
        """``(index, t0)`` arrays for local sample ids (None where unused)."""
        local = np.asarray(local, dtype=np.int64)
        if self.kind == "rows":
            return local, None
        if self.kind == "windows":
            w = self.windows_per_traj
            return local // w, local % w
        return None, None

    def selection(self, k: int, local: int, ndim: int) -> tuple:
        """Index tuple selecting field ``k`` of local sample ``local`` (ints drop axes)."""
        roles = self.roles[k]
        index, t0 = self.coords(np.array([local]))
        sel = []
        for r in roles:
            if r in "sb":
                sel.append(int(index[0]))
            else:
                start = int(t0[0])
                sel.append(slice(start, start + self.dt * (self.window - 1) + 1, self.dt))
        sel.extend([slice(None)] * (ndim - len(roles)))
        return tuple(sel)

    def field_shape(self, k: int, shape: Tuple[int, ...]) -> Tuple[int, ...]:
        """Shape of field ``k`` in one sample."""
        roles = self.roles[k]
        out = []
        for r, s in zip(roles, shape):
            if r == "t":
                out.append(self.window)
        return tuple(out) + tuple(shape[len(roles):])
