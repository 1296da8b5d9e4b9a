"""The ``mpiio`` reader's collective calls under MPI (run serially and under ``mpiexec -n 2``): a file cut short
after the reader opened it fails on every rank (ROMIO's ``Read_all`` counts the bytes past the end as read: the
block's tail was the buffer's old memory, delivered with no error); ranks that close after different numbers
of reads (prefetch threads read ahead by different amounts) all close (one rank waited in ``File.Close``, the
other in a read's ``Allreduce``: a hang); a request one rank refuses ends the call on every rank (the others
waited in the ``Allreduce``); the reader needs MPI_THREAD_MULTIPLE; a retry handle, opened by path, is never
another file than the one opened.  A hang here is ended by faulthandler (the job exits, naming where)."""
import faulthandler
import os

import h5py
import numpy as np
import pytest

import solar
from solar.io import get_reader
from solar.layout import LayoutSpec, build_layout

ROWS, WIDTH = 64, 1024  # float32 rows of 4 KiB, one block each (contiguous)


def _expected(b: int) -> np.ndarray:
    return (np.arange(b * WIDTH, (b + 1) * WIDTH, dtype="<f4") + 1).view(np.uint8)


def _layout(comm, root):
    if comm.rank == 0:
        with h5py.File(os.path.join(root, "t.h5"), "w") as f:
            f.create_dataset("X", data=np.arange(ROWS * WIDTH, dtype="<f4").reshape(ROWS, WIDTH) + 1)
    comm.Barrier()
    return build_layout(LayoutSpec("rows", ("t.h5",), ("X",), root=root), workers=1)


def _read(reader, layout, blocks):
    blocks = np.asarray(blocks, np.int64)
    outs = [np.full(int(layout.block_nbytes[b]), 0xAB, np.uint8) for b in blocks.tolist()]
    reader.read_blocks(blocks, outs)
    return outs


