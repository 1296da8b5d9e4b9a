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
    assert resolve(1, io.StringIO()) == "lines" and resolve(0) is None
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
    with Lines(25, "plan solar", "epoch", stream=out, every_s=10, clock=clock) as c:
        for _ in range(25):
            clock.t += 1
            c.update()
    assert out.getvalue().splitlines() == ["plan solar: 10/25 epochs (10 s)", "plan solar: 20/25 epochs (20 s)",
                                           "plan solar: 25/25 epochs, done in 25 s"]


def test_a_counter_stopped_early_says_where_not_done():
    out, clock = io.StringIO(), Clock()
    try:
        with Lines(20, "plan solar", "epoch", stream=out, every_s=10, clock=clock) as c:
            for _ in range(16):
                clock.t += 1
                c.update()
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert out.getvalue().splitlines()[-1] == "plan solar: stopped at 16/20 epochs after 16 s"
    out, clock = io.StringIO(), Clock()
    for i, _ in enumerate(each_lines(range(20), out, clock)):
        clock.t += 1
        if i == 15:
            break  # a consumer that stops
    assert out.getvalue().splitlines()[-1].startswith("x: stopped at 15/20 items")


def each_lines(it, out, clock):
    with Lines(20, "x", "item", stream=out, every_s=10, clock=clock) as c:
        for x in it:
            yield x
            c.update()


def test_lines_are_spaced_across_counters():
    """Several short counters one after the other (simulate's policies and buffer sizes) still print every 10 s."""
    out, clock = io.StringIO(), Clock()
    for k in range(6):
        with Lines(4, f"plan p{k}", "epoch", stream=out, every_s=10, clock=clock) as c:
            for _ in range(4):
                clock.t += 1
                c.update()
    lines = out.getvalue().splitlines()
    assert [ln for ln in lines if "done" not in ln] == ["plan p2: 2/4 epochs (2 s)", "plan p4: 4/4 epochs (4 s)"], lines


def test_bad_progress_values_are_refused_before_any_work(tmp_path):
    import solar
    from solar.errors import SpecError
    from solar.gen import GenConfig
    from solar.progress import check
    assert check(1) == 1 and check(0) == 0 and GenConfig(progress=0).progress == 0  # bool-like values pass
    with pytest.raises(SpecError, match="'bogus'"):
        solar.plan(str(tmp_path / "nothing-here"), world_size=1, local_batch=1, epochs=1, buffer_fraction=0.5,
                   progress="bogus")
    with pytest.raises(SpecError, match="'bogus'"):
        GenConfig(progress="bogus")


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


def test_a_kernel_compiling_for_long_is_said_once_and_one_loaded_says_nothing(capsys):
    """The first run after an install compiles numba kernels for a minute with nothing else on stderr: one line
    says so where compiling goes on past the delay; nothing where no kernel compiles (loaded from numba's cache,
    or already in the process), nor with progress off."""
    import threading

    import numba

    from solar.progress import compile_notice

    @numba.njit(cache=False)
    def kernel(x):
        return x + 1

    def slow_compile():  # a compile that is still going on when the delay ends
        release = threading.Event()
        threading.Timer(0.3, release.set).start()
        from numba.core import event
        with event.trigger_event("numba:compile", data={"dispatcher": None, "args": (), "return_type": None}):
            release.wait(5)

    with compile_notice("plan solar", "lines", after_s=0.05):
        slow_compile()
    err = capsys.readouterr().err
    assert err.count("plan solar: compiling numba kernels") == 1, err
    kernel(1)
    with compile_notice("plan solar", "lines", after_s=0.05):
        kernel(2)  # compiled already: nothing compiles
        threading.Event().wait(0.2)
    assert capsys.readouterr().err == ""
    with compile_notice("plan solar", False, after_s=0.0):
        slow_compile()
    assert capsys.readouterr().err == ""
    with compile_notice("plan solar", "lines", after_s=0.05):  # a compile that ended before the delay, then work
        from numba.core import event
        with event.trigger_event("numba:compile", data={"dispatcher": None, "args": (), "return_type": None}):
            pass
        threading.Event().wait(0.2)
    assert capsys.readouterr().err == ""
