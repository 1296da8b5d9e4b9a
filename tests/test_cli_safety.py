"""The CLI never loses data, leaves half-written files, or shows a traceback (issue 9).

Full disks and read-only folders are real: a small tmpfs, mounted as root (skipped
otherwise).  Commands whose exit matters (segfault, signals, closed pipes) run in a
subprocess; the rest call ``solar.cli.main`` in this process.
"""
import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest

import solar
from solar.cli import main
from solar.errors import SpecError
from solar.layout.spec import LayoutSpec
from solar.scheduler.config import PlanConfig, parse_bytes
from helpers import make_dataset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = ["-P", "2", "-b", "2", "--epochs", "2"]


# ------------------------------------------------------------------ helpers
def run_solar(*args, env=None, cwd=None, timeout=120):
    """``python -m solar ARGS`` in a subprocess; returns the CompletedProcess (text)."""
    full_env = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
    return subprocess.run([sys.executable, "-m", "solar", *args], capture_output=True, text=True, env=full_env,
                          cwd=cwd, timeout=timeout)


def assert_one_error(err: str, cmd: str, *needles: str):
    """stderr has exactly one ``solar CMD: error:`` line, containing every needle, and no traceback."""
    assert "Traceback" not in err and "Exception ignored" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith(f"solar {cmd}: error:")]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def run_main(capsys, *args) -> tuple:
    """``solar.cli.main(args)`` in this process: (exit status, stderr); argparse errors count as status 2."""
    try:
        rc = main(list(args))
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@contextlib.contextmanager
def tmpfs(path, size="1m", read_only=False):
    """A tmpfs of ``size`` mounted at ``path`` (root only; the test is skipped otherwise)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs (full disk / read-only folder) needs root")
    os.makedirs(path, exist_ok=True)
    opts = f"size={size}" + (",ro" if read_only else "")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A small ptychonn dataset (folder with solar-layout.json and ptychonn.h5)."""
    return make_dataset(tmp_path_factory.mktemp("safety"), "ptychonn", samples=40, size=4)


# ------------------------------------------------------ plan: lost data
def test_plan_refuses_to_overwrite_a_data_file_named_like_the_default_output(tmp_path, data, capsys, monkeypatch):
    shutil.copy(os.path.join(data, "ptychonn.h5"), tmp_path / "plan.h5")
    before = digest(tmp_path / "plan.h5")
    monkeypatch.chdir(tmp_path)
    rc, err = run_main(capsys, "plan", "plan.h5", *JOB, "--buffer-fraction", "0.5")  # default -o plan.h5
    assert rc == 2
    assert_one_error(err, "plan", "plan.h5", "input data file")
    assert digest(tmp_path / "plan.h5") == before


@pytest.mark.parametrize("link", ["same", "symlink", "hardlink"])
def test_plan_refuses_an_output_that_is_an_input_file(tmp_path, data, capsys, link):
    src = tmp_path / "x.h5"
    shutil.copy(os.path.join(data, "ptychonn.h5"), src)
    out = {"same": src, "symlink": tmp_path / "sym.h5", "hardlink": tmp_path / "hard.h5"}[link]
    if link == "symlink":
        os.symlink(src, out)
    elif link == "hardlink":
        os.link(src, out)
    before = digest(src)
    rc, err = run_main(capsys, "plan", str(src), *JOB, "--buffer-fraction", "0.5", "-o", str(out))
    assert rc == 2
    assert_one_error(err, "plan", "input data file")
    assert digest(src) == before and not list(tmp_path.glob("*.tmp-*"))


@pytest.mark.parametrize("content", ["text", "hdf5"])
def test_plan_refuses_to_replace_a_file_that_is_not_a_schedule(tmp_path, data, capsys, content):
    out = tmp_path / "notes.h5"
    if content == "text":
        out.write_text("my notes\n")
    else:
        with h5py.File(out, "w") as f:
            f["x"] = np.arange(3)
    before = digest(out)
    rc, err = run_main(capsys, "plan", data, *JOB, "--buffer-fraction", "0.5", "-o", str(out))
    assert rc == 2
    assert_one_error(err, "plan", "not a solar schedule")
    assert digest(out) == before


