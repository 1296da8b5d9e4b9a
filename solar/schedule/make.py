"""``solar.plan``: layout -> planner -> schedule file."""
from __future__ import annotations

import numbers
import os
from typing import Optional, Tuple, Union

import numpy as np

from ..errors import SpecError
from ..memory import (DEFAULT_IO_DEPTH, bookkeeping_bytes, check_reads_in_flight, demand_batch_bytes, largest_batch,
                      plan_budgets)
from ..scheduler.config import (MAX_BYTES, PlanConfig, check_count, check_drop_last, check_epochs,
                                check_epsilon, check_fraction, parse_bytes)
from ..scheduler.policies import get_policy
from ..scheduler.run import BufferTooSmall, Demand, PlanRun
from ..scheduler.sampler import steps_per_epoch
from ..scheduler.simulate import dataset_bytes
from .output import check_folder, check_target
from .schedule import Schedule
from .writer import ScheduleWriter


def buffer_bytes(demand: Demand, world_size: int, buffer_per_rank=None, buffer_fraction=None) -> int:
    """Per-rank budget from bytes ('2GiB') or a fraction of the dataset's decoded bytes."""
    if (buffer_per_rank is None) == (buffer_fraction is None):
        raise SpecError("give exactly one of buffer_per_rank and buffer_fraction")
    check_count("world_size", world_size)
    if buffer_fraction is not None:
        f = check_fraction("buffer_fraction", buffer_fraction)
        b = f * dataset_bytes(demand) / world_size
        if b > MAX_BYTES:
            raise SpecError(f"buffer_fraction {buffer_fraction!r} gives {b:.3g} bytes per rank, more than 2**62")
        return int(b)
    return parse_bytes(buffer_per_rank)


#: Epochs in a window of an open-ended schedule when ``window`` is not given.
DEFAULT_WINDOW = 10


def epochs_and_window(epochs, window) -> Tuple[int, int]:
    """``(epochs planned in the file, window)`` for ``epochs`` (a positive int, or ``"auto"``: open-ended)
    and ``window`` (None, or a positive int, only with ``"auto"``); window 0 means a fixed-epoch job."""
    if epochs == "auto":
        k = DEFAULT_WINDOW if window is None else window
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise SpecError(f"window must be a positive integer (epochs planned at a time), got {window!r}")
        check_epochs("window", k)
        return int(k), int(k)
    if isinstance(epochs, str):
        raise SpecError(f"epochs must be a positive integer or 'auto' (open-ended), got {epochs!r}")
    check_epochs("epochs", epochs)
    if window is not None:
        raise SpecError(f"window={window!r} needs epochs='auto' (open-ended training); with epochs={epochs!r} "
                        f"every epoch is planned up front")
    return int(epochs), 0


