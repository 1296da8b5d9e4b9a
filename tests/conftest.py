import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # for `import helpers`


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test`` runs ``-n N --dist loadgroup``): the tests that start one-machine SLURM
    clusters (and may install slurm-wlm with apt-get first) run one after another on one worker."""
    for item in items:
        if item.get_closest_marker("slurm") or item.name == "test_srun_ends_every_rank":
            item.add_marker(pytest.mark.xdist_group("slurm"))


@pytest.fixture(scope="session", autouse=True)
def solar_cache_dir():
    """SOLAR_CACHE_DIR (where ``solar bench`` writes its schedules) in a temporary folder, not the user's
    ~/.cache/solar: a test's files go with it.  Per process: under mpiexec only rank 0 writes there."""
    import shutil
    path = tempfile.mkdtemp(prefix="solar-cache-")
    old = os.environ.get("SOLAR_CACHE_DIR")
    os.environ["SOLAR_CACHE_DIR"] = path
    yield path
    if old is None:
        os.environ.pop("SOLAR_CACHE_DIR", None)
    else:
        os.environ["SOLAR_CACHE_DIR"] = old
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def comm():
    """MPI.COMM_WORLD: size 1 under plain pytest, 2 under `mpiexec -n 2 python -m pytest -m mpi`."""
    from mpi4py import MPI
    return MPI.COMM_WORLD


@pytest.fixture
def shared_tmp(comm):
    """A temporary folder that every rank sees (made on rank 0, name broadcast)."""
    path = tempfile.mkdtemp(prefix="solar-mpi-") if comm.rank == 0 else None
    path = comm.bcast(path, root=0)
    yield path
    comm.Barrier()
    if comm.rank == 0:
        import shutil
        shutil.rmtree(path, ignore_errors=True)


def on_root(comm, fn):
    """Run ``fn`` on rank 0 and broadcast its result; an exception there is raised on every rank."""
    res = None
    if comm.rank == 0:
        try:
            res = ("ok", fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised on every rank below
            res = ("err", f"{type(exc).__name__}: {exc}")
    status, val = comm.bcast(res, root=0)
    if status == "err":
        raise RuntimeError(f"rank 0 failed: {val}")
    return val


def pytest_runtest_logreport(report):
    """Under mpiexec, a failure on one rank aborts the whole job instead of leaving the
    other ranks waiting in a collective forever."""
    if not report.failed:
        return
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.size > 1:
        sys.stderr.write(f"\n[rank {comm.rank}] {report.nodeid} FAILED:\n{report.longreprtext}\n")
        sys.stderr.flush()
        comm.Abort(1)
