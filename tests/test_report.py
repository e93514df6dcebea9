"""report.py: the seed aggregation against hand-computed numbers, the page made from results/*.json only,
and the resumable run."""
import importlib.util
import json
import math
from pathlib import Path

import pytest

import report
from conftest import ROOT

STS = ["STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness", "avg"]
TRANSFER = ["MR", "CR", "SUBJ", "MPQA", "SST2", "TREC", "MRPC", "avg"]
REPO = Path(report.__file__).resolve().parents[1]  # the suite (report.py is in tools/)


def test_mean_and_sample_std_by_hand():
    # mean 7/3; squared deviations 16/9 + 1/9 + 25/9 = 42/9, over n - 1 = 2 -> 7/3
    mean, std = report.mean_std([1.0, 2.0, 4.0])
    assert mean == pytest.approx(7 / 3) and std == pytest.approx(math.sqrt(7 / 3))
    assert report.mean_std([76.0, 78.0]) == (77.0, pytest.approx(math.sqrt(2.0)))
    mean, std = report.mean_std([5.0])
    assert mean == 5.0 and math.isnan(std)


def test_paired_difference_by_hand():
    # diffs 1.0, 0.5, 1.5: mean 1, sample std 0.5, SE 0.5/sqrt(3) = 0.2887 < 0.5 = mean/2 -> marked
    mean, se, marked, n = report.paired_difference({42: 77.0, 43: 76.0, 44: 78.0}, {42: 76.0, 43: 75.5, 44: 76.5})
    assert (mean, n, marked) == (pytest.approx(1.0), 3, True) and se == pytest.approx(0.5 / math.sqrt(3))
    # diffs 1.0, -0.5, 0.8: mean 0.4333, std 0.8145, SE 0.4702 -> 2 SE = 0.94 > 0.43, not marked
    mean, se, marked, n = report.paired_difference({42: 1.0, 43: -0.5, 44: 0.8}, {42: 0.0, 43: 0.0, 44: 0.0})
    assert mean == pytest.approx(0.43333, abs=1e-5) and se == pytest.approx(0.47022, abs=1e-5) and not marked
    # only the seeds both runs have are paired; one pair has no standard error and is never marked
    mean, se, marked, n = report.paired_difference({42: 3.0, 43: 5.0}, {43: 4.0, 44: 0.0})
    assert (mean, marked, n) == (1.0, False, 1) and math.isnan(se)
    assert report.paired_difference({42: 1.0}, {43: 1.0})[3] == 0
    assert report.fmt_diff(1.0, 0.2887, True) == "**+1.00 ± 0.29**" and report.fmt_diff(-0.5, 0.3, False) == "-0.50 ± 0.30"


def fake_run(avg, dev, step, transfer_avg=None, align=0.2, speed=1.0):
    test = {t: avg - 1.0 for t in STS[:-1]}
    test["avg"] = avg
    run = {"test": test, "best_dev_stsb": dev, "best_step": step, "eval_pooler": "cls",
           "dev_curve": [[0, 79.0], [50, dev], [100, dev]], "steps_per_second": speed,
           "peak_memory_mb": 1000.0, "align_uniform": {"initial": {"align": 0.1, "uniform": -1.7},
                                                        "best": {"align": align, "uniform": -2.5}},
           "report": {"wall_s": 1800.0, "cpu_s": 3600.0}}
    if transfer_avg is not None:
        run["transfer"] = {**{t: transfer_avg for t in TRANSFER}, "mode": "fasttest"}
        run["report"].update(transfer_wall_s=900.0, transfer_cpu_s=1800.0)
    return run


