"""`solar bench` says what it is doing and writes its schedule to a cache folder (issue 26, items 9 and 11).

It was silent for minutes with --json (and whenever stderr was not a terminal), and left hidden
`.solar-bench-*.h5` schedules in the data folder, which may be read-only or shared.
"""
import json
import os
import subprocess
import sys

import pytest

from helpers import make_dataset

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


@pytest.mark.slow
def test_bench_json_progress_on_rank_0_stderr_and_schedule_in_the_cache(tmp_path):
    data = make_dataset(tmp_path, "ptychonn", "gzip", samples=24)
    before = sorted(os.listdir(data))
    cache = tmp_path / "cache"
    env = dict(os.environ, SOLAR_CACHE_DIR=str(cache))
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "solar", "bench", data, "--epochs", "2",
                        "-b", "2", "--num-workers", "0", "--baselines", "torch,memmap", "--json"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rep = json.loads(r.stdout)  # stdout is the JSON alone
    assert sorted(os.listdir(data)) == before  # nothing left next to the data
    written = [str(p) for p in (cache / "bench").iterdir()]
    assert written == [rep["schedule"]], (written, rep["schedule"])
    assert os.path.basename(rep["schedule"]).startswith(os.path.basename(data) + "-P2-b2-E2-")
    err = r.stderr
    assert "\r" not in err  # not a terminal: plain lines, no tqdm bars
    lines = err.splitlines()
    for want in (f"solar bench: schedule written to {rep['schedule']} in ",
                 "solar bench: measuring the limits: ",
                 "solar bench: solar epoch 0 (1 of 2): 24 samples in ",
                 "solar bench: solar epoch 1 (2 of 2): 24 samples in ",
                 "solar bench: baseline torch epoch 0 (1 of 2)", "solar bench: baseline torch epoch 1 (2 of 2)",
                 "solar bench: baseline torch: 0 DataLoader worker(s) per rank, 2 epoch(s), each stopped after 120 s",
                 "solar bench: baseline torch: ", "solar bench: baseline memmap: skipped (",
                 "solar bench: done in "):
        hits = [ln for ln in lines if ln.startswith(want) and (want != "solar bench: baseline torch: "
                                                               or ln.endswith(" samples/s per epoch"))]
        assert len(hits) == 1, (want, err[-3000:])  # once: rank 0 only
    assert all(ln.startswith("solar bench: ") for ln in lines), err[-3000:]


def test_no_progress_is_silent_and_schedule_wins(tmp_path, capsys):
    from solar.cli import main
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=8)
    out = tmp_path / "mine.h5"
    assert main(["bench", data, "--epochs", "1", "-b", "2", "--num-workers", "0", "--only", "solar", "--json",
                 "--no-progress", "--schedule", str(out)]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["schedule"] == str(out) and out.exists()
    assert cap.err == ""


def test_schedule_replaces_only_the_bench_s_own(tmp_path, capsys):
    """--schedule PATH: a second bench replaces the schedule the first wrote; a plan the user made there is refused
    in one line (exit 2) and left as it was."""
    import hashlib

    import solar
    from solar.cli import main
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=8)
    args = ["bench", data, "--epochs", "1", "-b", "2", "--num-workers", "0", "--only", "solar", "--json",
            "--no-progress", "--schedule"]
    out = tmp_path / "bench.h5"
    assert main(args + [str(out)]) == 0 and main(args + [str(out)]) == 0
    mine = tmp_path / "mine.h5"
    solar.plan(data, world_size=1, local_batch=4, epochs=3, buffer_fraction=0.5, out=str(mine)).close()
    before = hashlib.md5(mine.read_bytes()).hexdigest()
    capsys.readouterr()
    assert main(args + [str(mine)]) == 2
    err = capsys.readouterr().err
    assert "is a schedule that solar bench did not write" in err and "refusing to replace it" in err, err
    assert hashlib.md5(mine.read_bytes()).hexdigest() == before


def test_cache_folder_order(monkeypatch, tmp_path):
    from solar.bench.compare import cache_dir
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SOLAR_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == str(tmp_path / "home" / ".cache" / "solar")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == str(tmp_path / "xdg" / "solar")
    monkeypatch.setenv("SOLAR_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == str(tmp_path / "mine")


def test_schedule_name_differs_with_every_planning_input(tmp_path, monkeypatch):
    """Two runs share a cached schedule only when they would write the same plan: never another dataset's
    or another budget's (the old name had neither the data's identity nor the budget, seed or policy)."""
    from solar.bench.compare import bench_schedule_path
    from solar.layout import load_layout
    monkeypatch.setenv("SOLAR_CACHE_DIR", str(tmp_path / "c"))
    a = load_layout(make_dataset(tmp_path, "ptychonn", "contiguous", samples=8))
    b = load_layout(make_dataset(tmp_path, "ptychonn", "contiguous", seed=1, samples=8))
    job = dict(world_size=2, local_batch=2, epochs=3, buffer_fraction=0.5, buffer_per_rank=None, seed=0,
               policy=None, ranks_per_node=None, peer_cost=None)
    base = bench_schedule_path(a, "d", **job)
    assert base == bench_schedule_path(a, "d", **job) and base.startswith(str(tmp_path / "c" / "bench" / "d-P2-b2-E3-"))
    others = {bench_schedule_path(b, "d", **job)} | {bench_schedule_path(a, "d", **dict(job, **{k: v}))
                                                     for k, v in [("buffer_fraction", 0.25), ("seed", 1),
                                                                  ("buffer_per_rank", 10 ** 6)]}
    assert base not in others and len(others) == 4


def test_unwritable_cache_folder_is_one_line(tmp_path, monkeypatch, capsys):
    from solar.cli import main
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=8)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SOLAR_CACHE_DIR", str(tmp_path / "file" / "sub"))  # under a file: cannot be made
    assert main(["bench", data, "--epochs", "1", "-b", "2", "--num-workers", "0", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("solar bench: error: cannot create the bench's schedule folder "
                                               f"{tmp_path / 'file' / 'sub' / 'bench'}"), err
    assert "SOLAR_CACHE_DIR" in err[0] and "--schedule" in err[0]


def test_a_schedule_other_ranks_cannot_see_is_named(tmp_path):
    """Rank 0 writes the schedule; a cache folder only its node sees (node-local $XDG_CACHE_HOME) is named on
    every rank instead of failing later in the loader."""
    from mpi4py import MPI

    from solar.bench.compare import check_visible
    from solar.errors import SolarError
    there = tmp_path / "s.h5"
    there.write_bytes(b"")
    check_visible(MPI.COMM_SELF, str(there))
    with pytest.raises(SolarError, match=r"rank 0 cannot see the schedule .*/gone\.h5 that rank 0 wrote: give "
                                         r"--schedule \(or set \$SOLAR_CACHE_DIR\) in a folder every node sees"):
        check_visible(MPI.COMM_SELF, str(tmp_path / "gone.h5"))
