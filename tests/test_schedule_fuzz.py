"""Hostile schedule files: damaged bytes, truncation, attributes and arrays rewritten with wrong
types, lengths, dtypes and ids (with and without recomputing their checksums).  Opening the
file and using it the way solar does (``Schedule.load``, ``.summary()``, ``.demand()``,
``.rank(r)``, a ``BufferManager`` run over every step) either works with sane results or
raises a :class:`~solar.errors.SolarError`; never another exception, an absurd allocation
or an out-of-range read.

Byte flips and truncation produce files that libhdf5 itself parses; they run in a child
process so that a crash inside the C library would fail this test instead of killing pytest.
"""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, reject, settings, strategies as st

import solar
from solar.buffer import BufferManager
from solar.errors import SolarError
from solar.schedule import Schedule, ScheduleError
from solar.schedule.format import HEADER_KEYS, array_digest, header_digest
from solar.schedule.summary import format_schedule
from solar.scheduler import Demand, PlanConfig

FUZZ = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def plan_file(path: str):
    """A small valid schedule: 30 samples, 15 blocks of 200 bytes, 2 ranks, 2 epochs."""
    d = Demand.synthetic(30, 100, samples_per_block=2)
    solar.plan(d, world_size=2, local_batch=3, epochs=2, buffer_fraction=0.5, seed=1, out=path).close()


def dataset_names(path: str):
    names = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda n, obj: names.append(n) if isinstance(obj, h5py.Dataset) else None)
    return sorted(names)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fuzz") / "good.h5")
    plan_file(path)
    return path


def copy(src: str, dst: str) -> str:
    with open(src, "rb") as f, open(dst, "wb") as g:
        g.write(f.read())
    return dst


# ------------------------------------------------------------------ use a file
class ZeroReader:
    """Stands in for a block reader: fills each requested block with zeros."""

    collective = False

    def read_blocks(self, blocks, out):
        assert len(blocks) == len(out)
        for v in out:
            v[:] = 0
        return SimpleNamespace(n_reads=len(out), bytes_read=sum(v.nbytes for v in out))


def run_buffer(rp, demand, budget: int):
    """Every step of a rank's plan through a BufferManager; each step's blocks looked up."""
    ptr, blocks = demand["sample_ptr"], demand["sample_blocks"]

    def assemble(g, samples, lookup):
        return sum(lookup(int(b)).nbytes for s in samples.tolist() for b in blocks[ptr[s]:ptr[s + 1]].tolist())

    with BufferManager(rp, demand, ZeroReader(), assemble, budget=budget, prefetch=2) as bm:
        for g in range(rp.n_steps):
            bm.get(g)


def use(path: str) -> str:
    """Open and use a schedule; returns "ok" or the SolarError message; anything else propagates."""
    try:
        with Schedule.load(path) as s:
            text = format_schedule(s.summary())
            assert s.path in text and s.world_size >= 1 and s.n_steps == s.epochs * s.steps_per_epoch
            d = s.demand()
            assert d["sample_ptr"].shape == (s.n_samples + 1,) and d["sample_ptr"][0] == 0
            assert (np.diff(d["sample_ptr"]) >= 0).all() and d["sample_blocks"].shape == (d["sample_ptr"][-1],)
            assert ((d["sample_blocks"] >= 0) & (d["sample_blocks"] < s.n_blocks)).all()
            assert d["block_nbytes"].shape == (s.n_blocks,) and (d["block_nbytes"] >= 0).all()
            for r in range(s.world_size):
                rp = s.rank(r)
                assert rp.n_steps == s.n_steps
                assert ((rp.samples >= 0) & (rp.samples < s.n_samples)).all()
                for ids in (rp.load, rp.evict):
                    assert ((ids >= 0) & (ids < s.n_blocks)).all()
                run_buffer(rp, d, s.buffer_bytes)
        return "ok"
    except SolarError as exc:
        msg = str(exc)
        assert msg and "\n" not in msg, msg
        return msg


def test_valid_file_is_used(good):
    assert use(good) == "ok"


# ---------------------------------------------------------------- header attributes
odd_values = st.one_of(
    st.integers(-2**63, 2**63 - 1), st.sampled_from([0, -1, 1, 2, 3, 2**31, 2**62, 10**15]),
    st.text(max_size=12), st.floats(allow_nan=True), st.booleans(), st.binary(min_size=1, max_size=6),
    st.lists(st.integers(-3, 3), min_size=1, max_size=3).map(lambda v: np.array(v, dtype=np.int64)),
    st.just(None))  # None: delete the attribute


def set_attr(attrs, name, value):
    try:
        if value is None:
            if name in attrs:
                del attrs[name]
        else:
            attrs[name] = value
    except (TypeError, ValueError):  # h5py cannot store it: not a file anyone can make
        reject()