def fake_results(folder: Path) -> Path:
    folder.mkdir()
    runs = {("simcse", 42): fake_run(76.0, 84.0, 100, 80.0), ("simcse", 43): fake_run(75.0, 83.0, 50, 81.0),
            ("simcse", 44): fake_run(77.0, 85.0, 100, 82.0),
            ("micse", 42): fake_run(77.0, 84.5, 150, 80.0, align=0.3, speed=0.5),
            ("micse", 43): fake_run(76.5, 83.5, 100, 80.0, align=0.4, speed=0.5),
            ("micse", 44): fake_run(77.5, 85.5, 150, 80.0, align=0.5, speed=0.5),
            ("sscl", 42): fake_run(80.0, 87.0, 150)}
    for (name, seed), data in runs.items():
        (folder / f"{name}.seed{seed}.json").write_text(json.dumps(data))
    (folder / "simcse.seedX.json").write_text("{not a run}")  # not a seed file: ignored
    (folder / "initial.json").write_text(json.dumps({**{t: 60.0 for t in STS}, "report": {"wall_s": 60, "cpu_s": 120}}))
    (folder / "initial_avg.json").write_text(json.dumps({**{t: 70.0 for t in STS},
                                                         "report": {"wall_s": 1800, "cpu_s": 3600}}))
    (folder / "initial_avg_transfer.json").write_text(json.dumps({**{t: 65.0 for t in report.TRANSFER_COLUMNS},
                                                                  "report": {"wall_s": 900, "cpu_s": 1800}}))
    (folder / "machine.json").write_text(json.dumps({"cpu": "test cpu", "cores": 2, "python": "3", "torch": "t",
                                                     "transformers": "x", "date": "2026-01-01"}))
    return folder


def test_write_reproduces_a_known_page(tmp_path):
    results = fake_results(tmp_path / "results")
    report.write(results, tmp_path / "RESULTS.md", plots=False)
    page = (tmp_path / "RESULTS.md").read_text()
    lines = page.splitlines()
    # simcse: avg 76, 75, 77 -> 76.00 ± 1.00; every other task 1 lower
    assert "| simcse | 3 | " + " | ".join(["75.00 ± 1.00"] * 7) + " | 76.00 ± 1.00 | — |" in lines
    # micse - simcse paired on the avg: 1.0, 1.5, 0.5 -> +1.00, SE 0.29, beyond 2 SE -> bold
    assert "| micse | 3 | " + " | ".join(["76.00 ± 0.50"] * 7) + " | 77.00 ± 0.50 | **+1.00 ± 0.29** |" in lines
    # one seed: no deviation, one pair, no standard error, not marked
    assert "| sscl | 1 | " + " | ".join(["79.00"] * 7) + " | 80.00 | +4.00 |" in lines
    assert "| initial checkpoint ([CLS]) | 1 | " + " | ".join(["60.00"] * 8) + " | — |" in lines
    assert "| initial checkpoint (avg) | 1 | " + " | ".join(["70.00"] * 8) + " | — |" in lines
    # transfer: only the avg pooler's initial evaluation exists, so only its row
    assert "| initial checkpoint (avg) | 1 | " + " | ".join(["65.00"] * 8) + " | — |" in lines
    assert sum(line.startswith("| initial checkpoint") for line in lines) == 3
    assert "what SSCL's training changed is its distance to the initial checkpoint (avg)." in page
    assert "--pooler avg --senteval_dir ../shared/data/senteval --json results/initial_avg.json" in page
    # transfer: simcse 80, 81, 82; micse 80 each -> -1.00 ± 0.58 (diffs 0, -1, -2), not beyond 2 SE
    assert "| simcse | 3 | " + " | ".join(["81.00 ± 1.00"] * 8) + " | — |" in lines
    assert "| micse | 3 | " + " | ".join(["80.00 ± 0.00"] * 8) + " | -1.00 ± 0.58 |" in lines
    assert "| micse | 84.50 ± 1.00 | 150, 100, 150 | 78.13 (miCSE, Table 2 (100%)) |" in lines
    assert "| micse | 3 | 0.100 ± 0.000 | 0.400 ± 0.100 | -1.700 ± 0.000 | -2.500 ± 0.000 |" in lines
    assert "| micse | 0.500 | 0.50 | 1000 | 1.00 |" in lines
    # wall: 7 x 1800 + 6 x 900 (transfer) + 60 + 1800 + 900 (initial evaluations) s = 5.77 h;
    # CPU: 2 x (7 x 1800 + 6 x 900) + 120 + 3600 + 1800 s = 11.53 h
    assert "Runs on this page: 7 (6 with transfer scores). Total cost: 11.5 CPU-hours, 5.8 hours of wall time" in page
    assert "seeds 42, 43, 44." in page and "test cpu, 2 cores" in page
    assert "resumes with them): simcsepp (seeds 42, 43, 44); " in page and "; sscl (seeds 43, 44); " in page
    assert "micse_1pct (seeds 42, 43, 44). Transfer scores are missing for 1 of the 7 runs." in page
    # 12 rows x 3 seeds at 60 CPU-min a run and 30 a transfer evaluation: 36 x 1.5 h
    assert ("(60 CPU-minutes a run, 30 a transfer evaluation), all 36 runs and their transfer evaluations are "
            "about 54.0 CPU-hours.") in page
    assert "--seed S --fraction 0.1" not in page  # few-shot rows absent: no command for them
    assert not (results / "dev_curves.png").exists()


