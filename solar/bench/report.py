"""``solar bench``'s report: the ratios computed from the measured figures (speed against the baselines, limit
ratios, storage against the file and the plan) and the human-readable table the CLI prints."""
from __future__ import annotations


def _ratios(report: dict):
    """``speedup`` (vs torch), ``speedup_vs_best``/``best_baseline`` (per epoch), ``limit_ratio``, ``storage_vs_disk``."""
    n = report["epochs"]
    ran = {k: v["epochs"] for k, v in report.get("baselines", {}).items() if "epochs" in v}
    if "solar" in report and "baseline" in report:
        report["speedup"] = [s["samples_per_s"] / b["samples_per_s"] if b["samples_per_s"] else None
                             for s, b in zip(report["solar"]["epochs"], report["baseline"]["epochs"])]
    if ran:
        report["best_baseline"] = [max(ran, key=lambda k: ran[k][e]["samples_per_s"]) for e in range(n)]
    if "solar" in report and ran:
        report["speedup_vs_best"] = []
        for e, best in enumerate(report["best_baseline"]):
            b = ran[best][e]["samples_per_s"]
            report["speedup_vs_best"].append(report["solar"]["epochs"][e]["samples_per_s"] / b if b else None)
    aus = {k: [ep.get("au") for ep in eps] for k, eps in
           ([("solar", report["solar"]["epochs"])] if "solar" in report else []) + list(ran.items())}
    if any(a is not None for v in aus.values() for a in v):
        report["au"] = aus  # per loader and epoch: device-only time / wall time
        report["gpu_wait_fraction"] = {k: [None if a is None else max(0.0, 1.0 - a) for a in v]
                                       for k, v in aus.items()}
        # the device-only steps run after the epoch; on a busy or shared host they can take longer than the epoch
        over = [[k, e] for k, v in aus.items() for e, a in enumerate(v) if a is not None and a > 1.0]
        if over:
            report["au_above_1"] = over
    if "solar" not in report:
        return
    after = report.get("disk_after") or report["disk"]
    seq = max(report["disk"]["bytes_per_s"], after["bytes_per_s"])
    rnd = max(report["disk"]["random_read_gbps"], after["random_read_gbps"]) * 1e9
    report["limit_random_read_gbps"], report["limit_sequential_read_gbps"] = rnd / 1e9, seq / 1e9
    dec = report.get("decode")
    if dec and report.get("decode_after"):
        dec = dict(dec, bytes_per_s=max(dec["bytes_per_s"], report["decode_after"]["bytes_per_s"]))
        report["limit_decode_gbps"] = dec["bytes_per_s"] / 1e9
    before = report["disk"]["random_read_gbps"]  # the probe right before epoch 0
    for ep in report["solar"]["epochs"]:
        ep["storage_vs_disk"] = ep["storage_bytes_per_s"] / seq if seq else None
        secs = ep["seconds"] - ep.get("startup_s", 0.0)  # the epoch's reads: epoch 0 without the buffer's start-up
        ep["limit_ratio"] = (ep["storage_bytes"] / rnd) / secs if rnd and secs > 0 else None
        # against the faster of the two probes next to this epoch (the one before it, the one after it): a
        # shared disk's speed drifts within minutes, and the run-wide probes may be far from an epoch
        after_ep = ep.get("disk_random_read_gbps_after")
        near = max(before, after_ep if after_ep is not None else after["random_read_gbps"]) * 1e9
        ep["limit_ratio_adjacent"] = (ep["storage_bytes"] / near) / secs if secs > 0 else None
        before = after_ep if after_ep is not None else before
        # against the same reads replayed bare right after the epoch (the disk's speed for this very pattern)
        rep = ep.get("replay_gbps")
        ep["limit_ratio_replay"] = (ep["storage_bytes"] / (rep * 1e9)) / secs if rep and secs > 0 else None
        # against the disk's best depth (16, 64, 256 reads in flight): what one rank could read with reads enough
        best = max(report["disk"].get("best_random_read_gbps") or 0.0, after.get("best_random_read_gbps") or 0.0)
        ep["limit_ratio_best_depth"] = (ep["storage_bytes"] / (best * 1e9)) / secs if best and secs > 0 else None
        if report.get("copy") and ep.get("assemble_gbps"):  # the hit path against copying with the same cores
            ep["assemble_vs_copy"] = ep["assemble_gbps"] / report["copy"]["gbps"]
        if dec and dec["bytes_per_s"] and secs > 0:
            # the slower of the two physical limits: the disk's random reads, the node's cores decoding
            cpu_s = ep["storage_bytes"] * dec["filtered_fraction"] / dec["bytes_per_s"]
            ep["decode_limit_ratio"] = cpu_s / secs
            ep["physical_limit_ratio"] = max(cpu_s, ep["storage_bytes"] / rnd if rnd else 0.0) / secs
    report["limit_ratio"] = [ep["limit_ratio"] for ep in report["solar"]["epochs"]]
    report["limit_ratio_adjacent"] = [ep["limit_ratio_adjacent"] for ep in report["solar"]["epochs"]]
    report["limit_ratio_replay"] = [ep["limit_ratio_replay"] for ep in report["solar"]["epochs"]]
    report["limit_ratio_best_depth"] = [ep["limit_ratio_best_depth"] for ep in report["solar"]["epochs"]]
    if dec:
        report["physical_limit_ratio"] = [ep.get("physical_limit_ratio") for ep in report["solar"]["epochs"]]


