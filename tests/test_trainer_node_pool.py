"""The examples' trainer plans a node plan where the job's ranks share nodes and MPI started them; without MPI
it gives each rank a buffer and says what a node plan would have read (issue 25, item 1)."""
import os
import socket

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


class FakeGroup:
    """A Group whose allgather returns the given hosts (one per rank)."""

    def __init__(self, hosts):
        self.hosts, self.size, self.rank = list(hosts), len(hosts), 0

    def allgather(self, obj):
        return list(self.hosts)


@pytest.fixture
def trainer(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    import trainer
    return trainer


def test_ranks_sharing_a_node_under_mpi_plan_one_buffer_per_node(trainer):
    L, found, note = trainer.node_pool_choice(FakeGroup(["a", "a", "b", "b"]), env={"PMI_RANK": "0"})
    assert (L, found) == (2, 2) and "share one buffer" in note


def test_without_mpi_each_rank_has_its_buffer_and_is_told(trainer):
    L, found, note = trainer.node_pool_choice(FakeGroup(["a", "a"]), env={"LOCAL_RANK": "0"})
    assert (L, found) == (None, 2) and "needs MPI" in note


def test_one_rank_per_node_or_another_placement(trainer):
    assert trainer.node_pool_choice(FakeGroup(["a", "b"]), env={"PMI_RANK": "0"}) == (None, 1, None)
    L, found, note = trainer.node_pool_choice(FakeGroup(["a", "b", "a", "b"]), env={"PMI_RANK": "0"})
    assert L is None and "not placed in blocks" in note


def test_the_line_without_mpi_gives_both_predictions(trainer, tmp_path, capsys, monkeypatch):
    """The fallback's line names the per-rank plan's and a node plan's predicted storage reads."""
    from helpers import make_dataset
    monkeypatch.syspath_prepend(EXAMPLES)
    import train_ptychonn
    data = make_dataset(tmp_path, "ptychonn", "gzip", samples=64)
    args = trainer.parse_args(train_ptychonn.Ptycho(), "t", [data, "--local-batch", "4", "--epochs", "2",
                                                             "--plan", str(tmp_path / "p.h5")])
    from solar.topology import MPI_LAUNCH_VARS
    for v in MPI_LAUNCH_VARS:
        monkeypatch.delenv(v, raising=False)
    host = socket.gethostname()
    g = FakeGroup([host, host])
    g.bcast = lambda obj: obj
    path = trainer.ensure_plan(args, g)
    out = capsys.readouterr().out
    assert "needs MPI" in out and "as a node plan" in out and "per-rank" in out
    import solar
    with solar.Schedule.load(path) as s:
        assert s.nodes is None  # the per-rank plan was made
