"""--resume: a run stopped by SIGTERM and resumed (twice) ends bit-identical to the same run done straight."""
import importlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from plumbing import distributed
import plumbing
from plumbing import checkpoint, hub, resume, run as run_module
from conftest import ROOT, cli_in_process, gates, smoke_args, write_nli

# 20 examples at batch 8 are 3 steps an epoch (8, 8, 4): 6 steps are two epochs. The first run is stopped at
# step 2 (a dev gate, within epoch 0), the resumed one at step 3 (between gates, at the epoch's end).
STOPS = (2, 3)
CASES = {"simcse": [], "simcse-sup": ["--supervised"], "simcsepp": [], "sscl": ["--neg_layers", "1"],
         "whitenedcse": ["--num_groups", "16"], "micse": ["--queue_size", "12"],
         # the MLM head and the masking generator (#30), SSCL's projection (Table 5)
         "simcse-mlm": ["--do_mlm"], "sscl-projection": ["--neg_layers", "1", "--output_dim", "8"],
         # fp16 on CPU: the GradScaler's scale and growth tracker travel with last/ (#46)
         "simcse-fp16": ["--precision", "fp16"],
         # GradCache (#53): its parts' RNG states and the queue travel with last/ like the rest
         "micse-micro": ["--queue_size", "12", "--micro_batch_size", "3", "--gradient_checkpointing"]}


def case_args(case, tiny_model, corpus, senteval_dir, out, tmp_path):
    data = write_nli(tmp_path / "nli.csv", 20) if case == "simcse-sup" else corpus
    fraction = [] if case == "simcse-sup" else ["--fraction", 0.1]
    return [str(a) for a in smoke_args(tiny_model, data, senteval_dir, out, "--max_steps", 6, "--no_test_eval",
                                       "--lr", 1e-3, "--save_minutes", 0, *fraction, *CASES[case])]


def sigterm_at(monkeypatch, step):
    """The loop asks the StopSignal once a step, from step 0 (or the step it resumes at): SIGTERM this process
    when it asks at `step`, as SLURM's pre-emption would during that step."""
    real = distributed.StopSignal.requested
    calls = itertools.count()

    def requested(self, *args, **kwargs):
        if next(calls) == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(distributed.StopSignal, "requested", requested)


def run(script, argv, monkeypatch, stop_at=None, first_step=0):
    import importlib
    with monkeypatch.context() as patch:
        if stop_at is not None:
            sigterm_at(patch, stop_at - first_step)
        try:
            importlib.import_module(script).main(argv)
        except SystemExit as stopped:
            assert stop_at is not None and stopped.code == 143
            return
    assert stop_at is None


def outcome(out):
    results = json.loads((out / "results.json").read_text())
    weights = {f.name: load_file(f) for f in sorted((out / "best").glob("*.safetensors"))}
    return results, weights


