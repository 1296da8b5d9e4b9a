"""Numbers that explain a loader's speed: bytes per sample, blocks, read amplification."""
from __future__ import annotations

import os

import numpy as np

from .layout import Layout


def _stats(a: np.ndarray) -> dict:
    return {"min": int(a.min()), "mean": float(a.mean()), "max": int(a.max())}


def summarize(layout: Layout) -> dict:
    """JSON-ready summary of a layout (what ``solar inspect`` prints).

    ``read_amplification``: bytes decoded per byte used when every sample is
    read on its own (each touched block decoded whole); ``storage_amplification``
    the same for bytes read from storage.
    """
    used = layout.sample_used_nbytes()
    decoded = layout.per_sample_sum(layout.block_nbytes)
    stored = layout.per_sample_sum(layout.block_stored)
    nblk = np.diff(layout.sample_ptr)
    users = np.bincount(layout.sample_blocks, minlength=layout.n_blocks)
    touched = users > 0
    datasets = []
    for k, fname in enumerate(layout.spec.fields):  # one row per field, aggregated over files/groups
        ids = [src.datasets[k] for src in layout.sources]
        first = layout.datasets[ids[0]]
        shapes = {layout.datasets[d].shape for d in ids}
        field_stored = sum(int(layout.block_stored[layout.dataset_block_start[d]:layout.dataset_block_start[d + 1]].sum())
                     for d in ids)
        fallback = sorted({layout.datasets[d].fallback for d in ids if not layout.datasets[d].raw})
        linked = sorted({f"{os.path.relpath(layout.files[layout.datasets[d].file], layout.spec.root)}:"
                         f"{layout.datasets[d].name}" for src, d in zip(layout.sources, ids)
                         if layout.datasets[d].file != src.file})  # reached through external links
        datasets.append({
            "name": fname, "count": len(ids), "shape": list(first.shape) if len(shapes) == 1 else None,
            "dtype": str(np.dtype(first.dtype)), "chunks": list(first.chunks) if first.chunks else None,
            "block_shape": list(layout.block_shapes[ids[0]]),
            "filters": [f.name for f in first.filters],
            "nbytes": sum(layout.datasets[d].nbytes for d in ids), "stored_nbytes": field_stored,
            "reader": "h5py" if fallback else "raw", "fallback_reason": "; ".join(fallback) or None,
            "stored_in": linked or None,
        })
    return {
        "kind": layout.spec.kind,
        "name": layout.spec.name,
        "files": len(layout.files),
        "fields": {k: list(v) for k, v in layout.field_shapes(0).items()},
        "datasets": datasets,
        "samples": layout.n_samples,
        "blocks": int(layout.n_blocks),
        "blocks_used": int(touched.sum()),
        "blocks_per_sample": _stats(nblk),
        "samples_per_block": float(users[touched].mean()) if touched.any() else 0.0,
        "bytes_per_sample": _stats(used),
        "decoded_bytes_per_sample": _stats(decoded),
        "stored_bytes_per_sample": _stats(stored),
        "dataset_bytes": int(layout.block_nbytes[touched].sum()),
        "stored_bytes": int(layout.block_stored[touched].sum()),
        "read_amplification": float(decoded.sum() / max(1, used.sum())),
        "storage_amplification": float(stored.sum() / max(1, used.sum())),
        "raw_readable": all(i.raw for i in layout.datasets),
        "fingerprint": layout.fingerprint,
    }


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_summary(s: dict) -> str:
    """Human-readable text of :func:`summarize`'s dict."""
    hb = human_bytes
    lines = [f"layout: {s['kind']}" + (f" ({s['name']})" if s["name"] else "") +
             f", {s['files']} file(s), {s['samples']:,} samples"]
    lines.append("fields (per sample): " + ", ".join(f"{k} {tuple(v)}" for k, v in s["fields"].items()))
    lines.append("fields: dataset shape, dtype, storage, filters, stored bytes (xN: in N files/groups)")
    w = max(len(d["name"]) for d in s["datasets"])
    for d in s["datasets"]:
        chunks = "contiguous" if d["chunks"] is None else "chunks " + "x".join(map(str, d["chunks"]))
        filt = "+".join(d["filters"]) or "no filters"
        ratio = f"x{d['nbytes'] / d['stored_nbytes']:.2f} compression" if d["stored_nbytes"] else "nothing written"
        shape = str(tuple(d["shape"])) if d["shape"] is not None else "(varies)"
        count = f" x{d['count']}" if d["count"] > 1 else ""
        line = (f"  {d['name']:<{w}}  {shape:<22} {d['dtype']:<8} {chunks:<24} {filt:<18}"
                f" {hb(d['stored_nbytes']):>10} stored ({ratio}){count}")
        if d.get("stored_in"):
            more = f" and {len(d['stored_in']) - 3} more" if len(d["stored_in"]) > 3 else ""
            line += f"  [stored in {', '.join(d['stored_in'][:3])}{more}]"
        if d["reader"] != "raw":
            line += f"  [h5py reader: {d['fallback_reason']}]"
        lines.append(line)
    b = s["blocks_per_sample"]
    lines.append(f"blocks: {s['blocks_used']:,} used of {s['blocks']:,}; per sample {b['min']}..{b['max']} "
                 f"(mean {b['mean']:.2f}); samples sharing a block: {s['samples_per_block']:.2f} on average")
    lines.append(f"bytes per sample: {hb(s['bytes_per_sample']['mean'])} used, "
                 f"{hb(s['decoded_bytes_per_sample']['mean'])} decoded, "
                 f"{hb(s['stored_bytes_per_sample']['mean'])} read from storage (naive per-sample reads)")
    lines.append(f"dataset: {hb(s['dataset_bytes'])} decoded, {hb(s['stored_bytes'])} stored")
    lines.append(f"read amplification (decoded / used): x{s['read_amplification']:.2f}; "
                 f"storage amplification (stored / used): x{s['storage_amplification']:.2f}")
    lines.append("reader: " + ("raw (positional reads, decoded outside HDF5)" if s["raw_readable"]
                               else "h5py fallback for some datasets (see above)"))
    lines.append(f"fingerprint: {s['fingerprint'][:16]}")
    return "\n".join(lines)