def plan(data: Union[str, "Demand", object], *, world_size: int, local_batch: Optional[int] = None,
         epochs: Union[int, str, None] = None, buffer_per_rank=None, buffer_fraction: Optional[float] = None,
         seed: Optional[int] = None, drop_last: Optional[bool] = None, epsilon: Optional[float] = None,
         policy: Optional[str] = None, out: Optional[str] = None, progress: bool = False,
         split: Optional[str] = None, fields=None, window: Optional[int] = None, resume_from=None,
         ranks_per_node: Optional[int] = None, peer_cost=None, device_buffer=None,
         reads_in_flight: Optional[int] = None, parts: Optional[bool] = None,
         neighbours: Optional[bool] = None) -> Schedule:
    """Plan a job and write its schedule to ``out`` (in memory if None); returns the open :class:`Schedule`.

    ``data``: a layout spec path / folder / HDF5 file, a :class:`~solar.layout.Layout`
    or a :class:`~solar.scheduler.Demand`; ``split``/``fields`` (a path only): plan that split / those
    fields of the spec (:meth:`~solar.layout.LayoutSpec.select`).  The file stores the layout (format
    version 3, ``/layout``) unless ``data`` is a Demand, so that the job's ranks read no HDF5 metadata.
    ``local_batch`` and ``epochs`` have no default here (unless ``resume_from``): ``epochs`` is a number
    of epochs or ``"auto"`` (see below), which is what the ``solar plan`` command's ``--epochs``
    defaults to.  Exactly one of ``buffer_fraction`` (aggregate buffer / dataset's decoded bytes) and
    ``buffer_per_rank`` (bytes, or a string like ``"2GiB"``).  ``seed`` (default 0), ``drop_last``
    (False), ``epsilon`` (0.0), ``policy`` ("solar").

    ``epochs="auto"``: open-ended training (no epoch count known); the file holds the first ``window``
    epochs (default :data:`DEFAULT_WINDOW`) and :class:`~solar.loader.SolarLoader` plans the following
    windows as training goes (needs a policy with the identity epoch order and a bounded lookahead).

    ``resume_from``: a loader state (``SolarLoader.state_dict()``, or a file holding it: see
    :func:`solar.schedule.resume.read_state`) of a job checkpointed on other ranks; plans the rest of that
    job on ``world_size`` ranks with the same global batch (:mod:`solar.scheduler.elastic`).  Left out
    (None), ``local_batch``, ``epochs``, ``seed``, ``drop_last``, ``epsilon`` and ``policy`` are the
    checkpointed job's (``local_batch``: its global batch / ``world_size``); the file (format version 5)
    starts at the state's step and the new loader accepts the old state.

    ``device_buffer``: the residency planned for a buffer in GPU memory of this many bytes per rank (the planner
    is the same, with this budget); the file says so (root attribute ``buffer_place``) and the loader then keeps
    its pools on the GPU by default (``SolarLoader(buffer_device=...)``).  ``buffer_per_rank`` is then the host's
    budget, checked against the reads staged on the host (up to 4 steps of misses); not with ``buffer_fraction``,
    ``ranks_per_node`` or ``resume_from``.

    ``reads_in_flight`` (default 1): batches of a rank's budget held for reads in flight.  At a full buffer a
    step's evictions free slots only once the steps that last used them are assembled, so with one batch the
    next steps' reads wait for the steps before them (``book_wait_max_s`` in ``solar bench``); each more batch
    lets reads run further ahead and is a batch less of residency.  Stored as ``read_ahead_bytes``.

    ``parts`` (default: where the policy keeps them, :func:`~solar.scheduler.policies.admits_parts`): plan on
    parts of chunks (:mod:`solar.layout.parts`) where a chunk holds several samples' rows: the buffers keep the
    rows of a chunk the plan uses soon and drop the rest, so a chunk is read about once an epoch instead of
    once per eviction.  False: whole chunks.  True with a policy that does not keep parts: a SpecError.

    ``neighbours`` (default False): where blocks are stored back to back (contiguous datasets), a read block
    also brings its neighbours (:mod:`solar.layout.runs`) that the plan uses within ``0.75 f`` of an epoch, in
    the same request: fewer, larger reads for the same bytes (1.5-5x fewer requests).  Off by default for now:
    on the 2-core VM a cold epoch ran 1.5-2.1x faster with 16 KiB blocks, the same with 32-64 KiB
    (docs/planner.md).  True with a policy that does not keep parts: a SpecError.

    ``ranks_per_node``: node-shared buffers (format version 6): ranks ``n*L .. n*L+L-1`` share node n's
    buffer of L x the per-rank budget, planned with a node-pool policy (default ``"solar-peer"``: solar
    per node, plus blocks sent between nodes where ``peer_cost``, a
    :class:`~solar.scheduler.nodes.PeerCost`, says the network is faster than storage; ``"solar-node"``:
    no transfers).  The job must run L ranks per node in that order (the loader checks that each planned
    node's ranks share memory).  Open-ended (``epochs="auto"``) as a per-rank plan: the loader plans the next
    node windows.  With ``resume_from``: the rest of the checkpointed job as a node plan (format version 7),
    with the checkpointed job's policy if it was a node plan's, else ``"solar-peer"``; without
    ``ranks_per_node`` a node job resumes with one buffer per rank (policy ``"solar"`` by default).
    """
    check_count("world_size", world_size)
    from ..progress import check as check_progress
    check_progress(progress)
    reads = check_reads_in_flight(1 if reads_in_flight is None else reads_in_flight)
    if device_buffer is not None and reads > 1:
        raise SpecError("reads_in_flight= with device_buffer=: a device buffer stages its reads on the host "
                        f"({DEFAULT_IO_DEPTH} steps of misses); leave reads_in_flight= at 1")
    host_budget = None
    if device_buffer is not None:  # the residency in device memory; buffer_per_rank stays the host's budget
        device_buffer, host_budget = _device_budget(device_buffer, buffer_per_rank, buffer_fraction, ranks_per_node,
                                                    resume_from)
        buffer_per_rank, buffer_fraction = device_buffer, None
    nodes = _nodes(world_size, ranks_per_node, peer_cost)
    if resume_from is not None:  # policy None: the checkpointed job's, where it plans what this job runs
        return _plan_resumed(data, resume_from, world_size=world_size, local_batch=local_batch, epochs=epochs,
                             buffer_per_rank=buffer_per_rank, buffer_fraction=buffer_fraction, seed=seed,
                             drop_last=drop_last, epsilon=epsilon, policy=policy, out=out, progress=progress,
                             split=split, fields=fields, window=window, nodes=nodes, reads=reads, parts=parts,
                             neighbours=neighbours)
    if nodes is not None and policy is None:
        policy = "solar-peer"
    if local_batch is None or epochs is None:
        raise SpecError(f"{'local_batch' if local_batch is None else 'epochs'} is required (or resume_from=, "
                        f"which takes it from a checkpointed job)")
    check_count("local_batch", local_batch)
    epochs, window = epochs_and_window(epochs, window)
    pol = _policy("solar" if policy is None else policy, nodes is not None)
    out = _out_path(out)
    data, demand, source = _inputs(data, out, progress, split, fields, _parts(parts, pol),
                                   _parts(False if neighbours is None else neighbours, pol, "neighbours"))
    budget = buffer_bytes(demand, world_size, buffer_per_rank, buffer_fraction)  # all the rank's memory
    epsilon = check_epsilon(0.0 if epsilon is None else epsilon)  # before the budget, which uses it
    drop_last = check_drop_last(bool(drop_last) if drop_last is None else drop_last)
    resident, ahead = plan_budgets(budget, demand, local_batch, epsilon, None if data is demand else data, reads)
    seed, drop_last = 0 if seed is None else seed, bool(drop_last)
    staging = 0 if host_budget is None else _check_staging(host_budget, demand, local_batch, epsilon)
    S = steps_per_epoch(demand.n_samples, world_size, local_batch, drop_last)
    node_args = {} if nodes is None else {"nodes": nodes[0], "cost": nodes[1]}
    if window > 0 and data is demand and demand.has_parts:  # the file would not hold the extents: the loader
        raise SpecError("an open-ended plan of a Demand with block_extent (parts of chunks): the schedule file "  # could
                        "does not store the extents the loader needs to plan the next windows; plan from the "  # not
                        "layout (a path or a Layout), or give a number of epochs")  # plan its next windows

    def build(target: Optional[str]) -> Schedule:
        def make(res: int, slack: int, horizon: Optional[int] = None) -> Schedule:
            """The plan with residency ``res`` (``slack`` held back), written to ``target``; with ``horizon``, in
            memory and closed over that many epochs (an open-ended plan's next windows, as a probe of its pools)."""
            E, where, K = (epochs, target, window) if horizon is None else (horizon, None, 0)
            cfg = PlanConfig(world_size, local_batch, E, res, seed=seed, drop_last=drop_last, epsilon=epsilon)
            run = PlanRun(demand, cfg, pol, record=True, open_ended=K > 0, **node_args)  # before the file
            w = ScheduleWriter(where, demand, cfg, pol.name, S, source=source,
                               layout=None if data is demand else data, window=K, nodes=nodes,
                               buffer_place="host" if device_buffer is None else "device", read_ahead_bytes=ahead,
                               host_staging_bytes=staging, pool_slack_bytes=slack)
            return _write(w, where, lambda: run.advance(cfg.epochs, on_epoch=w.add_epoch,
                                                        progress=progress if horizon is None else False))
        probe = None if window == 0 else (lambda res, slack: make(res, slack, FIT_WINDOWS * window))
        s = _fitting_pools(make, resident, n_sizes, probe)
        if staging:
            _check_largest_step(s, staging, host_budget)
        return s
    n_sizes = _n_sizes(demand.block_nbytes)
    try:
        return _checked_output(out, bool(staging) or n_sizes > 1, build)
    except BufferTooSmall as exc:  # its figure is the residency: say what the rest of the rank's budget holds
        if budget == resident:
            raise
        from ..layout.summary import human_bytes as hb
        held = f"{hb(budget - resident)} of the {hb(budget)} per rank is held for batches in flight and bookkeeping"
        if ahead:
            held += f", {hb(ahead)} of it for reads_in_flight={reads} (--reads-in-flight {reads}; 1 holds less)"
        raise BufferTooSmall(f"{exc} ({held})") from None


