"""What-if comparison of policies (``solar simulate``): hit rates, storage bytes, imbalance."""
from __future__ import annotations

import re
from typing import Dict, Iterable, List, Optional

import numpy as np

from ..layout.summary import human_bytes
from .config import PlanConfig
from .nodes import NodeMap, PeerCost
from .policies import POLICIES, admits_parts, get_policy
from .run import BufferTooSmall, Demand, run_policy


def dataset_bytes(demand: Demand) -> int:
    used = np.zeros(demand.n_blocks, dtype=bool)
    used[demand.sample_blocks] = True
    return int(demand.block_nbytes[used].sum())


def simulate(demand: Demand, world_size: int, local_batch: int, epochs: int, buffer_bytes: int, seed: int = 0,
             drop_last: bool = False, epsilon: float = 0.0, policies: Iterable[str] = tuple(POLICIES),
             progress: bool = False, group_blocks: bool = True, ranks_per_node: int = 1,
             cost: Optional[PeerCost] = None, parts: Optional[Demand] = None) -> Dict[str, dict]:
    """Run each policy on the same job; JSON-ready dict per policy.

    ``group_blocks``: plan blocks that the same samples use as one unit (see
    :mod:`solar.scheduler.groups`); False plans every layout block on its own.
    ``ranks_per_node``/``cost``: node layout and transfer cost model of the node-pool policies
    (``policies.NODE_POLICIES``); the others keep a buffer per rank.
    Hit rates count a peer transfer as a hit (not a storage read); ``steady_peer_hit_rate`` is
    the part of ``steady_hit_rate`` that transfers serve, ``steady_node_hit_rate`` the rest.
    ``parts``: the same data as parts of chunks (:mod:`solar.layout.parts`), planned instead of ``demand`` for
    the policies that keep parts (what ``solar plan`` does; ``"parts": true`` in their results); or, a Demand
    with ``extent_runs``, with runs of neighbouring blocks (``solar plan --neighbour-reads``; ``"neighbours":
    true``).
    """
    cfg = PlanConfig(world_size, local_batch, epochs, int(buffer_bytes), seed=seed, drop_last=drop_last,
                     epsilon=epsilon)
    nodes = NodeMap(world_size, ranks_per_node)
    cost = cost or PeerCost()
    out = {}
    for name in policies:
        pol = get_policy(name)
        on_parts = parts is not None and admits_parts(pol)
        try:
            r = run_policy(parts if on_parts else demand, cfg, name, progress=progress, group_blocks=group_blocks,
                           nodes=nodes, cost=cost, progress_label=f" (buffer {human_bytes(int(buffer_bytes))} per rank)")
        except BufferTooSmall as exc:  # e.g. solar2023's appended misses outgrow a tight buffer
            out[name] = {"error": _pooled(str(exc), world_size, int(buffer_bytes)) if pol.single_buffer else str(exc)}
            continue
        rank = np.stack(r.rank_miss_bytes).sum(axis=0).astype(float)  # (P,) storage bytes per rank
        out[name] = {
            "steady_hit_rate": r.steady_hit_rate,
            "hit_rate_per_epoch": r.hit_rate_per_epoch,
            "storage_bytes_per_epoch": r.stored_bytes,
            "decoded_miss_bytes_per_epoch": r.miss_bytes,
            "max_local_batch": max(r.max_local_batch),
            "min_local_batch": min(r.min_local_batch),
            "storage_imbalance": float(rank.max() / rank.mean()) if rank.size > 1 and rank.mean() > 0 else 1.0,
            "epoch_order": r.epoch_order,
            "buffers": "one" if pol.single_buffer else ("node" if pol.node_pools else "rank"),
            "parts": on_parts and not parts.extent_runs,
            "neighbours": on_parts and parts.extent_runs,
            "steady_node_hit_rate": r.steady_node_hit_rate,
            "steady_peer_hit_rate": r.steady_peer_hit_rate,
            "peer_hit_rate_per_epoch": r.peer_hit_rate_per_epoch,
            "peer_bytes_per_epoch": r.peer_bytes,
            "max_staging_bytes": max(r.staging_bytes, default=0),
        }
    return out


