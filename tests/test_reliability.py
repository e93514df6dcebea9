"""Failure behaviour of every script: bad input is one line and exit 2 with nothing written; no silent overwrite;
atomic saves; Ctrl-C / SIGTERM keep what the run reached; the same seed gives the same losses."""
import hashlib
import importlib
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import common
import eval_sts
import plumbing
from plumbing import checkpoint, hub, run
from conftest import ROOT, cli_in_process, gates, run_script, smoke_args

SCRIPTS = ["simcse", "simcsepp", "sscl", "whitenedcse", "micse"]
METHOD_FLAGS = {"whitenedcse": ["--num_groups", "16"]}
SHARED_CASES = [
    (["--lr", "-1"], "--lr"), (["--lr", "nan"], "--lr"), (["--temp", "0"], "--temp"),
    (["--batch_size", "1"], "--batch_size"), (["--fraction", "0"], "--fraction"), (["--fraction", "2"], "--fraction"),
    (["--device", "cuda:3"], "--device"), (["--device", "nonsense"], "--device"),
    (["--max_seq_length", "0"], "--max_seq_length"), (["--eval_steps", "0"], "--eval_steps"),
    (["--max_grad_norm", "-1"], "--max_grad_norm"), (["--seed", "-1"], "--seed"), (["--epochs", "0"], "--epochs"),
    (["--warmup_steps", "-5"], "--warmup_steps"), (["--max_steps", "-1"], "--max_steps"),
    (["--num_workers", "-1"], "--num_workers"), (["--pooler", "max"], "--pooler"), (["--batch_size", "500"], "--batch_size"),
    (["--dropout", "1"], "--dropout"), (["--dropout", "-0.1"], "--dropout"),
]
METHOD_CASES = {
    "simcsepp": [(["--m", "0"], "--m"), (["--dcl_temp", "0"], "--dcl_temp"), (["--dcl_weight", "-1"], "--dcl_weight")],
    "sscl": [(["--neg_layers", "-1"], "--neg_layers"), (["--neg_layers", "5"], "--neg_layers"),
             (["--neg_layer_index", "5"], "--neg_layer_index")],
    "whitenedcse": [(["--num_pos", "1"], "--num_pos"), (["--num_groups", "5"], "--num_groups"),
                    (["--num_groups", "0"], "--num_groups")],
    "micse": [(["--momentum", "1.5"], "--momentum"), (["--queue_size", "-1"], "--queue_size"),
              (["--ami_samples", "1"], "--ami_samples"), (["--momentum_dropout", "1"], "--momentum_dropout"),
              (["--ami_lambda", "-1"], "--ami_lambda"), (["--ami_min_layer", "1", "--ami_max_layer", "2"], "--ami_min_layer")],
}
CASES = [(s, extra, needle) for s in SCRIPTS for extra, needle in SHARED_CASES + METHOD_CASES.get(s, [])]


def run_in_process(script, argv, capsys):
    """The script's CLI entry in this process (fast): exit status and the lines on stderr."""
    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as exit_info:
        plumbing.cli(lambda: module.main([str(a) for a in argv]))
        raise SystemExit(0)
    return exit_info.value.code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("script, extra, needle", CASES, ids=[f"{s}{' '.join(e)}" for s, e, _ in CASES])
def test_bad_argument_is_one_line_exit_2_nothing_written(script, extra, needle, tiny_model, corpus, senteval_dir,
                                                         tmp_path, capsys):
    out = tmp_path / "out"
    code, lines = run_in_process(script, smoke_args(tiny_model, corpus, senteval_dir, out)
                                 + METHOD_FLAGS.get(script, []) + extra, capsys)
    assert code == 2 and len(lines) == 1 and needle in lines[0], lines
    assert not out.exists()


