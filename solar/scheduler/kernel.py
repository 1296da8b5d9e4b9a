"""What the planner kernels (:func:`.engine.run_epoch`, :func:`.peer_engine.run_epoch_peer`) take and give:
four structs of arrays (named tuples, which numba types field by field), and their codes.

``Job``      the job's fixed inputs: batch bounds, per-step count bounds, the planning units, the policy;
``Epoch``    one epoch's accesses and their next uses;
``Buffers``  the buffers' state, kept from epoch to epoch (hash table, heaps, owners, due counts);
``Out``      what an epoch's kernel writes: buffer of each position, statistics, recorded lists, status;
``Scratch``  (inside a kernel, :mod:`.steps`) one step's assignment and needs.

"Buffers" are ranks, or nodes when ranks share a node's pool; "units" are the planner's units (layout
blocks, or groups of them, :mod:`.groups`).  Pure: arrays in, arrays out; no I/O, no MPI, no clock.
"""
from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

INF = np.int64(1) << np.int64(62)  # next use of a unit never used again
EMPTY = np.int64(-1)  # hash table: a slot never used
TOMB = np.int64(-2)  # hash table: a slot whose entry was removed
FRESH = INF + np.int64(1)  # priority of a unit loaded this step, before its refresh

# assignment modes
STRIDED, ROUTED, BOUNDARY = 0, 1, 2
# eviction kinds
BELADY, LRU, FIFO = 0, 1, 2
# status codes (Out.err[0])
OK, TOO_SMALL, HEAP_FULL, OUT_FULL, TABLE_FULL = 0, 1, 2, 3, 4
# rows of the statistics Out.st int64[NST, S, buffers] (units counted in layout blocks, bytes decoded but STORED)
COUNT, HITS, HIT_BYTES, PEER, PEER_BYTES, MISS, MISS_BYTES, STORED, STAGED, STAGED_BYTES = range(10)
NST = 10
# Out.n: how much of each recorded list is written
N_LOAD, N_EVICT, N_STAGE, N_XFER = range(4)
# Scratch.kind: what a buffer's need of a unit at a step is
HIT, RECV, LOAD = 0, 1, 2  # resident there; sent by the peer holding it (peer kernel); read from storage


class Job(NamedTuple):
    """The job's inputs, the same in every epoch (S steps, U units, Q buffers)."""

    bounds: np.ndarray  # int64[S+1]  global batch k = positions bounds[k]:bounds[k+1]
    cap_lo: np.ndarray  # int64[S]    fewest samples a buffer takes at each step
    cap_hi: np.ndarray  # int64[S]    most samples a buffer takes at each step
    target: np.ndarray  # int64[S]    a buffer's share of each step
    nbytes: np.ndarray  # int64[U]    decoded bytes of each unit (what a buffer holds)
    stored: np.ndarray  # int64[U]    bytes read from storage for it
    count: np.ndarray  # int64[U]     layout blocks of each unit (empty: one each)
    peer_ok: np.ndarray  # bool[U]    a miss of the unit may be a transfer (peer kernel; else empty)
    n_buf: int  # Q buffers
    ranks: int  # ranks of the strided split: position p of a batch from lo goes to rank (p - lo) % ranks,
    per_buf: int  # ... and to buffer rank // per_buf (ranks sharing a buffer)
    mode: int  # STRIDED, ROUTED or BOUNDARY
    evict_kind: int  # BELADY, LRU or FIFO
    budget: int  # bytes of one buffer
    boundary_steps: int  # BOUNDARY: steps of an epoch routed to holders
    blocks_per_slot: int  # most units of one sample
    refresh_holder: bool  # peer kernel: a peer's use refreshes the sender's priority
    # parts of chunks (:mod:`solar.layout.parts`): units sharing an *extent* (a chunk) are read together; all
    # four empty when every unit is its own extent (then ``stored`` is what a unit's read costs)
    ext_ptr: np.ndarray  # int64[U+1]  extents of unit u: ext_ids[ext_ptr[u]:ext_ptr[u+1]]
    ext_ids: np.ndarray  # int64[*]
    ext_stored: np.ndarray  # int64[X]  bytes read from storage for an extent (once per step and buffer)
    xu_ptr: np.ndarray  # int64[X+1]  units of extent x: xu_units[xu_ptr[x]:xu_ptr[x+1]]
    xu_units: np.ndarray  # int64[*]
    admit: bool  # keep the parts of an extent read at a step that are used again before what they would evict
    run_horizon: int  # runs: a neighbour is kept only if its next use is within this many steps
    admit_max: int  # runs: most units kept beside each unit a buffer reads at a step (recorded loads are sized by it)
    runs: bool  # the extents are runs of neighbouring blocks (not chunks): a unit kept beside a read is read too
    # (its ``stored`` paid; ``ext_stored`` is 0), in the same request as its neighbour