_PER_RANK = re.compile(r"buffer of [\d,]+ bytes per rank cannot hold the ([\d,]+) bytes of blocks that rank \d+ "
                       r"needs at step (\d+) of epoch (\d+)")


def _pooled(message: str, world_size: int, per_rank: int) -> str:
    """The planner's "buffer too small" ``message`` said of a policy with one buffer pooled over the ranks
    (ideal): its size is ``world_size`` x ``per_rank`` and it must hold the global batch, not one rank's."""
    m = _PER_RANK.match(message)
    if m is None:
        return message
    need, step, epoch = m.groups()
    return (f"one buffer pooled over the {world_size} ranks ({world_size} x {per_rank:,} = "
            f"{world_size * per_rank:,} bytes) cannot hold the {need} bytes of blocks of the global batch at step "
            f"{step} of epoch {epoch}: it must hold at least one global batch")


def format_table(rows: List[dict]) -> str:
    """Rows: {fraction, buffer_per_rank, results: {policy: dict}}.  ``peer hit``: part of the steady hit
    rate served by transfers from other nodes; ``I/O max/mean``: storage bytes of the busiest buffer
    (rank, or node for node pools) over the mean; a policy marked ``*`` planned parts of chunks, ``+`` runs of
    neighbouring blocks read together."""
    from ..layout.summary import human_bytes
    lines = []
    for row in rows:
        lines.append(f"buffer fraction {row['fraction']:.3g} ({human_bytes(row['buffer_per_rank'])} per rank)")
        lines.append(f"  {'policy':<11} {'steady hit':>10} {'vs ideal':>8} {'storage e0':>10} {'storage/epoch (e>=1)':>21} "
                     f"{'peer hit':>8} {'peer/epoch':>10} {'local batch':>12} {'I/O max/mean':>12}  "
                     f"hit rate per epoch")
        ideal = row["results"].get("ideal", {}).get("steady_hit_rate")
        for name, r in row["results"].items():
            if "error" in r:
                lines.append(f"  {name:<11} error: {r['error']}")
                continue
            st = r["storage_bytes_per_epoch"]
            steady = np.mean(st[1:]) if len(st) > 1 else st[0]
            rel = f"{r['steady_hit_rate'] / ideal:.3f}" if ideal else "-"
            lb = f"{r['min_local_batch']}..{r['max_local_batch']}"
            per = " ".join(f"{h:.3f}" for h in r["hit_rate_per_epoch"])
            pb = r.get("peer_bytes_per_epoch") or [0]
            peer = np.mean(pb[1:]) if len(pb) > 1 else pb[0]
            label = name + ("*" if r.get("parts") else "") + ("+" if r.get("neighbours") else "")
            lines.append(f"  {label:<11} {r['steady_hit_rate']:>10.4f} {rel:>8} {human_bytes(st[0]):>10} "
                         f"{human_bytes(steady):>21} "
                         f"{r.get('steady_peer_hit_rate', 0.0):>8.4f} {human_bytes(peer):>10} {lb:>12} "
                         f"{r['storage_imbalance']:>12.2f}  {per}")
    marks = {m for row in rows for r in row["results"].values() for m, k in (("*", "parts"), ("+", "neighbours"))
             if r.get(k)}
    if marks:
        notes = (("*", "* planned on parts of chunks"),
                 ("+", "+ read runs of neighbouring blocks together (a neighbour read beside a block is a hit where "
                       "it is used: compare the storage columns)"))
        lines.append("  " + "; ".join(text for m, text in notes if m in marks))
    return "\n".join(lines)


def plot(rows: List[dict], path: str, title: str = ""):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fr = [row["fraction"] for row in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    names = list(rows[0]["results"])
    for name in names:
        ys = [row["results"][name].get("steady_hit_rate", float("nan")) for row in rows]
        ax.plot(fr, ys, marker="o", label=name)
    ax.set_xlabel("aggregate buffer / dataset bytes")
    ax.set_ylabel("steady-state hit rate (epochs >= 1)")
    ax.set_xlim(0, max(1.0, max(fr)))
    ax.set_ylim(0, 1.0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
