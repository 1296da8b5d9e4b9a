"""Write a schedule file epoch by epoch (memory bounded by ``flush_bytes`` of pending rows)."""
from __future__ import annotations

import hashlib
import json
import uuid
from typing import Dict, List, Optional

import h5py
import numpy as np

from .. import __version__
from ..atomic import AtomicH5
from ..scheduler.config import PlanConfig
from ..scheduler.run import Demand, EpochPlan, PolicyResult
from .format import (FORMAT, LIBVER, NODE_LISTS, NODE_PEERS, NODE_RESUMED_VERSION, NODE_VERSION, RANK_LISTS,
                     RESUMED_VERSION, STATS, VERSION, array_digest, header_digest, id_dtype, put_text, source_paths)
from .pack import csr_rank_major, samples_rank_major, split_rows
from .stored_layout import write_layout


def _put(group, name: str, arr: np.ndarray):
    ds = group.create_dataset(name, data=arr, track_times=False)
    put_text(ds.attrs, "sha256", array_digest(arr))
    return ds


class ScheduleWriter:
    """Streams :class:`EpochPlan` s of one policy run into a schedule file.

    ``path=None`` keeps the file in memory (HDF5 core driver).  The file is written
    under a temporary name and renamed when :meth:`close` completes it, so a crashed
    run never leaves a file that looks complete; :meth:`abort` removes it (a failed
    write, e.g. a full disk, raises :class:`~solar.errors.WriteError` from the next call).
    ``window`` > 0: an open-ended job whose first ``window`` (= ``cfg.epochs``) epochs are written.
    ``resume``: a job resumed on another world size (format version 5, header attribute ``resume``:
    ``{"step": first step trained, "from": the checkpointed job's loader state}``).
    ``nodes``: a node-pool plan (format version 6, 7 when resumed): ``(NodeMap, PeerCost)``; its epochs are
    :class:`~solar.scheduler.node_plan.NodeEpochPlan` s.
    ``buffer_place="device"``: the residency was planned for a buffer in device memory (``solar plan
    --device-buffer``): the root attribute ``buffer_place`` says so, and the loader puts the pools on the GPU by
    default.  It decides where the buffer lives, not what is read or delivered, and is not in ``header_sha256``.
    ``read_ahead_bytes``: memory per rank the plan holds for reads in flight beyond the one batch every plan
    keeps (``solar plan --reads-in-flight``): the root attribute ``read_ahead_bytes`` (absent: 0), which the
    loader adds to the residency budget for its pools' slots for reads in flight; not in ``header_sha256``
    (where reads land, not what is read).
    ``pool_slack_bytes``: memory per rank (per node's rank in a node plan) held back from the residency so that
    the pools fit the budget: a pool has slots per block size, as many as that size's own peak, and where several
    sizes peak at different steps those peaks add up to more than the plan's peak (:func:`solar.plan` plans again
    with less residency then): the root attribute ``pool_slack_bytes`` (absent: 0), which the loader adds to the
    residency budget as it adds ``read_ahead_bytes``; not in ``header_sha256``.
    ``host_staging_bytes``: a device plan's host memory per rank for the misses staged on their way to the device
    (the host budget less the bookkeeping; ``solar plan --device-buffer`` with ``--buffer-per-rank``): the root
    attribute ``host_staging_bytes`` (absent: not bounded), which the loader keeps its staged reads within; not
    in ``header_sha256``.
    ``demand.extent_runs``: planned with runs of neighbouring blocks (:mod:`solar.layout.runs`): the root
    attribute ``neighbour_run_bytes`` (absent: none) is the run size, so that a loader planning the next windows
    of an open-ended plan cuts the same runs; not in ``header_sha256`` (the epochs, checksummed, say what is
    read; a loader whose replay of window 0 differs from them refuses the file).
    """

    def __init__(self, path: Optional[str], demand: Demand, cfg: PlanConfig, policy: str, steps_per_epoch: int,
                 source: str = "", flush_bytes: int = 256 << 20, layout=None, window: int = 0,
                 resume: Optional[dict] = None, nodes=None, buffer_place: str = "host", read_ahead_bytes: int = 0,
                 host_staging_bytes: int = 0, pool_slack_bytes: int = 0):
        self.path, self.cfg, self.S, self.window = path, cfg, steps_per_epoch, int(window)
        if buffer_place not in ("host", "device"):
            raise ValueError(f"buffer_place must be 'host' or 'device', got {buffer_place!r}")
        for name, v in (("read_ahead_bytes", read_ahead_bytes), ("host_staging_bytes", host_staging_bytes),
                         ("pool_slack_bytes", pool_slack_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        self.buffer_place, self.read_ahead_bytes = buffer_place, read_ahead_bytes
        self.host_staging_bytes, self.pool_slack_bytes = host_staging_bytes, pool_slack_bytes
        self.resume = resume
        self.nodes, self.cost = nodes if nodes is not None else (None, None)
        if resume is not None and self.window:
            raise ValueError("a resumed plan is not open-ended")
        if self.nodes is not None:
            self.version = NODE_VERSION if resume is None else NODE_RESUMED_VERSION
        else:
            self.version = VERSION if resume is None else RESUMED_VERSION
        self.P, self.E = cfg.world_size, cfg.epochs
        self.idt = id_dtype(demand.n_samples, demand.n_blocks)
        self.flush_bytes = flush_bytes
        if path is None:
            self.out = None
            self.f = h5py.File(f"solar-schedule-{uuid.uuid4().hex}.h5", "w", driver="core", backing_store=False,
                               libver=LIBVER)
        else:
            self.out = AtomicH5(path, libver=LIBVER)
            self.f = self.out.file
        self.ds: List[Dict[str, h5py.Dataset]] = []
        try:
            self._start(demand, cfg, policy, source, layout)
        except BaseException:  # an error, Ctrl-C or SIGTERM while the file is created: leave nothing behind
            self.abort()
            raise

    def _start(self, demand: Demand, cfg: PlanConfig, policy: str, source: str, layout):
        """Header attributes, ``/demand``, ``/layout`` (when ``layout`` is given: the
        :class:`~solar.layout.Layout` ``demand`` comes from) and the empty appendable ``/ranks/<r>`` datasets."""
        path, steps_per_epoch = self.path, self.S
        a = self.f.attrs
        rel, absolute = source_paths(source, path)  # the dataset relative to the schedule file, and absolute
        text = {"format": FORMAT, "solar_version": __version__, "policy": policy,
                "config": json.dumps(cfg.to_dict(), sort_keys=True), "fingerprint": demand.fingerprint,
                "source": rel, "source_abs": absolute, "id_dtype": self.idt.str}
        for k, v in text.items():
            put_text(a, k, v)
        if self.resume is not None:
            put_text(a, "resume", json.dumps(self.resume, sort_keys=True))
        if self.nodes is not None:
            put_text(a, "nodes", json.dumps({"ranks_per_node": self.nodes.ranks_per_node, **self.cost.to_dict()},
                                            sort_keys=True))
        a["version"], a["n_samples"], a["n_blocks"] = self.version, demand.n_samples, demand.n_blocks
        a["steps_per_epoch"], a["complete"] = steps_per_epoch, 0
        a["open_ended"], a["window"] = int(self.window > 0), self.window  # window > 0: the first window of K epochs
        if self.buffer_place != "host":
            put_text(a, "buffer_place", self.buffer_place)
        if self.read_ahead_bytes:
            a["read_ahead_bytes"] = np.int64(self.read_ahead_bytes)
        if self.host_staging_bytes:
            a["host_staging_bytes"] = np.int64(self.host_staging_bytes)
        if self.pool_slack_bytes:
            a["pool_slack_bytes"] = np.int64(self.pool_slack_bytes)
        chunks = getattr(layout, "_chunks", None)
        if chunks is not None:  # planned on parts of chunks: the fingerprint is the parts'; `solar inspect DATA` shows
            put_text(a, "data_fingerprint", chunks.fingerprint)  # this one (display only: the checks use the parts')
        if demand.extent_runs:  # planned with runs of neighbours: the loader cuts the same runs to plan on
            from ..layout.runs import RUN_BYTES
            a["neighbour_run_bytes"] = np.int64(RUN_BYTES)
        g = self.f.create_group("demand")
        _put(g, "sample_ptr", np.asarray(demand.sample_ptr, dtype="<i8"))
        _put(g, "sample_blocks", np.asarray(demand.sample_blocks, dtype=self.idt))
        _put(g, "block_nbytes", np.asarray(demand.block_nbytes, dtype="<i8"))
        _put(g, "block_stored", np.asarray(demand.block_stored, dtype="<i8"))
        a["layout_bytes"] = 0 if layout is None else write_layout(self.f.create_group("layout"), layout, path, _put)
        # per rank: appendable datasets, a running sha256 each, rows pending a flush
        total = int(np.asarray(demand.sample_ptr).shape[0] - 1)
        per_rank = max(1, -(-total // self.P) * self.E)
        ids_chunk = int(min(1 << 18, max(1024, per_rank // 8)))
        cnt_chunk = int(min(1 << 16, max(64, self.S * self.E)))
        self.hash: List[Dict[str, "hashlib._Hash"]] = []
        # groups written to: /ranks/<r> (r < P), then for a node plan /nodes/<n> (entry P + n)
        ranks = self.f.create_group("ranks")
        node_plan = self.nodes is not None
        for r in range(self.P):
            lists = ("samples",) if node_plan else RANK_LISTS
            self._group(ranks.create_group(str(r)), lists, (), len(STATS) if not node_plan else 0, ids_chunk,
                        cnt_chunk)
        if node_plan:
            from ..scheduler.node_plan import NODE_STATS
            nodes = self.f.create_group("nodes")
            for n in range(self.nodes.n_nodes):
                self._group(nodes.create_group(str(n)), NODE_LISTS, tuple(NODE_PEERS.values()), len(NODE_STATS),
                            ids_chunk, cnt_chunk)
        self.pending: List[Dict[str, List[np.ndarray]]] = [{k: [] for k in d} for d in self.ds]
        self.pending_bytes = 0
        self.epochs_written = 0
        self._check()

    def _group(self, g, lists, peers, n_stats: int, ids_chunk: int, cnt_chunk: int):
        """Empty appendable datasets in ``g``: an id list and an int32 ``_count`` per name of ``lists``,
        int32 lists ``peers``, and ``stats`` int64[*, n_stats] (none when 0); a running sha256 each."""
        d = {}
        for name in lists:
            d[name] = g.create_dataset(name, shape=(0,), maxshape=(None,), dtype=self.idt, chunks=(ids_chunk,),
                                       track_times=False)
            d[name + "_count"] = g.create_dataset(name + "_count", shape=(0,), maxshape=(None,), dtype="<i4",
                                                  chunks=(cnt_chunk,), track_times=False)
        for name in peers:
            d[name] = g.create_dataset(name, shape=(0,), maxshape=(None,), dtype="<i4", chunks=(ids_chunk,),
                                       track_times=False)
        if n_stats:
            d["stats"] = g.create_dataset("stats", shape=(0, n_stats), maxshape=(None, n_stats), dtype="<i8",
                                          chunks=(cnt_chunk, n_stats), track_times=False)
        self.ds.append(d)
        self.hash.append({name: hashlib.sha256() for name in d})

    # ---------------------------------------------------------------- epochs
    def add_epoch(self, ep: EpochPlan):
        """Append one epoch (its load/evict lists must have been recorded)."""
        if self.nodes is not None:
            return self._add_node_epoch(ep)
        if ep.load is None:
            raise ValueError("the epoch plan was not recorded (run_policy(record=True))")
        P, S = self.P, self.S
        if ep.bounds.shape[0] - 1 != S or ep.count.shape != (S, P):
            raise ValueError(f"epoch plan has shape {ep.count.shape}, expected ({S}, {P})")
        samples, scount = samples_rank_major(ep.indices, ep.bounds, ep.rank_of, P)  # int64[T], int64[P, S]
        load, lcount = csr_rank_major(ep.load_ptr, ep.load, S, P)
        evict, vcount = csr_rank_major(ep.evict_ptr, ep.evict, S, P)
        stats = np.stack([ep.hits, ep.hit_bytes, ep.misses, ep.miss_bytes, ep.stored_bytes], axis=-1)  # (S, P, 5)
        parts = {"samples": (samples, scount), "load": (load, lcount), "evict": (evict, vcount)}
        for name, (arr, cnt) in parts.items():
            starts = split_rows(cnt)  # int64[P+1]
            for r in range(P):
                self._queue(r, name, arr[starts[r]:starts[r + 1]].astype(self.idt))
                self._queue(r, name + "_count", cnt[r].astype("<i4"))
        for r in range(P):
            self._queue(r, "stats", np.ascontiguousarray(stats[:, r, :], dtype="<i8"))  # (S, 5)
        self.epochs_written += 1
        if self.pending_bytes >= self.flush_bytes:
            self.flush()

    def _add_node_epoch(self, ep):
        """Append one epoch of a node-pool plan (a recorded NodeEpochPlan): each rank's samples, each
        node's pool, staging and transfer lists."""
        if ep.load is None:
            raise ValueError("the node epoch plan was not recorded (record=True)")
        P, S, Q = self.P, self.S, self.nodes.n_nodes
        if ep.bounds.shape[0] - 1 != S or ep.count.shape != (S, P) or ep.stats.shape[:2] != (S, Q):
            raise ValueError(f"node epoch plan has shape {ep.count.shape}, expected ({S}, {P})")
        samples, scount = samples_rank_major(ep.indices, ep.bounds, ep.rank_of, P)  # int64[T], int64[P, S]
        starts = split_rows(scount)  # int64[P+1]
        for r in range(P):
            self._queue(r, "samples", samples[starts[r]:starts[r + 1]].astype(self.idt))
            self._queue(r, "samples_count", scount[r].astype("<i4"))
        for name in ("load", "evict", "stage"):
            arr, cnt = csr_rank_major(getattr(ep, name + "_ptr"), getattr(ep, name), S, Q)  # node-major
            starts = split_rows(cnt)  # int64[Q+1]
            for n in range(Q):
                self._queue(P + n, name, arr[starts[n]:starts[n + 1]].astype(self.idt))
                self._queue(P + n, name + "_count", cnt[n].astype("<i4"))
        step = np.repeat(np.arange(S, dtype=np.int64), np.diff(ep.xfer_ptr))  # (X,) step of each transfer
        for n in range(Q):
            for name, mine, other in (("send", ep.xfer_src, ep.xfer_dst), ("recv", ep.xfer_dst, ep.xfer_src)):
                sel = np.flatnonzero(mine == n)  # the plan's order (MPI matches a pair's messages in order)
                self._queue(P + n, name, ep.xfer_block[sel].astype(self.idt))
                self._queue(P + n, NODE_PEERS[name], other[sel].astype("<i4"))
                self._queue(P + n, name + "_count", np.bincount(step[sel], minlength=S).astype("<i4"))
            self._queue(P + n, "stats", np.ascontiguousarray(ep.stats[:, n, :], dtype="<i8"))  # (S, 10)
        self.epochs_written += 1
        if self.pending_bytes >= self.flush_bytes:
            self.flush()

    def _queue(self, r: int, name: str, arr: np.ndarray):
        self.pending[r][name].append(arr)
        self.pending_bytes += arr.nbytes

    def flush(self):
        for r in range(len(self.ds)):
            for name, parts in self.pending[r].items():
                if not parts:
                    continue
                arr = np.concatenate(parts)
                ds = self.ds[r][name]
                n = ds.shape[0]
                ds.resize(n + arr.shape[0], axis=0)
                ds[n:] = arr
                self._check()
                self.hash[r][name].update(arr.tobytes())
                parts.clear()
        self.pending_bytes = 0

    def _check(self):
        """Raise :class:`~solar.errors.WriteError` as soon as a write to the file has failed."""
        if self.out is not None:
            self.out.check()

    # ----------------------------------------------------------------- close
    def close(self, result: PolicyResult):
        """Write the per-epoch totals, checksums and the completion mark; returns the open file."""
        if self.epochs_written != self.E:
            raise ValueError(f"{self.epochs_written} epochs written, the job has {self.E}")
        self.flush()
        for r in range(len(self.ds)):
            for name, ds in self.ds[r].items():
                put_text(ds.attrs, "sha256", self.hash[r][name].hexdigest())
        g = self.f.create_group("epochs")
        _put(g, "source_epoch", np.asarray(result.epoch_order, dtype="<i8"))
        for name in ("hit_bytes", "miss_bytes", "stored_bytes", "demand_bytes", "max_local_batch",
                     "min_local_batch"):
            _put(g, name, np.asarray(getattr(result, name), dtype="<i8"))
        per = self.P if self.nodes is None else self.nodes.n_nodes  # a node plan's misses are per node
        _put(g, "rank_miss_bytes", np.asarray(result.rank_miss_bytes, dtype="<i8").reshape(self.E, per))
        if self.nodes is not None:
            _put(g, "peer_bytes", np.asarray(result.peer_bytes, dtype="<i8").reshape(self.E))
        put_text(self.f.attrs, "header_sha256", header_digest(self.f.attrs, self.version))
        self.f.attrs["complete"] = 1
        if self.out is None:
            self.f.flush()
            return self.f
        self.ds = []
        self.out.commit()
        return None

    def abort(self):
        """Close and discard the file (the temporary file is removed)."""
        self.ds = []
        if self.out is None:
            self.f.close()
        else:
            self.out.abort()
