"""Smooth random fields: sums of a few random Fourier modes, seeded.

A mode is ``a * exp(i(2 pi k.x + phi + w t))`` with integer wave vector ``k``
(|k| <= kmax) and amplitude decaying with |k|, so fields look like smooth
simulation output and compress like it (neither zeros nor white noise).
Products of per-axis exponentials keep it cheap: a 2-D frame is one matrix product.
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np


def _modes(rng: np.random.Generator, ndim: int, n_modes: int, kmax: int):
    k = rng.integers(-kmax, kmax + 1, size=(n_modes, ndim))
    k[np.all(k == 0, axis=1), 0] = 1
    amp = rng.standard_normal(n_modes) / (1.0 + np.linalg.norm(k, axis=1)) ** 1.5
    phase = rng.uniform(0, 2 * np.pi, n_modes)
    omega = rng.uniform(-0.3, 0.3, n_modes)
    return k, amp * np.exp(1j * phase), omega


def smooth_frames(rng: np.random.Generator, shape: Sequence[int], n_frames: int = 0,
                  n_modes: int = 12, kmax: int = 6) -> np.ndarray:
    """float32 field of ``shape`` (1-3 axes), or ``(n_frames, *shape)`` evolving in time."""
    ndim = len(shape)
    k, coef, omega = _modes(rng, ndim, n_modes, kmax)
    axes = [np.exp(2j * np.pi * np.outer(k[:, a], np.arange(n) / n)) for a, n in enumerate(shape)]  # each (M, n)
    t = np.arange(max(n_frames, 1))
    c = coef[None, :] * np.exp(1j * np.outer(t, omega))  # (T, M)
    if ndim == 1:
        out = c @ axes[0]  # (T, X)
    elif ndim == 2:
        # (T, X, M) @ (M, Y) as einsum's own loop: matmul of the transposed complex view was a slow loop, and
        # through BLAS its threads cost more than this small product on a busy machine (the same bytes either way)
        out = np.einsum("txm,my->txy", np.transpose(c[:, :, None] * axes[0][None], (0, 2, 1)), axes[1])
    else:
        out = np.einsum("tm,mx,my,mz->txyz", c, axes[0], axes[1], axes[2], optimize=True)
    out = out.real.astype(np.float32)  # (T, *shape)
    return out if n_frames else out[0]


@functools.lru_cache(maxsize=8)
def _optics(shape, fresnel: float):
    """The Gaussian probe and the Fresnel transfer function of a ``shape`` frame (the same for every sample)."""
    ny, nx = shape
    y, x = np.meshgrid(np.arange(ny) - ny / 2, np.arange(nx) - nx / 2, indexing="ij")
    probe = np.exp(-(x ** 2 + y ** 2) / (2 * (0.35 * max(nx, ny)) ** 2))
    ky, kx = np.meshgrid(np.fft.fftfreq(ny) * ny, np.fft.fftfreq(nx) * nx, indexing="ij")
    h = np.exp(-1j * np.pi * fresnel * (kx ** 2 + ky ** 2))
    probe.setflags(write=False)
    h.setflags(write=False)
    return probe, h


def diffraction(amplitude: np.ndarray, phase: np.ndarray, fresnel: float = 2.0e-3) -> np.ndarray:
    """Diffraction amplitude of a 2-D object ``A exp(i phi)`` lit by a Gaussian probe, normalised to max 1.

    Propagated a short (Fresnel) distance: transfer function ``exp(-i pi fresnel (kx^2+ky^2))`` with
    integer frequencies k.  Unlike the far field |FFT(obj)| of a periodic object (the same for every
    shift of it and for its conjugate twin, so amplitude and phase cannot be learned back from it),
    this pattern keeps them recoverable pixel by pixel, as a surrogate model needs.
    """
    probe, h = _optics(amplitude.shape, fresnel)
    obj = probe * amplitude.astype(np.complex64) * np.exp(1j * phase.astype(np.complex64))
    field = np.abs(np.fft.ifft2(np.fft.fft2(obj) * h))
    return (field / max(float(field.max()), 1e-12)).astype(np.float32)
