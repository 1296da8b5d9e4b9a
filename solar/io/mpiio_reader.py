"""The ``mpiio`` reader: MPI-IO reads of coalesced ranges, decoding in a thread pool.

Every file of the layout is opened once, collectively, at construction
(``MPI.File.Open(comm, path, MODE_RDONLY)``), so constructing and closing the
reader are collective over ``comm`` (``None`` means ``MPI.COMM_SELF``).  A
layout of more files than the open-file budget (the smallest over the ranks of
:func:`~solar.io.fdcache.open_file_budget`, from ``ulimit -n``; option
``max_open``) is refused at construction with a SpecError pointing to the
``pread`` reader, which reopens files on demand.

``collective=True`` (default): :meth:`read_blocks` is collective.  Each call
first agrees, with one ``Allreduce(MAX)`` over an int32[n_files] array, on how
many read rounds each file needs; then every rank walks those files in order
and, per round, sets a file view of its ranges (an hindexed byte type) and calls
``Read_all`` into one packed buffer, with an empty view when it has nothing
there.  A read error is held until the rounds are over and is raised on every
rank (one more small ``Allreduce``), so a failure never leaves ranks waiting: a failure before the rounds
(a request this rank refuses, memory for a round's buffer) is held too, and the rank takes part in the
rounds with nothing to read.  The ranks' prefetch threads read ahead by different amounts, so a rank may
close while others still make reads: ``close`` keeps taking part in their reads, with nothing to read, until
every rank is closing (one more int in the ``Allreduce``: whether the rank still reads), then closes the
files.  ROMIO counts bytes past the end of a file as read in ``Read_all``, so each round also asks the file's
size (every rank, ``Get_size``): a file cut short since it was opened fails as a short read, never delivers
the memory it left unwritten.

``collective=False``: one independent ``Read_at`` per coalesced range, no
collective calls per step.

A read that comes back short or fails (``MPI.Exception``) is retried for its
missing bytes with independent ``Read_at`` calls (a collective read's on a
per-rank ``COMM_SELF`` handle, opened on demand by path (refused if the path is now another file than the
one opened), at most :data:`RETRY_HANDLES` kept open, so the other ranks are not involved), up to
``READ_RETRIES`` times with a short backoff; then the step fails with a
DecodeError naming file, dataset, chunk and byte range.

Reads run in the calling thread (MPI calls; the loader's I/O thread, while the training thread may make
MPI calls of its own: MPI_THREAD_MULTIPLE is required); copying and decoding into the caller's arrays run
in ``threads`` worker threads, overlapping the next read.
"""
from __future__ import annotations

import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import ClassVar

import numpy as np

from .. import aligned
from ..errors import DecodeError, SpecError
from ..threads import start_threads
from .block_plan import (
    deliver,
    direct_mask,
    fill_unwritten,
    plan_reads,
    chunk_where,
    short_read_error,
)
from .coalesce import CoalescePolicy
from .fdcache import FileCache
from .pread_reader import READ_RETRIES, RETRY_BACKOFF_S
from .reader import BlockReader, ReadStats, check_file_budget, mpi4py_missing, register

_INT_MAX = 2**31 - 1
RETRY_HANDLES = 4
"""``COMM_SELF`` handles for retries kept open at once (least recently used closed first)."""


