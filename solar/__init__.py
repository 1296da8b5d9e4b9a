"""solar: HDF5 data loading for distributed PyTorch training, planned offline (SOLAR-style).

Data flows one way: layout (``solar.layout``) -> planner (``solar.scheduler``) ->
schedule file -> buffer (``solar.buffer``) <- readers (``solar.io``) -> torch.
"""
__version__ = "0.1.0"

from .errors import DecodeError, LayoutError, SolarError, SpecError, WriteError  # noqa: E402
from .layout import Layout, LayoutSpec, build_layout, load_layout  # noqa: E402
from .schedule import Schedule, ScheduleError, plan  # noqa: E402

__all__ = ["__version__", "SolarError", "SpecError", "LayoutError", "DecodeError", "WriteError", "Layout", "LayoutSpec",
           "build_layout", "load_layout", "Schedule", "ScheduleError", "plan", "SolarLoader", "SolarDataset",
           "H5Dataset"]

_LAZY = {"SolarLoader": "solar.loader", "SolarDataset": "solar.torch",  # imported on first use (numba, torch)
         "H5Dataset": "solar.torch"}


def __getattr__(name: str):
    """``solar.SolarLoader`` / ``solar.SolarDataset`` / ``solar.H5Dataset``, imported when first used."""
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'solar' has no attribute {name!r}")
