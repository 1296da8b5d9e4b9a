"""`solar bench` end to end on a tiny file (figures are not checked: speed lives in benchmarks/)."""
import json
import os

import pytest
from helpers import make_dataset


def reads_s(ep: dict) -> float:
    """An epoch's time without the buffer's start-up (epoch 0's ``startup_s``): what the limit ratios divide by."""
    return ep["seconds"] - ep["startup_s"]


def _check_keys(rep: dict, n_epochs: int):
    """The report's keys are present and sane (values are not speeds to check)."""
    assert len(rep["speedup"]) == n_epochs and all(x > 0 for x in rep["speedup"])
    ran = {k for k, b in rep["baselines"].items() if "epochs" in b}
    assert "torch" in ran and rep["baseline"] == rep["baselines"]["torch"]
    assert len(rep["best_baseline"]) == n_epochs and set(rep["best_baseline"]) <= ran
    for e in range(n_epochs):
        best = max(rep["baselines"][k]["samples_per_s"][e] for k in ran)
        assert rep["baselines"][rep["best_baseline"][e]]["samples_per_s"][e] == best
        assert rep["speedup_vs_best"][e] == pytest.approx(rep["solar"]["epochs"][e]["samples_per_s"] / best)
        assert rep["speedup_vs_best"][e] <= rep["speedup"][e] + 1e-12
    for k in ran:
        b = rep["baselines"][k]
        assert b["samples_per_s"] == [e["samples_per_s"] for e in b["epochs"]] and len(b["epochs"]) == n_epochs
    d = rep["disk"]
    assert d["random_read_gbps"] > 0 and d["sequential_read_gbps"] > 0 and d["block_bytes"] > 0
    assert d["random"]["depth"] == 16 and d["bytes_per_s"] == d["sequential"]["bytes_per_s"]
    a = rep["disk_after"]  # measured again after the loaders; the ratios use the faster of the two
    assert a["random_read_gbps"] > 0 and a["block_bytes"] == d["block_bytes"]
    rnd = max(d["random_read_gbps"], a["random_read_gbps"]) * 1e9
    assert rep["limit_random_read_gbps"] * 1e9 == pytest.approx(rnd)
    for ep in rep["solar"]["epochs"]:  # the time the next step's reads waited for free slots: within the epoch
        assert 0.0 <= ep["book_wait_max_s"] <= ep["seconds"]
    for ep, lr in zip(rep["solar"]["epochs"], rep["limit_ratio"]):
        assert lr == pytest.approx(ep["storage_bytes"] / rnd / reads_s(ep)) and ep["limit_ratio"] == lr
        assert ep["plan_violations"] == 0 and ep["page_cache_left"] is not None
    before = d["random_read_gbps"]  # and against the probes next to each epoch: the one before, the one after
    for ep, la in zip(rep["solar"]["epochs"], rep["limit_ratio_adjacent"]):
        after = ep["disk_random_read_gbps_after"]
        assert after > 0 and la == pytest.approx(ep["storage_bytes"] / (max(before, after) * 1e9) / reads_s(ep))
        before = after
    if rep["solar"]["reader"] == "pread":  # each epoch's own reads, replayed bare after it (all: a tiny file)
        for ep, lr in zip(rep["solar"]["epochs"], rep["limit_ratio_replay"]):
            assert ep["replay_bytes"] == ep["storage_bytes"] and (ep["replay_reads"] > 0) == (ep["storage_bytes"] > 0)
            if ep["storage_bytes"]:
                assert ep["replay_gbps"] > 0
                assert lr == pytest.approx(ep["storage_bytes"] / (ep["replay_gbps"] * 1e9) / reads_s(ep))
            else:  # nothing read (all resident): nothing to replay
                assert ep["replay_gbps"] is None and lr is None
    assert rep["solar"]["warmup_s"] > 0  # the kernels' first calls made before any timer
    eps = rep["solar"]["epochs"]  # start-up timed apart (SolarLoader.prepare), counted in epoch 0's samples/s
    assert eps[0]["startup_s"] == rep["solar"]["startup_s"] > 0 and all(ep["startup_s"] == 0 for ep in eps[1:])
    assert all(0 < reads_s(ep) <= ep["seconds"] for ep in eps)
    assert "memory_limit_bytes" in rep and rep["memory_method"]
    dec = rep["decode"]  # None: no filtered block; else the cpu limit and the slower-of-two ratio per epoch
    if dec is not None:
        assert dec["bytes_per_s"] > 0 and 0 < dec["filtered_fraction"] <= 1
        dec = dict(dec, bytes_per_s=max(dec["bytes_per_s"], rep["decode_after"]["bytes_per_s"]))
        assert rep["limit_decode_gbps"] * 1e9 == pytest.approx(dec["bytes_per_s"])
        for ep, pr in zip(rep["solar"]["epochs"], rep["physical_limit_ratio"]):
            cpu = ep["storage_bytes"] * dec["filtered_fraction"] / dec["bytes_per_s"] / reads_s(ep)
            assert ep["decode_limit_ratio"] == pytest.approx(cpu) and pr == pytest.approx(max(cpu, ep["limit_ratio"]))
    json.dumps(rep)


