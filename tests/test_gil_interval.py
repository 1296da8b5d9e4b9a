"""The GIL switch interval a loader sets while its threads run (solar.loader.gil): lowered while any
loader that asked is open, never raised, put back when the last one closes, left alone when someone
else changed it meanwhile; bad values are one-line SpecErrors naming them."""
import sys

import numpy as np
import pytest

import solar
from solar.loader import SolarLoader
from solar.loader.gil import DEFAULT_SWITCH_INTERVAL, check_interval, lower

from helpers import make_dataset


@pytest.fixture(autouse=True)
def python_default(monkeypatch):
    """Python's default interval and no hold: loaders of other tests left open (their threads still running)
    keep theirs, which is not this test's."""
    import gc

    from solar.loader import gil
    gc.collect()  # loaders other tests left behind unreachable give their holds back now, not during this test
    for name, value in (("_users", 0), ("_saved", None), ("_set", None)):
        monkeypatch.setattr(gil, name, value)
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_lowered_while_used_and_put_back_by_the_last_release():
    r1 = lower(0.001)
    assert sys.getswitchinterval() == pytest.approx(0.001)
    r2 = lower(0.0005)  # the lower of the two holds
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    r3 = lower(0.002)  # never raised
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    r1()
    r1()  # a second call does nothing (does not release another user's hold)
    r3()
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    r2()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_left_alone_when_changed_meanwhile_or_not_asked():
    release = lower(0.0005)
    sys.setswitchinterval(0.003)  # the training script's own choice after the loader started
    release()
    assert sys.getswitchinterval() == pytest.approx(0.003)
    for value in (None, 0, 0.0):
        lower(value)()
        assert sys.getswitchinterval() == pytest.approx(0.003)


@pytest.mark.parametrize("bad", [-0.001, 2, "0.001", True, float("nan")])
def test_bad_intervals_are_spec_errors_naming_them(bad):
    with pytest.raises(solar.SpecError, match=f"switch_interval must be seconds in \\[0, 1\\].*got {bad!r}"):
        check_interval(bad)


def test_a_loader_lowers_it_while_open_and_restores_it(tmp_path):
    data = make_dataset(tmp_path, "ptychonn", "chunked", samples=24)
    path = str(tmp_path / "plan.h5")
    solar.plan(data, world_size=1, local_batch=4, epochs=2, buffer_fraction=0.5, out=path).close()
    with SolarLoader(path, data, rank=0) as loader:
        assert sys.getswitchinterval() == pytest.approx(0.005)  # nothing runs yet
        seen = []
        for e in loader.epoch_range():
            loader.set_epoch(e)
            for batch in loader:
                seen.append(sys.getswitchinterval())
                assert batch["index"].shape[0] == 4
        assert seen and all(s == pytest.approx(DEFAULT_SWITCH_INTERVAL) for s in seen)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    with SolarLoader(path, data, rank=0, switch_interval=None) as loader:
        next(iter(loader))
        assert sys.getswitchinterval() == pytest.approx(0.005)
    with pytest.raises(solar.SpecError, match="switch_interval must be seconds.*got -1"):
        SolarLoader(path, data, rank=0, switch_interval=-1)
    assert np.isclose(sys.getswitchinterval(), 0.005)


def test_a_loader_never_closed_gives_it_back_when_collected(tmp_path):
    import gc
    data = make_dataset(tmp_path, "ptychonn", "chunked", samples=24)
    path = str(tmp_path / "plan.h5")
    solar.plan(data, world_size=1, local_batch=4, epochs=1, buffer_fraction=0.5, out=path).close()
    loader = SolarLoader(path, data, rank=0)
    for _ in loader:
        pass
    assert sys.getswitchinterval() == pytest.approx(DEFAULT_SWITCH_INTERVAL)
    loader._stop_buffer()  # its threads end (as an epoch loop left behind does once the buffer is stopped)
    loader.reader.close()
    loader.schedule.close()
    if loader._guard is not None:
        loader._guard()
    del loader
    gc.collect()
    assert sys.getswitchinterval() == pytest.approx(0.005)
