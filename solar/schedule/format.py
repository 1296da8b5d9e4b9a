"""The schedule file format (HDF5), version 1.

::

    /                       attrs: format="solar-schedule", version, solar_version, policy, config (JSON of
                            PlanConfig), fingerprint (layout's), source, n_samples, n_blocks, steps_per_epoch,
                            id_dtype, complete (1 once fully written), header_sha256
    /demand/sample_ptr      int64[N+1]  sample -> blocks CSR (what the buffer needs to know of the layout)
    /demand/sample_blocks   id[nnz]
    /demand/block_nbytes    int64[B]    decoded bytes (buffer slots)
    /demand/block_stored    int64[B]    bytes on storage
    /epochs/source_epoch    int64[E]    DistributedSampler epoch trained at position e
    /epochs/{hit,miss,stored,demand}_bytes  int64[E]  predicted totals over ranks
    /epochs/rank_miss_bytes int64[E, P]
    /epochs/{max,min}_local_batch  int64[E]
    /ranks/<r>/samples      id[n_r]     sample ids rank r trains on, step after step (global step g = e*S + s)
    /ranks/<r>/samples_count int32[E*S]
    /ranks/<r>/load         id[l_r]     blocks to load before each step (after the evictions)
    /ranks/<r>/load_count   int32[E*S]
    /ranks/<r>/evict        id[v_r]     blocks to drop before each step's loads
    /ranks/<r>/evict_count  int32[E*S]
    /ranks/<r>/stats        int64[E*S, 5]  predicted hits, hit_bytes, misses, miss_bytes, stored_bytes

Every dataset carries an ``sha256`` attribute of its bytes (little-endian), checked when
read; the root attributes carry ``header_sha256``.  A rank reads only ``/ranks/<r>``
and ``/demand``.  ``id`` is int32 when sample and block ids fit, else int64.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

FORMAT = "solar-schedule"
VERSION = 1
STATS = ("hits", "hit_bytes", "misses", "miss_bytes", "stored_bytes")
RANK_LISTS = ("samples", "load", "evict")
HEADER_KEYS = ("format", "version", "solar_version", "policy", "config", "fingerprint", "source", "n_samples",
               "n_blocks", "steps_per_epoch", "id_dtype")


def id_dtype(n_samples: int, n_blocks: int) -> np.dtype:
    return np.dtype("<i4") if max(n_samples, n_blocks) < 2**31 - 1 else np.dtype("<i8")


def header_digest(attrs) -> str:
    """sha256 of the header attributes in a canonical JSON form."""
    def norm(v):
        if isinstance(v, bytes):
            return v.decode()
        if isinstance(v, np.generic):
            return v.item()
        return v
    doc = {k: norm(attrs[k]) for k in HEADER_KEYS}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def array_digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()
