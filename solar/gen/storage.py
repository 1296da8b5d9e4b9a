"""How the generator stores datasets: contiguous, chunked, compressed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import SpecError

STORAGE_PRESETS = {
    "contiguous": dict(chunk_samples=0),
    "chunked": dict(chunk_samples=1),
    "multi": dict(chunk_samples=4),
    "gzip": dict(chunk_samples=4, compression="gzip"),
    "lzf": dict(chunk_samples=4, compression="lzf", shuffle=True),
}


@dataclass(frozen=True)
class Storage:
    """Storage of generated datasets.

    ``chunk_samples``: 0 = contiguous; K >= 1 = chunks of K samples along the
    sample axis (K frames along time for trajectories; files that hold one
    sample per dataset use h5py's automatic chunking).
    """

    chunk_samples: int = 0
    compression: Optional[str] = None
    shuffle: bool = False
    fletcher32: bool = False

    def __post_init__(self):
        if not isinstance(self.chunk_samples, int) or self.chunk_samples < 0:
            raise SpecError(f"chunk_samples must be an integer >= 0, got {self.chunk_samples!r}")
        if self.compression not in (None, "gzip", "lzf"):
            raise SpecError(f"compression must be gzip, lzf or none, got {self.compression!r}")
        if self.chunk_samples == 0 and (self.compression or self.shuffle or self.fletcher32):
            raise SpecError("compression, shuffle and checksums need chunked storage (chunk_samples >= 1)")

    @classmethod
    def preset(cls, name: str, **over) -> "Storage":
        if name not in STORAGE_PRESETS:
            raise SpecError(f"unknown storage {name!r}; valid: {', '.join(STORAGE_PRESETS)}")
        kw = dict(STORAGE_PRESETS[name])
        kw.update({k: v for k, v in over.items() if v is not None})
        return cls(**kw)

    @property
    def label(self) -> str:
        if self.chunk_samples == 0:
            return "contiguous"
        s = f"chunked x{self.chunk_samples}"
        if self.compression:
            s += f" {self.compression}"
        if self.shuffle:
            s += "+shuffle"
        if self.fletcher32:
            s += "+fletcher32"
        return s

    def kwargs(self, shape, lead_axes: int) -> dict:
        """``create_dataset`` keyword arguments for a dataset of ``shape``.

        ``lead_axes``: 1 = samples on axis 0; 2 = trajectories on axis 0 and
        time on axis 1 (chunk K frames); 0 = one sample per dataset (auto chunks).
        """
        if self.chunk_samples == 0:
            return {}
        if lead_axes == 0:
            chunks = True
        elif lead_axes == 1:
            chunks = (min(self.chunk_samples, shape[0]),) + tuple(shape[1:])
        else:
            chunks = (1, min(self.chunk_samples, shape[1])) + tuple(shape[2:])
        kw = dict(chunks=chunks)
        if self.compression == "gzip":
            kw.update(compression="gzip", compression_opts=4)
        elif self.compression == "lzf":
            kw.update(compression="lzf")
        if self.shuffle:
            kw["shuffle"] = True
        if self.fletcher32:
            kw["fletcher32"] = True
        return kw
