"""Layout build over many files in worker processes (issue 12, item 4): same layout as one process."""
import os

import numpy as np
import pytest

import solar
from solar.errors import LayoutError, SpecError
from solar.layout import find_spec
from solar.layout.build import build_layout, fingerprint, merge_scans, scan_file
from solar.layout.scan_pool import _Pool, chunk_bounds, default_workers, scan_files

from helpers import make_dataset

ARRAYS = ("block_dataset", "block_offset", "block_stored", "block_nbytes", "block_mask", "dataset_block_start",
          "source_start", "sample_ptr", "sample_blocks")


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("par")
    return {"whole": make_dataset(root, "cosmoflow", samples=40, size=4),
            "rows": make_dataset(root, "ptychonn", "multi"),
            "windows": make_dataset(root, "well", "chunked"),
            "groups": make_dataset(root, "pdebench-mult", "gzip")}


def helper_scans(spec, paths):
    """Every chunk read by one helper process (this process takes none)."""
    pool = _Pool(spec, paths, 4, None)
    pool.helper()
    out = []
    for r in pool.results:
        if r is None:  # never handed out: only after a failed chunk
            assert pool.stop
            continue
        if r[0] != "ok":
            raise r[1]
        out.extend(r[1])
    assert len(out) == len(paths), "the helper did not answer every chunk"
    return out


def assert_same_layout(a, b):
    assert a.fingerprint == b.fingerprint
    assert a.files == b.files and a.datasets == b.datasets and a.sources == b.sources
    assert a.block_shapes == b.block_shapes
    for name in ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name


@pytest.mark.parametrize("kind", ["whole", "rows", "windows", "groups"])
def test_helper_process_scans_give_the_serial_layout(datasets, kind):
    spec = find_spec(datasets[kind])
    serial = build_layout(spec, workers=1)
    paths = spec.resolve_files()
    files, stats, dsets, shapes, sources, arrays = merge_scans(spec, helper_scans(spec, paths))
    assert tuple(files) == serial.files and tuple(dsets) == serial.datasets and tuple(sources) == serial.sources
    for name in ARRAYS:
        assert np.array_equal(arrays[name], getattr(serial, name)), name
    # the file sizes/mtimes seen by the scan are the ones a fresh stat gives: the fingerprint is unchanged
    assert fingerprint(spec, files, dsets, arrays, stats) == fingerprint(spec, files, dsets, arrays) \
        == serial.fingerprint


def test_parallel_build_equals_serial(datasets, capsys):
    spec = find_spec(datasets["whole"])
    serial = build_layout(spec, workers=1)
    par = build_layout(spec, workers=2, progress="bar")
    assert_same_layout(serial, par)
    assert "layout" in capsys.readouterr().err  # the progress bar
    assert len(serial.files) == 40 and serial.n_samples == 40


def test_first_bad_file_in_order_is_named(datasets, tmp_path):
    src = datasets["whole"]
    names = sorted(n for n in os.listdir(src) if n.endswith(".hdf5"))
    for n in names:
        os.symlink(os.path.join(src, n), tmp_path / n)
    for bad in (names[25], names[31]):
        os.unlink(tmp_path / bad)
        (tmp_path / bad).write_bytes(b"not hdf5" * 100)
    with open(os.path.join(src, "solar-layout.json")) as f:
        (tmp_path / "solar-layout.json").write_text(f.read())
    spec = find_spec(str(tmp_path))
    paths = spec.resolve_files()
    for run in (lambda: helper_scans(spec, paths), lambda: build_layout(spec, workers=2),
                lambda: build_layout(spec, workers=1)):
        with pytest.raises(LayoutError, match=rf"cannot open .*{names[25]} as HDF5"):
            run()


def test_one_stat_and_one_open_per_file(datasets, monkeypatch):
    spec = find_spec(datasets["whole"])
    paths = set(spec.resolve_files())
    stats, opens = [], []
    real_stat = os.stat
    import solar.layout.build as build

    def counting_stat(p, *a, **k):
        if p in paths:
            stats.append(p)
        return real_stat(p, *a, **k)

    real_open = build.open_readonly

    def counting_open(p, *a, **k):
        opens.append(p)
        return real_open(p, *a, **k)

    monkeypatch.setattr(os, "stat", counting_stat)
    monkeypatch.setattr(build, "open_readonly", counting_open)
    scans = [scan_file(spec, p) for p in sorted(paths)]
    build.merge_scans(spec, scans)
    assert sorted(stats) == sorted(paths) and sorted(opens) == sorted(paths)


def test_worker_count(monkeypatch):
    assert default_workers(10, env={}) == 1  # too few files for a helper
    assert default_workers(10**6, env={"SOLAR_LAYOUT_WORKERS": "3"}) == 3
    cpus = len(os.sched_getaffinity(0))
    assert default_workers(10**6, env={}) == cpus
    assert default_workers(10**6, env={"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0",
                                       "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) \
        == max(1, cpus // 4)
    with pytest.raises(SpecError, match="SOLAR_LAYOUT_WORKERS must be an integer >= 1, got '0'"):
        default_workers(100, env={"SOLAR_LAYOUT_WORKERS": "0"})
    with pytest.raises(SpecError, match="workers must be"):
        scan_files(None, [], workers=0)
    b = chunk_bounds(1000, 2)
    assert b[0][0] == 0 and b[-1][1] == 1000 and all(x[1] == y[0] for x, y in zip(b, b[1:]))


def test_helper_that_dies_gives_its_chunk_back(datasets, monkeypatch):
    spec = find_spec(datasets["whole"])
    paths = spec.resolve_files()
    pool = _Pool(spec, paths, 4, None)
    monkeypatch.setattr("solar.layout.scan_pool.sys.executable", "/bin/false")  # "helper" exits at once
    pool.helper()
    # every chunk it took (none, one or two, as fast as /bin/false exits) is given back, none is lost
    assert sorted(pool.returned) == list(range(pool.next)) and all(r is None for r in pool.results)
    scans = scan_files(spec, paths, workers=3)  # helpers that all die: this process reads everything
    assert [x.files for x in scans] == [x.files for x in scan_files(spec, paths, workers=1)]
    monkeypatch.undo()
    assert_same_layout(build_layout(spec, workers=1), solar.build_layout(spec))