@pytest.fixture(scope="module")
def straight_runs(tiny_model, corpus, senteval_dir, tmp_path_factory):
    """Each case run straight, once."""
    import importlib
    outs = {}
    for case in CASES:
        tmp = tmp_path_factory.mktemp(f"straight-{case}")
        importlib.import_module(case.split("-")[0]).main(case_args(case, tiny_model, corpus, senteval_dir,
                                                                   tmp / "run", tmp))
        outs[case] = tmp / "run"
    return outs


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_run_is_bit_identical_to_a_straight_one(case, straight_runs, tiny_model, corpus, senteval_dir,
                                                          tmp_path, monkeypatch):
    script, out = case.split("-")[0], tmp_path / "run"
    argv = case_args(case, tiny_model, corpus, senteval_dir, out, tmp_path)
    run(script, argv, monkeypatch, stop_at=STOPS[0])
    interrupted = json.loads((out / "results.json").read_text())
    assert interrupted["interrupted"] is True and interrupted["steps"] == STOPS[0]
    assert json.loads((out / "last" / "run.json").read_text())["step"] == STOPS[0]
    scaler = torch.load(out / "last" / "state.pt", weights_only=True)["scaler"]  # tensors and plain data
    assert (scaler["scale"] == 65536.0) if case == "simcse-fp16" else scaler == {}  # a disabled scaler has none
    run(script, argv + ["--resume"], monkeypatch, stop_at=STOPS[1], first_step=STOPS[0] + 1)
    assert json.loads((out / "last" / "run.json").read_text())["step"] == STOPS[1]
    run(script, argv + ["--resume"], monkeypatch)

    (resumed, resumed_weights), (straight, straight_weights) = outcome(out), outcome(straight_runs[case])
    assert resumed["train_loss"] == straight["train_loss"]  # bit for bit: floats compared exactly
    assert resumed["grad_norm"] == straight["grad_norm"]
    assert gates(resumed) == gates(straight) and resumed["best_step"] == straight["best_step"]
    assert resumed["best_dev_stsb"] == straight["best_dev_stsb"]
    assert resumed["align_uniform"] == straight["align_uniform"]
    assert resumed_weights.keys() == straight_weights.keys()
    for name in resumed_weights:
        for key in resumed_weights[name]:
            assert torch.equal(resumed_weights[name][key], straight_weights[name][key]), key
    assert resumed["resumptions"] == list(STOPS) and straight["resumptions"] == []
    assert not (out / "last").exists()  # a completed run deletes it


def test_auto_resume_starts_resumes_and_restarts_one_command(tiny_model, corpus, senteval_dir, tmp_path,
                                                              monkeypatch, straight_runs):
    """--auto_resume: the first time it starts; stopped, the same command resumes (to the straight run's result);
    a run stopped before its first save starts again; a completed run exits 0; another run's folder is one line."""
    out = tmp_path / "run"
    argv = case_args("simcse", tiny_model, corpus, senteval_dir, out, tmp_path) + ["--auto_resume"]
    run("simcse", argv, monkeypatch, stop_at=STOPS[0])
    run("simcse", argv, monkeypatch)
    resumed, straight = outcome(out)[0], outcome(straight_runs["simcse"])[0]
    assert resumed["train_loss"] == straight["train_loss"] and resumed["resumptions"] == [STOPS[0]]
    with pytest.raises(SystemExit) as done:  # complete: nothing to do (tests/test_faults.py)
        importlib.import_module("simcse").main(argv)
    assert done.value.code == 0
    (out / "results.json").unlink()  # as if killed before its first save: best/, tb/, started.json, no last/
    run("simcse", argv, monkeypatch)
    assert outcome(out)[0]["train_loss"] == straight["train_loss"] and outcome(out)[0]["resumptions"] == []
    (out / "results.json").unlink()
    with pytest.raises(plumbing.UsageError, match=r"^--auto_resume: --lr is 0.002 here but 0.001 in the run in "
                                                  r".*started.json"):
        run("simcse", argv + ["--lr", "2e-3"], monkeypatch)


@pytest.fixture(scope="module")
def stopped_run(tiny_model, corpus, senteval_dir, tmp_path_factory):
    """A run stopped by SIGTERM at step 2 (its last/ saved), once: (its folder, its argv); each test takes a copy."""
    tmp = tmp_path_factory.mktemp("stopped")
    argv = case_args("simcse", tiny_model, corpus, senteval_dir, tmp / "run", tmp)
    with pytest.MonkeyPatch.context() as patch:
        run("simcse", argv, patch, stop_at=STOPS[0])
    return tmp / "run", argv


