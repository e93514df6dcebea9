"""What stops a run leaves the last complete state and one line, and nothing a user had is lost or rewritten: a
SIGTERM at any moment under --auto_resume (the SLURM recipe of docs/engineering.md), --keep_last, a completed run, a
folder replaced with --overwrite_output_dir, the best model's one copy, a resumed run's model card, a run that
diverges, full, read-only and failing disks, a SIGTERM to the whole process group with data-loader workers, two
processes on one folder."""
import contextlib
import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import common
import eval_sts
import simcse
from plumbing import checkpoint, distributed, lock, outdir, resume
from plumbing import run as run_module
from conftest import (ROOT, TRACKED, cli_in_process, gates, next_second, smoke_args, tracked, tracker_env,
                      write_tiny_model)


def argv_of(tiny_model, corpus, senteval_dir, out, *extra):
    """The SLURM recipe's command, small: 6 steps, a dev gate every 2, --auto_resume, the default --save_minutes (a
    short run saves last/ only when it stops)."""
    return [str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--max_steps", 6, "--lr", 1e-3,
                                       "--auto_resume", *extra)]


def digests(folder):
    return {p.relative_to(folder): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def weights(out):
    return {f.name: load_file(f) for f in sorted((out / "best").glob("*.safetensors"))}


def signal_at(monkeypatch, target, name, nth, signum=signal.SIGTERM, when=lambda *a, **k: True):
    """Send `signum` to this process inside the `nth` call (from 0) of target.name that `when` accepts."""
    real, calls = getattr(target, name), itertools.count()

    def wrapped(*args, **kwargs):
        if when(*args, **kwargs) and next(calls) == nth:
            os.kill(os.getpid(), signum)
        return real(*args, **kwargs)
    monkeypatch.setattr(target, name, wrapped)


@pytest.fixture(scope="module")
def straight(tiny_model, corpus, senteval_dir, tmp_path_factory):
    """The recipe run once without a stop, every tracker on: its results.json, best/ weights and what the trackers
    hold (conftest.tracked)."""
    out = tmp_path_factory.mktemp("straight") / "run"
    with pytest.MonkeyPatch.context() as patch:
        tracker_env(patch, out.parent / "mlruns")
        simcse.main(argv_of(tiny_model, corpus, senteval_dir, out, *TRACKED))
        return json.loads((out / "results.json").read_text()), weights(out), tracked(out)


def assert_like_straight(out, straight):
    results, want_weights = straight[:2]
    got = json.loads((out / "results.json").read_text())
    assert got["interrupted"] is False and "interrupted_during" not in got
    for key in ("train_loss", "grad_norm", "best_step", "best_dev_stsb", "test", "align_uniform"):
        assert got[key] == results[key], key  # floats compared exactly
    assert gates(got) == gates(results)
    got_weights = weights(out)
    assert got_weights.keys() == want_weights.keys()
    for name in got_weights:
        for key in got_weights[name]:
            assert torch.equal(got_weights[name][key], want_weights[name][key]), key
    assert not any((out / name).exists() for name in ("last", "last.old", "last.tmp", "best.tmp", ".lock"))
    return got


MOMENTS = {  # where the SIGTERM comes: (module, function, which call, a filter on its arguments)
    "training": (simcse, "info_nce", 2, None),  # during step 3's loss: between two dev gates
    "dev gate": (run_module, "dev_measures", 2, None),  # the gate at step 4
    "writing best/": (checkpoint.BestCopy, "write", 0, None),  # the end's write (no save before it: 10 minutes)
    "final evaluation": (eval_sts, "evaluate", 0, lambda *a, mode="test", **k: mode == "test"),
}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_the_slurm_recipe_survives_a_sigterm_at_any_moment(moment, straight, tiny_model, corpus, senteval_dir,
                                                           tmp_path, monkeypatch, capsys):
    """SIGTERM (`--signal=TERM@120`, a pre-emption) at each moment: exit 143, then the same --auto_resume command
    (the requeued job) ends as the uninterrupted run: the same losses, dev curve, best step, best/ and test scores,
    and each tracker (TensorBoard, MLflow, W&B offline, each read back by its own reader as lists) holds every
    metric at each step once, with the uninterrupted run's value, test/* and the lr included. The stop's last line
    and a plain rerun of the command (no --auto_resume) name --auto_resume first, and what is left. Fails where a
    resume logs again what a tracker holds (a duplicate), or skips what it lacks (a gap)."""
    out = tmp_path / "run"
    tracker_env(monkeypatch, tmp_path / "mlruns")
    argv = argv_of(tiny_model, corpus, senteval_dir, out, *TRACKED)
    target, name, nth, when = MOMENTS[moment]
    with monkeypatch.context() as patch:
        signal_at(patch, target, name, nth, when=when or (lambda *a, **k: True))
        with pytest.raises(SystemExit) as stopped:
            simcse.main(argv)
    assert stopped.value.code == 143
    first = json.loads((out / "results.json").read_text())
    assert first["interrupted"] is True and first["stop"]["by"] == "SIGTERM"
    training_done = moment in ("writing best/", "final evaluation")
    assert first["interrupted_during"] == ("final evaluation" if training_done else "training")
    assert outdir.state(out)[0] == ("evaluating" if training_done else "resumable")
    left = "whose training ended and whose final evaluation did not: to finish it" if training_done else \
        f"stopped after step {first['steps']} of 6: to continue it"
    hint = "run the same command with --auto_resume (or --resume)"
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(
        "stopped during the final evaluation: to finish it" if training_done else
        f"stopped after step {first['steps']} of 6 (last/ holds it): to continue it, {hint}")
    code, err = cli_in_process(simcse, *[a for a in argv if a != "--auto_resume"])  # the command, again
    assert code == 2 and err.strip().splitlines() == [
        f"error: --output_dir {out} holds a run {left}, {hint}" + (": it runs the final evaluation alone" if
                                                                    training_done else "")
        + "; or give another --output_dir for a new run (--overwrite_output_dir deletes this one)"], err
    if moment == "training":  # paths compare as paths: DIR/ resumes the run of DIR
        argv[argv.index("--model_name_or_path") + 1] += "/"
    trained = {"device": "cuda:0", "world_size": 2, "peak_memory_mb": 1234.5, "peak_memory_kind": "cuda_max_allocated",
               "peak_memory_reserved_mb": 2048.0, "summary": {"device": "cuda:0 x 2, precision fp32"}}
    if training_done:  # as if two GPU processes had trained it: the evaluation alone on CPU keeps their record
        first.update(trained, provenance={**first["provenance"], "processes": 2, "device_name": "a GPU"})
        (out / "results.json").write_text(json.dumps(first))
    next_second()  # as a requeued job starts (conftest.next_second)
    simcse.main(argv)
    got = assert_like_straight(out, straight)
    found = tracked(out)
    for tracker, metrics in straight[2].items():  # every tracker, every metric: the same (step, value) list
        assert found[tracker].keys() == metrics.keys(), tracker
        for metric, want in metrics.items():
            assert found[tracker][metric] == want, (tracker, metric)
    if training_done:
        assert {key: got[key] for key in trained} == trained and "2 process(es) on a GPU" in \
            (out / "best" / "README.md").read_text()
        assert got["evaluation_alone"]["device"] == "cpu" and got["evaluation_alone"]["world_size"] == 1
        alone = got["evaluation_alone"]
        assert alone["peak_memory_kind"] == "cpu_max_rss" and alone["peak_memory_mb"] > 0
    else:
        assert "evaluation_alone" not in got and got["device"] == "cpu"
    assert got["resumptions"] == [6 if training_done else first["steps"]]
    parts = got["provenance"]["parts"]
    assert len(parts) == 2 and parts[1]["after_step"] == got["resumptions"][0]
    assert not got["provenance"]["crosses_commits"]
    assert "STS test, Spearman" in (out / "best" / "README.md").read_text()


def test_keep_last_keeps_the_final_state_and_a_completed_run_is_never_rewritten(tiny_model, corpus, senteval_dir,
                                                                               tmp_path, capsys):
    """A completed run is rewritten by nothing; --auto_resume of the same command (a requeued job that had finished, a
    protocol's second pass) says it is complete and exits 0, --resume or another command's --auto_resume is one
    line, exit 2."""
    out = tmp_path / "run"
    argv = [str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--max_steps", 3, "--save_steps", 2,
                                       "--keep_last", "--no_test_eval")]
    simcse.main(argv)
    assert json.loads((out / "last" / "run.json").read_text())["step"] == 3  # the final state, not step 2's
    card = (out / "best" / "README.md").read_text()  # the run has ended: no "yet"
    assert "Not evaluated on the STS test tasks: the run was given --no_test_eval; `python eval_sts.py" in card, card
    before = digests(out)
    capsys.readouterr()
    code, err = cli_in_process(simcse, *argv, "--auto_resume")
    assert code == 0 and err == "" and capsys.readouterr().out.strip().splitlines() == [
        f"complete: results in {out / 'results.json'} (--auto_resume: nothing left to do)"]
    for extra in (["--resume"], ["--auto_resume", "--lr", "2e-3"], []):
        code, err = cli_in_process(simcse, *argv, *extra)
        assert code == 2 and "holds a completed run" in err and "nothing is rewritten" in err, err
        assert len(err.strip().splitlines()) == 1 and ("--lr is 0.002 here but 3e-05" in err) == ("--lr" in extra)
    assert digests(out) == before