def test_a_damaged_results_file_is_named_on_the_page_and_in_one_terminal_line(tmp_path, capsys):
    """#58: `report.py write` skips a results file that is not a run's record and names it on the page; the terminal
    says so too, in one line, so that a user who reads only the terminal knows the page has fewer runs."""
    results = fake_results(tmp_path / "results")
    (results / "sscl.seed43.json").write_text('{"best_step": 1, "te')  # truncated (a full disk, a killed copy)
    report.write(results, tmp_path / "RESULTS.md", plots=False)
    why = "cannot be read (JSONDecodeError: truncated or damaged)"
    assert f"Skipped, not a run's record: `sscl.seed43.json` ({why})." in (tmp_path / "RESULTS.md").read_text()
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if "sscl.seed43.json" in line] == [
        f"skipped 1 file(s) that are not a run's record (named on {tmp_path / 'RESULTS.md'}): "
        f"{results / 'sscl.seed43.json'} ({why})"]


def test_complete_page_with_untimed_runs_still_states_the_full_cost(tmp_path):
    """Every run present, one made before report.py timed its runs: the measured total is short, so the page
    keeps the estimate of a full `report.py run`; with every run timed, the measured total is the cost."""
    folder = tmp_path / "results"
    folder.mkdir()
    for name, *_ in report.RUNS + report.FEW_SHOT:
        for seed in report.SEEDS:
            (folder / f"{name}.seed{seed}.json").write_text(json.dumps(fake_run(76.0, 84.0, 100, 80.0)))
    for name in ("initial", "initial_avg"):
        (folder / f"{name}.json").write_text(json.dumps({t: 60.0 for t in STS}))
    (folder / "machine.json").write_text(json.dumps({"cpu": "c", "cores": 2, "python": "3", "torch": "t",
                                                     "transformers": "x", "date": "2026-01-01"}))
    report.write(folder, tmp_path / "complete.md", plots=False)
    page = (tmp_path / "complete.md").read_text()
    assert "Every row has every default seed (42, 43, 44). At the mean cost" in page  # nothing missing, yet estimated
    assert "runs made before report.py timed" in page  # the two initial evaluations carry no timing
    # 36 runs x (60 + 30) CPU-min = 54 h, stated although nothing is missing
    assert "all 36 runs and their transfer evaluations are about 54.0 CPU-hours." in page
    untimed = json.loads((folder / "simcse.seed42.json").read_text())
    del untimed["report"]
    (folder / "simcse.seed42.json").write_text(json.dumps(untimed))
    for name in ("initial", "initial_avg"):
        (folder / f"{name}.json").write_text(json.dumps({**{t: 60.0 for t in STS}, "report": {"wall_s": 1, "cpu_s": 1}}))
    report.write(folder, tmp_path / "one_untimed.md", plots=False)
    assert "1 runs made before" in (tmp_path / "one_untimed.md").read_text()
    assert "about 54.0 CPU-hours." in (tmp_path / "one_untimed.md").read_text()
    (folder / "simcse.seed42.json").write_text(json.dumps(fake_run(76.0, 84.0, 100, 80.0)))
    report.write(folder, tmp_path / "all_timed.md", plots=False)
    all_timed = (tmp_path / "all_timed.md").read_text()
    assert "At the mean cost" not in all_timed and "not counted" not in all_timed
    assert "Total cost: 54.0 CPU-hours" in all_timed  # 36 x 90 CPU-min, plus 2 s of initial evaluations


