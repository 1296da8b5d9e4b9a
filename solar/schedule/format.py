"""The schedule file format (HDF5), version 4, version 5 for a resumed job, version 6 for a plan of
node-shared buffers and 7 for one of a resumed job (versions 1-3 are still read).

::

    /                       attrs: format="solar-schedule", version, solar_version, policy, config (JSON of
                            PlanConfig), fingerprint (layout's), source, source_abs, n_samples, n_blocks,
                            steps_per_epoch, id_dtype, layout_bytes (bytes of /layout, 0: none),
                            open_ended (1: the job's epochs are not fixed), window (epochs planned in the
                            file when open-ended, 0 otherwise), complete (1 once fully written), header_sha256
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
    /layout/document        uint8[...]  JSON: the layout spec, tables of distinct dataset/source values,
                                        n_files, root / root_abs (the spec's folder, as source / source_abs)
    /layout/<array>         the rest of the Layout (per file, dataset, source, block; see
                            :mod:`solar.layout.store`), so no rank needs the HDF5 files' metadata

Every dataset carries an ``sha256`` attribute of its bytes (little-endian), checked when
read; the root attributes carry ``header_sha256``.  A rank reads only ``/ranks/<r>``
and ``/demand``.  ``id`` is int32 when sample and block ids fit, else int64.

``source`` is the dataset the plan was made from (layout spec, folder or HDF5 file),
relative to the schedule file's folder, and ``source_abs`` the same path made absolute
when planning ("" for both when planned from a Layout or Demand object).  In version 1
``source`` was the path as given, relative to the directory ``solar plan`` ran in,
and there was no ``source_abs``.  Versions 1 and 2 have no ``/layout`` (and no ``layout_bytes``):
the loader builds the layout from the HDF5 files.  Version 3 writes ``/layout`` whenever the plan
was made from a dataset (not from a bare :class:`~solar.scheduler.Demand`).

Version 4 adds ``open_ended`` and ``window`` (both covered by ``header_sha256``).  An open-ended
schedule (``solar plan --epochs auto --window K``) holds the first window: ``config.epochs`` = K
epochs planned with :class:`~solar.scheduler.run.PlanRun` ``open_ended=True`` (the last epoch's
evictions see the next epoch's uses); the loader plans windows 2, 3, ... itself, with the same
deterministic planner (:mod:`solar.loader.extend`).  Files of versions 1-3 are fixed-epoch.

Version 5 is written only for a job resumed on another world size (``solar plan --resume-from STATE``,
:mod:`solar.scheduler.elastic`); it adds the header attribute ``resume`` (JSON, covered by
``header_sha256``): ``{"step": first global step the job trains, "from": the checkpointed job's
loader state (fingerprint, world_size, config, policy, step)}``.  Its steps before ``step`` are
empty (no samples, loads or evictions: the job starts with empty buffers); an older solar, which
would train those empty steps, refuses the version.
Other plans are still written as version 4.

Version 6 is written only for a node-pool policy (``solar plan --ranks-per-node L --policy solar-node``
or ``solar-peer``, :mod:`solar.scheduler.node_plan`): the L ranks of a node share one buffer of
L x ``config.buffer_bytes``, and nodes may send blocks to each other.  It adds the header attribute
``nodes`` (JSON, covered by ``header_sha256``): ``{"ranks_per_node": L, "network_bytes_per_s": ...,
"storage_bytes_per_s": ...}`` (the :class:`~solar.scheduler.nodes.PeerCost` planned with).  Q = P / L
nodes, ranks ``n*L .. n*L+L-1`` on node n.  What changes:

    /ranks/<r>/samples, samples_count   as above (rank r's samples); no load, evict or stats per rank
    /nodes/<n>/load, evict, stage       id[*] + ``<name>_count`` int32[E*S]: node n's pool (evict, then
                                        load) and its staging reads (read, used at that step, dropped)
    /nodes/<n>/send, recv               id[*] + ``<name>_count`` int32[E*S]: blocks node n sends / receives
                                        at each step, in the plan's order, with ``send_to`` / ``recv_from``
                                        int32[*] the other node
    /nodes/<n>/stats                    int64[E*S, 10]  :data:`~solar.scheduler.node_plan.NODE_STATS`
    /epochs/rank_miss_bytes             int64[E, Q]  per node (not per rank)
    /epochs/peer_bytes                  int64[E]  decoded bytes sent between nodes

A node plan may be open-ended (``open_ended`` 1, the file holds the first ``window`` epochs; the loader plans
the next windows of every node, :mod:`solar.loader.node_windows`); solar before open-ended node plans refuses
such a file (as damaged).  Older solar refuses the version.

Version 7 is a node plan of a resumed job (``solar plan --resume-from STATE --ranks-per-node L``): version 6's
groups and attributes plus version 5's ``resume`` (both covered by ``header_sha256``); its steps before
``resume["step"]`` are empty (no samples, pool, staging or transfer lists: every node starts empty).  It is
never open-ended.  Older solar refuses the version.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional, Tuple

import h5py
import numpy as np

FORMAT = "solar-schedule"
VERSION = 4
RESUMED_VERSION = 5  # a resumed job's file (header attribute ``resume``)
NODE_VERSION = 6     # a node-pool plan (header attribute ``nodes``, groups ``/nodes/<n>``)
NODE_RESUMED_VERSION = 7  # a node-pool plan of a resumed job (version 6 + the attribute ``resume``)
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7)
STATS = ("hits", "hit_bytes", "misses", "miss_bytes", "stored_bytes")
RANK_LISTS = ("samples", "load", "evict")
NODE_LISTS = ("load", "evict", "stage", "send", "recv")
NODE_PEERS = {"send": "send_to", "recv": "recv_from"}  # the other node of each transfer
HEADER_KEYS_V1 = ("format", "version", "solar_version", "policy", "config", "fingerprint", "source", "n_samples",
                  "n_blocks", "steps_per_epoch", "id_dtype")
HEADER_KEYS_V2 = HEADER_KEYS_V1 + ("source_abs",)
HEADER_KEYS_V3 = HEADER_KEYS_V2 + ("layout_bytes",)
HEADER_KEYS_V4 = HEADER_KEYS_V3 + ("open_ended", "window")
HEADER_KEYS = HEADER_KEYS_V4 + ("resume",)
HEADER_KEYS_V6 = HEADER_KEYS_V4 + ("nodes",)
HEADER_KEYS_V7 = HEADER_KEYS_V6 + ("resume",)


def id_dtype(n_samples: int, n_blocks: int) -> np.dtype:
    return np.dtype("<i4") if max(n_samples, n_blocks) < 2**31 - 1 else np.dtype("<i8")


def header_keys(version: int) -> Tuple[str, ...]:
    """The root attributes ``header_sha256`` covers in files of format ``version``."""
    return {1: HEADER_KEYS_V1, 2: HEADER_KEYS_V2, 3: HEADER_KEYS_V3, 4: HEADER_KEYS_V4,
            6: HEADER_KEYS_V6, 7: HEADER_KEYS_V7}.get(version, HEADER_KEYS)


def header_digest(attrs, version: int = VERSION) -> str:
    """sha256 of the header attributes of a version-``version`` file in a canonical JSON form."""
    def norm(v):
        if isinstance(v, bytes):
            return v.decode()
        if isinstance(v, np.generic):
            return v.item()
        return v
    doc = {k: norm(attrs[k]) for k in header_keys(version)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def array_digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def source_paths(source: str, schedule_path: Optional[str]) -> Tuple[str, str]:
    """``(relative to the schedule file's folder, absolute)`` forms of the dataset path ``source``
    (relative to the current directory or absolute).  Both are ``""`` when ``source`` is; an
    in-memory schedule (``schedule_path`` None), or a path with no relative form, stores the
    absolute path twice."""
    if not source:
        return "", ""
    absolute = os.path.abspath(source)
    if schedule_path is None:
        return absolute, absolute
    try:
        return os.path.relpath(absolute, os.path.dirname(os.path.abspath(schedule_path))), absolute
    except ValueError:  # another drive (Windows)
        return absolute, absolute


# HDF5 object formats of 1.8 and later: superblock, object headers and chunk indexes carry
# checksums that libhdf5 verifies when it reads them, so damaged metadata is refused instead of
# being parsed (a damaged version-0 object header can crash or hang the library).
LIBVER = ("v108", "latest")


def put_text(attrs, name: str, value: str):
    """Store ``value`` as a fixed-length UTF-8 attribute: it lives in the (checksummed) object header,
    where a variable-length string would live in the global heap, which has no checksum."""
    raw = value.encode()
    attrs.create(name, np.array(raw, dtype=h5py.string_dtype("utf-8", max(1, len(raw)))))
