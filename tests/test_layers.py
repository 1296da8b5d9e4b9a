"""Data flows one way: layout -> planner -> schedule -> buffer <- readers -> torch.  The planner
(``solar.scheduler``) and the schedule layer (``solar.schedule``) never import the buffer; the memory
model both share (``solar.memory``) sits below them and imports neither (issue 24, item 3)."""
import ast
import json
import os
import subprocess
import sys

import pytest

import solar
from helpers import make_dataset

ROOT = os.path.dirname(os.path.abspath(solar.__file__))
#: what each package may not import, at module level or inside a function
FORBIDDEN = {
    "schedule": ("solar.buffer",),
    "scheduler": ("solar.buffer",),
    "memory": ("solar.buffer", "solar.schedule", "solar.scheduler", "solar.loader", "solar.torch", "solar.io",
               "solar.bench", "solar.cli"),
}


def _imports(path: str, package: str):
    """``(line, module)`` of every import in ``path`` (a module of ``package``, e.g. ``solar.schedule``),
    relative imports resolved; ``from X import y`` also yields ``X.y`` (``y`` may be a module)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module
            yield node.lineno, mod
            for a in node.names:
                yield node.lineno, f"{mod}.{a.name}"


def _violations(sub: str):
    folder = os.path.join(ROOT, sub)
    out = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            path = os.path.join(folder, name)
            for line, mod in _imports(path, f"solar.{sub}"):
                if any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN[sub]):
                    out.append(f"solar/{sub}/{name}:{line} imports {mod}")
    return sorted(set(out))


def test_import_scan_resolves_relative_imports():
    """The scan itself: ``from ..buffer.x import y`` in solar/schedule is solar.buffer.x (and .y)."""
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("def f():\n    from ..buffer.sizing import a\n    from . import make\nimport numpy\n")
    try:
        got = set(m for _, m in _imports(f.name, "solar.schedule"))
    finally:
        os.unlink(f.name)
    assert {"solar.buffer.sizing", "solar.buffer.sizing.a", "solar.schedule", "solar.schedule.make",
            "numpy"} <= got


@pytest.mark.parametrize("sub", sorted(FORBIDDEN))
def test_layer_imports_nothing_below_or_beside_it(sub):
    """No import of solar.buffer (and, for solar.memory, of any layer above it) anywhere in the package's
    modules, lazy imports inside functions included."""
    assert _violations(sub) == []


def test_planning_and_summaries_load_no_buffer(tmp_path):
    """Planning a job (one buffer per rank, and node-shared), and summarizing its memory as ``solar plan``
    and ``solar inspect`` do, in a fresh interpreter: no ``solar.buffer`` module is ever loaded."""
    data = make_dataset(tmp_path, "ptychonn")
    code = f"""
import json, sys
import solar
from solar.schedule.summary import format_schedule
for kw, out in (({{}}, "rank.h5"), ({{"ranks_per_node": 2}}, "node.h5")):
    with solar.plan({data!r}, world_size=2, local_batch=2, epochs=2, buffer_fraction=0.5,
                    out={str(tmp_path)!r} + "/" + out, **kw) as s:
        summ = s.summary()
        assert "error" not in summ["memory_per_rank"], summ["memory_per_rank"]
        format_schedule(summ)
print(json.dumps(sorted(m for m in sys.modules if m == "solar.buffer" or m.startswith("solar.buffer."))))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []
