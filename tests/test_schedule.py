"""Schedule files: content equals the planner's decisions, replay is valid, bytes are
reproducible, and every kind of bad file gives a clear error."""
import json
import os

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from torch.utils.data import DistributedSampler

import solar
from solar.schedule import Schedule, ScheduleError
from solar.scheduler import Demand, PlanConfig, run_policy, sampler_sizes

from helpers import make_dataset


def sampler_batches(n, P, b, seed, epoch, drop_last):
    """Per rank, the local batches DistributedSampler gives (torch itself)."""
    out = []
    for r in range(P):
        s = DistributedSampler(range(n), num_replicas=P, rank=r, shuffle=True, seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        idx = list(s)
        out.append([idx[k:k + b] for k in range(0, len(idx), b)])
    return out


def replay_file(sched: Schedule, r: int, demand: Demand):
    """Execute rank r's plan from the file alone: budget, residency, predicted hits."""
    rp = sched.rank(r)
    nb = demand.block_nbytes
    resident, used = set(), 0
    for g in range(sched.n_steps):
        st_ = rp.step(g)
        need = set()
        for smp in st_.samples:
            need.update(demand.sample_blocks[demand.sample_ptr[smp]:demand.sample_ptr[smp + 1]].tolist())
        assert len(need & resident) == st_.hits
        for blk in st_.evict.tolist():
            assert blk in resident and blk not in need
            resident.remove(blk)
            used -= nb[blk]
        for blk in st_.load.tolist():
            assert blk not in resident
            resident.add(blk)
            used += nb[blk]
        assert used <= sched.buffer_bytes
        assert need <= resident
        assert st_.misses == len(need) - st_.hits
        assert st_.miss_bytes == sum(int(nb[x]) for x in st_.load.tolist())


cases = st.fixed_dictionaries(dict(
    n=st.integers(1, 90), P=st.integers(1, 5), b=st.integers(1, 6), E=st.integers(1, 3), seed=st.integers(0, 9),
    drop_last=st.booleans(), frac=st.floats(0.0, 1.2), spb=st.integers(1, 3),
    policy=st.sampled_from(["solar", "nopfs", "torch", "solar2023"]), eps=st.sampled_from([0.0, 0.3])))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(cases)
def test_file_matches_plan_and_replays(tmp_path, c):
    n, P, b = c["n"], c["P"], c["b"]
    if c["drop_last"] and n < P:
        return
    d = Demand.synthetic(n, 50 * c["spb"], samples_per_block=c["spb"])
    need = 2 * b * int(d.block_nbytes[0]) * 2
    budget = max(need, int(c["frac"] * d.block_nbytes.sum() / P))
    path = str(tmp_path / f"s{np.random.randint(1 << 30)}.h5")
    s = solar.plan(d, world_size=P, local_batch=b, epochs=c["E"], buffer_per_rank=budget, seed=c["seed"],
                   drop_last=c["drop_last"], epsilon=c["eps"], policy=c["policy"], out=path)
    plans = []
    res = run_policy(d, PlanConfig(P, b, c["E"], budget, c["seed"], c["drop_last"], c["eps"]), c["policy"],
                     record=True, on_epoch=plans.append)
    assert s.world_size == P and s.epochs == c["E"] and s.steps_per_epoch == len(plans[0].bounds) - 1
    pred = s.predicted()
    assert pred["miss_bytes"] == res.miss_bytes and pred["storage_bytes"] == res.stored_bytes
    for e, ep in enumerate(plans):
        assert s.source_epoch(e) == ep.source_epoch
        ref = sampler_batches(n, P, b, c["seed"], ep.source_epoch, c["drop_last"])
        for k in range(s.steps_per_epoch):
            got = [s.batch(e, k, r) for r in range(P)]
            # the step's samples over all ranks are DistributedSampler's global batch k
            assert sorted(np.concatenate(got).tolist()) == sorted(x for r in range(P) for x in ref[r][k])
            if c["policy"] in ("torch", "nopfs"):  # no reassignment: each rank gets its sampler's batch
                assert all(sorted(got[r].tolist()) == sorted(ref[r][k]) for r in range(P))
    for r in range(P):
        replay_file(s, r, d)
    s.close()


def test_same_inputs_same_file_bytes(tmp_path):
    d = Demand.synthetic(500, 100, samples_per_block=2)
    paths = [str(tmp_path / f"{i}.h5") for i in range(2)]
    for p in paths:
        solar.plan(d, world_size=3, local_batch=7, epochs=3, buffer_fraction=0.4, seed=5, out=p).close()
    a, b = (open(p, "rb").read() for p in paths)
    assert a == b
    solar.plan(d, world_size=3, local_batch=7, epochs=3, buffer_fraction=0.4, seed=6, out=paths[1]).close()
    assert open(paths[1], "rb").read() != a


@pytest.fixture
def planned(tmp_path):
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=40)
    path = str(tmp_path / "plan.h5")
    solar.plan(data, world_size=2, local_batch=4, epochs=2, buffer_fraction=0.5, out=path).close()
    return data, path


