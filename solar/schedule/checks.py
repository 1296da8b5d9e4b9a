"""Validation of everything read from a schedule file, before it is used.

Pure functions: attribute values and arrays in, :class:`Damaged` out.  Array
metadata (shape, dtype, bytes) is checked before an array is read, so a file that
claims 10^15 elements fails without allocating them; array contents are checked
before a rank plan or the sample -> block map is handed to the buffer manager,
so ids index what they should and a replayed plan stays within the budget.
"""
from __future__ import annotations

import json
from dataclasses import fields
from typing import Optional, Sequence, Tuple

import numpy as np

from ..errors import SolarError
from ..scheduler.config import PlanConfig
from ..scheduler.sampler import batch_bounds, epoch_indices, sampler_sizes, steps_per_epoch
from .format import id_dtype

MAX_TOTAL_BYTES = 2**62  # decoded bytes of all blocks together: int64 sums of them cannot overflow


class Damaged(Exception):
    """A value read from a schedule file that cannot be right (the message says which and why)."""


# ------------------------------------------------------------------- header
def attr_str(attrs, name: str) -> str:
    """Root attribute ``name`` as text (variable- or fixed-length UTF-8 string)."""
    if name not in attrs:
        raise Damaged(f"attribute {name} is missing")
    v = attrs[name]
    if isinstance(v, bytes):
        try:
            return v.decode()
        except UnicodeDecodeError:
            raise Damaged(f"attribute {name} is not UTF-8 text") from None
    if not isinstance(v, str):
        raise Damaged(f"attribute {name} is {_show(v)}, expected text")
    return v


def attr_int(attrs, name: str, lo: int = 0, hi: int = 2**62) -> int:
    """Root attribute ``name`` as an integer scalar in ``[lo, hi]``."""
    if name not in attrs:
        raise Damaged(f"attribute {name} is missing")
    v = attrs[name]
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise Damaged(f"attribute {name} is {_show(v)}, expected an integer")
    if not lo <= int(v) <= hi:
        raise Damaged(f"attribute {name} is {int(v)}, expected {lo}..{hi}")
    return int(v)


def parse_config(text: str) -> PlanConfig:
    """The ``config`` attribute (JSON of :class:`PlanConfig`) -> a validated PlanConfig."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        raise Damaged(f"attribute config is not JSON: {text[:60]!r}") from None
    names = {f.name for f in fields(PlanConfig)}
    if not isinstance(doc, dict) or set(doc) != names:
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise Damaged(f"attribute config has {got}, expected the fields {sorted(names)}")
    try:
        return PlanConfig(**doc)
    except (SolarError, TypeError, ValueError, OverflowError) as exc:
        raise Damaged(f"attribute config: {exc}") from None


def check_sizes(cfg: PlanConfig, n_samples: int, n_blocks: int, steps: int, ids: str):
    """The header's sizes agree with each other and with the job in ``cfg``."""
    if n_samples < 1:
        raise Damaged(f"n_samples is {n_samples}, expected at least 1")
    want = steps_per_epoch(n_samples, cfg.world_size, cfg.local_batch, cfg.drop_last)
    if steps != want:
        raise Damaged(f"steps_per_epoch is {steps}, but {n_samples} samples on {cfg.world_size} ranks with "
                      f"local batch {cfg.local_batch} make {want}")
    if ids != id_dtype(n_samples, n_blocks).str:
        raise Damaged(f"id_dtype is {ids!r}, expected {id_dtype(n_samples, n_blocks).str!r}")


def check_window(open_ended: bool, window: int, epochs: int):
    """An open-ended file holds one window of ``window`` = ``epochs`` epochs; a fixed one has window 0."""
    if open_ended and window != epochs:
        raise Damaged(f"window is {window}, but the open-ended schedule holds {epochs} epochs")
    if not open_ended and window != 0:
        raise Damaged(f"window is {window} in a schedule that is not open-ended (expected 0)")


