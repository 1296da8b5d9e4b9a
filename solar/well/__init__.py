"""The Well as its users load it: :class:`WellTransform` turns a solar batch of a ``windows``
layout into the dict a The Well model takes (``input_fields``, ``output_fields``, constant
scalars, boundary conditions, grids), z-score or RMS normalised from ``stats.yaml``."""
from .stats import find_stats, parse_stats, read_stats
from .transform import WellTransform

__all__ = ["WellTransform", "find_stats", "parse_stats", "read_stats"]
