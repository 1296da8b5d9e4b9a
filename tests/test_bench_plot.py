"""`solar bench --plot`: the report drawn (samples/s of every loader with solar's limits, solar's storage bytes),
and a bad --plot refused before anything is measured."""
import glob
import json
import os
import subprocess
import sys

import pytest

from helpers import make_dataset

pytest.importorskip("matplotlib")
from solar.bench.plot import loaders, plot_report, title  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
REPORTS = sorted(glob.glob(os.path.join(REPO, "docs", "bench-2026-11-27", "*.json"))) + \
    sorted(glob.glob(os.path.join(REPO, "docs", "gpu-2026-11-26", "run3-bench-conv.json")))


@pytest.mark.parametrize("path", REPORTS, ids=os.path.basename)
def test_recorded_reports_are_drawn(tmp_path, path):
    with open(path) as f:
        rep = json.load(f)
    out = str(tmp_path / "b.png")
    plot_report(rep, out)
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    names = [n for n, _ in loaders(rep)]
    assert names[0] == "solar" and set(names[1:]) == {k for k, v in rep["baselines"].items() if "epochs" in v}
    assert f"local batch {rep['local_batch']}" in title(rep)


def test_a_bad_plot_path_is_refused_before_the_run(tmp_path):
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=8)
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "solar", "bench", data, "--no-progress",
                        "--plot", str(tmp_path / "no" / "b.png")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.strip().splitlines() == [f"solar bench: error: --plot {str(tmp_path / 'no' / 'b.png')!r}: folder "
                                             f"{tmp_path / 'no'} does not exist"], r.stderr


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_a_plot_path_that_cannot_be_written_is_refused_first():
    from solar.cli.argtypes import check_plot_path
    from solar.errors import SpecError
    with pytest.raises(SpecError, match=r"--plot '/proc/x.png': cannot write in /proc"):
        check_plot_path("/proc/x.png")
    with pytest.raises(SpecError, match="--plot needs a file name, got an empty one"):
        check_plot_path("")


def test_an_existing_figure_is_kept_by_the_check(tmp_path):
    from solar.cli.argtypes import check_plot_path
    fig = tmp_path / "b.png"
    fig.write_bytes(b"mine")
    assert check_plot_path(str(fig)) == str(fig) and fig.read_bytes() == b"mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.png"]  # the write probe left nothing


def test_without_matplotlib_plot_says_what_to_install(monkeypatch):
    from solar.cli.argtypes import check_plot_path
    from solar.errors import SpecError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SpecError, match=r"--plot needs matplotlib .*pip install 'solar-hdf5\[plot\]'"):
        check_plot_path("b.png")


def test_the_bench_draws_its_own_report(tmp_path):
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=16)
    png = str(tmp_path / "b.png")
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "solar", "bench", data, "--no-progress", "--json",
                        "--epochs", "2", "-b", "4", "--only", "solar", "--plot", png, "--schedule",
                        str(tmp_path / "s.h5")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout)  # stdout stays the JSON alone
    assert f"solar bench: plot: {png}" in r.stderr
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