def _n_sizes(block_nbytes) -> int:
    """How many pool size classes the blocks come in (:func:`solar.memory.size_classes`)."""
    from ..memory import size_classes
    return int(size_classes(np.asarray(block_nbytes, np.int64))[1].shape[0])


def _checked_output(out: Optional[str], checked: bool, build) -> Schedule:
    """``build(target)``: a plan written at ``target`` and checked there (a check may refuse it after writing).
    With ``checked``, ``target`` is a name beside ``out``, renamed over it once ``build`` returns and removed if it
    raises: a refused plan leaves ``out`` as it was (a schedule ``solar plan -o`` would have replaced)."""
    if out is None or not checked:
        return build(out)
    from ..atomic import remove_quietly, temp_name
    tmp = temp_name(out) + "-checked"
    try:
        s = build(tmp)
    except BaseException:
        remove_quietly(tmp)
        raise
    s.close()
    os.replace(tmp, out)
    return Schedule.load(out)


def _check_largest_step(s: Schedule, staging: int, host_budget: int) -> None:
    """SpecError (``s`` closed) when a step of a device plan stages more misses on the host than its host
    budget leaves for them (rows of their size class's width; a plan on parts of chunks also loads, at a step,
    the rows of its chunks that later steps use)."""
    from ..memory import largest_step_load, size_classes
    nb = np.asarray(s.demand()["block_nbytes"], np.int64)
    class_of, class_bytes = size_classes(nb)
    width = class_bytes[class_of]
    worst = max((largest_step_load(p.load, p.load_ptr, width) + (r,)
                 for r, p in ((r, s.rank(r, keep=False)) for r in range(s.world_size))), default=(0, 0, 0))
    if worst[0] <= staging:
        return
    s.close()
    from ..layout.summary import human_bytes as hb
    need = host_budget - staging + worst[0]
    raise SpecError(f"a host budget of {host_budget:,} bytes per rank cannot stage the device buffer's reads of step "
                    f"{worst[1]} of rank {worst[2]}: {worst[0]:,} bytes of blocks it loads (on parts of chunks or "
                    f"with neighbours, also those later steps use) where {staging:,} are left after the "
                    f"bookkeeping; raise buffer_per_rank= to at least {need:,} bytes ({hb(need)})")