@pytest.mark.mpi
def test_bench_report(comm, shared_tmp):
    from conftest import on_root

    from solar.bench.compare import bench
    from solar.bench.report import format_report
    data = on_root(comm, lambda: make_dataset(shared_tmp, "ptychonn", "gzip", samples=24))
    rep = bench(data, comm=comm, epochs=2, local_batch=2, buffer_fraction=1.0, num_workers=0, cold=True)
    _check_keys(rep, 2)
    assert "chunked and filtered" in rep["baselines"]["memmap"]["skipped"]
    assert set(rep["baselines"]) == {"torch", "memmap", "h5py-cache", "batched"}
    n = 24 + (-24) % comm.size
    for ep in rep["solar"]["epochs"]:
        assert ep["global_samples"] == n
    for k in ("torch", "h5py-cache", "batched"):
        assert all(ep["global_samples"] == n for ep in rep["baselines"][k]["epochs"])
    assert rep["solar"]["epochs"][0]["storage_bytes"] > 0
    assert "posix_fadvise" in rep["cache"] and rep["memory_limit_bytes"] is None
    text = format_report(rep)
    for word in ["speedup", "vs best", "limit_ratio", "disk cold sequential read", "disk cold random read",
                 "baseline memmap: skipped", "h5py-cache", "disk cold random read after each solar epoch"] + (
                 ["replayed bare right after it"] if rep["solar"]["reader"] == "pread" else []):
        assert word in text


def test_bench_cli_json(tmp_path, capsys):
    from solar.cli import main
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=16)
    assert main(["bench", data, "--epochs", "2", "-b", "2", "--num-workers", "0", "--json", "--cold"]) == 0
    rep = json.loads(capsys.readouterr().out)
    _check_keys(rep, 2)
    assert rep["solar"]["reader"] == "pread" and "contiguous" in rep["baselines"]["h5py-cache"]["skipped"]
    assert {"memmap", "batched"} <= set(rep["best_baseline"]) | {k for k, b in rep["baselines"].items() if "epochs" in b}


@pytest.mark.mpi
def test_bench_equal_memory(comm, shared_tmp):
    from conftest import on_root

    from solar.bench import memlimit
    from solar.bench.compare import bench
    from solar.bench.report import format_report
    from solar.errors import SolarError
    try:
        where = os.path.dirname(memlimit.locate("probe")[0])
    except SolarError as exc:
        pytest.skip(str(exc))
    before = sorted(os.listdir(where))
    data = on_root(comm, lambda: make_dataset(shared_tmp, "ptychonn", "contiguous", samples=16))
    rep = bench(data, comm=comm, epochs=1, local_batch=2, num_workers=0, cold=True, equal_memory=True,
                memory_allowance=64 << 20, baselines=("torch", "memmap"))
    budget = rep["solar"]["memory_need_per_rank"]["limit"]  # the residency budget + batches + bookkeeping
    assert rep["solar"]["buffer_budget_per_rank"] < budget
    assert rep["memory_allowance_bytes"] == 64 << 20
    # the memory for data: the node's solar buffers + the allowance (one node here)
    assert rep["memory_limit_bytes"] == comm.size * budget + (64 << 20)
    assert "memory.limit_in_bytes" in rep["memory_method"] or "memory.max" in rep["memory_method"]
    assert set(rep["baselines"]) == {"torch", "memmap"}
    page = os.sysconf("SC_PAGE_SIZE")
    for b in (rep["solar"], *rep["baselines"].values()):
        # each loader limited to its own processes as they started + the memory for data
        assert 0 <= b["memory_base_bytes"]
        assert b["memory_cgroup_limit_bytes"] - b["memory_base_bytes"] - rep["memory_limit_bytes"] in range(page)
        assert b["memory_peak_bytes"] is None or 0 < b["memory_peak_bytes"] <= b["memory_cgroup_limit_bytes"]
    assert "memory: cgroup" in format_report(rep)
    comm.Barrier()
    # the cgroup is gone (tests running beside this one, pytest-xdist, may have cgroups of their own meanwhile)
    after = sorted(os.listdir(where))
    others = [n for n in before if not n.startswith("solar-bench-")]
    assert [n for n in after if not n.startswith("solar-bench-")] == others
    assert f"solar-bench-{os.getpid()}" not in after