def test_plots_are_written_or_skipped_with_a_message(tmp_path, capsys):
    results = fake_results(tmp_path / "results")
    report.write(results, tmp_path / "RESULTS.md")
    plots = [results / "dev_curves.png", results / "align_uniform.png"]
    if importlib.util.find_spec("matplotlib") is None:  # an optional dependency
        assert "matplotlib is not installed: skipping the plots" in capsys.readouterr().out
        assert not any(p.exists() for p in plots)
        return
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in plots)


def test_write_without_results_is_one_line_and_status_2(tmp_path, capsys):
    (tmp_path / "results").mkdir()
    with pytest.raises(SystemExit) as stop:
        report.write(tmp_path / "results", tmp_path / "RESULTS.md")
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().count("\n") == 0 and not (tmp_path / "RESULTS.md").exists()


def test_write_without_initial_evaluation_is_one_line_and_status_2(tmp_path, capsys):
    results = fake_results(tmp_path / "results")
    (results / "initial.json").unlink()
    with pytest.raises(SystemExit) as stop:
        report.write(results, tmp_path / "RESULTS.md")
    assert stop.value.code == 2 and "initial.json" in capsys.readouterr().err
    assert not (tmp_path / "RESULTS.md").exists()


def test_committed_page_is_made_from_committed_results(tmp_path):
    """RESULTS.md, its LaTeX tables and its CSV are exactly what `report.py write` makes of results/*.json: every
    number on them is theirs."""
    report.write(REPO / "results", tmp_path / "RESULTS.md", plots=False, tables_dir=tmp_path)
    assert (tmp_path / "RESULTS.md").read_text() == (REPO / "RESULTS.md").read_text()
    assert (tmp_path / "runs.csv").read_text() == (REPO / "results" / "runs.csv").read_text()
    made, committed = (sorted((folder / "latex").glob("*.tex")) for folder in (tmp_path, REPO / "results"))
    assert [p.name for p in made] == [p.name for p in committed]
    assert all(a.read_text() == b.read_text() for a, b in zip(made, committed))


def test_run_is_resumable(tmp_path, monkeypatch, capsys):
    """A run whose JSON exists is not trained again; one without transfer scores gets only its transfer run."""
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(report, "machine", lambda: {"cpu": "c", "cores": 2})
    calls, commands = [], []

    def fake_timed(cmd):
        calls.append(cmd[1])
        commands.append(cmd)
        value = lambda flag: cmd[cmd.index(flag) + 1]
        if cmd[1] in ("eval_sts.py", "eval_transfer.py"):
            Path(value("--json")).write_text(json.dumps({"avg": 1.0}))
        else:
            out = Path(value("--output_dir"))
            (out / "best").mkdir(parents=True)
            (out / "results.json").write_text(json.dumps({"eval_pooler": "cls", "seed": int(value("--seed"))}))
        return {"wall_s": 1.0, "cpu_s": 2.0}

    monkeypatch.setattr(report, "timed", fake_timed)
    (tmp_path / "results").mkdir()
    # simcse seed 42 exists, trained before report.py timed its runs (no "report" key) and without transfer scores
    (tmp_path / "results" / "simcse.seed42.json").write_text(json.dumps({"eval_pooler": "cls"}))
    (tmp_path / "runs" / "report" / "simcse.seed42" / "best").mkdir(parents=True)
    report.run_all([42, 43], ["simcse", "micse"], transfer=True)
    assert calls == ["eval_sts.py"] * 2 + ["micse.py", "simcse.py", "micse.py"] + ["eval_transfer.py"] * 6
    counts = [line.split(" (")[0] for line in capsys.readouterr().out.splitlines() if "training run" in line]
    assert counts == ["== training run 1/3", "== training run 2/3", "== training run 3/3"]
    # the initial checkpoint under both poolers, simcse seed 42 not trained again, then 2 + 4 transfer evaluations
    poolers = [cmd[cmd.index("--pooler") + 1] for cmd in commands if cmd[1].startswith("eval_")]
    assert poolers == ["cls_before_pooler", "avg", "cls_before_pooler", "avg"] + ["cls"] * 4
    untimed = json.loads((tmp_path / "results" / "simcse.seed42.json").read_text())
    assert untimed["report"] == {"transfer_wall_s": 1.0, "transfer_cpu_s": 2.0}
    saved = json.loads((tmp_path / "results" / "micse.seed43.json").read_text())
    assert saved["seed"] == 43 and saved["transfer"] == {"avg": 1.0, "mode": "fasttest"}
    assert saved["report"] == {"wall_s": 1.0, "cpu_s": 2.0, "transfer_wall_s": 1.0, "transfer_cpu_s": 2.0}
    assert not list((tmp_path / "results").glob("*.tmp*"))
    calls.clear()
    report.run_all([42, 43], ["simcse", "micse"], transfer=True)  # everything there: nothing runs
    assert calls == []


