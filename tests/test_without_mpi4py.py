"""mpi4py is an optional extra (``pip install solar-hdf5[mpi]``): with it absent, ``import solar``,
``solar plan`` and a torchrun-style job (rank from the environment, the ``pread`` reader) work, and
``solar bench`` (an MPI program) says in one line that it needs mpi4py.

The check runs in a subprocess whose ``sys.meta_path`` starts with a finder that raises
ImportError for ``mpi4py`` and its submodules, as on a machine where it is not installed.
"""
import os
import subprocess
import sys
import textwrap

from helpers import make_dataset

BLOCK = textwrap.dedent("""
    import sys

    class NoMPI:
        def find_spec(self, name, path=None, target=None):
            if name == "mpi4py" or name.startswith("mpi4py."):
                raise ImportError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, NoMPI())
""")

JOB = textwrap.dedent("""
    import os, sys
    import numpy as np
    import solar
    from solar.cli import main as cli
    data, plan = sys.argv[1], sys.argv[2]
    assert cli(["plan", data, "-P", "2", "-b", "2", "--epochs", "2", "--buffer-fraction", "0.5", "-o", plan]) == 0
    seen = []
    for rank in (0, 1):                      # each rank as torchrun starts it: RANK / WORLD_SIZE only
        os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
        with solar.SolarLoader(plan) as loader:
            assert loader.rank == rank and loader.reader_name == "pread", (loader.rank, loader.reader_name)
            for e in range(loader.epochs):
                loader.set_epoch(e)
                for batch in loader:
                    seen.append((e, rank, batch["index"].tolist()))
                    assert batch["X_train"].shape[1:] == (16, 16, 1)
    from solar.torch import SolarDataset  # the torch side imports without MPI too
    assert cli(["bench", data, "--epochs", "1"]) == 2  # needs MPI: one line, no traceback
    bad = sorted(m for m in sys.modules if m == "mpi4py" or m.startswith("mpi4py."))
    assert not bad, bad
    for e in (0, 1):
        ids = sorted(i for ep, _, b in seen if ep == e for i in b)
        assert ids == list(range(12)), (e, ids)
    print("ok", len(seen))
""")


def test_plan_and_a_torchrun_style_epoch_without_mpi4py(tmp_path):
    data = make_dataset(tmp_path, "ptychonn", samples=12, size=16)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPI_LOCAL", "OMPI_", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", HDF5_USE_FILE_LOCKING="FALSE")
    r = subprocess.run([sys.executable, "-c", BLOCK + JOB, data, str(tmp_path / "plan.h5")], env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "ok 12"
    assert "solar bench: error: solar bench runs under mpiexec and needs mpi4py" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr


def test_the_blocker_blocks():
    """The finder does what the test above relies on: ``import mpi4py`` fails in the subprocess."""
    code = BLOCK + "\ntry:\n    import mpi4py\nexcept ImportError:\n    print('blocked')\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.stdout.strip() == "blocked", r.stdout + r.stderr