def bad_files(tmp_path):
    (tmp_path / "latin1.txt").write_bytes(b"a fine line\ncaf\xe9 au lait\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "folder").mkdir()
    (tmp_path / "nli.csv").write_text("sent0,sent1,hard_neg\na,b,c\nd,e\n")
    return [("latin1.txt", [], "line 2 is not UTF-8"), ("empty.txt", [], "is empty"),
            ("missing.txt", [], "no such file"), ("folder", [], "it is a folder"),
            ("nli.csv", ["--supervised"], "line 3 has 2 column(s)")]


@pytest.mark.parametrize("case", range(5))
def test_bad_train_file_names_the_file_and_line(case, tiny_model, senteval_dir, tmp_path, capsys):
    name, extra, needle = bad_files(tmp_path)[case]
    out = tmp_path / "out"
    code, lines = run_in_process("simcse", smoke_args(tiny_model, tmp_path / name, senteval_dir, out) + extra, capsys)
    assert code == 2 and len(lines) == 1 and needle in lines[0] and name in lines[0], lines
    assert not out.exists()


def test_output_dir_that_is_a_file_is_refused_and_kept(tiny_model, corpus, senteval_dir, tmp_path, capsys):
    target = tmp_path / "notes.txt"
    target.write_text("my notes")
    code, lines = run_in_process("simcse", smoke_args(tiny_model, corpus, senteval_dir, target), capsys)
    assert code == 2 and len(lines) == 1 and "--output_dir" in lines[0] and "is a file" in lines[0]
    assert target.read_text() == "my notes"


def test_the_real_cli_prints_one_line_without_traceback(tiny_model, corpus, senteval_dir, tmp_path):
    proc = run_script("micse.py", *smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "o"), "--lr", "-1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: --lr -1.0 is out of range: a positive number"]
    assert not (tmp_path / "o").exists()


