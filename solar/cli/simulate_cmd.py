"""``solar simulate``: hit rate and storage bytes of each policy on a layout or a synthetic one."""
from __future__ import annotations

import json
import sys

from ..errors import SpecError
from ..scheduler.nodes import DEFAULT_NETWORK_BPS, DEFAULT_STORAGE_BPS, PeerCost
from ..scheduler.policies import ALL_POLICIES, POLICIES
from ..scheduler.run import Demand
from ..scheduler.simulate import dataset_bytes, format_table, plot, simulate
from .argtypes import byte_size, check_plot_path, epoch_count, epsilon, fraction, non_negative_int, positive_int

EPILOG = """\
policies: torch (DistributedSampler + per-rank LRU), nopfs (DistributedSampler + per-rank Belady that
sees its whole seeded future), solar2023 (SOLAR's published algorithm), solar (ours), ideal (one P x
budget Belady buffer); node pools (the ranks of a node share one buffer, --ranks-per-node; with more
than one rank per node solar-peer is compared by default, the others on asking): solar-node (solar per
node), solar-peer (solar-node + misses sent by the node holding the block when the network is faster
than storage for it), nopfs-peer (DistributedSampler + per-node Belady on its own future + fetch from
any node holding the block), lru-peer (the same with per-node LRU: no knowledge of the future).

examples:
  solar simulate --samples 16384 --sample-bytes 196608 -P 8 -b 32 --epochs 5 --buffer-fraction 0.1 0.25 0.5 0.9
  solar simulate data/well -P 64 -b 4 --epochs 3 --buffer-fraction 0.25 --json
  solar simulate --samples 65536 --sample-bytes 1e5 -P 512 -b 8 --buffer-fraction 0.1 0.5 --plot hit.png
  solar simulate --samples 16384 --sample-bytes 1000 -P 8 -b 32 --epochs 4 --buffer-fraction 0.95 --epsilon 0.1
  solar simulate data/well -P 8 -b 4 --buffer-fraction 0.5 --ranks-per-node 2 --policies solar solar-peer ideal

storage/epoch is what the policy reads from storage per epoch (stored, i.e. compressed, bytes), the mean
over epochs 1 and later (numbered from 0); the hit rate counts decoded bytes, and a block received from another node is a hit
(peer hit: the part of it that transfers serve; peer/epoch: decoded bytes sent between nodes).

A policy that cannot run with a buffer (smaller than the blocks of one local batch; ideal: one global
batch, in its one pooled buffer; solar2023 also when its appended misses outgrow the buffer) shows
"error: ..." in its row (JSON: "error"); the command then ends with one line naming the fractions and
policies that failed and exits 2, after the table, the JSON and the plot of the rest.
"""


