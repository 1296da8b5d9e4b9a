""":class:`SolarDataset`: one rank's planned batches for ``torch.utils.data.DataLoader``.

    ds = SolarDataset("plan.h5")                       # rank from torch.distributed / the launcher
    dl = DataLoader(ds, batch_size=None, num_workers=2, pin_memory=True)
    for epoch in ds.epoch_range():                     # range(ds.epoch, ds.epochs); endless if open-ended
        ds.set_epoch(epoch)
        for batch in dl:            # {field: tensor (n, ...), "index", "weight", "step"}
            ...

DataLoader workers and the one buffer: the rank's buffer (its memory, prefetch thread and
readers) lives in the process that built the dataset and nowhere else.  A worker process
reads nothing: worker ``w`` of ``k`` yields a few bytes, a reference to global step ``g``
for every ``g = start + w, start + w + k, ...`` of the pass; DataLoader sends them back in
that round-robin order, i.e. plan order, and unpickling a reference in the main process
(DataLoader's main or pin-memory thread) takes that step's assembled batch from the buffer,
which fetches steps strictly in plan order (references that arrive early wait in a small
stash: at most ``prefetch_factor * num_workers`` batches).  Each batch is assembled once and
never crosses a process boundary.
"""
from __future__ import annotations

import itertools
import numbers
import os
import threading
import weakref
from typing import Iterator, Optional

from torch.utils.data import IterableDataset, get_worker_info

from ..errors import SolarError, SpecError
from ..loader import SolarLoader

__all__ = ["SolarDataset"]

_OPEN: "weakref.WeakValueDictionary[str, SolarDataset]" = weakref.WeakValueDictionary()  # token -> dataset
_TOKENS = itertools.count()


