"""report.py's protocols: the papers' numbers, the commands of `paper` and `fewshot`, and a tiny protocol (two rows,
two seeds, a sweep of three values) run end to end on the tiny model."""
import importlib
import json
import re

import pytest

import protocols
import report
from conftest import SHARED, needs_shared, smoke_args

pytest.importorskip("matplotlib", reason="the pages' plots need matplotlib (requirements.txt)")


def test_paper_numbers_hand_checked_cells():
    assert protocols.PAPER["simcse"][1]["avg"] == 76.25 and protocols.PAPER["simcse"][1]["STS12"] == 68.40
    assert protocols.PAPER["simcse-sup"][1]["SICKRelatedness"] == 80.39
    assert protocols.PAPER["micse-1%"][1] == {"avg": (76.40, 0.48)}
    assert protocols.PAPER["ami-0.1%"][1] == {"avg": (73.85, 0.49)} and protocols.PAPER["simcse-100%"][1] == {
        "avg": 76.15}
    assert protocols.PAPER["whitenedcse"][1] == {"avg": 78.78}


@needs_shared
def test_paper_numbers_are_the_papers_own():
    """Every transcribed row appears, digit for digit and in order, in its paper's text in ../shared/papers."""
    papers = {name: (SHARED / "papers" / f"{name}.txt").read_text() for name in
              ("simcse", "simcsepp", "sscl", "whitenedcse", "micse")}
    for key, (source, cells) in protocols.PAPER.items():
        paper = {"SimCSE": "simcse", "SimCSE++": "simcsepp", "SSCL": "sscl", "WhitenedCSE": "whitenedcse",
                 "miCSE": "micse"}[source.split()[0]]
        text = papers[paper]
        if len(cells) == 8:  # one line of the paper's table holds the eight, in order (bold cells are doubled)
            in_order = ".*".join(re.escape(f"{cells[c]:.2f}") for c in protocols.STS)
            assert any(re.search(in_order, line) for line in text.splitlines()), key
        else:
            value = cells["avg"]  # miCSE's text writes a cell as "76.40\\pm 0.48"
            assert (f"{value[0]:.2f}\\pm {value[1]:.2f}" if isinstance(value, tuple) else f"{value:.2f}") in text, key


def lines_of(action_args, capsys):
    report.main(action_args)
    return capsys.readouterr().out.strip().splitlines()


def test_paper_and_fewshot_commands(capsys):
    """Each paper's rows at the precision of its released scripts, said before the commands: fp16 where they pass
    --fp16 (SimCSE, SimCSE++, SSCL, WhitenedCSE), fp32 for miCSE's (its README commands have none)."""
    paper = lines_of(["commands", "--protocol", "paper"], capsys)
    said, paper = [line for line in paper if line.startswith("#")], [line for line in paper if line[0] != "#"]
    assert said[0] == "# simcse: --precision fp16 (SimCSE's run_unsup_example.sh and run_sup_example.sh pass --fp16)"
    assert said[-1] == "# micse: --precision fp32 (miCSE's README commands pass no --fp16)" and len(said) == 6
    assert len(paper) == 6 * 5 and all("--eval_transfer test" in line for line in paper)
    assert "python simcse.py --precision fp16 --supervised --seed 42 --eval_transfer test --output_dir " \
           "runs/paper/simcse-sup.seed42" in paper
    assert "python micse.py --precision fp32 --seed 42 --eval_transfer test --output_dir runs/paper/micse.seed42" \
        in paper
    few = [line for line in lines_of(["commands", "--protocol", "fewshot"], capsys) if line[0] != "#"]
    assert len(few) == 3 * 4 * 5 and all("--precision fp32" in line for line in few)
    assert "python micse.py --precision fp32 --queue_size 0 --fraction 0.001 --seed 48 --output_dir " \
           "runs/fewshot/ami-0.1%.seed48" in few
    assert "python micse.py --precision fp32 --seed 52 --output_dir runs/fewshot/micse-100%.seed52" in few
    # on a machine without fp16 (a CPU), --args replaces the row's precision: the last flag wins
    cpu = lines_of(["commands", "--protocol", "paper", "--args", "--precision fp32", "--only", "sscl"], capsys)
    assert cpu[-1].startswith("python sscl.py --precision fp16 --precision fp32 --seed 46")
    sweep = lines_of(["commands", "--protocol", "sweep", "--script", "simcsepp.py", "--flag", "m", "--values", "0.8",
                      "1.0", "--seeds", "42", "--base", "smoke"], capsys)
    assert len(sweep) == 2 and sweep[1].startswith("python simcsepp.py --model_name_or_path ../shared/models/")
    assert sweep[1].endswith("--m 1.0 --seed 42 --output_dir runs/sweep-simcsepp-m/m=1.0.seed42")


def test_bad_protocol_and_gpus_are_one_line(tmp_path, capsys):
    for argv, needle in ((["run", "--protocol", "nosuch"], "neither a built-in protocol"),
                         (["run", "--protocol", "paper", "--gpus", "0,1"], "--gpus 0,1: this machine has 0 CUDA"),
                         (["run", "--protocol", "paper", "--gpus", "a"], "give GPU indices"),
                         (["run", "--protocol", "sweep", "--script", "simcsepp.py"], "needs --script, --flag"),
                         (["commands", "--protocol", "paper", "--only", "nosuch"], "no such row")):
        with pytest.raises(SystemExit) as stop:
            report.main(argv)
        assert stop.value.code == 2 and needle in capsys.readouterr().err, argv


