"""report.py write: RESULTS.md is made from results/*.json and shows exactly their numbers."""
import json
import sys

import pytest

import report

TASKS = ["STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness", "avg"]


def fake_results(tmp_path, names):
    results = tmp_path / "results"
    results.mkdir()
    for k, name in enumerate(names):
        test = {t: round(70 + k + i / 7, 2) for i, t in enumerate(TASKS)}
        (results / f"{name}.json").write_text(json.dumps({
            "test": test, "best_dev_stsb": 80.0 + k, "best_step": 50 * k, "dev_curve": [[0, 79.73], [50, 80.0 + k]],
            "steps_per_second": 1.0 / (k + 1), "peak_memory_mb": 1000.0 + 100 * k, "peak_memory_kind": "cpu_max_rss"}))
    (results / "initial.json").write_text(json.dumps({t: 60.0 for t in TASKS}))
    (results / "machine.json").write_text(json.dumps({"cpu": "test cpu", "cores": 2, "python": "3", "torch": "t",
                                                      "transformers": "x", "date": "2026-01-01"}))
    return results


def test_write_uses_the_json_numbers(tmp_path, monkeypatch):
    names = ["simcse", "simcsepp", "micse_no_queue"]
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "RESULTS", fake_results(tmp_path, names))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the plot is optional
    report.write()
    page = (tmp_path / "RESULTS.md").read_text()
    for name in names:
        data = json.loads((tmp_path / "results" / f"{name}.json").read_text())
        row = next(line for line in page.splitlines() if line.startswith(f"| {name} | 7"))
        assert all(f"{data['test'][t]:.2f}" in row for t in TASKS)
        assert f"{data['best_dev_stsb']:.2f} ({data['best_step']})" in row
    assert "| simcsepp | 0.500 | 0.50 | 1100 | 1.10 |" in page
    assert "76.88 (miCSE Table 2, AMI+SimCSE (100%))" in page and "test cpu, 2 cores" in page
    assert "| initial checkpoint ([CLS]) | 60.00" in page
    assert not (tmp_path / "results" / "dev_curves.png").exists()


def test_write_without_results_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "results").mkdir()
    monkeypatch.setattr(report, "RESULTS", tmp_path / "results")
    with pytest.raises(SystemExit, match="report.py run"):
        report.write()
