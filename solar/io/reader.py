"""The block-reader interface the buffer manager consumes, and the registry of backends.

A reader fills caller-owned byte arrays with decoded blocks::

    with get_reader("pread", layout, threads=4) as r:
        outs = [np.empty(layout.block_nbytes[b], np.uint8) for b in blocks]
        stats = r.read_blocks(blocks, outs)

``outs[i]`` then holds block ``blocks[i]`` decoded, in its full block shape
(``layout.block_shapes[d]``, C order), byte-identical to
:func:`solar.io.raw.decode_block` inside the dataset extent, so
``assemble_sample(layout, s, lambda b: outs_of[b].view(dtype).reshape(shape))``
gives h5py's sample.  Never-written chunks read as the fill value.

Backends (see :data:`READERS`): ``pread`` (threads + ``os.preadv``), ``mpiio``
(MPI-IO, collective or independent), ``h5py`` and ``h5py-mpio`` (HDF5 decodes;
for filters solar cannot decode itself).
"""
from __future__ import annotations

import abc
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..errors import SpecError
from .fdcache import open_file_budget
from .fstype import parallel_fs_name


@dataclass
class ReadStats:
    """What one or more ``read_blocks`` calls cost.

    ``n_reads``: contiguous byte ranges read from storage (one ``preadv`` or
    ``Read_at`` each; a collective read through a file view counts its pieces;
    the h5py readers count one per written block);
    ``bytes_read``: storage bytes read, coalescing gaps included;
    ``blocks``: blocks delivered; ``seconds``: wall time inside ``read_blocks``.
    """

    n_reads: int = 0
    bytes_read: int = 0
    blocks: int = 0
    seconds: float = 0.0

    def __iadd__(self, other: ReadStats):
        self.n_reads += other.n_reads
        self.bytes_read += other.bytes_read
        self.blocks += other.blocks
        self.seconds += other.seconds
        return self

    def merge(self, other: ReadStats) -> ReadStats:
        """A new ReadStats with both summed."""
        out = ReadStats(self.n_reads, self.bytes_read, self.blocks, self.seconds)
        out += other
        return out

    __add__ = merge


class BlockReader(abc.ABC):
    """Reads blocks of a :class:`~solar.layout.Layout` into caller-owned uint8 arrays.

    Capabilities (class attributes; ``collective`` may be overridden per instance):

    * ``threaded``: reads/decodes in its own thread pool, outside HDF5's lock;
    * ``collective``: every rank of ``comm`` must call :meth:`read_blocks` the
      same number of times in the same order (one call per step), even with
      zero blocks;
    * ``needs_raw``: every dataset must be raw-readable (``DatasetInfo.raw``).

    Subclasses list their options with defaults in ``OPTIONS`` and implement
    :meth:`_read` (distinct, validated blocks).
    """

    name: ClassVar[str]
    threaded: ClassVar[bool] = False
    collective: ClassVar[bool] = False
    needs_raw: ClassVar[bool] = True
    OPTIONS: ClassVar[dict[str, Any]] = {}

    @classmethod
    def available(cls) -> tuple[bool, str]:
        """``(usable here?, reason if not)``."""
        return True, ""

    def __init__(self, layout, *, comm=None, threads: int = 4, **options):
        ok, why = self.available()
        if not ok:
            raise SpecError(f"reader {self.name!r} is not available here: {why}")
        if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
            raise SpecError(f"threads must be an integer >= 1, got {threads!r}")
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            valid = ", ".join(["threads", *self.OPTIONS]) if self.OPTIONS else "threads"
            raise SpecError(f"reader {self.name!r} has no option {', '.join(map(repr, unknown))}; valid: {valid}")
        if self.needs_raw:
            check_raw(layout, self.name)
        self.layout = layout
        self.comm = comm
        self.threads = int(threads)
        self.options = {**self.OPTIONS, **options}
        self._closed = False

    # ------------------------------------------------------------------ API
    def read_blocks(self, blocks, out: Sequence[np.ndarray]) -> ReadStats:
        """Fill ``out[i]`` (writable uint8[block_nbytes[blocks[i]]]) with block ``blocks[i]`` decoded.

        ``blocks``: int64[k], any order; a repeated id is read once and copied.
        Raises :class:`~solar.errors.DecodeError` naming the file, dataset and
        chunk for corrupt or missing bytes.
        """
        return self._request(blocks, out, self._read)

    def read_alone(self, blocks, out: Sequence[np.ndarray]) -> ReadStats:
        """:meth:`read_blocks` on this rank alone, from any thread: for a collective reader outside the sequence
        of calls every rank makes (blocks the plan wrongly called resident, read on the spot by one rank); for
        the others the same as :meth:`read_blocks`."""
        return self.read_blocks(blocks, out)

    def _request(self, blocks, out: Sequence[np.ndarray], read) -> ReadStats:
        """A validated request served by ``read`` (distinct blocks, as :meth:`_read`), repeated ids copied."""
        if self._closed:
            raise ValueError(f"reader {self.name!r} is closed")
        blocks = check_request(self.layout, blocks, out)
        t0 = time.perf_counter()
        _, first, inverse = np.unique(blocks, return_index=True, return_inverse=True)
        if first.shape[0] == blocks.shape[0]:
            stats = read(blocks, out)
        else:
            stats = read(blocks[first], [out[i] for i in first.tolist()])
            src = first[inverse.reshape(-1)]
            for i in np.flatnonzero(src != np.arange(blocks.shape[0])).tolist():
                out[i][:] = out[int(src[i])]
        stats.blocks = int(blocks.shape[0])
        stats.seconds = time.perf_counter() - t0
        return stats

    @abc.abstractmethod
    def _read(self, blocks: np.ndarray, out: Sequence[np.ndarray]) -> ReadStats:
        """Read distinct, validated ``blocks`` (int64[k]) into ``out``; return n_reads and bytes_read."""

    def open_stats(self) -> dict:
        """``{"opens", "evictions", "max_open"}``: files opened so far (reopens included), files closed
        to stay within ``max_open``, and that bound (see :mod:`solar.io.fdcache`)."""
        return {"opens": 0, "evictions": 0, "max_open": 0}

    def start(self) -> None:
        """Start the reader's threads now (a buffer calls it before its first step; otherwise the first read
        starts them, one at a time, in the middle of that step: :mod:`solar.threads`).  Nothing to do for a
        reader without threads; may be called again."""

    def close(self) -> None:
        """Release files and threads (collective for readers that opened files collectively)."""
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, threads={self.threads}, options={self.options})"