def test_bad_row_name_is_one_line_and_status_2(capsys):
    with pytest.raises(SystemExit) as stop:
        report.main(["run", "--only", "nosuchmethod"])
    assert stop.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_the_page_states_the_device_memory_and_corpus_its_results_record(tmp_path):
    """A GPU run's page says GPU, its precision and CUDA memory, never "CPU only" or "peak RSS"; the corpus
    size and the initial checkpoint's dev figures come from the runs."""
    results = fake_results(tmp_path / "results")
    for path in results.glob("*.seed4?.json"):
        run = json.loads(path.read_text())
        run.update(device="cuda:0", precision="bf16", peak_memory_kind="cuda_max_allocated",
                   num_train_examples=2400)
        if path.name.startswith("sscl"):
            run["dev_curve"][0] = [0, 86.0]
        path.write_text(json.dumps(run))
    report.write(results, tmp_path / "RESULTS.md", plots=False)
    page = (tmp_path / "RESULTS.md").read_text()
    assert "test cpu, 2 cores, GPU: cuda:0, the encoder in bf16;" in page
    assert "CPU only" not in page and "peak RSS" not in page
    assert "memory is the GPU's peak allocated memory (torch.cuda.max_memory_allocated)" in page
    assert "on `wiki1m_head.txt` (2,400 Wikipedia sentences, about 2 passes)." in page
    assert "the initial checkpoint's STS-B dev figure with that pooler is 86.00, not 79.00." in page
    committed = (ROOT / "RESULTS.md").read_text()  # the CPU results: what the page said before, from data
    assert "2 cores, CPU only;" in committed and "peak RSS on CPU" in committed
    assert "(11,900 Wikipedia sentences, about 40% of one pass)" in committed and "86.72, not 79.73" in committed


def test_runs_with_a_trajectory_give_the_page_that_the_older_dev_curve_gave(tmp_path):
    """results.json's trajectory replaced dev_curve: both formats load, and to the same page."""
    old = fake_results(tmp_path / "results")
    report.write(old, tmp_path / "OLD.md", plots=False)
    for path in old.glob("*.seed4?.json"):
        run = json.loads(path.read_text())
        run["trajectory"] = [{"step": step, "train_time_s": 1.0, "lr": 3e-5, "stsb_dev": dev, "align": 0.1,
                              "uniform": -2.0, "gate": True} for step, dev in run.pop("dev_curve")]
        path.write_text(json.dumps(run))
    report.write(old, tmp_path / "NEW.md", plots=False)
    assert (tmp_path / "NEW.md").read_text() == (tmp_path / "OLD.md").read_text()
    assert "79.00" in (tmp_path / "NEW.md").read_text()  # the step-0 dev figure, read from the trajectory


def test_run_with_every_result_present_makes_nothing_and_keeps_the_machine(tmp_path, monkeypatch):
    """`report.py run --protocol smoke` on the committed results: no run, and machine.json (the page's machine
    line) untouched, so the page comes out as committed."""
    import shutil
    copy = tmp_path / "results"
    shutil.copytree(ROOT / "results", copy)
    monkeypatch.setattr(report, "RESULTS", copy)
    monkeypatch.setattr(report, "timed", lambda *a, **k: pytest.fail(f"ran {a}"))
    report.run_all(report.SEEDS, None, transfer=True)
    assert (copy / "machine.json").read_text() == (ROOT / "results" / "machine.json").read_text()
    report.write(copy, tmp_path / "RESULTS.md", plots=False)
    assert (tmp_path / "RESULTS.md").read_text() == (ROOT / "RESULTS.md").read_text()


