"""``solar plan --reads-in-flight N``: N batches of each rank's budget held for reads in flight.  The residency
budget is N-1 batches smaller, the file says how much more the pools get (``read_ahead_bytes``), the loader's
memory stays within what the plan was made for, and the batches are the same, byte for byte."""
import numpy as np
import pytest

import solar
from solar.cli import main
from solar.loader import SolarLoader
from solar.memory import batch_bytes, largest_batch

from helpers import make_dataset


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("rif"), "ptychonn", "chunked", samples=48)


def _plan(data, tmp_path, name, **kw):
    return solar.plan(data, world_size=1, local_batch=4, epochs=2, buffer_fraction=0.5,
                      out=str(tmp_path / name), **kw)


def _batches(path, data):
    out = []
    with SolarLoader(path, data, rank=0) as loader:
        for e in loader.epoch_range():
            loader.set_epoch(e)
            for b in loader:
                out.append({k: v.numpy().copy() for k, v in b.items() if k != "weight"})
        memory = loader.memory
    return out, memory


def test_more_reads_in_flight_take_batches_from_the_residency_not_from_the_limit(data, tmp_path):
    one = _plan(data, tmp_path, "one.h5")
    four = _plan(data, tmp_path, "four.h5", reads_in_flight=4)
    batch = batch_bytes(one.layout(), largest_batch(4, 0.0))
    assert one.read_ahead_bytes == 0 and four.read_ahead_bytes == 3 * batch
    assert four.buffer_bytes == one.buffer_bytes - 3 * batch  # the residency planned
    assert four.memory_budget == one.memory_budget == one.buffer_bytes  # what the rank's memory is sized from
    assert four.summary()["read_ahead_bytes"] == 3 * batch
    paths = one.path, four.path
    one.close()
    four.close()
    (b1, m1), (b4, m4) = (_batches(p, data) for p in paths)
    assert m4.limit == m1.limit and m4.fits  # the same memory in all
    assert m4.staging >= m1.staging + 3 * batch // 2  # more of it for reads in flight (slots of whole blocks)
    assert len(b1) == len(b4)
    for x, y in zip(b1, b4):  # the same batches, byte for byte
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


@pytest.mark.parametrize("bad", [0, -1, 65, 1.5, True, "2"])
def test_bad_reads_in_flight_is_a_spec_error_naming_it(data, tmp_path, bad):
    with pytest.raises(solar.SpecError, match=f"reads_in_flight must be an integer from 1 to 64.*got {bad!r}"):
        _plan(data, tmp_path, "bad.h5", reads_in_flight=bad)


def test_reads_in_flight_that_leave_no_residency_say_so(data, tmp_path):
    with pytest.raises(solar.SpecError, match="leaves nothing for the buffer.*64 read in flight.*or reads_in_flight"):
        solar.plan(data, world_size=1, local_batch=4, epochs=1, buffer_fraction=0.05, reads_in_flight=64,
                   out=str(tmp_path / "tiny.h5"))


def test_not_with_a_device_buffer(data, tmp_path):
    with pytest.raises(solar.SpecError, match="reads_in_flight= with device_buffer="):
        solar.plan(data, world_size=1, local_batch=4, epochs=1, device_buffer="64MiB", reads_in_flight=2,
                   out=str(tmp_path / "dev.h5"))


def test_cli(data, tmp_path, capsys):
    out = str(tmp_path / "cli.h5")
    assert main(["plan", data, "-P", "1", "-b", "4", "--epochs", "1", "--buffer-fraction", "0.5",
                 "--reads-in-flight", "3", "-o", out, "--json"]) == 0
    with solar.Schedule.load(out) as s:
        assert s.read_ahead_bytes > 0
    with pytest.raises(SystemExit) as ex:
        main(["plan", data, "-P", "1", "-b", "4", "--epochs", "1", "--buffer-fraction", "0.5",
              "--reads-in-flight", "0", "-o", out])
    assert ex.value.code == 2
