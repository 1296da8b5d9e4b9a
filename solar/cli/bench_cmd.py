"""``solar bench``: loader-only benchmark of solar against DataLoader + DistributedSampler baselines."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys

from ..memory import DEFAULT_PREFETCH
from ..scheduler.policies import NODE_POLICIES
from .argtypes import byte_size, epoch_count, fraction, non_negative_int, positive_int, seconds

EPILOG = """\
Run under MPI, one process per training rank:
  mpiexec -n 2 solar bench data/ptychonn --epochs 3 --buffer-fraction 0.5 --cold --json
What each batch feeds: by default nothing (the loader alone); --step-time S seconds of sleep per
step (a simulated accelerator, as MLPerf Storage runs it); --model conv a real training step (a
32-channel conv encoder-decoder learning to reproduce the largest field, Adam; bf16 autocast and
channels_last on CUDA) on --device cpu or cuda.  With a model or a step time every epoch of every
loader reports au (device-only time / wall time, MLPerf Storage's accelerator utilisation) and
gpu_wait_fraction (1 - au), the device-only time measured right after the epoch: the same steps
on one batch already on the device.  On CUDA every loader's batches reach the GPU the same way
(pinned, copied ahead of use on a side stream):
  mpiexec -n 1 solar bench data/ptychonn -b 128 --device cuda --model conv --cold
  mpiexec -n 1 solar bench data/cosmo -b 1 --step-time 0.0035 --cold   # CosmoFlow on an H100, per MLPerf
--cold drops the dataset files' pages (posix_fadvise DONTNEED, no root needed) before each
epoch, on one rank per node; --cache-mode system drops the whole page cache (root).
Baselines (--baselines, default all): torch (h5py per sample, datasets kept open), memmap
(contiguous unfiltered data), h5py-cache (chunked data, chunk cache = solar's buffer per rank),
batched (one sorted fancy-index read per field and batch); one that does not apply to the
layout is skipped with the reason in the output.
The disk's limit is measured in the same run, cold: random reads of the layout's stored
blocks (--disk-depth in flight) and 8 MiB sequential reads (4 in flight).
--equal-memory (root, Linux memory cgroup) runs every loader in one memory cgroup per node,
each loader limited to its own processes' memory as they start (before it reads) + the node's
solar buffers + --memory-allowance (page cache counted).
The JSON has per-epoch samples/s of every loader, "speedup" (solar / torch), "speedup_vs_best"
and "best_baseline" (the fastest baseline each epoch) and "limit_ratio" (solar's storage
bytes at the disk's random-read bandwidth / solar's epoch time).
Ranks that share a node share one buffer by default (a node plan): the ranks per node are found
from MPI's shared-memory split when every node runs the same number of ranks placed in blocks
(srun --distribution=block, mpiexec -ppn L); otherwise, with one rank per node, with --buffer-device
or with --no-node-pool, each rank has its own buffer.  The first progress line says which.
--ranks-per-node L plans L ranks per node whatever the placement (--policy solar-peer, the default,
also sends blocks between nodes): a test topology may put several planned nodes on one machine, e.g.
  mpiexec -n 4 solar bench data/well --ranks-per-node 2 -b 4 --only solar --json
and each epoch reports the bytes sent between nodes next to the plan's.  Every solar epoch checks
a few delivered samples per rank against h5py (after its timer) and reports its storage bytes
against the plan's ("storage_vs_plan").
The schedule goes to --schedule, else to $SOLAR_CACHE_DIR/bench (default $XDG_CACHE_HOME/solar/bench
or ~/.cache/solar/bench; on several nodes a folder every node sees), never next to the data; the run
says where (and the JSON's "schedule").  Progress goes to rank 0's stderr, with --json too: tqdm
bars on a terminal, plain lines (a line per stage and per epoch of each loader) otherwise.
A user error (a bad option, spec or file) that every rank meets prints one line, "solar bench:
error: ...", and every rank exits 2.  An error on one rank only prints "solar bench: error on rank
R: ..." and aborts every rank (MPI_Abort; status 2 for a user error, 1 for any other), so no rank
waits in a collective forever; --no-abort-on-error turns that off.
"""


def add_parser(sub):
    p = sub.add_parser("bench", help="benchmark the solar loader against the strongest baselines (under mpiexec)",
                       description="Loader benchmark: solar (plan + buffer + readers) against DistributedSampler "
                                   "baselines (torch: DataLoader + h5py; memmap; h5py-cache; batched), the same file, "
                                   "epochs, batches and sampler, with the disk's and memory's limits measured in the "
                                   "same run.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", metavar="SPEC", help="layout spec, folder holding solar-layout.json, or HDF5 file")
    p.add_argument("--epochs", type=epoch_count, default=3, help="epochs each loader runs (default 3)")
    p.add_argument("-b", "--local-batch", type=positive_int, default=32, help="samples per rank per step (default 32)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--buffer-fraction", type=fraction, help="aggregate buffer / dataset bytes (default 0.5)")
    g.add_argument("--buffer-per-rank", type=byte_size, metavar="BYTES",
                   help="solar's buffer per rank instead, e.g. 2GiB (the baselines get the same memory)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="DistributedSampler / planner seed (default 0)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each epoch")
    p.add_argument("--cache-mode", choices=("file", "system"), default=None,
                   help="with --cold: drop the dataset files' pages (default) or the whole page cache (root)")
    p.add_argument("--step-time", type=seconds, default=0.0,
                   help="seconds of simulated training per step (default 0; not with --model conv)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the batches go and the training step runs (default cpu; cuda: GPU local rank mod GPUs)")
    p.add_argument("--model", choices=("conv", "none"), default="none",
                   help="the training step each batch feeds: conv (a small conv net, forward + backward + Adam) or "
                        "none (copy to the device only; default)")
    p.add_argument("--cpus", type=positive_int,
                   help="cores solar's loader may keep busy assembling batches (default: the rank's share of the "
                        "node's cores)")
    p.add_argument("--buffer-device", choices=("cuda", "cpu"),
                   help="solar's buffer in this device's memory (cuda: the GPU; batches gathered there; cpu stands "
                        "in for it in tests); per-rank plans only")
    p.add_argument("--loader-process", dest="loader_process", action="store_true",
                   help="solar's buffer, reader and assembly in a process of their own per rank "
                        "(SolarLoader(process=True)): their threads never take the GIL from the training thread; "
                        "a buffer per rank")
    p.add_argument("--reads-in-flight", type=positive_int, metavar="N",
                   help="solar plan's --reads-in-flight: batches of each rank's budget held for reads in flight "
                        "(default 1)")
    p.add_argument("--no-parts", dest="parts", action="store_false", default=None,
                   help="solar plan's --no-parts: plan whole chunks, not one sample's rows of a chunk")
    p.add_argument("--neighbour-reads", dest="neighbours", action="store_true", default=None,
                   help="solar plan's --neighbour-reads: a read also brings the neighbouring blocks used soon")
    p.add_argument("--step-sync", action="store_true",
                   help="with --only solar: the ranks wait for each other after every step, as DDP's gradient "
                        "all-reduce makes training do")
    p.add_argument("--switch-interval", type=float, default=None, metavar="SECONDS",
                   help="the interpreter's GIL switch interval during the run, every loader alike (default "
                        "0.0005, SolarLoader's default; 0: Python's own, 0.005)")
    p.add_argument("--amp", choices=("auto", "none", "bf16"), default="auto",
                   help="--model conv: bf16 autocast or none; auto: bf16 on cuda, none on cpu")
    p.add_argument("--num-workers", type=non_negative_int, default=2, help="baseline DataLoader workers per rank")
    p.add_argument("--baseline-time-limit", type=seconds, default=120.0, metavar="SECONDS",
                   help="stop a baseline's epoch after this long and take its rate over the samples it delivered "
                        "(marked partial; default 120; 0: whole epochs)")
    p.add_argument("--reader", help="solar reader backend (default: chosen for the layout and file system)")
    p.add_argument("--threads", type=positive_int, default=16,
                   help="solar reader threads per rank (I/O depth; with the pread reader's native AIO: the reads in "
                        "flight of each step's read call)")
    p.add_argument("--reader-options", type=_json_dict, metavar="JSON",
                   help="options of solar's reader as a JSON object, e.g. '{\"direct_io\": true}' (pread: O_DIRECT) "
                        "or '{\"aio\": false}' (pread: O_DIRECT reads by a thread pool, not native AIO)")
    p.add_argument("--prefetch", type=positive_int, default=DEFAULT_PREFETCH,
                   help=f"assembled batches waiting ahead of the training loop (default {DEFAULT_PREFETCH}; reads run up to 4 steps further)")
    p.add_argument("--schedule", help="schedule file to write (default: in $SOLAR_CACHE_DIR/bench, "
                                      "~/.cache/solar/bench when unset; every rank must see it); replaces one an "
                                      "earlier solar bench wrote, never a plan of yours")
    p.add_argument("--only", choices=("solar", "baseline"), help="run solar only, or the baselines only")
    p.add_argument("--baselines", type=_baselines, default=None,
                   help="comma-separated baselines to run (default: torch,memmap,h5py-cache,batched)")
    p.add_argument("--equal-memory", action="store_true",
                   help="limit every loader to the same memory, page cache included (memory cgroup; root)")
    p.add_argument("--memory-allowance", type=byte_size, default=None,
                   help="with --equal-memory: bytes per node on top of solar's buffers and each loader's own "
                        "processes as they start (default 256 MiB + 16 MiB per rank of the node)")
    p.add_argument("--disk-depth", type=positive_int, default=16, help="random reads in flight for the disk's limit")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON on stdout")
    p.add_argument("--plot", metavar="PNG", help="also draw the report: samples/s per epoch of every loader with solar's "
                                                 "limits, and solar's storage bytes per epoch (.png, .pdf or .svg)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress on stderr (default: rank 0 says what it is doing, with --json too: bars on "
                        "a terminal, plain lines otherwise)")
    p.add_argument("--ranks-per-node", type=positive_int,
                   help="solar's node plan: ranks sharing one node's buffer (must divide the ranks; default: the "
                        "ranks the job runs on each node, when placed in blocks)")
    p.add_argument("--no-node-pool", dest="node_pool", action="store_false",
                   help="one buffer per rank, also where ranks share a node")
    p.add_argument("--policy", choices=list(NODE_POLICIES),
                   help="with --ranks-per-node: the node policy (default solar-peer)")
    p.add_argument("--network-bandwidth", type=byte_size, metavar="BYTES/S",
                   help="with --ranks-per-node: bytes/s between nodes in the plan's cost model")
    p.add_argument("--storage-bandwidth", type=byte_size, metavar="BYTES/S",
                   help="with --ranks-per-node: bytes/s of storage reads in the plan's cost model")
    p.add_argument("--no-abort-on-error", dest="abort_on_error", action="store_false",
                   help="do not MPI_Abort every rank when one fails (the default does, so none waits forever)")
    p.set_defaults(run=run)
    return p


def _json_dict(text: str) -> dict:
    """``--reader-options``: a JSON object."""
    try:
        val = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(val, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object like '{{\"direct_io\": true}}', got {text!r}")
    return val


def _baselines(text: str) -> tuple:
    """``--baselines``: a comma-separated subset of the baselines' names."""
    from ..bench.baseline import BASELINES
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in BASELINES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown baseline {bad[0] if bad else text!r}; "
                                         f"choose from {','.join(BASELINES)}")
    return names


def run(args) -> int:
    try:
        from mpi4py import MPI
    except ImportError as exc:  # mpi4py is an optional extra
        from ..errors import SolarError
        raise SolarError(f"solar bench runs under mpiexec and needs mpi4py ({exc}): "
                         "pip install 'solar-hdf5[mpi]'") from None

    from ..bench.compare import bench
    from ..bench.report import format_report
    from ..errors import SpecError
    from ..mpi import abort_on_error
    from ..scheduler.nodes import DEFAULT_NETWORK_BPS, DEFAULT_STORAGE_BPS, PeerCost
    comm = MPI.COMM_WORLD
    # a user error that every rank meets (these checks, a bad option or spec found in bench()) is one line and
    # exit 2 on every rank; one that only some ranks meet aborts the job (status 2), so none waits forever
    guard = abort_on_error(comm, prefix="solar bench", user_error_status=2) if args.abort_on_error \
        else contextlib.nullcontext()
    with guard:
        given = [x is not None for x in (args.policy, args.network_bandwidth, args.storage_bandwidth)]
        if args.loader_process and (args.ranks_per_node or 1) > 1:
            raise SpecError("--loader-process runs a buffer per rank; --ranks-per-node plans node buffers: give one")
        if args.loader_process and args.buffer_device is not None:
            raise SpecError("--loader-process keeps solar's buffer in the loader process: leave out --buffer-device")
        if args.ranks_per_node is not None and not args.node_pool:
            raise SpecError("--ranks-per-node plans node buffers and --no-node-pool one buffer per rank: give one")
        L, pool_note = _node_pool(args, comm)
        if L is None and any(given):
            raise SpecError(f"--policy, --network-bandwidth and --storage-bandwidth need a node plan; {pool_note}")
        if args.cache_mode is not None and not args.cold:
            raise SpecError(f"--cache-mode {args.cache_mode} says how --cold drops the page cache: give --cold too")
        if args.plot is not None:  # before the run, not after it
            from .argtypes import check_plot_path
            check_plot_path(args.plot)
        if args.step_sync and args.only != "solar":
            raise SpecError("--step-sync runs solar alone: give --only solar too")
        if args.buffer_device == "cuda" and args.device != "cuda":
            raise SpecError("--buffer-device cuda needs --device cuda (solar's batches are gathered on the GPU; "
                            "the baselines' must go there too, and the GPU each rank uses is set by it)")
        cost = None
        if given[1] or given[2]:
            cost = PeerCost(DEFAULT_NETWORK_BPS if args.network_bandwidth is None else args.network_bandwidth,
                            DEFAULT_STORAGE_BPS if args.storage_bandwidth is None else args.storage_bandwidth)
        if args.progress and comm.rank == 0:
            _progress_line(pool_note)
        frac = args.buffer_fraction if args.buffer_fraction is not None or args.buffer_per_rank is not None else 0.5
        rep = bench(args.spec, comm=comm, epochs=args.epochs, local_batch=args.local_batch, buffer_fraction=frac,
                    buffer_per_rank=args.buffer_per_rank, seed=args.seed, cold=args.cold,
                    cache_mode=args.cache_mode or "file", step_time=args.step_time, num_workers=args.num_workers,
                    reader=args.reader, threads=args.threads, prefetch=args.prefetch, schedule=args.schedule,
                    loaders=(args.only,) if args.only else ("solar", "baseline"),
                    baselines=args.baselines, equal_memory=args.equal_memory,
                    memory_allowance=args.memory_allowance, disk_depth=args.disk_depth,
                    progress=args.progress and comm.rank == 0 and _is_terminal(sys.stderr),
                    abort_on_error=args.abort_on_error,
                    baseline_time_limit=args.baseline_time_limit or None, ranks_per_node=L,
                    reads_in_flight=args.reads_in_flight, step_sync=args.step_sync, parts=args.parts,
                    neighbours=args.neighbours,
                    policy=args.policy, peer_cost=cost, reader_options=args.reader_options,
                    device=args.device, model=args.model, amp=args.amp,
                    loader_options={k: v for k, v in (("cpus", args.cpus), ("buffer_device", args.buffer_device),
                                                      ("switch_interval", args.switch_interval),
                                                      ("process", args.loader_process or None)) if v is not None},
                    log=_progress_line if args.progress and comm.rank == 0 else None)
    if comm.rank == 0:
        print(json.dumps(rep, indent=2) if args.json else format_report(rep), flush=True)
        if args.plot:
            from ..bench.plot import plot_report
            plot_report(rep, args.plot)
            print(f"solar bench: plot: {args.plot}", file=sys.stderr, flush=True)
    return 0


def _node_pool(args, comm) -> tuple:
    """``(ranks_per_node or None, a line saying which buffers solar gets)``: ``--ranks-per-node`` as given;
    else the job's ranks per node (collective) where they share one (more than one rank per node, placed in
    blocks, no ``--buffer-device``, no ``--no-node-pool``); else None (a buffer per rank)."""
    if args.ranks_per_node is not None:
        return args.ranks_per_node, f"solar: a node plan of {args.ranks_per_node} rank(s) per node (--ranks-per-node)"
    if not args.node_pool:
        return None, "solar: one buffer per rank (--no-node-pool)"
    if args.buffer_device is not None:
        return None, "solar: one buffer per rank, on its GPU (--buffer-device)"
    if args.loader_process:
        return None, "solar: one buffer per rank, in a loader process of its own (--loader-process)"
    from ..mpi import ranks_per_node
    L, why = ranks_per_node(comm)
    if L is None:
        return None, f"solar: one buffer per rank: {why}"
    if L == 1:
        return None, "solar: one buffer per rank (one rank per node)"
    return L, (f"solar: the {L} ranks of each node share one buffer (a node plan; --no-node-pool for a buffer "
               f"per rank)")


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


def _progress_line(text: str) -> None:
    """One progress line on stderr (rank 0), flushed at once: a log file or pipe sees it as it happens."""
    print(f"solar bench: {text}", file=sys.stderr, flush=True)
