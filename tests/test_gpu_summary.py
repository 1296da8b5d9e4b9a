"""benchmarks/gpu_summary.py, the GPU check's summary: reports parsed past what mpiexec adds around them, and the
merged sections' reports (depth, gil, reads, sync; eqmem) summarised per run, a failed run said as such."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import gpu_summary  # noqa: E402


def _report(rates, waits, baselines=None):
    eps = [dict(samples_per_s=r, storage_bytes_per_s=1e9, limit_ratio_best_depth=0.8, book_wait_max_s=w,
                gpu_wait_fraction=None) for r, w in zip(rates, waits)]
    rep = {"solar": {"epochs": eps}}
    if baselines:
        rep["baselines"] = {k: {"samples_per_s": v} for k, v in baselines.items()}
    return rep


def test_reports_parse_past_escape_sequences():
    rep = _report([1.0], [0.0])
    text = "\x1b[0m\x1b[0m" + json.dumps(rep) + "\n\x1b[0m"
    assert gpu_summary.parse_report(text) == rep


def test_merged_sections_summarised_per_run(tmp_path):
    (tmp_path / "reads.json").write_text(json.dumps({"1": _report([100.0, 200.0], [0.5, 0.4]),
                                                     "4": {"raw": "killed"}}))
    (tmp_path / "eqmem.json").write_text(json.dumps(_report([300.0], [0.0], {"torch": [50.0]})))
    rows = gpu_summary.merged_rows(str(tmp_path))
    assert rows["reads 1"]["samples_per_s"] == [100.0, 200.0] and rows["reads 1"]["book_wait_max_s"] == [0.5, 0.4]
    assert rows["reads 4"] == {"failed": True}
    assert rows["eqmem"]["baselines"] == {"torch": [50.0]}
    md = gpu_summary.markdown(dict(machine=dict(gpu="g", device="cuda", samples=1, size=1, batch=1, workers=1),
                                   steps=[], training={}, resident_ratio=None, fidelity=None, bench=None, nodes={},
                                   merged=rows))
    assert "| reads 1 | 100, 200 | 1.00, 1.00 | 0.80, 0.80 | 0.50, 0.40 | -, - | - |" in md
    assert "| reads 4 | no report |" in md and "torch 50" in md
