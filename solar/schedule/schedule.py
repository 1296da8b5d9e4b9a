"""Open and query a schedule file: :class:`Schedule` (job-wide) and :class:`RankPlan` (one rank)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, Optional

import h5py
import numpy as np

from ..errors import SolarError
from ..scheduler.config import PlanConfig
from .format import FORMAT, RANK_LISTS, STATS, VERSION, array_digest, header_digest


class ScheduleError(SolarError):
    """A schedule file that cannot be used: damaged, truncated, or made for another job."""


def _ptr(count: np.ndarray) -> np.ndarray:
    out = np.zeros(count.shape[0] + 1, dtype=np.int64)
    np.cumsum(count, out=out[1:])
    return out


@dataclass(frozen=True)
class StepPlan:
    """What one rank does at one global step: evict, then load, then train on ``samples``."""

    step: int
    samples: np.ndarray
    load: np.ndarray
    evict: np.ndarray
    hits: int
    hit_bytes: int
    misses: int
    miss_bytes: int
    stored_bytes: int


class RankPlan:
    """One rank's slice of the schedule; arrays over its G = E*S global steps.

    ``samples``/``load``/``evict`` are id arrays with int64[G+1] pointers
    ``samples_ptr``/``load_ptr``/``evict_ptr``; ``stats`` is int64[G, 5]
    (hits, hit_bytes, misses, miss_bytes, stored_bytes as the planner predicts).
    """

    def __init__(self, rank: int, arrays: Dict[str, np.ndarray]):
        self.rank = rank
        for name in RANK_LISTS:
            setattr(self, name, arrays[name])
            setattr(self, name + "_ptr", _ptr(arrays[name + "_count"]))
        self.stats = arrays["stats"]

    @property
    def n_steps(self) -> int:
        return int(self.stats.shape[0])

    def step(self, g: int) -> StepPlan:
        if not 0 <= g < self.n_steps:
            raise IndexError(f"global step {g} out of range [0, {self.n_steps})")
        sl = {n: getattr(self, n)[getattr(self, n + "_ptr")[g]:getattr(self, n + "_ptr")[g + 1]] for n in RANK_LISTS}
        return StepPlan(g, sl["samples"], sl["load"], sl["evict"], *(int(x) for x in self.stats[g]))

    def predicted(self) -> Dict[str, int]:
        tot = self.stats.sum(axis=0)
        return {k: int(v) for k, v in zip(STATS, tot)}


class Schedule:
    """A planned job, opened from its file (``Schedule.load``) or returned by ``solar.plan``.

    Job-wide figures are read when opened; a rank's slice is read (and its
    checksums verified) only when asked for with :meth:`rank`.
    """

    def __init__(self, h5: h5py.File, path: str, verify: bool = True):
        self._f, self.path, self.verify = h5, path, verify
        a = h5.attrs
        if a.get("format") != FORMAT:
            raise ScheduleError(f"{path}: not a solar schedule file (format attribute {a.get('format')!r})")
        if int(a.get("version", -1)) != VERSION:
            raise ScheduleError(f"{path}: schedule format version {a.get('version')}, this solar reads {VERSION}; "
                                f"re-run solar plan")
        if int(a.get("complete", 0)) != 1:
            raise ScheduleError(f"{path}: incomplete schedule (the planner did not finish writing it)")
        if header_digest(a) != a.get("header_sha256"):
            raise ScheduleError(f"{path}: header checksum mismatch: the file is damaged")
        self.config = PlanConfig(**json.loads(a["config"]))
        self.policy = str(a["policy"])
        self.fingerprint = str(a["fingerprint"])
        self.source = str(a["source"])
        self.n_samples, self.n_blocks = int(a["n_samples"]), int(a["n_blocks"])
        self.steps_per_epoch = int(a["steps_per_epoch"])
        self.solar_version = str(a["solar_version"])
        self.epoch_order = self._read("epochs/source_epoch")
        self._epochs = {k: self._read(f"epochs/{k}") for k in ("hit_bytes", "miss_bytes", "stored_bytes",
                                                                "demand_bytes", "max_local_batch", "min_local_batch",
                                                                "rank_miss_bytes")}
        self._ranks: Dict[int, RankPlan] = {}
        self._demand: Optional[Dict[str, np.ndarray]] = None

    # ------------------------------------------------------------------ open
    @classmethod
    def load(cls, path: str, *, layout=None, fingerprint: Optional[str] = None, world_size: Optional[int] = None,
             verify: bool = True) -> "Schedule":
        """Open ``path``; with ``layout``/``fingerprint``/``world_size`` also check it fits this job."""
        if not os.path.exists(path):
            raise ScheduleError(f"no schedule file {path!r} (make one with solar plan)")
        try:
            h5 = h5py.File(path, "r", locking=False)
        except OSError as exc:
            raise ScheduleError(f"{path}: cannot open as a schedule (damaged or truncated file?): "
                                f"{str(exc).splitlines()[0]}") from None
        try:
            s = cls(h5, path, verify)
        except (KeyError, OSError, ValueError) as exc:
            h5.close()
            raise ScheduleError(f"{path}: damaged schedule file ({type(exc).__name__}: {exc})") from None
        except BaseException:
            h5.close()
            raise
        s.check(layout=layout, fingerprint=fingerprint, world_size=world_size)
        return s

    def check(self, *, layout=None, fingerprint: Optional[str] = None, world_size: Optional[int] = None):
        """Raise :class:`ScheduleError` if this schedule was made for another dataset or world size."""
        if layout is not None:
            fingerprint = layout.fingerprint
        if fingerprint is not None and fingerprint != self.fingerprint:
            raise ScheduleError(
                f"{self.path}: schedule was planned for another dataset or an older version of it (layout "
                f"fingerprint {self.fingerprint[:12]}, the data now has {fingerprint[:12]}); re-run solar plan")
        if world_size is not None and int(world_size) != self.world_size:
            raise ScheduleError(f"{self.path}: schedule was planned for world size {self.world_size}, "
                                f"the job has {world_size} ranks")

    def close(self):
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"Schedule({self.path!r}, policy={self.policy}, world_size={self.world_size}, epochs={self.epochs}, "
                f"steps_per_epoch={self.steps_per_epoch})")

    def _read(self, name: str) -> np.ndarray:
        try:
            ds = self._f[name]
            arr = ds[()]
        except KeyError:
            raise ScheduleError(f"{self.path}: damaged schedule file: {name} is missing") from None
        except OSError as exc:
            raise ScheduleError(f"{self.path}: cannot read {name} (damaged or truncated file?): "
                                f"{str(exc).splitlines()[0]}") from None
        if self.verify and array_digest(arr) != ds.attrs.get("sha256"):
            raise ScheduleError(f"{self.path}: checksum mismatch in {name}: the file is damaged")
        return arr

    # ----------------------------------------------------------------- shape
    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def epochs(self) -> int:
        return self.config.epochs

    @property
    def local_batch(self) -> int:
        return self.config.local_batch

    @property
    def buffer_bytes(self) -> int:
        return self.config.buffer_bytes

    @property
    def n_steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def source_epoch(self, e: int) -> int:
        """Which DistributedSampler epoch (``set_epoch`` value) is trained at position ``e``."""
        if not 0 <= e < self.epochs:
            raise IndexError(f"epoch {e} out of range [0, {self.epochs})")
        return int(self.epoch_order[e])

    # ----------------------------------------------------------------- ranks
    def rank(self, r: int) -> RankPlan:
        """Rank ``r``'s slice (read once, checksums verified)."""
        if not 0 <= r < self.world_size:
            raise ScheduleError(f"rank {r} out of range: the schedule has world size {self.world_size}")
        if r not in self._ranks:
            names = [n for x in RANK_LISTS for n in (x, x + "_count")] + ["stats"]
            arrays = {n: self._read(f"ranks/{r}/{n}") for n in names}
            G = self.n_steps
            for n in names:
                if n.endswith("_count") and arrays[n].shape != (G,):
                    raise ScheduleError(f"{self.path}: rank {r} has {arrays[n].shape[0]} steps of {n}, expected {G}")
            for x in RANK_LISTS:
                if int(arrays[x + "_count"].sum()) != arrays[x].shape[0]:
                    raise ScheduleError(f"{self.path}: rank {r}: {x} counts do not add up (damaged file)")
            self._ranks[r] = RankPlan(r, arrays)
        return self._ranks[r]

    def batch(self, e: int, step: int, rank: int) -> np.ndarray:
        """Sample ids rank ``rank`` trains on at step ``step`` of epoch position ``e``."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} out of range [0, {self.steps_per_epoch})")
        self.source_epoch(e)
        return self.rank(rank).step(e * self.steps_per_epoch + step).samples

    def demand(self) -> Dict[str, np.ndarray]:
        """The sample -> blocks map and block sizes the plan was made for."""
        if self._demand is None:
            self._demand = {k: self._read(f"demand/{k}") for k in ("sample_ptr", "sample_blocks", "block_nbytes",
                                                                  "block_stored")}
        return self._demand

    # ------------------------------------------------------------ prediction
    def predicted(self) -> Dict[str, list]:
        """Predicted per-epoch totals over ranks (bytes), and hit rates."""
        e = self._epochs
        hit_rate = [float(1.0 - m / d) if d else 0.0 for m, d in zip(e["miss_bytes"], e["demand_bytes"])]
        m, d = e["miss_bytes"][1:], e["demand_bytes"][1:]
        if m.size == 0:
            m, d = e["miss_bytes"], e["demand_bytes"]
        steady = float(1.0 - m.sum() / d.sum()) if d.sum() else 0.0
        return {"hit_bytes": e["hit_bytes"].tolist(), "miss_bytes": e["miss_bytes"].tolist(),
                "storage_bytes": e["stored_bytes"].tolist(), "demand_bytes": e["demand_bytes"].tolist(),
                "hit_rate": hit_rate, "steady_hit_rate": steady,
                "max_local_batch": e["max_local_batch"].tolist(), "min_local_batch": e["min_local_batch"].tolist(),
                "rank_miss_bytes": e["rank_miss_bytes"].tolist()}

    def summary(self) -> dict:
        p = self.predicted()
        return {"path": self.path, "policy": self.policy, "solar_version": self.solar_version,
                "fingerprint": self.fingerprint, "source": self.source, "config": self.config.to_dict(),
                "n_samples": self.n_samples, "n_blocks": self.n_blocks, "steps_per_epoch": self.steps_per_epoch,
                "source_epochs": self.epoch_order.tolist(), "file_bytes": _file_size(self.path), **p}


def _file_size(path: str) -> Optional[int]:
    try:
        return os.path.getsize(path)
    except OSError:
        return None