def digests(folder):
    return {p.relative_to(folder): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def test_second_run_into_the_same_folder_is_refused_and_leaves_files_identical(tiny_model, corpus, senteval_dir,
                                                                              tmp_path, capsys):
    out = tmp_path / "run"
    args = smoke_args(tiny_model, corpus, senteval_dir, out) + ["--no_test_eval"]
    assert run_in_process("simcse", args, capsys)[0] == 0
    before = digests(out)
    assert any(str(p).startswith("best") for p in before) and "results.json" in map(str, before)
    code, lines = run_in_process("simcse", args + ["--seed", "7"], capsys)
    assert code == 2 and len(lines) == 1 and "--overwrite_output_dir" in lines[0], lines
    assert digests(out) == before
    assert run_in_process("simcse", args + ["--seed", "7", "--overwrite_output_dir"], capsys)[0] == 0
    assert json.loads((out / "results.json").read_text())["args"]["seed"] == 7


def test_a_resume_refused_after_it_took_the_folder_leaves_no_lock(tiny_model, corpus, senteval_dir, tmp_path, capsys):
    """A refusal that comes once the run holds its folder (here: the training data grew, so the run whose final
    evaluation is left would train more steps) says why in one line and gives the folder back: no .lock stays."""
    data, out = tmp_path / "corpus.txt", tmp_path / "run"
    data.write_text(corpus.read_text())
    args = ["--model_name_or_path", tiny_model, "--train_file", data, "--senteval_dir", senteval_dir, "--epochs", 1,
            "--batch_size", 100, "--eval_steps", 2, "--output_dir", out, "--device", "cpu", "--no_test_eval"]
    assert run_in_process("simcse", args, capsys)[0] == 0
    results = json.loads((out / "results.json").read_text())
    results.update(interrupted=True, interrupted_during="final evaluation")  # as a kill in it leaves the record
    (out / "results.json").write_text(json.dumps(results))
    data.write_text(corpus.read_text() * 2)
    code, lines = run_in_process("simcse", args + ["--auto_resume"], capsys)
    assert code == 2 and len(lines) == 1 and "trained 2 steps, this command plans 4" in lines[0], lines
    assert not (out / ".lock").exists()


def test_a_failing_save_leaves_the_previous_best_intact(tiny_model, tmp_path, monkeypatch):
    from transformers import AutoModel, AutoTokenizer
    tokenizer, backbone = AutoTokenizer.from_pretrained(tiny_model), AutoModel.from_pretrained(tiny_model)
    head = common.MLPHead(backbone.config)
    checkpoint.save(tmp_path, backbone, head, tokenizer, "cls_before_pooler")
    saved = digests(tmp_path / "best")
    with torch.no_grad():
        backbone.embeddings.word_embeddings.weight.add_(1.0)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing")
    monkeypatch.setattr(type(tokenizer), "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, backbone, head, tokenizer, "cls_before_pooler")
    assert digests(tmp_path / "best") == saved
    AutoModel.from_pretrained(tmp_path / "best")  # still loadable
    monkeypatch.undo()
    checkpoint.save(tmp_path, backbone, head, tokenizer, "cls_before_pooler")  # the next save cleans up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"] and digests(tmp_path / "best") != saved


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_stops_at_a_step_boundary_and_keeps_what_the_run_reached(signum, code, tiny_model, corpus,
                                                                        senteval_dir, tmp_path, monkeypatch):
    """SIGTERM (a cluster's stop) to the real CLI's process once training is under way; Ctrl-C's SIGINT to this
    process from within step 6, main() run as plumbing.cli runs it (SIGINT to one process of torchrun's two:
    test_distributed.py)."""
    out = tmp_path / "run"
    args = smoke_args(tiny_model, corpus, senteval_dir, out)
    steps = args[args.index("--max_steps") + 1] = 100_000 if signum == signal.SIGTERM else 50  # not reached
    if signum == signal.SIGINT:
        import simcse
        record = run.Run.record
        monkeypatch.setattr(run.Run, "record", lambda self, *a, **k: (
            self.current_step == 6 and os.kill(os.getpid(), signum)) or record(self, *a, **k))
        returncode, stderr = cli_in_process(simcse, *args, "--eval_steps", "5")
    else:
        proc = subprocess.Popen([sys.executable, str(ROOT / "simcse.py"), *map(str, args), "--eval_steps", "5"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
        for line in proc.stdout:  # wait until training is under way and one checkpoint exists
            if line.startswith("step 5/"):
                break
        proc.send_signal(signum)
        stderr = proc.communicate(timeout=120)[1]
        returncode = proc.returncode
    assert returncode == code, stderr
    assert "Traceback" not in stderr
    results = json.loads((out / "results.json").read_text())
    assert results["interrupted"] is True and results["interrupted_during"] == "training" and "test" not in results
    assert 5 <= results["steps"] < steps and len(results["train_loss"]) == results["steps"]
    assert [s for s, _ in gates(results)][:2] == [0, 5]
    assert results["best_step"] in [s for s, _ in gates(results)]
    from transformers import AutoModel
    AutoModel.from_pretrained(out / "best")


def test_a_run_finishing_its_record_absorbs_sigterms_and_a_second_sigint_stops_it_at_once(capsys):
    """While a run finishes its record (best/, results.json, the trackers), each SIGTERM lets it finish (torchrun
    sends one to every process when another exits: tests/test_distributed.py), and so does a first Ctrl-C; the stop
    stays the first signal's. The user's second Ctrl-C stops it at once. Fails where a SIGTERM after the training's
    own signal raises KeyboardInterrupt (the handler Python's default by then: exit 130, the record unfinished), or
    where the absorbed SIGTERMs leave a second SIGINT absorbed too."""
    import time
    from plumbing import distributed

    def send(signum, absorbed=True):
        try:
            os.kill(os.getpid(), signum)
            time.sleep(0.01)  # the handler runs here
        except KeyboardInterrupt:
            if absorbed:  # a failure, not pytest's own stop
                pytest.fail(f"{signal.Signals(signum).name} stopped the finish at once")
            raise
    for first in (signal.SIGTERM, None):  # a stop in training, or none before the finish
        stop = distributed.StopSignal()
        if first:
            send(first)
        stop.phase = "writing results.json"
        for signum in [signal.SIGTERM, signal.SIGTERM] if first else [signal.SIGINT, signal.SIGTERM]:
            send(signum)
        with pytest.raises(KeyboardInterrupt):
            send(signal.SIGINT, absorbed=False)
        assert stop.signum == (signal.SIGTERM if first else signal.SIGINT)
        with pytest.raises(SystemExit) as stopped:
            stop.exit_if_stopped()
        assert stopped.value.code == (143 if first else 130)
    assert capsys.readouterr().out.splitlines() == [
        "signal SIGTERM: stopping at the end of this step", *["signal SIGTERM while writing results.json: finishing "
                                                              "that first"] * 2,
        "signal SIGINT while writing results.json: finishing that first",
        "signal SIGTERM while writing results.json: finishing that first"]


def test_same_seed_same_losses_other_seed_other_losses(tiny_model, corpus, senteval_dir, tmp_path, capsys):
    def losses(seed, name):  # in-process: a run must not depend on what ran before it in the same process either
        args = smoke_args(tiny_model, corpus, senteval_dir, tmp_path / name)
        args[args.index("--max_steps") + 1] = 20
        args[args.index("--eval_steps") + 1] = 20
        code, lines = run_in_process("simcse", args + ["--seed", seed, "--no_test_eval"], capsys)
        assert code == 0, lines
        return json.loads((tmp_path / name / "results.json").read_text())["train_loss"]
    first, again, other = losses(1, "a"), losses(1, "b"), losses(2, "c")
    assert len(first) == 20 and first == again  # bit-identical floats
    assert first != other


def test_malformed_sentEval_file_is_found_before_training(tiny_model, corpus, senteval_dir, tmp_path, capsys):
    import shutil
    root = tmp_path / "se"
    shutil.copytree(senteval_dir, root)
    (root / "STS/STS16-en-test/STS.gs.headlines.txt").write_text("1.0\n2.5\nnot-a-score\n")
    out = tmp_path / "out"
    code, lines = run_in_process("whitenedcse", smoke_args(tiny_model, corpus, root, out) + ["--num_groups", "16"],
                                 capsys)
    assert code == 2 and len(lines) == 1 and "STS.gs.headlines.txt line 3" in lines[0], lines
    assert not out.exists()


def test_a_missing_local_model_folder_is_no_such_folder_not_a_hub_error(tiny_model, corpus, senteval_dir, tmp_path,
                                                                        capsys):
    import eval_sts
    out = tmp_path / "out"
    for missing in ["runs/simcse/best", str(tmp_path / "best")]:
        args = smoke_args(tiny_model, corpus, senteval_dir, out)
        args[args.index("--model_name_or_path") + 1] = missing
        code, lines = run_in_process("simcse", args, capsys)
        assert code == 2 and lines == [f"error: --model_name_or_path {missing}: no such folder"], lines
        with pytest.raises(SystemExit) as exit_info:
            plumbing.cli(lambda: eval_sts.main(["--model_name_or_path", missing, "--senteval_dir", str(senteval_dir)]))
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"error: --model_name_or_path {missing}: no such folder"]
    assert not out.exists()


def test_missing_local_data_is_no_such_file_or_folder_and_the_hub_error_names_a_folder(tiny_model, corpus,
                                                                                       senteval_dir, tmp_path,
                                                                                       capsys, monkeypatch):
    import eval_sts
    out = tmp_path / "out"
    (tmp_path / "empty").mkdir()
    with monkeypatch.context() as patch:  # found before the model is loaded (seconds; a corpus: minutes)
        patch.setattr(hub, "load_pretrained", lambda *a, **k: pytest.fail("the model loaded before the paths' check"))
        for flag, missing, why in [("--senteval_dir", str(tmp_path / "SentEval"), "no such folder"),
                                   ("--senteval_dir", str(tmp_path / "empty"), "no SentEval STS/ folder found there"),
                                   ("--train_file", str(tmp_path / "wiki.txt"), "no such file"),
                                   ("--model_name_or_path", str(tmp_path / "empty"), "is a folder but not a model")]:
            args = smoke_args(tiny_model, corpus, senteval_dir, out)
            args[args.index(flag) + 1] = missing
            code, lines = run_in_process("simcse", args, capsys)
            assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {flag} {missing}") and why in \
                lines[0], lines
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)
    with pytest.raises(plumbing.UsageError, match="pass a local folder with --senteval_dir"):
        eval_sts.resolve_senteval_dir(None)
    assert not out.exists()


def test_nli_triplets_given_to_an_unsupervised_run_are_refused(tiny_model, senteval_dir, tmp_path, capsys):
    nli = tmp_path / "nli.csv"
    nli.write_text("sent0,sent1,hard_neg\na man runs,a person runs,a dog sleeps\nthe sun,a star,the moon\n")
    out = tmp_path / "out"
    code, lines = run_in_process("sscl", smoke_args(tiny_model, nli, senteval_dir, out), capsys)
    assert code == 2 and len(lines) == 1 and "is NLI triplets" in lines[0] and "--supervised" in lines[0], lines
    assert not out.exists()


def test_checkpoint_files_get_the_users_umask(tiny_model, tmp_path):
    from transformers import AutoModel, AutoTokenizer
    tokenizer, backbone = AutoTokenizer.from_pretrained(tiny_model), AutoModel.from_pretrained(tiny_model)
    saved = os.umask(0o022)
    try:
        checkpoint.save(tmp_path, backbone, common.MLPHead(backbone.config), tokenizer, "cls")
    finally:
        os.umask(saved)
    best = tmp_path / "best"
    modes = {p.name: p.stat().st_mode & 0o777 for p in best.rglob("*")}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644 and modes["2_Dense"] == 0o755, modes


def test_an_undefined_dev_score_is_null_and_never_the_best_not_even_the_first(tiny_model, corpus, senteval_dir,
                                                                              tmp_path, monkeypatch, capsys):
    """A NaN Spearman (constant or NaN embeddings: a collapsed or diverged model) is null in results.json (valid JSON,
    no bare NaN), never wins a dev gate, not even the first (the loop's former `or run.best_step is None` kept step 0's
    NaN as the best), and each gate says why in one line. A run whose every gate is undefined keeps no best/, evaluates
    nothing and says so."""
    import simcse
    nan = float("nan")
    for name, scores, best in (("later", [nan, -5.0, nan], 2), ("never", [nan, nan, nan], None)):
        given = iter(scores)
        monkeypatch.setattr(eval_sts, "spearman", lambda pairs, embed: next(given))  # the gate's Spearman
        out = tmp_path / name
        simcse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--no_test_eval")])
        log = capsys.readouterr().out
        assert log.count("the STS-B dev score is undefined") == sum(s != s for s in scores), log
        results = json.loads((out / "results.json").read_text(),
                             parse_constant=lambda c: pytest.fail(f"results.json holds {c}"))
        assert gates(results) == [[0, None], [2, None if best is None else -5.0], [4, None]]
        assert results["best_step"] == best and results["interrupted"] is False
        assert results["best_dev_stsb"] == (None if best is None else -5.0)
        assert (out / "best" / "config.json").is_file() == ("align_uniform" in results) == (best is not None)
    assert "no best/: every dev gate's STS-B dev was undefined" in log


def test_a_run_that_diverges_at_step_1_records_its_next_dev_score_as_null(tiny_model, corpus, senteval_dir,
                                                                          tmp_path):
    """--lr 1e30: step 1 makes the weights overflow, so the dev gate after it encodes NaN embeddings. Their Spearman is
    scipy's NaN, recorded as null; the hand-written ranks gave each NaN a rank of its own and a made-up -12.9 that
    could have won the gate. best/ stays step 0's; the loss's NaN at step 2 then stops the run."""
    import simcse
    out = tmp_path / "diverged"
    code, err = cli_in_process(simcse, *smoke_args(tiny_model, corpus, senteval_dir, out, "--lr", "1e30",
                                                   "--eval_steps", 1, "--no_test_eval"))
    results = json.loads((out / "results.json").read_text())
    assert code == 2 and results["stop"]["by"] == "divergence" and results["stop"]["step"] == 2, err
    assert [step for step, score in gates(results) if score is None] == [1] and results["best_step"] == 0


def test_a_signal_during_the_final_evaluation_stops_it_and_is_recorded(tiny_model, corpus, senteval_dir, tmp_path,
                                                                       monkeypatch, capsys):
    """A SIGTERM after training (a cluster's time limit during the test evaluation) stops the evaluation at once,
    says so, keeps best/ and writes results.json with what was done, then exits 143."""
    import eval_sts
    import simcse
    evaluate = eval_sts.evaluate

    def evaluate_then_sigterm(encode, senteval_dir, tasks=None, mode="test", **kw):
        if mode == "test":
            os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(encode, senteval_dir, tasks, mode, **kw)

    monkeypatch.setattr(eval_sts, "evaluate", evaluate_then_sigterm)
    out = tmp_path / "late"
    with pytest.raises(SystemExit) as exit_info:
        simcse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out)])
    assert exit_info.value.code == 143
    assert "signal SIGTERM during the final evaluation: stopping it" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["interrupted"] is True and results["interrupted_during"] == "final evaluation"
    assert "test" not in results and results["steps"] == 4 and (out / "best" / "config.json").is_file()


