"""Planner inputs, frozen and validated when built (errors name the bad value)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import SpecError


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
        for name in ("world_size", "local_batch", "epochs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SpecError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.buffer_bytes, int) or self.buffer_bytes < 0:
            raise SpecError(f"buffer_bytes must be a non-negative integer, got {self.buffer_bytes!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise SpecError(f"seed must be a non-negative integer, got {self.seed!r}")
        if not 0 <= float(self.epsilon) < 1:
            raise SpecError(f"epsilon must be in [0, 1), got {self.epsilon!r}")
        object.__setattr__(self, "drop_last", bool(self.drop_last))
        object.__setattr__(self, "epsilon", float(self.epsilon))

    def to_dict(self) -> dict:
        return asdict(self)


def parse_bytes(text) -> int:
    """'2GiB', '512MB', '1.5e9', 1000 -> bytes (binary and decimal units)."""
    if isinstance(text, (int, float)):
        return int(text)
    s = str(text).strip()
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
             "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    i = len(s)
    while i > 0 and s[i - 1].isalpha():
        i -= 1
    num, unit = s[:i].strip(), s[i:].lower()
    try:
        val = float(num)
    except ValueError:
        raise SpecError(f"cannot read a byte size from {text!r} (try 2GiB, 512MB, 1e9)") from None
    if unit not in units or val < 0:
        raise SpecError(f"cannot read a byte size from {text!r} (units: {', '.join(sorted(set(units) - {''}))})")
    return int(val * units[unit])
