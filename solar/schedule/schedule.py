"""Open and query a schedule file: :class:`Schedule` (job-wide) and :class:`RankPlan` (one rank)."""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Optional

import h5py
import numpy as np

from ..errors import SolarError
from . import checks
from .format import FORMAT, NODE_LISTS, NODE_PEERS, RANK_LISTS, READABLE_VERSIONS, STATS, array_digest, header_digest
from .memory import schedule_memory_summary

# what h5py, numpy and json raise on a damaged file (turned into ScheduleError where the file is read)
LOW_LEVEL = (OSError, KeyError, ValueError, TypeError, RuntimeError, IndexError, OverflowError, RecursionError)


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

    def arrays(self) -> Dict[str, np.ndarray]:
        """The constructor's ``arrays`` (id lists, int32 ``<name>_count`` per step, ``stats``): to build
        a modified plan (``RankPlan(rank, {**plan.arrays(), ...})``)."""
        out = {n: getattr(self, n) for n in RANK_LISTS}
        out.update({n + "_count": np.diff(getattr(self, n + "_ptr")).astype(np.int32) for n in RANK_LISTS})
        out["stats"] = self.stats
        return out

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

    Job-wide figures are read and validated when opened; a rank's slice is read (its
    checksums verified, its ids and replay checked) only when asked for with :meth:`rank`.
    Anything damaged, whatever its checksum, raises :class:`ScheduleError`.
    """

    def __init__(self, h5: h5py.File, path: str, verify: bool = True):
        self._f, self.path, self.verify = h5, path, verify
        self._ranks: Dict[int, RankPlan] = {}
        self._demand: Optional[Dict[str, np.ndarray]] = None
        self._layout = None  # (Layout, file sizes, file mtimes) once read from /layout
        with self._reading("the header"):
            self._max_bytes = int(h5.id.get_filesize())
            self._read_header(h5.attrs)
        with self._reading("/epochs"):
            self._read_epochs()

    def _read_header(self, a):
        """Root attributes -> validated job figures (types, ranges, checksum, agreement)."""
        self._check_kind(a)
        texts = {k: checks.attr_str(a, k) for k in ("solar_version", "policy", "config", "fingerprint", "source",
                                                     "id_dtype", "header_sha256")}
        self.source_abs = checks.attr_str(a, "source_abs") if self.version > 1 else ""
        self.layout_bytes = checks.attr_int(a, "layout_bytes") if self.version > 2 else 0
        self.open_ended = bool(checks.attr_int(a, "open_ended", 0, 1)) if self.version > 3 else False
        self.window = checks.attr_int(a, "window", 0, 2**31) if self.version > 3 else 0
        resume = checks.attr_str(a, "resume") if self.version in (5, 7) else None
        nodes = checks.attr_str(a, "nodes") if self.version in (6, 7) else None
        #: where the plan's residency was planned to live: "host" (process memory) or "device" (``solar plan
        #: --device-buffer``: the loader's default buffer_device is then CUDA)
        self.buffer_place = checks.attr_str(a, "buffer_place") if "buffer_place" in a else "host"
        if self.buffer_place not in ("host", "device"):
            raise ScheduleError(f"{self.path}: buffer_place {self.buffer_place!r} is neither 'host' nor 'device'")
        #: memory per rank held for reads in flight beyond the one batch every plan keeps (``solar plan
        #: --reads-in-flight``); the loader's pools get it on top of the residency budget
        self.read_ahead_bytes = checks.attr_int(a, "read_ahead_bytes", 0, 2**62) if "read_ahead_bytes" in a else 0
        #: memory per rank held back from the residency so that pools of several block sizes fit (solar.plan)
        self.pool_slack_bytes = checks.attr_int(a, "pool_slack_bytes", 0, 2**62) if "pool_slack_bytes" in a else 0
        #: a device plan's host memory per rank for misses staged on their way to the device (0: not bounded)
        self.host_staging_bytes = checks.attr_int(a, "host_staging_bytes", 1, 2**62) \
            if "host_staging_bytes" in a else 0
        #: a plan on parts of chunks: the fingerprint of the data's own layout (whole chunks), which `solar inspect
        #: DATA` shows; ``fingerprint`` is that of its parts (empty: not recorded, or whole chunks)
        self.data_fingerprint = checks.attr_str(a, "data_fingerprint") if "data_fingerprint" in a else ""
        #: bytes of a run of neighbouring blocks the plan read together (:mod:`solar.layout.runs`); 0: none
        self.neighbour_run_bytes = checks.attr_int(a, "neighbour_run_bytes", 1, 2**40) \
            if "neighbour_run_bytes" in a else 0
        ints = {k: checks.attr_int(a, k) for k in ("n_samples", "n_blocks", "steps_per_epoch")}
        if header_digest(a, self.version) != texts["header_sha256"]:
            raise ScheduleError(f"{self.path}: header checksum mismatch: the file is damaged")
        self.header_sha256 = texts["header_sha256"]  # the same on every rank reading the same plan
        self.config = checks.parse_config(texts["config"])
        self.policy, self.fingerprint = texts["policy"], texts["fingerprint"]
        self.solar_version, self.source_rel = texts["solar_version"], texts["source"]
        self.n_samples, self.n_blocks = ints["n_samples"], ints["n_blocks"]
        self.steps_per_epoch = ints["steps_per_epoch"]
        checks.check_sizes(self.config, self.n_samples, self.n_blocks, self.steps_per_epoch, texts["id_dtype"])
        checks.check_window(self.open_ended, self.window, self.config.epochs)
        #: a job resumed on another world size (format version 5, 7): ``{"step": first step trained, "from": the
        #: checkpointed job's loader state}``; None otherwise
        self.resume = None if resume is None else checks.parse_resume(resume, self.config, self.n_samples,
                                                                     self.fingerprint)
        if self.resume is not None and self.open_ended:
            raise checks.Damaged("an open-ended schedule cannot be a resumed one (attribute resume)")
        #: a node-pool plan (format version 6, 7): its :class:`~solar.scheduler.nodes.NodeMap` and
        #: :class:`~solar.scheduler.nodes.PeerCost`; None (and None) for a plan of one buffer per rank
        self.nodes, self.peer_cost = (None, None) if nodes is None else checks.parse_nodes(nodes, self.config,
                                                                                            self.policy)
        self.id_dtype = np.dtype(texts["id_dtype"])
        ranks = self._f["ranks"] if "ranks" in self._f else None
        P = self.world_size
        if not isinstance(ranks, h5py.Group) or len(ranks) != P or any(str(r) not in ranks for r in range(P)):
            raise checks.Damaged(f"/ranks does not hold one group per rank 0..{P - 1}")
        if self.nodes is not None:
            grp, Q = (self._f["nodes"] if "nodes" in self._f else None), self.nodes.n_nodes
            if not isinstance(grp, h5py.Group) or len(grp) != Q or any(str(n) not in grp for n in range(Q)):
                raise checks.Damaged(f"/nodes does not hold one group per node 0..{Q - 1}")

    def _check_kind(self, a):
        """A solar schedule, of a format version this solar reads, completely written; sets ``version``."""
        try:
            kind = checks.attr_str(a, "format")
        except checks.Damaged:
            kind = None
        if kind != FORMAT:
            raise ScheduleError(f"{self.path}: not a solar schedule file (format attribute {kind!r})")
        version = a["version"] if "version" in a else None
        if not isinstance(version, (int, np.integer)) or int(version) not in READABLE_VERSIONS:
            raise ScheduleError(f"{self.path}: schedule format version {version!r}, this solar reads "
                                f"{' and '.join(map(str, READABLE_VERSIONS))}; re-run solar plan")
        self.version = int(version)
        if "complete" not in a or not isinstance(a["complete"], (int, np.integer)) or int(a["complete"]) != 1:
            raise ScheduleError(f"{self.path}: incomplete schedule (the planner did not finish writing it)")

    def _read_epochs(self):
        E, P = self.epochs, self.world_size
        self.epoch_order = self._read("epochs/source_epoch", "<i8", (E,))
        self._epochs = {k: self._read(f"epochs/{k}", "<i8", (E,)) for k in (
            "hit_bytes", "miss_bytes", "stored_bytes", "demand_bytes", "max_local_batch", "min_local_batch")}
        per = P if self.nodes is None else self.nodes.n_nodes  # a node plan's misses are per node
        self._epochs["rank_miss_bytes"] = self._read("epochs/rank_miss_bytes", "<i8", (E, per))
        if self.nodes is not None:
            self._epochs["peer_bytes"] = self._read("epochs/peer_bytes", "<i8", (E,))
        checks.check_epochs({"source_epoch": self.epoch_order, **self._epochs}, E)

    # ------------------------------------------------------------------ open
    @classmethod
    def load(cls, path: str, *, layout=None, fingerprint: Optional[str] = None, world_size: Optional[int] = None,
             verify: bool = True) -> "Schedule":
        """Open ``path``; with ``layout``/``fingerprint``/``world_size`` also check it fits this job."""
        if not os.path.exists(path):
            raise ScheduleError(f"no schedule file {path!r} (make one with solar plan)")
        try:
            h5 = h5py.File(path, "r", locking=False)
        except LOW_LEVEL as exc:
            raise ScheduleError(f"{path}: cannot open as a schedule (damaged or truncated file?): "
                                f"{_first_line(exc)}") from None
        try:
            s = cls(h5, path, verify)
            s.check(layout=layout, fingerprint=fingerprint, world_size=world_size)
        except BaseException:
            h5.close()
            raise
        return s

    def check(self, *, layout=None, fingerprint: Optional[str] = None, world_size: Optional[int] = None):
        """Raise :class:`ScheduleError` if this schedule was made for another dataset or world size.  A layout of
        whole chunks fits a schedule planned on its parts (:mod:`solar.layout.parts`)."""
        if layout is not None:
            fingerprint = layout.fingerprint
            if fingerprint != self.fingerprint and getattr(layout, "block_parent", None) is None:
                from ..errors import LayoutError
                from ..layout.parts import split_chunks
                try:
                    cut = split_chunks(layout)
                except LayoutError:  # the files changed since the layout was built: not this plan's data
                    cut = None
                if cut is not None and cut.fingerprint == self.fingerprint:
                    fingerprint = cut.fingerprint
        if fingerprint is not None and fingerprint != self.fingerprint:
            raise ScheduleError(
                f"{self.path}: schedule was planned for another dataset or an older version of it (layout "
                f"fingerprint {self.fingerprint[:12]}, the data now has {fingerprint[:12]}); re-run solar plan")
        if world_size is not None and int(world_size) != self.world_size:
            raise ScheduleError(f"{self.path}: schedule was planned for world size {self.world_size}, "
                                f"the job has {world_size} rank{'' if int(world_size) == 1 else 's'}")

    def close(self):
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        epochs = f"open-ended, window={self.window}" if self.open_ended else f"epochs={self.epochs}"
        return (f"Schedule({self.path!r}, policy={self.policy}, world_size={self.world_size}, {epochs}, "
                f"steps_per_epoch={self.steps_per_epoch})")

    @contextmanager
    def _reading(self, what: str):
        """Turn what a damaged file makes h5py, numpy or the checks raise into one-line ScheduleErrors."""
        try:
            yield
        except SolarError:
            raise
        except checks.Damaged as exc:
            raise ScheduleError(f"{self.path}: damaged schedule file: {exc}") from None
        except LOW_LEVEL as exc:
            raise ScheduleError(f"{self.path}: cannot read {what} (damaged or truncated file?): "
                                f"{type(exc).__name__}: {_first_line(exc)}") from None

    def _read(self, name: str, dtype, shape) -> np.ndarray:
        """Dataset ``name``, checked to be ``dtype`` of ``shape`` (None: any length) before it is read,
        and against its checksum after."""
        ds = self._f[name] if name in self._f else None
        if not isinstance(ds, h5py.Dataset):
            raise checks.Damaged(f"{name} is missing" if ds is None else f"{name} is not a dataset")
        checks.check_meta(name, ds.dtype, ds.shape, dtype, shape, self._max_bytes)
        arr = ds[()]
        if self.verify:
            try:
                want = checks.attr_str(ds.attrs, "sha256")
            except checks.Damaged:
                want = None
            if array_digest(arr) != want:
                raise ScheduleError(f"{self.path}: checksum mismatch in {name}: the file is damaged")
        return arr

    # ---------------------------------------------------------------- source
    @property
    def source(self) -> str:
        """The dataset this schedule was planned from, as a path usable from here ("" if none is recorded):
        see :meth:`source_path`."""
        return self.source_path() if self.source_rel or self.source_abs else ""

    def source_path(self) -> str:
        """The recorded dataset path that exists: relative to the schedule file's folder, else the
        absolute path recorded when planning (version 1 files: as given, else relative to the
        schedule).  Raises :class:`ScheduleError` naming both when neither exists."""
        here = os.path.join(os.path.dirname(os.path.abspath(self.path)), self.source_rel)
        tries = [here, self.source_abs] if self.version > 1 else [self.source_rel, here]
        for p in tries:
            if p and os.path.exists(p):
                return p
        raise ScheduleError(f"{self.path}: the dataset it was planned from is neither at {tries[0]!r} nor at "
                            f"{tries[1]!r}; pass its layout spec path (data=...)")

    # ----------------------------------------------------------------- shape
    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def epochs(self) -> int:
        """Epochs planned in the file (of an open-ended schedule: its first window, ``window``)."""
        return self.config.epochs

    @property
    def local_batch(self) -> int:
        return self.config.local_batch

    @property
    def buffer_bytes(self) -> int:
        return self.config.buffer_bytes

    @property
    def memory_budget(self) -> int:
        """The residency budget plus the plan's memory for more reads in flight (:attr:`read_ahead_bytes`) and the
        pools' slack (:attr:`pool_slack_bytes`): what a rank's memory model (:func:`solar.memory.memory_need`) takes
        as its budget."""
        return self.config.buffer_bytes + self.read_ahead_bytes + self.pool_slack_bytes

    @property
    def n_steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    @property
    def start_step(self) -> int:
        """The first global step the job trains: 0, or where a resumed job starts (steps before it are empty)."""
        return int(self.resume["step"]) if self.resume is not None else 0

    @property
    def resumed_from(self) -> Optional[dict]:
        """The loader state of the checkpointed job this one resumes (a resumed schedule), else None."""
        return dict(self.resume["from"]) if self.resume is not None else None

    def source_epoch(self, e: int) -> int:
        """Which DistributedSampler epoch (``set_epoch`` value) is trained at position ``e``."""
        if not 0 <= e < self.epochs:
            raise IndexError(f"epoch {e} out of range [0, {self.epochs})")
        return int(self.epoch_order[e])

    # ----------------------------------------------------------------- ranks
    def _check_rank(self, r) -> int:
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 0 <= r < self.world_size:
            raise ScheduleError(f"rank {r!r} out of range: the schedule has world size {self.world_size}")
        return int(r)

    def rank(self, r: int, keep: bool = True) -> RankPlan:
        """Rank ``r``'s slice, read once and verified: ids in range, the replay of its plan (residency,
        budget) and, with ``verify``, checksums and its samples against DistributedSampler's batches.
        ``keep=False``: not kept after the call (a pass over every rank's slice holds one at a time).
        A node plan (``nodes`` not None) has no per-rank buffer: see :meth:`node_plan`."""
        r = self._check_rank(r)
        if self.nodes is not None:
            raise ScheduleError(f"{self.path}: a node plan ({self.policy}, {self.nodes.ranks_per_node} ranks per "
                                f"node) has one buffer per node, not per rank: read it with node_plan(rank)")
        if r in self._ranks:
            return self._ranks[r]
        demand = self.demand()
        with self._reading(f"ranks/{r}"):
            plan = RankPlan(r, self._read_rank(r, demand["block_nbytes"]))
        if keep:
            self._ranks[r] = plan
        return plan

    def _read_rank(self, r: int, block_nbytes: np.ndarray) -> Dict[str, np.ndarray]:
        """``/ranks/<r>`` arrays, each checked before it is read (counts first) and after."""
        G, base = self.n_steps, f"ranks/{r}/"
        arrays = {}
        for x in RANK_LISTS:
            cnt = self._read(base + x + "_count", "<i4", (G,))
            checks.check_range(base + x + "_count", cnt, 0, 2**31)
            arrays[x + "_count"] = cnt
            arrays[x] = self._read(base + x, self.id_dtype, (int(cnt.sum(dtype=np.int64)),))
        checks.check_range(base + "samples", arrays["samples"], 0, self.n_samples)
        for x in ("load", "evict"):
            checks.check_range(base + x, arrays[x], 0, self.n_blocks)
        arrays["stats"] = self._read(base + "stats", "<i8", (G, len(STATS)))
        checks.check_range(base + "stats", arrays["stats"], 0, 2**63 - 1)
        checks.check_replay(r, arrays["load"], arrays["load_count"], arrays["evict"], arrays["evict_count"],
                            block_nbytes, self.buffer_bytes)
        if self.verify:
            checks.check_sampler(r, arrays["samples"], arrays["samples_count"], self.n_samples, self.config,
                                 self.epoch_order)
        return arrays

    # ----------------------------------------------------------------- nodes
    def node_plan(self, r: int, keep: bool = True) -> "NodeRankPlan":
        """Of a node plan: what rank ``r`` needs to run it (its samples, its node's lists), read once and
        verified like :meth:`rank` (ids in range, the replay of the node's pool within L x the budget,
        the receives against the senders' lists, samples against DistributedSampler's batches).
        ``keep=False``: not kept after the call (a pass over every node holds one at a time)."""
        r = self._check_rank(r)
        if self.nodes is None:
            raise ScheduleError(f"{self.path}: not a node plan (policy {self.policy}, one buffer per rank): read it "
                                f"with rank(r)")
        key = ("node", r)
        if key not in self._ranks:
            demand = self.demand()
            with self._reading(f"ranks/{r} and its node"):
                n_transfers = sum(int(self._read(f"nodes/{n}/send_count", "<i4", (self.n_steps,)).sum(dtype=np.int64))
                                  for n in range(self.nodes.n_nodes))
                mine = self._read_samples(r)
                # the node's other ranks' samples too: who reads which block for the node (buffer.node_place)
                known = {q: mine if q == r else self._read_samples(q, sampler=False)
                         for q in self.nodes.ranks_of(r // self.nodes.ranks_per_node)}
                out = NodeRankPlan(self, r, mine, self._read_node(
                    r // self.nodes.ranks_per_node, demand["block_nbytes"], known), n_transfers,
                    peers={q: v for q, v in known.items() if q != r})
            if not keep:
                return out
            self._ranks[key] = out
        return self._ranks[key]

    def _read_samples(self, r: int, sampler: bool = True) -> Dict[str, np.ndarray]:
        """``/ranks/<r>/samples`` and ``samples_count`` checked (with ``sampler`` and ``verify``: against
        DistributedSampler's batches too)."""
        base, G = f"ranks/{r}/", self.n_steps
        cnt = self._read(base + "samples_count", "<i4", (G,))
        checks.check_range(base + "samples_count", cnt, 0, 2**31)
        samples = self._read(base + "samples", self.id_dtype, (int(cnt.sum(dtype=np.int64)),))
        checks.check_range(base + "samples", samples, 0, self.n_samples)
        if sampler and self.verify:
            checks.check_sampler(r, samples, cnt, self.n_samples, self.config, self.epoch_order)
        return {"samples": samples, "samples_count": cnt}

    def _node_lists(self, n: int, names) -> Dict[str, np.ndarray]:
        from ..scheduler.node_plan import NODE_STATS
        base, G, Q = f"nodes/{n}/", self.n_steps, self.nodes.n_nodes
        out = {}
        for x in names:
            if x == "stats":
                out[x] = self._read(base + x, "<i8", (G, len(NODE_STATS)))
                checks.check_range(base + x, out[x], 0, 2**63 - 1)
                continue
            cnt = self._read(base + x + "_count", "<i4", (G,))
            checks.check_range(base + x + "_count", cnt, 0, 2**31)
            out[x + "_count"] = cnt
            out[x] = self._read(base + x, self.id_dtype, (int(cnt.sum(dtype=np.int64)),))
            checks.check_range(base + x, out[x], 0, self.n_blocks)
            if x in NODE_PEERS:
                other = NODE_PEERS[x]
                out[other] = self._read(base + other, "<i4", (out[x].shape[0],))
                checks.check_range(base + other, out[other], 0, Q)
                if (out[other] == n).any():
                    raise checks.Damaged(f"node {n} has a transfer to or from itself")
        return out

    def _read_node(self, n: int, block_nbytes: np.ndarray, known: Dict[int, dict]) -> Dict[str, np.ndarray]:
        """``/nodes/<n>`` arrays, each checked before it is read and after; the pool replayed within the
        node's budget, the transfers against the partners' lists, the staging against the node's samples
        (``known``: ranks whose samples are already read)."""
        out = self._node_lists(n, NODE_LISTS + ("stats",))
        checks.check_replay(n, out["load"], out["load_count"], out["evict"], out["evict_count"], block_nbytes,
                            self.nodes.ranks_per_node * self.buffer_bytes, what="node")
        partners = np.union1d(out["recv_from"], out["send_to"]).tolist()
        checks.check_transfers(n, out, {int(m): self._node_lists(int(m), ("send", "recv")) for m in partners})
        checks.check_staging(n, out, self._node_step_bytes(n, block_nbytes, known), block_nbytes)
        return out

    def _node_step_bytes(self, n: int, block_nbytes: np.ndarray, known: Dict[int, dict]) -> np.ndarray:
        """int64[G]: decoded bytes of the blocks node ``n``'s ranks' samples use at each step (an upper bound
        of what the node stages and receives then)."""
        d = self.demand()
        csum = np.concatenate(([0], np.cumsum(block_nbytes[np.asarray(d["sample_blocks"], np.int64)])))
        sample_bytes = csum[d["sample_ptr"][1:]] - csum[d["sample_ptr"][:-1]]  # int64[N]
        G, total = self.n_steps, np.zeros(self.n_steps, dtype=np.int64)
        for r in self.nodes.ranks_of(n):
            rs = known[r] if r in known else self._read_samples(r, sampler=False)
            step = np.repeat(np.arange(G, dtype=np.int64), rs["samples_count"])  # (n_r,) step of each sample
            np.add.at(total, step, sample_bytes[np.asarray(rs["samples"], np.int64)])
        return total

    def batch(self, e: int, step: int, rank: int) -> np.ndarray:
        """Sample ids rank ``rank`` trains on at step ``step`` of epoch position ``e``."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} out of range [0, {self.steps_per_epoch})")
        self.source_epoch(e)
        g = e * self.steps_per_epoch + step
        if self.nodes is not None:
            p = self.node_plan(rank)
            return p.samples[p.samples_ptr[g]:p.samples_ptr[g + 1]]
        return self.rank(rank).step(g).samples

    def demand(self) -> Dict[str, np.ndarray]:
        """The sample -> blocks map and block sizes the plan was made for (read once, validated):
        ``sample_ptr`` int64[N+1], ``sample_blocks`` id[nnz] in [0, B), ``block_nbytes`` and
        ``block_stored`` int64[B] (bytes)."""
        if self._demand is None:
            with self._reading("/demand"):
                self._demand = self._read_demand()
        return self._demand

    def _read_demand(self) -> Dict[str, np.ndarray]:
        ptr = self._read("demand/sample_ptr", "<i8", (self.n_samples + 1,))
        checks.check_ptr("demand/sample_ptr", ptr)
        blocks = self._read("demand/sample_blocks", self.id_dtype, (int(ptr[-1]),))
        checks.check_range("demand/sample_blocks", blocks, 0, self.n_blocks)
        out = {"sample_ptr": ptr, "sample_blocks": blocks}
        for k in ("block_nbytes", "block_stored"):
            out[k] = self._read(f"demand/{k}", "<i8", (self.n_blocks,))
            checks.check_block_bytes(f"demand/{k}", out[k])
        return out

    # ---------------------------------------------------------------- layout
    @property
    def has_layout(self) -> bool:
        """Whether the file stores the layout (format version 3 planned from a dataset)."""
        return self.layout_bytes > 0

    def layout(self):
        """The :class:`~solar.layout.Layout` stored in the file (read once, checksums and consistency
        verified; no data file is opened), its files found from the data folder relative to the schedule
        file, else the absolute path recorded.  A ScheduleError if the file stores none."""
        if self._layout is None:
            if not self.has_layout:
                raise ScheduleError(f"{self.path}: the schedule stores no layout (format version {self.version}"
                                    f"{'' if self.version > 2 else ': re-run solar plan to store it'})")
            from .stored_layout import read_layout
            with self._reading("/layout"):
                self._layout = read_layout(self)
        return self._layout[0]

    def _parts_of_chunks(self):
        """The chunks a plan on parts of chunks cut (None: whole chunks, or its layout cannot be read here)."""
        from ..errors import SolarError
        if self.extent_runs:
            return None
        try:
            ext = self.block_extent()
        except (SolarError, OSError):
            return None
        return None if ext is None else int(np.unique(ext).shape[0])

    def block_extent(self):
        """int64[n_blocks] or None: the chunk of each block when the plan is on parts of chunks
        (:mod:`solar.layout.parts`), the run of each block when it read runs of neighbours
        (:attr:`neighbour_run_bytes`; :attr:`extent_runs`), else None: what the planner needs to plan more of
        the job."""
        if not self.has_layout:
            return None
        ext = getattr(self.layout(), "block_parent", None)
        if ext is None and self.neighbour_run_bytes:
            from ..layout.runs import neighbour_runs
            ext = neighbour_runs(self.layout(), self.neighbour_run_bytes)
        return ext

    @property
    def extent_runs(self) -> bool:
        """Whether :meth:`block_extent` gives runs of neighbouring blocks (not chunks)."""
        return bool(self.neighbour_run_bytes)

    def planned_file_stats(self):
        """``(size int64[F] bytes, mtime int64[F] ns)`` of each of :meth:`layout`'s files when planned."""
        self.layout()
        return self._layout[1], self._layout[2]

    # ------------------------------------------------------------ prediction
    def predicted(self) -> Dict[str, list]:
        """Predicted per-epoch totals over ranks (bytes), and hit rates."""
        e = self._epochs
        hit_rate = [float(1.0 - m / d) if d else 0.0 for m, d in zip(e["miss_bytes"], e["demand_bytes"])]
        first = self.start_step // self.steps_per_epoch  # the first epoch trained (a resumed job's: cold)
        steady_epochs = slice(first + 1 if self.epochs > first + 1 else first, None)  # after the cold one, if any
        m, d = e["miss_bytes"][steady_epochs], e["demand_bytes"][steady_epochs]
        steady = float(1.0 - m.sum() / d.sum()) if d.sum() else 0.0
        return {"hit_bytes": e["hit_bytes"].tolist(), "miss_bytes": e["miss_bytes"].tolist(),
                "storage_bytes": e["stored_bytes"].tolist(), "demand_bytes": e["demand_bytes"].tolist(),
                "hit_rate": hit_rate, "steady_hit_rate": steady,
                "max_local_batch": e["max_local_batch"].tolist(), "min_local_batch": e["min_local_batch"].tolist(),
                **({"rank_miss_bytes": e["rank_miss_bytes"].tolist()} if self.nodes is None else
                   {"node_miss_bytes": e["rank_miss_bytes"].tolist(), "peer_bytes": e["peer_bytes"].tolist(),
                    "steady_peer_hit_rate": float(e["peer_bytes"][steady_epochs].sum() / d.sum()) if d.sum() else 0.0})}

    def summary(self) -> dict:
        p = self.predicted()
        return {"path": self.path, "policy": self.policy, "solar_version": self.solar_version,
                "fingerprint": self.fingerprint, "data_fingerprint": self.data_fingerprint or None,
                "source": self.source_rel, "source_abs": self.source_abs,
                "format_version": self.version, "config": self.config.to_dict(), "layout_bytes": self.layout_bytes,
                "open_ended": self.open_ended, "window": self.window, "resume": self.resume,
                "buffer_place": self.buffer_place, "read_ahead_bytes": self.read_ahead_bytes,
                "host_staging_bytes": self.host_staging_bytes, "pool_slack_bytes": self.pool_slack_bytes,
                "nodes": None if self.nodes is None else {"ranks_per_node": self.nodes.ranks_per_node,
                                                          "n_nodes": self.nodes.n_nodes, **self.peer_cost.to_dict()},
                "n_samples": self.n_samples, "n_blocks": self.n_blocks, "steps_per_epoch": self.steps_per_epoch,
                "parts_of_chunks": self._parts_of_chunks(), "neighbour_run_bytes": self.neighbour_run_bytes,
                "source_epochs": self.epoch_order.tolist(), "file_bytes": _file_size(self.path), **p,
                "memory_per_rank": schedule_memory_summary(self)}


class NodeRankPlan:
    """What one rank of a node plan (format version 6, or 7 when resumed) needs: its samples and its node's lists,
    with the interface :class:`~solar.buffer.NodeBufferManager` takes (a :class:`~solar.scheduler.node_plan.NodePlan`
    sliced to one rank: ``nodes``, ``policy``, ``steps_per_epoch``, ``n_steps``, :meth:`rank` and
    :meth:`node` for this rank and its node only, :meth:`identity`).

    ``samples`` id[n_r] with ``samples_ptr`` int64[G+1]; ``node(n)`` as NodePlan's: ``load``/``evict``/
    ``stage``/``send``/``recv`` with int64[G+1] ``*_ptr``, ``send_to``/``recv_from`` int32, ``stats``
    int64[G, 10].  ``n_steps``: G when it is not the file's (a later window of an open-ended plan,
    :mod:`solar.loader.node_windows`); ``n_transfers``: the transfers of the plan the lists are.
    """

    def __init__(self, schedule: "Schedule", rank: int, samples: Dict[str, np.ndarray], node: Dict[str, np.ndarray],
                 n_transfers: int, n_steps: Optional[int] = None,
                 peers: Optional[Dict[int, Dict[str, np.ndarray]]] = None):
        self.nodes, self.policy = schedule.nodes, schedule.policy
        self.steps_per_epoch = schedule.steps_per_epoch
        self.n_steps = schedule.n_steps if n_steps is None else int(n_steps)  # a later window's: more
        self.rank_id, self.node_id = rank, rank // self.nodes.ranks_per_node
        self.samples = samples["samples"]
        self.samples_ptr = _ptr(samples["samples_count"])
        # the samples of the node's other ranks where known (``peers``: {rank: samples and samples_count})
        self._peers = {int(q): {"samples": v["samples"], "samples_ptr": _ptr(v["samples_count"])}
                       for q, v in (peers or {}).items()}
        self._node = {k: v for k, v in node.items() if not k.endswith("_count")}
        for x in NODE_LISTS:
            self._node[x + "_ptr"] = _ptr(node[x + "_count"])
        self._identity = (schedule.fingerprint, self.n_steps, schedule.header_sha256)
        #: transfers between nodes in the whole job (every rank sees the same number, whether or not its
        #: node takes part)
        self.n_transfers = n_transfers

    def identity(self) -> tuple:
        """The same on every rank of one job: the file's header checksum (ranks compare it)."""
        return self._identity

    def rank(self, r: int) -> Dict[str, np.ndarray]:
        """Rank r's samples: this rank's, or another rank's of its node where the plan holds them."""
        if r != self.rank_id:
            if r in self._peers:
                return dict(self._peers[r])
            raise IndexError(f"this plan holds rank {self.rank_id}'s samples, not rank {r}'s")
        return {"samples": self.samples, "samples_ptr": self.samples_ptr}

    def node(self, n: int) -> Dict[str, np.ndarray]:
        if n != self.node_id:
            raise IndexError(f"this plan holds node {self.node_id}'s lists, not node {n}'s")
        return dict(self._node)

    def predicted(self) -> Dict[str, int]:
        """The node's totals of :data:`~solar.scheduler.node_plan.NODE_STATS` over the job."""
        from ..scheduler.node_plan import NODE_STATS
        return {k: int(v) for k, v in zip(NODE_STATS, self._node["stats"].sum(axis=0))}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _file_size(path: str) -> Optional[int]:
    try:
        return os.path.getsize(path)
    except OSError:
        return None
