"""solar: HDF5 data loading for distributed PyTorch training, planned offline (SOLAR-style).

The shuffled order of every epoch is known before training starts (DistributedSampler's, same seed), so
solar plans offline which rank reads which sample and which blocks each rank keeps in memory, and the
loader executes that plan: most storage reads of a data-parallel job become buffer hits, and every rank
trains on exactly the global batches DistributedSampler would give it.

Data flows one way: layout (``solar.layout``) -> planner (``solar.scheduler``) ->
schedule file -> buffer (``solar.buffer``) <- readers (``solar.io``) -> torch.  The memory model planner
and buffer share (``solar.memory``: pure, arrays in, numbers out) sits below both.

Command line (``solar COMMAND --help``)
    solar gen PRESET OUTDIR       synthetic datasets with real projects' layouts
    solar inspect PATH            any HDF5 file, a layout spec or folder, or a schedule file
    solar simulate SPEC ...       compare loading policies (hit rate, storage bytes)
    solar plan SPEC -P N -b B ... plan a job: write its schedule file
    mpiexec -n N solar bench SPEC solar's loader against the strongest baselines, cold page cache

Main entry points
    solar.plan(data, *, world_size, local_batch, epochs, buffer_fraction=... | buffer_per_rank=...,
               out="plan.h5") -> Schedule
        Plan a job and write its schedule; ``epochs`` is a number or ``"auto"`` (open-ended training,
        what ``solar plan`` defaults to).  ``data``: a layout spec file, the folder holding
        ``solar-layout.json``, an HDF5 file or a :class:`Layout`.
    solar.SolarDataset(schedule, data=None, **loader_kwargs)        (needs torch)
        One rank's planned batches as a torch ``IterableDataset``: ``DataLoader(ds, batch_size=None,
        num_workers=k)`` for any k; ``ds.epoch_range()``, ``ds.set_epoch(e)``, ``ds.state_dict()`` /
        ``load_state_dict()`` to checkpoint and resume.  Also ``solar.torch.init_distributed()``.
    solar.SolarLoader(schedule, data=None, *, comm=None, rank=None, ...)
        The same without torch's DataLoader: iterate one epoch's batches, ``{field: tensor (n, ...),
        "index": sample ids, "weight": loss scale, "step"}``; with an mpi4py ``comm`` an error on one rank
        ends every rank (MPI_Abort).
    solar.H5Dataset(data, split=None, fields=None, transform=None)  (needs torch)
        A map-style dataset (``ds[i]`` is sample i) over the same layout, for evaluation.
    solar.load_layout(path) -> Layout, solar.build_layout(spec) -> Layout
        The block map of a dataset: every sample's HDF5 chunks or byte ranges, fingerprinted.
    solar.Schedule.load(path) -> Schedule
        Open a schedule file (each rank reads only its slice).

``SolarLoader``, ``SolarDataset`` and ``H5Dataset`` are imported on first use (numba, torch): see
``help(solar.SolarLoader)``, ``help(solar.SolarDataset)``, ``help(solar.H5Dataset)``.

Errors (``solar.errors``; every error a user can cause is one of these, with a one-line message naming the
bad file, dataset, value or option; the CLI prints ``solar <command>: error: <message>`` and exits 2)
    SolarError      the base class
    SpecError       an invalid layout spec, argument or option (also a ValueError)
    LayoutError     the HDF5 files do not match what the spec describes
    DecodeError     stored bytes of a block could not be decoded
    WriteError      an output file or folder could not be written
    ScheduleError   a schedule file that cannot be used: damaged, truncated, or made for another job

Documentation: README.md and docs/ of the source tree (layouts, planner, schedule, runtime, torch, gpu,
reliability).
"""
__version__ = "0.1.0"

from .errors import DecodeError, LayoutError, SolarError, SpecError, WriteError  # noqa: E402
from .layout import Layout, LayoutSpec, build_layout, load_layout  # noqa: E402
from .schedule import Schedule, ScheduleError, plan  # noqa: E402

# what help(solar) documents in full: the entry points (the exceptions, all alike, are in the docstring above;
# they stay importable as solar.SolarError etc.)
__all__ = ["__version__", "Layout", "LayoutSpec", "build_layout", "load_layout", "Schedule", "plan", "SolarLoader",
           "SolarDataset", "H5Dataset"]

_LAZY = {"SolarLoader": "solar.loader", "SolarDataset": "solar.torch",  # imported on first use (numba, torch)
         "H5Dataset": "solar.torch"}


def __getattr__(name: str):
    """``solar.SolarLoader`` / ``solar.SolarDataset`` / ``solar.H5Dataset``, imported when first used."""
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'solar' has no attribute {name!r}")
