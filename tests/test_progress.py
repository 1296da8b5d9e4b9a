"""Progress on stderr: a bar on a terminal, plain lines in a log file or pipe (solar.progress), and the commands'
--no-progress."""
import io
import subprocess
import sys

import pytest

from solar.progress import Lines, each, resolve


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_modes():
    assert resolve(False) is None and resolve(None) is None
    assert resolve(True, Tty()) == "bar" and resolve(True, io.StringIO()) == "lines"
    assert resolve("lines") == "lines" and resolve("bar") == "bar"
    with pytest.raises(ValueError, match="'sometimes'"):
        resolve("sometimes")


def test_lines_come_at_most_every_interval_and_short_work_prints_nothing():
    out, clock = io.StringIO(), Clock()
    with Lines(100, "plan solar", "epoch", stream=out, every_s=10, clock=clock) as c:
        for _ in range(5):
            clock.t += 1
            c.update()
    assert out.getvalue() == ""  # 5 s: nothing
    out, clock = io.StringIO(), Clock()
    with Lines(100, "plan solar", "epoch", stream=out, every_s=10, clock=clock) as c:
        for _ in range(25):
            clock.t += 1
            c.update()
    assert out.getvalue().splitlines() == ["plan solar: 10/100 epochs (10 s)", "plan solar: 20/100 epochs (20 s)",
                                           "plan solar: 25/100 epochs, done in 25 s"]


def test_each_counts_the_items_done():
    got = list(each(range(3), 3, "x", "item", False))
    assert got == [0, 1, 2]


def test_plan_in_a_log_file_prints_its_progress_and_no_progress_silences_it(tmp_path, monkeypatch):
    """Run as a SLURM job would (stderr a file): lines come when the work is long (here every 0 s)."""
    from solar.gen import GenConfig, generate
    generate("ptychonn", str(tmp_path / "d"), GenConfig(samples=64, size=8))
    code = ("import solar.progress as p; p.LINE_EVERY_S = 0.0; import sys; from solar.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    base = [sys.executable, "-c", code, "plan", str(tmp_path / "d"), "-P", "2", "-b", "4", "--epochs", "3",
            "--buffer-fraction", "0.5", "-o", str(tmp_path / "p.h5")]
    r = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "plan solar: 3/3 epochs, done in" in r.stderr and "\r" not in r.stderr
    r = subprocess.run(base + ["--no-progress"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "epochs" not in r.stderr, r.stderr