class SolarDataset(IterableDataset):
    """One rank's planned batches as a ``torch.utils.data.IterableDataset``.

    ``SolarDataset(schedule, data=None, **kw)`` builds a :class:`~solar.loader.SolarLoader`
    with the same arguments (``rank``/``comm`` optional: see :func:`solar.topology.launcher`);
    ``SolarDataset(loader)`` wraps an existing one.  Use it with
    ``DataLoader(ds, batch_size=None, num_workers=k)`` for any ``k``: every batch exactly once,
    in plan order, each a dict ``{field: tensor (n, ...), "index": int64 (n,), "weight": float,
    "step": global step}``.  Iterating yields the rest of the current epoch.

    Checkpoints: with ``num_workers=0`` :meth:`state_dict` is exact at any point.  With workers
    DataLoader fetches up to ``prefetch_factor * num_workers`` batches ahead of the training
    loop, so :meth:`state_dict` raises unless given the next step the loop has not seen:
    ``ds.state_dict(step=batch["step"] + 1)``, at an epoch's end too (or call it after
    ``set_epoch`` of the next epoch).  A pass abandoned mid-epoch with workers
    continues after the batches already fetched; ``load_state_dict`` to go back.
    ``persistent_workers=True`` is refused (a persistent worker cannot see the new epoch).  With
    workers a custom ``collate_fn`` runs in the worker on step references, not on batches: use
    ``transform=`` / ``sample_transform=`` (SolarLoader's, run in the main process's prefetch
    thread) instead.  ``device=`` is refused: wrap the DataLoader in :func:`solar.torch.to_device`.
    """

    def __init__(self, schedule, data=None, **loader_kwargs):
        if loader_kwargs.get("device") is not None or getattr(getattr(schedule, "hooks", None), "mover", None):
            raise SpecError("SolarDataset takes no device=: DataLoader's workers and pin-memory thread expect CPU "
                            "batches; wrap the DataLoader instead: solar.torch.to_device(DataLoader(ds, ...), device)")
        if isinstance(schedule, SolarLoader):
            if data is not None or loader_kwargs:
                raise SpecError("SolarDataset(loader) takes no other arguments")
            self.loader = schedule
        else:
            self.loader = SolarLoader(schedule, data, **loader_kwargs)
        self._lock = threading.Lock()
        self._gen: Optional[Iterator[dict]] = None  # the loader's iterator over the current epoch
        self._stash: dict = {}                      # step -> batch fetched before its reference arrived
        self._ahead = False                         # a worker pass fed this epoch since the last seek
        self._span: Optional[tuple] = None          # (start, end) steps, in a spawned worker's copy
        self._passes = 0                            # passes iterated by this (worker's) copy
        self._token = f"{os.getpid()}:{next(_TOKENS)}"
        _OPEN[self._token] = self

    # ------------------------------------------------------------------ plan
    def _own(self, what: str) -> SolarLoader:
        """The loader, or a SolarError naming ``what`` when this is a pickled copy (which has none)."""
        if self.loader is None:
            raise SolarError(f"SolarDataset.{what}: this SolarDataset is a pickled copy, which holds no loader (the "
                             "copies DataLoader sends its worker processes only hand out step references); use the "
                             "SolarDataset it was copied from, or build SolarDataset(schedule, ...) in this process")
        return self.loader

    def __len__(self) -> int:
        """Steps per epoch."""
        return self._own("__len__").S

    @property
    def epoch(self) -> int:
        return self._own("epoch").epoch

    @property
    def epochs(self) -> Optional[int]:
        """Epochs the schedule plans; None for an open-ended schedule (``solar plan --epochs auto``)."""
        return self._own("epochs").epochs

    def epoch_range(self):
        """The epoch positions left to train (:meth:`SolarLoader.epoch_range`)."""
        return self._own("epoch_range").epoch_range()

    def set_epoch(self, epoch: int):
        """:meth:`SolarLoader.set_epoch <solar.loader.SolarLoader.set_epoch>`: a no-op inside ``epoch``."""
        self._own("set_epoch")
        with self._lock:
            before = self.loader.cursor
            self.loader.set_epoch(epoch)
            if self.loader.cursor != before:
                self._forget()
            elif self.loader.cursor % self.loader.S == 0:
                self._ahead = False  # the training loop moved on to a new epoch: it has seen the last one whole

    def state_dict(self, step: Optional[int] = None) -> dict:
        """The loader's state; ``step``: the next global step the training loop has not seen
        (``batch["step"] + 1``), needed mid-epoch when DataLoader workers fetch ahead."""
        self._own("state_dict")
        with self._lock:
            state = self.loader.state_dict()
            fetched = self.loader.cursor
            if step is None:
                # the main process takes a worker's batch from the buffer when it receives it, which may be
                # before the loop gets it (DataLoader reorders what workers send; its pin-memory thread takes all it
                # can): even a pass fetched to its epoch's end may not be trained to the end yet
                if self._ahead:
                    raise SolarError(f"DataLoader workers have fetched up to step {fetched - 1}, which may be ahead "
                                     "of the training loop: call state_dict(step=batch['step'] + 1) (at an epoch's "
                                     "end too, or after set_epoch of the next epoch)")
                return state
            first = self.loader.schedule.start_step  # 0, or where a resumed job starts
            if isinstance(step, bool) or not isinstance(step, numbers.Integral) or not first <= step <= fetched:
                raise SpecError(f"step must be an integer in [{first}, {fetched}] (steps fetched so far), got {step!r}")
            state["step"] = int(step)
            return state

    def load_state_dict(self, state: dict):
        """:meth:`SolarLoader.load_state_dict <solar.loader.SolarLoader.load_state_dict>` (also the state of a job
        checkpointed on other ranks when the schedule resumes it: ``solar plan --resume-from``)."""
        self._own("load_state_dict")
        with self._lock:
            self.loader.load_state_dict(state)
            self._forget()

    def _forget(self):
        """Drop the epoch iterator and early batches after the cursor moved."""
        self._gen, self._ahead = None, False
        self._stash.clear()

    # ------------------------------------------------------------- iterate
    def __iter__(self):
        info = get_worker_info()
        return self._local() if info is None else self._references(info.id, info.num_workers)

    def _pass(self) -> tuple:
        """(first, end) global steps of this pass: the rest of the cursor's epoch."""
        if self._span is not None:
            return self._span
        g, steps = self.loader.cursor, self.loader.S
        if not self.loader.open_ended and g >= self.loader.schedule.n_steps:  # open-ended: planned as it goes
            raise SolarError(f"the schedule's {self.loader.epochs} epochs are used up; plan more epochs")
        return g, (g // steps + 1) * steps

    def _local(self):
        """Iteration in this process (no DataLoader workers)."""
        self._own("__iter__")  # here, before the first next(): a generator's body runs late
        return self._steps()

    def _steps(self):
        first, end = self._pass()
        for g in range(first, end):
            yield self._take(g)

    def _references(self, worker: int, workers: int):
        """In DataLoader worker ``worker`` of ``workers``: references to its share of the pass."""
        if self._passes:
            raise SpecError("SolarDataset does not support DataLoader(persistent_workers=True): a persistent "
                            "worker keeps the epoch it started with; leave persistent_workers off")
        self._passes += 1
        first, end = self._pass()
        for g in range(first + worker, end, workers):
            yield _StepRef(self._token, g)

    def _take(self, g: int, from_worker: bool = False) -> dict:
        """Step ``g``'s batch: from the stash, or fetched in plan order through the loader."""
        with self._lock:
            self._ahead |= from_worker
            batch = self._stash.pop(g, None)
            if batch is None:
                if g < self.loader.cursor:
                    raise SolarError(f"step {g} was already handed out (the dataset is at step "
                                     f"{self.loader.cursor}); a second DataLoader pass over the same steps?")
                while self.loader.cursor <= g:
                    b = self._next_batch()
                    self._stash[self.loader.cursor - 1] = b
                batch = self._stash.pop(g)
        batch["step"] = g
        return batch

    def _next_batch(self) -> dict:
        if self._gen is not None:
            b = next(self._gen, None)
            if b is not None:
                return b
        self._gen = iter(self.loader)  # next epoch (or the first call)
        return next(self._gen)

    # ------------------------------------------------------------- pickling
    def __getstate__(self) -> dict:
        """What a spawned DataLoader worker needs: the token and this pass's steps (no loader)."""
        with self._lock:
            return {"_token": self._token, "_span": self._pass(), "_passes": 0}

    def __setstate__(self, state: dict):
        self.__dict__.update(state)
        self.loader = None  # a copy: references in a DataLoader worker, nothing else (see _own)
        self._lock = threading.Lock()
        self._gen, self._stash, self._ahead = None, {}, False

    # -------------------------------------------------------------- close
    def stats(self) -> dict:
        return self._own("stats").stats()

    def close(self):
        """Close the loader (buffer, readers, schedule); a pickled copy has nothing to close."""
        if self.loader is None:
            return  # the token is the original's: it stays open
        _OPEN.pop(self._token, None)
        self.loader.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.loader is None:
            return None
        _OPEN.pop(self._token, None)
        return self.loader.__exit__(exc_type, exc, tb)


class _StepRef:
    """What a DataLoader worker yields: global step ``step`` of dataset ``token``; unpickled in the
    main process it becomes that step's batch (or DataLoader's wrapper of the error, re-raised there)."""

    __slots__ = ("token", "step")

    def __init__(self, token: str, step: int):
        self.token, self.step = token, step

    def __reduce__(self):
        return _resolve, (self.token, self.step)


def _resolve(token: str, step: int):
    from torch._utils import ExceptionWrapper
    try:
        ds = _OPEN.get(token)
        if ds is None:
            raise SolarError(f"a DataLoader worker sent step {step} of a SolarDataset that is closed "
                             "or belongs to another process")
        return ds._take(step, from_worker=True)
    except Exception:  # noqa: BLE001 - DataLoader re-raises it in the training loop
        return ExceptionWrapper(where=f"in SolarDataset, step {step} (main process)")
