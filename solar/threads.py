"""Thread pools started before they are needed.

A :class:`~concurrent.futures.ThreadPoolExecutor` starts its threads one at a time, as tasks are submitted.
Each start waits until the new thread runs, and its stack is a new mapping, which waits for the process's
memory map (held, for instance, while a buffer's pages are faulted in beside the reads).  The first step of a
loader submits to three such pools at once (the I/O pool, the reader's workers, the assembly workers), so
their threads were started in the middle of the first read, one after the other: on the 2-core development VM
the first batch of an epoch came 150-190 ms after it was asked for, where its reads take about 10 ms.
:func:`start_threads` starts them beforehand (docs/runtime.md, "Threads started before the first step").
"""
from __future__ import annotations

import threading
from typing import Callable, Optional


def start_threads(executor, n: int, each: Optional[Callable[[], None]] = None) -> None:
    """Start ``n`` threads of ``executor`` (a ThreadPoolExecutor of at least ``n`` workers) now, each running
    ``each()`` once (per-thread set-up, such as a thread-local scratch buffer); returns once all have, and
    raises the first exception of ``each``.  Threads already started count: no more than ``n`` run after it."""
    if n <= 0:
        return
    gate = threading.Event()

    def hold():
        try:
            if each is not None:
                each()
        finally:
            gate.wait()  # busy until all n tasks are submitted: each submit finds no idle thread and starts one

    futures = []
    try:
        for _ in range(n):
            futures.append(executor.submit(hold))
    finally:
        gate.set()
    for f in futures:
        f.result()
