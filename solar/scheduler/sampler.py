"""The global index: exactly what ``torch.utils.data.DistributedSampler`` trains on.

For source epoch ``t``, ``indices = randperm(N, generator seeded seed + t)``, padded
by repeating its head to a multiple of P (or truncated with ``drop_last``); rank r
takes ``indices[r::P]``, so with local batch b the global batch k is exactly
``indices[k*P*b:(k+1)*P*b]``.  torch is used only for ``randperm``, to match its
generator bit for bit.
"""
from __future__ import annotations

import math

import numpy as np


def sampler_sizes(n: int, world_size: int, drop_last: bool):
    """``(num_samples per rank, total_size)`` as DistributedSampler computes them."""
    if drop_last and n % world_size != 0:
        num = math.ceil((n - world_size) / world_size)
    else:
        num = math.ceil(n / world_size)
    return num, num * world_size


def epoch_indices(n: int, world_size: int, seed: int, epoch: int, drop_last: bool = False) -> np.ndarray:
    """int64[total_size]: the padded/truncated shuffled index of one source epoch."""
    import torch
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    idx = torch.randperm(n, generator=g).numpy().astype(np.int64)
    num, total = sampler_sizes(n, world_size, drop_last)
    if total <= n:
        return idx[:total]
    pad = total - n
    reps = math.ceil(pad / n)
    return np.concatenate([idx, np.tile(idx, reps)[:pad]])


def steps_per_epoch(n: int, world_size: int, local_batch: int, drop_last: bool = False) -> int:
    """Steps of one epoch (the DataLoader keeps a last partial batch)."""
    num, _ = sampler_sizes(n, world_size, drop_last)
    return math.ceil(num / local_batch)


def batch_bounds(total: int, world_size: int, local_batch: int) -> np.ndarray:
    """int64[steps+1]: global batch k is ``indices[bounds[k]:bounds[k+1]]``."""
    gb = world_size * local_batch
    return np.minimum(np.arange(0, total + gb, gb, dtype=np.int64), total)[: -(-total // gb) + 1]
