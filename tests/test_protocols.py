"""report.py's protocols: the papers' numbers, the commands of `paper` and `fewshot`, and a tiny protocol (two rows,
two seeds, a sweep of three values) run end to end on the tiny model."""
import importlib
import json
import re

import pytest

import protocols
import report
import tables
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
           "runs/paper/simcse-sup.seed42 --auto_resume" in paper  # one line starts, resumes or finishes a run
    assert "python micse.py --precision fp32 --seed 42 --eval_transfer test --output_dir runs/paper/micse.seed42 " \
           "--auto_resume" in paper
    few = [line for line in lines_of(["commands", "--protocol", "fewshot"], capsys) if line[0] != "#"]
    assert len(few) == 3 * 4 * 5 and all("--precision fp32" in line for line in few)
    assert "python micse.py --precision fp32 --queue_size 0 --fraction 0.001 --seed 48 --output_dir " \
           "runs/fewshot/ami-0.1%.seed48 --auto_resume" in few
    assert "python micse.py --precision fp32 --seed 52 --output_dir runs/fewshot/micse-100%.seed52 --auto_resume" in few
    # on a machine without fp16 (a CPU), --args replaces the row's precision: the last flag wins
    cpu = lines_of(["commands", "--protocol", "paper", "--args", "--precision fp32", "--only", "sscl"], capsys)
    assert cpu[-1].startswith("python sscl.py --precision fp16 --precision fp32 --seed 46")
    sweep = lines_of(["commands", "--protocol", "sweep", "--script", "simcsepp.py", "--flag", "m", "--values", "0.8",
                      "1.0", "--seeds", "42", "--base", "smoke"], capsys)
    assert len(sweep) == 2 and sweep[1].startswith("python simcsepp.py --model_name_or_path ../shared/models/")
    assert sweep[1].endswith("--m 1.0 --seed 42 --output_dir runs/sweep-simcsepp-m/m=1.0.seed42 --auto_resume")


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
    importlib.import_module("simcsepp").main(printed[3].split()[2:])  # --auto_resume: the run starts again
    report.main(["write", "--protocol", str(files["tiny"])])
    assert "4 of 4 runs done" in (tmp_path / "results" / "tiny" / "RESULTS.md").read_text()


