"""`solar bench` end to end on a tiny file (figures are not checked: speed lives in benchmarks/)."""
import json

import pytest

from helpers import make_dataset


@pytest.mark.mpi
def test_bench_report(comm, shared_tmp):
    from conftest import on_root
    from solar.bench.compare import bench, format_report
    data = on_root(comm, lambda: make_dataset(shared_tmp, "ptychonn", "gzip", samples=24))
    rep = bench(data, comm=comm, epochs=2, local_batch=2, buffer_fraction=1.0, num_workers=0, cold=True)
    assert len(rep["speedup"]) == 2 and all(x > 0 for x in rep["speedup"])
    n = 24 + (-24) % comm.size
    for ep in rep["solar"]["epochs"]:
        assert ep["global_samples"] == n and ep["plan_violations"] == 0
    for ep in rep["baseline"]["epochs"]:
        assert ep["global_samples"] == n
    assert rep["solar"]["epochs"][0]["storage_bytes"] > 0 and rep["disk"]["bytes_per_s"] > 0
    assert "posix_fadvise" in rep["cache"]
    text = format_report(rep)
    assert "speedup" in text and "disk cold sequential read" in text
    json.dumps(rep)


def test_bench_cli_json(tmp_path, capsys):
    from solar.cli import main
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=16)
    assert main(["bench", data, "--epochs", "2", "-b", "2", "--num-workers", "0", "--json", "--cold"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert len(rep["speedup"]) == 2 and rep["solar"]["reader"] == "pread"