@register
class MpiioReader(BlockReader):
    """MPI-IO; options ``collective``, ``coalesce``, ``max_gap``, ``max_read``, ``max_call_bytes``,
    ``max_open`` (the most files it may open at once; None: from ``ulimit -n``)."""

    name = "mpiio"
    threaded = True
    collective = True  # the default; an instance built with collective=False overrides it
    needs_raw = True
    OPTIONS: ClassVar[dict] = {"collective": True, "coalesce": True, "max_gap": CoalescePolicy.max_gap,
                               "max_read": CoalescePolicy.max_read, "max_call_bytes": 1 << 30, "max_open": None}

    @classmethod
    def available(cls):
        why = mpi4py_missing()
        return not why, why

    def __init__(self, layout, *, comm=None, threads: int = 4, **options):
        super().__init__(layout, comm=comm, threads=threads, **options)
        from mpi4py import MPI
        self._MPI = MPI
        o = self.options
        if not isinstance(o["collective"], bool):
            raise SpecError(f"collective must be True or False, got {o['collective']!r}")
        mcb = o["max_call_bytes"]
        if isinstance(mcb, bool) or not isinstance(mcb, int) or not 1 <= mcb <= _INT_MAX:
            raise SpecError(f"max_call_bytes must be an integer in [1, {_INT_MAX}], got {mcb!r}")
        self.collective = o["collective"]
        self.policy = CoalescePolicy(o["max_gap"], o["max_read"], o["coalesce"])
        self.max_call_bytes = mcb
        if MPI.Query_thread() != MPI.THREAD_MULTIPLE:  # the same on every rank: refused before any collective
            raise SpecError("reader 'mpiio' reads in the loader's I/O thread while the training thread may make MPI "
                            "calls of its own: it needs MPI_THREAD_MULTIPLE, and mpi4py.rc.thread_level is lower; "
                            "use the 'pread' reader")
        check_file_budget(layout, self.name, self._budget(MPI, comm, o["max_open"]))
        # a communicator of our own: the reads' collectives run in the prefetch thread while the training
        # loop may run its own collectives (allreduce of gradients) on ``comm``; on one communicator the two
        # could match each other across ranks (wrong results, or a hang)
        self.comm = (comm if comm is not None else MPI.COMM_SELF).Dup()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="solar-mpiio")
        self._fh = []
        self._ids = []  # (st_dev, st_ino) of each file as opened: a retry handle, opened by path, must be the same
        self._in_call = False  # this rank's part of the current read_blocks call reached the collective rounds
        # file index -> COMM_SELF handle for retries (opened on first need)
        self._self_fh = FileCache(self._open_self, lambda fh: fh.Close(), RETRY_HANDLES)
        try:
            for p in layout.files:
                self._fh.append(MPI.File.Open(self.comm, p, MPI.MODE_RDONLY))
                st = os.stat(p)
                self._ids.append((st.st_dev, st.st_ino))
        except MPI.Exception as exc:
            self._close_files()
            self.comm.Free()
            raise DecodeError(f"MPI-IO cannot open {p}: {exc.Get_error_string()}") from None
        # ROMIO's Read_all through a file view reports the full count even past the end of
        # the file, so ranges are checked against the sizes the files had when opened.
        self._sizes = [fh.Get_size() for fh in self._fh]

    @staticmethod
    def _budget(MPI, comm, max_open) -> int:
        """The files a rank may open: ``max_open`` or the open-file budget, the smallest over ``comm``'s
        ranks (collective), so every rank refuses or accepts the layout alike."""
        from .pread_reader import max_open_option
        mine = max_open_option(max_open, "mpiio")
        return mine if comm is None else comm.allreduce(mine, op=MPI.MIN)

    def _close_files(self):
        for fh in self._fh:
            fh.Close()
        self._fh = []
        self._self_fh.close_all()

    def _open_self(self, f: int):
        """This rank's own handle on file ``f`` (``COMM_SELF``), for independent retries; a DecodeError where the
        path is now another file than the one the reader opened (replaced: its bytes are not the layout's)."""
        MPI = self._MPI
        path = self.layout.files[f]
        fh = MPI.File.Open(MPI.COMM_SELF, path, MPI.MODE_RDONLY)
        try:
            st = os.stat(path)
            same = (st.st_dev, st.st_ino) == self._ids[f]
        except OSError:
            same = False
        if not same:
            fh.Close()
            raise DecodeError(f"{path} was replaced while the job read it (not the file the reader opened): "
                              "its bytes are not the planned layout's")
        return fh

    def _retry_handle(self, f: int):
        """This rank's own handle on file ``f``, for independent retries.  Not pinned: only the thread
        calling ``read_blocks`` uses these handles, and it evicts one only in a later call."""
        fh = self._self_fh.acquire(f)
        self._self_fh.release(f)
        return fh

    def open_stats(self) -> dict:
        n = len(self._fh)
        st = self._self_fh.stats()
        return {"opens": n + st["opens"], "evictions": st["evictions"], "max_open": n + RETRY_HANDLES}

    def _read_at_full(self, fh, start: int, buf: np.ndarray, bl, where: int) -> int:
        """``Read_at`` file bytes ``[start, start + len(buf))`` into ``buf`` until full, retrying a short
        or failed read up to READ_RETRIES times; returns the bytes read (less: the file ended)."""
        MPI = self._MPI
        got = failures = 0
        while got < buf.shape[0]:
            st = MPI.Status()
            try:
                fh.Read_at(start + got, [buf[got:], MPI.BYTE], st)
                n = st.Get_count(MPI.BYTE)
            except MPI.Exception as exc:
                if failures >= READ_RETRIES:
                    raise DecodeError(
                        f"reading {chunk_where(self.layout, int(bl[0]))}: bytes [{start}, {start + buf.shape[0]}) "
                        f"failed ({failures + 1} tries): {exc.Get_error_string()}"
                    ) from None
                n = 0
            if n <= 0:
                if failures >= READ_RETRIES:
                    break
                time.sleep(RETRY_BACKOFF_S * 2 ** failures)
                failures += 1
                continue
            got += n
        return got

    def start(self) -> None:
        if self.threads > 1 and not self._closed:  # the workers that decode and deliver the ranges read
            start_threads(self._pool, self.threads)

    def close(self) -> None:
        """Collective over ``comm``: closes every file; collective reads of ranks still reading are taken part in
        (with nothing to read) until every rank closes."""
        if not self._closed:
            self._closed = True  # (a close that failed is not run again)
            try:
                if self.collective:
                    self._drain()
            finally:
                self._pool.shutdown(wait=True)
                self._close_files()
                self.comm.Free()
        super().close()

    def _drain(self) -> None:
        """Take part, with nothing to read, in the collective reads the other ranks still make, until every rank
        is closing (all say so in the same ``Allreduce``).  Another rank's read error is that rank's to raise."""
        while True:
            _, _, reading = self._rounds_of_call({}, None, [], reading=0)
            self._raise_on_all_ranks(None, others=False)
            if not reading:
                return

    def read_blocks(self, blocks, out: Sequence[np.ndarray]) -> ReadStats:
        if not self.collective or self._closed:
            return super().read_blocks(blocks, out)
        self._in_call = False
        try:
            return super().read_blocks(blocks, out)
        except Exception as exc:
            if self._in_call:
                raise
            self.fail_call(exc)  # refused before its collective part (a bad request on this rank)
            raise

    def fail_call(self, exc: BaseException) -> None:
        """A call that failed on this rank before its collective part (``exc``; a wrapping reader's too: the parts
        reader's): take part in it with nothing to read, so the other ranks are not left waiting, and raise ``exc``
        here and "another rank failed" on the others."""
        self._rounds_of_call({}, exc, [])
        self._raise_on_all_ranks(exc)
        raise exc

    # ----------------------------------------------------------------- read
    def read_alone(self, blocks, out: Sequence[np.ndarray]) -> ReadStats:
        """Outside the collective sequence (any thread, no other rank involved): independent reads on ``COMM_SELF``
        handles opened for the call (not the collective handles, whose file view the rounds set, nor the retry
        handles, which the reading thread owns); the files must be those opened.  ROMIO holds one lock through a
        collective read, so a read alone beside another thread's ``Read_all`` waits for that round (for the
        slowest rank to reach it)."""
        if not self.collective:
            return self.read_blocks(blocks, out)
        return self._request(blocks, out, self._read_alone)

    def _read_alone(self, blocks: np.ndarray, out: Sequence[np.ndarray]) -> ReadStats:
        MPI = self._MPI
        handles: dict = {}

        def handle(f: int):
            if f not in handles:
                try:
                    handles[f] = self._open_self(f)
                except MPI.Exception as exc:
                    raise DecodeError(f"MPI-IO cannot open {self.layout.files[f]}: {exc.Get_error_string()}") \
                        from None
            return handles[f]

        try:
            return self._read(blocks, out, handle)
        finally:
            for fh in handles.values():
                fh.Close()

    def _plan(self, blocks, out, stats: ReadStats) -> list:
        """The call's reads (FilePlans); blocks never written are filled here, ``stats.bytes_read`` set."""
        unwritten, plans = plan_reads(self.layout, blocks, self.policy)
        for i in unwritten.tolist():
            fill_unwritten(self.layout, int(blocks[i]), out[i])
        stats.bytes_read = sum(fp.ranges.nbytes for fp in plans)
        return plans

    def _read(self, blocks: np.ndarray, out: Sequence[np.ndarray], handle=None) -> ReadStats:
        """Collective rounds (a collective reader), or independent reads (on ``handle(file)``: :meth:`read_alone`)."""
        collective = self.collective and handle is None
        stats, futs, err = ReadStats(), [], None
        try:
            if collective:
                try:  # a failure here is held: this rank still takes part in the rounds, with nothing to read
                    mine, err = self._my_rounds(blocks, out, stats)
                except Exception as exc:
                    mine, err = {}, exc
                stats.n_reads, err, _ = self._rounds_of_call(mine, err, futs)
            else:
                stats.n_reads = self._read_independent(blocks, out, self._plan(blocks, out, stats), futs, handle)
        finally:
            wait(futs)  # no worker writes into `out` after we return or raise
        if err is None:
            err = next((f.exception() for f in futs if f.exception() is not None), None)
        if collective:
            self._raise_on_all_ranks(err)
        elif err is not None:
            raise err
        return stats

    def _raise_on_all_ranks(self, err, others: bool = True):
        """Collective: ``err`` raised here, and where another rank failed (``others``) a DecodeError naming it."""
        MPI = self._MPI
        if self.comm.allreduce(0 if err is None else 1, op=MPI.MAX) == 0:
            return
        msgs = self.comm.allgather(None if err is None else f"rank {self.comm.Get_rank()}: {err}")
        if err is not None:
            raise err
        if others:
            raise DecodeError(f"another rank failed in a collective read: {next(m for m in msgs if m)}")

    def _deliver_range(self, buf: np.ndarray, blocks, rel, outs):
        """Copy/decode the blocks of one range from ``buf`` (the range's bytes) into ``outs``."""
        stored = self.layout.block_stored[blocks]
        for k in range(len(blocks)):
            a = int(rel[k])
            deliver(self.layout, int(blocks[k]), buf[a:a + int(stored[k])], outs[k])

    def _range_parts(self, fp, blocks, out):
        """Per range of a FilePlan: ``(start, length, blocks, rel offsets, out arrays)``, and the error
        for the first range that runs past the end of the file (such ranges are left out)."""
        rng = fp.ranges
        size = self._sizes[fp.file]
        parts, err = [], None
        for r, mem in enumerate(fp.members()):
            p = fp.pos[mem]
            start, length, rel = int(rng.starts[r]), int(rng.lengths[r]), rng.offset_in_range[mem]
            if start + length > size:
                err = err or short_read_error(self.layout, blocks[p], start + rel, size)
                continue
            parts.append((start, length, blocks[p], rel, [out[i] for i in p.tolist()]))
        return parts, err

    def _read_independent(self, blocks, out, plans, futs, handle=None) -> int:
        """Each range with ``Read_at`` on ``handle(file)`` (default: the handles opened at construction)."""
        n = 0
        for fp in plans:
            fh = self._fh[fp.file] if handle is None else handle(fp.file)
            parts, err = self._range_parts(fp, blocks, out)
            if err is not None:
                raise err
            for start, length, bl, rel, outs in parts:
                # a lone block stored as its decoded bytes goes straight into the caller's array
                alone = len(bl) == 1 and bool(direct_mask(self.layout, bl)[0])
                buf = outs[0] if alone else aligned.empty(length)  # (on a page: solar.aligned)
                got = self._read_at_full(fh, start, buf, bl, fp.file)
                n += 1
                if got < length:
                    raise short_read_error(self.layout, bl, start + rel, start + got)
                if not alone:
                    futs.append(self._pool.submit(self._deliver_range, buf, bl, rel, outs))
        return n

    def _rounds(self, parts) -> list[list]:
        """Group a file's ranges into reads of at most ``max_call_bytes`` (a bigger range alone)."""
        rounds, cur, size = [], [], 0
        for part in parts:
            if cur and size + part[1] > self.max_call_bytes:
                rounds.append(cur)
                cur, size = [], 0
            cur.append(part)
            size += part[1]
        if cur:
            rounds.append(cur)
        return rounds

    def _my_rounds(self, blocks, out, stats) -> tuple:
        """This rank's part of a collective call: ``({file: rounds}, error or None)`` (unwritten blocks filled)."""
        mine, err = {}, None
        for fp in self._plan(blocks, out, stats):
            parts, e = self._range_parts(fp, blocks, out)
            err = err or e
            mine[fp.file] = self._rounds(parts)
        return mine, err

    @staticmethod
    def _below(parts, size: int) -> int:
        """Bytes of a round's packed buffer (``parts`` in order) that lie below file offset ``size``."""
        pos = 0
        for start, length, *_ in parts:
            if start + length > size:
                return pos + max(0, size - start)
            pos += length
        return pos

    def _rounds_of_call(self, mine: dict, err, futs, reading: int = 1):
        """The collective part of one call: agree on the rounds per file (and, with ``reading`` 0 from a closing
        rank, on whether any rank still reads), read this rank's ``mine`` in them, deliver through ``futs``.
        ``(ranges read, first error, any rank still reading)``; errors are held, never raised between rounds."""
        MPI = self._MPI
        lay = self.layout
        need = np.zeros(len(lay.files) + 1, dtype=np.int32)
        for f, rounds in mine.items():
            need[f] = len(rounds)
        need[-1] = reading
        agreed = np.empty_like(need)
        self._in_call = True
        self.comm.Allreduce(need, agreed, op=MPI.MAX)
        n = 0
        for f in np.flatnonzero(agreed[:-1]).tolist():
            fh, path = self._fh[f], lay.files[f]
            rounds = mine.get(f, [])
            for k in range(int(agreed[f])):
                parts = rounds[k] if k < len(rounds) else []
                total = sum(p[1] for p in parts)
                ftype = None
                try:
                    if total > _INT_MAX:  # a single chunk over 2 GiB: keep the ranks in step, fail after
                        raise DecodeError(f"a range of {total} bytes in {path} is too big for one MPI read")
                    buf = aligned.empty(total)
                    if parts:
                        ftype = MPI.BYTE.Create_hindexed([p[1] for p in parts], [p[0] for p in parts]).Commit()
                except Exception as exc:  # (memory for the round): this rank reads nothing in it, fails after
                    err = err or exc
                    parts, buf, ftype = [], aligned.empty(0), None
                fh.Set_view(0, MPI.BYTE, ftype if ftype is not None else MPI.BYTE)
                st = MPI.Status()
                try:
                    fh.Read_all([buf, MPI.BYTE], st)
                    got = st.Get_count(MPI.BYTE)
                except MPI.Exception:
                    got = 0  # this rank's part failed: retried independently below
                if ftype is not None:
                    ftype.Free()
                size = fh.Get_size()  # on every rank, every round (kept symmetric): the file as it is now
                if not parts:
                    continue
                got = min(got, self._below(parts, size))  # cut short since opened: the rest is retried, fails
                n += len(parts)
                pos = 0
                for start, length, bl, rel, outs in parts:
                    if got < pos + length:  # short: read the rest of this range on our own handle
                        have = max(0, got - pos)
                        try:
                            more = self._read_at_full(self._retry_handle(f), start + have,
                                                      buf[pos + have:pos + length], bl, f)
                        except DecodeError as exc:
                            err = err or exc
                            break
                        except MPI.Exception as exc:  # the retry handle could not be opened
                            err = err or DecodeError(f"MPI-IO cannot open {path} to retry a short read: "
                                                     f"{exc.Get_error_string()}")
                            break
                        if have + more < length:
                            err = err or short_read_error(lay, bl, start + rel, start + have + more)
                            break
                    futs.append(self._pool.submit(self._deliver_range, buf[pos:pos + length], bl, rel, outs))
                    pos += length
        return n, err, bool(agreed[-1])