# ---------------------------------------------------------------- checks
def mpi4py_missing() -> str:
    """Why mpi4py cannot be used here ('' when it can)."""
    try:
        from mpi4py import MPI  # noqa: F401
    except ImportError as exc:
        return f"mpi4py cannot be imported ({exc})"
    return ""


def check_raw(layout, reader_name: str) -> None:
    """SpecError naming the first dataset that a raw reader cannot serve, and why."""
    for info in layout.datasets:
        if not info.raw:
            raise SpecError(
                f"reader {reader_name!r} reads raw bytes, but {layout.files[info.file]}:/{info.name.lstrip('/')} "
                f"cannot be read raw ({info.fallback}); use the 'h5py' reader")


def check_file_budget(layout, reader_name: str, max_open=None) -> None:
    """SpecError when a reader that opens every file collectively at construction would hold more
    files than ``max_open`` (default :func:`~solar.io.fdcache.open_file_budget`, from ``ulimit -n``)."""
    budget = open_file_budget() if max_open is None else max_open
    if isinstance(budget, int) and len(layout.files) > budget:
        raise SpecError(f"reader {reader_name!r} opens all {len(layout.files)} files of the layout at once, more "
                        f"than the {budget} this process may hold open (ulimit -n); use --reader pread "
                        f"(reader='pread'), which keeps at most {budget} open")


def check_request(layout, blocks, out) -> np.ndarray:
    """Validate a ``read_blocks`` request; returns ``blocks`` as int64[k]."""
    arr = np.asarray(blocks)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"blocks must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if len(out) != arr.shape[0]:
        raise ValueError(f"{arr.shape[0]} blocks but {len(out)} output arrays")
    if arr.size and (arr.min() < 0 or arr.max() >= layout.n_blocks):
        bad = int(arr[(arr < 0) | (arr >= layout.n_blocks)][0])
        raise ValueError(f"block id {bad} out of range [0, {layout.n_blocks})")
    need = layout.block_nbytes[arr]
    for i, o in enumerate(out):
        if not (isinstance(o, np.ndarray) and o.dtype == np.uint8 and o.ndim == 1 and o.flags.c_contiguous
                and o.flags.writeable and o.shape[0] == need[i]):
            got = (f"{type(o).__name__} dtype={getattr(o, 'dtype', None)} shape={getattr(o, 'shape', None)}"
                   f"{'' if getattr(getattr(o, 'flags', None), 'writeable', True) else ' read-only'}")
            raise ValueError(f"out[{i}] must be a writable contiguous uint8 array of {int(need[i])} bytes "
                             f"(block {int(arr[i])}), got {got}")
    return arr


# ---------------------------------------------------------------- registry
READERS: dict[str, type[BlockReader]] = {}


def register(cls: type[BlockReader]) -> type[BlockReader]:
    """Class decorator adding a backend to :data:`READERS` under ``cls.name``."""
    READERS[cls.name] = cls
    return cls


def get_reader(name: str, layout, comm=None, **opts) -> BlockReader:
    """Construct the reader ``name`` (collective for MPI readers: call on every rank of ``comm``); for a
    layout of parts (:mod:`solar.layout.parts`), that reader of its chunks inside a
    :class:`~solar.io.parts.PartReader`."""
    try:
        cls = READERS[name]
    except KeyError:
        raise SpecError(f"unknown reader {name!r}; valid readers: {', '.join(sorted(READERS))}") from None
    from ..layout.parts import chunks_of, is_parts
    if is_parts(layout):  # a layout of parts: the backend reads their chunks
        from .parts import PartReader
        return PartReader(layout, cls(chunks_of(layout), comm=comm, **opts))
    return cls(layout, comm=comm, **opts)


def default_reader_name(layout, comm=None) -> str:
    """The reader to use when none is named.

    ``"h5py"`` if some dataset has a filter only HDF5 decodes; ``"mpiio"`` when
    ``comm`` has more than one rank and every file's folder is on a parallel
    file system (Lustre, GPFS, BeeGFS, OrangeFS, PanFS: ``statfs`` magic, see
    :mod:`solar.io.fstype`) and mpi4py is present and the files are no more than
    the open-file budget (``mpiio`` opens them all at once); ``"pread"`` otherwise.
    """
    if any(not info.raw for info in layout.datasets):
        return "h5py"
    size = comm.Get_size() if comm is not None else 1
    if size > 1 and layout.files and len(layout.files) <= open_file_budget():
        folders = {os.path.dirname(os.path.abspath(p)) for p in layout.files}
        if all(parallel_fs_name(f) for f in folders) and READERS["mpiio"].available()[0]:
            return "mpiio"
    return "pread"