class Epoch(NamedTuple):
    """One epoch's accesses (T positions, A accesses)."""

    idx: np.ndarray  # int64[T]  "sample" of each position
    acc_ptr: np.ndarray  # int64[T+1]  accesses of position p: unit_ptr[idx[p]] ..., nu[acc_ptr[p]] ...
    nu: np.ndarray  # int64[A]  next use step of each access's unit after this step (INF: never)
    unit_ptr: np.ndarray  # int64[*+1]  units of sample i: units[unit_ptr[i]:unit_ptr[i+1]]
    units: np.ndarray  # int64[*]
    step0: int  # global step of the epoch's first step
    first_step: int  # steps before it are skipped (a job resumed mid-epoch; rank kernel only)


class Buffers(NamedTuple):
    """The buffers' state, kept across epochs (Q buffers, U units)."""

    keys: np.ndarray  # int64[slots]  hash table of resident (buffer, unit): key buffer * U + unit
    prio: np.ndarray  # int64[slots]  each entry's eviction priority (the heaps pop the largest)
    used: np.ndarray  # int64[slots]  the last step that used it
    hk: np.ndarray  # int64[Q, cap]   one lazy max-heap of (priority, unit) per buffer: priorities,
    hb: np.ndarray  # int64[Q, cap]   ... units (stale entries are skipped when popped)
    hn: np.ndarray  # int64[Q]        ... and sizes
    res_bytes: np.ndarray  # int64[Q]  bytes resident
    owner: np.ndarray  # int64[U]  the buffer that used (ROUTED) or loaded it last; -1: none
    stamp: np.ndarray  # int64[U]  (step, buffer) that last counted it: one need per unit and step
    n_res: np.ndarray  # int64[2]  live entries and tombstones of the hash table
    due: np.ndarray  # int64[R, Q]  ROUTED: units resident on q whose next use is t, at [t % R, q]
    nxt: np.ndarray  # int64[U]  (``job.admit``) each unit's next use after its last use so far (INF: none seen)
    ext_stamp: np.ndarray  # int64[X]  (step, buffer) that last read each extent: one read per extent and step


class Out(NamedTuple):
    """What an epoch's kernel writes (T positions, S steps, Q buffers)."""

    buf_of: np.ndarray  # int32[T]  buffer of each position
    st: np.ndarray  # int64[NST, S, Q]  rows COUNT .. STAGED_BYTES
    record: bool  # write the lists below
    load: np.ndarray  # int64[*]  units loaded, CSR over (step, buffer): load_ptr int64[S*Q+1]
    load_ptr: np.ndarray
    evict: np.ndarray  # int64[*]  units evicted (before the step's loads), evict_ptr int64[S*Q+1]
    evict_ptr: np.ndarray
    stage: np.ndarray  # int64[*]  units read into staging only (peer kernel), stage_ptr int64[S*Q+1]
    stage_ptr: np.ndarray
    x_src: np.ndarray  # int32[X]  transfers (peer kernel): sender, receiver,
    x_dst: np.ndarray
    x_blk: np.ndarray  # int64[X]  ... unit sent; CSR over steps x_ptr int64[S+1]
    x_ptr: np.ndarray
    n: np.ndarray  # int64[4]  lengths written: N_LOAD, N_EVICT, N_STAGE, N_XFER
    err: np.ndarray  # int64[4]  on failure: (status, step, buffer, bytes needed)