def test_plan_overwrites_an_existing_schedule(tmp_path, data, capsys):
    out = str(tmp_path / "plan.h5")
    budgets = []
    for per_rank in ("4KiB", "2KiB"):
        assert run_main(capsys, "plan", data, *JOB, "--buffer-per-rank", per_rank, "-o", out)[0] == 0
        with solar.Schedule.load(out) as s:
            budgets.append(s.buffer_bytes)
    assert budgets == [4096, 2048] and os.listdir(tmp_path) == ["plan.h5"]


def test_plan_refuses_an_output_that_a_spec_glob_would_read_as_data(tmp_path, data, capsys):
    folder = tmp_path / "globbed"
    shutil.copytree(data, folder)
    LayoutSpec("rows", ("*.h5",), ("X_train", "Y_I_train", "Y_phi_train"), root=str(folder)).save(str(folder))
    rc, err = run_main(capsys, "plan", str(folder), *JOB, "--buffer-fraction", "0.5", "-o", str(folder / "plan.h5"))
    assert rc == 2
    assert_one_error(err, "plan", "'*.h5'", "would be read as data")
    assert sorted(os.listdir(folder)) == ["ptychonn.h5", "solar-layout.json"]


def test_output_glob_match_follows_glob_rules(tmp_path):
    from solar.schedule.output import _glob_match
    assert _glob_match("/d/*.h5", "/d/plan.h5")
    assert not _glob_match("/d/*.h5", "/d/sub/plan.h5")  # * does not cross /
    assert not _glob_match("/d/*.h5", "/d/.plan.h5")  # nor match a leading dot
    assert _glob_match("/d/*/train/*.hdf5", "/d/x/train/p.hdf5")
    assert not _glob_match("/d/univ_*.hdf5", "/d/plan.hdf5")


# ------------------------------------------------- plan: bad output paths
def test_plan_refuses_a_directory_or_a_missing_folder(tmp_path, data, capsys):
    rc, err = run_main(capsys, "plan", data, *JOB, "--buffer-fraction", "0.5", "-o", str(tmp_path))
    assert rc == 2
    assert_one_error(err, "plan", "is a directory")
    rc, err = run_main(capsys, "plan", data, *JOB, "--buffer-fraction", "0.5", "-o", str(tmp_path / "no" / "p.h5"))
    assert rc == 2
    assert_one_error(err, "plan", "does not exist")
    assert os.listdir(tmp_path) == []


def test_plan_into_a_read_only_folder(tmp_path, data, capsys):
    with tmpfs(tmp_path / "ro", read_only=True) as ro:
        rc, err = run_main(capsys, "plan", data, *JOB, "--buffer-fraction", "0.5", "-o", os.path.join(ro, "p.h5"))
    assert rc == 2
    assert_one_error(err, "plan", "not writable")


# ------------------------------------------------------- option checks
@pytest.mark.parametrize("opts, needle", [
    (["-P", "0", "-b", "2", "--epochs", "1", "--buffer-fraction", "0.5"], "--world-size: must be a positive integer"),
    (["-P", "-2", "-b", "2", "--epochs", "1", "--buffer-fraction", "0.5"], "got '-2'"),
    (["-P", "2", "-b", "0", "--epochs", "1", "--buffer-fraction", "0.5"], "--local-batch: must be a positive"),
    (["-P", "2", "-b", "2", "--epochs", "0", "--buffer-fraction", "0.5"], "--epochs: must be a positive integer"),
    (["-P", "2", "-b", "2", "--epochs", "1", "--buffer-fraction", "inf"], "finite number > 0, got inf"),
    (["-P", "2", "-b", "2", "--epochs", "1", "--buffer-fraction", "nan"], "got nan"),
    (["-P", "2", "-b", "2", "--epochs", "1", "--buffer-fraction", "0"], "got 0.0"),
    (["-P", "2", "-b", "2", "--epochs", "1", "--buffer-fraction", "-1"], "got -1.0"),
    (["-P", "2", "-b", "2", "--epochs", "1", "--buffer-per-rank", "1e300"], "'1e300' is more than 2**62 bytes"),
    (["-P", "2", "-b", "2", "--epochs", "1", "--buffer-per-rank", "inf"], "'inf'"),
    (["-P", "2", "-b", "2", "--epochs", "1", "--buffer-fraction", "0.5", "--epsilon", "nan"], "--epsilon"),
    (["-P", "2", "-b", "2", "--epochs", "1", "--buffer-fraction", "0.5", "--epsilon", "-0.5"], "got '-0.5'"),
])
def test_plan_bad_options_give_one_line(tmp_path, data, capsys, opts, needle):
    out = tmp_path / "p.h5"
    rc, err = run_main(capsys, "plan", data, *opts, "-o", str(out))
    assert rc == 2
    assert_one_error(err, "plan", needle)
    assert not out.exists()