@pytest.fixture
def tiny_protocols(tiny_model, corpus, senteval_dir, tmp_path, monkeypatch):
    """Two rows x two seeds, and a sweep of three values, on the tiny model; the runs go under tmp_path and run
    in this process (report.timed replaced), each command recorded."""
    monkeypatch.setattr(protocols, "RUNS_DIR", tmp_path / "runs")
    monkeypatch.setattr(report, "RESULTS", tmp_path / "results")
    shared = [str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, "x")[:-4]] + ["--device", "cpu"]
    rows = {"name": "tiny", "description": "two rows", "args": shared, "seeds": [1, 2], "transfer": None,
            "rows": [{"name": "simcse", "script": "simcse.py", "flags": [], "paper": "simcse"},
                     {"name": "simcsepp", "script": "simcsepp.py", "flags": ["--m", "0.9"], "paper": None}]}
    sweep = {**protocols.sweep_protocol("simcsepp.py", "dcl_weight", ["0", "0.1", "1"], [1], [], "paper"),
             "args": shared}
    files = {}
    for protocol in (rows, sweep):
        files[protocol["name"]] = tmp_path / f"{protocol['name']}.json"
        files[protocol["name"]].write_text(json.dumps(protocol))
    made = []

    def in_process(cmd, env=None):
        made.append(" ".join(["python", *cmd[1:]]))
        script, argv = cmd[1], cmd[2:]
        importlib.import_module(script[:-3]).main(argv)
        return {"wall_s": 1.0, "cpu_s": 1.0}
    monkeypatch.setattr(report, "timed", in_process)
    return files, made


def test_a_tiny_protocol_end_to_end(tiny_protocols, tmp_path, capsys):
    files, made = tiny_protocols
    printed = lines_of(["commands", "--protocol", str(files["tiny"])], capsys)
    report.main(["run", "--protocol", str(files["tiny"])])
    out = capsys.readouterr().out
    assert "protocol tiny: 4 runs, 0 done, 4 to make (one at a time)" in out
    assert made == printed  # `commands` prints exactly the runs `run` makes
    page = (tmp_path / "results" / "tiny" / "RESULTS.md").read_text()
    assert "4 of 4 runs done" in page and "Missing" not in page
    assert "| simcse: paper (SimCSE Table 5, unsup-SimCSE-BERT-base) | | 68.40 |" in page
    ours = next(line for line in page.splitlines() if line.startswith("| simcse: ours | 2 |"))
    assert "±" in ours and "| simcse: ours − paper |" in page and "| simcsepp | 2 |" in page
    assert (tmp_path / "results" / "tiny" / "dev_curves.png").read_bytes()[:4] == b"\x89PNG"

    # a second run makes nothing; a removed run is listed as missing, then made again
    made.clear()
    report.main(["run", "--protocol", str(files["tiny"])])
    assert made == [] and "4 done, 0 to make" in capsys.readouterr().out
    (tmp_path / "results" / "tiny" / "simcsepp.seed2.json").unlink()
    (tmp_path / "runs" / "tiny" / "simcsepp.seed2" / "results.json").unlink()
    report.main(["write", "--protocol", str(files["tiny"])])
    assert "Missing (run them with `python tools/report.py run`, or the lines of `commands`): simcsepp seed 2." in \
        (tmp_path / "results" / "tiny" / "RESULTS.md").read_text()
    # a run finished elsewhere (a line of `commands` on a cluster) is picked up by `write`
    importlib.import_module("simcsepp").main(printed[3].split()[2:] + ["--overwrite_output_dir"])
    report.main(["write", "--protocol", str(files["tiny"])])
    assert "4 of 4 runs done" in (tmp_path / "results" / "tiny" / "RESULTS.md").read_text()


def test_a_tiny_sweep_writes_its_plot(tiny_protocols, tmp_path, capsys):
    files, made = tiny_protocols
    report.main(["run", "--protocol", str(files["sweep-simcsepp-dcl_weight"])])
    assert [line.split("--dcl_weight ")[1].split()[0] for line in made] == ["0", "0.1", "1"]
    folder = tmp_path / "results" / "sweep-simcsepp-dcl_weight"
    assert (folder / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert "| dcl_weight=0.1 | 1 |" in (folder / "RESULTS.md").read_text()


def test_the_estimate_scales_earlier_runs_of_the_same_settings(tmp_path):
    earlier = {"method": "simcsepp", "steps": 150, "report": {"wall_s": 600.0},
               "args": {"model_name_or_path": "m", "batch_size": 32}}
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "simcsepp.seed1.json").write_text(json.dumps(earlier))
    todo = [{"argv": ["simcsepp.py", "--model_name_or_path", "m", "--batch_size", "32", "--max_steps", "300"]},
            {"argv": ["simcsepp.py", "--model_name_or_path", "m", "--batch_size", "64", "--max_steps", "300"]},
            {"argv": ["simcse.py", "--model_name_or_path", "m", "--batch_size", "32", "--max_steps", "300"]}]
    assert protocols.estimate(todo, tmp_path) == ("about 20m00s, from earlier runs of the same settings; 2 run(s) "
                                                  "not estimated (no earlier run of their settings)")
    assert protocols.estimate([], tmp_path) == "nothing to run"


def test_the_paper_page_states_each_rows_precision(tmp_path, capsys):
    page = protocols.write_page(protocols.BUILT_IN["paper"], tmp_path, plots=False).read_text()
    assert "## Precision" in page and "- micse: --precision fp32 (miCSE's README commands pass no --fp16)" in page
    assert "- whitenedcse: --precision fp16 (WhitenedCSE's run_unsup_example.sh passes --fp16)" in page