class Killed(BaseException):
    """A SIGKILL, in-process: nothing of the run's own handling runs."""


def kill_at(monkeypatch, target, name, nth):
    real, calls = getattr(target, name), itertools.count()

    def wrapped(*args, **kwargs):
        if next(calls) == nth:
            raise Killed
        return real(*args, **kwargs)
    monkeypatch.setattr(target, name, wrapped)


def test_overwrite_output_dir_clears_the_old_run_before_the_new_one_trains(tiny_model, corpus, senteval_dir,
                                                                           tmp_path, monkeypatch):
    """The old run's last/, results.json and best/ go before the new run trains: a SIGKILL of the new run leaves
    nothing of the old one to be read as the new one's, and --auto_resume then starts the new run again. A user's
    own file in the folder stays."""
    out = tmp_path / "run"
    argv = [str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--no_test_eval")]
    simcse.main(argv + ["--keep_last"])
    (out / "notes.txt").write_text("mine")
    with monkeypatch.context() as patch:
        kill_at(patch, simcse, "info_nce", 1)  # killed in step 2, before any save of the new run
        with pytest.raises(Killed):
            simcse.main(argv + ["--seed", "7", "--overwrite_output_dir"])
    assert sorted(p.name for p in out.iterdir()) == [".lock", "notes.txt", "started.json"]
    assert json.loads((out / "started.json").read_text())["args"]["seed"] == 7
    simcse.main(argv + ["--seed", "7", "--auto_resume"])
    results = json.loads((out / "results.json").read_text())
    assert results["args"]["seed"] == 7 and results["resumptions"] == [] and results["steps"] == 4
    assert (out / "notes.txt").read_text() == "mine"


def test_the_best_model_is_copied_into_buffers_allocated_once(tiny_model, corpus, senteval_dir, tmp_path,
                                                             monkeypatch):
    """Each improvement copies into the first copy's buffers (one copy of the weights at any moment, not two), and
    the copy does not alias the training model."""
    from transformers import AutoModel, AutoTokenizer
    backbone, tokenizer = AutoModel.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model)
    head = common.MLPHead(backbone.config)
    kept = checkpoint.BestCopy(backbone, head, tokenizer, "cls")
    pointers = [t.data_ptr() for t in [*kept.state.values(), *kept.head.state_dict().values()]]
    with torch.no_grad():
        for p in [*backbone.parameters(), *head.parameters()]:
            p.add_(1.0)
    kept.update(backbone, head)
    assert [t.data_ptr() for t in [*kept.state.values(), *kept.head.state_dict().values()]] == pointers
    assert all(torch.equal(kept.state[k], v) for k, v in backbone.state_dict().items())
    assert torch.equal(kept.head[0].weight, head[0].weight)
    with torch.no_grad():
        backbone.embeddings.word_embeddings.weight.add_(1.0)
    assert not torch.equal(kept.state["embeddings.word_embeddings.weight"], backbone.embeddings.word_embeddings.weight)
    # a run whose every gate improves builds one BestCopy and copies into it at each later gate
    scores, built, updates = itertools.count(), [], []
    real_init, real_update = checkpoint.BestCopy.__init__, checkpoint.BestCopy.update
    monkeypatch.setattr(run_module, "dev_measures",
                        lambda *a: {"stsb_dev": float(next(scores)), "align": 0.0, "uniform": 0.0})
    monkeypatch.setattr(checkpoint.BestCopy, "__init__", lambda self, *a: built.append(1) or real_init(self, *a))
    monkeypatch.setattr(checkpoint.BestCopy, "update", lambda self, *a: updates.append(1) or real_update(self, *a))
    simcse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "run", "--no_test_eval")])
    assert len(built) == 1 and len(updates) == 1 + 2  # the constructor's own copy, then the gates at steps 2 and 4