def predicted_storage(data, **kw) -> Optional[int]:
    """Bytes a plan of ``data`` with :func:`plan`'s arguments ``kw`` would read from storage over its planned
    epochs (planned into a temporary file, then dropped); None where it cannot be planned (a SolarError).
    What a command that planned one way says the other way would read."""
    import tempfile

    from ..errors import SolarError
    with tempfile.TemporaryDirectory(prefix="solar-plan-") as tmp:
        try:
            with plan(data, out=os.path.join(tmp, "plan.h5"), **kw) as s:
                return int(sum(s.predicted()["storage_bytes"]))
        except SolarError:
            return None


def _device_budget(device_buffer, buffer_per_rank, buffer_fraction, ranks_per_node, resume_from):
    """``(device budget bytes, host budget bytes or None)`` of ``plan(device_buffer=...)``; SpecError for what
    it cannot be combined with."""
    dev = _bytes_arg("device_buffer", device_buffer)
    if buffer_fraction is not None:
        raise SpecError("device_buffer= with buffer_fraction=: the device budget is in bytes; give the host's "
                        "budget (staging for reads) as buffer_per_rank=")
    if ranks_per_node is not None:
        raise SpecError("device_buffer= plans one buffer per rank on its GPU: not with ranks_per_node=")
    if resume_from is not None:
        raise SpecError("device_buffer= with resume_from=: plan the resumed job with buffer_per_rank= and run it "
                        "with SolarLoader(buffer_device=...)")
    return dev, None if buffer_per_rank is None else _bytes_arg("buffer_per_rank", buffer_per_rank)