class Scratch(NamedTuple):
    """A kernel's scratch for one step (W = positions of the epoch + 1, G = units of the largest step,
    Q buffers), allocated once per epoch by :func:`scratch`."""

    cnt: np.ndarray  # int64[Q]  samples given to each buffer
    lim: np.ndarray  # int64[Q]
    rr: np.ndarray  # int64[1]  round-robin pointer
    aff_rank: np.ndarray  # int64[64]  buffers owning a sample's units, and
    aff_val: np.ndarray  # int64[64]  ... their bytes of it
    resv: np.ndarray  # int64[W]  due slots reserved by routed misses, and
    resv_r: np.ndarray  # int64[W]  ... their buffers
    qfar: np.ndarray  # int64[W]  misses never used again
    qpos: np.ndarray  # int64[W]  misses used again, and
    qkey: np.ndarray  # int64[W]  ... their buckets of next use
    qord: np.ndarray  # int64[W]  misses in routing order
    bcnt: np.ndarray  # int64[W+2]  bucket counts
    pos_by: np.ndarray  # int64[W]  the step's positions grouped by buffer (index order inside one),
    start: np.ndarray  # int64[Q+1]  ... buffer q's at pos_by[start[q]:start[q+1]]
    node: np.ndarray  # int64[2G]  the step's needs: buffer, unit, its next use, kind (HIT, RECV, LOAD);
    unit: np.ndarray  # int64[2G]  ... the peer kernel adds the senders' refreshes (at most one per need)
    nu: np.ndarray  # int64[2G]
    kind: np.ndarray  # int64[2G]
    loads: np.ndarray  # int64[2G]  the step's reads (LOAD needs' units), buffer q's at
    ld_start: np.ndarray  # int64[Q+1]  ... loads[ld_start[q]:ld_start[q+1]],
    ld_bytes: np.ndarray  # int64[Q]  ... their bytes
    pinned_k: np.ndarray  # int64[2G+1]  residents used at the step, popped while making room: priorities,
    pinned_b: np.ndarray  # int64[2G+1]  ... units
    cand: np.ndarray  # int64[C]  (``job.admit``) parts a step's reads bring that the buffer may keep, and
    cand_nu: np.ndarray  # int64[C]  ... their next uses (C: G x the most units of one extent)


@nb.njit(cache=True, nogil=True, no_cpython_wrapper=True)
def scratch(job):
    """:class:`Scratch` for one epoch of ``job`` (a :class:`Job`)."""
    S = job.bounds.shape[0] - 1
    Q = job.n_buf
    w = job.bounds[S] - job.bounds[0] + 1
    g = 2 * ((np.max(job.bounds[1:] - job.bounds[:-1]) if S > 0 else 0) * job.blocks_per_slot + 1)
    c = 0
    if job.admit and job.xu_ptr.shape[0] > 1:
        c = g * np.max(job.xu_ptr[1:] - job.xu_ptr[:-1]) * max(1, np.max(job.ext_ptr[1:] - job.ext_ptr[:-1]))
    return Scratch(np.zeros(Q, np.int64), np.zeros(Q, np.int64), np.zeros(1, np.int64), np.empty(64, np.int64),
                   np.empty(64, np.int64), np.empty(w, np.int64), np.empty(w, np.int64), np.empty(w, np.int64),
                   np.empty(w, np.int64), np.empty(w, np.int64), np.empty(w, np.int64), np.zeros(w + 2, np.int64),
                   np.empty(w, np.int64), np.zeros(Q + 1, np.int64), np.empty(g, np.int64), np.empty(g, np.int64),
                   np.empty(g, np.int64), np.empty(g, np.int64), np.empty(g, np.int64), np.zeros(Q + 1, np.int64),
                   np.zeros(Q, np.int64), np.empty(g + 1, np.int64), np.empty(g + 1, np.int64),
                   np.empty(c, np.int64), np.empty(c, np.int64))


def outputs(T: int, S: int, Q: int, A: int, resident: int, record: bool, nodes: bool, err: np.ndarray,
            admitted: int = 0) -> Out:
    """An epoch's :class:`Out`, zeroed, and ``err`` zeroed in place.  Recorded lists are sized for A accesses,
    ``admitted`` more loads (parts kept beside a read, ``Job.admit``) and ``resident`` units resident before
    the epoch; the stage and transfer lists only for node pools."""
    def ptr(n):
        return np.zeros(n, dtype=np.int64) if record else np.zeros(0, dtype=np.int64)

    def ids(n, dtype=np.int64, keep=True):
        return np.empty(n if record and keep else 0, dtype=dtype)

    err[:] = 0
    return Out(np.empty(T, dtype=np.int32), np.zeros((NST, S, Q), dtype=np.int64), bool(record),
               ids(A + admitted), ptr(S * Q + 1), ids(A + admitted + resident + 1), ptr(S * Q + 1),
               ids(A, keep=nodes), ptr(S * Q + 1 if nodes else 0),
               ids(A, np.int32, nodes), ids(A, np.int32, nodes), ids(A, keep=nodes), ptr(S + 1 if nodes else 0),
               np.zeros(4, dtype=np.int64), err)