# (the script or tool, its arguments but the flag, a flag as a user mistypes it, what the line suggests or None)
MISTYPED = [
    *[(script, [], ["--micro_batch", "8"], "--micro_batch_size") for script in SCRIPTS],
    ("simcse", [], ["--max_step", "5"], "--max_steps"), ("simcse", [], ["--gradient_checkpoint"],
                                                           "--gradient_checkpointing"),
    ("simcse", [], ["--max_step=5"], "--max_steps"), ("simcse", [], ["--batchsize", "8"], "--batch_size"),
    ("simcse", [], ["--nonsense_flag"], None), ("micse", [], ["--queue", "16"], "--queue_size"),
    ("simcse_augmentations", [], ["--posit", "crop"], "--positive"),
    ("simcsepp_noise_barlow", [], ["--barlow_lamb", "1"], "--barlow_lambda"),
    ("whitenedcse_whitening", [], ["--whitening_ep", "1"], "--whitening_eps"),
    ("eval_sts", ["MODEL"], ["--pool", "avg"], "--pooler"), ("eval_transfer", ["MODEL"], ["--task", "CR"], "--tasks"),
    ("analyze", ["spectrum"], ["--overwrit"], "--overwrite"), ("bench", [], ["--flag_cos"], "--flag_cost"),
    # the planner names its own flag before it hands the flags it does not know to the method's parser
    ("bench", ["--memory", "--recipes", "simcse"], ["--backbone", "bert-base"], "--backbones"),
    ("parity", [], ["--toler", "1"], "--tolerance"), ("report", ["commands"], ["--no_trans"], "--no_transfer"),
]