def parse_resume(text: str, cfg: PlanConfig, n_samples: int, fingerprint: str) -> dict:
    """The ``resume`` attribute of a version-5 or 7 file (JSON ``{"step", "from"}``, see :mod:`.format`) -> that
    dict, checked: ``from`` is a loader state of the same dataset and global batch as ``cfg``, and ``step``
    is where :func:`~solar.scheduler.elastic.resume_point` puts its step, inside the job."""
    from ..scheduler import elastic
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        raise Damaged(f"attribute resume is not JSON: {text[:60]!r}") from None
    if not isinstance(doc, dict) or set(doc) != {"step", "from"}:
        raise Damaged(f"attribute resume has {sorted(doc) if isinstance(doc, dict) else type(doc).__name__}, "
                      f"expected ['from', 'step']")
    try:
        old = elastic.check_state(doc["from"])
    except SolarError as exc:
        raise Damaged(f"attribute resume: {exc}") from None
    if old["fingerprint"] != fingerprint:
        raise Damaged("attribute resume: the checkpointed job was on another dataset")
    o = old["config"]
    try:
        point = elastic.resume_point(n_samples, o.world_size, o.local_batch, cfg.world_size, cfg.local_batch,
                                     old["step"], cfg.drop_last)
    except SolarError as exc:
        raise Damaged(f"attribute resume: {exc}") from None
    n_steps = cfg.epochs * steps_per_epoch(n_samples, cfg.world_size, cfg.local_batch, cfg.drop_last)
    if doc["step"] != point.global_step or not point.global_step < n_steps or o.seed != cfg.seed or \
            o.drop_last != cfg.drop_last:
        raise Damaged(f"attribute resume: step {doc['step']!r} is not where the checkpointed step {old['step']} "
                      f"resumes in this job ({point.global_step} of {n_steps}, same seed and drop_last)")
    return doc


def parse_nodes(text: str, cfg: PlanConfig, policy: str):
    """The ``nodes`` attribute of a version-6 or 7 file (JSON, see :mod:`.format`) -> ``(NodeMap, PeerCost)``,
    checked: L divides the world size, the policy is a node-pool one."""
    from ..scheduler.nodes import NodeMap, PeerCost
    from ..scheduler.policies import NODE_POLICIES
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        raise Damaged(f"attribute nodes is not JSON: {text[:60]!r}") from None
    keys = {"ranks_per_node", "network_bytes_per_s", "storage_bytes_per_s"}
    if not isinstance(doc, dict) or set(doc) != keys:
        raise Damaged(f"attribute nodes has {sorted(doc) if isinstance(doc, dict) else type(doc).__name__}, "
                      f"expected {sorted(keys)}")
    if policy not in NODE_POLICIES:
        raise Damaged(f"policy {policy!r} of a node plan (version 6 or 7) is not a node-pool policy")
    try:
        return (NodeMap(cfg.world_size, doc["ranks_per_node"]),
                PeerCost(doc["network_bytes_per_s"], doc["storage_bytes_per_s"]))
    except SolarError as exc:
        raise Damaged(f"attribute nodes: {exc}") from None


def _pairs(blocks: np.ndarray, other: np.ndarray, count: np.ndarray, peer: int):
    """``(steps, blocks)`` of the transfers of one node's list (``blocks`` with the other node of each in
    ``other``, ``count`` int32[G] per step) that go to or come from node ``peer``, in the list's order."""
    step = np.repeat(np.arange(count.shape[0], dtype=np.int64), count)
    sel = other == peer
    return step[sel], np.asarray(blocks, np.int64)[sel]


def check_transfers(node: int, mine: dict, others: dict):
    """Between node ``node`` (its lists ``mine``) and each node it sends to or receives from (``others``:
    node -> its ``send``/``send_to``/``send_count`` and ``recv``/``recv_from``/``recv_count``): what one sends
    the other at each step is, in order, what the other receives from it.  A send nobody receives, or a
    receive nobody sends, would leave a rank waiting forever."""
    for m, d in sorted(others.items()):
        for a, b, src, dst in ((d, mine, m, node), (mine, d, node, m)):
            s_step, s_blk = _pairs(a["send"], a["send_to"], a["send_count"], dst)
            r_step, r_blk = _pairs(b["recv"], b["recv_from"], b["recv_count"], src)
            if s_step.shape != r_step.shape or not (np.array_equal(s_step, r_step) and np.array_equal(s_blk, r_blk)):
                k = next((i for i in range(min(s_step.shape[0], r_step.shape[0]))
                          if s_step[i] != r_step[i] or s_blk[i] != r_blk[i]), min(s_step.shape[0], r_step.shape[0]))
                at = (f"step {int(s_step[k]) if k < s_step.shape[0] else int(r_step[k])}"
                      if k < max(s_step.shape[0], r_step.shape[0]) else "the end")
                raise Damaged(f"node {src} sends node {dst} {s_step.shape[0]} blocks, node {dst} receives "
                              f"{r_step.shape[0]} from it; the lists first differ at {at}")