def format_report(r: dict) -> str:
    from ..layout.summary import human_bytes
    d = r["disk"]
    a = r.get("disk_after") or d
    dev = r.get("device")
    if dev and dev.get("model") == "conv":
        step = (f"training step: conv net ({dev['parameters']:,} parameters, {dev['amp']}, "
                f"{'channels_last' if dev['channels_last'] else 'contiguous'}) on {dev['device']}"
                + (f" ({dev['device_name']})" if dev.get("device_name") else "")
                + f", input field {dev['field']} as {'x'.join(map(str, dev['image']))}")
    elif dev:
        step = f"training step: none (batches copied to {dev['device']}" + \
            (f" ({dev['device_name']})" if dev.get("device_name") else "") + ")"
    else:
        step = f"step time {r['step_time_s']} s"
    lines = [f"solar bench {r['spec']}: {r['n_samples']:,} samples, {human_bytes(r['dataset_file_bytes'])} on disk; "
             f"{r['world_size']} ranks x local batch {r['local_batch']}, {r['epochs']} epochs, {step}",
             f"page cache before each epoch: {r['cache']}",
             f"memory: {r['memory_method']}",
             f"disk cold random read: {d['random_read_gbps']:.2f} GB/s before the loaders, "
             f"{a['random_read_gbps']:.2f} after ({human_bytes(d['block_bytes'])} blocks, "
             f"{d['random']['depth']} in flight; the ratios use the faster)",
             f"disk cold sequential read: {d['sequential_read_gbps']:.2f} GB/s before, "
             f"{a['sequential_read_gbps']:.2f} after "
             f"({human_bytes(d['sequential']['request_bytes'])} requests, {d['sequential']['depth']} in flight)"]
    dec = r.get("decode")
    if dec:
        da = r.get("decode_after") or dec
        lines.append(f"cpu decode of the filtered blocks: {dec['bytes_per_s'] / 1e9:.2f} GB/s stored before, "
                     f"{da['bytes_per_s'] / 1e9:.2f} after "
                     f"({dec['decoded_bytes_per_s'] / 1e9:.2f} GB/s decoded, {dec['threads']} threads, "
                     f"{dec['filtered_fraction']:.0%} of the stored bytes are filtered)")
    if "solar" in r:
        s = r["solar"]
        pools = f"pools {human_bytes(s['pool_bytes_per_rank'])}" if "pool_bytes_per_rank" in s else \
            f"pools {human_bytes(s['pool_bytes_per_node'])} per node, shared"
        io = s.get("reader_io", {})
        how = ", ".join(w for w, on in (("O_DIRECT", io.get("direct_io")), ("native AIO", io.get("aio_files")))
                        if on)
        lines.append(f"solar: reader {s['reader']}{f' ({how})' if how else ''}, buffer "
                     f"{human_bytes(s['buffer_budget_per_rank'])} per rank "
                     f"({pools}), RSS growth {human_bytes(s['rss_growth_bytes_max_rank'])} on the largest rank")
        if "ranks_per_node" in s:
            lines.append(f"solar node plan: {s['policy']}, {s['ranks_per_node']} ranks per node sharing one buffer; "
                         f"node memory {human_bytes(s['memory_need_per_node']['total'])} on the largest node")
        if "memory_need_per_rank" in s:
            from ..memory import MemoryNeed
            from ..schedule.summary import format_memory
            m = s["memory_need_per_rank"]
            need = MemoryNeed(**{k: m[k] for k in ("resident", "staging", "batches", "bookkeeping", "limit",
                                                   "prefetch")})
            lines.append(f"solar memory per rank: {format_memory(need)}; RSS growth "
                         f"{human_bytes(s['rss_growth_bytes_max_rank'])} against that + "
                         f"{human_bytes(m['fixed_overhead'])} fixed overhead")
    for kind, b in r.get("baselines", {}).items():
        if "skipped" in b:
            lines.append(f"baseline {kind}: skipped ({b['skipped']})")
        elif "failed" in b:
            lines.append(f"baseline {kind}: failed ({b['failed']})")
    ran = [k for k, b in r.get("baselines", {}).items() if "epochs" in b]
    lines.append("samples/s per epoch; speedup = solar / torch, vs best = solar / fastest baseline that epoch, "
                 "limit_ratio = (solar's storage bytes / random-read GB/s) / solar's epoch time"
                 + ("; with decode = the slower of that and the cpu decode limit" if dec else ""))
    lines.append("epoch  " + "".join(f"{k:>13}" for k in ran) + "     solar  speedup       vs best (name)"
                 "  limit_ratio" + (" with decode" if dec else "") + "  stall s  solar read")
    n = r["epochs"]
    for e in range(n):
        s = r.get("solar", {}).get("epochs", [{}] * n)[e]
        sp = r.get("speedup", [None] * n)[e]
        sb = r.get("speedup_vs_best", [None] * n)[e]
        best = r.get("best_baseline", [None] * n)[e]
        lr = s.get("limit_ratio")
        lines.append(
            f"{e:5d}  " + "".join(f"{r['baselines'][k]['samples_per_s'][e]:12.1f}"
                                  + ("*" if r['baselines'][k]['epochs'][e].get("partial") else " ") for k in ran)
            + f"  {s.get('samples_per_s', float('nan')):8.1f}  {'x%.2f' % sp if sp else '-':>7}"
            + f"  {('x%.2f (%s)' % (sb, best)) if sb else '-':>19}  {'%.2f' % lr if lr is not None else '-':>11}"
            + (f"  {'%.2f' % s['physical_limit_ratio'] if s.get('physical_limit_ratio') is not None else '-':>11}"
               if dec else "")
            + f"  {s.get('stall_max_s', float('nan')):7.2f}  {human_bytes(s.get('storage_bytes', 0)):>10}")
    if "solar" in r:
        eps = r["solar"]["epochs"]
        lines.append("solar storage bytes read / planned per epoch: "
                     + ", ".join(f"{ep['storage_vs_plan']:.3f}" if ep.get("storage_vs_plan") else "-" for ep in eps)
                     + " (blocks loaded, without the gaps reads coalesce: "
                     + ", ".join(f"{ep['blocks_vs_plan']:.3f}" if ep.get("blocks_vs_plan") else "-" for ep in eps)
                     + f"); {sum(ep.get('verified', 0) for ep in eps)} delivered samples equal to h5py's")
        if any(ep.get("book_wait_max_s") for ep in eps):
            lines.append("solar steps waiting to be booked (s per epoch, the slowest rank: their reads need slots the "
                         "steps before them still hold; node pools: also the other ranks): "
                         + ", ".join(f"{ep.get('book_wait_max_s', 0.0):.2f}" for ep in eps))
        if all(ep.get("disk_random_read_gbps_after") is not None for ep in eps):
            lines.append("disk cold random read after each solar epoch: "
                         + ", ".join(f"{ep['disk_random_read_gbps_after']:.2f}" for ep in eps)
                         + " GB/s; limit_ratio against the faster probe next to each epoch: "
                         + ", ".join(f"{ep['limit_ratio_adjacent']:.2f}" if ep.get("limit_ratio_adjacent") is not None
                                     else "-" for ep in eps))
        if any(ep.get("replay_gbps") for ep in eps):
            lines.append("solar's own reads of each epoch replayed bare right after it: "
                         + ", ".join(f"{ep['replay_gbps']:.2f}" if ep.get("replay_gbps") else "-" for ep in eps)
                         + " GB/s; limit_ratio against that: "
                         + ", ".join(f"{ep['limit_ratio_replay']:.2f}" if ep.get("limit_ratio_replay") is not None
                                     else "-" for ep in eps))
        d0 = r["disk"]
        if d0.get("random_by_depth"):
            lines.append("disk cold random read by reads in flight: "
                         + ", ".join(f"{k}: {v:.2f}" for k, v in d0["random_by_depth"].items())
                         + " GB/s; limit_ratio against the best depth: "
                         + ", ".join(f"{ep['limit_ratio_best_depth']:.2f}" if ep.get("limit_ratio_best_depth")
                                     is not None else "-" for ep in eps))
        if r.get("copy"):
            lines.append("hit path: batches assembled at "
                         + ", ".join(f"{ep['assemble_gbps']:.2f}" if ep.get("assemble_gbps") else "-" for ep in eps)
                         + f" GB/s per epoch (slowest rank; {r['solar'].get('cpus', '?')} cpu(s) each), memory copy "
                         f"with those cores {r['copy']['gbps']:.2f} GB/s; storage read per the OS: "
                         + ", ".join(human_bytes(ep.get("os_read_bytes", 0)) for ep in eps))
        if "ranks_per_node" in r["solar"] and r["world_size"] > r["solar"]["ranks_per_node"]:  # several nodes
            lines.append("solar bytes sent between nodes per epoch (as run / planned): "
                         + ", ".join(f"{human_bytes(ep['peer_bytes_sent'])} / {human_bytes(ep['predicted_peer_bytes'])}"
                                     for ep in eps))
    if r.get("au"):
        names = list(r["au"])
        lines.append("au = device-only time of the same steps on one batch already on the device / wall time "
                     "(mean over ranks); the device waits for the loader 1 - au of the time")
        lines.append("epoch  " + "".join(f"{k:>13}" for k in names))
        for e in range(n):
            lines.append(f"{e:5d}  " + "".join(f"{r['au'][k][e]:13.3f}" if r["au"][k][e] is not None else f"{'-':>13}"
                                                for k in names))
        if r.get("au_above_1"):
            lines.append("au above 1 (" + ", ".join(f"{k} epoch {e}" for k, e in r["au_above_1"]) + "): the same "
                         "steps on a resident batch, timed after the epoch, took longer than the epoch itself; the "
                         "machine's speed moved between the two (a busy or shared host): read it as about 1, the "
                         "device not waiting, within that noise")
    if any(ep.get("partial") for k in ran for ep in r["baselines"][k]["epochs"]):
        lines.append("* stopped after the baseline time limit: rate over the samples delivered until then")
    return "\n".join(lines)
