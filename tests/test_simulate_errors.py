"""`solar simulate` with a buffer some policy cannot run with (issue 26, item 8).

The README's `--buffer-fraction 0.1 0.25 0.5 0.9` printed "error: ..." for every policy at 0.1 (and for
solar2023 at 0.25) and exited 0; the ideal policy's message called its pooled buffer (P x the per-rank
budget) "per rank".  Now the results that ran are printed (table, JSON, plot) and the command ends with
one line naming the fractions and policies that failed, exit 2; the ideal's message says its buffer is
pooled over the ranks and must hold a global batch.
"""
import json

from solar.cli import main

JOB = ["simulate", "--samples", "2048", "--sample-bytes", "1000", "-P", "4", "-b", "64", "--epochs", "2",
       "--buffer-fraction", "0.05", "0.5"]


def test_a_failing_fraction_prints_the_rest_then_one_line_and_exit_2(capsys):
    assert main(JOB) == 2
    cap = capsys.readouterr()
    assert cap.err.splitlines() == [
        "solar simulate: error: 5 of 10 runs could not plan with their buffer (buffer fraction 0.05: torch, nopfs, "
        "solar2023, solar, ideal; the 'error' in the output says why): give a larger --buffer-fraction / "
        "--buffer-per-rank"]
    table = cap.out.split("buffer fraction 0.5 ")[1]  # the fraction that ran is printed in full
    for name in ("torch", "nopfs", "solar2023", "solar", "ideal"):
        assert f"\n  {name} " in table and "error" not in table
    first = cap.out.split("buffer fraction 0.5 ")[0]
    assert ("  torch       error: buffer of 25,600 bytes per rank cannot hold the 64,000 bytes of blocks that rank 0 "
            "needs at step 0 of epoch 0") in first
    assert ("  ideal       error: one buffer pooled over the 4 ranks (4 x 25,600 = 102,400 bytes) cannot hold the "
            "256,000 bytes of blocks of the global batch at step 0 of epoch 0: it must hold at least one global "
            "batch") in first
    assert "per rank cannot hold the 256,000" not in first


def test_json_is_complete_and_the_status_2(capsys, tmp_path):
    png = tmp_path / "hit.png"
    assert main(JOB + ["--json", "--plot", str(png)]) == 2
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert [sorted(r["results"]["ideal"]) == ["error"] for r in out["rows"]] == [True, False]
    assert "pooled over the 4 ranks" in out["rows"][0]["results"]["ideal"]["error"]
    assert png.stat().st_size > 1000  # the plot of what ran
    assert len(cap.err.splitlines()) == 1 and "buffer fraction 0.05: torch, nopfs" in cap.err


def test_every_run_ok_is_exit_0(capsys):
    assert main(JOB[:-2] + ["0.5"]) == 0
    assert capsys.readouterr().err == ""
