"""What a user sees while a run works: tqdm bars on a terminal, plain periodic lines in a log, the run summary
with its presets (printed and in results.json), an ETA in the log lines, and no phase left silent."""
import argparse
import fcntl
import json
import os
import re
import pty
import struct
import subprocess
import sys
import termios

import pytest

import simcse
from plumbing import progress, run
from conftest import ROOT, cli_in_process, smoke_args

DEMO = "import time\nfrom plumbing import progress\nwith progress.Progress(4, 'demo', unit='step') as bar:\n" \
       "    for _ in range(4):\n        time.sleep(0.05)\n        bar.update()\n        bar.set_postfix(loss=0.5)\n"


class FakeClock:
    def __init__(self, *times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


def test_duration_by_hand():
    assert [progress.duration(s) for s in (0, 59.4, 61, 3599, 3720, None, float("nan"))] == \
        ["0s", "59s", "1m01s", "59m59s", "1h02m", "?", "?"]


def test_plain_lines_carry_count_rate_eta_and_postfix(monkeypatch, capsys):
    """Not a terminal (pytest captures stderr): no bar, a line per interval; 1 of 3 steps after 10 s is 0.1
    steps/s, so 2 steps are left at 20 s."""
    monkeypatch.setattr(progress.time, "monotonic", FakeClock(0.0, 10.0, 10.5, 30.0, 31.0))
    bar = progress.Progress(3, "demo", unit="step")
    assert bar.bar is None
    bar.set_postfix(loss=0.25, best_dev=None)
    bar.update()  # t = 10: the first interval has passed
    bar.update()  # t = 10.5: too soon for another line
    bar.update()  # t = 30
    bar.close()  # t = 31
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["demo: 1/3 steps (33%), 0.1 steps/s, 10s elapsed, ETA 20s  loss 0.25",
                     "demo: 3/3 steps (100%), 0.1 steps/s, 30s elapsed, ETA 0s  loss 0.25",
                     "demo: 3/3 steps in 31s"]


def test_a_short_phase_in_a_log_says_nothing(monkeypatch, capsys):
    monkeypatch.setattr(progress.time, "monotonic", FakeClock(0.0, 1.0, 2.0))
    with progress.Progress(2, "short") as bar:
        bar.update(2)
    assert capsys.readouterr().out == ""


def test_unpause_leaves_a_dev_gate_out_of_the_rate(monkeypatch, capsys):
    """1 step by t = 1, a 100 s gate, unpause, 1 more step by t = 102: 2 steps in 2 s of work."""
    monkeypatch.setattr(progress.time, "monotonic", FakeClock(0.0, 1.0, 101.0, 102.0))
    monkeypatch.setenv("PROGRESS_INTERVAL", "1.5")
    bar = progress.Progress(4, "training", unit="step")
    bar.update()
    bar.unpause()
    bar.update()
    assert capsys.readouterr().out.splitlines() == ["training: 2/4 steps (50%), 1 steps/s, 2s elapsed, ETA 2s"]


def run_in_terminal(code: str) -> str:
    """Run python -c code in a pseudo-terminal of 120 x 40 and return everything it wrote."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=follower, stdout=follower, stderr=follower,
                            cwd=ROOT, env=dict(os.environ, PYTHONIOENCODING="utf-8"))
    os.close(follower)
    output = bytearray()
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed: the process is done
            break
        if not chunk:
            break
        output.extend(chunk)
    proc.wait(timeout=60)
    os.close(leader)
    return output.decode(errors="replace")


def test_a_terminal_gets_a_bar_and_a_log_gets_plain_lines():
    terminal = run_in_terminal(DEMO)
    assert "demo: 100%|" in terminal and "4/4" in terminal and "step/s" in terminal and "loss 0.5" in terminal
    log = subprocess.run([sys.executable, "-c", DEMO], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PROGRESS_INTERVAL="0"))
    assert "%|" not in log.stdout + log.stderr and "\r" not in log.stdout + log.stderr
    assert log.stdout.splitlines()[0].startswith("demo: 1/4 steps (25%), ")
    assert log.stdout.splitlines()[-1].startswith("demo: 4/4 steps in ")


def test_a_run_in_a_log_file_has_the_summary_plain_progress_and_no_redraws(tiny_model, corpus, senteval_dir,
                                                                            tmp_path, monkeypatch, capsys):
    """A whole run whose output is not a terminal (in this process, as plumbing.cli runs main(): a new interpreter's
    log is test_a_terminal_gets_a_bar_and_a_log_gets_plain_lines's and the scripts' CLI tests')."""
    out = tmp_path / "run"
    monkeypatch.setenv("PROGRESS_INTERVAL", "0")
    code, err = cli_in_process(simcse, *smoke_args(tiny_model, corpus, senteval_dir, out, "--fraction", "0.5"))
    printed = capsys.readouterr().out
    assert code == 0, err
    lines = printed.splitlines()
    assert "\r" not in printed and "%|" not in printed + err
    assert lines[0] == "simcse" and lines[1].startswith("  presets   none")
    assert lines[2] == "  backbone  bert, 32 wide, 2 layers: no preset for this backbone, the BERT-base settings"
    assert lines[3] == f"  data      100 examples, a 0.5 subset of {corpus} drawn with --seed 42 (not the " \
                       "authors' subset: theirs are --fraction 0.000064, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.1 " \
                       "with --seed 48-52)"
    assert lines[5] == "  encoder   sdpa attention, a prebuilt 4-D mask (no host check)"
    assert lines[6] == "  device    cpu x 1, precision fp32"
    assert lines[7] == "  execution the whole batch in one pass, eager, padded to its longest row (no " \
                       "--micro_batch_size, --gradient_checkpointing, --compile or --pad_to_max_length)"
    assert lines[8].startswith("  schedule  4 steps (13 an epoch), batch 8")
    assert "step 0/4  STS-B dev" in printed and "loss nan" not in printed
    for phase in ("training: 1/4 steps", "dev gate: STS-B dev: ", "STS test: encoding: ", "alignment/uniformity: "):
        assert phase in printed, phase
    assert "ETA" in next(line for line in lines if line.startswith("step 2/4"))
    # the bar's loss is the last logged step's, and says which (it read "loss 0.3452" for ten steps, no step named)
    after_log = [line for line in lines if line.startswith("training: 3/4 steps")]
    assert after_log and re.search(r"  loss -?[\d.]+(e-?\d+)? \(step 2\), best_dev ", after_log[0]), after_log
    results = json.loads((out / "results.json").read_text())
    assert set(results["summary"]) == {"presets", "backbone", "data", "model", "encoder", "device", "execution",
                                       "schedule", "output"}
    assert results["summary"]["data"] == lines[3].split(None, 1)[1]
    assert results["args"]["presets"] == {"source": "none: the defaults in --help (BERT-base's)", "applied": {},
                                          "overridden": {}}  # what applied: none, and why
    assert results["args"]["backbone"] is None


def test_presets_are_recorded_with_their_source_and_the_users_overrides():
    args = simcse.parse_args(["--supervised", "--lr", "1e-4"])
    assert args.presets == {"source": "supervised SimCSE (Table A.1, Appendix A)",
                            "applied": {"batch_size": 512, "epochs": 3, "eval_steps": 250, "mlp_only_train": False},
                            "overridden": {"lr": 1e-4}}
    assert simcse.parse_args([]).presets == {"source": "none: the defaults in --help (BERT-base's)", "applied": {},
                                             "overridden": {}}


def summary_args(**kw):
    values = dict(fraction=1.0, seed=42, train_file=None, presets=None, method="micse", model_name_or_path="m",
                  pooler="cls", mlp_only_train=True, precision="fp32", compile=False, batch_size=64, lr=1e-5,
                  eval_steps=500, output_dir="out", backbone="bert-base", backbone_config="bert, 768 wide",
                  micro_batch_size=None, gradient_checkpointing=False, pad_to_max_length=False)
    return argparse.Namespace(**{**values, **kw})


@pytest.mark.parametrize("kw, subset, data", [
    (dict(fraction=0.01, seed=3), None, "10 examples, a 0.01 subset of wiki1m.txt drawn with --seed 3 (not the "
                                        "authors' subset: theirs are --seed 48-52)"),
    (dict(fraction=0.01, seed=48), "wiki_subset_1M_001.00percent_seed48.txt",
     "miCSE's released subset wiki_subset_1M_001.00percent_seed48.txt: 10 examples (Table 2's data)"),
    (dict(fraction=0.02, seed=3), None, "10 examples, a 0.02 subset of wiki1m.txt drawn with --seed 3 (not the "
     "authors' subset: theirs are --fraction 0.000064, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.1 with --seed 48-52)"),
    (dict(fraction=0.02, seed=3, supervised=True), None, "10 examples, a 0.02 subset of wiki1m.txt drawn with "
                                                         "--seed 3"),  # NLI: miCSE released no subset of it
    (dict(fraction=0.01, seed=3, train_file="mine.txt"), None, "10 examples, a 0.01 subset of wiki1m.txt drawn "
                                                               "with --seed 3 (not the authors' subset: theirs are "
                                                               "--seed 48-52)"),
    (dict(fraction=0.01, seed=48, train_file="mine.txt"), None, "10 examples, a 0.01 subset of wiki1m.txt drawn "
     "with --seed 48 (not the authors' subset: a local copy is read whole under its name, "
     "wiki_subset_1M_001.00percent_seed48.txt)"),
    (dict(), None, "10 examples from wiki1m.txt"),
])
def test_the_summary_says_whose_data_it_is(kw, subset, data, capsys):
    summary = run.summary(summary_args(**kw), {"num_train_examples": 10, "train_file": "wiki1m.txt",
                                               "micse_subset": subset}, 1, 50, "cpu")
    assert summary["data"] == data and f"  data      {data}" in capsys.readouterr().out


def test_the_summary_names_the_presets_and_what_replaced_them():
    import micse
    args = micse.parse_args(["--fraction", "0.01", "--seed", "3", "--lr", "2e-5"])
    summary = run.summary(args, {"num_train_examples": 10, "train_file": "wiki1m.txt", "micse_subset": None}, 1, 50,
                          "cpu")
    assert summary["presets"] == ("miCSE's settings for fraction 0.01 (the authors' README): batch_size 64, epochs 50, "
                                  "warmup_steps 0, ami_lambda 0.0001, eval_steps 500; your flags replaced lr (now "
                                  "2e-05)")


def test_the_summary_echoes_what_changes_a_steps_memory_and_time(capsys):
    summary = run.summary(summary_args(micro_batch_size=16, gradient_checkpointing=True, compile=True,
                                       pad_to_max_length=True, max_seq_length=32),
                          {"num_train_examples": 10, "train_file": "wiki1m.txt", "micse_subset": None}, 1, 50, "cpu")
    assert summary["execution"] == ("--micro_batch_size 16 (GradCache: the whole batch's loss, 16 examples encoded at "
                                    "a time); --gradient_checkpointing (each layer recomputed in the backward pass); "
                                    "--compile (torch.compile); --pad_to_max_length (every batch 32 tokens wide: "
                                    "one shape)")
    assert f"  execution {summary['execution']}" in capsys.readouterr().out and "compile" not in summary["device"]


def test_log_lines_show_no_loss_at_step_0_and_an_eta_after():
    assert run.progress_line(0, 100, [], 0.0) == "step 0/100"
    assert run.progress_line(10, 100, [0.5] * 10, 5.0) == "step 10/100  loss 0.5000  2.00 steps/s  ETA 45s"
    assert run.progress_line(100, 100, [0.5] * 100, 50.0) == "step 100/100  loss 0.5000  2.00 steps/s"
