"""`solar simulate` end to end: JSON fields, plot file, and a real layout."""
import json

from solar.cli import main
from helpers import make_dataset


def test_simulate_synthetic_json_and_plot(tmp_path, capsys):
    png = tmp_path / "hit.png"
    rc = main(["simulate", "--samples", "2048", "--sample-bytes", "100", "-P", "4", "-b", "8", "--epochs", "3",
               "--buffer-fraction", "0.25", "0.5", "--json", "--plot", str(png)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["fraction"] for r in out["rows"]] == [0.25, 0.5]
    for row in out["rows"]:
        res = row["results"]
        assert set(res) == {"torch", "nopfs", "solar2023", "solar", "ideal"}
        for r in res.values():
            assert len(r["hit_rate_per_epoch"]) == 3 and len(r["storage_bytes_per_epoch"]) == 3
            assert {"steady_hit_rate", "max_local_batch"} <= set(r)
        assert res["solar"]["steady_hit_rate"] > res["torch"]["steady_hit_rate"]
        assert res["ideal"]["steady_hit_rate"] >= res["solar"]["steady_hit_rate"] - 1e-9
        assert res["solar"]["max_local_batch"] == 8
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_simulate_on_windowed_layout(tmp_path, capsys):
    out = make_dataset(tmp_path, "well", "contiguous", steps=12)
    rc = main(["simulate", out, "-P", "2", "-b", "2", "--epochs", "3", "--buffer-fraction", "0.5"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "solar" in text and "ideal" in text and "buffer fraction 0.5" in text


def test_simulate_needs_input(capsys):
    assert main(["simulate", "-P", "2", "-b", "2", "--buffer-fraction", "0.5"]) == 2
    assert "give a SPEC, or --samples and --sample-bytes" in capsys.readouterr().err


def test_simulate_neighbour_reads(tmp_path, capsys):
    """--neighbour-reads: the policies that keep parts read runs of neighbours (marked +, noted under the table;
    "neighbours" in the JSON), the others do not; a layout without runs says so in one line."""
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=256)
    args = ["simulate", data, "-P", "2", "-b", "8", "--epochs", "2", "--buffer-fraction", "0.5",
            "--policies", "solar", "nopfs"]
    assert main(args + ["--neighbour-reads"]) == 0
    text = capsys.readouterr().out
    assert "solar+" in text and "nopfs+" not in text and "+ read runs of neighbouring blocks together" in text
    assert main(args + ["--neighbour-reads", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    res = out["rows"][0]["results"]
    assert out["neighbour_reads"] and res["solar"]["neighbours"] and not res["nopfs"]["neighbours"]
    assert main(args + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["rows"][0]["results"]
    assert not plain["solar"]["neighbours"]
    # runs read neighbours beside a block: the same storage within 25% on this tiny file, never nothing
    assert 0 < res["solar"]["storage_bytes_per_epoch"][0] <= 1.25 * plain["solar"]["storage_bytes_per_epoch"][0]
    gz = make_dataset(tmp_path, "ptychonn", "gzip", samples=64)
    assert main(["simulate", gz, "-P", "2", "-b", "4", "--epochs", "1", "--buffer-fraction", "0.5",
                 "--policies", "solar", "--neighbour-reads", "--no-parts"]) == 0
    assert "no blocks of this layout lie back to back" in capsys.readouterr().err