def test_a_resumed_run_that_finds_no_new_best_writes_its_test_scores_into_the_card(tiny_model, corpus, senteval_dir,
                                                                                    tmp_path, monkeypatch):
    out = tmp_path / "run"
    argv = argv_of(tiny_model, corpus, senteval_dir, out)
    scores = iter([10.0, 20.0, 0.0, 0.0])  # the gates at 0 and 2; after the resume 4 and 6 are worse
    monkeypatch.setattr(run_module, "dev_measures",
                        lambda *a: {"stsb_dev": next(scores), "align": 0.0, "uniform": 0.0})
    with monkeypatch.context() as patch:
        signal_at(patch, simcse, "info_nce", 2)
        with pytest.raises(SystemExit):
            simcse.main(argv)
    card = (out / "best" / "README.md").read_text()
    assert "Not evaluated on the STS test tasks yet" in card and "at step 2" in card
    simcse.main(argv)
    results = json.loads((out / "results.json").read_text())
    assert results["best_step"] == 2 and results["resumptions"] == [3]
    card = (out / "best" / "README.md").read_text()
    assert "STS test, Spearman" in card and f"{results['test']['avg']:.2f}" in card and "at step 2" in card


def test_a_kill_between_the_renames_of_best_loses_no_best(tiny_model, corpus, senteval_dir, tmp_path, monkeypatch):
    """Killed between the two renames of best/'s swap (best/ moved to best.old/, the new one not in place yet), the run
    resumes from the previous save; it finds no better model, so its final evaluation needs the best/ of that save:
    best.old/ is put back."""
    out = tmp_path / "run"
    argv = argv_of(tiny_model, corpus, senteval_dir, out, "--save_minutes", 0, "--no_test_eval")
    scores = iter([10.0, 20.0, 0.0, 0.0, 0.0])  # gates 0 and 2; resumed after step 0, gates 2, 4, 6 are worse
    monkeypatch.setattr(run_module, "dev_measures", lambda *a: {"stsb_dev": next(scores), "align": 0.0, "uniform": 0.0})
    with monkeypatch.context() as patch:
        real_rename, renames = type(out).rename, itertools.count()

        def killed_between_renames(self, target):
            if self.name == "best.tmp" and next(renames) == 1:  # the write of step 2's best
                raise Killed
            return real_rename(self, target)
        patch.setattr(type(out), "rename", killed_between_renames)
        with pytest.raises(Killed):
            simcse.main(argv)
    assert not (out / "best").exists() and (out / "best.old").is_dir() and (out / "best.tmp").is_dir()
    simcse.main(argv)
    results = json.loads((out / "results.json").read_text())
    assert results["resumptions"] == [0] and results["best_step"] == 0 and "align_uniform" in results
    assert (out / "best" / "config.json").is_file() and not (out / "best.old").exists()


