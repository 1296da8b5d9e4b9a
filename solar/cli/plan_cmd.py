"""``solar plan``: precompute the schedule of a training job and write it to a file."""
from __future__ import annotations

import argparse
import json
import sys

from .argtypes import byte_size, epoch_count, epsilon, fraction, non_negative_int, positive_int
from ..errors import SpecError
from ..schedule.make import DEFAULT_WINDOW
from ..scheduler.nodes import DEFAULT_NETWORK_BPS, DEFAULT_STORAGE_BPS, PeerCost
from ..scheduler.policies import ALL_POLICIES, NODE_POLICIES

EPILOG = """\
The schedule holds, for every step and rank, the samples to train on (the same global
batches as DistributedSampler with this seed), the blocks to evict and to load, and the
predicted hits.  Each rank of the training job reads only its own slice.

examples:
  solar plan data/ptychonn --world-size 2 --local-batch 32 --epochs 10 --buffer-fraction 0.5 -o plan.h5
  solar plan data/ptychonn -P 2 -b 32 --epochs auto --window 5 --buffer-fraction 0.5 -o open.h5
  solar plan data/well/solar-layout.json -P 64 -b 4 --epochs 100 --buffer-per-rank 2GiB --seed 7 -o well.h5
  solar plan data/well --split valid --fields t0_fields/density -P 2 -b 4 --epochs 1 --buffer-fraction 0.5
  solar plan data/ptychonn --resume-from state.json -P 3 --buffer-fraction 0.5 -o plan3.h5
  solar plan data/well -P 4 -b 4 --epochs 3 --buffer-fraction 0.5 --ranks-per-node 2 -o node.h5
  solar inspect plan.h5

Run inside the job it plans for (same -P; e.g. in the sbatch script, or under mpiexec), solar plan
takes the job's ranks per node and plans node-shared buffers where MPI or SLURM runs it (under
torchrun a buffer per rank, with a line saying so); --no-node-pool plans a buffer per rank.
--ranks-per-node L plans node-shared buffers: ranks n*L .. n*L+L-1 (mpiexec/srun's block placement)
share one buffer of L x the per-rank budget, and with --policy solar-peer (the default then) a node
may send a block it holds to another node instead of that node reading it from storage, where
--network-bandwidth / --storage-bandwidth say it is faster.  The job must run with L ranks per node.
A node plan may be open-ended (--epochs auto: the loader plans every node's next window) or plan the
rest of a checkpointed job (--resume-from, its policy kept if it was a node plan's).

--resume-from STATE plans the rest of a job checkpointed on other ranks (STATE: loader.state_dict()
as JSON, or a torch checkpoint holding it) on -P ranks with the same global batch: -b, --epochs,
--seed, --drop-last, --epsilon and --policy default to the checkpointed job's; the new loader
accepts the old state (SolarLoader.load_state_dict).
"""


