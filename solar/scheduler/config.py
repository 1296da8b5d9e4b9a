"""Planner inputs, frozen and validated when built (errors name the bad value)."""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass

from ..errors import SpecError

MAX_BYTES = 2**62  # largest byte size accepted: more than any machine holds, and int64 sums of it stay exact

MAX_EPOCHS = 10**6
"""Most epochs a job may have (``epochs``, an open-ended ``window``, the epoch of a loader state).

Planning is sequential (each epoch starts from the buffers the one before left) and its per-epoch
totals are kept, so a job of E epochs costs O(E) time and memory before its first batch: a million
epochs is more than any training job runs (a full-batch job of one step per epoch included), while
2**31 took 8 GB before planning began and a loader state at step 10**12 planned for ever.  Far
beyond it, DistributedSampler cannot even seed the epoch: torch's seed, ``seed + epoch``, must fit
64 bits."""


def check_count(name: str, value) -> int:
    """``value`` if it is a positive integer (not a bool), else :class:`SpecError` naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_epochs(name: str, value) -> int:
    """``value`` if it is a positive integer of at most :data:`MAX_EPOCHS`, else :class:`SpecError` naming
    ``name``, the value and the limit."""
    check_count(name, value)
    if value > MAX_EPOCHS:
        raise SpecError(f"{name} must be at most {MAX_EPOCHS:,} (solar.scheduler.config.MAX_EPOCHS: planning is "
                        f"sequential, epoch after epoch), got {value!r}")
    return value


def check_state_epoch(epoch: int, seed: int, step=None) -> int:
    """``epoch`` if a job can reach it (below :data:`MAX_EPOCHS`), else :class:`SpecError` naming it (and the
    ``step`` it was found from), the limit and, beyond 64 bits, that DistributedSampler cannot seed it."""
    if 0 <= epoch < MAX_EPOCHS:
        return epoch
    where = f"step {step} is in epoch {epoch}" if step is not None else f"epoch {epoch}"
    why = (f"; DistributedSampler cannot even seed it (seed {seed} + epoch must fit 64 bits)"
           if seed + epoch >= 2**64 else "")
    raise SpecError(f"{where}, beyond the {MAX_EPOCHS:,} epochs a job may have "
                    f"(solar.scheduler.config.MAX_EPOCHS){why}")


def check_fraction(name: str, value) -> float:
    """``value`` as a float if it is finite and > 0 (a buffer fraction), else :class:`SpecError`."""
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise SpecError(f"{name} must be a number > 0, got {value!r}") from None
    if not (math.isfinite(f) and f > 0):
        raise SpecError(f"{name} must be a finite number > 0, got {value!r}")
    return f


@dataclass(frozen=True)
class PlanConfig:
    """The job a schedule is planned for.

    ``buffer_bytes`` is the per-rank budget of decoded blocks; ``epsilon`` bounds
    per-rank sample counts to ``[ceil(b(1-eps)), floor(b(1+eps))]`` (0: exactly b).
    """

    world_size: int
    local_batch: int
    epochs: int
    buffer_bytes: int
    seed: int = 0
    drop_last: bool = False
    epsilon: float = 0.0

    def __post_init__(self):
        for name in ("world_size", "local_batch"):
            check_count(name, getattr(self, name))
        check_epochs("epochs", self.epochs)
        b = self.buffer_bytes
        if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b <= MAX_BYTES:
            raise SpecError(f"buffer_bytes must be an integer in [0, 2**62], got {b!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63:
            # DistributedSampler seeds torch's generator with seed + epoch, which must fit 64 bits
            raise SpecError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        object.__setattr__(self, "drop_last", check_drop_last(self.drop_last))
        object.__setattr__(self, "epsilon", check_epsilon(self.epsilon))

    def to_dict(self) -> dict:
        return asdict(self)


def check_epsilon(v) -> float:
    """``v`` as a float in [0, 1), else a SpecError naming it (also for nan, strings, bools)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 <= v < 1:
        raise SpecError(f"epsilon must be in [0, 1), got {v!r}")
    return float(v)


def check_drop_last(v) -> bool:
    """``v`` as a bool (True/False, or 1/0), else a SpecError: ``bool("no")`` would be True."""
    if isinstance(v, str) or v not in (True, False):
        raise SpecError(f"drop_last must be True or False, got {v!r}")
    return bool(v)


def parse_bytes(text) -> int:
    """'2GiB', '512MB', '1.5e9', 1000 -> bytes (binary and decimal units), at most :data:`MAX_BYTES`."""
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
             "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    if isinstance(text, bool):
        raise SpecError(f"cannot read a byte size from {text!r}")
    if isinstance(text, (int, float)):
        val, unit = text, ""
    else:
        s = str(text).strip()
        i = len(s)
        while i > 0 and s[i - 1].isalpha():
            i -= 1
        num, unit = s[:i].strip(), s[i:].lower()
        try:
            val = float(num)
        except ValueError:
            raise SpecError(f"cannot read a byte size from {text!r} (try 2GiB, 512MB, 1e9)") from None
        if unit not in units:
            raise SpecError(f"cannot read a byte size from {text!r} (units: {', '.join(sorted(set(units) - {''}))})")
    if not (math.isfinite(val) and val >= 0):
        raise SpecError(f"byte size must be a finite number >= 0, got {text!r}")
    if val * units[unit] > MAX_BYTES:
        raise SpecError(f"byte size {text!r} is more than 2**62 bytes (4 EiB): no machine has that much memory")
    return int(val * units[unit])
