"""Human summary of a schedule (``solar plan`` and ``solar inspect plan.h5``)."""
from __future__ import annotations

from ..layout.summary import human_bytes
from ..memory import BATCHES_HANDED_OUT, MemoryNeed


def format_schedule(s: dict) -> str:
    c = s["config"]
    size = f", {human_bytes(s['file_bytes'])}" if s.get("file_bytes") else ""
    lines = [f"schedule {s['path']} (policy {s['policy']}, solar {s['solar_version']}{size})",
             f"  planned for: {s.get('source_abs') or s['source'] or 'a layout'}  fingerprint {s['fingerprint'][:16]}"
             + (f" (of its parts; the data's own: {s['data_fingerprint'][:16]})" if s.get("data_fingerprint") else
                " (of its parts)" if s.get("parts_of_chunks") else "")
             + "  "
             f"({s['n_samples']:,} samples, {s['n_blocks']:,} blocks"
             + (f": parts of {s['parts_of_chunks']:,} chunks" if s.get("parts_of_chunks") else "")
             + (f"; runs of neighbours read together, up to {human_bytes(s['neighbour_run_bytes'])}"
                if s.get("neighbour_run_bytes") else "") + ")",
             f"  job: world size {c['world_size']}, local batch {c['local_batch']}, {_epochs_text(s)}, "
             f"buffer {human_bytes(c['buffer_bytes'])} per rank"
             f"{' in GPU memory' if s.get('buffer_place') == 'device' else ''}"
             + (f" (+{human_bytes(s['pool_slack_bytes'])} held back: pools of several block sizes)"
                if s.get("pool_slack_bytes") else "")
             + (f", host staging {human_bytes(s['host_staging_bytes'])} per rank" if s.get("host_staging_bytes")
                else "") + f", seed {c['seed']}, "
             f"drop_last {'yes' if c['drop_last'] else 'no'}, epsilon {c['epsilon']}",
             _layout_line(s),
             *_resume_lines(s),
             *_node_lines(s),
             *(["  (hit rate: a neighbour read beside a block is a hit where it is used; what is read is in the next "
                "column)"] if s.get("neighbour_run_bytes") else []),
             "  epoch  sampler-epoch  hit rate  read from storage  local batch"
             + ("  sent between nodes" if s.get("nodes") else ""),
             ]
    first = s["resume"]["step"] // s["steps_per_epoch"] if s.get("resume") else 0  # epochs before: empty
    for e, (src, hr, st, lo, hi) in enumerate(zip(s["source_epochs"], s["hit_rate"], s["storage_bytes"],
                                                  s["min_local_batch"], s["max_local_batch"])):
        if e < first:
            continue
        lb = f"{lo}" if lo == hi else f"{lo}..{hi}"
        peer = f"  {human_bytes(s['peer_bytes'][e]):>18}" if s.get("nodes") else ""
        lines.append(f"  {e:5d}  {src:13d}  {hr:8.3f}  {human_bytes(st):>17}  {lb:>11}{peer}")
    tot = sum(s["storage_bytes"])
    who = "node" if s.get("nodes") else "rank"
    per_rank = [sum(col) for col in zip(*s[f"{who}_miss_bytes"])]
    imb = max(per_rank) / (sum(per_rank) / len(per_rank)) if sum(per_rank) else 1.0
    peer = f" (of it {s['steady_peer_hit_rate']:.3f} sent by other nodes)" if s.get("nodes") else ""
    lines.append(f"  predicted: steady-state hit rate {s['steady_hit_rate']:.3f}{peer}, {human_bytes(tot)} read from "
                 f"storage in all, busiest {who} reads x{imb:.2f} the mean")
    m = s.get("memory_per_rank")
    if m:
        lines.append(f"  memory per {'node' if m.get('per_node') else 'rank'}: {_memory_text(m)}")
    return "\n".join(lines)


def _node_lines(s: dict) -> list:
    """For a node plan: the nodes and the transfer cost model."""
    n = s.get("nodes")
    if not n:
        return []
    return [f"  nodes: {n['n_nodes']} x {n['ranks_per_node']} ranks sharing one buffer each "
            f"({human_bytes(n['ranks_per_node'] * s['config']['buffer_bytes'])}); transfers when faster than "
            f"storage at network {n['network_bytes_per_s'] / 1e9:.3g} GB/s, storage {n['storage_bytes_per_s'] / 1e9:.3g} GB/s"]


