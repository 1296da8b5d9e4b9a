"""The global index: exactly what ``torch.utils.data.DistributedSampler`` trains on.

For source epoch ``t``, ``indices = randperm(N, generator seeded seed + t)``, padded
by repeating its head to a multiple of P (or truncated with ``drop_last``); rank r
takes ``indices[r::P]``, so with local batch b the global batch k is exactly
``indices[k*P*b:(k+1)*P*b]``.

``randperm`` is torch's CPU ``torch.randperm(n, generator=g)`` bit for bit without importing torch
(3 s of a planner's start-up): for ``n`` below ``2**32 / 20`` torch fills ``0..n-1`` and swaps
position ``i`` with ``i + u_i % (n - i)``, ``u_i`` the 32-bit outputs of an MT19937 seeded with the
low 32 bits of the seed (the reference MT19937 initialisation, which ``numpy.random.RandomState``
also uses for a 32-bit seed).  Larger ``n`` (another algorithm in torch) still calls torch.
``tests/test_planner.py`` checks it against torch on many sizes and seeds.
"""
from __future__ import annotations

import math

import numba as nb
import numpy as np

#: torch.randperm's CPU path shuffles as below for n < uint32 max / 20 (aten randperm_cpu)
RANDPERM_SIMPLE_MAX = (2**32 - 1) // 20
_CHUNK = 1 << 20  # 32-bit draws generated at a time (memory stays flat for large n)


@nb.njit(cache=True, nogil=True)
def _swap_run(r, draws, start, n):
    """Fisher-Yates steps ``start .. start + len(draws) - 1`` of torch's randperm on ``r`` (int64[n])."""
    for j in range(draws.shape[0]):
        i = start + j
        z = i + np.int64(np.uint64(draws[j]) % np.uint64(n - i))
        t = r[i]
        r[i] = r[z]
        r[z] = t


def randperm(n: int, seed: int) -> np.ndarray:
    """int64[n]: ``torch.randperm(n, generator=torch.Generator().manual_seed(seed))`` on the CPU."""
    if n >= RANDPERM_SIMPLE_MAX:
        import torch
        g = torch.Generator()
        g.manual_seed(seed)
        return torch.randperm(n, generator=g).numpy().astype(np.int64)
    r = np.arange(n, dtype=np.int64)
    rs = np.random.RandomState(int(seed) & 0xFFFFFFFF)
    for start in range(0, max(n - 1, 0), _CHUNK):
        draws = rs.randint(0, 2**32, size=min(_CHUNK, n - 1 - start), dtype=np.uint32)  # raw 32-bit outputs
        _swap_run(r, draws, start, n)
    return r


def sampler_sizes(n: int, world_size: int, drop_last: bool):
    """``(num_samples per rank, total_size)`` as DistributedSampler computes them."""
    if drop_last and n % world_size != 0:
        num = math.ceil((n - world_size) / world_size)
    else:
        num = math.ceil(n / world_size)
    return num, num * world_size


def epoch_indices(n: int, world_size: int, seed: int, epoch: int, drop_last: bool = False) -> np.ndarray:
    """int64[total_size]: the padded/truncated shuffled index of one source epoch."""
    idx = randperm(n, seed + epoch)
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