def test_simulate_bad_buffer_fraction_gives_one_line(capsys):
    rc, err = run_main(capsys, "simulate", "--samples", "64", "--sample-bytes", "100", "-P", "2", "-b", "2",
                       "--buffer-fraction", "inf")
    assert rc == 2
    assert_one_error(err, "simulate", "--buffer-fraction", "got inf")


def test_python_api_checks_the_same_values(data):
    with pytest.raises(SpecError, match="world_size must be a positive integer, got 0"):
        solar.plan(data, world_size=0, local_batch=2, epochs=1, buffer_fraction=0.5)
    with pytest.raises(SpecError, match="buffer_fraction must be a finite number > 0, got inf"):
        solar.plan(data, world_size=2, local_batch=2, epochs=1, buffer_fraction=float("inf"))
    with pytest.raises(SpecError, match="more than 2"):
        solar.plan(data, world_size=2, local_batch=2, epochs=1, buffer_per_rank=1e300)
    with pytest.raises(SpecError, match="more than 2"):
        parse_bytes(2**63)
    with pytest.raises(SpecError, match="buffer_bytes"):
        PlanConfig(2, 2, 1, 2**63)
    with pytest.raises(SpecError, match="epsilon"):
        PlanConfig(2, 2, 1, 100, epsilon=float("nan"))
    assert parse_bytes("2GiB") == 2**31 and parse_bytes(2**62) == 2**62


# ------------------------------------------- full disk, signals, pipes
def test_plan_on_a_full_disk_one_line_no_segfault_no_leftover(tmp_path, data):
    # the planner runs without numba compilation here (only the writer's failure is under test, and
    # compiling takes ~20 s per process); the file fills the tmpfs when HDF5 flushes it at the end
    env = {"NUMBA_DISABLE_JIT": "1", "PYTHONWARNINGS": "ignore::RuntimeWarning"}
    with tmpfs(tmp_path / "full", size="24k") as full:
        res = run_solar("plan", data, "-P", "2", "-b", "2", "--epochs", "30", "--buffer-fraction", "0.3",
                        "-o", os.path.join(full, "plan.h5"), env=env)
        left = os.listdir(full)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert_one_error(res.stderr, "plan", "plan.h5", "No space left on device")
    assert left == []


NUMBA_CACHE_ON_A_FULL_DISK = """
import sys
from solar.cli import main
rc = main(sys.argv[1:])
if rc == 0:
    from solar.loader import SolarLoader
    with SolarLoader(sys.argv[-1], rank=0, as_torch=False, reader="pread") as loader:
        print("batches", sum(1 for _ in loader))
sys.exit(rc)
"""