@pytest.fixture
def no_hang():
    faulthandler.dump_traceback_later(120, exit=True)  # a rank still waiting after 2 minutes is hung
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.mark.mpi
def test_a_file_cut_short_after_the_reader_opened_it_fails_on_every_rank(comm, shared_tmp, no_hang):
    layout = _layout(comm, shared_tmp)
    last = layout.n_blocks - 1
    cut = int(layout.block_offset[last] + layout.block_stored[last] // 2)
    with get_reader("mpiio", layout, comm=comm, threads=1) as reader:
        comm.Barrier()
        if comm.rank == 0:
            os.truncate(layout.files[0], cut)
        comm.Barrier()
        mine = [last - 1, last] if comm.rank == 0 else [comm.rank]  # rank 0 alone in the round with the cut block
        with pytest.raises(solar.DecodeError, match=r"truncated\?|another rank failed"):
            _read(reader, layout, mine)
        ok = _read(reader, layout, [1, 2])  # blocks the cut left whole are still read right
        assert all(np.array_equal(o, _expected(b)) for o, b in zip(ok, (1, 2)))


@pytest.mark.mpi
def test_ranks_closing_after_different_numbers_of_reads_all_close(comm, shared_tmp, no_hang):
    layout = _layout(comm, shared_tmp)
    reader = get_reader("mpiio", layout, comm=comm, threads=1, max_call_bytes=8192)
    calls = 1 + 2 * comm.rank  # rank 0 closes after one read, the others read on (3, 5, ... calls)
    for k in range(calls):
        mine = [(comm.rank * 7 + 3 * k + j) % layout.n_blocks for j in range(4)]
        got = _read(reader, layout, mine)
        assert all(np.array_equal(o, _expected(b)) for o, b in zip(got, mine)), f"call {k}"
    reader.close()  # the first to close takes part in the others' reads (nothing to read) until they close
    comm.Barrier()


def _chunked(comm, root, parts):
    """A file of 4 rows a chunk: blocks are chunks, or with ``parts`` rows of chunks (the parts reader)."""
    from solar.layout.parts import split_chunks
    if comm.rank == 0:
        with h5py.File(os.path.join(root, "c.h5"), "w") as f:
            f.create_dataset("X", data=np.arange(ROWS * WIDTH, dtype="<f4").reshape(ROWS, WIDTH) + 1,
                             chunks=(4, WIDTH))
    comm.Barrier()
    layout = build_layout(LayoutSpec("rows", ("c.h5",), ("X",), root=root), workers=1)
    return split_chunks(layout) if parts else layout


@pytest.mark.mpi
@pytest.mark.parametrize("parts", [False, True], ids=["blocks", "parts"])
def test_a_request_one_rank_refuses_ends_the_call_on_every_rank(comm, shared_tmp, no_hang, parts):
    """Also through the parts reader, which refused the request before its inner (collective) call: the other
    ranks got no error and the ranks stayed a call apart (a hang at the next collective of another kind)."""
    layout = _chunked(comm, shared_tmp, True) if parts else _layout(comm, shared_tmp)
    bad = comm.size - 1
    with get_reader("mpiio", layout, comm=comm, threads=1) as reader:
        blocks = np.array([comm.rank, comm.rank + 2], np.int64)
        outs = [np.empty(int(layout.block_nbytes[b]), np.uint8) for b in blocks.tolist()]
        if comm.rank == bad:
            outs[0] = np.empty(10, np.uint8)  # a caller's mistake on this rank only
            with pytest.raises(ValueError, match="uint8 array of 4096 bytes"):
                reader.read_blocks(blocks, outs)
        else:
            with pytest.raises(solar.DecodeError, match=f"another rank failed in a collective read: rank {bad}: "):
                reader.read_blocks(blocks, outs)
        got = _read(reader, layout, [comm.rank])  # the ranks are still in step
        assert np.array_equal(got[0], _expected(comm.rank))


def test_the_reader_needs_mpi_thread_multiple(tmp_path, monkeypatch):
    from mpi4py import MPI
    layout = _layout(MPI.COMM_SELF, str(tmp_path))
    monkeypatch.setattr(MPI, "Query_thread", lambda: MPI.THREAD_FUNNELED)
    with pytest.raises(solar.SpecError, match="needs MPI_THREAD_MULTIPLE.*'pread' reader"):
        get_reader("mpiio", layout)


def test_a_retry_handle_is_never_a_file_that_replaced_the_one_opened(tmp_path):
    """Short reads are retried on a handle opened by path: a file put in its place since is refused."""
    from mpi4py import MPI
    layout = _layout(MPI.COMM_SELF, str(tmp_path))
    with get_reader("mpiio", layout) as reader:
        path = layout.files[0]
        new = str(tmp_path / "new.h5")
        with open(path, "rb") as src, open(new, "wb") as dst:
            dst.write(src.read())
        os.replace(new, path)
        with pytest.raises(solar.DecodeError, match="was replaced while the job read it"):
            reader._retry_handle(0)
        got = _read(reader, layout, [3])  # the handle opened reads the file it opened
        assert np.array_equal(got[0], _expected(3))


class _NoCollectives:
    """Stands in for the reader's communicator: any use fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"a read alone used the communicator ({name})")


@pytest.mark.mpi
@pytest.mark.parametrize("parts", [False, True], ids=["blocks", "parts"])
def test_a_read_alone_makes_no_collective_call(comm, shared_tmp, no_hang, parts):
    """Blocks the plan wrongly called resident are read on the spot by one rank (``read_outside``, from the booking
    thread while the I/O thread may be in a collective read): ``read_alone`` reads them on handles of its own, no
    collective call, the bytes h5py's; the collective reads go on in step after it."""
    from solar.buffer.steps import StepStats, read_outside
    layout = _chunked(comm, shared_tmp, parts)
    with get_reader("mpiio", layout, comm=comm, threads=1) as reader:
        inner = getattr(reader, "inner", reader)
        real, inner.comm = inner.comm, _NoCollectives()
        try:
            mine = np.array([5 + comm.rank, 9], np.int64)
            got = read_outside(reader, mine, layout.block_nbytes, StepStats(0))
        finally:
            inner.comm = real
        def want(b):  # a part is one row; a block of the whole layout is a chunk of 4 rows
            return _expected(b) if parts else np.concatenate([_expected(4 * b + j) for j in range(4)])

        assert sorted(got) == sorted(mine.tolist())
        assert all(np.array_equal(got[b], want(b)) for b in mine.tolist())
        again = _read(reader, layout, [comm.rank])
        assert np.array_equal(again[0], want(comm.rank))


@pytest.mark.mpi
def test_a_resumed_device_buffer_s_warm_up_in_parts_makes_no_collective_call(comm, shared_tmp, no_hang, monkeypatch):
    """A resumed device buffer warms up in parts of bounded host staging, as many as the rank's resident bytes
    take: with the collective reader, ranks made different numbers of collective calls before their first step,
    and under a per-step allreduce (DDP) one waited for a call the other could not make (a hang).  The warm-up
    parts are read alone; here rank 0 stages in small parts (standing in for a rank holding more)."""
    import solar.buffer.rank_place as rank_place
    from helpers import make_dataset
    from solar.loader import SolarLoader
    if comm.rank == 0:
        data = make_dataset(shared_tmp, "ptychonn", "contiguous", samples=96)
        plan = os.path.join(shared_tmp, "plan.h5")
        solar.plan(data, world_size=comm.size, local_batch=2, epochs=2, buffer_fraction=0.5, out=plan).close()
    else:
        data = plan = None
    data, plan = comm.bcast((data, plan), root=0)
    if comm.rank == 0:
        monkeypatch.setattr(rank_place, "WARMUP_STAGING", 20000)
    with SolarLoader(plan, data, comm=comm, reader="mpiio", buffer_device="cpu", cpus=1) as loader:
        inner = getattr(loader.reader, "inner", loader.reader)
        alone, real = [], inner.read_alone
        monkeypatch.setattr(inner, "read_alone", lambda b, o: alone.append(len(b)) or real(b, o))
        state = loader.state_dict()
        state["step"] = 30
        loader.load_state_dict(state)
        steps = 0
        for batch in loader:
            comm.allreduce(1)  # the training's gradient allreduce
            steps += 1
    assert steps == (30 // loader.S + 1) * loader.S - 30  # the rest of the epoch of step 30
    if comm.rank == 0:
        assert len(alone) >= 2, alone  # its warm-up parts, read alone
