"""Deterministic generator of realistic scientific HDF5 datasets (``solar gen``)."""
from .fields import diffraction, smooth_frames
from .presets import PRESETS, GenConfig, generate
from .storage import STORAGE_PRESETS, Storage

__all__ = ["PRESETS", "GenConfig", "generate", "Storage", "STORAGE_PRESETS", "smooth_frames", "diffraction"]