def add_parser(sub):
    p = sub.add_parser("plan", help="precompute a job's schedule (assignment, loads, evictions)",
                       description="Plan a distributed training job on a dataset layout and write the schedule.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", metavar="SPEC", help="layout spec, folder holding solar-layout.json, or HDF5 file")
    p.add_argument("-P", "--world-size", type=positive_int, required=True, help="number of training ranks")
    p.add_argument("-b", "--local-batch", type=positive_int,
                   help="samples per rank per step (required unless --resume-from)")
    p.add_argument("--epochs", type=epochs_arg,
                   help="epochs to plan, or 'auto' (default): open-ended training, planned a window at a time; "
                        "with --resume-from: the job's total (default: the checkpointed job's)")
    p.add_argument("--window", type=epoch_count,
                   help=f"with --epochs auto: epochs per window (default {DEFAULT_WINDOW}); the file holds the "
                        f"first, the loader plans the next ones in the background")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--buffer-per-rank", type=byte_size, help="decoded bytes each rank may buffer (2GiB, 5e8); with "
                                                             "--device-buffer the host's budget (staging for reads)")
    g.add_argument("--buffer-fraction", type=fraction, help="aggregate buffer / dataset bytes")
    p.add_argument("--device-buffer", type=byte_size, metavar="BYTES",
                   help="plan the residency in GPU memory, this many bytes per rank (e.g. 60GiB): the loader keeps "
                        "its buffer there (SolarLoader(buffer_device='cuda'), the default for such a plan), batches "
                        "gathered on the GPU; one buffer per rank")
    p.add_argument("--reads-in-flight", type=positive_int, metavar="N",
                   help="batches of each rank's budget held for reads in flight (default 1): more lets reads run "
                        "further ahead of the steps in use, each a batch less of residency")
    p.add_argument("--no-parts", dest="parts", action="store_false", default=None,
                   help="plan whole chunks (default: where a chunk holds several samples' rows and the policy "
                        "keeps parts, plan one sample's rows of a chunk as a unit: the buffer keeps the rows used "
                        "soon and drops the rest, and reads each chunk about once an epoch)")
    p.add_argument("--neighbour-reads", dest="neighbours", action="store_true", default=None,
                   help="where blocks are stored back to back, a read also brings the neighbouring blocks the plan "
                        "uses soon, in the same request: fewer, larger reads (policies that keep parts)")
    p.add_argument("--seed", type=non_negative_int, help="DistributedSampler seed (default 0)")
    p.add_argument("--drop-last", action="store_true", default=None, help="as DistributedSampler(drop_last=True)")
    p.add_argument("--epsilon", type=epsilon,
                   help="allowed per-rank batch imbalance (default 0: every rank gets exactly b samples)")
    p.add_argument("--policy", choices=[k for k, v in ALL_POLICIES.items() if not v.single_buffer],
                   help=f"planning policy (default solar; with --ranks-per-node solar-peer, one of "
                        f"{', '.join(NODE_POLICIES)})")
    p.add_argument("--ranks-per-node", type=positive_int,
                   help="node-shared buffers: ranks sharing one node's buffer (must divide -P; the job runs "
                        "this many ranks per node; default, run inside the job under MPI or SLURM: its ranks per "
                        "node)")
    p.add_argument("--no-node-pool", dest="node_pool", action="store_false",
                   help="one buffer per rank, also when run inside a job whose ranks share nodes")
    p.add_argument("--network-bandwidth", type=byte_size, metavar="BYTES/S",
                   help=f"with --ranks-per-node: bytes/s a transfer between nodes moves (default "
                        f"{DEFAULT_NETWORK_BPS:.3g})")
    p.add_argument("--storage-bandwidth", type=byte_size, metavar="BYTES/S",
                   help=f"with --ranks-per-node: bytes/s a storage read moves (default {DEFAULT_STORAGE_BPS:.3g})")
    p.add_argument("--resume-from", metavar="STATE",
                   help="plan the rest of a job checkpointed on other ranks: its loader state (JSON of "
                        "loader.state_dict(), or a torch checkpoint holding it); same global batch")
    p.add_argument("--split", help="plan this split of a spec that names splits (default: its train or first split)")
    p.add_argument("--fields", help="plan only these fields, comma-separated (default: all the spec's fields)")
    p.add_argument("-o", "--output", default="plan.h5", help="schedule file to write (default plan.h5)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress on stderr (default: a bar on a terminal; in a log file or pipe a line at most "
                        "every 10 s of long work)")
    p.set_defaults(run=run)
    return p


def epochs_arg(text: str):
    """``--epochs``: a positive integer (at most MAX_EPOCHS), or ``auto`` (open-ended)."""
    if text == "auto":
        return text
    try:
        positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'auto', got {text!r}") from None
    return epoch_count(text)