def add_parser(sub):
    import argparse
    p = sub.add_parser("simulate", help="compare loading policies (hit rate, storage bytes)",
                       description="What-if simulation of the buffer policies on a real layout (SPEC) or a "
                                   "synthetic one (--samples/--sample-bytes).",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", nargs="?", metavar="SPEC", help="layout spec, folder, or HDF5 file")
    p.add_argument("--samples", type=positive_int, help="synthetic: number of samples")
    p.add_argument("--sample-bytes", type=byte_size, help="synthetic: bytes per sample")
    p.add_argument("--samples-per-block", type=positive_int, default=1, help="synthetic: samples sharing one block")
    p.add_argument("--blocks-per-sample", type=positive_int, default=1, help="synthetic: blocks per sample")
    p.add_argument("-P", "--world-size", type=positive_int, required=True, help="number of training ranks")
    p.add_argument("-b", "--local-batch", type=positive_int, required=True, help="samples per rank per step")
    p.add_argument("--epochs", type=epoch_count, default=5,
                   help="epochs to simulate (default 5; the steady figures are the mean over epochs 1 and later, numbered from 0)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--buffer-per-rank", type=byte_size, nargs="+", help="bytes per rank (2GiB, 5e8, ...)")
    g.add_argument("--buffer-fraction", type=fraction, nargs="+", help="aggregate buffer / dataset bytes")
    p.add_argument("--seed", type=non_negative_int, default=0, help="DistributedSampler seed (default 0)")
    p.add_argument("--epsilon", type=epsilon, default=0.0,
                   help="solar: local batches may range over [ceil(b(1-eps)), floor(b(1+eps))] (default 0)")
    p.add_argument("--drop-last", action="store_true",
                   help="as DistributedSampler(drop_last=True): drop the samples that do not fill the ranks evenly")
    p.add_argument("--no-group-blocks", dest="group_blocks", action="store_false",
                   help="plan every layout block on its own (default: blocks that the same samples use, "
                        "e.g. the fields of one sample, are planned as one unit)")
    p.add_argument("--no-parts", dest="parts", action="store_false",
                   help="plan whole chunks (default: where a chunk holds several samples' rows, the policies that "
                        "keep parts, as solar plan does, plan one sample's rows of a chunk as a unit, read with "
                        "its chunk; the table marks them *)")
    p.add_argument("--neighbour-reads", dest="neighbours", action="store_true",
                   help="as solar plan --neighbour-reads: where blocks of one size lie back to back, the policies that "
                        "keep parts also keep the neighbours of a block they read that they use soon, read in the "
                        "same request (the table marks them +)")
    p.add_argument("--policies", nargs="+", default=None, choices=list(ALL_POLICIES), metavar="POLICY",
                   help=f"policies to compare (default: {' '.join(POLICIES)}, and with --ranks-per-node above 1 "
                        f"solar-peer, what solar plan plans for such nodes, after solar; also: "
                        f"{' '.join(k for k in ALL_POLICIES if k not in POLICIES)})")
    p.add_argument("--ranks-per-node", type=positive_int, default=1,
                   help="node pools: ranks sharing one node's buffer (must divide -P; default 1)")
    p.add_argument("--network-bandwidth", type=byte_size, default=int(DEFAULT_NETWORK_BPS), metavar="BYTES/S",
                   help=f"peer policies: bytes/s a transfer between nodes moves (default {DEFAULT_NETWORK_BPS:.3g})")
    p.add_argument("--storage-bandwidth", type=byte_size, default=int(DEFAULT_STORAGE_BPS), metavar="BYTES/S",
                   help=f"peer policies: bytes/s a storage read moves (default {DEFAULT_STORAGE_BPS:.3g}); a block "
                        f"is sent rather than read when its decoded bytes travel faster than its stored bytes")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress on stderr (default: a bar on a terminal; in a log file or pipe a line at most "
                        "every 10 s of long work)")
    p.add_argument("--plot", metavar="PNG", help="write hit rate vs buffer fraction per policy")
    p.set_defaults(run=run)
    return p


def default_policies(ranks_per_node: int) -> list:
    """The policies compared by default: :data:`POLICIES`, and where ranks share a node the node policy
    ``solar plan`` uses for them (solar-peer) right after per-rank solar."""
    names = list(POLICIES)
    if ranks_per_node > 1:
        names.insert(names.index("solar") + 1, "solar-peer")
    return names


def run(args) -> int:
    if args.plot is not None:  # before the simulation, not after it
        check_plot_path(args.plot)
    if args.spec and (args.samples is not None or args.sample_bytes is not None):
        raise SpecError("--samples and --sample-bytes describe a synthetic layout: give them or a SPEC, not both")
    parts = None
    if args.spec:
        from ..layout import load_layout
        from ..layout.parts import split_chunks
        layout = load_layout(args.spec, progress=args.progress)
        demand = Demand.from_layout(layout)
        cut = split_chunks(layout) if args.parts else None
        parts = Demand.from_layout(cut) if cut is not None else None
        if args.neighbours and parts is None:
            runs = Demand.from_layout(layout, runs=True)
            parts = runs if runs.extent_runs else None
            if parts is None:
                print("solar simulate: --neighbour-reads: no blocks of this layout lie back to back in runs of one "
                      "block size; each block is read on its own", file=sys.stderr)
        source = args.spec
    else:
        if args.samples is None or args.sample_bytes is None:
            raise SpecError("give a SPEC, or --samples and --sample-bytes for a synthetic layout")
        if args.sample_bytes < 1:
            raise SpecError(f"--sample-bytes must be at least 1, got {args.sample_bytes}")
        demand = Demand.synthetic(args.samples, args.sample_bytes, args.samples_per_block, args.blocks_per_sample)
        source = f"synthetic: {args.samples} samples x {args.sample_bytes} B"
    total = dataset_bytes(parts if parts is not None else demand)  # what solar plan's --buffer-fraction takes
    P = args.world_size
    if P % args.ranks_per_node:
        raise SpecError(f"--ranks-per-node {args.ranks_per_node} does not divide the world size {P}")
    cost = PeerCost(args.network_bandwidth, args.storage_bandwidth)
    if args.policies is None:
        args.policies = default_policies(args.ranks_per_node)
    if args.buffer_fraction:
        budgets = [(f, int(f * total / P)) for f in args.buffer_fraction]
    else:
        budgets = [(b * P / total, b) for b in args.buffer_per_rank]
    rows = []
    for frac, per_rank in budgets:
        res = simulate(demand, P, args.local_batch, args.epochs, per_rank, seed=args.seed, drop_last=args.drop_last,
                       epsilon=args.epsilon, policies=args.policies, progress=args.progress,
                       group_blocks=args.group_blocks, ranks_per_node=args.ranks_per_node, cost=cost, parts=parts)
        rows.append({"fraction": frac, "buffer_per_rank": per_rank, "results": res})
    if any(f >= 1.0 for f, _ in budgets):  # where a reader would conclude that a plan holds all the data
        print("solar simulate: each policy's buffer is the whole budget; `solar plan` at the same budget keeps the "
              "queued batches and reads in flight inside it, so its buffers hold a little less (`solar plan "
              "--buffer-fraction` says which fraction holds the data; docs/runtime.md, 'The budget is the memory "
              "used')", file=sys.stderr)
    if args.json:
        print(json.dumps({"source": source, "dataset_bytes": total, "world_size": P,
                          "local_batch": args.local_batch, "epochs": args.epochs, "epsilon": args.epsilon,
                          "group_blocks": args.group_blocks, "ranks_per_node": args.ranks_per_node,
                          "parts": parts is not None and not parts.extent_runs,
                          "neighbour_reads": parts is not None and parts.extent_runs,
                          **cost.to_dict(), "rows": rows}, indent=2))
    else:
        nodes = f", {P // args.ranks_per_node} nodes of {args.ranks_per_node} ranks" if args.ranks_per_node > 1 else ""
        print(f"{source}; dataset {total:,} B; P={P}, b={args.local_batch}, epochs={args.epochs}, "
              f"epsilon={args.epsilon}{nodes}")
        print(format_table(rows))
    if args.plot:  # after the results: a figure that cannot be drawn loses nothing printed
        sys.stdout.flush()
        plot(rows, args.plot, f"{source}; P={P}, b={args.local_batch}, E={args.epochs}, eps={args.epsilon}")
        if not args.json:
            print(f"plot: {args.plot}")
    failed = _failures(rows)
    if failed:  # after the results that did run: a sweep is still worth its table
        sys.stdout.flush()
        raise SpecError(failed)
    return 0


def _failures(rows) -> str:
    """One line naming the (fraction, policies) that could not run, or '' when every run did."""
    parts, n = [], 0
    for row in rows:
        bad = [name for name, r in row["results"].items() if "error" in r]
        if bad:
            n += len(bad)
            parts.append(f"{row['fraction']:.3g}: {', '.join(bad)}")
    if not n:
        return ""
    runs = sum(len(row["results"]) for row in rows)
    return (f"{n} of {runs} runs could not plan with their buffer (buffer fraction {'; '.join(parts)}; the "
            f"'error' in the output says why): give a larger --buffer-fraction / --buffer-per-rank")