def test_a_tiny_sweep_writes_its_plot(tiny_protocols, tmp_path, capsys):
    files, made = tiny_protocols
    report.main(["run", "--protocol", str(files["sweep-simcsepp-dcl_weight"])])
    assert [line.split("--dcl_weight ")[1].split()[0] for line in made] == ["0", "0.1", "1"]
    folder = tmp_path / "results" / "sweep-simcsepp-dcl_weight"
    assert (folder / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert "| dcl\\_weight=0.1 | 1 |" in (folder / "RESULTS.md").read_text()  # Markdown's escape: a literal _


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


def fake_result(avg: float, commit: str = "c" * 40) -> dict:
    return {"method": "simcse", "args": {}, "best_dev_stsb": 80.0, "best_step": 10, "interrupted": False,
            "test": {column: avg for column in protocols.STS},
            "provenance": {"git": {"commit": commit, "uncommitted_changes": False}, "versions": {"torch": "t"}}}


def test_row_names_users_type_keep_the_tables_whole_and_damaged_runs_are_named(tmp_path, capsys):
    """Row names with the characters Markdown and LaTeX treat specially stay one cell each and read back as typed;
    a truncated, non-object or foreign results file is skipped and named on the page."""
    names = ["a|b", "c\\d", "e&f", "g%h", "i_j", "k#l", "m$n", "o{p}", "q*r*"]
    protocol = {"name": "names", "description": "", "args": [], "seeds": [1], "transfer": None,
                "rows": [{"name": name, "script": "simcse.py", "flags": [], "paper": None} for name in names]}
    folder = tmp_path / "names"
    folder.mkdir()
    for i, name in enumerate(names):
        run = {"row": name, "seed": 1}
        (folder / protocols.kept_name(run)).write_text(json.dumps(fake_result(70.0 + i)))
    (folder / protocols.kept_name({"row": "a|b", "seed": 1})).write_text('{"best_step": 1, "te')  # truncated
    (folder / protocols.kept_name({"row": "c\\d", "seed": 1})).write_text("[1, 2]")  # not an object
    (folder / protocols.kept_name({"row": "e&f", "seed": 1})).write_text('{"STS12": 1.0}')  # eval_sts.py --json
    page = protocols.write_page(protocol, tmp_path, plots=False).read_text()
    assert "Skipped, not a run's record:" in page and "cannot be read (JSONDecodeError" in page
    skipped = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skipped")]  # #58: and says so
    assert len(skipped) == 1 and skipped[0].startswith(f"skipped 3 file(s) that are not a run's record (named on "
                                                       f"{folder / 'RESULTS.md'}): ")
    assert page.count("not a run's results.json") == 2
    tables_ = tables.markdown_tables(page.splitlines())
    for table in tables_:
        assert all(len(row) == len(table["header"]) for row in table["rows"]), table["title"]
    sts = next(t for t in tables_ if t["title"].startswith("STS test"))
    assert [row[0] for row in sts["rows"]] == names and [row[1] for row in sts["rows"]] == ["0"] * 3 + ["1"] * 6
    for tex in (folder / "latex").glob("*.tex"):
        body = tex.read_text()
        assert body.count(r"\begin{") == body.count(r"\end{")
        text = re.sub(r"\\[a-zA-Z]+\{\}|\\[{}&%$#_]|\$\\pm\$", "", body)  # the escapes and commands that are whole
        assert text.count("{") == text.count("}"), tex.name
    latex = (folder / "latex" / "01-sts-test-best-sts-b-dev-checkpoint.tex").read_text()
    for escaped in (r"a\textbar{}b", r"c\textbackslash{}d", r"e\&f", r"g\%h", r"i\_j", r"k\#l", r"m\$n", r"o\{p\}"):
        assert escaped in latex, escaped
    assert tables.escape("a\\b") == r"a\textbackslash{}b"  # not \textbackslash\{\}


def test_tools_inputs_that_users_type_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    for protocol, needle in (({"name": "p", "seeds": [1], "rows": [{"name": "x/y", "script": "simcse.py"}]},
                              "cannot name a folder"),
                             ({"name": "..", "seeds": [1], "rows": []}, "cannot name a folder"),
                             ({"name": "p", "seeds": [1], "rows": [{"name": "a", "script": "s.py"}] * 2},
                              "two rows have the same name"),
                             ({"name": "p", "seeds": ["1"], "rows": []}, "not a protocol"),
                             ([1, 2], "not a protocol")):
        bad.write_text(json.dumps(protocol))
        with pytest.raises(SystemExit) as stop:
            report.main(["commands", "--protocol", str(bad)])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    bad.write_text('{"name": "p", "seeds": [1], "rows": [')
    for argv, needle in ((["commands", "--protocol", str(bad)], "not a protocol"),
                         (["commands", "--protocol", "paper", "--args", "--train_file 'my file"],
                          "--args \"--train_file 'my file\": No closing quotation"),
                         (["commands", "--protocol", "sweep", "--script", "simcsepp.py", "--flag", "m", "--values",
                           "1", "--flags", '--x "y'], "--flags '--x \"y': No closing quotation")):
        with pytest.raises(SystemExit) as stop:
            report.main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    # a sweep over paths: its values name files, not folders
    sweep = protocols.sweep_protocol("simcse.py", "model_name_or_path", ["/m/a", "/m/b"], [1], [], "paper")
    assert [run["out"].name for run in protocols.runs(sweep)] == ["model_name_or_path=_m_a.seed1",
                                                                 "model_name_or_path=_m_b.seed1"]


def test_rows_that_would_share_a_run_folder_are_one_line(tmp_path, capsys):
    """#58: file_name makes '\\' and '/' '_', so the rows a\\b and a_b (and a sweep's values m/a and m_a) would write
    one runs/<protocol>/<row>.seed<S> folder and one kept results file: refused before any run, naming both."""
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "p", "seeds": [1], "rows": [{"name": "a\\b", "script": "simcse.py"},
                                                                   {"name": "a_b", "script": "simcse.py"}]}))
    for argv, needle in ((["commands", "--protocol", str(bad)], "the rows 'a\\\\b' and 'a_b' would share one folder, "
                                                                "a_b.seed<S>"),
                         (["commands", "--protocol", "sweep", "--script", "simcse.py", "--flag", "model_name_or_path",
                           "--values", "m/a", "m_a"], "the rows 'model_name_or_path=m/a' and 'model_name_or_path=m_a' "
                                                      "would share one folder")):
        with pytest.raises(SystemExit) as stop:
            report.main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert len({run["out"] for run in protocols.runs(protocols.sweep_protocol(
        "simcse.py", "model_name_or_path", ["m/a", "m/b"], [1], [], "paper"))}) == 2  # distinct folders still run