def test_fit_checks(planned, tmp_path):
    data, path = planned
    layout = solar.load_layout(data)
    Schedule.load(path, layout=layout, world_size=2).close()
    with pytest.raises(ScheduleError, match="planned for world size 2, the job has 4 ranks"):
        Schedule.load(path, world_size=4)
    other = solar.load_layout(make_dataset(tmp_path, "ptychonn", "contiguous", seed=1, samples=40))
    with pytest.raises(ScheduleError, match="planned for another dataset"):
        Schedule.load(path, layout=other)
    with Schedule.load(path) as s, pytest.raises(ScheduleError, match="rank 2 out of range"):
        s.rank(2)


def test_damaged_files(planned, tmp_path):
    _, path = planned
    raw = open(path, "rb").read()
    with pytest.raises(ScheduleError, match="no schedule file"):
        Schedule.load(str(tmp_path / "nope.h5"))
    cut = str(tmp_path / "cut.h5")
    open(cut, "wb").write(raw[: len(raw) // 2])
    with pytest.raises(ScheduleError, match="damaged or truncated"):
        Schedule.load(cut)
    # flip bytes inside rank 1's sample list: the checksum catches it when that rank reads its slice
    with h5py.File(path, "r") as f:
        off = f["ranks/1/samples"].id.get_offset()
        if off is None:  # chunked: first chunk's offset
            off = f["ranks/1/samples"].id.get_chunk_info(0).byte_offset
    bad = bytearray(raw)
    bad[off:off + 8] = bytes(8 * [0x7F])
    flipped = str(tmp_path / "flipped.h5")
    open(flipped, "wb").write(bytes(bad))
    s = Schedule.load(flipped)
    s.rank(0)
    with pytest.raises(ScheduleError, match="checksum mismatch in ranks/1/samples"):
        s.rank(1)
    s.close()
    inc = str(tmp_path / "incomplete.h5")
    open(inc, "wb").write(raw)
    with h5py.File(inc, "r+") as f:
        f.attrs["complete"] = 0
    with pytest.raises(ScheduleError, match="incomplete schedule"):
        Schedule.load(inc)
    with h5py.File(inc, "r+") as f:
        f.attrs["complete"] = 1
        f.attrs["config"] = f.attrs["config"].decode().replace('"world_size": 2', '"world_size": 3')
    with pytest.raises(ScheduleError, match="header checksum mismatch"):
        Schedule.load(inc)
    with pytest.raises(ScheduleError, match="not a solar schedule file"):
        Schedule.load(os.path.join(planned[0], "ptychonn.h5"))


def test_buffer_smaller_than_one_batch_and_bound_policy(tmp_path):
    d = Demand.synthetic(64, 1000)
    with pytest.raises(solar.SolarError, match="must hold at least one local batch"):
        solar.plan(d, world_size=2, local_batch=8, epochs=1, buffer_per_rank=5000, out=str(tmp_path / "x.h5"))
    assert not os.listdir(tmp_path), "a failed plan leaves no file behind"
    with pytest.raises(solar.SpecError, match="policy 'ideal' is a bound"):
        solar.plan(d, world_size=2, local_batch=8, epochs=1, buffer_fraction=0.5, policy="ideal")


def test_plan_and_inspect_cli(planned, tmp_path, capsys):
    from solar.cli import main
    data, _ = planned
    out = str(tmp_path / "cli.h5")
    args = ["plan", data, "-P", "2", "-b", "4", "--epochs", "3", "--buffer-per-rank", "20kB", "-o", out]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "world size 2, local batch 4, 3 epochs x 5 steps" in text and "steady-state hit rate" in text
    assert main(["inspect", out]) == 0 and "policy solar" in capsys.readouterr().out
    assert main(["inspect", out, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["buffer_bytes"] == 20000
    assert main(args[:-4] + ["--buffer-per-rank", "1kB", "-o", out]) == 2
    assert capsys.readouterr().err.startswith("solar plan: error: buffer of 1,000 bytes")


@pytest.mark.mpi
def test_each_rank_reads_its_slice(comm, shared_tmp):
    """Under mpiexec every rank opens the file and reads only its own group; together the
    slices form DistributedSampler's global batches."""
    path = os.path.join(shared_tmp, "plan.h5")
    P = max(2, comm.size)
    if comm.rank == 0:
        solar.plan(Demand.synthetic(200, 10), world_size=P, local_batch=5, epochs=2, buffer_fraction=0.3,
                   seed=3, out=path).close()
    comm.Barrier()
    with Schedule.load(path, world_size=P) as s:
        mine = [s.batch(e, k, r) for r in range(comm.rank, P, comm.size) for e in range(2)
                for k in range(s.steps_per_epoch)]
        with h5py.File(path, "r", locking=False) as f:
            assert f["ranks"][str(comm.rank)]["samples"].shape[0] == sum(len(x) for x in mine[:2 * s.steps_per_epoch])
    total = comm.allreduce(sum(len(x) for x in mine))
    assert total == 2 * sampler_sizes(200, P, False)[1]  # two epochs of the padded global index


def test_source_is_found_from_any_cwd_and_after_moving(tmp_path, monkeypatch):
    """The dataset path is stored relative to the schedule (and absolute): opening the plan from
    another directory works, moving plan and data together works, moving the plan alone falls
    back to the absolute path, and when neither exists the error names both."""
    from solar.loader import SolarLoader
    proj = tmp_path / "proj"
    data = make_dataset(proj / "data", "ptychonn", "contiguous", samples=12)
    (proj / "plans").mkdir()
    monkeypatch.chdir(proj)
    rel_data = os.path.relpath(data, proj)
    solar.plan(rel_data, world_size=2, local_batch=3, epochs=1, buffer_fraction=0.5, out="plans/p.h5").close()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    plan = str(proj / "plans" / "p.h5")
    with Schedule.load(plan) as s:
        assert os.path.samefile(s.source, data)
        assert s.summary()["source"] == os.path.join("..", rel_data)
    loader = SolarLoader(plan, rank=1, threads=1)
    assert len(next(iter(loader))["index"]) == 3
    loader.close()
    alone = str(elsewhere / "p.h5")
    open(alone, "wb").write(open(plan, "rb").read())
    with Schedule.load(alone) as s:  # relative path broken, absolute fallback
        assert s.source == os.path.abspath(os.path.join(str(proj), rel_data))
    moved = tmp_path / "moved"
    os.rename(proj, moved)
    with Schedule.load(str(moved / "plans" / "p.h5")) as s:  # plan and data moved together
        assert os.path.samefile(s.source, str(moved / rel_data))
    with Schedule.load(alone) as s, pytest.raises(ScheduleError, match="dataset it was planned from is neither at"):
        s.source


def test_version_1_files_are_read(planned, tmp_path, monkeypatch):
    """A version-1 file (source relative to where solar plan ran, no source_abs) still opens and
    resolves its dataset from that directory."""
    from solar.schedule.format import header_digest
    data, path = planned
    with h5py.File(path, "r+") as f:
        del f.attrs["source_abs"]
        f.attrs["version"] = 1
        f.attrs["source"] = os.path.join(os.path.basename(os.path.dirname(data)), os.path.basename(data))
        f.attrs["header_sha256"] = header_digest(f.attrs, 1)
    monkeypatch.chdir(os.path.dirname(os.path.dirname(data)))
    with Schedule.load(path) as s:
        assert s.version == 1 and os.path.samefile(s.source, data)
        s.rank(1)


def test_plan_arguments_of_the_wrong_type_are_named(tmp_path):
    """solar.plan took drop_last="no" as True (bool("no")), and gave AttributeError / TypeError tracebacks for a
    pathlib.Path, None or an int as data, an int as out and a string epsilon; a path-like is a path."""
    import pathlib
    data = make_dataset(tmp_path, "ptychonn", samples=16, size=4)
    kw = dict(world_size=2, local_batch=2, epochs=1, buffer_fraction=0.5)
    assert solar.plan(pathlib.Path(data), out=pathlib.Path(tmp_path / "p.h5"), **kw).n_steps == 4
    for bad, msg in ((dict(drop_last="no"), "drop_last must be True or False, got 'no'"),
                     (dict(epsilon="0.1"), r"epsilon must be in \[0, 1\), got '0.1'"),
                     (dict(out=123), "out must be a file path or None, got int 123")):
        with pytest.raises(solar.SpecError, match=msg):
            solar.plan(data, **kw, **bad)
    for bad in (None, 123):
        with pytest.raises(solar.SpecError, match="data must be a layout spec path, a Layout or a Demand"):
            solar.plan(bad, **kw)
    with pytest.raises(solar.SpecError, match="drop_last must be True or False"):
        PlanConfig(2, 2, 1, 100, drop_last="yes")
    with pytest.raises(solar.SpecError, match="beyond the 1,073,741,824 samples"):
        Demand.synthetic(10**11, 1000)
