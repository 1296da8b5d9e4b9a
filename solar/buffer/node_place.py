"""A node's buffer: a node plan (:class:`solar.scheduler.node_plan.NodePlan`) executed by the ranks of a node
sharing one pool in an MPI shared-memory window (:mod:`solar.buffer.node_pools`); the per-step loop is the
manager's (:mod:`solar.buffer.manager`), this is the place it runs in, one instance per rank.

Per step g, at node n (the plan's order): evict, load, stage, the transfers of g, then every rank
of n assembles its samples from n's pool and staging area.  At run time:

* **Who reads**: the node's loads and stages of g are split over its ranks by a read split
  (:data:`~solar.buffer.node_pools.READ_SPLITS`; ``need``, the default: each block by a rank whose samples
  use it at g, the least loaded of them where several do; ``spread``: contiguous runs balanced by stored
  bytes; ``leader``: local rank 0 reads all); each rank reads its part with its own reader, straight into
  the shared slots, in the manager's prefetch thread (reads of up to ``io_depth`` steps in flight, at most
  ``prefetch`` assembled batches waiting), the blocks other ranks use at g first, in a request of their own.
* **Who waits**: every rank publishes counters in the window: ``READ`` (its part of every step up to it
  is in the pool; for local rank 0 also the blocks received from other nodes), ``SHARED`` (the blocks of
  its part that other ranks use at the step, up to it) and ``DONE`` (it has assembled every step up to it;
  for local rank 0 also sent every block of those steps).  A rank assembles g once its own reads of g
  are in, every rank that read a block it uses at g has SHARED >= g, and every rank that read one of its
  blocks at an earlier step g' has READ >= g' (every rank records who read each block, and when: all book
  the same steps): with the ``need`` split, ranks wait for each other only where their samples share
  blocks, not for each other's whole reads (local rank 0 of a plan with transfers also waits until it has
  posted the node's sends of g, which need the whole node's reads of g).  It writes step g's slots once every
  rank of its node has DONE >= ``after[g]`` (the slot assignment says when they are free: once the node has assembled the
  last use of the block a slot held, or its load if it was not used, where the plan holds every local
  rank's samples; else the step before its eviction: :func:`~solar.buffer.node_pools.assign_slots`).
  Waiting is polling with a backoff sleep (50 us .. 2 ms; a rank's own reads wake it at once), never a
  spin.
* **Transfers** (``solar-peer`` plans): local rank 0 of each node posts, when it books step g, a
  receive per block the node gets at g (into its staging slots), and once its node has read g, a
  send per block it gives at g (a copy of the slot: see :meth:`NodePlace.poll`), on a communicator of
  its own (tag: the step).  Blocks of one (step, sender, receiver) are matched in the plan's order (MPI's
  non-overtaking rule).  Sends and receives are tested in the same polling loop, so a slow rank
  or node only slows the ranks that need its blocks.
* **Failures**: a rank whose prefetch thread fails, or whose consumer leaves a ``with`` block on
  an exception (:meth:`NodePlace.fail`), marks itself failed in the window (with a one-line
  message) and, when the plan has transfers, tells every other node's local rank 0; every rank that
  learns of it raises :class:`NodeBufferError` naming the failed rank at its next ``get``.
  Under the loader's abort hooks (:mod:`solar.mpi`) the first error ends the job.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List

import numpy as np

from ..errors import SolarError
from ..layout.parts import extent_of, stored_once
from ..memory import plan_node_memory
from .node_pools import (DONE, FAILED, CLOSED, FLAG, READ, RECV, SHARED, NodeBufferError, SharedPools, assign_slots,
                         check_node_memory, get_read_split, last_uses, node_comm)
from .steps import Booked, BufferTotals, StepBlocks, StepStats, read_outside, step_blocks
from .warmup import resident_at

TAG_MOD = 32000      # transfer tags: step % TAG_MOD (MPI guarantees tags up to 32767)
TAG_ERR = 32001      # "a rank failed" (payload: its one-line message)
TAG_CLOSED = 32002   # "this node closed before its plan's end" (payload: int64, the first step it has not sent)
_KEPT: list = []     # what a closed manager must never free: transfer communicators of managers closed before their
                     # plan's end, requests not complete at close (and so their buffers): see close
NO_DEP = -(1 << 62)  # a step's dependency on a rank it does not depend on


class PeerFailed(NodeBufferError):
    """Another rank failed (raised here so that this rank does not wait for it forever)."""


@dataclass
class NodeStepStats(StepStats):
    """:class:`StepStats` of one rank at one step; ``misses``/``bytes_*``: this rank's part of the
    node's reads; ``staged``: of those, staging reads; ``recv_*``/``sent_*``: blocks the node
    received / sent at this step (counted on local rank 0 only)."""

    staged: int = 0
    recv_blocks: int = 0
    recv_bytes: int = 0
    sent_blocks: int = 0
    sent_bytes: int = 0


NODE_KEYS = ("staged", "recv_blocks", "recv_bytes", "sent_blocks", "sent_bytes")


@dataclass
class NodeTotals(BufferTotals):
    staged: int = 0
    recv_blocks: int = 0
    recv_bytes: int = 0
    sent_blocks: int = 0
    sent_bytes: int = 0

    def add(self, s: NodeStepStats):
        super().add(s)
        for k in NODE_KEYS:
            setattr(self, k, getattr(self, k) + getattr(s, k))


def _same(keys: list, names: tuple, first: int = 0) -> None:
    """NodeBufferError (the same on every rank that gathered ``keys``) naming the first field in which a
    rank's key differs from the first one's; ``first``: the job rank of ``keys[0]``."""
    for j, k in enumerate(keys):
        if k != keys[0]:
            i = next(i for i in range(len(k)) if k[i] != keys[0][i])
            raise NodeBufferError(f"rank {first + j} runs {names[i]} = {k[i]!r}, rank {first} {keys[0][i]!r}: every "
                                  f"rank must pass the same plan, range, prefetch, io_depth and batch size")


class NodePlace:
    """Rank ``rank``'s view of its node's shared pools and of the node plan; what
    :class:`~solar.buffer.node_manager.NodeBufferManager` documents (arguments, checks) is done here."""

    error_cls, what, kind = NodeBufferError, "node buffer manager", "node-"
    totals_cls = NodeTotals
    warmup = None  # (a rank's buffer counts its warm-up there; a node's: warmup_bytes_read)

    def __init__(self, plan, rank, demand, reader, comm, budget, prefetch, start, stop, io_depth, batch_bytes,
                 read_split, keep_step_stats, timeout):
        nodes = plan.nodes
        P, L = nodes.world_size, nodes.ranks_per_node
        if comm is not None and comm.Get_size() != P:
            raise NodeBufferError(f"the node plan is for {P} ranks but the communicator has {comm.Get_size()}")
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < P:
            raise NodeBufferError(f"rank must be an integer in [0, {P}), got {rank!r}")
        if comm is not None and comm.Get_rank() != rank:
            raise NodeBufferError(f"rank={rank} disagrees with the communicator, whose rank is {comm.Get_rank()}")
        if comm is None and P > 1:
            raise NodeBufferError(f"a node plan of {P} ranks needs comm= (the job's communicator)")
        for name, v, lo in (("prefetch", prefetch, 1), ("io_depth", io_depth, 1),
                            ("keep_step_stats", keep_step_stats, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise NodeBufferError(f"{name} must be an integer >= {lo}, got {v!r}")
        if getattr(reader, "collective", False):
            raise NodeBufferError(f"reader {getattr(reader, 'name', reader)!r} is collective; node-shared buffers need "
                                  f"an independent reader (pread, h5py, or mpiio with collective=False)")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise NodeBufferError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
        split = get_read_split(read_split)
        G = plan.n_steps
        self.start, self.stop = int(start), G if stop is None else int(stop)
        if not 0 <= self.start <= self.stop <= G:
            raise NodeBufferError(f"steps [{start}, {stop}) outside the plan's [0, {G})")
        self.plan, self.rank, self.comm, self.reader = plan, int(rank), comm, reader
        self.nodes, self.L, self.node = nodes, L, int(rank) // L
        self.local = int(rank) - self.node * L
        self.owners, self.read_split = split, read_split
        self.prefetch, self.io_depth, self.timeout = int(prefetch), int(io_depth), timeout
        self.budget = int(budget)
        self.sample_ptr = np.asarray(demand["sample_ptr"], np.int64)
        self.sample_blocks = np.asarray(demand["sample_blocks"], np.int64)
        self.block_nbytes = np.asarray(demand["block_nbytes"], np.int64)
        self.block_stored = np.asarray(demand.get("block_stored", demand["block_nbytes"]), np.int64)
        self.extent = extent_of(getattr(reader, "layout", None))  # parts of chunks: one read per chunk and step
        self.together = self.extent if self.extent is not None else demand.get("block_run")  # ... or per run
        B = self.block_nbytes.shape[0]
        self.transfers = plan.n_transfers > 0
        if self.transfers:
            from mpi4py import MPI
            if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
                raise NodeBufferError("a plan with transfers needs MPI_THREAD_MULTIPLE (sends and receives run in the "
                                      "prefetch thread); mpi4py.rc.thread_level is lower")
        # the node's lists and this rank's samples, int64[G+1] pointers each
        self.lists = plan.node(self.node)
        mine = plan.rank(self.rank)
        self.samples, self.samples_ptr = np.asarray(mine["samples"], np.int64), mine["samples_ptr"]
        # every local rank's samples per step (who needs which block at a step: the read split "need"); a plan
        # that holds this rank's alone (a later window of an open-ended plan) reads by "spread" instead
        try:
            self.local_samples = [(np.asarray(r["samples"]), np.asarray(r["samples_ptr"], np.int64))
                                  for r in (plan.rank(q) for q in nodes.ranks_of(self.node))]
        except IndexError:
            self.local_samples = None
            if read_split == "need":
                self.owners = get_read_split("spread")
        self.memory, slots2, self.class_of, class_bytes, main, self.stg = plan_node_memory(
            self.lists, self.block_nbytes, self.sample_ptr.shape[0] - 1, self.sample_blocks.shape[0], L=L,
            budget=self.budget, batch=int(batch_bytes), prefetch=self.prefetch, io_depth=self.io_depth)
        C = class_bytes.shape[0]
        self.C = C
        check_node_memory(self.memory, self.node, L)
        self.class_bytes2 = np.concatenate([class_bytes, class_bytes]).astype(np.int64)  # (2C,) pool, staging
        self.slots2 = slots2
        # a pool slot is free once the node has assembled the last use of the block it held (known where the plan
        # holds every local rank's samples), else the step before its eviction
        last = None if self.local_samples is None else last_uses(
            main[2], main[3], B, self.sample_ptr, self.sample_blocks, self.local_samples,
            [(self.lists["send"], self.lists["send_ptr"])])
        self.load_slot, after_main = assign_slots(self.class_of, slots2[:C], *main, last_use=last)
        self.stage_slot, after_stage = assign_slots(self.class_of, slots2[C:], *self.stg, check_evict=False)
        self.after = np.maximum(after_main, after_stage)  # (G,)
        if self.start > 0:  # a resume: no slot is written before every rank's warm-up reads are in
            self.after[self.start:] = np.maximum(self.after[self.start:], self.start - 1)
        self.slot_of = np.full(B, -1, dtype=np.int64)   # pool slot of each block resident (this rank's view)
        self.sslot_of = np.full(B, -1, dtype=np.int64)  # staging slot of each block staged or received
        # which local rank read each block last, at which step (every rank books every step: the same everywhere)
        self.loaded_by = np.full(B, -1, dtype=np.int32)  # (solar.memory.node.NODE_BLOCK_BYTES counts these)
        self.loaded_at = np.full(B, -1, dtype=np.int64)
        self._mark = np.zeros(B, dtype=bool)  # book's scratch (all False between calls)
        # step -> (read of this rank's part that other ranks use at the step, read of the rest, READ needed of
        # each local rank, SHARED needed of each): see ready
        self._parts: Dict[int, tuple] = {}
        self.resident_bytes = 0
        self.peak_resident_bytes = 0
        self.warmup_bytes_read = 0
        self.ran_all = False  # the prefetch thread finished the plan's last step
        self._failed_shared = False
        self._send_next = self.start  # local rank 0 with transfers: the first step whose sends are not posted
        self._closed_nodes: Dict[int, int] = {}  # node -> first step it has not sent, from its TAG_CLOSED notice
        self._err_reqs: list = []
        self.ncomm = self.xcomm = self.shm = self.pools = None
        self._sending: Deque[tuple] = deque()    # (step, send requests) of local rank 0 in flight
        self._sends: Dict[int, list] = {}        # step -> [(dest rank, view)] noted at booking, sent later
        # the polling loop's view: this rank's last READ / RECV / DONE published, its last step assembled, the
        # node's counters as last read
        self.pub_read = self.pub_recv = self.pub_shared = self.asm = self.done = self.start - 1
        self.reads = self.dones = self.shareds = None
        self.xfer = False  # local rank 0 of a plan with transfers (set once connected)
        self.booked_to = self.start  # the first step not booked yet
        self.node_read = self.recvd = self.start - 1

    @property
    def closed(self) -> bool:
        return self.shm is None

    def connect(self):
        """The collective part: every rank agrees on the plan and range, the node's communicator and
        window, the transfer communicator."""
        comm = self.comm
        if comm is not None and comm.Get_size() > 1:
            # everything the shared slot layout depends on (ranks of a node that computed different slots would
            # read and write each other's blocks): the same on every rank, then the slots on every rank of a node
            # (the split in effect: a plan without the other ranks' samples reads by "spread")
            key = (self.start, self.stop, self.plan.identity(), (self.read_split, self.local_samples is not None),
                   self.prefetch, self.io_depth, int(self.memory.batches))
            keys = comm.allgather((key, (tuple(int(x) for x in self.slots2), int(self.memory.window))))
            # every rank reaches the same verdict from the same list: all raise, or none
            _same([k for k, _ in keys], ("start", "stop", "plan", "read_split", "prefetch", "io_depth", "batch bytes"))
            for n in range(self.nodes.n_nodes):
                ranks = self.nodes.ranks_of(n)
                _same([keys[r][1] for r in ranks], ("slots", "window bytes"), ranks[0])
            self.ncomm = node_comm(comm, self.node)
            if self.transfers:
                self.xcomm = comm.Dup()
        # a resume: DONE starts a step lower and reaches start - 1 once this rank's warm-up reads are in. A slot
        # that holds a block at ``start`` is reused by a load that waits for DONE >= start - 1 on every rank of
        # the node (assign_slots' ``after``), so no rank overwrites a slot that another one is still warming up
        self.shm = SharedPools(self.ncomm if self.L > 1 else None, self.class_bytes2, self.slots2,
                               self.memory.window, init=self.start - 1,
                               done_init=self.start - 2 if self.start > 0 else None)
        self.pools = self.shm.pools
        self.xfer = self.xcomm is not None and self.local == 0

    # ------------------------------------------------------------------ consumer side
    def fail(self, exc: BaseException):
        """Tell the other ranks that this one failed (``exc``: why), so that none waits for it (a no-op
        for the failure of another rank, which they know of)."""
        if isinstance(exc, PeerFailed):
            return
        self._share_failure(f"{type(exc).__name__}: {exc}" if not isinstance(exc, SolarError) else str(exc))

    def close(self, q):
        """Free the window once the manager ``q``'s prefetch thread has stopped.  Collective over the node (and
        over ``comm`` for a plan with transfers) when nothing failed; after a failure nothing collective is done
        (the window is left to the process's end, so that no rank waits for a failed one)."""
        failed = self._failed_shared or q._error is not None or self._peer_failed()
        if not failed:
            self.shm.publish(FLAG, CLOSED)
        left = []
        if self.xcomm is not None:  # requests left by an early close or a failure
            sends = [r for _, reqs in self._sending for r in reqs]
            unsent = next((g for g, reqs in self._sending if not _all_done(reqs)), self._send_next)
            if not failed and self.ran_all:
                # the plan's end: the other nodes, at theirs too, take the last steps' blocks; until they have,
                # MPI may still read each send's buffer (a rendezvous transfer pulls it when the receive matches)
                _finish(sends, self._peer_failed)
            recvs = [r for b in q._booked for r in b.recvs]
            for r in recvs:
                _drop(r)
            # a send is never cancelled (its receiver may have been told to wait for it: _notify_closed) nor
            # freed with its buffer: freed, the block's copy went back to the allocator, which wrote its own
            # bookkeeping over the first 32 bytes while MPI could still send them (wrong bytes at the receiver,
            # no error: found by a review, 2026-11-27); kept, it completes whenever its receive comes
            for r in sends + [r for r, _ in self._err_reqs]:
                _keep(r)
            left = [r for r in recvs + sends if not _done(r)]
            if not failed and self.local == 0 and not self.ran_all:
                self._notify_closed(unsent)
            if not (self.ran_all and not left):
                # closed before its plan's end: another node's block for a later step may still come, or sit
                # unmatched (a send MPI delivered eagerly cannot be cancelled).  Freed, the communicator's
                # context id would go to the next manager's Dup, whose receive for the same step tag would take
                # that stale block in place of its own (wrong bytes, no error).  Kept, no later Dup gets its id.
                _KEPT.append(self.xcomm)
                self.xcomm = None
        if failed:  # the window is left mapped (a rank may still write into it); its pages no longer faulted in
            self.shm.stop_populating()
            self.shm = None
            return
        freed = self.shm.free()  # gives up if a rank of the node fails while this one waits for it
        self.shm = None
        if not freed:
            return
        for c in (self.xcomm, self.ncomm):
            if c is not None:
                c.Free()
        self.xcomm = self.ncomm = None

    def _notify_closed(self, unsent: int):
        """Local rank 0 closing before its plan's end: tell every other node's local rank 0 which steps' blocks
        will not come (from ``unsent`` on), so that one waiting for them ends with an error instead of a hang."""
        payload = np.array([unsent], dtype=np.int64)
        for m in range(self.nodes.n_nodes):
            if m != self.node:
                _KEPT.append((self.xcomm.Isend([payload, _byte()], dest=self.nodes.ranks_of(m)[0], tag=TAG_CLOSED),
                              payload))

    # ------------------------------------------------------------------ shared state
    def _share_failure(self, message: str, own: bool = True):
        """Mark this rank failed in the window (its node's ranks see it) and, for a failure of its own
        (``own``) in a plan with transfers, tell every other node's local rank 0."""
        if self._failed_shared or self.shm is None:
            return
        self._failed_shared = True
        text = f"rank {self.rank} (node {self.node}) failed: {message}" if own else message
        self.shm.fail(text)
        if self.xcomm is not None and own:
            payload = bytearray(text.encode("utf-8", "replace")[:255])
            for m in range(self.nodes.n_nodes):
                if m != self.node:
                    self._err_reqs.append((self.xcomm.Isend([payload, _byte()], dest=self.nodes.ranks_of(m)[0],
                                                            tag=TAG_ERR), payload))

    def _peer_failed(self) -> bool:
        if self.shm is None:
            return False
        flags = self.shm.counters(FLAG)
        return bool(((flags == FAILED) & (np.arange(self.L) != self.local)).any())

    def _check_peers(self):
        """PeerFailed when another rank of the node, or (local rank 0, transfers) of the job, failed."""
        flags = self.shm.counters(FLAG)
        for j in np.flatnonzero(flags == FAILED).tolist():
            if j != self.local:
                raise PeerFailed(self.shm.message(j) or f"rank {self.node * self.L + j} (node {self.node}) failed")
        if self.xcomm is not None and self.local == 0:
            from mpi4py import MPI
            st = MPI.Status()
            while self.xcomm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_CLOSED, status=st):
                got = np.zeros(1, dtype=np.int64)
                self.xcomm.Recv([got, _byte()], source=st.Get_source(), tag=TAG_CLOSED)
                self._closed_nodes[st.Get_source() // self.nodes.ranks_per_node] = int(got[0])
            if self.xcomm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_ERR, status=st):
                buf = bytearray(st.Get_count(MPI.BYTE))
                self.xcomm.Recv([buf, MPI.BYTE], source=st.Get_source(), tag=TAG_ERR)
                text = buf.decode("utf-8", "replace")
                self._share_failure(text, own=False)  # this node's other ranks learn it from the window
                raise PeerFailed(text)

    def failure(self, exc: BaseException) -> str:
        return f"node buffer of rank {self.rank} failed: {type(exc).__name__}: {exc}"

    def failed(self, exc: BaseException, err: BaseException):
        if not isinstance(exc, PeerFailed):
            self._share_failure(str(err))

    # ------------------------------------------------------------------ the manager's hooks
    def warm_up(self):
        """Read this rank's part of what the plan holds resident when step ``start`` begins (a resume), then
        publish DONE = start - 1 (this rank's share of the resident blocks is in)."""
        lst, lp = self.lists, self.lists["load_ptr"]
        blocks = resident_at(lst["load"], lp, lst["evict"], lst["evict_ptr"], self.start, self.block_nbytes.shape[0])
        loaded, last = np.unique(np.asarray(lst["load"][:lp[self.start]], np.int64)[::-1], return_index=True)
        # each resident block's slot: that of its last load before start (last: positions in the reversed list)
        slot = self.load_slot[:lp[self.start]][::-1][last[np.searchsorted(loaded, blocks)]]
        self.slot_of[blocks] = slot
        self.resident_bytes = self.peak_resident_bytes = int(self.block_nbytes[blocks].sum())
        owner = self._read_together(blocks, self.owners(blocks, self.block_stored[blocks], [], self.L))
        self.loaded_by[blocks], self.loaded_at[blocks] = owner, self.start  # in once SHARED >= start
        part = owner == self.local
        views = [self._view(int(self.class_of[b]), int(s), int(b)) for b, s in zip(blocks[part].tolist(),
                                                                                  slot[part].tolist())]
        if views:
            self.warmup_bytes_read = self.reader.read_blocks(blocks[part], views).bytes_read
        self.shm.publish(DONE, self.start - 1)

    def poll(self, booked) -> bool:
        """Failures of other ranks; this rank's reads (READ) and local rank 0's receives (RECV) of the oldest
        steps, published in order; local rank 0's sends of the steps its node has read; DONE.  Whether
        anything moved."""
        progressed = False
        self._check_peers()
        reads, dones = self.reads, self.dones = self.shm.counters(READ), self.shm.counters(DONE)
        shareds = self.shareds = self.shm.counters(SHARED)
        self.recvd = int(self.shm.counters(RECV)[0])
        # this rank's reads that other ranks use at the same step complete: SHARED, in order; all its storage
        # reads of the oldest steps complete: READ, in order (READ <= SHARED); local rank 0's receives complete:
        # RECV (separate: a node sends once its reads are in, whatever it still receives)
        for item in booked:
            if item.g <= self.pub_shared:
                continue
            fs = self._parts[item.g][0]
            if fs is not None:
                if not fs.done():
                    break
                fs.result()  # a failed read raises here: never published as in
            self._publish_shared(item.g)
            progressed = True
        for item in booked:
            if item.g <= self.pub_read:
                continue
            fs, fo = self._parts[item.g][:2]
            if any(f is not None and not f.done() for f in (fs, fo)):
                break
            for f in (fs, fo):
                if f is not None:
                    rs = f.result()
                    item.stats.bytes_read += rs.bytes_read
                    item.stats.n_reads += rs.n_reads
            item.stats.read_s = time.perf_counter() - item.t0
            self._parts[item.g] = (None, None) + self._parts[item.g][2:]
            if item.g > self.pub_shared:
                self._publish_shared(item.g)
            self.pub_read = item.g
            self.shm.publish(READ, self.pub_read)
            reads[self.local] = self.pub_read
            progressed = True
        if self.local == 0:
            for item in booked:
                if item.g <= self.pub_recv:
                    continue
                if item.recvs and not _all_done(item.recvs):
                    break
                self.pub_recv = self.recvd = item.g
                self.shm.publish(RECV, self.pub_recv)
                progressed = True
        self.node_read = int(reads.min())
        if self.xfer:  # local rank 0: send the blocks of steps its node has read; completed sends
            sending = self._sending
            while self._send_next < self.booked_to and self._send_next <= self.node_read:
                g = self._send_next
                # each block copied out of the window first: MPICH 5.0.2 sending straight from a shared
                # window's memory gave MPI_ERR_TRUNCATE at the receiver (CMA on) or a segfault (CMA off)
                reqs = [self.xcomm.Isend([v.copy(), _byte()], dest=d, tag=g % TAG_MOD)
                        for d, v in self._sends.pop(g, [])]
                sending.append((g, reqs))
                self._send_next = g + 1
                progressed = True
            while sending and _all_done(sending[0][1]):
                sending.popleft()
                progressed = True
        return self._publish_done() or progressed

    def _publish_shared(self, g: int):
        self.pub_shared = g
        self.shm.publish(SHARED, g)
        self.shareds[self.local] = g

    def _publish_done(self) -> bool:
        """DONE: every step up to it assembled here (and, for local rank 0 with transfers, its blocks sent)."""
        if self.xfer:
            sent = self._sending[0][0] - 1 if self._sending else self._send_next - 1
            d = min(self.asm, sent)
        else:
            d = self.asm
        if d <= self.done:
            return False
        self.done = d
        self.shm.publish(DONE, d)
        self.dones[self.local] = d
        return True

    def ready(self, item: Booked) -> bool:
        """Step g's blocks are in for this rank's samples: its own reads of g (READ), the blocks other ranks
        read at g that it uses (their SHARED >= g), those they read at earlier steps (their READ >= that step),
        the blocks received from other nodes (RECV).  Not the other ranks' whole reads of g: a rank waits for
        another only where they share blocks."""
        g = item.g
        if g > self.pub_read or g > self.recvd:
            return False
        if self.xfer and g >= self._send_next:  # local rank 0: the node's sends of g posted first, so that a
            return False                         # consumer that took g and closes leaves none of them unsent
        dep_read, dep_shared = self._parts[g][2:]
        return bool((self.reads >= dep_read).all() and (self.shareds >= dep_shared).all())

    def before_assemble(self, item: Booked):
        """(The reads' figures were taken when READ was published.)"""
        self._parts.pop(item.g, None)

    def assembled(self, g: int):
        self.asm = g
        self._publish_done()

    def drained(self) -> bool:
        return self.done >= self.stop - 1

    def may_book(self, g: int, booked) -> bool:
        """Step g's slots are free on the whole node: every rank assembled the step that freed them."""
        return int(self.dones.min()) >= int(self.after[g])

    def idle(self, q, booked, g_book: int, wait_s: float, idle_s: float) -> bool:
        """Nothing moved: check for a stuck node (:meth:`_check_stuck`), then sleep ``wait_s`` (the manager's
        backoff) unless the consumer wakes it.  Whether this rank waits for its own consumer."""
        own = self._check_stuck(q, booked, g_book, idle_s)
        with q._cv:
            if not q._closed:
                q._cv.wait(wait_s)
        return own

    def _check_stuck(self, q, booked, g_book, idle_s) -> bool:
        """While nothing moves: a closed rank this one waits for, or ``timeout`` spent waiting for the
        node's other ranks (not for this rank's consumer), raise NodeBufferError.  Returns whether this
        rank waits for its own consumer (its queue full, or reads as far ahead as allowed)."""
        flags, reads, dones, pub_read = self.shm.counters(FLAG), self.reads, self.dones, self.pub_read
        waits = []  # (local rank, what, step) this rank waits for, to make that step
        if booked and booked[0].g <= pub_read:
            g = booked[0].g
            dep_read, dep_shared = self._parts[g][2:]
            waits += [(j, f"its reads of step {g}", g)
                      for j in np.flatnonzero((reads < dep_read) | (self.shareds < dep_shared)).tolist()]
            if self.xfer and g >= self._send_next:  # local rank 0: the node's sends of g need every rank's reads
                waits += [(j, f"its reads of step {g} (the node's sends of it)", g)
                          for j in np.flatnonzero(reads < g).tolist()]
        if g_book < self.stop and len(booked) < self.io_depth:
            a = int(self.after[g_book])
            what = f"its step {a} to be assembled" if a >= self.start else \
                f"its warm-up reads (the blocks resident at step {self.start})"
            waits += [(j, what, g_book) for j in np.flatnonzero(dones < a).tolist()]
        with q._cv:
            wanted = q._waiting  # the step this rank's consumer waits for in get (None: it is not waiting)
        if self._closed_nodes and booked and booked[0].recvs and not _all_done(booked[0].recvs) \
                and wanted is not None and booked[0].g <= wanted:
            g = booked[0].g
            rp = self.lists["recv_ptr"]
            for m in sorted({int(x) for x in np.asarray(self.lists["recv_from"][rp[g]:rp[g + 1]]).tolist()}):
                if self._closed_nodes.get(m, g + 1) <= g:
                    raise NodeBufferError(
                        f"rank {self.nodes.ranks_of(m)[0]} (node {m}) closed its node buffer before sending its "
                        f"blocks of step {g}, which rank {self.rank} waits for: every rank must close together")
        for j, what, g in waits:
            # a closed rank ends this one only once its consumer waits for what that rank will not give: steps
            # prefetched beyond what the consumer took may never be asked for (the ranks close together)
            if j != self.local and flags[j] == CLOSED and wanted is not None and g <= wanted:
                raise NodeBufferError(f"rank {self.node * self.L + j} closed its node buffer while rank {self.rank} "
                                      f"waits for {what}: every rank of a node must close together")
        with q._cv:  # (or for its own assembly thread, which needs no other rank: not a stall of the node)
            consumer_bound = (bool(booked) and booked[0].g - q._next_get >= self.prefetch) or (
                not booked and (g_book - q._next_get >= self.prefetch + self.io_depth or q._fenced(g_book))) \
                or bool(q._making)
        if consumer_bound:
            return True
        if self.timeout is not None and idle_s > self.timeout:
            who = ", ".join(f"rank {self.node * self.L + j} ({what})" for j, what, _ in waits) \
                or "other nodes' transfers"
            raise NodeBufferError(f"rank {self.rank} made no progress for {idle_s:.0f} s waiting for {who} (node "
                                  f"{self.node}: READ {reads.tolist()}, DONE {dones.tolist()}; next step to book "
                                  f"{g_book})")
        return False

    def book(self, g: int, io) -> Booked:
        lst, C = self.lists, self.C
        lp, ep = lst["load_ptr"], lst["evict_ptr"]
        ev = np.asarray(lst["evict"][ep[g]:ep[g + 1]], np.int64)
        ld = np.asarray(lst["load"][lp[g]:lp[g + 1]], np.int64)
        self.slot_of[ev] = -1
        self.slot_of[ld] = self.load_slot[lp[g]:lp[g + 1]]
        self.resident_bytes += int(self.block_nbytes[ld].sum()) - int(self.block_nbytes[ev].sum())
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
        s_load, s_lptr, s_evict, s_eptr = self.stg
        self.sslot_of[s_evict[s_eptr[g]:s_eptr[g + 1]]] = -1
        sl = s_load[s_lptr[g]:s_lptr[g + 1]]
        self.sslot_of[sl] = self.stage_slot[s_lptr[g]:s_lptr[g + 1]]
        sp = self.samples_ptr
        samples = self.samples[sp[g]:sp[g + 1]]
        st = NodeStepStats(g, samples=int(samples.shape[0]))
        # where each block this rank's samples need lives: pool (class c), staging (class C + c)
        need = step_blocks(self.sample_ptr, self.sample_blocks, samples)
        slot, cls = self.slot_of[need], self.class_of[need].astype(np.int64)
        staged = slot < 0
        slot = np.where(staged, self.sslot_of[need], slot)
        cls = np.where(staged, cls + C, cls)
        missing = need[slot < 0]
        mark = self._mark  # scratch: the blocks loaded at g (cleared below)
        mark[ld] = True
        fresh = mark[need]  # blocks of this rank's samples loaded at g: misses, not hits
        mark[ld] = False
        st.hits = int(np.count_nonzero(~staged & ~fresh))
        st.hit_bytes = int(self.block_nbytes[need[~staged & ~fresh]].sum())
        extra = read_outside(self.reader, missing, self.block_nbytes, st)  # the plan said the node holds these
        blocks = StepBlocks(g, need, cls, slot, self.pools, self.block_nbytes, extra)
        # this rank's part of the node's reads: loads (pool) and stages (staging), sorted by block
        n_stage = int(lst["stage_ptr"][g + 1] - lst["stage_ptr"][g])
        r_blocks = np.concatenate([ld, sl[:n_stage]])
        r_cls = np.concatenate([self.class_of[ld], self.class_of[sl[:n_stage]] + C]).astype(np.int64)
        r_slot = np.concatenate([self.slot_of[ld], self.sslot_of[sl[:n_stage]]])
        is_stage = np.arange(r_blocks.shape[0]) >= ld.shape[0]
        order = np.argsort(r_blocks, kind="stable")
        rb = r_blocks[order]
        # who reads what (the read split), the same on every rank of the node: it needs every local rank's blocks
        needs = [need if j == self.local else self._needs(j, g) for j in range(self.L)]
        owner = self._read_together(rb, self.owners(rb, self.block_stored[rb], needs, self.L), needs)
        self.loaded_by[rb], self.loaded_at[rb] = owner, g
        # what this rank's samples wait for: blocks other local ranks read at g (their SHARED >= g) or before
        # (their READ >= that step); blocks read by no rank yet (-1: received, or read outside) wait for none
        by, at = self.loaded_by[need], self.loaded_at[need]
        peer = (by >= 0) & (by != self.local)
        dep_read = np.full(self.L, NO_DEP, dtype=np.int64)
        dep_shared = np.full(self.L, NO_DEP, dtype=np.int64)
        old = peer & (at < g)
        np.maximum.at(dep_read, by[old], at[old])
        dep_shared[by[peer & (at >= g)]] = g
        mine = order[owner == self.local]
        st.misses, st.bytes_loaded = int(mine.shape[0]), int(self.block_nbytes[r_blocks[mine]].sum())
        st.stored_bytes = stored_once(self.block_stored, self.extent, r_blocks[mine])
        st.staged = int(np.count_nonzero(is_stage[mine]))
        # this rank's reads that other ranks use at g first, in a request of their own (they wait for it)
        # (where the other ranks' blocks are not known, all of this rank's reads count as used by them)
        others = [needs[j] for j in range(self.L) if j != self.local]
        if self.local_samples is None:
            used = np.ones(mine.shape[0], bool)
        elif others:
            theirs = np.concatenate(others)
            mark[theirs] = True
            used = mark[r_blocks[mine]]
            mark[theirs] = False
        else:
            used = np.zeros(mine.shape[0], bool)
        if self.together is not None and used.any() and not used.all():  # a chunk's parts (a run) in one request
            ext = self.together[r_blocks[mine]]
            used = np.isin(ext, ext[used])
        t0 = time.perf_counter()
        futs = []
        for part in (mine[used], mine[~used]):
            if not part.size:
                futs.append(None)
                continue
            views = [self._view(c, s, b) for c, s, b in zip(r_cls[part].tolist(), r_slot[part].tolist(),
                                                           r_blocks[part].tolist())]
            futs.append(io.submit(self.reader.read_blocks, r_blocks[part], views))
        self._parts[g] = (futs[0], futs[1], dep_read, dep_shared)
        recvs = []
        if self.xfer:
            recvs = self._post_transfers(g, st)
        self.booked_to = g + 1
        # (no fut: a node place's readiness is its counters, ready(); the reads wake the manager through wakes)
        return Booked(g, samples, blocks, st, None, t0, recvs=recvs, wakes=tuple(f for f in futs if f is not None))

    def _read_together(self, blocks: np.ndarray, owner: np.ndarray, needs=()) -> np.ndarray:
        """``owner`` (the read split's reader of each of ``blocks``, ascending), with the parts of one chunk (a
        plan on parts of chunks) all read by the reader of the first of them: one read of the chunk; likewise
        the blocks of one run of neighbours (a plan that reads them, :mod:`solar.layout.runs`): one request,
        by the reader of its first block that a rank of the node ``needs`` at this step (the others are read
        for later; the read split balances the needed blocks, so the runs follow; a review saw one rank read
        3.5x the other's bytes when a run went to the reader of its first block)."""
        if self.together is None or not owner.size:
            return owner
        _, first, inv = np.unique(self.together[blocks], return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
        if self.extent is None and len(needs):
            needed = np.flatnonzero(np.isin(blocks, np.concatenate([np.asarray(n, np.int64) for n in needs])))
            pick = np.full(first.shape[0], blocks.shape[0], dtype=np.int64)
            np.minimum.at(pick, inv[needed], needed)  # each run's first needed block
            first = np.where(pick < blocks.shape[0], pick, first)
        return owner[first][inv]

    def _needs(self, j: int, g: int) -> np.ndarray:
        """int64[m] ascending: the blocks local rank j's samples use at step g (none where the plan does not
        hold rank j's samples)."""
        if self.local_samples is None:
            return np.zeros(0, np.int64)
        smp, ptr = self.local_samples[j]
        return step_blocks(self.sample_ptr, self.sample_blocks, smp[ptr[g]:ptr[g + 1]])

    def _post_transfers(self, g: int, st: NodeStepStats) -> list:
        """Local rank 0: post the receives of step g (into staging slots) and note its sends (posted
        once the node has read g)."""
        lst, C = self.lists, self.C
        rp, sp = lst["recv_ptr"], lst["send_ptr"]
        recv, frm = lst["recv"][rp[g]:rp[g + 1]], lst["recv_from"][rp[g]:rp[g + 1]]
        reqs = []
        for b, m in zip(np.asarray(recv, np.int64).tolist(), np.asarray(frm).tolist()):
            v = self._view(int(self.class_of[b]) + C, int(self.sslot_of[b]), b)
            reqs.append(self.xcomm.Irecv([v, _byte()], source=self.nodes.ranks_of(int(m))[0], tag=g % TAG_MOD))
        st.recv_blocks, st.recv_bytes = len(reqs), int(self.block_nbytes[np.asarray(recv, np.int64)].sum())
        send, to = lst["send"][sp[g]:sp[g + 1]], lst["send_to"][sp[g]:sp[g + 1]]
        out = []
        for b, m in zip(np.asarray(send, np.int64).tolist(), np.asarray(to).tolist()):
            if self.slot_of[b] >= 0:
                v = self._view(int(self.class_of[b]), int(self.slot_of[b]), b)
            elif self.sslot_of[b] >= 0:
                v = self._view(int(self.class_of[b]) + C, int(self.sslot_of[b]), b)
            else:
                raise NodeBufferError(f"step {g}: the plan has node {self.node} send block {b}, which it does not "
                                      f"hold (damaged plan?)")
            out.append((self.nodes.ranks_of(int(m))[0], v))
        self._sends[g] = out
        st.sent_blocks, st.sent_bytes = len(out), int(self.block_nbytes[np.asarray(send, np.int64)].sum())
        return reqs

    def _view(self, c: int, s: int, b: int) -> np.ndarray:
        arr = self.pools.arrays[c][s]
        n = int(self.block_nbytes[b])
        return arr if n == arr.shape[0] else arr[:n]


def _byte():
    from mpi4py import MPI
    return MPI.BYTE


def _all_done(reqs: List) -> bool:
    from mpi4py import MPI
    return bool(MPI.Request.Testall(reqs))


#: Seconds a closing node waits for its last sends to be received (the other nodes end their plan too), and for a
#: cancelled receive to end, before it keeps the request alive instead (_KEPT: its buffer is never freed).
FINISH_S, CANCEL_S = 60.0, 1.0


def _done(req) -> bool:
    from mpi4py import MPI
    try:
        return req == MPI.REQUEST_NULL or bool(req.Test())
    except Exception:  # noqa: BLE001 - a request MPI no longer knows: nothing left to wait for
        return True


def _finish(reqs: List, failed, wait_s: float = FINISH_S) -> bool:
    """Wait (polling) until ``reqs`` are complete; False after ``wait_s`` seconds or once ``failed()`` says a rank
    of the node failed (then they are kept, see :func:`_keep`)."""
    deadline = time.monotonic() + wait_s
    while not all(_done(r) for r in reqs):
        if failed() or time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _keep(req):
    """A request not complete at close stays referenced to the process's end (its message buffer with it)."""
    if not _done(req):
        _KEPT.append(req)


def _drop(req):
    """Give up on a receive still active at close: cancelled, and waited for until the cancel (or the receive) is
    over, so that nothing writes into the window after it is freed; kept (never freed) where that takes longer than
    :data:`CANCEL_S`."""
    from mpi4py import MPI
    try:
        if req == MPI.REQUEST_NULL:
            return
        req.Cancel()
    except Exception:  # noqa: BLE001 - best effort at shut-down
        return
    if not _finish([req], lambda: False, CANCEL_S):
        _KEPT.append(req)