@pytest.mark.parametrize("script, before, flag, nearest", MISTYPED,
                         ids=[f"{s} {' '.join(f)}" for s, _, f, _ in MISTYPED])
def test_a_mistyped_or_abbreviated_flag_is_refused_naming_the_nearest(script, before, flag, nearest, tiny_model,
                                                                      corpus, senteval_dir, tmp_path, capsys):
    """#58: argparse took a flag's abbreviation silently (`--micro_batch 8` ran as --micro_batch_size): every script
    and tool takes flags spelled out, and an unknown flag is one line, exit 2, with the nearest flag if one is."""
    out = tmp_path / "out"
    argv = [str(tiny_model) if a == "MODEL" else a for a in before]
    if script in SCRIPTS or script in ("simcse_augmentations", "simcsepp_noise_barlow", "whitenedcse_whitening"):
        argv = smoke_args(tiny_model, corpus, senteval_dir, out) + METHOD_FLAGS.get(script, [])
    elif script in ("eval_sts", "eval_transfer"):
        argv = ["--model_name_or_path", *argv, "--senteval_dir", senteval_dir]
    code, lines = run_in_process(script, argv + flag, capsys)
    assert code == 2 and len(lines) == 1, lines
    assert f"unrecognized arguments: {' '.join(flag)}" in lines[0], lines
    assert lines[0].endswith(f"; did you mean {nearest}? (see --help)" if nearest else " (see --help)"), lines
    assert ("did you mean" in lines[0]) == bool(nearest), lines
    assert not out.exists()
