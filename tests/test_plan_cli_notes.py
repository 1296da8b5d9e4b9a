"""`solar plan`'s notes on stderr: a buffer fraction of 1 or more whose buffers still hold less than the data
(the queued batches and reads in flight come out of the budget) names the fraction that holds it all."""
from __future__ import annotations

import json
import re

import pytest

from solar.cli import main
from helpers import make_dataset


def plan(capsys, data, out, fraction: str, *more) -> tuple:
    rc = main(["plan", data, "-P", "1", "--epochs", "3", "--buffer-fraction", fraction, "-o", out,
               "--json", "--no-progress", *(more or ("-b", "32"))])
    cap = capsys.readouterr()
    return rc, json.loads(cap.out), cap.err


@pytest.mark.parametrize("job", [("-b", "32"), ("-b", "8", "--reads-in-flight", "16")],
                         ids=["batches-over-the-allowance", "reads-in-flight"])
def test_a_fraction_of_one_that_holds_less_than_the_data_names_the_one_that_holds_it(tmp_path, capsys, job):
    data = make_dataset(tmp_path, "ptychonn", samples=256, size=128)  # 48 MiB: the batches (18 MiB at b=32) outgrow
    # the allowance a plan does not take from the budget (16 MiB); at b=8 the 15 extra reads in flight (22 MiB) do
    rc, s, err = plan(capsys, data, str(tmp_path / "a.h5"), "1.0", *job)
    assert rc == 0 and s["steady_hit_rate"] < 1.0
    m = re.search(r"--buffer-fraction 1 is the memory per rank.*--buffer-fraction ([0-9.]+) gives them 1 x the data",
                  err)
    assert m, err
    rc, s, err = plan(capsys, data, str(tmp_path / "b.h5"), m.group(1), *job)
    assert rc == 0 and s["steady_hit_rate"] == 1.0, (m.group(1), s["steady_hit_rate"])
    assert "gives them" not in err
    rc, s, err = plan(capsys, data, str(tmp_path / "c.h5"), "0.5", *job)  # below 1: the user asked for less
    assert rc == 0 and "gives them" not in err


def test_one_epoch_gets_no_fraction_note(tmp_path, capsys):
    data = make_dataset(tmp_path, "ptychonn", samples=256, size=128)
    rc = main(["plan", data, "-P", "1", "-b", "32", "--epochs", "1", "--buffer-fraction", "1.0", "-o",
               str(tmp_path / "p.h5"), "--no-progress"])
    assert rc == 0 and "gives them" not in capsys.readouterr().err  # a single epoch reads everything anyway


def test_simulate_at_a_fraction_of_one_says_its_buffers_are_the_whole_budget(tmp_path, capsys):
    args = ["simulate", "--samples", "64", "--sample-bytes", "1000", "-P", "2", "-b", "4", "--epochs", "2",
            "--policies", "solar", "--no-progress", "--buffer-fraction"]
    assert main(args + ["0.5"]) == 0
    assert capsys.readouterr().err == ""  # below 1: nothing to say
    assert main(args + ["1.0"]) == 0
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "buffer is the whole budget" in err, err
