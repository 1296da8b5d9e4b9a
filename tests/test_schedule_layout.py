"""The layout stored in the schedule (format version 3): equal to the one built from HDF5, used by the
loader instead of the HDF5 metadata, covered by the checksums, and the data checked against it
(verify_data fast / strict / off)."""
import json
import os
import shutil

import h5py
import numpy as np
import pytest

import solar
import solar.layout
import solar.layout.build
import solar.layout.h5meta
from solar.cli import main
from solar.layout import load_layout
from solar.layout.parts import PART_ARRAYS, chunks_of, is_parts, split_chunks
from solar.schedule.summary import format_schedule
from solar.loader import SolarLoader
from solar.schedule import Schedule, ScheduleError
from solar.schedule.format import array_digest, header_digest
from solar.scheduler import Demand

from helpers import assert_same_sample, h5py_sample, make_dataset

LAYOUT_STATE = ("files", "datasets", "block_shapes", "sources", "spec", "fingerprint")
LAYOUT_ARRAYS = ("sample_ptr", "sample_blocks", "block_dataset", "block_offset", "block_stored", "block_nbytes",
                 "block_mask", "dataset_block_start", "source_start")


def plan_of(data, out, world_size=2):
    solar.plan(data, world_size=world_size, local_batch=1, epochs=2, buffer_per_rank="64MiB", out=str(out)).close()
    return str(out)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """(plan, data) of a 3-file one-sample-per-file dataset (gzip chunks, so masks and filters are stored)."""
    root = tmp_path_factory.mktemp("stored")
    data = make_dataset(root, "cosmoflow", "gzip")
    return plan_of(data, root / "plan.h5"), data


def fresh_job(tmp_path, preset="cosmoflow", storage="contiguous"):
    data = make_dataset(tmp_path, preset, storage)
    return plan_of(data, tmp_path / "plan.h5"), data


def forbid_hdf5_metadata(monkeypatch):
    """Make every way of building a layout from HDF5 metadata raise."""
    def boom(*a, **k):
        raise AssertionError("HDF5 metadata read")
    for mod, name in ((solar.layout, "build_layout"), (solar.layout, "load_layout"),
                      (solar.layout.build, "build_layout"), (solar.layout.build, "open_h5"),
                      (solar.layout.build, "read_dataset_info"), (solar.layout.h5meta, "read_dataset_info")):
        monkeypatch.setattr(mod, name, boom)


def flip_byte(path, dataset, at=0):
    """Flip one byte of ``dataset``'s stored bytes in the file (not through HDF5)."""
    with h5py.File(path, "r") as f:
        off = f[dataset].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(off + at)
        b = fh.read(1)
        fh.seek(off + at)
        fh.write(bytes([b[0] ^ 0x40]))


def rewrite(path, dataset, arr):
    """Replace ``dataset`` with ``arr`` and fix its checksum (only the consistency checks can catch it)."""
    with h5py.File(path, "r+") as f:
        del f[dataset]
        f.create_dataset(dataset, data=arr)
        f[dataset].attrs["sha256"] = array_digest(arr)


# ------------------------------------------------------------------ stored = built
@pytest.mark.parametrize("preset,storage", [("ptychonn", "gzip"), ("well", "chunked"), ("pdebench-mult", "lzf"),
                                            ("cosmoflow", "contiguous"), ("pdebench", "multi")])
