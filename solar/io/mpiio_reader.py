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
rank (one more small ``Allreduce``), so a failure never leaves ranks waiting.

``collective=False``: one independent ``Read_at`` per coalesced range, no
collective calls per step.

A read that comes back short or fails (``MPI.Exception``) is retried for its
missing bytes with independent ``Read_at`` calls (a collective read's on a
per-rank ``COMM_SELF`` handle, opened on demand, at most :data:`RETRY_HANDLES` kept open,
so the other ranks are not involved), up to
``READ_RETRIES`` times with a short backoff; then the step fails with a
DecodeError naming file, dataset, chunk and byte range.

Reads run in the calling thread (MPI calls); copying and decoding into the
caller's arrays run in ``threads`` worker threads, overlapping the next read.
"""
from __future__ import annotations

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
        check_file_budget(layout, self.name, self._budget(MPI, comm, o["max_open"]))
        # a communicator of our own: the reads' collectives run in the prefetch thread while the training
        # loop may run its own collectives (allreduce of gradients) on ``comm``; on one communicator the two
        # could match each other across ranks (wrong results, or a hang)
        self.comm = (comm if comm is not None else MPI.COMM_SELF).Dup()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="solar-mpiio")
        self._fh = []
        # file index -> COMM_SELF handle for retries (opened on first need)
        self._self_fh = FileCache(self._open_self, lambda fh: fh.Close(), RETRY_HANDLES)
        try:
            for p in layout.files:
                self._fh.append(MPI.File.Open(self.comm, p, MPI.MODE_RDONLY))
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
        """This rank's own handle on file ``f`` (``COMM_SELF``), for independent retries."""
        MPI = self._MPI
        return MPI.File.Open(MPI.COMM_SELF, self.layout.files[f], MPI.MODE_RDONLY)

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
        """Collective over ``comm``: closes every file."""
        if not self._closed:
            self._pool.shutdown(wait=True)
            self._close_files()
            self.comm.Free()
        super().close()

    # ----------------------------------------------------------------- read
    def _read(self, blocks: np.ndarray, out: Sequence[np.ndarray]) -> ReadStats:
        lay = self.layout
        unwritten, plans = plan_reads(lay, blocks, self.policy)
        for i in unwritten.tolist():
            fill_unwritten(lay, int(blocks[i]), out[i])
        stats = ReadStats(bytes_read=sum(fp.ranges.nbytes for fp in plans))
        futs: list = []
        err = None
        try:
            if self.collective:
                stats.n_reads, err = self._read_collective(blocks, out, plans, futs)
            else:
                stats.n_reads = self._read_independent(blocks, out, plans, futs)
        finally:
            wait(futs)  # no worker writes into `out` after we return or raise
        if err is None:
            err = next((f.exception() for f in futs if f.exception() is not None), None)
        if self.collective:
            self._raise_on_all_ranks(err)
        elif err is not None:
            raise err
        return stats

    def _raise_on_all_ranks(self, err):
        MPI = self._MPI
        if self.comm.allreduce(0 if err is None else 1, op=MPI.MAX) == 0:
            return
        msgs = self.comm.allgather(None if err is None else f"rank {self.comm.Get_rank()}: {err}")
        if err is not None:
            raise err
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

    def _read_independent(self, blocks, out, plans, futs) -> int:
        n = 0
        for fp in plans:
            fh = self._fh[fp.file]
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

    def _read_collective(self, blocks, out, plans, futs):
        MPI = self._MPI
        lay = self.layout
        mine, err = {}, None
        for fp in plans:
            parts, e = self._range_parts(fp, blocks, out)
            err = err or e
            mine[fp.file] = self._rounds(parts)
        need = np.zeros(len(lay.files), dtype=np.int32)
        for f, rounds in mine.items():
            need[f] = len(rounds)
        agreed = np.empty_like(need)
        self.comm.Allreduce(need, agreed, op=MPI.MAX)
        n = 0
        for f in np.flatnonzero(agreed).tolist():
            fh, path = self._fh[f], lay.files[f]
            rounds = mine.get(f, [])
            for k in range(int(agreed[f])):
                parts = rounds[k] if k < len(rounds) else []
                total = sum(p[1] for p in parts)
                if total > _INT_MAX:  # a single chunk over 2 GiB: keep the ranks in step, fail after
                    err = err or DecodeError(f"a range of {total} bytes in {path} is too big for one MPI read")
                    parts, total = [], 0
                buf = aligned.empty(total)
                ftype = None
                if parts:
                    ftype = MPI.BYTE.Create_hindexed([p[1] for p in parts], [p[0] for p in parts]).Commit()
                fh.Set_view(0, MPI.BYTE, ftype if ftype is not None else MPI.BYTE)
                st = MPI.Status()
                try:
                    fh.Read_all([buf, MPI.BYTE], st)
                    got = st.Get_count(MPI.BYTE)
                except MPI.Exception:
                    got = 0  # this rank's part failed: retried independently below
                if ftype is not None:
                    ftype.Free()
                if not parts:
                    continue
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
        return n, err
