"""Every command README.md shows runs as shown (issue 26): on small data, in order, in a fresh folder.

The commands are read from the README itself (its indented command lines and its ```python blocks), so a
command added or changed there is run here.  The only changes: ``solar gen`` writes the same number of
samples with a small spatial edge (``--size``), so that every ratio of buffer to batch stays what the
README's sizes give and the run takes a minute, not an hour; ``some_file.h5`` is a real NeXus file written
by another tool (tests/data).  Not run: ``make demo`` and ``make test`` (CI runs both), ``. .venv/bin/activate``
(the venv's bin is on PATH here), the install commands of "Installing on a cluster" (no network), and what
needs CUDA (``--device cuda``).  Also checked: the lines of ``solar inspect``'s output that the README
quotes are what it prints (numbers aside: the data here is smaller).
"""
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
README = os.path.join(ROOT, "README.md")
BIN = os.path.dirname(sys.executable)

#: spatial edge per preset for ``solar gen`` here (the README's sample counts are kept)
SMALL_SIZE = {"ptychonn": 16, "well": 8, "pdebench": 16, "cosmoflow": 16}
STARTS = ("solar ", "mpiexec ", "make ", ". ", "python ", "pip ", "MPICC=")
LIMIT_S = 600


def readme_commands(text: str):
    """``(kind, command)`` in README order: ``("shell", line)`` for each indented command line (comment cut),
    ``("python", code)`` for each fenced python block."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```python"):
            j = lines.index("```", i + 1)
            out.append(("python", "\n".join(lines[i + 1:j])))
            i = j + 1
            continue
        if line.startswith("    ") and line.strip().startswith(STARTS):
            out.append(("shell", " ".join(shlex.split(line.strip(), comments=True))))
        i += 1
    return out


def skip_reason(cmd: str):
    if cmd in ("make demo", "make test"):
        return "CI runs it"
    if cmd.startswith(". "):
        return "the venv's bin is on PATH here"
    if cmd.startswith(("pip ", "MPICC=")):
        return "installs from the network"
    if "--device cuda" in cmd:
        return "needs CUDA"
    return None


def small(cmd: str) -> str:
    """The command as run here: ``solar gen`` with a small spatial edge."""
    args = shlex.split(cmd)
    if args[:2] == ["solar", "gen"] and "--size" not in args:
        args += ["--size", str(SMALL_SIZE[args[2]]), "--no-progress"]
    return shlex.join(args)


def test_readme_parses_into_the_commands_it_shows():
    cmds = readme_commands(open(README).read())
    shell = [c for k, c in cmds if k == "shell"]
    assert "make demo" in shell and "make test" in shell
    assert any(c.startswith("solar simulate data/ptycho") for c in shell)
    assert any(c.startswith("mpiexec -n 2 solar bench") for c in shell)
    assert sum(k == "python" for k, _ in cmds) == 2
    assert not any("#" in c for c in shell)  # comments cut


@pytest.mark.slow
def test_every_readme_command_runs_as_shown(tmp_path):
    text = open(README).read()
    work = tmp_path / "work"
    work.mkdir()
    os.symlink(os.path.join(ROOT, "examples"), work / "examples")  # the README runs from the checkout
    shutil.copy(os.path.join(HERE, "data", "nexpy_example.nxs"), work / "some_file.h5")  # another tool's file
    env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""),
               SOLAR_CACHE_DIR=str(tmp_path / "cache"), MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    env.pop("MASTER_PORT", None)  # as a user runs them: under mpiexec rank 0 picks a free port and sends it over MPI
    ran, skipped, outputs = [], [], {}
    for n, (kind, cmd) in enumerate(readme_commands(text)):
        if kind == "python":
            script = work / f"readme_{n}.py"
            script.write_text(cmd + "\n")
            # the training snippet runs under the launcher the README names (2 ranks: plan.h5's world size)
            argv = [os.path.join(BIN, "mpiexec"), "-n", "2", sys.executable, str(script)] \
                if "init_distributed" in cmd else [sys.executable, str(script)]
        else:
            why = skip_reason(cmd)
            if why:
                skipped.append((cmd, why))
                continue
            argv = ["bash", "-c", small(cmd)]
        r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=LIMIT_S)
        shown = cmd if kind == "shell" else f"python block {n}"
        assert r.returncode == 0, f"{shown}\nexit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        assert "Traceback" not in r.stderr and ": error:" not in r.stderr, f"{shown}\n{r.stderr[-3000:]}"
        outputs[cmd] = r.stdout
        ran.append(shown)
    assert len(ran) >= 19, ran  # what the README shows today
    assert {c for c, _ in skipped} >= {"make demo", "make test"}, skipped
    assert not [f for f in os.listdir(work / "data" / "ptycho") if f.startswith(".")]  # nothing hidden left there
    assert os.listdir(tmp_path / "cache" / "bench")  # the bench's schedules went to the cache folder
    check_quoted_inspect_lines(text, outputs["solar inspect data/ptycho"])


NUMBER = re.compile(r"\d[\d,]*(\.\d+)?( ?[KMGT]?i?B)?")


def check_quoted_inspect_lines(text: str, printed: str):
    """The lines the README quotes from ``solar inspect`` on the gzip file are lines it prints, with the
    numbers of the README's own data (masked here: the file here is smaller)."""
    lines = text.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("`solar inspect` on the gzip file above prints"))
    quoted = []
    for ln in lines[at + 1:]:
        if quoted and not ln.strip():
            break
        if ln.startswith("    "):
            quoted.append(ln.strip())
    assert len(quoted) == 3, quoted
    got = {NUMBER.sub("#", ln.strip()) for ln in printed.splitlines()}
    for q in quoted:
        assert NUMBER.sub("#", q) in got, f"README quotes {q!r}; solar inspect prints:\n{printed}"
