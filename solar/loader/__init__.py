"""PyTorch side: :class:`SolarLoader` yields each rank's planned local batches."""
from .assemble import BatchAssembler
from .loader import SolarLoader

__all__ = ["SolarLoader", "BatchAssembler"]