def run(args) -> int:
    from ..schedule import plan
    from ..schedule.summary import format_schedule, whole_data_note
    from ..topology import detect
    job = detect()
    if job.rank != 0:  # run by every rank of a job (mpiexec, srun): rank 0 plans, writes -o and prints
        if job.world_size != args.world_size:  # not the job it plans for (a variable inherited?): nothing planned
            raise SpecError(f"this process is rank {job.rank} of a job of {job.world_size} ({job.source}), not "
                            f"of the -P {args.world_size} job it would plan for: run solar plan outside the job, "
                            f"or on its rank 0")
        return 0
    epochs = args.epochs
    if args.resume_from is None:
        if args.local_batch is None:
            raise SpecError("-b/--local-batch is required (unless --resume-from takes it from a checkpointed job)")
        epochs = "auto" if epochs is None else epochs
        if args.window is not None and epochs != "auto":
            raise SpecError(f"--window {args.window} needs --epochs auto (open-ended); --epochs {epochs} plans "
                            f"every epoch up front")
    elif args.window is not None or epochs == "auto":
        raise SpecError("--resume-from plans a fixed number of epochs: give --epochs N (the job's total), not "
                        "--epochs auto or --window")
    L, found, note = _ranks_per_node(args)
    if L is not None and args.world_size is not None and args.world_size % L:
        raise SpecError(f"--ranks-per-node {L} does not divide -P/--world-size {args.world_size}: every node must "
                        f"run the same number of ranks")
    if note and L is not None:
        note += "; --no-node-pool for a buffer per rank"
    cost = None
    if args.network_bandwidth is not None or args.storage_bandwidth is not None:
        if L is None:
            raise SpecError("--network-bandwidth and --storage-bandwidth need --ranks-per-node (node-shared buffers)")
        cost = PeerCost(DEFAULT_NETWORK_BPS if args.network_bandwidth is None else args.network_bandwidth,
                        DEFAULT_STORAGE_BPS if args.storage_bandwidth is None else args.storage_bandwidth)
    if args.buffer_per_rank is None and args.buffer_fraction is None and args.device_buffer is None:
        raise SpecError("give the buffer: --buffer-per-rank, --buffer-fraction or --device-buffer")
    kw = dict(world_size=args.world_size, local_batch=args.local_batch, epochs=epochs,
              buffer_per_rank=args.buffer_per_rank, buffer_fraction=args.buffer_fraction, seed=args.seed,
              drop_last=args.drop_last, epsilon=args.epsilon, split=args.split, fields=args.fields,
              window=args.window, resume_from=args.resume_from, reads_in_flight=args.reads_in_flight,
              parts=args.parts, neighbours=args.neighbours)
    s = plan(args.spec, policy=args.policy, out=args.output, progress=args.progress, ranks_per_node=L,
             peer_cost=cost, device_buffer=args.device_buffer, **kw)
    try:
        summary = s.summary()
        whole = whole_data_note(args.buffer_fraction, s)
    finally:
        s.close()
    if L is None and found > 1 and note:  # what the node plan MPI would carry would read instead
        from ..layout.summary import human_bytes
        from ..schedule.make import predicted_storage
        theirs = predicted_storage(args.spec, ranks_per_node=found, **kw)
        if theirs is not None:
            note += (f"; predicted storage reads over the planned epochs: "
                     f"{human_bytes(sum(summary['storage_bytes']))} with a buffer per rank, {human_bytes(theirs)} "
                     f"as a node plan")
    if args.neighbours and not summary.get("neighbour_run_bytes"):
        note = ((note + "; ") if note else "") + ("--neighbour-reads: no blocks of this layout lie back to back "
                                                  "in runs of one block size; each block is read on its own")
    if whole:
        note = ((note + "; ") if note else "") + whole
    if note:
        print(f"solar plan: {note}", file=sys.stderr)
    print(json.dumps(summary, indent=2) if args.json else format_schedule(summary))
    return 0


def _ranks_per_node(args) -> tuple:
    """``(ranks_per_node or None, the job's ranks per node, a line or None)``: ``--ranks-per-node`` as given;
    else, run inside the job it plans for (its launcher's variables) and without ``--no-node-pool``, that
    job's ranks per node (:func:`solar.topology.job_ranks_per_node`), where the plan can be a node plan."""
    if args.ranks_per_node is not None:
        if not args.node_pool:
            raise SpecError("--ranks-per-node plans node buffers and --no-node-pool one buffer per rank: give one")
        return args.ranks_per_node, args.ranks_per_node, None
    if not args.node_pool or args.device_buffer is not None:  # (a GPU tier is per rank)
        return None, 1, None
    from ..topology import detect, job_ranks_per_node
    job = detect()
    L, note = job_ranks_per_node(job, args.world_size)
    return L, job.local_size if note else 1, note