def fix_header(f):
    """Recompute header_sha256 over whatever the header now holds (when it can be computed)."""
    try:
        f.attrs["header_sha256"] = header_digest(f.attrs)
    except (KeyError, TypeError, ValueError):
        pass


@settings(max_examples=120, **FUZZ)
@given(name=st.sampled_from(HEADER_KEYS + ("complete", "header_sha256")), value=odd_values, fix=st.booleans())
def test_header_attribute_rewritten(good, tmp_path, name, value, fix):
    path = copy(good, str(tmp_path / "h.h5"))
    with h5py.File(path, "r+") as f:
        set_attr(f.attrs, name, value)
        if fix:
            fix_header(f)
    use(path)


config_values = st.one_of(st.integers(-2**70, 2**70), st.sampled_from([0, -1, 10**12]), st.floats(allow_nan=True),
                          st.text(max_size=5), st.none(), st.booleans(), st.lists(st.integers(), max_size=2))


@settings(max_examples=80, **FUZZ)
@given(field=st.sampled_from(sorted(PlanConfig.__dataclass_fields__) + ["extra"]), value=config_values,
       drop=st.booleans())
def test_config_rewritten_checksum_fixed(good, tmp_path, field, value, drop):
    """The config JSON edited and header_sha256 recomputed: only validation can catch it."""
    path = copy(good, str(tmp_path / "c.h5"))
    with h5py.File(path, "r+") as f:
        cfg = json.loads(f.attrs["config"])
        if drop:
            cfg.pop(field, None)
        else:
            cfg[field] = value
        f.attrs["config"] = json.dumps(cfg)
        fix_header(f)
    use(path)


# ---------------------------------------------------------------------------- arrays
def mutated(arr: np.ndarray, how: str, k: int, n_ids: int) -> np.ndarray:
    """``arr`` damaged as ``how`` says, at a position/amount chosen by ``k``."""
    flat = arr.reshape(-1).copy()
    i = k % max(1, flat.shape[0])
    if how == "shorter":
        return flat[:max(0, flat.shape[0] - 1 - k % 4)]
    if how == "longer":
        return np.concatenate([flat, flat[:1 + k % 4] if flat.size else np.zeros(1 + k % 4, flat.dtype)])
    if how == "float":
        return arr.astype(np.float64)
    if how == "narrower":
        return arr.astype(np.int16)
    if how == "wider":
        return arr.astype(np.int64 if arr.dtype != np.int64 else np.uint64)
    if how == "2d":
        return flat.reshape(-1, 1)
    if how == "shuffled":
        return np.random.default_rng(k).permutation(flat).reshape(arr.shape)
    if flat.size == 0:
        reject()
    value = {"negative": -1 - k % 3, "huge": np.iinfo(arr.dtype).max - k % 2, "near": n_ids + k % 3 - 1,
             "small": k % 40}[how]
    flat[i] = value
    return flat.reshape(arr.shape)


def replace_dataset(f, name: str, new, fix: bool):
    old_sha = f[name].attrs.get("sha256", "")
    del f[name]
    if isinstance(new, str):  # "group"
        f.create_group(name)
        return
    ds = f.create_dataset(name, data=new)
    ds.attrs["sha256"] = array_digest(new) if fix else old_sha


HOW = ["shorter", "longer", "float", "narrower", "wider", "2d", "shuffled", "negative", "huge", "near", "small",
       "group", "delete"]


@pytest.fixture(scope="module")
def names(good):
    return dataset_names(good)


@settings(max_examples=200, **FUZZ)
@given(data=st.data(), how=st.sampled_from(HOW), k=st.integers(0, 10**6), fix=st.booleans())
def test_array_replaced(good, names, tmp_path, data, how, k, fix):
    name = data.draw(st.sampled_from(names))
    path = copy(good, str(tmp_path / "a.h5"))
    with h5py.File(path, "r+") as f:
        n_ids = int(f.attrs["n_samples"] if name.endswith("samples") else f.attrs["n_blocks"])
        if how == "delete":
            del f[name]
        else:
            replace_dataset(f, name, "group" if how == "group" else mutated(f[name][()], how, k, n_ids), fix)
    use(path)


@pytest.mark.parametrize("name", ["demand/sample_ptr", "demand/sample_blocks", "ranks/1/load",
                                  "ranks/0/samples_count", "epochs/rank_miss_bytes"])
