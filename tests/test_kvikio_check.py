"""benchmarks/kvikio_check.py on the CPU (KvikIO needs a GPU: it says so and the rest runs): solar's path to the
device delivers the file's bytes, every method reads the same bytes, and a dataset with no unfiltered block is
refused in one line."""
import json
import os
import sys

import numpy as np

from helpers import make_dataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import kvikio_check  # noqa: E402


def test_the_check_reads_the_files_bytes_on_the_cpu(tmp_path, capsys):
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=40)
    rc = kvikio_check.main([data, "--device", "cpu", "--threads", "4", "--step-blocks", "7", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    res = json.loads(out.out)
    from solar.layout import load_layout
    layout = load_layout(data)
    assert res["blocks"] == layout.block_nbytes.shape[0]  # every block: they all fit the default 1 GiB
    assert res["bytes"] == int(layout.block_stored.sum())
    m = res["methods"]
    assert m["solar"]["equal_to_file"] is True and m["solar"]["bytes"] == res["bytes"] and m["solar"]["gbps"] > 0
    assert m["disk"]["bytes"] == res["bytes"]
    assert "kvikio" in m and ("unavailable" in m["kvikio"] or m["kvikio"]["equal_to_file"] is True)
    assert "solar: " in out.err and "equal to the file: True" in out.err


def test_the_blocks_are_a_random_prefix_of_at_most_max_bytes(tmp_path):
    from solar.layout import load_layout
    layout = load_layout(make_dataset(tmp_path, "ptychonn", "contiguous", samples=40))
    one = int(layout.block_nbytes.max())
    got = kvikio_check.pick_blocks(layout, 5 * one, seed=3)
    assert got.shape[0] == 5 and len(set(got.tolist())) == 5
    assert not np.array_equal(got, np.sort(got)) or got.shape[0] < 2  # shuffled (seeded)
    assert np.array_equal(got, kvikio_check.pick_blocks(layout, 5 * one, seed=3))
    ref = kvikio_check.expected(layout, got[:2])
    assert ref.shape[0] == int(layout.block_stored[got[:2]].sum())


def test_a_dataset_of_filtered_blocks_is_refused_in_one_line(tmp_path, capsys):
    data = make_dataset(tmp_path, "ptychonn", "gzip", samples=12)
    assert kvikio_check.main([data, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvikio_check: ") and "no block is stored without a filter" in err[0]


def test_sizes_parse():
    assert kvikio_check.parse_bytes("1GiB") == 1 << 30
    assert kvikio_check.parse_bytes("256MiB") == 256 << 20
    assert kvikio_check.parse_bytes("4096") == 4096


class FakeCuFile:
    """KvikIO's ``CuFile`` as the check uses it, on the CPU: ``pread`` into a torch tensor's bytes, a future
    back; ``short`` bytes fewer than asked for (a read that comes back short)."""

    def __init__(self, path, short=0):
        self.fd, self.short = os.open(path, os.O_RDONLY), short

    def pread(self, buf, n, off):
        view = buf.numpy()
        got = os.preadv(self.fd, [memoryview(view)[:n - self.short]], off)
        return type("Future", (), {"get": lambda self: got})()

    def close(self):
        os.close(self.fd)


def _fake_kvikio(monkeypatch, short):
    def fake_open(layout, blocks, threads):
        return None, {f: FakeCuFile(p, short) for f, p in enumerate(layout.files)}, {"version": "fake"}
    monkeypatch.setattr(kvikio_check, "open_kvikio", fake_open)


def test_kvikio_s_bytes_are_checked_and_a_short_read_fails_the_check(tmp_path, capsys, monkeypatch):
    """The KvikIO half of the check, with a stand-in for CuFile on the CPU: its bytes equal the file's; a
    read that comes back short is a failure (exit 1, "failed"), not "unavailable"."""
    data = make_dataset(tmp_path, "ptychonn", "contiguous", samples=40)
    _fake_kvikio(monkeypatch, 0)
    assert kvikio_check.main([data, "--device", "cpu", "--threads", "2", "--step-blocks", "5", "--json"]) == 0
    m = json.loads(capsys.readouterr().out)["methods"]
    assert m["kvikio"]["equal_to_file"] is True and m["kvikio"]["bytes"] == m["solar"]["bytes"]
    _fake_kvikio(monkeypatch, 1)
    assert kvikio_check.main([data, "--device", "cpu", "--threads", "2", "--step-blocks", "5", "--json"]) == 1
    out = capsys.readouterr()
    m = json.loads(out.out)["methods"]
    assert m["kvikio"]["failed"].startswith("RuntimeError: KvikIO read") and "FAILED: RuntimeError" in out.err
