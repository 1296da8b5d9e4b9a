"""Open-ended schedules: each rank plans the windows after the file's first, in the background.

An open-ended schedule file (``solar plan --epochs auto --window K``) holds epochs ``0..K-1``.
Window ``w`` is epochs ``wK .. (w+1)K - 1`` (global steps ``wKS .. (w+1)KS - 1``, S steps per
epoch).  Every rank runs the same deterministic planner (:class:`~solar.scheduler.run.PlanRun`,
``open_ended=True``) on the schedule's demand and configuration: it plans all ranks' routing,
keeps its own slice, writes no file and talks to no other rank; windows planned one after the
other equal one plan made at once (``tests/test_planner_windows.py``), so all ranks agree.

The engine state at the end of window 0 is rebuilt by replaying the file's window (not stored in
the file): the replay costs planning K epochs once per loader (~0.04 s per epoch at 16k samples,
docs/planner.md), and its predicted per-epoch hits are compared with the file's, so a planner
that would plan differently from the one that wrote the file is refused instead of trusted.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

from ..schedule import RankPlan, ScheduleError
from ..schedule.format import RANK_LISTS
from ..schedule.pack import csr_rank_major, samples_rank_major, split_rows
from ..scheduler.run import Demand, EpochPlan, PlanRun

log = logging.getLogger("solar")


@dataclass
class WindowSlice:
    """One rank's part of window ``w``: per-step lists over its K*S steps and the blocks resident
    when it begins (int64 block ids, ascending)."""

    w: int
    arrays: Dict[str, np.ndarray]  # samples/load/evict id lists, *_count int32[K*S], stats int64[K*S, 5]
    resident: np.ndarray


class WindowPlanner:
    """Plans window after window of an open-ended ``schedule`` for rank ``rank``.

    :meth:`rank_plan` ``(w)`` is a :class:`~solar.schedule.RankPlan` over global steps
    ``0 .. (w+1)KS - 1`` whose steps before window ``w`` are empty except the last, which loads the
    blocks resident when the window begins: a buffer started anywhere in window ``w`` holds what the
    plan holds.  :meth:`prepare` ``(w)`` starts planning window ``w`` in a thread.
    """

    PARTS = (*RANK_LISTS, *(n + "_count" for n in RANK_LISTS), "stats")  # the arrays of a slice

    def __init__(self, schedule, rank: int, first: RankPlan):
        self.schedule, self.rank = schedule, int(rank)
        self.K, self.S, self.P = schedule.window, schedule.steps_per_epoch, schedule.world_size
        self.slices: Dict[int, WindowSlice] = {0: self._first_slice(first)}
        self.run: Optional[PlanRun] = None  # created (and window 0 replayed) by the first extension
        self.planned = 1  # windows planned so far: the engine state is at the end of window planned - 1
        self.n_blocks = schedule.n_blocks
        self._lock = threading.Lock()  # one planner at a time (the thread or the caller)
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._warned = False
        self.plan_s: Dict[int, float] = {}  # seconds spent planning each window (0: the replay)

    def _first_slice(self, first) -> WindowSlice:
        """Window 0's slice: the file's plan of this rank (``first``)."""
        return WindowSlice(0, first.arrays(), np.zeros(0, np.int64))

    # ---------------------------------------------------------------- planning
    def _replay(self) -> PlanRun:
        """A PlanRun at the end of window 0, made by planning the file's epochs again (not recorded)."""
        s, d = self.schedule, self.schedule.demand()
        demand = Demand(d["sample_ptr"], np.asarray(d["sample_blocks"], np.int64), d["block_nbytes"],
                        d["block_stored"], s.fingerprint, s.block_extent(), s.extent_runs)
        t0 = time.perf_counter()
        run = PlanRun(demand, s.config, s.policy, record=False, open_ended=True, nodes=s.nodes, cost=s.peer_cost)
        res = run.advance(self.K)
        want = s.predicted()
        if res.hit_bytes != want["hit_bytes"] or res.miss_bytes != want["miss_bytes"] or \
                res.stored_bytes != want["storage_bytes"] or (s.nodes is not None and res.peer_bytes != want["peer_bytes"]):
            raise ScheduleError(f"{s.path}: planning the file's first window again does not give the file's plan "
                                f"(solar {s.solar_version} wrote it); re-run solar plan")
        run.record = True  # the next windows' load/evict lists are needed
        self.plan_s[0] = time.perf_counter() - t0
        return run

    def _plan_next(self):
        """Plan window ``planned`` and keep this rank's slice of it (drops slices two windows older)."""
        if self.run is None:
            self.run = self._replay()
        w = self.planned
        t0 = time.perf_counter()
        parts = {n: [] for n in self.PARTS}
        self.run.advance((w + 1) * self.K, on_epoch=lambda ep: self._keep(ep, parts))
        arrays = {n: np.concatenate(v) for n, v in parts.items()}
        prev = self.slices[w - 1]
        self.slices[w] = WindowSlice(w, arrays, _resident_after(prev, self.n_blocks))
        self.planned = w + 1
        for old in range(1, w - 1):  # window 0 (the file's) is kept
            self.slices.pop(old, None)
        self.plan_s[w] = time.perf_counter() - t0

    def _keep(self, ep: EpochPlan, parts: Dict[str, list]):
        """Append this rank's part of epoch plan ``ep`` (step-major, all ranks) to ``parts``."""
        P, S, r = self.P, self.S, self.rank
        samples, scount = samples_rank_major(ep.indices, ep.bounds, ep.rank_of, P)
        lists = {"samples": (samples, scount), "load": csr_rank_major(ep.load_ptr, ep.load, S, P),
                 "evict": csr_rank_major(ep.evict_ptr, ep.evict, S, P)}
        for name, (arr, cnt) in lists.items():
            starts = split_rows(cnt)
            parts[name].append(arr[starts[r]:starts[r + 1]].astype(self.schedule.id_dtype))
            parts[name + "_count"].append(cnt[r].astype(np.int32))
        stats = np.stack([ep.hits, ep.hit_bytes, ep.misses, ep.miss_bytes, ep.stored_bytes], axis=-1)  # (S, P, 5)
        parts["stats"].append(np.ascontiguousarray(stats[:, r, :], dtype=np.int64))

    def _plan_until(self, w: int):
        with self._lock:
            if w not in self.slices and w < self.planned:  # an earlier window, dropped: plan again from 0
                self.run, self.slices, self.planned = None, {0: self.slices[0]}, 1
            while self.planned <= w:
                self._plan_next()

    def prepare(self, w: int):
        """Start planning up to window ``w`` in a background thread (nothing if planned or under way)."""
        if self.planned > w or (self._thread is not None and self._thread.is_alive()):
            return

        def work():
            try:
                self._plan_until(w)
            except BaseException as exc:  # noqa: BLE001 - raised in the training thread by wait()
                self._error = exc
        self._thread = threading.Thread(target=work, name=f"solar-plan-r{self.rank}", daemon=True)
        self._thread.start()

    def wait(self, w: int):
        """Return once window ``w`` is planned: wait for the background thread (logging once that
        planning is slower than training), then plan what is still missing here."""
        t = self._thread
        if t is not None and t.is_alive() and w not in self.slices:
            t0 = time.perf_counter()
            t.join()
            if not self._warned:
                self._warned = True
                log.warning("solar: rank %d waited %.2f s for the plan of window %d (epochs %d..%d): planning a "
                            "window takes longer than training it; a larger --window gives the planner more time",
                            self.rank, time.perf_counter() - t0, w, w * self.K, (w + 1) * self.K - 1)
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        if w not in self.slices:
            start = self.planned if w >= self.planned else 1  # an earlier window is planned again from 1
            if w - start >= 2:  # a resume far into the job: every window before w is planned first
                log.warning("solar: rank %d plans windows %d..%d (epochs %d..%d) before going on at epoch %d: an "
                            "open-ended schedule is planned window after window", self.rank, start, w,
                            start * self.K, (w + 1) * self.K - 1, w * self.K)
            self._plan_until(w)

    def close(self):
        """Wait for a planning thread still running (it ends after its window)."""
        if self._thread is not None:
            self._thread.join()

    # ------------------------------------------------------------------ plans
    def rank_plan(self, w: int) -> RankPlan:
        """This rank's plan of window ``w`` (planned first if need be), as a RankPlan over global steps
        ``0 .. (w+1)KS - 1``: see the class docstring."""
        self.wait(w)
        sl = self.slices[w]
        base = w * self.K * self.S
        arrays = {}
        for name in RANK_LISTS:
            pre = np.zeros(base, dtype=np.int32)
            lead = sl.resident if name == "load" else np.zeros(0, np.int64)
            if base:
                pre[-1] = lead.shape[0]
            arrays[name] = np.concatenate([lead.astype(sl.arrays[name].dtype), sl.arrays[name]])
            arrays[name + "_count"] = np.concatenate([pre, sl.arrays[name + "_count"]])
        arrays["stats"] = np.concatenate([np.zeros((base, sl.arrays["stats"].shape[1]), np.int64),
                                          sl.arrays["stats"]])
        return RankPlan(self.rank, arrays)


def _resident_after(sl: WindowSlice, n_blocks: int) -> np.ndarray:
    """int64 block ids resident at the end of window slice ``sl`` (ascending): its ``resident`` plus its
    ``load`` minus its ``evict`` (a rank's buffer, or a node's pool)."""
    count = np.zeros(n_blocks, dtype=np.int64)
    np.add.at(count, np.asarray(sl.resident, np.int64), 1)
    np.add.at(count, np.asarray(sl.arrays["load"], np.int64), 1)
    np.add.at(count, np.asarray(sl.arrays["evict"], np.int64), -1)
    return np.flatnonzero(count > 0)