@pytest.mark.parametrize("parts", [None, False])
def test_stored_layout_equals_the_built_one(tmp_path, preset, storage, parts):
    """The stored layout is the one planned: by default cut into parts of chunks where a chunk holds several
    samples' rows (:mod:`solar.layout.parts`, arrays ``block_parent`` and ``part_offset`` included), whole
    chunks with ``parts=False``."""
    data = make_dataset(tmp_path, preset, storage)
    path = tmp_path / "p.h5"
    solar.plan(data, world_size=1, local_batch=1, epochs=1, buffer_per_rank="64MiB", out=str(path),
               parts=parts).close()
    built = load_layout(data)
    if parts is None:
        built = split_chunks(built) or built
    with Schedule.load(str(path)) as s:
        assert s.version >= 3 and s.has_layout and s.layout_bytes > 0
        stored = s.layout()
        assert s.fingerprint == built.fingerprint
        summary = s.summary()  # solar plan / solar inspect say a plan on parts cut which chunks
        assert summary["parts_of_chunks"] == (chunks_of(built).n_blocks if is_parts(built) else None)
        assert ("parts of" in format_schedule(summary)) == is_parts(built)
    for name in LAYOUT_STATE:
        assert getattr(stored, name) == getattr(built, name), name
    for name in LAYOUT_ARRAYS + (PART_ARRAYS if is_parts(built) else ()):
        a, b = getattr(stored, name), getattr(built, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert is_parts(stored) == is_parts(built)
    if (preset, storage) == ("ptychonn", "gzip"):  # 3 samples a chunk
        assert is_parts(stored) == (parts is None)


def test_loader_reads_no_hdf5_metadata_and_batches_equal_h5py(job, monkeypatch):
    plan, data = job
    ref_layout = load_layout(data)
    forbid_hdf5_metadata(monkeypatch)
    with SolarLoader(plan, rank=1, reader="pread", as_torch=False) as loader:
        seen = 0
        for e in range(loader.epochs):
            loader.set_epoch(e)
            for batch in loader:
                for i, sample in enumerate(batch["index"]):
                    ref = h5py_sample(ref_layout, int(sample))
                    assert_same_sample({k: batch[k][i] for k in ref}, ref)
                    seen += 1
    assert seen == 2 * 2  # 3 samples on 2 ranks: 2 per rank per epoch (padding), 2 epochs


def test_explicit_data_is_built_and_matched_by_fingerprint(job, tmp_path):
    plan, data = job
    with SolarLoader(plan, data, rank=0, as_torch=False) as loader:
        assert loader.layout.fingerprint == loader.schedule.fingerprint
    other = make_dataset(tmp_path, "cosmoflow", "gzip", seed=1)
    with pytest.raises(ScheduleError, match="planned for another dataset"):
        SolarLoader(plan, other, rank=0)


# ------------------------------------------------------------------ damage
@pytest.mark.parametrize("name", ["document", "files", "ds_cols", "block_offset", "file_mtime_ns", "src_ints"])
def test_flipped_byte_in_the_stored_layout_is_caught(job, tmp_path, name):
    path = str(tmp_path / "p.h5")
    shutil.copy(job[0], path)
    flip_byte(path, f"layout/{name}")
    with Schedule.load(path) as s:
        with pytest.raises(ScheduleError, match=f"checksum mismatch in layout/{name}: the file is damaged"):
            s.layout()


@pytest.mark.parametrize("name,value,msg", [
    ("ds_cols", 99, "a row of table"), ("src_datasets", 7, "a source's dataset outside"),
    ("block_offset", -5, "a block offset outside"), ("dataset_block_start", 9, "dataset_block_start"),
])
def test_inconsistent_stored_layout_with_fixed_checksum_is_refused(job, tmp_path, name, value, msg):
    path = str(tmp_path / "p.h5")
    shutil.copy(job[0], path)
    with h5py.File(path, "r") as f:
        arr = f[f"layout/{name}"][()]
    arr.reshape(-1)[-1] = value
    rewrite(path, f"layout/{name}", arr)
    with Schedule.load(path) as s:
        with pytest.raises(ScheduleError, match=f"{path}: damaged schedule file: layout: .*{msg}"):
            s.layout()


def test_layout_bytes_attribute_is_covered_by_the_header_checksum(job, tmp_path):
    path = str(tmp_path / "p.h5")
    shutil.copy(job[0], path)
    with h5py.File(path, "r+") as f:
        f.attrs["layout_bytes"] = 0
    with pytest.raises(ScheduleError, match="header checksum mismatch"):
        Schedule.load(path)


# ------------------------------------------------------------------ verification
def test_fast_check_names_a_touched_file(tmp_path):
    plan, data = fresh_job(tmp_path)
    victim = sorted(load_layout(data).files)[1]
    st = os.stat(victim)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ScheduleError, match=f"data file {victim} was modified since planning .* re-run solar plan"):
        SolarLoader(plan, rank=0)
    with SolarLoader(plan, rank=0, verify_data="off", as_torch=False) as loader:  # off: the user's risk
        assert loader.layout.files


def test_fast_check_names_grown_and_missing_files(tmp_path):
    plan, data = fresh_job(tmp_path)
    files = sorted(load_layout(data).files)
    st = os.stat(files[0])
    with open(files[0], "ab") as fh:
        fh.write(b"x" * 10)
    os.remove(files[2])
    with pytest.raises(ScheduleError, match=rf"data file {files[0]} has [\d,]+ bytes, [\d,]+ when planned "
                                            rf"\(and 1 more files\)"):
        SolarLoader(plan, rank=0)
    os.truncate(files[0], st.st_size)
    os.utime(files[0], ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ScheduleError, match=f"data file {files[2]} is missing"):
        SolarLoader(plan, rank=0)


def test_strict_check_catches_what_sizes_and_mtimes_miss(tmp_path):
    """Two same-shaped datasets swap names, size and mtime restored: fast mode cannot see it (the reads
    would come from the other dataset), strict mode rebuilds the block map and refuses."""
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(40, dtype="f4").reshape(8, 5))
        f.create_dataset("y", data=-np.arange(40, dtype="f4").reshape(8, 5))
    solar.layout.LayoutSpec("rows", ("d.h5",), ("x",), root=str(tmp_path)).save(str(tmp_path))
    plan = plan_of(str(tmp_path), tmp_path / "plan.h5", world_size=1)
    st = os.stat(path)
    with h5py.File(path, "r+") as f:
        f.move("x", "t")
        f.move("y", "x")
        f.move("t", "y")
    assert os.path.getsize(path) == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    SolarLoader(plan, rank=0, verify_data="fast").close()
    with pytest.raises(ScheduleError, match="planned for another dataset or an older version of it"):
        SolarLoader(plan, rank=0, verify_data="strict")


def test_strict_builds_from_hdf5_and_fast_does_not(job, monkeypatch):
    calls = []
    real = solar.layout.build_layout
    monkeypatch.setattr(solar.layout, "build_layout", lambda spec, **k: calls.append(spec) or real(spec, **k))
    SolarLoader(job[0], rank=0, verify_data="fast").close()
    assert calls == []
    SolarLoader(job[0], rank=0, verify_data="strict").close()
    assert len(calls) == 1


@pytest.mark.parametrize("kw,msg", [({"verify_data": "quick"}, "verify_data must be one of .* got 'quick'"),
                                    ({"verify_data": True}, "verify_data must be one of .* got True"),
                                    ({"verify_scope": "rack"}, "verify_scope must be one of .* got 'rack'")])
def test_bad_verify_option_names_the_value(job, kw, msg):
    with pytest.raises(solar.SpecError, match=msg):
        SolarLoader(job[0], rank=0, **kw)


# ------------------------------------------------------------------ paths
def test_moved_together_the_data_is_found_relative_to_the_schedule(tmp_path):
    fresh_job(tmp_path / "a")
    moved = tmp_path / "b"
    os.rename(tmp_path / "a", moved)  # rename keeps mtimes: the fast check passes
    with SolarLoader(str(moved / "plan.h5"), rank=0, as_torch=False) as loader:
        assert all(f.startswith(str(moved)) for f in loader.layout.files)
        loader.set_epoch(0)
        assert sum(len(b["index"]) for b in loader) == 2


def test_missing_data_folder_names_both_places(tmp_path):
    plan, data = fresh_job(tmp_path)
    shutil.rmtree(data)
    with Schedule.load(plan) as s:
        with pytest.raises(ScheduleError, match=f"data folder it was planned for is neither at .* nor at '{data}'"):
            s.layout()


# ------------------------------------------------------------------ versions, planning, inspect
def as_version_2(src, dst):
    """A copy of a version-3 schedule as version 2 wrote it (no /layout, no layout_bytes)."""
    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        del f["layout"]
        del f.attrs["layout_bytes"]
        f.attrs["version"] = 2
        f.attrs["header_sha256"] = np.array(header_digest(f.attrs, 2).encode(), dtype="S64")
    return str(dst)