def test_array_claiming_huge_shape_fails_without_allocating(good, tmp_path, name):
    """A dataset whose metadata claims ~10^13 elements (chunked, nothing written: the file stays
    small) is refused from its shape before any read."""
    path = copy(good, str(tmp_path / "huge.h5"))
    with h5py.File(path, "r+") as f:
        old = f[name]
        shape = (10**13,) + old.shape[1:]
        dtype, sha = old.dtype, old.attrs["sha256"]
        del f[name]
        ds = f.create_dataset(name, shape=shape, dtype=dtype, chunks=(1024,) + shape[1:])
        ds.attrs["sha256"] = sha
    assert os.path.getsize(path) < 10**6
    msg = use(path)
    assert "damaged schedule file" in msg and "shape" in msg, msg


def test_sizes_rewritten_consistently_are_caught(good, tmp_path):
    """n_samples doubled with header_sha256 recomputed: the sizes no longer agree with each other."""
    path = copy(good, str(tmp_path / "n.h5"))
    with h5py.File(path, "r+") as f:
        f.attrs["n_samples"] = 2 * int(f.attrs["n_samples"])
        fix_header(f)
    with pytest.raises(ScheduleError, match="damaged schedule file: steps_per_epoch is"):
        Schedule.load(path)


@pytest.mark.parametrize("name,how,match", [
    ("ranks/0/load", "negative", "ranks/0/load holds -2, outside"),
    ("ranks/1/samples", "near", r"ranks/1/samples holds 30, outside \[0, 30\)"),
    ("demand/sample_blocks", "near", r"demand/sample_blocks holds 15, outside \[0, 15\)"),
    ("ranks/0/evict", "shuffled", r"rank 0 (evicts|loads) block \d+ at step \d+, which is"),
    ("ranks/1/samples", "shuffled", r"rank 1 trains sample \d+ at step \d+ of epoch position \d, which is not in"),
    ("ranks/1/load_count", "longer", r"ranks/1/load_count has shape \(\d+,\), expected"),
    ("demand/block_nbytes", "huge", "demand/block_nbytes holds 9223372036854775806, outside"),
])
def test_arrays_rewritten_with_checksum_are_caught(good, tmp_path, name, how, match):
    """Damage whose sha256 attribute was recomputed: the validation, not the checksum, names it."""
    path = copy(good, str(tmp_path / "v.h5"))
    with h5py.File(path, "r+") as f:
        replace_dataset(f, name, mutated(f[name][()], how, 1, 30 if name.endswith("samples") else 15), True)
    with pytest.raises(ScheduleError, match="damaged schedule file: (" + match + ")"):
        with Schedule.load(path) as s:
            for r in range(s.world_size):
                s.rank(r)


# ------------------------------------------------------------ bytes: in a child process
def fuzz_bytes(good_path: str, work: str, examples: str):
    """Flip bytes of / truncate the file at ``good_path`` (hypothesis, ``examples`` cases), using each.
    Offsets: anywhere, in the first 4 KiB (superblock, root group) or near the header attributes."""
    raw = open(good_path, "rb").read()
    size = len(raw)
    attrs = raw.find(b"format\x00")
    where = st.one_of(st.integers(0, size - 1), st.integers(0, min(4095, size - 1)),
                      st.integers(max(0, attrs - 256), min(size - 1, attrs + 256)))
    flips = st.lists(st.tuples(where, st.integers(1, 255)), min_size=1, max_size=6)

    @settings(max_examples=int(examples), database=None, **FUZZ)
    @given(flips=flips, cut=st.one_of(st.none(), st.integers(0, size - 1)))
    def check(flips, cut):
        bad = bytearray(raw)
        for off, x in flips:
            bad[off % size] ^= x
        if cut is not None:
            bad = bad[:cut]
        path = os.path.join(work, "b.h5")
        with open(path, "wb") as f:
            f.write(bytes(bad))
        use(path)

    check()


def in_child(func: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``func(*args)`` of this module in a child Python (libhdf5 parses the damaged bytes there)."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, sys.argv[1]); import test_schedule_fuzz as t; t.{func}(*sys.argv[2:])"
    return subprocess.run([sys.executable, "-c", code, here, *args], capture_output=True, text=True, timeout=600)


def test_byte_flips_and_truncation(good, tmp_path):
    res = in_child("fuzz_bytes", good, str(tmp_path), "150")
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"


def print_use(path: str):
    print(use(path))


def test_damaged_attribute_datatype_is_refused(good, tmp_path):
    """One byte changed in the first header attribute's message (in a version-1 object header, the
    datatype of the variable-length 'format' string: libhdf5 crashed reading it).  Schedules are
    now written with checksummed HDF5 metadata and fixed-length strings: a clear error."""
    raw = bytearray(open(good, "rb").read())
    raw[raw.find(b"format\x00") + 9] ^= 27
    path = str(tmp_path / "attr.h5")
    open(path, "wb").write(bytes(raw))
    res = in_child("print_use", path)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stderr[-4000:]}"
    assert "damaged" in res.stdout, res.stdout