def _epochs_text(s: dict) -> str:
    """``"10 epochs x 5 steps"``, or for an open-ended schedule ``"open-ended, window 4 (...), 5 steps per epoch"``."""
    e, steps = s["config"]["epochs"], s["steps_per_epoch"]
    if not s.get("open_ended"):
        return f"{e} epoch{'s' * (e != 1)} x {steps} steps"
    return (f"open-ended, window {s['window']} (epochs 0..{e - 1} planned in the file, the loader plans the next "
            f"windows as training goes), {steps} steps per epoch")


def _resume_lines(s: dict) -> list:
    """For a job resumed on another world size: where it starts and what it resumes."""
    r = s.get("resume")
    if not r:
        return []
    old, S = r["from"]["config"], s["steps_per_epoch"]
    return [f"  resumes: a job checkpointed at step {r['from']['step']} on {old['world_size']} ranks x local batch "
            f"{old['local_batch']}; trains from step {r['step']} (epoch {r['step'] // S}, step {r['step'] % S})"]


def _layout_line(s: dict) -> str:
    """Whether the schedule stores the layout (and its size), i.e. whether the ranks read HDF5 metadata."""
    if s.get("layout_bytes"):
        return f"  layout: stored in the schedule ({human_bytes(s['layout_bytes'])}): the ranks read no HDF5 metadata"
    why = f"format version {s['format_version']}" if s.get("format_version", 3) < 3 else "planned without a dataset"
    return f"  layout: not stored ({why}): every rank builds it from the HDF5 files"


def format_memory(need) -> str:
    """One line: what a rank's memory is made of (a :class:`~solar.memory.MemoryNeed`; ``solar inspect``,
    ``solar bench``)."""
    hb = human_bytes
    return (f"{hb(need.total)} (pools {hb(need.resident)} resident + {hb(need.staging)} reads in flight, "
            f"{need.prefetch} + {BATCHES_HANDED_OUT} batches {hb(need.batches)}, bookkeeping {hb(need.bookkeeping)}; "
            f"planned for {hb(need.limit)})")


def _memory_text(m: dict) -> str:
    """The memory line of a schedule summary (:func:`format_memory`; a node plan's per node)."""
    if "error" in m:
        return f"unknown ({m['error']})"
    if m.get("per_node"):
        return (f"{human_bytes(m['total'])} (pool {human_bytes(m['resident'])}, staging {human_bytes(m['staging'])}, "
                f"reads in flight {human_bytes(m['ahead'])}, {m['ranks_per_node']} ranks' batches "
                f"{human_bytes(m['batches'])}, bookkeeping {human_bytes(m['bookkeeping'])}; planned for "
                f"{human_bytes(m['limit'])}" + (f", staging over it by {human_bytes(m['over_limit'])}"
                                                 if m["over_limit"] else "") + ")")
    return format_memory(MemoryNeed(**{k: m[k] for k in ("resident", "staging", "batches", "bookkeeping", "limit",
                                                          "prefetch")}))


def whole_data_note(fraction, schedule) -> str:
    """A line for ``--buffer-fraction`` >= 1 whose buffers still hold less than the data: the fraction is the
    memory, and the queued batches and reads in flight come out of it; says what fraction gives the buffers
    ``fraction`` x the data ('' when there is nothing to say: a fraction below 1, a node plan, no epoch after
    the first, or buffers that hold the data).  ``schedule``: an open :class:`~solar.schedule.Schedule`.
    Printed by ``solar plan`` and ``solar bench``."""
    if fraction is None or fraction < 1.0 or schedule.nodes is not None:
        return ""
    if schedule.epochs - schedule.start_step // schedule.steps_per_epoch < 2:
        return ""  # one epoch: it reads everything, whatever the buffers hold
    import math

    from ..scheduler.run import Demand
    from ..scheduler.simulate import dataset_bytes
    data = dataset_bytes(Demand(**schedule.demand()))  # what the fraction is of (solar.schedule.make.buffer_bytes)
    held = schedule.buffer_bytes * schedule.world_size  # the buffers' residency, all ranks
    steady = schedule.predicted()["steady_hit_rate"]
    if data <= 0 or held >= data or steady >= 1.0:
        return ""
    # the reserve (batches, reads in flight) does not grow with the budget: f' x data = f x data + reserve x P
    want = math.ceil((2.0 * fraction - held / data) * 100) / 100
    return (f"--buffer-fraction {fraction:g} is the memory per rank, batches and reads in flight included: the buffers "
            f"hold {held / data:.2f} x the data and the steady epochs hit {steady:.1%}; --buffer-fraction {want:g} "
            f"gives them {fraction:g} x the data (docs/runtime.md, 'The budget is the memory used')")
