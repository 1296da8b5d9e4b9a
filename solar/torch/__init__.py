"""PyTorch surface of solar; the one package that imports torch at import time (``import solar``
does not; solar's other modules that use torch import it inside functions, bench's baseline aside).

* :class:`SolarDataset` (``dataset``): one rank's planned batches for ``DataLoader``, any ``num_workers``;
* :class:`H5Dataset`, :func:`shard_range` (``h5dataset``): map-style evaluation/inference over a split;
* :class:`DeviceMover`, :func:`to_device` (``device``): batches to the GPU ahead of use;
* :func:`init_distributed` (``distributed``): ``torch.distributed`` from torchrun / SLURM / MPI variables.
"""
from .dataset import SolarDataset, _StepRef  # noqa: F401  (_StepRef: what DataLoader workers send)
from .device import DeviceMover, to_device
from .distributed import init_distributed
from .h5dataset import H5Dataset, shard_range

__all__ = ["SolarDataset", "H5Dataset", "shard_range", "DeviceMover", "to_device", "init_distributed"]