def test_the_pages_tables_in_latex_carry_the_markdowns_numbers(tmp_path):
    """Each Markdown table of the page becomes a booktabs table: environments balanced, _ and % escaped, the same
    numbers to the printed digit, the best of each score column in bold, the papers' averages marked as theirs."""
    import re
    import tables
    results = fake_results(tmp_path / "results")
    report.write(results, tmp_path / "RESULTS.md", plots=False)
    page = (tmp_path / "RESULTS.md").read_text().splitlines()
    markdown = tables.markdown_tables(page)
    latex = sorted((results / "latex").glob("*.tex"))
    assert len(latex) == len(markdown) >= 5
    for table, path in zip(markdown, latex):
        tex = path.read_text()
        for env in ("table", "tabular"):
            assert tex.count(rf"\begin{{{env}}}") == tex.count(rf"\end{{{env}}}") == 1
        assert r"\toprule" in tex and r"\midrule" in tex and r"\bottomrule" in tex and "booktabs" not in tex
        body = tex.split(r"\midrule")[1].split(r"\bottomrule")[0]
        assert not re.search(r"(?<!\\)[_%&#]", body.replace(" & ", " ")), path.name  # escaped
        numbers = [re.findall(r"\d+\.\d+", " ".join(row)) for row in table["rows"]]
        tex_rows = [line for line in body.strip().splitlines()]
        assert [re.findall(r"\d+\.\d+", row.split(" & paper")[0]) [:len(nums)] for row, nums in
                zip(tex_rows, numbers)] == numbers, path.name
    sts = latex[0].read_text()
    assert "paper\\dag{}" in sts and "the paper's own number, not ours" in sts
    assert r"sscl & 1 & \textbf{79.00}" in sts  # the best STS12 (79 > 76 > 75), and so on
    assert r"micse & 3 & 76.00 $\pm$ 0.50" in sts and "+1.00 $\\pm$ 0.29$^{*}$ & 78.13" in sts  # significant: *
    assert "initial checkpoint ([CLS]) & 1 & 60.00" in sts  # not ranked
    align = next(p for p in latex if "alignment" in p.name).read_text()
    assert r"\textbf{0.200 $\pm$ 0.000}" in align  # lower is better: simcse's 0.2 beats micse's 0.4


def test_every_run_in_the_csv_reads_back_as_its_results_json(tmp_path):
    import csv
    results = fake_results(tmp_path / "results")
    report.write(results, tmp_path / "RESULTS.md", plots=False)
    with open(results / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 7
    for row in rows:
        data = json.loads((results / f"{row['run']}.seed{row['seed']}.json").read_text())
        assert {t: float(row[f"test_{t}"]) for t in STS} == data["test"]
        assert float(row["best_dev_stsb"]) == data["best_dev_stsb"] and int(row["best_step"]) == data["best_step"]
        assert row["script"] == f"{row['run']}.py"
        if "transfer" in data:
            assert {t: float(row[f"transfer_{t}"]) for t in TRANSFER} == {t: data["transfer"][t] for t in TRANSFER}
        else:
            assert row["transfer_avg"] == ""


def test_the_page_says_which_commits_and_versions_its_runs_came_from():
    import tables
    made = {"git": {"commit": "a" * 40, "uncommitted_changes": False}, "versions": {"torch": "2.13.0"}}
    other = {"git": {"commit": "b" * 40, "uncommitted_changes": True}, "versions": {"torch": "2.13.0"}}
    lines = tables.provenance_lines([{"provenance": made}, {"provenance": made}])
    assert lines == ["Code: aaaaaaaaaaaa (2 runs).", "Libraries: torch 2.13.0 (2 runs)."]
    lines = tables.provenance_lines([{"provenance": made}, {"provenance": other}, {}])
    assert "bbbbbbbbbbbb (uncommitted changes) (1 run)" in lines[0] and "1 run(s) made before" in lines[0]
    assert lines[-1].startswith("**Warning**: these runs came from more than one commit")