class RunsCode:
    """Unpickled, it runs code (here: it creates the file `marker`), as a crafted last/ from someone else would."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


@pytest.mark.parametrize("damage", ["truncated state.pt", "unreadable run.json", "missing rng_rank0.pt",
                                    "missing run.json", "crafted state.pt", "crafted rng_rank0.pt"])
def test_a_damaged_or_crafted_last_is_one_line_naming_the_file_and_nothing_changes(damage, stopped_run, tmp_path,
                                                                                   monkeypatch):
    """A file of last/ that is damaged, or crafted to run code when unpickled (#58: a run folder from someone else),
    is one line naming it, before any work (the model is not loaded); nothing runs, nothing changes."""
    out = tmp_path / "run"
    shutil.copytree(stopped_run[0], out)
    argv = [str(out) if a == str(stopped_run[0]) else a for a in stopped_run[1]]
    name, marker = damage.split()[-1], tmp_path / "code-ran"
    if damage.startswith("truncated"):
        data = (out / "last" / name).read_bytes()
        (out / "last" / name).write_bytes(data[:len(data) // 2])
    elif damage.startswith("unreadable"):
        (out / "last" / name).write_text("{")
    elif damage.startswith("crafted"):
        torch.save({"record": RunsCode(marker)}, out / "last" / name)
    else:
        (out / "last" / name).unlink()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    monkeypatch.setattr(hub, "load_pretrained", lambda *a, **k: pytest.fail("loaded the model before the check"))
    why = "holds Python objects other than tensors and plain data" if damage.startswith("crafted") else \
        "cannot be read"
    for extra in (["--resume"], ["--auto_resume"]):
        code, err = cli_in_process(importlib.import_module("simcse"), *argv, *extra)
        assert code == 2 and f"last/{name} {why}" in err and "--overwrite_output_dir" in err, err
        assert len(err.strip().splitlines()) == 1
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    if damage.startswith("crafted"):  # torch.load(weights_only=True) refuses it too, whatever the check found
        with pytest.raises(plumbing.UsageError, match="which unpickling could run as code"):
            resume.load(out / "last" / name)
        assert not marker.exists()


def test_rng_streams_are_saved_as_tensors_and_an_earlier_versions_still_load(tmp_path):
    """last/'s RNG streams are tensors and plain data (torch.load(weights_only=True) reads them), restored exactly;
    an earlier version's file (Python's state as a tuple, NumPy's with its uint32 array) still loads, and only such
    arrays: a NumPy array of Python objects is refused."""
    import random
    import numpy as np

    def draws():
        return random.random(), np.random.rand(), torch.rand(1).item()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    def earlier():  # the format before #58: Python's tuple, NumPy's tuple with its array
        return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
                "cuda": None}
    for rng_state in (resume.rng_state, earlier):
        torch.save({"rng": rng_state()}, tmp_path / "rng.pt")
        expected = draws()
        draws()
        resume.check_safe(tmp_path / "rng.pt")
        resume.set_rng_state(resume.load(tmp_path / "rng.pt")["rng"])
        assert draws() == expected
    torch.save({"rng": np.array([RunsCode(tmp_path / "code-ran")], dtype=object)}, tmp_path / "objects.pt")
    with pytest.raises(plumbing.UsageError, match="holds Python objects other than tensors"):
        resume.check_safe(tmp_path / "objects.pt")
    with pytest.raises(plumbing.UsageError, match="holds Python objects other than tensors"):
        resume.load(tmp_path / "objects.pt")
    assert not (tmp_path / "code-ran").exists()


def test_resume_with_a_changed_lr_is_one_line_naming_it(tiny_model, corpus, senteval_dir, tmp_path, monkeypatch):
    import simcse
    out = tmp_path / "run"
    argv = case_args("simcse", tiny_model, corpus, senteval_dir, out, tmp_path)
    run("simcse", argv, monkeypatch, stop_at=2)
    with pytest.raises(plumbing.UsageError, match=r"--resume: --lr is 0.002 here but 0.001 in the run in .*last"):
        simcse.main(argv + ["--resume", "--lr", "2e-3"])
    # flags that do not change the numbers may differ
    simcse.main(argv + ["--resume", "--num_workers", "1", "--logging_steps", "1", "--keep_last"])
    assert (out / "last" / "run.json").is_file()  # --keep_last


def test_resume_without_last_is_one_line_and_the_guards_stay(tiny_model, corpus, senteval_dir, tmp_path):
    """In this process, as plumbing.cli runs main() (simcse.py's CLI: its subprocess tests)."""
    import simcse
    out = tmp_path / "run"
    code, stderr = cli_in_process(simcse, *case_args("simcse", tiny_model, corpus, senteval_dir, out, tmp_path),
                                  "--resume")
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.strip().startswith(f"error: --resume: {out} has no last/ to resume from")
    assert stderr.strip().endswith("the same command with --auto_resume instead starts a run that stopped before its "
                                   "first save again")
    argv = case_args("simcse", tiny_model, corpus, senteval_dir, out, tmp_path)
    with pytest.raises(plumbing.UsageError, match="give one of them"):
        simcse.main(argv + ["--resume", "--overwrite_output_dir"])


def test_a_kill_while_writing_last_leaves_a_loadable_state(tiny_model, corpus, senteval_dir, tmp_path,
                                                           monkeypatch, straight_runs):
    """Killed in the middle of writing the state file (the previous last/ stays) or between the two renames (the
    previous one is in last.old/): --resume continues from it to the straight run's result."""
    import simcse
    out = tmp_path / "run"
    argv = case_args("simcse", tiny_model, corpus, senteval_dir, out, tmp_path)
    real_save, real_rename = torch.save, type(out).rename

    def killed_while_saving(obj, path, *args, **kwargs):
        if "last.tmp" in str(path) and str(path).endswith("state.pt") and "record" in obj and \
                len(obj["record"]["losses"]) == 4:  # the save at step 4
            real_save(obj, path, *args, **kwargs)
            with open(path, "r+b") as f:
                f.truncate(100)  # half a file
            raise KeyboardInterrupt
        return real_save(obj, path, *args, **kwargs)
    monkeypatch.setattr(torch, "save", killed_while_saving)
    with pytest.raises(KeyboardInterrupt):
        simcse.main(argv)
    monkeypatch.setattr(torch, "save", real_save)
    assert json.loads((out / "last" / "run.json").read_text())["step"] == 2 and (out / "last.tmp").exists()

    def killed_between_renames(self, target):
        if self.name == "last.tmp":
            raise KeyboardInterrupt
        return real_rename(self, target)
    monkeypatch.setattr(type(out), "rename", killed_between_renames)
    with pytest.raises(KeyboardInterrupt):
        simcse.main(argv + ["--resume"])  # resumes after step 2, killed in the save at step 4
    monkeypatch.setattr(type(out), "rename", real_rename)
    assert not (out / "last").exists() and resume.folder(out) == out / "last.old"

    simcse.main(argv + ["--resume"])
    resumed, straight = outcome(out)[0], outcome(straight_runs["simcse"])[0]
    # the first resumption's record went with its unfinished save: the run resumed from step 2's state once
    assert resumed["train_loss"] == straight["train_loss"] and resumed["resumptions"] == [2]
    assert not any((out / name).exists() for name in ("last", "last.old", "last.tmp"))


DRIVER = '''
import itertools, os, signal, sys
sys.path[:0] = [{root!r}]
import importlib, plumbing
from plumbing import distributed
kill_at, straight, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
real, calls = distributed.StopSignal.requested, itertools.count()
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
def requested(self, *args, **kwargs):
    if next(calls) == kill_at and distributed.rank() == 1 and first_attempt:  # a node lost: no handler, no save
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, *args, **kwargs)
def run(argv):
    try:
        plumbing.cli(lambda: importlib.import_module("micse").main(argv))
    except SystemExit as exit:
        return exit.code
    return 0
if first_attempt:  # the straight run first, in the same two processes (the interpreters' start paid once)
    at = argv.index("--output_dir") + 1
    if run(argv[:at] + [straight] + argv[at + 1:]) != 0:
        sys.exit(1)
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "straight"  # the next process group under keys of its own
distributed.StopSignal.requested = requested
code = run(argv)
sys.exit(code)
'''


def test_resume_under_torchrun(tiny_model, corpus, senteval_dir, tmp_path):
    """Two processes (gloo), one command under torchrun --max_restarts 1 with --auto_resume: a straight run of miCSE,
    then the same run with process 1 SIGKILLed during step 3; torchrun restarts both, and they continue from last/
    (step 2's gate) in new processes and end with the straight run's losses and gates (a resume that lost any state
    would part them: the AMI generators, alike on each process, the slices and the shared queue). A signal to one
    process or to both, the stop at the same step and its resume: test_distributed.py."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(root=str(ROOT)))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    argv = case_args("micse", tiny_model, corpus, senteval_dir, tmp_path / "restarted", tmp_path) + [
        "--device", "cpu", "--auto_resume"]
    restarted = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                "2", "--max_restarts", "1", str(driver), "3", str(tmp_path / "straight"), *argv],
                               capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    b = json.loads((tmp_path / "straight" / "results.json").read_text())
    c = json.loads((tmp_path / "restarted" / "results.json").read_text())
    assert b["world_size"] == 2 and b["steps"] == 6 and not b.get("resumptions")
    assert c["resumptions"] == [2] and "exitcode: -9" in restarted.stderr  # SIGKILLed, then resumed at step 2
    assert c["train_loss"] == b["train_loss"] and gates(c) == gates(b) and c["best_step"] == b["best_step"]


def test_last_is_saved_at_dev_gates_after_save_minutes_every_save_steps_and_at_a_signal(
        tiny_model, corpus, senteval_dir, tmp_path, monkeypatch):
    """--save_minutes 0: at every gate; the default (10 minutes of training): a short run saves at --save_steps and
    at the signal only. best/ is written where last/ is (and at the end), from the device copy of the best model."""
    saved_at, written_at = [], []
    real_save, real_write = resume.save, checkpoint.BestCopy.write
    monkeypatch.setattr(resume, "save", lambda args, step, *rest: saved_at.append(step) or real_save(args, step,
                                                                                                      *rest))
    monkeypatch.setattr(checkpoint.BestCopy, "write", lambda self, out, card: written_at.append(len(saved_at)) or
                        real_write(self, out, card))
    argv = case_args("simcse", tiny_model, corpus, senteval_dir, tmp_path / "run", tmp_path)
    run("simcse", argv + ["--eval_steps", "4", "--save_steps", "3"], monkeypatch, stop_at=5)
    assert saved_at == [0, 3, 4, 5]  # gates 0 and 4, --save_steps 3, the signal at 5
    saved_at.clear()
    written_at.clear()
    argv = case_args("simcse", tiny_model, corpus, senteval_dir, tmp_path / "default", tmp_path)
    del argv[argv.index("--save_minutes"):argv.index("--save_minutes") + 2]  # the default, 10 minutes
    run("simcse", argv + ["--eval_steps", "2", "--save_steps", "3"], monkeypatch, stop_at=5)
    assert saved_at == [3, 5]  # gates 0, 2, 4 were within 10 minutes of training: no save there
    assert written_at[0] == 0 and set(written_at) <= {0, 1}  # best/ just before a save of last/, when newer
    times = json.loads((tmp_path / "default" / "results.json").read_text())["checkpoint_time_s"]
    assert times["last_writes"] == 2 and times["best_writes"] == len(written_at) and times["best_copies"] >= 1


def test_deterministic_sets_torch_and_cublas_and_changes_nothing_on_cpu(straight_runs, tiny_model, corpus,
                                                                        senteval_dir, tmp_path, monkeypatch):
    """--deterministic: PyTorch's deterministic algorithms and cuBLAS's fixed workspace (what a bit-identical resume
    on a GPU needs: tests/test_cuda.py); a CPU run is deterministic already, so its numbers stay the same."""
    import simcse
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        simcse.main(case_args("simcse", tiny_model, corpus, senteval_dir, tmp_path / "run", tmp_path)
                    + ["--deterministic"])
        assert torch.are_deterministic_algorithms_enabled() and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
    assert outcome(tmp_path / "run")[0]["train_loss"] == outcome(straight_runs["simcse"])[0]["train_loss"]