def test_an_out_of_memory_stop_keeps_the_best_found_since_the_last_write(tiny_model, corpus, senteval_dir, tmp_path,
                                                                         monkeypatch):
    """The device runs out of memory in step 3 (injected on CPU); the best model, found at step 2 and only in its device
    copy (no save yet: --save_minutes 10), is written to best/ once the training state is freed, results.json records
    the stop; the one line names --auto_resume with --gradient_checkpointing first, and that command starts the run
    again (no last/ yet), to its end."""
    out = tmp_path / "run"
    argv = argv_of(tiny_model, corpus, senteval_dir, out, "--no_test_eval")
    scores = iter([10.0, 20.0])
    with monkeypatch.context() as patch:
        patch.setattr(run_module, "dev_measures", lambda *a: {"stsb_dev": next(scores), "align": 0.0, "uniform": 0.0})
        real, calls = simcse.info_nce, itertools.count()

        def out_of_memory(*args, **kwargs):
            if next(calls) == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total "
                                             "capacity of 23.65 GiB of which 11.06 MiB is free.\nmore lines")
            return real(*args, **kwargs)
        patch.setattr(simcse, "info_nce", out_of_memory)
        code, err = cli_in_process(simcse, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(
        "error: the GPU ran out of memory in step 3 (CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has "), err
    assert "best/ holds step 2's model" in err and err.index("--micro_batch_size") > err.index(
        "run the same command with --auto_resume --gradient_checkpointing"), err
    results = json.loads((out / "results.json").read_text())
    assert results["stop"]["by"] == "out of memory" and results["stop"]["step"] == 3, results["stop"]
    assert results["interrupted_during"] == "training" and results["steps"] == 2 and results["best_step"] == 2
    assert "at step 2" in (out / "best" / "README.md").read_text() and not (out / lock.NAME).exists()
    assert outdir.state(out)[0] == "started"  # no last/ yet: --auto_resume starts it again
    argv.remove("--no_test_eval")  # the test scores come first now, then the final evaluation runs out of memory
    with monkeypatch.context() as patch:
        patch.setattr(eval_sts, "align_uniform", lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA")))
        code, err = cli_in_process(simcse, *argv, "--gradient_checkpointing")
    assert code == 2 and err.strip() == "error: the GPU ran out of memory in the final evaluation (CUDA): best/ and " \
        "results.json hold the training; to finish it, run the same command with --auto_resume (or --resume): it " \
        "runs the final evaluation alone, without the training's memory", err
    assert outdir.state(out)[0] == "evaluating" and "test" in json.loads((out / "results.json").read_text())
    simcse.main(argv + ["--gradient_checkpointing"])
    results = json.loads((out / "results.json").read_text())
    assert results["interrupted"] is False and "stop" not in results and results["steps"] == 6
    assert results["resumptions"] == [6] and "align_uniform" in results


def test_an_out_of_memory_stop_in_a_dev_gate_names_the_step_it_came_after(tiny_model, corpus, senteval_dir, tmp_path,
                                                                         monkeypatch):
    out = tmp_path / "run"
    calls = itertools.count()
    real = run_module.dev_measures
    monkeypatch.setattr(run_module, "dev_measures", lambda *a: real(*a) if next(calls) < 2 else (
        _ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory")))  # the gate after step 4
    code, err = cli_in_process(simcse, *argv_of(tiny_model, corpus, senteval_dir, out, "--no_test_eval"))
    assert code == 2 and err.startswith("error: the GPU ran out of memory after step 4 (CUDA out of memory): "), err
    results = json.loads((out / "results.json").read_text())
    assert results["stop"]["step"] == 4 and results["steps"] == 4


def nan_from(monkeypatch, call):
    real, calls = simcse.info_nce, itertools.count()
    monkeypatch.setattr(simcse, "info_nce", lambda *a, **k: real(*a, **k) * (
        float("nan") if next(calls) >= call else 1.0))


def test_a_run_that_diverges_keeps_its_best_and_its_record(tiny_model, corpus, senteval_dir, tmp_path, monkeypatch):
    """The loss becomes NaN at step 3 (read at the gate of step 4): one line, exit 2, best/ written from its copy,
    results.json with the stop, its reason and the record up to it; --auto_resume does not run into it again."""
    out = tmp_path / "run"
    argv = argv_of(tiny_model, corpus, senteval_dir, out)
    nan_from(monkeypatch, 2)
    code, err = cli_in_process(simcse, *argv)
    assert code == 2 and err.strip().splitlines() == ["error: the loss became nan at step 3: the run diverged (a "
                                                      "lower --lr may help)"]
    results = json.loads((out / "results.json").read_text())
    assert results["interrupted"] is True and results["stop"]["by"] == "divergence" and results["stop"]["step"] == 3
    assert "the loss became nan" in results["stop"]["reason"] and results["steps"] == 2
    assert [row["step"] for row in results["trajectory"]] == [0, 2]
    assert (out / "best" / "config.json").is_file() and results["best_step"] in (0, 2)
    assert "Not evaluated on the STS test tasks: the run stopped itself at step 3 (divergence)" in \
        (out / "best" / "README.md").read_text() and not (out / lock.NAME).exists()
    code, err = cli_in_process(simcse, *argv)
    assert code == 2 and "stopped itself (the loss became nan at step 3" in err and len(err.splitlines()) == 1


def test_a_resumed_run_that_diverges_before_a_new_best_records_its_own_eval_pooler(tiny_model, corpus, senteval_dir,
                                                                                     tmp_path, monkeypatch):
    """The evaluation pooler is the run's, not a default: resumed after step 3, the run diverges at step 4, before
    any new best."""
    out = tmp_path / "run"
    argv = argv_of(tiny_model, corpus, senteval_dir, out, "--pooler", "avg", "--no_test_eval")
    with monkeypatch.context() as patch:
        signal_at(patch, simcse, "info_nce", 2)
        with pytest.raises(SystemExit):
            simcse.main(argv)
    nan_from(monkeypatch, 0)
    code, err = cli_in_process(simcse, *argv)
    results = json.loads((out / "results.json").read_text())
    assert code == 2 and results["stop"]["by"] == "divergence" and results["resumptions"] == [3], err
    assert results["eval_pooler"] == "avg" and results["best_step"] in (0, 2)


@contextlib.contextmanager
def tmpfs(path, size: str, read_only: bool = False):
    """A small file system of its own at `path` (a full disk as a user meets one); needs root, as CI runs."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    path.mkdir()
    options = f"size={size}" + (",ro" if read_only else "")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("mount is not permitted on this machine")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(folder):
    """Write a file until the disk is full."""
    with open(folder / "filler", "wb") as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()


def test_read_only_full_and_small_disks_are_one_line_before_any_work(tiny_model, corpus, senteval_dir, tmp_path):
    import eval_transfer
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        code, err = cli_in_process(simcse, *smoke_args(tiny_model, corpus, senteval_dir, ro / "run"))
        assert code == 2 and err.strip() == f"error: --output_dir {ro / 'run'}: {ro} is on a read-only file system; " \
                                            "give a folder you can write"
        for evaluator in (eval_sts, eval_transfer):  # --json too, before any evaluation
            code, err = cli_in_process(evaluator, "--model_name_or_path", tiny_model, "--senteval_dir",
                                       senteval_dir, "--json", ro / "scores.json")
            assert code == 2 and "read-only file system" in err and len(err.splitlines()) == 1, err
        import analyze
        code, err = cli_in_process(analyze, "spectrum", "--model_name_or_path", tiny_model, "--out", ro / "figures")
        assert code == 2 and err.strip() == f"error: --out {ro / 'figures'}: {ro} is on a read-only file system; " \
                                            "give a folder you can write", err
    with tmpfs(tmp_path / "full", "2m") as full:
        fill(full)
        code, err = cli_in_process(simcse, *smoke_args(tiny_model, corpus, senteval_dir, full / "run"))
        assert code == 2 and f"the disk of {full} is full" in err and len(err.splitlines()) == 1, err
        assert not (full / "run").exists()
    big = write_tiny_model(tmp_path / "wide", hidden=256)  # 4.5 MB of weights: its saves need about 30 MB
    with tmpfs(tmp_path / "small", "16m") as small:
        code, err = cli_in_process(simcse, *smoke_args(big, corpus, senteval_dir, small / "run"))
        assert code == 2 and "MiB free, but this run's saves need up to" in err and len(err.splitlines()) == 1, err
        assert list((small / "run").iterdir()) == []  # nothing trained, nothing written, no .lock left


def test_a_disk_that_fills_during_the_run_keeps_the_last_complete_saves(straight, tiny_model, corpus, senteval_dir,
                                                                       tmp_path, monkeypatch):
    """Another process fills the disk during step 3; the saves at step 4 fail: one line, exit 2, last/ and best/ as
    the last complete save left them (no half-written folder). Space freed, the same command resumes from there to
    the uninterrupted run's result."""
    with tmpfs(tmp_path / "disk", "8m") as disk:
        out = disk / "run"
        argv = argv_of(tiny_model, corpus, senteval_dir, out, "--save_steps", 2)
        with monkeypatch.context() as patch:
            real, calls = simcse.info_nce, itertools.count()
            patch.setattr(simcse, "info_nce", lambda *a, **k: (next(calls) == 2 and fill(disk)) or real(*a, **k))
            code, err = cli_in_process(simcse, *argv)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "failed (No space left on device)" in err and ("as it was" in err or "last complete save" in err), err
        assert not any((out / name).exists() for name in ("last.tmp", "best.tmp", "last.old", "best.old"))
        assert json.loads((out / "last" / "run.json").read_text())["step"] == 2
        for name in ("state.pt", "rng_rank0.pt"):  # whole: every file there and readable
            resume.load(out / "last" / name)
        eval_sts.load_encode(str(out / "best"), "cls_before_pooler", torch.device("cpu"))
        (disk / "filler").unlink()
        simcse.main(argv)
        results = json.loads((out / "results.json").read_text())
        assert results["train_loss"] == straight[0]["train_loss"] and results["resumptions"] == [2]
        assert results["best_step"] == straight[0]["best_step"] and results["test"] == straight[0]["test"]


def test_a_sigterm_to_the_process_group_with_workers_stops_at_a_step_and_saves(tiny_model, corpus, senteval_dir,
                                                                              tmp_path):
    """SLURM, `docker stop` and `kill -- -PGID` signal every process of the group: the data-loader workers ignore it,
    the main process stops at a step boundary, saves last/ and exits 143, without a traceback."""
    out = tmp_path / "run"
    args = smoke_args(tiny_model, corpus, senteval_dir, out, "--max_steps", 100_000, "--eval_steps", 5,
                      "--num_workers", 2)
    proc = subprocess.Popen([sys.executable, str(ROOT / "simcse.py"), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"))
    for line in proc.stdout:
        if line.startswith("step 5/"):
            break
    os.killpg(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "Traceback" not in stderr, stderr
    assert (out / "last" / "run.json").is_file() and json.loads((out / "results.json").read_text())["interrupted"]


HOLDER = """
import fcntl, json, os, socket, sys, time
f = open(sys.argv[1], "a+")
fcntl.flock(f, fcntl.LOCK_EX)
f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": "now"}))
f.flush()
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_process_on_a_folder_is_refused_and_a_dead_ones_lock_is_not(tiny_model, corpus, senteval_dir,
                                                                             tmp_path):
    """The same --auto_resume command started twice: the second is one line naming the process that holds the folder,
    before any work, and changes nothing; once that process is dead (SIGKILL: its lock file stays), the command
    runs."""
    out = tmp_path / "run"
    out.mkdir()
    argv = argv_of(tiny_model, corpus, senteval_dir, out, "--no_test_eval")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out / lock.NAME)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        before = digests(out)
        code, err = cli_in_process(simcse, *argv)
        assert code == 2 and err.strip() == f"error: --output_dir {out} is in use by process {holder.pid} on " \
                                            f"{os.uname().nodename}, started now: one run writes a folder at a time; " \
                                            "wait for it to end, or give another --output_dir", err
        assert digests(out) == before
    finally:
        holder.kill()
        holder.wait()
    assert (out / lock.NAME).exists()  # a stale lock file
    code, err = cli_in_process(simcse, *argv)
    assert code == 0, err
    assert not (out / lock.NAME).exists()  # released at the end


def test_eval_transfer_data_is_checked_before_training(tiny_model, corpus, senteval_dir, tmp_path):
    out = tmp_path / "run"
    code, err = cli_in_process(simcse, *smoke_args(tiny_model, corpus, senteval_dir, out, "--eval_transfer"))
    assert code == 2 and "MR" in err and "no such file" in err.lower() and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_paths_compare_as_paths(tiny_model):
    assert resume.same_value("model_name_or_path", f"{tiny_model}/", str(tiny_model))
    assert resume.same_value("train_file", "./data/x.txt", "data/x.txt")
    assert not resume.same_value("model_name_or_path", "bert-base-uncased", "roberta-base")
    assert not resume.same_value("lr", 1e-3, 2e-3) and resume.same_value("lr", 1e-3, 1e-3)


def test_the_model_card_is_ready_to_upload_as_it_is(tiny_model, corpus, senteval_dir, tmp_path, capsys):
    """A run from a local backbone given by its absolute path: the card names no local path (the command's paths
    shortened to their names, the base model by its folder's name), --hub_model_id is in its usage snippets,
    --base_model and --license fill the Hub's metadata a local folder does not have, and huggingface_hub parses
    it; each STS task is labelled with its own protocol."""
    from huggingface_hub import ModelCard
    from plumbing import provenance
    import types
    args = types.SimpleNamespace(model_name_or_path="bert-base-uncased", base_model=None)
    assert provenance.base_model(args) == "`bert-base-uncased` (Hugging Face Hub)"
    out = tmp_path / "run"
    simcse.main([str(a) for a in smoke_args(tiny_model.resolve(), corpus.resolve(), senteval_dir.resolve(), out,
                                            "--max_steps", 2, "--no_align_uniform", "--hub_model_id", "me/simcse-tiny",
                                            "--base_model", "google-bert/bert-base-uncased", "--license",
                                            "apache-2.0")])
    assert f"to share it: hf upload me/simcse-tiny {out / 'best'} ." in capsys.readouterr().out
    card = (out / "best" / "README.md").read_text()
    for local in (str(tiny_model.resolve().parent), str(corpus.resolve().parent), str(tmp_path)):
        assert local not in card, local
    assert 'SentenceTransformer("me/simcse-tiny")' in card and "--model_name_or_path me/simcse-tiny" in card
    data = ModelCard(card).data
    assert data.base_model == "google-bert/bert-base-uncased" and data.license == "apache-2.0"
    names = {r.dataset_name: r.metric_name for r in data.eval_results}
    assert "SentEval 'all'" in names["STS12"] and "the test split's pairs" in names["STSBenchmark"]


def test_provenance_of_parts_that_ran_under_other_commits():
    from plumbing import provenance
    first = {"git": {"commit": "a" * 40, "uncommitted_changes": False}, "started": "t0"}
    second = {"git": {"commit": "b" * 40, "uncommitted_changes": True}, "started": "t1", "versions": {}}
    merged = provenance.resumed(first, second, 7)
    assert merged["started"] == "t0" and merged["crosses_commits"] is True
    assert [p["after_step"] for p in merged["parts"]] == [None, 7]
    assert provenance.commit_text(merged) == "aaaaaaaaaaaa, then bbbbbbbbbbbb (uncommitted changes)"
    again = provenance.resumed(merged, {**second, "started": "t2"}, 9)
    assert len(again["parts"]) == 3 and again["started"] == "t0"
    assert not provenance.resumed(first, {**first, "started": "t1"}, 3)["crosses_commits"]


KILLER = '''
import itertools, os, signal, sys
sys.path[:0] = [{root!r}]
import common, eval_sts, plumbing, simcse
from plumbing import checkpoint, files, resume, run
kill_at, argv, events = int(sys.argv[1]), sys.argv[2:], itertools.count()
def at_event(module, name):  # a SIGKILL (no handler runs) at the kill_at-th event of this process
    real = getattr(module, name)
    def wrapped(*args, **kwargs):
        if next(events) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    setattr(module, name, wrapped)
for module, name in ((simcse, "info_nce"), (run, "dev_measures"), (checkpoint, "save"), (resume, "save"),
                     (files, "swap_in"), (files, "write_text"), (eval_sts, "evaluate"), (eval_sts, "align_uniform")):
    at_event(module, name)
plumbing.cli(lambda: simcse.main(argv))
'''


def test_sigkills_at_random_moments_then_auto_resume_end_as_the_straight_run(straight, tiny_model, corpus,
                                                                             senteval_dir, tmp_path):
    """SIGKILL (no handler runs: an out-of-memory kill, a lost node) at seeded random moments of the run (a step, a
    dev gate, a write of best/, last/ or results.json, between a save's two renames, the final evaluation), each time
    followed by the same --auto_resume command: the run ends as the uninterrupted one."""
    import random
    driver = tmp_path / "killer.py"
    driver.write_text(KILLER.format(root=str(ROOT)))
    out = tmp_path / "run"
    argv = argv_of(tiny_model, corpus, senteval_dir, out, "--save_minutes", 0)  # last/ at every gate
    rng, kills = random.Random(52), []
    for attempt in range(6):
        kill_at = rng.randrange(40) if attempt < 3 else -1  # three kills (each a new interpreter), then to the end
        proc = subprocess.run([sys.executable, str(driver), str(kill_at), *argv], capture_output=True, text=True,
                              cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=300)
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
        kills.append(kill_at)
    assert proc.returncode == 0 and len(kills) >= 2, (kills, proc.stderr[-2000:])
    assert_like_straight(out, straight)


def test_a_run_writes_nothing_outside_its_folder(tiny_model, corpus, senteval_dir, tmp_path):
    """A best/ that is a symbolic link to another folder (a user's published model, say) is refused in one line
    before any work, for a new run, --overwrite_output_dir and --auto_resume alike: the other folder and its README.md
    stay as they were (the run's card would have been written through the link). A link inside best/ too. The
    output folder itself may be a link, to a scratch disk."""
    elsewhere = tmp_path / "published"
    elsewhere.mkdir()
    (elsewhere / "README.md").write_text("my model")
    out = tmp_path / "run"
    out.mkdir()
    (out / "best").symlink_to(elsewhere)
    argv = [str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--no_test_eval")]
    for extra in ([], ["--overwrite_output_dir"], ["--auto_resume"]):
        code, err = cli_in_process(simcse, *argv, *extra)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"best is a symbolic link to {elsewhere}, outside the run's folder" in err, err
    assert (elsewhere / "README.md").read_text() == "my model" and sorted(p.name for p in elsewhere.iterdir()) == \
        ["README.md"]
    (out / "best").unlink()
    (out / "best").mkdir()
    (out / "best" / "README.md").symlink_to(elsewhere / "README.md")
    code, err = cli_in_process(simcse, *argv, "--overwrite_output_dir")
    assert code == 2 and "best/README.md is a symbolic link" in err.replace("best" + "/", "best/"), err
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (tmp_path / "linked").symlink_to(scratch)
    simcse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "linked", "--no_test_eval",
                                            "--no_align_uniform")])
    assert (scratch / "results.json").is_file()


def test_overwrite_clears_mteb_and_a_record_that_contradicts_the_folder_is_one_line(tiny_model, corpus, senteval_dir,
                                                                                    tmp_path):
    """--overwrite_output_dir removes tools/mteb_eval.py's mteb/ with the rest of the old run. A results.json that
    says the run ran out of memory before its first save, beside a best/ whose card holds a finished run's test
    scores, or after saves of last/ that are gone, is one line naming the file: --auto_resume starts nothing over
    and best/ stays."""
    out = tmp_path / "run"
    argv = [str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--no_align_uniform")]
    simcse.main(argv)
    (out / "mteb").mkdir()
    (out / "mteb" / "STSBenchmark.json").write_text("{}")
    card = (out / "best" / "README.md").read_text()
    results = json.loads((out / "results.json").read_text())
    results.update(interrupted=True, interrupted_during="training", stop={"by": "out of memory", "step": 3})
    for saves in (0, 2):
        results["checkpoint_time_s"]["last_writes"] = saves
        (out / "results.json").write_text(json.dumps(results))
        code, err = cli_in_process(simcse, *argv, "--auto_resume")
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert ("holds a finished run's test scores" if saves == 0 else "records 2 save(s) of last/") in err, err
        assert "results.json" in err and (out / "best" / "README.md").read_text() == card
    simcse.main(argv + ["--overwrite_output_dir"])
    assert not (out / "mteb").exists()