def check_staging(node: int, lists: dict, step_bytes: np.ndarray, block_nbytes: np.ndarray):
    """Each step's staged and received blocks of node ``node`` hold no more bytes than its ranks' samples of
    that step use (``step_bytes`` int64[G]): the staging area (sized from these lists) stays batch-sized."""
    G = step_bytes.shape[0]
    got = np.zeros(G, dtype=np.int64)
    for name in ("stage", "recv"):
        step = np.repeat(np.arange(G, dtype=np.int64), lists[name + "_count"])
        np.add.at(got, step, block_nbytes[np.asarray(lists[name], np.int64)])
    over = np.flatnonzero(got > step_bytes)
    if over.size:
        g = int(over[0])
        raise Damaged(f"node {node} stages or receives {int(got[g]):,} bytes at step {g}, more than the "
                      f"{int(step_bytes[g]):,} bytes its ranks' samples use then")


# ------------------------------------------------------------------- arrays
def check_meta(name: str, dtype: np.dtype, shape: Tuple[int, ...], want_dtype, want_shape: Sequence[Optional[int]],
               max_bytes: int):
    """Dataset ``name`` (its HDF5 ``dtype``/``shape``) is ``want_dtype`` with ``want_shape`` (None: any
    length) and its bytes fit in the file's ``max_bytes`` (solar writes no compression)."""
    if dtype != np.dtype(want_dtype):
        raise Damaged(f"{name} has dtype {dtype}, expected {np.dtype(want_dtype)}")
    if len(shape) != len(want_shape) or any(w is not None and s != w for s, w in zip(shape, want_shape)):
        raise Damaged(f"{name} has shape {tuple(shape)}, expected {tuple(want_shape)}")
    nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if nbytes > max_bytes:
        raise Damaged(f"{name} claims {nbytes:,} bytes, more than the file's {max_bytes:,}")


def check_range(name: str, arr: np.ndarray, lo: int, hi: int):
    """All values of ``arr`` lie in ``[lo, hi)``."""
    if arr.size and (int(arr.min()) < lo or int(arr.max()) >= hi):
        bad = arr[(arr < lo) | (arr >= hi)][0]
        raise Damaged(f"{name} holds {int(bad)}, outside [{lo}, {hi})")


def check_ptr(name: str, ptr: np.ndarray):
    """CSR pointers int64[n+1]: start at 0 and never decrease."""
    if ptr[0] != 0:
        raise Damaged(f"{name} starts at {int(ptr[0])}, expected 0")
    if ptr.shape[0] > 1 and (np.diff(ptr) < 0).any():
        k = int(np.flatnonzero(np.diff(ptr) < 0)[0])
        raise Damaged(f"{name} decreases at {k} ({int(ptr[k])} -> {int(ptr[k + 1])})")


def check_block_bytes(name: str, nbytes: np.ndarray):
    """Block sizes int64[B]: non-negative, all together below 2^62 bytes."""
    check_range(name, nbytes, 0, MAX_TOTAL_BYTES)
    if float(nbytes.sum(dtype=np.float64)) >= MAX_TOTAL_BYTES:
        raise Damaged(f"{name} adds up to more than 2^62 bytes")


def check_epochs(epochs: dict, E: int):
    """Per-epoch predictions: non-negative; ``source_epoch`` is a permutation of 0..E-1."""
    for k, arr in epochs.items():
        check_range(f"epochs/{k}", arr, 0, 2**63 - 1)
    if not np.array_equal(np.sort(epochs["source_epoch"]), np.arange(E)):
        raise Damaged(f"epochs/source_epoch is not an order of the {E} epochs")
    if (epochs["min_local_batch"] > epochs["max_local_batch"]).any():
        raise Damaged("epochs/min_local_batch exceeds epochs/max_local_batch")