def test_bench_equal_memory_refuses_clearly(tmp_path, capsys, monkeypatch):
    from solar.bench import memlimit
    from solar.cli import main
    monkeypatch.setattr(memlimit, "MOUNTINFO", str(tmp_path / "no-mountinfo"))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=8)
    assert main(["bench", data, "--epochs", "1", "-b", "2", "--num-workers", "0", "--equal-memory",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("solar bench: error: --equal-memory: no memory cgroup")
    with pytest.raises(SystemExit) as ex:
        main(["bench", data, "--baselines", "torch,nope"])
    assert ex.value.code == 2 and "unknown baseline 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("equal_memory", [False, True])
def test_a_baseline_whose_workers_die_is_reported_not_fatal(tmp_path, monkeypatch, equal_memory):
    """A baseline's DataLoader worker killed mid-run (as the OOM killer does under --equal-memory):
    the bench records it as failed, names it in the report, and runs the other loaders (under
    --equal-memory each of them with its own limit, lifted again after the failed one)."""
    from solar.bench import baseline, memlimit
    from solar.bench.compare import bench
    from solar.bench.report import format_report
    from solar.errors import SolarError
    if equal_memory:
        try:
            memlimit.locate("probe")
        except SolarError as exc:
            pytest.skip(str(exc))
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=16)
    real, calls = baseline._epoch, []

    def dying_first_epoch(loader, *a, **kw):
        calls.append(1)
        if len(calls) == 1:  # the first baseline (torch), its first epoch
            raise RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly")
        return real(loader, *a, **kw)
    monkeypatch.setattr(baseline, "_epoch", dying_first_epoch)
    from mpi4py import MPI
    rep = bench(data, comm=MPI.COMM_SELF, epochs=2, local_batch=2, num_workers=0, cold=True,
                baselines=("torch", "memmap", "batched"), equal_memory=equal_memory)
    assert "pid(s) 4242" in rep["baselines"]["torch"]["failed"] and "epoch 0" in rep["baselines"]["torch"]["failed"]
    if equal_memory:  # the failed baseline had its limit; the next ones theirs
        for k in ("torch", "memmap", "batched"):
            b = rep["baselines"][k]
            assert b["memory_cgroup_limit_bytes"] - b["memory_base_bytes"] >= rep["memory_limit_bytes"]
    assert len(rep["baselines"]["memmap"]["samples_per_s"]) == 2 and len(rep["baselines"]["batched"]["epochs"]) == 2
    assert "speedup" not in rep and set(rep["best_baseline"]) <= {"memmap", "batched"}
    assert len(rep["speedup_vs_best"]) == 2
    text = format_report(rep)
    assert "baseline torch: failed (torch failed in epoch 0: rank 0: DataLoader worker (pid(s) 4242)" in text


@pytest.mark.mpi
def test_bench_step_sync_runs_solar_alone(comm, shared_tmp):
    """--step-sync: the ranks wait for each other after every step (as DDP's all-reduce); solar alone, and
    asked with baselines a clear error on every rank before any work."""
    from conftest import on_root

    from solar.bench.compare import bench
    from solar.errors import SolarError
    data = on_root(comm, lambda: make_dataset(shared_tmp, "ptychonn", "chunked", samples=24))
    with pytest.raises(SolarError, match="--step-sync runs solar alone"):
        bench(data, comm=comm, epochs=1, local_batch=2, cold=False, step_sync=True)
    with pytest.raises(SolarError, match="step_sync must be True or False"):
        bench(data, comm=comm, epochs=1, local_batch=2, cold=False, step_sync=1, loaders=("solar",))
    rep = bench(data, comm=comm, epochs=2, local_batch=2, cold=False, step_sync=True, loaders=("solar",))
    assert rep["step_sync"] is True and "baselines" not in rep
    assert [e["global_samples"] for e in rep["solar"]["epochs"]] == [24, 24]
    assert all(e["verified"] > 0 for e in rep["solar"]["epochs"])