def test_numba_cache_dir_on_a_full_disk_compiles_without_it(tmp_path, data):
    """Issue 26: NUMBA_CACHE_DIR on a full disk (a shared folder over its quota): `solar plan` printed a 58-line
    traceback and the loader called the good schedule "damaged or truncated".  Now both go on without the cache
    and say so in one line naming NUMBA_CACHE_DIR and the OS error.  (Compiles every kernel: ~20 s.)"""
    out = tmp_path / "p.h5"
    with tmpfs(tmp_path / "full", size="16k") as full:
        fd = os.open(os.path.join(full, "fill"), os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):  # fill it up
            while True:
                os.write(fd, b"\0" * 4096)
        os.close(fd)
        cache = os.path.join(full, "numba")
        env = {**os.environ, "PYTHONPATH": REPO, "NUMBA_CACHE_DIR": cache}
        res = subprocess.run([sys.executable, "-c", NUMBA_CACHE_ON_A_FULL_DISK, "plan", data, "-P", "1", "-b", "4",
                              "--epochs", "2", "--buffer-fraction", "0.5", "--no-progress", "-o", str(out)],
                             capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "damaged" not in res.stderr, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"NUMBA_CACHE_DIR={cache}" in lines[0] and "No space left on device" in lines[0], \
        res.stderr[-3000:]
    assert "batches 10" in res.stdout  # the first epoch: 40 samples, 4 a step


def test_gen_on_a_full_disk_leaves_nothing(tmp_path):
    with tmpfs(tmp_path / "full", size="64k") as full:
        out = os.path.join(full, "d")
        res = run_solar("gen", "ptychonn", out, "--samples", "400", "--size", "8", "--no-progress")
        left = os.listdir(out) if os.path.isdir(out) else []
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert_one_error(res.stderr, "gen", out, "No space left on device")
    assert left == []


def test_gen_into_a_read_only_folder(tmp_path, capsys):
    with tmpfs(tmp_path / "ro", read_only=True) as ro:
        rc, err = run_main(capsys, "gen", "ptychonn", os.path.join(ro, "d"), "--samples", "4", "--size", "4")
        assert rc == 2
        assert_one_error(err, "gen", os.path.join(ro, "d"), "Read-only file system")
        rc, err = run_main(capsys, "gen", "ptychonn", ro, "--samples", "4", "--size", "4")
        assert rc == 2
        assert_one_error(err, "gen", ro, "Read-only file system")


SIGNAL_IN_PLAN = """
import os, signal, sys
from solar.cli import main
from solar.schedule import writer
real = writer.ScheduleWriter.add_epoch
def add_epoch(self, ep):  # the signal arrives while the schedule is being written (temp file open)
    assert self.out.file.id.valid and self.out._trap.fd >= 0
    os.kill(os.getpid(), signal.{sig})
    return real(self, ep)
writer.ScheduleWriter.add_epoch = add_epoch
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig, status, line", [
    ("SIGTERM", 128 + signal.SIGTERM, "solar plan: terminated (SIGTERM)"),
    ("SIGINT", 130, "solar plan: interrupted"),
])
def test_signal_during_plan_exits_cleanly_and_leaves_nothing(tmp_path, data, sig, status, line):
    """SIGTERM (what scancel sends) or Ctrl-C while the schedule is written: one line, its exit status,
    no temporary file left."""
    out = tmp_path / "plan.h5"
    env = {**os.environ, "PYTHONPATH": REPO}
    res = subprocess.run([sys.executable, "-c", SIGNAL_IN_PLAN.replace("{sig}", sig), "plan", data, *JOB,
                          "--buffer-fraction", "0.5", "-o", str(out)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == status, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and res.stderr.strip() == line, res.stderr[-2000:]
    assert os.listdir(tmp_path) == []


def test_plan_killed_outright_while_writing_leaves_nothing(tmp_path, data):
    """SIGKILL (the OOM killer; an MPI launcher ending the other ranks of an aborted job, issue 26) runs no
    clean-up: the schedule is written to a file without a name (O_TMPFILE) until it is complete."""
    try:
        os.close(os.open(tmp_path, os.O_TMPFILE | os.O_RDWR, 0o600))
    except (AttributeError, OSError):
        pytest.skip("this file system has no O_TMPFILE: the named temporary file is used")
    out = tmp_path / "plan.h5"
    env = {**os.environ, "PYTHONPATH": REPO}
    res = subprocess.run([sys.executable, "-c", SIGNAL_IN_PLAN.replace("{sig}", "SIGKILL"), "plan", data, *JOB,
                          "--buffer-fraction", "0.5", "-o", str(out)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    assert os.listdir(tmp_path) == []


HOOK = """
import os, signal, sys
from solar.cli import main
real, state = os.pwrite, {"n": 0}
def pwrite(fd, data, offset):  # {what} during the {nth} write HDF5 makes to the file
    state["n"] += 1
    if state["n"] == {nth}:
        {action}
    return real(fd, data, offset)
os.pwrite = pwrite
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("what, action, status, needle", [
    ("SIGTERM", "signal.raise_signal(signal.SIGTERM)", 143, "solar gen: terminated (SIGTERM)"),
    ("ENOSPC", "raise OSError(28, os.strerror(28))", 2, "No space left on device"),
])
def test_gen_failure_inside_an_hdf5_write_is_clean(tmp_path, what, action, status, needle):
    """A signal or an I/O error arriving inside HDF5's write path: one line, no leftovers, no crash."""
    out = tmp_path / "d"
    code = HOOK.replace("{what}", what).replace("{nth}", "3").replace("{action}", action)
    env = {**os.environ, "PYTHONPATH": REPO}
    res = subprocess.run([sys.executable, "-c", code, "gen", "ptychonn", str(out), "--samples", "200", "--size",
                          "8", "--no-progress"], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == status, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "Exception ignored" not in res.stderr, res.stderr[-2000:]
    assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert os.listdir(out) == []


@pytest.mark.parametrize("cmd", ["inspect", "simulate", "plan"])
def test_closed_stdout_exits_quietly(tmp_path, data, cmd):
    args = {"inspect": ["inspect", data, "--json"],
            "simulate": ["simulate", "--samples", "64", "--sample-bytes", "100", "-P", "2", "-b", "4",
                         "--epochs", "1", "--buffer-fraction", "0.5", "--policies", "torch", "--json"],
            "plan": ["plan", data, "-P", "2", "-b", "4", "--epochs", "1", "--buffer-fraction", "0.5",
                     "-o", str(tmp_path / "p.h5"), "--json"]}[cmd]
    env = {**os.environ, "PYTHONPATH": REPO, "NUMBA_DISABLE_JIT": "1", "PYTHONWARNINGS": "ignore::RuntimeWarning"}
    p = subprocess.Popen([sys.executable, "-m", "solar", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env)
    p.stdout.close()  # as `| head -0`: the reader is gone before anything is written
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert p.returncode in (0, 141), (p.returncode, err)
    assert "Traceback" not in err and "Exception ignored" not in err and "BrokenPipe" not in err, err


def test_gen_into_a_folder_with_files_needs_overwrite(tmp_path, capsys):
    """solar gen replaced a folder's files of the same names without a word (a user's dataset, lost)."""
    out = tmp_path / "d"
    assert run_main(capsys, "gen", "ptychonn", str(out), "--samples", "4", "--size", "4", "--no-progress")[0] == 0
    before = {p: p.stat().st_mtime_ns for p in out.iterdir()}
    rc, err = run_main(capsys, "gen", "ptychonn", str(out), "--samples", "8", "--size", "4", "--no-progress")
    assert rc == 2
    assert_one_error(err, "gen", str(out), "is not empty", "--overwrite")
    assert {p: p.stat().st_mtime_ns for p in out.iterdir()} == before
    rc, _ = run_main(capsys, "gen", "ptychonn", str(out), "--samples", "8", "--size", "4", "--no-progress",
                     "--overwrite")
    assert rc == 0 and solar.load_layout(str(out)).n_samples == 8


def test_sizes_beyond_memory_give_one_line(tmp_path, capsys, monkeypatch):
    """A MemoryError (solar gen --size 99999 asks numpy for 1.75 TiB) ends with one line naming it, exit 2; here the
    generator's allocation is made to fail, as it does on a machine that refuses it at once."""
    import solar.cli.gen_cmd as gen_cmd

    def refuse(*a, **k):  # numpy's own MemoryError subclass says the same
        raise MemoryError("Unable to allocate 1.75 TiB for an array with shape (3, 16, 99999, 99999, 1) and data "
                          "type float32")
    monkeypatch.setattr(gen_cmd, "generate", refuse)
    assert main(["gen", "ptychonn", str(tmp_path / "g"), "--samples", "16", "--size", "99999", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("solar gen: error: out of memory: Unable to allocate 1.75 TiB"), err


@pytest.mark.parametrize("argv, needle", [
    (["gen", "ptychonn", "{d}/g", "--variant", "mult"], "--variant is pdebench's (single or mult), not ptychonn's"),
    (["gen", "cosmoflow", "{d}/g", "--steps", "7"], "--steps (time steps a trajectory) is for well and pdebench"),
    (["bench", "{data}", "--cache-mode", "system"], "--cache-mode system says how --cold drops the page cache"),
    (["bench", "{data}", "--step-sync"], "--step-sync runs solar alone: give --only solar too"),
])
def test_options_that_would_do_nothing_are_refused(tmp_path, data, capsys, argv, needle):
    """An option the command would ignore (it said nothing and did something else) is one line, exit 2."""
    assert main([a.format(d=tmp_path, data=data) for a in argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err
    assert not (tmp_path / "g").exists()
