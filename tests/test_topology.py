import os

import pytest

from solar.errors import SpecError
from solar.topology import Topology, detect


def test_detect_from_environment():
    env = {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)",
           "SLURM_NNODES": "2"}
    assert detect(env=env) == Topology(8, 5, 1, 4, 2)
    assert detect(env={"PMI_SIZE": "2", "PMI_RANK": "1"}) == Topology(2, 1, 0, 1, 1)
    assert detect(env={}) == Topology(1, 0)
    assert Topology(4, 1, 1, 2).device(True, 2) == "cuda:1" and Topology(4, 1).device(False) == "cpu"


def test_bad_topology_names_value():
    with pytest.raises(SpecError, match="rank must be in \\[0, 2\\), got 2"):
        Topology(2, 2)
    with pytest.raises(SpecError, match="SLURM_PROCID='x' is not an integer"):
        detect(env={"SLURM_NTASKS": "2", "SLURM_PROCID": "x"})


@pytest.mark.mpi
def test_detect_from_comm(comm):
    t = detect(comm)
    assert t.world_size == comm.size and t.rank == comm.rank and t.nodes == 1 and t.local_size == comm.size


def test_cpu_share_of_a_rank():
    """A rank's cores: its affinity when the launcher bound it to fewer than the node's, else an equal share."""
    from solar.topology import Topology, cpus_of_this_rank
    t4 = Topology(8, 1, local_rank=1, local_size=4)
    assert t4.cpu_share(affinity=16, cpu_count=16) == 4       # the whole node: a quarter each
    assert t4.cpu_share(affinity=3, cpu_count=16) == 3        # bound by srun --cpus-per-task=3
    assert Topology(8, 1, local_rank=1, local_size=32).cpu_share(16, 16) == 1  # more ranks than cores
    assert Topology(1, 0).cpu_share(2, 2) == 2
    assert 1 <= cpus_of_this_rank(Topology(1, 0)) <= (os.cpu_count() or 1)


def test_a_rank_bound_to_one_core_of_many_is_told(monkeypatch):
    """Open MPI binds a 1-2 rank job to one core each: seen on a 16-core GPU machine, where solar's default
    cpus (and a DataLoader's 16 workers) then shared one core. The user gets one warning saying so."""
    import warnings

    import solar.topology as top
    one = Topology(1, 0)
    assert one.binding_note(1, 16) is not None and "--bind-to none" in one.binding_note(1, 16)
    assert one.binding_note(2, 16) is None           # a binding of several cores is the user's choice
    assert one.binding_note(1, 2) is None            # a small machine: one core is no surprise
    assert Topology(8, 1, local_rank=1, local_size=8).binding_note(1, 16) is None   # share of 2 cores
    assert Topology(8, 1, local_rank=1, local_size=4).binding_note(1, 16) is not None  # share of 4
    monkeypatch.setattr(top.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(top.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(top, "_SAID", set())
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert top.cpus_of_this_rank(one) == 1
        assert top.cpus_of_this_rank(one) == 1
    said = [w for w in got if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1 and "1 of the node's 16 cores" in str(said[0].message)
