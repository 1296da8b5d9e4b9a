"""A user error inside `mpiexec -n N solar bench` is one line and exit 2, like every other CLI error.

It went through the MPI abort path: `solar bench: error on rank 0: ...`, `aborting all 2 ranks`, exit 1,
even when every rank had met the same error (a bad option each rank checks, a bad spec that rank 0 found
and handed to every rank).  Now a SolarError that every rank raises ends every rank with status 2 and
one line (rank 0's); one that only some ranks raise still aborts the job (so none waits in a collective
forever), with status 2.
"""
import os
import subprocess
import sys

import pytest

from helpers import make_dataset

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def run(args, timeout=120):
    return subprocess.run([MPIEXEC, "-n", "2", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("ue"), "ptychonn", "contiguous", samples=8)


@pytest.mark.parametrize("extra, line", [
    (["--model", "conv", "--step-time", "1"],
     "solar bench: error: --step-time simulates the training step: give it with --model none, not with --model conv"),
    (["--policy", "solar-node", "--no-node-pool"],
     "solar bench: error: --policy, --network-bandwidth and --storage-bandwidth need a node plan; "
     "solar: one buffer per rank (--no-node-pool)"),
    (["--ranks-per-node", "2", "--no-node-pool"],
     "solar bench: error: --ranks-per-node plans node buffers and --no-node-pool one buffer per rank: give one"),
    (["--loader-process", "--ranks-per-node", "2"],
     "solar bench: error: --loader-process runs a buffer per rank; --ranks-per-node plans node buffers: give one"),
])
def test_an_option_every_rank_refuses_is_one_line_exit_2(data, extra, line):
    r = run([sys.executable, "-m", "solar", "bench", data, "--no-progress", *extra])
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [line] and r.stdout == "", r.stderr


def test_a_bad_spec_rank_0_finds_is_one_line_exit_2(tmp_path):
    missing = str(tmp_path / "nothing-here")
    r = run([sys.executable, "-m", "solar", "bench", missing, "--no-progress"])
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [f"solar bench: error: file not found: {missing}"], r.stderr


CODE = """
import sys, solar
from mpi4py import MPI
from solar.mpi import abort_on_error
c = MPI.COMM_WORLD
mode = sys.argv[1]
try:
    with abort_on_error(c, prefix="job", user_error_status=None if mode == "library" else 2):
        if mode in ("every", "library") or (mode == "one" and c.rank == 1):
            raise solar.SpecError("bad value 7")
        if mode == "differ":
            raise solar.SpecError(f"bad value on rank {c.rank}")
        c.Barrier()
except solar.SpecError as exc:  # only where the error propagates (user_error_status None)
    sys.stderr.write(f"rank {c.rank} caught: {exc}\\n")  # one write: the ranks' lines do not interleave
    sys.stderr.flush()
    sys.exit(5)
"""


@pytest.mark.parametrize("mode, status, lines", [
    ("every", 2, ["job: error: bad value 7"]),
    ("differ", 2, ["job: error: bad value on rank 0", "job: error on rank 1: bad value on rank 1"]),
    ("library", 5, ["rank 0 caught: bad value 7", "rank 1 caught: bad value 7"]),
])
def test_abort_on_error_when_every_rank_fails(mode, status, lines):
    r = run([sys.executable, "-c", CODE, mode])
    assert r.returncode == status, r.stderr
    assert sorted(r.stderr.strip().splitlines()) == sorted(lines), r.stderr


def test_a_user_error_on_one_rank_still_aborts_every_rank_with_status_2():
    r = run([sys.executable, "-c", CODE, "one"])
    assert r.returncode == 2, r.stderr
    assert "job: error on rank 1: bad value 7\njob: aborting all 2 ranks" in r.stderr, r.stderr
