"""``solar bench --plot``: one figure of a bench report (the dict ``solar.bench.compare.bench`` returns).

Left: samples/s per epoch of every loader that ran, with solar's limits as marks over its bar: the rate at which
solar's own storage bytes of the epoch take the disk's best cold random-read rate (``limit_ratio_best_depth``),
the slower of disk and decoding where the data is filtered (``physical_limit_ratio``; drawn where it differs), and on
a device the rate of the same steps on one batch already there (``au``); baselines that did not run are named.
Right: solar's storage bytes per epoch as multiples of the file, by its own counters (the gaps between blocks that
reads coalesced included; the blocks alone marked where they differ) and by the operating system's, with the
plan's prediction (its blocks).
"""
from __future__ import annotations

import os
from typing import List, Optional

#: What each of solar's limit marks shows: (epoch key, label, marker).
LIMITS = (("limit_ratio_best_depth", "solar's reads at the disk's best random-read rate", "black"),
          ("physical_limit_ratio", "... or at the slower of disk and decoding (filtered data)", "purple"))


def _implied(rate: float, ratio: Optional[float]) -> Optional[float]:
    """The samples/s at which a ratio of ``rate`` to a limit would be 1 (None where the ratio is not known)."""
    return rate / ratio if ratio and ratio > 0 else None


def loaders(report: dict) -> List[tuple]:
    """``[(name, per-epoch dicts)]`` of solar and every baseline that ran, in the report's order."""
    out = [("solar", report["solar"]["epochs"])] if "solar" in report else []
    for name, b in report.get("baselines", {}).items():
        if "epochs" in b:
            out.append((name, b["epochs"]))
    return out


def title(report: dict) -> str:
    what = os.path.basename(os.path.normpath(str(report.get("spec", ""))))
    f = report.get("buffer_fraction")
    parts = [what, f"{report['world_size']} rank{'s' if report['world_size'] != 1 else ''}",
             f"local batch {report['local_batch']}"]
    if f is not None:
        parts.append(f"f = {f:g}")
    parts.append("page cache warm" if str(report.get("cache", "none")).startswith("none") else "cold")
    if report.get("memory_limit_bytes"):
        parts.append("equal memory")
    if report.get("model") not in (None, "none"):
        dev = report.get("device") or {}
        where = dev.get("device_name") or dev.get("device") if isinstance(dev, dict) else dev
        parts.append(f"model {report['model']} on {where or 'cpu'}")
    return ", ".join(parts)


def plot_report(report: dict, path: str) -> None:
    """Write the figure of ``report`` to ``path`` (.png, .pdf or .svg)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = loaders(report)
    E = int(report["epochs"])
    solar = report.get("solar")
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 5), gridspec_kw={"width_ratios": [2.2, 1]})
    width = 0.8 / max(1, len(runs))
    partial_seen = False
    for k, (name, eps) in enumerate(runs):
        xs = [e + (k - (len(runs) - 1) / 2) * width for e in range(E)]
        ys = [ep["samples_per_s"] for ep in eps]
        partial = [bool(ep.get("partial")) for ep in eps]
        partial_seen |= any(partial)
        ax.bar(xs, ys, width * 0.95, label=name, color=f"C{k}", edgecolor="white")
        for x, y, p in zip(xs, ys, partial):
            if p:
                ax.bar([x], [y], width * 0.95, color="none", edgecolor="black", hatch="//", linewidth=0)
        if name == "solar":
            drawn = {}
            for key, label, colour in LIMITS:  # a ceiling over solar's bar
                marks = [(x, _implied(ep["samples_per_s"], ep.get(key))) for x, ep in zip(xs, eps)]
                marks = [(x, y) for x, y in marks if y is not None]
                # decoding faster than the disk: the second mark is the first one (not drawn twice)
                if marks and drawn and all(abs(y - drawn.get(x, -1.0)) <= 0.01 * y for x, y in marks):
                    continue
                drawn.update(marks)
                if marks:
                    ax.hlines([y for _, y in marks], [x - width / 2 for x, _ in marks], [x + width / 2 for x, _ in marks],
                              colors=colour, linewidth=2, zorder=3, label=label)
            device = [(x, _implied(ep["samples_per_s"], ep.get("au"))) for x, ep in zip(xs, eps)]
            device = [(x, y) for x, y in device if y is not None]
            if device:
                ax.hlines([y for _, y in device], [x - width / 2 for x, _ in device], [x + width / 2 for x, _ in device],
                          colors="red", linestyles="dashed", linewidth=2, zorder=3,
                          label="solar's steps on one batch already on the device")
    ax.set_xticks(range(E))
    ax.set_xticklabels([f"epoch {e}" for e in range(E)])
    ax.set_ylabel("samples/s (all ranks)")
    ax.grid(axis="y", alpha=0.3)
    if partial_seen:
        ax.bar([0], [0], color="none", edgecolor="black", hatch="//", label="stopped at the time limit")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, frameon=False)
    missing = [f"{name} ({'skipped' if 'skipped' in b else 'failed'})" for name, b in report.get("baselines", {}).items()
               if "epochs" not in b]
    if missing:
        ax.text(0.01, 0.99, "not run: " + ", ".join(missing) + " (see the report)", transform=ax.transAxes,
                fontsize=7, va="top")
    ax.set_title("loaders", fontsize=9)
    if solar:
        file_bytes = float(report.get("dataset_file_bytes") or 0) or None
        eps = solar["epochs"]
        scale = file_bytes or 1e9
        unit = "x the file" if file_bytes else "GB"
        xs = list(range(E))
        ax2.bar([x - 0.2 for x in xs], [ep["storage_bytes"] / scale for ep in eps], 0.4,
                label="solar's reads (gaps of coalesced reads included)", color="C0")
        osb = [ep.get("os_read_bytes") for ep in eps]
        if any(v is not None for v in osb):
            ax2.bar([x + 0.2 for x in xs], [(v or 0) / scale for v in osb], 0.4, label="the OS's read_bytes",
                    color="C7")
        pred = [(x, ep["predicted_storage_bytes"] / scale) for x, ep in zip(xs, eps)
                if ep.get("predicted_storage_bytes") is not None]
        if pred:
            ax2.scatter(*zip(*pred), marker="_", color="black", s=400, zorder=3, label="the plan (its blocks)")
        blocks = [(x - 0.2, ep["block_storage_bytes"] / scale) for x, ep in zip(xs, eps)
                  if ep.get("block_storage_bytes") is not None]
        if blocks and any(abs(ep["storage_bytes"] - ep["block_storage_bytes"]) > 0.01 * max(ep["storage_bytes"], 1)
                          for ep in eps if ep.get("block_storage_bytes") is not None):
            ax2.scatter(*zip(*blocks), marker="_", color="white", s=150, zorder=3,
                        label="the blocks solar read (white dash)")
        ax2.set_xticks(xs)
        ax2.set_xticklabels([f"epoch {e}" for e in xs])
        ax2.set_ylabel(f"storage bytes read ({unit})")
        ax2.grid(axis="y", alpha=0.3)
        ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=1, frameon=False)
        ax2.set_title("solar's reads", fontsize=9)
    else:
        ax2.axis("off")
    fig.suptitle(title(report), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
