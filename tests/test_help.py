"""Help that helps (issue 26, item 10): every CLI option says what it is; help(solar) documents the entry points.

Before: `solar simulate -P/-b/--epochs/--seed/--drop-last` had no help text; help(solar) was 837 lines, 650
of them the methods every exception inherits from BaseException, and did not mention SolarLoader,
SolarDataset or H5Dataset; solar.plan's docstring said `epochs` was required where `solar plan` defaults
to `auto`.
"""
import argparse
import subprocess
import sys

import pytest

from solar.cli import build_parser


def subcommands():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("name", ["gen", "inspect", "simulate", "plan", "bench"])
def test_every_option_has_help(name):
    p = subcommands()[name]
    bare = [a.option_strings or [a.dest] for a in p._actions if not a.help]
    assert not bare, f"solar {name}: no help text for {bare}"
    assert p.format_help().count("\n") > 10


def test_help_solar_documents_the_entry_points_and_keeps_exceptions_short():
    """Rendered as help(solar) renders it, in a fresh interpreter: it must not import torch either."""
    code = ("import pydoc, sys, solar\n"
            "text = pydoc.render_doc(solar, renderer=pydoc.plaintext)\n"
            "print(len(text.splitlines()), 'torch' in sys.modules)\n"
            "print(text)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    head, text = r.stdout.split("\n", 1)
    n, torch = head.split()
    assert int(n) < 500 and torch == "False", head
    for name in ("solar.SolarDataset(schedule", "solar.SolarLoader(schedule", "solar.H5Dataset(data",
                 "solar.plan(data", "solar.load_layout(path)", "solar.Schedule.load(path)", "SolarError",
                 "SpecError", "ScheduleError", "solar bench"):
        assert name in text, name
    assert "Methods inherited from builtins.BaseException" not in text
    assert "class Schedule" in text and "plan(data" in text  # the entry points documented in full


def test_exceptions_stay_importable_from_solar():
    import solar
    from solar.errors import SolarError
    assert solar.SolarError is SolarError and issubclass(solar.ScheduleError, SolarError)
    assert {solar.SpecError, solar.LayoutError, solar.DecodeError, solar.WriteError} <= set(SolarError.__subclasses__())


def test_plan_docstring_says_what_epochs_takes():
    import solar
    doc = solar.plan.__doc__
    assert '``"auto"``' in doc and "``solar plan`` command's ``--epochs``" in doc and "are required" not in doc