def _bytes_arg(name: str, v) -> int:
    """``v``, bytes given as an int or text (``'60GiB'``), as an int >= 1; SpecError naming ``name`` otherwise."""
    from ..scheduler.config import parse_bytes
    try:
        n = parse_bytes(v) if isinstance(v, str) else v
    except (ValueError, SpecError):
        raise SpecError(f"{name} must be bytes (an integer, or like '60GiB'), got {v!r}") from None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise SpecError(f"{name} must be bytes >= 1, got {v!r}")
    return n


def _check_staging(host_budget: int, demand, local_batch: int, epsilon: float) -> int:
    """The bytes a device plan's host side may stage (``host_budget`` less the bookkeeping); SpecError when that
    does not hold the misses of :data:`~solar.memory.DEFAULT_IO_DEPTH` steps of a local batch's blocks each.  A
    step that loads more (a plan on parts of chunks, or with neighbours, loads blocks for later steps too) is
    checked once the plan is made (:func:`_check_largest_step`); the loader keeps fewer steps of reads in flight
    where steps load more."""
    n = largest_batch(local_batch, epsilon)
    step = demand_batch_bytes(demand.sample_ptr, demand.sample_blocks, demand.block_nbytes, n)
    keep = bookkeeping_bytes(demand.n_samples, demand.n_blocks, len(demand.sample_blocks))
    need = DEFAULT_IO_DEPTH * step + keep
    if need > host_budget:
        from ..layout.summary import human_bytes as hb
        raise SpecError(f"a host budget of {hb(host_budget)} per rank cannot stage a device buffer's reads: "
                        f"{DEFAULT_IO_DEPTH} steps of misses ({hb(step)} each at most, a local batch of {n} samples' "
                        f"blocks) and {hb(keep)} of bookkeeping take {hb(need)}; raise buffer_per_rank= or lower the "
                        "local batch")
    return int(host_budget - keep)


def _plan_resumed(data, state, *, world_size: int, local_batch, epochs, buffer_per_rank, buffer_fraction, seed,
                  drop_last, epsilon, policy, out, progress, split, fields, window, nodes=None,
                  reads: int = 1, parts=None, neighbours=None) -> Schedule:
    """:func:`plan` with ``resume_from=state``: the rest of a checkpointed job on ``world_size`` ranks (with
    ``nodes``, ``(NodeMap, PeerCost)``: as a node plan)."""
    from ..scheduler import elastic
    from .resume import read_state
    if window is not None:
        raise SpecError(f"window={window!r}: a resumed job is planned for a fixed number of epochs")
    if isinstance(state, (str, os.PathLike)):
        state = read_state(state)
    old = elastic.check_state(state)  # before the layout is built: a bad state fails fast
    if policy is None and get_policy(old["policy"]).node_pools != (nodes is not None):
        policy = "solar" if nodes is None else "solar-peer"  # the old job's policy plans the other kind of buffer
    out = _out_path(out)
    pol0 = _policy(policy or old["policy"], nodes is not None)
    data, demand, source = _inputs(data, out, progress, split, fields, _parts(parts, pol0),
                                   _parts(False if neighbours is None else neighbours, pol0, "neighbours"))
    if demand.fingerprint != old["fingerprint"] and not isinstance(data, Demand):
        data, demand = _as_planned(data, demand, old, parts, policy, bool(neighbours))
    job = elastic.resume_job(state, demand.n_samples, demand.fingerprint, world_size=world_size,
                             local_batch=local_batch, epochs=epochs, seed=seed, drop_last=drop_last,
                             epsilon=epsilon, policy=policy)
    pol = _policy(job.policy, nodes is not None)
    budget = buffer_bytes(demand, world_size, buffer_per_rank, buffer_fraction)
    resident, ahead = plan_budgets(budget, demand, job.local_batch, job.epsilon, None if data is demand else data,
                                   reads)
    node_args = {} if nodes is None else {"nodes": nodes[0], "cost": nodes[1]}

    def make(res: int, slack: int, target: Optional[str]) -> Schedule:
        cfg = PlanConfig(world_size, job.local_batch, job.epochs, res, seed=job.seed, drop_last=job.drop_last,
                         epsilon=job.epsilon)
        run = elastic.ResumedRun(demand, cfg, pol, job.point, **node_args)  # before the file: SpecError leaves none
        w = ScheduleWriter(target, demand, cfg, pol.name, run.S, source=source,
                           layout=None if data is demand else data, resume=job.record, nodes=nodes,
                           read_ahead_bytes=ahead, pool_slack_bytes=slack)
        return _write(w, target, lambda: run.advance(w.add_epoch, progress=progress))
    n_sizes = _n_sizes(demand.block_nbytes)
    return _checked_output(out, n_sizes > 1, lambda target: _fitting_pools(
        lambda res, slack: make(res, slack, target), resident, n_sizes))


#: Plans made at most by :func:`_fitting_pools` (the first and the re-plans with less residency).
FIT_ATTEMPTS = 4
#: Windows of an open-ended plan whose pools :func:`_fitting_pools` checks (the file's and the loader's next ones).
FIT_WINDOWS = 4


def _fitting_pools(make, resident: int, n_sizes: int, probe=None) -> Schedule:
    """``make(residency, slack)`` (a plan written, open), planned again with ``slack`` bytes less residency while
    a rank's (or node's) pools do not fit the memory it was planned for.

    A pool holds, per block size, the most blocks of that size resident at once (:mod:`solar.memory`); where
    blocks of several sizes peak at different steps (whole chunks of fields chunked differently), those peaks
    add up to more than the plan's own peak, which the planner keeps within the residency budget, and the loader
    would refuse the plan.  The bytes held back are stored (``pool_slack_bytes``), so the memory the loader
    checks is the user's budget still.  One block size: planned once, as before.  ``probe(residency, slack)``: a plan to
    measure instead of the file's (an open-ended plan's first :data:`FIT_WINDOWS` windows, which the loader
    plans with the file's residency; later windows are not checked here, the loader checks each one).  When no
    re-plan fits (the budget cannot hold a batch with less residency), a SpecError with the figures (the plan
    closed; :func:`_checked_output` removes its file).  ``n_sizes``: the blocks' pool size classes."""
    s = make(resident, 0)
    if n_sizes < 2:
        return s
    slack = 0
    try:
        for attempt in range(FIT_ATTEMPTS):
            over = _pools_over(s) if probe is None else _pools_over(probe(resident - slack, slack), close=True)
            if over <= 0:
                return s
            more = slack + over + (resident - slack) // 64  # a little more: the next plan's peaks move too
            t = None
            if attempt < FIT_ATTEMPTS - 1 and more < resident:
                try:
                    t = make(resident - more, more)
                except BufferTooSmall:
                    pass
            if t is None:
                break
            s.close()
            s, slack = t, more
    except BaseException:
        s.close()
        raise
    s.close()
    tried = (f"planning with {slack:,} bytes less residency did not close the gap" if slack else
             "a plan with less residency does not hold a local batch")
    raise SpecError(f"the budget cannot hold this plan's pools: blocks of {n_sizes} sizes (whole chunks of fields "
                    f"chunked differently) need slots for each size's own peak, {over:,} bytes per rank beyond the "
                    f"budget, and {tried}; raise the budget, or plan on parts of chunks (parts=True, solar plan "
                    f"without --no-parts, with a policy that keeps them)")