def test_version_2_files_build_the_layout_from_hdf5(job, tmp_path, monkeypatch):
    old = as_version_2(job[0], tmp_path / "v2.h5")
    with Schedule.load(old) as s:
        assert s.version == 2 and not s.has_layout
        with pytest.raises(ScheduleError, match="stores no layout .*re-run solar plan"):
            s.layout()
    with SolarLoader(old, rank=0, as_torch=False) as loader:
        assert loader.layout.fingerprint == loader.schedule.fingerprint
    forbid_hdf5_metadata(monkeypatch)
    with pytest.raises(AssertionError, match="HDF5 metadata read"):
        SolarLoader(old, rank=0)


def test_a_plan_from_a_demand_stores_no_layout():
    with solar.plan(Demand.synthetic(64, 100), world_size=2, local_batch=4, epochs=1, buffer_fraction=0.5) as s:
        assert s.version >= 3 and not s.has_layout and s.layout_bytes == 0


def test_a_file_changed_after_the_layout_was_built_is_refused(tmp_path):
    data = make_dataset(tmp_path, "cosmoflow", "contiguous")
    layout = load_layout(data)
    with open(layout.files[0], "ab") as fh:
        fh.write(b"\0")
    with pytest.raises(solar.LayoutError, match="changed while it was planned"):
        solar.plan(layout, world_size=1, local_batch=1, epochs=1, buffer_per_rank="64MiB", out=str(tmp_path / "p.h5"))
    assert not os.path.exists(tmp_path / "p.h5")


def test_inspect_says_whether_the_layout_is_stored(job, tmp_path, capsys):
    assert main(["inspect", job[0]]) == 0
    assert "layout: stored in the schedule (" in capsys.readouterr().out
    assert main(["inspect", job[0], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout_bytes"] > 0
    assert main(["inspect", as_version_2(job[0], tmp_path / "v2.h5")]) == 0
    assert "layout: not stored (format version 2): every rank builds it" in capsys.readouterr().out


def test_a_job_planned_on_parts_resumes_on_parts_and_says_why_not_otherwise(tmp_path):
    """A checkpointed job planned on parts of chunks resumes on parts (by default); asked for whole chunks
    (``parts=False``, or a policy that does not keep parts) it gets one line saying so, not "another dataset"."""
    from solar.errors import SpecError
    data = make_dataset(tmp_path, "ptychonn", "gzip", samples=24)
    with solar.plan(data, world_size=2, local_batch=2, epochs=3, buffer_fraction=0.3, out=str(tmp_path / "a.h5")) as s:
        assert is_parts(s.layout())
        state = {"fingerprint": s.fingerprint, "world_size": 2, "config": s.config.to_dict(), "policy": "solar",
                 "step": s.steps_per_epoch + 1, "open_ended": False}
    with solar.plan(data, world_size=1, resume_from=state, buffer_fraction=0.3, out=str(tmp_path / "b.h5")) as s:
        assert is_parts(s.layout()) and s.start_step == state["step"]
    for kw in (dict(parts=False), dict(policy="nopfs")):
        with pytest.raises(SpecError, match="planned on parts of chunks"):
            solar.plan(data, world_size=1, resume_from=state, buffer_fraction=0.3, out=str(tmp_path / "c.h5"), **kw)


def test_an_open_ended_plan_of_a_demand_with_parts_is_refused(tmp_path):
    """The file of a plan made from a Demand stores no layout, so not the extents its next windows need."""
    from solar.errors import SpecError
    from solar.scheduler.run import Demand
    data = make_dataset(tmp_path, "ptychonn", "gzip", samples=24)
    demand = Demand.from_layout(split_chunks(load_layout(data)))
    with pytest.raises(SpecError, match="open-ended plan of a Demand"):
        solar.plan(demand, world_size=1, local_batch=2, epochs="auto", buffer_fraction=0.5)
    solar.plan(demand, world_size=1, local_batch=2, epochs=2, buffer_fraction=0.5).close()
