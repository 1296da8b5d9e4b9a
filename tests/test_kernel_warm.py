"""A loader's ``prepare()`` loads the GIL-free read and gather kernels (numba's cache) that its first step
calls, so the first step's booking, reads and assembly do not wait for them, and it loads exactly the code those calls
take: in a fresh process, after ``prepare()`` each kernel holds one compiled signature, and taking batches adds
none (a warm-up of other argument types would leave the real call to load its own)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import solar
from helpers import make_dataset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json, sys
from solar.io import aio, kernels
from solar.buffer import book, gather
from solar.loader import SolarLoader

def sigs():
    return {k: [str(s) for s in d.signatures] for k, d in (("read", kernels.read_direct_ranges),
            ("inflate", kernels.inflate_direct_ranges), ("aio", aio.aio_read_ranges),
            ("gather", gather._gather_field), ("gather_all", gather._gather_fields), ("book", book._step_need))}

with SolarLoader(sys.argv[1], sys.argv[2], reader_options={"direct_io": True, "aio": sys.argv[3] == "1"}) as loader:
    loader.prepare()
    warm = sigs()
    loader.set_epoch(0)
    it = iter(loader)
    for _ in range(2):
        next(it)
    print(json.dumps({"warm": warm, "after": sigs()}))
"""


def o_direct_here(path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except (OSError, AttributeError):
        return False


@pytest.mark.parametrize("aio", [False, True], ids=["threads", "aio"])
@pytest.mark.parametrize("storage", ["contiguous", "gzip"])
def test_prepare_loads_the_kernels_the_first_step_calls(tmp_path, storage, aio):
    data = make_dataset(tmp_path, "ptychonn", storage, samples=64, size=32)
    files = [os.path.join(data, f) for f in os.listdir(data) if f.endswith(".h5")]
    if not o_direct_here(files[0]):
        pytest.skip(f"{tmp_path}: no O_DIRECT here, the read kernels are not the reader's path")
    if aio and not solar.io.aio.aio_available()[0]:
        pytest.skip(f"native AIO: {solar.io.aio.aio_available()[1]}")
    plan = str(tmp_path / "plan.h5")
    solar.plan(data, world_size=1, local_batch=8, epochs=1, buffer_fraction=0.5, out=plan).close()
    res = subprocess.run([sys.executable, "-c", SCRIPT, plan, data, str(int(aio))], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    warm, after = got["warm"], got["after"]
    kernel = "inflate" if storage == "gzip" and solar.io.kernels.LIBDEFLATE else "aio" if aio else "read"
    assert len(warm[kernel]) == 1 and len(warm["gather"]) == 1, warm
    assert len(warm["gather_all"]) == 1 and len(warm["book"]) == 1, warm  # (the batch's fields in one call; booking)
    assert len(warm["aio"]) == int(aio), warm  # loaded where the reader uses it, only there
    assert after == warm, (warm, after)