def _pools_over(sch: Schedule, close: bool = False) -> int:
    """Bytes per rank by which the rank (or node) of ``s`` furthest over the memory it was planned for is over it
    (<= 0: all within it): pools for the residency, batches and bookkeeping against the limit, with the loader's
    defaults (:mod:`solar.schedule.memory`; slots for reads in flight get what is left).  ``close``: close
    ``sch`` after (a probe)."""
    from ..errors import SolarError
    from .memory import schedule_memory, schedule_node_memory
    try:
        layout = sch.layout() if getattr(sch, "has_layout", False) else None
        if sch.nodes is not None:
            L = sch.nodes.ranks_per_node
            needs = [schedule_node_memory(sch, n, layout, keep=False) for n in range(sch.nodes.n_nodes)]
        else:
            L = 1
            needs = [schedule_memory(sch, r, layout, keep=False) for r in range(sch.world_size)]
    except SolarError:
        return 0
    finally:
        if close:
            sch.close()
    over = max(m.resident + m.batches + m.bookkeeping - m.limit for m in needs)
    return -(-over // L)


def _policy(name: str, node_pools: bool = False):
    """The policy ``name`` if it plans what the job runs: one buffer per rank, or with ``node_pools`` per node."""
    from ..scheduler.policies import NODE_POLICIES
    pol = get_policy(name)
    if pol.single_buffer:
        raise SpecError(f"policy {name!r} is a bound with one shared buffer, not a per-rank plan; "
                        f"plan with solar, nopfs, torch or solar2023")
    if pol.node_pools and not node_pools:
        raise SpecError(f"policy {name!r} plans one buffer per node: give ranks_per_node (solar plan "
                        f"--ranks-per-node L)")
    if node_pools and not pol.node_pools:
        raise SpecError(f"policy {name!r} plans one buffer per rank; with ranks_per_node plan with one of "
                        f"{', '.join(NODE_POLICIES)}")
    return pol


def _nodes(world_size: int, ranks_per_node, peer_cost):
    """``(NodeMap, PeerCost)`` of a node plan, or None (one buffer per rank)."""
    from ..scheduler.nodes import NodeMap, PeerCost
    if ranks_per_node is None:
        if peer_cost is not None:
            raise SpecError("peer_cost= needs ranks_per_node= (node-shared buffers)")
        return None
    if peer_cost is not None and not isinstance(peer_cost, PeerCost):
        raise SpecError(f"peer_cost must be a solar.scheduler.nodes.PeerCost, got {type(peer_cost).__name__}")
    return NodeMap(world_size, ranks_per_node), peer_cost if peer_cost is not None else PeerCost()


def _out_path(out) -> Optional[str]:
    if out is None:
        return None
    if not isinstance(out, (str, os.PathLike)):
        raise SpecError(f"out must be a file path or None, got {type(out).__name__} {out!r}")
    return os.fspath(out)


def _as_planned(layout, demand, old: dict, parts, policy, neighbours: bool = False):
    """``(layout, demand)`` of a resumed job whose checkpointed plan cut chunks into parts differently: the
    whole chunks when it planned them (planned before parts, or with ``parts=False``), the parts when it
    planned parts.  Where the old plan had parts, a plan on whole chunks cannot take its state: a SpecError
    saying so.  Any other mismatch is left to the fingerprint check (another dataset)."""
    from ..layout.parts import chunks_of, is_parts, split_chunks
    if is_parts(layout):
        whole = chunks_of(layout)
        if whole.fingerprint == old["fingerprint"]:
            return whole, Demand.from_layout(whole, runs=neighbours)
        return layout, demand
    cut = split_chunks(layout)
    if cut is not None and cut.fingerprint == old["fingerprint"]:
        raise SpecError(f"the checkpointed job was planned on parts of chunks (solar.layout.parts); "
                        f"{'parts=False' if parts is False else 'policy ' + repr(policy)} plans whole chunks, whose "
                        f"plan cannot take its state: resume with parts (a policy that keeps them: solar, ideal, "
                        f"solar-node, solar-peer)")
    return layout, demand


def _parts(parts, pol, name: str = "parts") -> bool:
    """Whether to plan on parts of chunks (``name`` "parts") or with runs of neighbours ("neighbours"): the
    argument ``parts`` (None: where policy ``pol`` keeps what a read brings beside the block it needs)."""
    from ..scheduler.policies import admits_parts
    if parts is None:
        return admits_parts(pol)
    if not isinstance(parts, bool):
        raise SpecError(f"{name} must be True, False or None, got {parts!r}")
    if parts and not admits_parts(pol):
        what = ("the parts of a chunk it reads (it would read a chunk for each part); plan it on whole chunks "
                "(parts=False)") if name == "parts" else \
            "the neighbours of a block it reads; plan it with neighbours=False"
        raise SpecError(f"{name}=True: policy {pol.name!r} does not keep {what}")
    return parts


def _inputs(data, out: Optional[str], progress: bool, split, fields, parts: bool = False,
            neighbours: bool = False):
    """``(data, demand, source)``: the layout (built from a path) or Demand to plan on, and the path planned
    from ("" for an object); the output checked first (never replace the data with a schedule).  With
    ``parts``, a layout is cut into parts of chunks where a chunk holds several samples' rows; with
    ``neighbours``, a layout's runs of neighbouring blocks are its extents (:mod:`solar.layout.runs`)."""
    if out is not None:
        check_folder(out)
    source = ""
    if isinstance(data, os.PathLike):
        data = os.fspath(data)
    if isinstance(data, str):
        from ..layout import load_layout
        source = data
        data = load_layout(data, progress=progress, split=split, fields=fields)
    elif split is not None or fields is not None:
        raise SpecError("split= and fields= select from a layout spec path; pass the path, not a layout")
    elif not isinstance(data, Demand) and not hasattr(data, "sample_ptr"):
        raise SpecError(f"data must be a layout spec path, a Layout or a Demand, got {type(data).__name__} {data!r}")
    if out is not None:  # before planning: never replace the data (or anything not a schedule) with a schedule
        check_target(out, getattr(data, "files", ()), getattr(data, "spec", None))
    if parts and not isinstance(data, Demand):
        from ..layout.parts import split_chunks
        data = split_chunks(data) or data
    # neighbours: a read block's neighbours that the plan uses soon are kept too (one request)
    demand = data if isinstance(data, Demand) else Demand.from_layout(data, runs=neighbours)
    return data, demand, source


def _write(w: ScheduleWriter, out: Optional[str], advance) -> Schedule:
    """Run ``advance()`` (planning, streaming epochs into ``w``) and complete the file; the open Schedule."""
    try:
        h5 = w.close(advance())
    except BaseException:  # errors, a full disk, Ctrl-C or SIGTERM: no temporary file is left behind
        w.abort()
        raise
    if out is None:
        return Schedule(h5, "<memory>")
    return Schedule.load(out)
