"""The rank kernel, run by every policy but the peer ones: assign a step's samples to buffers, then run each
buffer (hits, loads, evictions) under its byte budget.  A buffer is a rank's, one for all ranks (``ideal``),
or a node's (``solar-node``).  The peer policies run :mod:`.peer_engine`; both kernels take the structs of
:mod:`.kernel` and run the same steps: the assignment (:mod:`.routing`), then the buffers (:mod:`.steps`).

Pure: arrays in, arrays out; no I/O, no MPI, no clock.

State kept across epochs (:class:`.kernel.Buffers`, allocated by :class:`solar.scheduler.run.PlanRun`):
a hash table of resident ``(buffer, unit)`` pairs with each entry's eviction priority, one lazy max-heap of
``(priority, unit)`` per buffer (stale entries are skipped when popped), the bytes resident per buffer, and
``owner[unit]``: for the routed policy the buffer that last used the unit (its next use is routed there),
for the others the buffer that last loaded it.

Priorities (the heap pops the largest):
``belady``  next use step (``INF`` = never again) - farthest first;
``lru``     minus the last use step - least recently used first;
``fifo``    minus the load step, not refreshed on hits - oldest load first.
"""
from __future__ import annotations

import numba as nb

from .kernel import INF
from .steps import run_steps


@nb.njit(cache=True, nogil=True)
def run_epoch(job, ep, buf, out):
    """Process the steps ``ep.first_step .. S-1`` of one epoch (:mod:`.kernel`: ``job`` :class:`~.kernel.Job`,
    ``ep`` :class:`~.kernel.Epoch`, ``buf`` :class:`~.kernel.Buffers`, written: ``buf`` and ``out``
    :class:`~.kernel.Out`, statistics rows COUNT, HITS, HIT_BYTES, MISS, MISS_BYTES, STORED).

    Hit and miss counts are in layout blocks (``job.count``).  Steps before ``ep.first_step`` are skipped:
    nothing is assigned, loaded or counted there (``out.buf_of`` of their positions is left unwritten, their
    record rows empty); with fresh state, an epoch that starts there from empty buffers.  Per step: the
    positions get buffers (:func:`.routing.assign_step`), then each buffer in turn counts its hits, evicts
    until its misses fit, loads them, and refreshes the priorities of what it used
    (:func:`.steps.buffer_step`).
    """
    run_steps(False, job, ep, buf, out)


@nb.njit(cache=True, nogil=True)
def next_use(idx, bounds, step0, idx_f, n_future, acc_ptr, P, per_rank, sample_ptr, sample_blocks, last, nu,
             first_step=0, first=None):
    """Fill ``nu`` (int64[A], aligned with ``acc_ptr``) with each access's next use step, for the accesses of
    steps ``first_step .. S-1`` of this epoch (those of earlier steps are left as they are).

    The next use of a block used at step s is the first later step that uses it, in
    this epoch or in the ``n_future`` epochs that follow (``idx_f``: their indices
    concatenated, int64[n_future*T], same batch bounds; epoch j starts at step
    step0 + (j+1)*S), else INF.  ``per_rank``: next use by the same rank under the
    strided split (position p of a batch starting at lo goes to rank (p - lo) % P).
    ``last``: int64[B] scratch, INF on entry and on exit.  ``first`` (int64[B], not with ``per_rank``): set to
    each block's first use from step ``first_step`` on, in this epoch or the ``n_future`` after it (INF: none).
    """
    n_groups = P if per_rank else 1
    stride = P if per_rank else 1
    S = bounds.shape[0] - 1
    T = idx.shape[0]
    for g in range(n_groups):
        for j in range(n_future - 1, -1, -1):
            off = j * T
            for k in range(S - 1, -1, -1):
                for p in range(bounds[k] + g, bounds[k + 1], stride):
                    smp = idx_f[off + p]
                    for a in range(sample_ptr[smp], sample_ptr[smp + 1]):
                        last[sample_blocks[a]] = step0 + (j + 1) * S + k
        for k in range(S - 1, first_step - 1, -1):
            for p in range(bounds[k] + g, bounds[k + 1], stride):
                smp = idx[p]
                base = sample_ptr[smp]
                for a in range(base, sample_ptr[smp + 1]):
                    nu[acc_ptr[p] + a - base] = last[sample_blocks[a]]
            for p in range(bounds[k] + g, bounds[k + 1], stride):
                smp = idx[p]
                for a in range(sample_ptr[smp], sample_ptr[smp + 1]):
                    last[sample_blocks[a]] = step0 + k
        if first is not None and not per_rank:
            first[:] = last
        for j in range(-1, n_future):  # reset what this group touched
            src = idx if j < 0 else idx_f[j * T:(j + 1) * T]
            for k in range(first_step if j < 0 else 0, S):
                for p in range(bounds[k] + g, bounds[k + 1], stride):
                    smp = src[p]
                    for a in range(sample_ptr[smp], sample_ptr[smp + 1]):
                        last[sample_blocks[a]] = INF