def check_replay(rank: int, load: np.ndarray, load_count: np.ndarray, evict: np.ndarray, evict_count: np.ndarray,
                 block_nbytes: np.ndarray, budget: int, what: str = "rank"):
    """Replaying rank ``rank``'s plan (per step: evict, then load; ids already in range) never evicts
    a block that is not resident, never loads one that is, and never holds more than ``budget`` bytes.

    ``load``/``evict`` id arrays, ``*_count`` int32[G] per step; O(n log n) in the list lengths.
    """
    G = load_count.shape[0]
    step_l = np.repeat(np.arange(G, dtype=np.int64), load_count)
    step_e = np.repeat(np.arange(G, dtype=np.int64), evict_count)
    blocks = np.concatenate([evict.astype(np.int64), load.astype(np.int64)])
    when = np.concatenate([2 * step_e, 2 * step_l + 1])  # a step's evictions come before its loads
    sign = np.concatenate([np.full(evict.shape[0], -1, np.int8), np.ones(load.shape[0], np.int8)])
    order = np.lexsort((when, blocks))
    b, s, w = blocks[order], sign[order], when[order]
    first = np.ones(b.shape[0], dtype=bool)
    first[1:] = b[1:] != b[:-1]
    bad = (first & (s < 0)) | (~first & (s == np.roll(s, 1)))
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        state = "not resident" if s[k] < 0 else "already resident"
        verb = "evicts" if s[k] < 0 else "loads"
        raise Damaged(f"{what} {rank} {verb} block {int(b[k])} at step {int(w[k]) // 2}, which is {state}")
    delta = np.zeros(G, dtype=np.int64)
    np.add.at(delta, step_l, block_nbytes[load])
    np.subtract.at(delta, step_e, block_nbytes[evict])
    resident = np.cumsum(delta)
    if G and int(resident.max()) > budget:
        g = int(np.argmax(resident))
        raise Damaged(f"{what} {rank} holds {int(resident[g]):,} bytes after step {g}, more than its buffer of "
                      f"{budget:,} bytes")


def check_sampler(rank: int, samples: np.ndarray, samples_count: np.ndarray, n_samples: int, cfg: PlanConfig,
                  epoch_order: np.ndarray):
    """Rank ``rank``'s samples at each step come from that step's global batch of DistributedSampler
    (source epoch ``epoch_order[e]``), as the planner guarantees: catches in-range sample ids that were
    changed.  ``samples`` id[n_r] with ``samples_count`` int32[E*S]; one ``randperm(N)`` per epoch."""
    _, total = sampler_sizes(n_samples, cfg.world_size, cfg.drop_last)
    bounds = batch_bounds(total, cfg.world_size, cfg.local_batch)  # int64[S+1]
    S = bounds.shape[0] - 1
    step_of_pos = np.repeat(np.arange(S, dtype=np.int64), np.diff(bounds))
    start = 0
    for e, src in enumerate(epoch_order.tolist()):
        cnt = samples_count[e * S:(e + 1) * S]
        mine = samples[start:start + int(cnt.sum(dtype=np.int64))].astype(np.int64)
        start += mine.shape[0]
        idx = epoch_indices(n_samples, cfg.world_size, cfg.seed, src, cfg.drop_last)
        step = np.repeat(np.arange(S, dtype=np.int64), cnt)
        ok = _in_step(mine, step, idx, step_of_pos, n_samples)
        if not ok.all():
            k = int(np.flatnonzero(~ok)[0])
            raise Damaged(f"rank {rank} trains sample {int(mine[k])} at step {int(step[k])} of epoch position {e}, "
                          f"which is not in that step's DistributedSampler batch")


def _in_step(mine: np.ndarray, step: np.ndarray, idx: np.ndarray, step_of_pos: np.ndarray, n: int) -> np.ndarray:
    """bool[m]: sample ``mine[i]`` is in global batch ``step[i]`` of the epoch's index ``idx`` (int64[T],
    position p in batch ``step_of_pos[p]``).  Padding repeats a sample at most twice while T <= 2N:
    its first and last step then say it all, in O(N + T); else (N < world size) a sort."""
    if idx.shape[0] > 2 * n:
        return np.isin(step * n + mine, step_of_pos * n + idx)
    first = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    last = np.full(n, -1, dtype=np.int64)
    np.minimum.at(first, idx, step_of_pos)
    np.maximum.at(last, idx, step_of_pos)
    return (first[mine] == step) | (last[mine] == step)


def _show(v) -> str:
    if isinstance(v, np.ndarray):
        return f"an array of shape {v.shape}"
    return f"{type(v).__name__} {str(v)[:40]!r}"
