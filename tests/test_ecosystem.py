"""Where researchers already work (#59): W&B and MLflow tracking (offline, under a resume), MTEB on a checkpoint, a
Hub-ready model card read back by huggingface_hub's own parsers, --fit_memory's choice, and the trained model in use
in sentence-transformers and transformers."""
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import simcse
from conftest import (ROOT, SHARED, cli_in_process, needs_shared, next_second, smoke_args, tracked,
                      tracker_env)
from plumbing import provenance


@pytest.fixture(scope="module")
def finished_run(tiny_model, corpus, senteval_dir, tmp_path_factory):
    """A tiny SimCSE run with its final evaluation: its folder."""
    out = tmp_path_factory.mktemp("ecosystem") / "run"
    simcse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--no_align_uniform")])
    return out


def test_the_model_card_metadata_is_the_hubs_and_holds_the_test_scores(finished_run):
    """Expected: huggingface_hub's ModelCard parses best/README.md: library sentence-transformers, the pipeline tag,
    the tags, and a model-index whose results are each STS test task's Spearman as results.json has it; a local
    base model and a local --train_file are not named as Hub ids."""
    from huggingface_hub import ModelCard
    results = json.loads((finished_run / "results.json").read_text())
    card = ModelCard.load(finished_run / "best" / "README.md")
    assert card.data.library_name == "sentence-transformers" and card.data.pipeline_tag == "sentence-similarity"
    assert {"sentence-embeddings", "contrastive-learning", "simcse"} <= set(card.data.tags)
    assert card.data.base_model is None and card.data.datasets is None
    found = {r.dataset_name: (r.dataset_type, r.dataset_split, r.metric_type, r.metric_value)
             for r in card.data.eval_results}
    assert found == {task: (provenance.STS_DATASETS[task], "test", "spearman", score)
                     for task, score in results["test"].items() if task != "avg"}
    assert "## Scores" in card.text  # the prose stays


def test_a_hub_base_model_and_the_authors_data_are_named_with_the_license():
    from huggingface_hub import ModelCardData
    import yaml
    for method, fraction, dataset in (("simcse", 1.0, "princeton-nlp/datasets-for-simcse"),
                                      ("micse", 0.01, "sap-ai-research/datasets-for-micse")):
        args = types.SimpleNamespace(method=method, model_name_or_path="roberta-base", train_file=None,
                                     fraction=fraction)
        data = ModelCardData(**yaml.safe_load(provenance.hub_metadata(args, method, "Title: x", {}, False)))
        assert data.base_model == "roberta-base" and data.license == "mit" and data.datasets == [dataset]
        assert data.library_name == "transformers" and data.eval_results is None


def python_blocks(markdown: Path) -> list[str]:
    """The ```python blocks of a page, in order."""
    import re
    return re.findall(r"```python\n(.*?)```", markdown.read_text(), re.S)


def test_the_trained_model_in_use_as_docs_show_it(finished_run):
    """docs/using.md's two Python blocks, run as they stand on a tiny best/ (its path in place of runs/simcse/best):
    sentence-transformers' encode, similarity and semantic_search (what the released simcse package's encode /
    similarity / search do), then transformers with the recorded pooler, which gives sentence-transformers'
    embeddings. A renamed function, flag or file in the page fails it."""
    blocks = python_blocks(ROOT / "docs" / "using.md")[:2]
    assert all("runs/simcse/best" in block for block in blocks)
    best = str(finished_run / "best")
    page = {}
    exec(blocks[0].replace("runs/simcse/best", best), page)
    assert page["scores"].shape == (1, 3) and page["scores"][0, 0] == pytest.approx(1.0, abs=1e-5)
    assert len(page["hits"][0]) == 2 and page["hits"][0][0]["score"] >= page["hits"][0][1]["score"]
    by_sentence_transformers = page["embeddings"].numpy()
    exec(blocks[1].replace("runs/simcse/best", best), page)
    pooler = json.loads((finished_run / "best" / "eval_pooler.json").read_text())["pooler"]
    assert pooler == "cls_before_pooler"  # SimCSE unsupervised: [CLS] without the MLP head, as the block takes it
    np.testing.assert_allclose(page["embeddings"].numpy(), by_sentence_transformers, atol=1e-5)


def test_fit_memory_switches_on_the_first_exact_setting_that_fits_and_a_resume_keeps_it(
        tiny_model, corpus, senteval_dir, tmp_path, monkeypatch, capsys):
    """--fit_memory with a GPU's free memory given (the CPU has no figure): the estimate of this command (batch 64)
    exceeds it, recomputation alone does not fit, GradCache's parts of 32 do; the run says so in one line, trains
    with them, and records the choice; stopped and resumed where the GPU has room, with the flag or without it, it
    keeps parts of 32."""
    import test_resume
    import transformers
    from plumbing import memory
    argv = [str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "run", "--batch_size", 64,
                                       "--max_steps", 4, "--no_test_eval", "--no_align_uniform", "--fit_memory")]
    args = simcse.parse_args(argv)
    args.precision = "fp32"
    config = transformers.AutoConfig.from_pretrained(str(tiny_model))
    step = memory.estimate(args, config)["step"]
    capacity = int(0.6 * step)  # usable bytes: what the GPU's free memory leaves after the context and 10%
    free = memory.CONTEXT + int(capacity / (1 - memory.FRAGMENTATION)) + 1
    monkeypatch.setattr(memory, "device_free", lambda device: free)
    test_resume.run("simcse", argv, monkeypatch, stop_at=2)
    line = [l for l in capsys.readouterr().out.splitlines() if "--fit_memory" in l]
    assert len(line) == 1 and line[0].startswith("memory: --fit_memory switched on --micro_batch_size 32: the same "
                                                 "objective in about"), line
    monkeypatch.setattr(memory, "device_free", lambda device: 2 ** 40)  # room for anything now
    test_resume.run("simcse", [a for a in argv if a != "--fit_memory"] + ["--resume"], monkeypatch)  # flag or not
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["args"]["micro_batch_size"] == 32 and not results["args"]["gradient_checkpointing"]
    assert results["fit_memory"] == {"chose": "--micro_batch_size 32", "at": "the run's start"}
    assert results["resumptions"] == [2] and results["steps"] == 4
    assert "--micro_batch_size 32 (GradCache" in json.dumps(results["summary"])  # the run's summary says it


def test_fit_memory_fits_the_graph_a_gpu_runs_by_default(tiny_model, corpus, senteval_dir, tmp_path, monkeypatch):
    """On one GPU the CUDA graph is on by default; --fit_memory fits that run as it will run. Where the graph's run
    fits, nothing changes (the graph stays on); where only a memory flag fits, the flag is switched on and the graph
    off (it takes neither) in the one line and the record; where nothing fits, the run goes on as given. Fails where
    --fit_memory declines any run with the graph on (it then runs out of memory)."""
    import transformers
    from plumbing import memory
    argv = [str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "run", "--batch_size", 64,
                                       "--fit_memory")]
    config = transformers.AutoConfig.from_pretrained(str(tiny_model))

    def graph_args():  # as options.check_cuda_graph leaves them on one CUDA GPU
        args = simcse.parse_args(argv)
        args.precision, args.cuda_graph, args.pad_to_max_length = "fp32", True, True
        return args
    step = memory.estimate(graph_args(), config)["step"]
    for capacity, chose in ((2 * step, None), (int(0.6 * step), "--micro_batch_size 32"), (1, None)):
        monkeypatch.setattr(memory, "device_free", lambda device: memory.CONTEXT + int(
            capacity / (1 - memory.FRAGMENTATION)) + 1)
        args = graph_args()
        line, record = memory.fit(args, config, torch.device("cuda"))
        assert record["chose"] == chose, (capacity, line, record)
        if chose:
            assert line.startswith("memory: --fit_memory switched on --micro_batch_size 32, and the CUDA graph off "
                                   "(it takes neither memory flag): the same objective"), line
            assert args.micro_batch_size == 32 and args.cuda_graph is False and record["cuda_graph"] is False
        else:
            assert args.cuda_graph is True and not args.micro_batch_size and not args.gradient_checkpointing
            assert line is None if capacity > step else "no setting of" in line


from plumbing.tracking import wandb_parts, wandb_records  # noqa: E402  (the reader of W&B's offline run files)


@pytest.mark.skipif(not (importlib.util.find_spec("wandb") and importlib.util.find_spec("mlflow")),
                    reason="wandb and mlflow-skinny are test requirements (requirements-test.txt); not installed here")
def test_wandb_and_mlflow_track_the_run_and_a_resume_continues_the_same_tracked_runs(
        tiny_model, corpus, senteval_dir, tmp_path, monkeypatch):
    """--report_to wandb mlflow tensorboard, W&B offline and MLflow on a local file store, stopped by SIGTERM at step
    2 and resumed: each tracker has the loss at every step as results.json has it, the dev gates' STS-B dev, the STS
    test scores at the end and the run's arguments; the resumed run continues the same W&B run id and MLflow run,
    which ends FINISHED."""
    import mlflow
    import test_resume
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DATA_DIR", raising=False)  # W&B stages --log_model's files in the run's wandb/
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's local file store, for a test
    out = tmp_path / "run"
    argv = [str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--logging_steps", 1,
                                       "--no_align_uniform", "--report_to", "wandb", "mlflow", "tensorboard",
                                       "--log_model")]
    test_resume.run("simcse", argv, monkeypatch, stop_at=2)
    next_second()  # as a resumed job starts (conftest.next_second)
    test_resume.run("simcse", argv + ["--resume"], monkeypatch)
    results = json.loads((out / "results.json").read_text())
    losses = dict(enumerate(results["train_loss"], start=1))
    gates = {row["step"]: row["stsb_dev"] for row in results["trajectory"] if row.get("gate")}
    test = {f"test/{task}": score for task, score in results["test"].items()}
    assert results["resumptions"] == [2]
    found = tracked(out)  # each tracker as lists: a step logged twice, or one missing, fails
    for tracker, metrics in found.items():
        for key, want in {"train/loss": losses, "dev/stsb_dev": gates, **{k: {4: v} for k, v in test.items()}}.items():
            assert [step for step, _ in metrics[key]] == list(want), (tracker, key)
            assert [value for _, value in metrics[key]] == pytest.approx(list(want.values())), (tracker, key)
    # W&B: two offline parts of one run id, the second a resume of the first
    parts = sorted(out.glob("wandb/offline-run-*"))
    assert len(parts) == 2 and all(p.name.endswith(results["tracking"]["wandb"]) or
                                   p.name.endswith(results["tracking"]["wandb"] + "-1") for p in parts), parts
    config, artifacts = {}, []
    for part in parts:
        for record in wandb_records(part / f"run-{results['tracking']['wandb']}.wandb"):
            if record.WhichOneof("record_type") == "artifact":
                artifacts.append((part, record.artifact.type, {entry.path for entry in
                                                               record.artifact.manifest.contents}))
            elif record.WhichOneof("record_type") == "run":
                config.update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                               for i in record.run.config.update})
    assert config["args.lr"] == 3e-05 and config["args.seed"] == 42 and "provenance.started" in config
    best_files = {f"best/{p.relative_to(out / 'best')}" for p in (out / "best").rglob("*") if p.is_file()}
    assert artifacts == [(parts[-1], "model", best_files | {"results.json"})]  # --log_model: once, at the end
    assert list((out / "wandb" / "artifacts" / "staging").iterdir()) and "WANDB_DATA_DIR" not in os.environ
    # MLflow: one run, its params the arguments, the same metrics, FINISHED
    client = mlflow.MlflowClient()
    run = client.get_run(results["tracking"]["mlflow"])
    assert run.info.status == "FINISHED" and run.data.params["args.lr"] == "3e-05"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"best", "results.json"}
    assert {a.path for a in client.list_artifacts(run.info.run_id, "best")} == {f"best/{p.name}" for p in
                                                                               (out / "best").iterdir()}


KILL_DRIVER = '''
import itertools, os, signal, sys
sys.path[:0] = [{root!r}]
import importlib, mlflow, plumbing, simcse
from plumbing import distributed, tracking
at, argv = sys.argv[1], sys.argv[2:]
def kill_in(owner, name, nth=0):  # a SIGKILL (no handler runs) in the nth call of owner.name
    real, calls = getattr(owner, name), itertools.count()
    def wrapped(*args, **kwargs):
        if next(calls) == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    setattr(owner, name, wrapped)
if at == "finish":  # the start of the finish: no tracker finished; the resumed run's losses shifted by 1
    kill_in(tracking.Trackers, "finish")
    shifted = simcse.info_nce
    simcse.info_nce = lambda *a, **k: shifted(*a, **k) + 1.0
elif at == "mlflow":  # the middle of the finish: TensorBoard's and W&B's finished, MLflow's not
    kill_in(mlflow.MlflowClient, "set_terminated")
else:  # after that step trained, before its log: no handler, no save
    kill_in(distributed.StopSignal, "requested", int(at))
plumbing.cli(lambda: simcse.main(argv))
'''


@pytest.mark.skipif(not (importlib.util.find_spec("wandb") and importlib.util.find_spec("mlflow")),
                    reason="wandb and mlflow-skinny are test requirements (requirements-test.txt); not installed here")
def test_each_step_is_tracked_once_across_a_kill_between_saves(tiny_model, corpus, senteval_dir, tmp_path,
                                                               monkeypatch, capsys):
    """kill -9 at a step drawn between two saves (last/ every 3 steps, a log every step: the steps after the save,
    logged already, are trained again by the resumed run), then --resume, killed -9 at the start of its trackers'
    finish (results.json written whole), then --auto_resume, which finishes the trackers and is killed -9 in the
    middle of that (TensorBoard's and W&B's finished, MLflow's not), then --auto_resume again. W&B's offline parts
    together and MLflow's store hold the loss and gradient norm at each of the 8 steps once, each the value
    results.json has, and the STS test scores once; MLflow's run ends FINISHED; the run's last lines print the sync
    command for every part, which the installed wandb's CLI takes; TensorBoard's events, read by its EventAccumulator,
    hold each step once too. The resumed run's losses are shifted by 1 (its info_nce patched: the gradients stay),
    as a GPU's re-run in bf16 differs from the first try: a tracker that kept the killed run's values of the steps
    trained again fails (W&B and MLflow did so, logging each step at once). A resumed run that logged its replayed
    steps again would give MLflow two values at a step, W&B a second part that starts at an old step, and TensorBoard
    steps 1 and 2 twice (a held step read as -1 did so). Where results.json is complete before the trackers have
    finished and --auto_resume leaves them so ("nothing left to do"), the test scores are missing from every tracker
    and MLflow's run stays RUNNING; a finish of the finished trackers again writes the test scores twice."""
    import mlflow
    import random
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(),
           "MLFLOW_ALLOW_FILE_STORE": "true"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    argv = [str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--max_steps", 8, "--eval_steps", 4,
                                       "--logging_steps", 1, "--save_steps", 3, "--no_align_uniform",
                                       "--report_to", "wandb", "mlflow", "tensorboard")]
    driver = tmp_path / "driver.py"
    driver.write_text(KILL_DRIVER.format(root=str(ROOT)))
    own = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_SERVICE", "_WANDB"))}  # its own service
    kill_at = random.Random(20261128).choice([4, 5])  # after the save at 3, before the one at 6
    for at, flag in ((kill_at, []), ("finish", ["--resume"]), ("mlflow", ["--auto_resume"])):
        next_second()  # a new W&B part's and TensorBoard file's name (conftest.next_second)
        killed = subprocess.run([sys.executable, str(driver), str(at), *argv, *flag], capture_output=True,
                                text=True, cwd=ROOT, env=dict(own, HF_HUB_OFFLINE="1"), timeout=300)
        assert killed.returncode == -9, (at, killed.stdout[-2000:], killed.stderr[-2000:])
        if at == "finish":  # the record whole, its trackers not: a completed run with its mark
            results = json.loads((out / "results.json").read_text())
            assert results["interrupted"] is False and results["tracking_unfinished"] == ["wandb", "mlflow",
                                                                                          "tensorboard"]
    next_second()
    code, _ = cli_in_process(simcse, *argv, "--auto_resume")
    printed = capsys.readouterr().out
    assert code == 0 and printed.strip().splitlines()[-1] == (
        f"complete: results in {out / 'results.json'} (--auto_resume: its trackers left unfinished, wandb, mlflow, "
        "tensorboard, finished now)")
    results = json.loads((out / "results.json").read_text())
    assert results["resumptions"] == [3] and results["steps"] == 8 and "tracking_unfinished" not in results
    assert min(results["train_loss"][3:]) > max(results["train_loss"][:3]) + 0.5  # the shift is in the record
    parts = wandb_parts(out, results["tracking"]["wandb"])
    assert len(parts) == 4  # the killed run's, the resumed run's, and each finish's
    found = tracked(out)  # each tracker as its own reader reads it, as lists: a step written twice fails
    want = {"train/loss": results["train_loss"], "train/grad_norm": results["grad_norm"]}
    for tracker in ("tensorboard", "mlflow", "wandb"):
        for key, values in want.items():
            assert [step for step, _ in found[tracker][key]] == list(range(1, 9)), (tracker, key)
            assert [value for _, value in found[tracker][key]] == pytest.approx(values, rel=1e-6), (tracker, key)
        for key in ("train/lr", "dev/stsb_dev"):  # at the gates and log points, once each
            points = [row["step"] for row in results["trajectory"] if key.split("/")[1] in row]
            assert [step for step, _ in found[tracker][key]] == points, (tracker, key)
        for task, score in results["test"].items():  # the final scores, once, at the last step
            assert found[tracker][f"test/{task}"] == [(8, pytest.approx(score, rel=1e-6))], (tracker, task)
    assert mlflow.MlflowClient().get_run(results["tracking"]["mlflow"]).info.status == "FINISHED"
    assert f"`wandb sync {' '.join(map(str, parts))}` uploads this run, all its 4 part(s)" in printed
    dry = subprocess.run([sys.executable, "-m", "wandb", "sync", "--dry-run", *map(str, parts)],  # the CLI's own
                         capture_output=True, text=True, env=dict(os.environ, **env), timeout=120)
    assert dry.returncode == 0 and all(part.name in dry.stdout + dry.stderr for part in parts), dry


@pytest.mark.parametrize("tracker, package", [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_tracker_not_installed_is_one_line_before_any_work(tracker, package, tiny_model, corpus, senteval_dir,
                                                            tmp_path, monkeypatch):
    import sys
    import plumbing
    monkeypatch.setitem(sys.modules, package, None)  # what importlib sees when it is not installed
    out = tmp_path / "run"
    with pytest.raises(plumbing.UsageError, match=f"--report_to {tracker} needs the {package} package: pip "
                                                  f"install {package}"):
        simcse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--report_to", tracker)])
    assert not out.exists()


@needs_shared
@pytest.mark.skipif(not importlib.util.find_spec("mteb"), reason="mteb is a test requirement (requirements-test.txt); "
                                                                 "not installed here")
def test_mteb_on_a_checkpoint_scores_a_local_sts_task_as_the_suite_does(tmp_path):
    """tools/mteb_eval.py on all-MiniLM-L6-v2 with --sts_file (STS-B test's first 300 pairs, offline): MTEB's main
    score x 100 is the Spearman correlation of the suite's own embeddings' cosine similarities (eval_sts.load_encode,
    the same pooler) with the gold scores, computed here; MTEB's result file is written in its cache layout, the
    suite's table beside it. (A tiny random model will not do: its embeddings are so alike that fp32's rounding in
    other batches reorders the pairs.)"""
    import csv
    import eval_sts
    import mteb_eval
    from scipy.stats import spearmanr
    senteval, model = SHARED / "data" / "senteval", str(SHARED / "models" / "all-MiniLM-L6-v2")
    pairs = eval_sts.load_pairs(senteval, "STSBenchmark")[:300]
    sts_file = tmp_path / "stsb.csv"
    with open(sts_file, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["sentence1", "sentence2", "score"])
        writer.writerows(pairs)
    out = tmp_path / "mteb"
    scores = mteb_eval.main(["--model_name_or_path", model, "--pooler", "avg", "--sts_file", str(sts_file),
                             "--output_dir", str(out), "--device", "cpu"])
    encode = eval_sts.load_encode(model, "avg", "cpu")
    a, b = encode([p[0] for p in pairs]), encode([p[1] for p in pairs])
    cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    expected = 100 * spearmanr(cosine, [p[2] for p in pairs])[0]
    assert scores == {"local-stsb": pytest.approx(expected, abs=0.006)}  # rounded to 2 decimals
    result = json.loads(next(out.glob("results/*/local/local-stsb.json")).read_text())
    assert result["scores"]["test"][0]["main_score"] * 100 == pytest.approx(expected, abs=1e-3)
    assert "| local-stsb |" in (out / "scores.md").read_text()


@pytest.mark.skipif(not importlib.util.find_spec("mteb"), reason="mteb is a test requirement; not here")
def test_mteb_on_a_runs_best_writes_its_hub_tasks_into_the_card_once(finished_run, tmp_path, monkeypatch):
    """tools/mteb_eval.py on a run's best/: a task with a dataset on the Hub (here STS-B's metadata over 20 local
    pairs: no internet) goes into results.json's "mteb" and the card's model-index with MTEB's names, split and
    revision, beside the suite's own STS entries; run again, it replaces its entry (no duplicate); --hub_model_id
    names the model in MTEB's files; a run holding the folder leaves the card alone, with a note. A local
    --sts_file task is never carded (its path is local)."""
    import shutil
    from pathlib import Path
    import eval_sts
    import mteb
    import mteb_eval
    from huggingface_hub import ModelCard
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    sts_file = tmp_path / "pairs.csv"
    pairs = eval_sts.load_pairs(Path(json.loads((run / "results.json").read_text())["args"]["senteval_dir"]),
                                "STSBenchmark")[:20]
    sts_file.write_text("sentence1,sentence2,score\n" + "".join(f'"{a}","{b}",{s}\n' for a, b, s in pairs))
    local_task = mteb_eval.local_sts_task

    def as_if_on_the_hub(mteb_module, path):
        task = local_task(mteb_module, path)
        task.metadata = task.metadata.model_copy(update={"name": "STSBenchmark",
                                                         "dataset": mteb.get_task("STSBenchmark").metadata.dataset})
        return task
    argv = ["--model_name_or_path", str(run / "best"), "--sts_file", str(sts_file), "--device", "cpu",
            "--hub_model_id", "me/tiny-simcse"]
    assert list(mteb_eval.main(argv)) == ["local-pairs"]
    assert "mteb" not in json.loads((run / "results.json").read_text())  # a local task: not carded
    monkeypatch.setattr(mteb_eval, "local_sts_task", as_if_on_the_hub)
    for _ in range(2):
        scores = mteb_eval.main(argv)
    results = json.loads((run / "results.json").read_text())
    hub = mteb.get_task("STSBenchmark").metadata.dataset
    assert results["mteb"] == [{"task_type": "STS", "dataset_type": hub["path"], "dataset_name": "MTEB STSBenchmark",
                                "dataset_config": "default", "dataset_split": "test",
                                "dataset_revision": hub["revision"], "metric_type": "cosine_spearman",
                                "metric_value": scores["STSBenchmark"],
                                "metric_name": "cosine_spearman x 100 (MTEB)"}]
    card = ModelCard.load(run / "best" / "README.md")
    found = {r.dataset_name: (r.dataset_type, r.dataset_split, r.metric_value) for r in card.data.eval_results}
    assert found["MTEB STSBenchmark"] == (hub["path"], "test", scores["STSBenchmark"])
    assert {"STS12", "STSBenchmark", "SICKRelatedness"} <= set(found)  # the suite's own entries stay
    assert list((run / "mteb" / "results").glob("me__tiny-simcse/*/STSBenchmark.json"))
    before = (run / "best" / "README.md").read_text()
    (run / "results.json").write_text(json.dumps({**results, "mteb": []}))
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
                               str(run / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        mteb_eval.main(argv)
    finally:
        holder.kill()
    assert json.loads((run / "results.json").read_text())["mteb"] == []
    assert (run / "best" / "README.md").read_text() == before
    (run / "results.json").write_text(json.dumps({**results, "mteb": [], "interrupted": True}))  # a stopped run
    mteb_eval.main(argv)
    assert json.loads((run / "results.json").read_text())["mteb"] == []


def test_mteb_without_the_package_or_with_a_bad_file_is_one_line(finished_run, tmp_path, monkeypatch):
    import sys
    import mteb_eval
    from conftest import cli_in_process
    bad = tmp_path / "bad.csv"
    bad.write_text("sentence1,sentence2,score\na,b,high\n")
    if importlib.util.find_spec("mteb"):
        code, err = cli_in_process(mteb_eval, "--model_name_or_path", finished_run / "best", "--sts_file", bad,
                                   "--device", "cpu", "--output_dir", tmp_path / "out")
        assert code == 2 and err.strip().splitlines() == [
            f"error: --sts_file {bad}, line 2: want sentence1, sentence2 and a numeric score, got ['a', 'b', 'high']"]
    code, err = cli_in_process(mteb_eval, "--model_name_or_path", finished_run, "--device", "cpu")  # not its best/
    assert code == 2 and err.strip().splitlines() == [f"error: --model_name_or_path {finished_run} is a training "
                                                      f"run's folder; its model is --model_name_or_path "
                                                      f"{finished_run / 'best'}"]
    monkeypatch.setitem(sys.modules, "mteb", None)
    code, err = cli_in_process(mteb_eval, "--model_name_or_path", finished_run / "best", "--device", "cpu")
    assert code == 2 and "tools/mteb_eval.py needs the mteb package: pip install mteb" in err, err


@pytest.mark.skipif(not importlib.util.find_spec("mlflow"), reason="mlflow-skinny is a test requirement; not here")
def test_a_tracker_that_cannot_start_stops_the_run_in_one_line(tiny_model, corpus, senteval_dir, tmp_path,
                                                                monkeypatch):
    """An MLflow store that cannot be used (here MLflow 3's file store without its opt-in) is one line naming the
    tracker and the way on, not a traceback, and the folder is free for the next command."""
    from conftest import cli_in_process
    from plumbing import lock
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    import mlflow
    if int(mlflow.__version__.split(".")[0]) < 3:
        pytest.skip("MLflow 2's file store starts")
    out = tmp_path / "run"
    code, err = cli_in_process(simcse, *smoke_args(tiny_model, corpus, senteval_dir, out, "--report_to", "mlflow"))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: --report_to mlflow: it could not start ("), err
    assert lines[0].endswith("check MLFLOW_TRACKING_URI (docs/using.md), or leave mlflow out of --report_to")
    assert "MLFLOW_ALLOW_FILE_STORE" in lines[0]  # MLflow's own fix, not cut off
    assert not (out / lock.NAME).exists()


@pytest.mark.skipif(not importlib.util.find_spec("mlflow"), reason="mlflow-skinny is a test requirement; not here")
def test_a_run_that_stops_itself_closes_its_tracked_run_and_an_evaluation_alone_continues_it(
        tiny_model, corpus, senteval_dir, tmp_path, monkeypatch):
    """A run that diverges (its loss made NaN at step 3) marks its MLflow run KILLED with what it logged; a run killed
    in its final evaluation and finished by --auto_resume (the evaluation alone) logs the test scores into the same
    MLflow run, which ends FINISHED."""
    import math
    import mlflow
    import common
    import test_faults
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.MlflowClient()
    out = tmp_path / "diverged"
    real_info_nce, calls = simcse.info_nce, []

    def diverging(*args, **kwargs):
        calls.append(1)
        loss = real_info_nce(*args, **kwargs)
        return loss * math.nan if len(calls) == 3 else loss
    with monkeypatch.context() as patch:
        patch.setattr(simcse, "info_nce", diverging)
        with pytest.raises(SystemExit):
            import plumbing
            plumbing.cli(lambda: simcse.main([str(a) for a in smoke_args(
                tiny_model, corpus, senteval_dir, out, "--logging_steps", 1, "--report_to", "mlflow")]))
    results = json.loads((out / "results.json").read_text())
    assert results["stop"]["by"] == "divergence"
    run = client.get_run(results["tracking"]["mlflow"])
    assert run.info.status == "KILLED" and [m.step for m in client.get_metric_history(run.info.run_id,
                                                                                       "train/loss")] == [1, 2]
    # killed in the final evaluation, finished by the same command with --auto_resume: the same MLflow run
    out = tmp_path / "evaluated"
    argv = [str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--report_to", "mlflow",
                                       "--no_align_uniform", "--auto_resume")]
    import eval_sts
    with monkeypatch.context() as patch:  # SIGTERM in the final evaluation's STS test
        test_faults.signal_at(patch, eval_sts, "evaluate", 0, when=lambda *a, mode="test", **k: mode == "test")
        with pytest.raises(SystemExit):
            simcse.main(argv)
    first = json.loads((out / "results.json").read_text())["tracking"]["mlflow"]
    assert client.get_run(first).info.status == "KILLED"
    simcse.main(argv)
    results = json.loads((out / "results.json").read_text())
    assert results["tracking"]["mlflow"] == first and "evaluation_alone" in results
    run = client.get_run(first)
    assert run.info.status == "FINISHED" and run.data.metrics["test/avg"] == pytest.approx(results["test"]["avg"])


def test_mteb_refuses_scores_that_do_not_vary_and_an_unknown_task_in_one_line(finished_run, tmp_path):
    pytest.importorskip("mteb", reason="mteb is a test requirement (requirements-test.txt)")
    import mteb_eval
    from conftest import cli_in_process
    flat = tmp_path / "flat.csv"
    flat.write_text("sentence1,sentence2,score\na b,c d,3\ne f,g h,3\n")
    code, err = cli_in_process(mteb_eval, "--model_name_or_path", finished_run / "best", "--sts_file", flat,
                               "--device", "cpu", "--output_dir", tmp_path / "out")
    assert code == 2 and err.strip().splitlines() == [f"error: --sts_file {flat}: fewer than 2 pairs, or every score "
                                                      "the same (a correlation needs scores that vary)"]
    code, err = cli_in_process(mteb_eval, "--model_name_or_path", finished_run / "best", "--tasks", "NoSuchTask",
                               "--device", "cpu", "--output_dir", tmp_path / "out")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "NoSuchTask" in lines[0] and "mteb.get_tasks(task_types=['STS'])" in \
        lines[0], err


@pytest.mark.skipif(not importlib.util.find_spec("mlflow"), reason="mlflow-skinny is a test requirement")
def test_the_second_hours_frictions_are_each_one_line(tiny_model, corpus, senteval_dir, tmp_path, monkeypatch,
                                                      capsys):
    """mlflow-skinny without MLFLOW_TRACKING_URI: one line that names the variable, before any work (not MLflow's
    message about SQLite and its model registry). A warm-up at least as long as the run: the summary says so (miCSE's
    preset of 250 warm-up steps on a 20-step run)."""
    import importlib.util as util
    from conftest import cli_in_process
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    real = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name, *a: None if name == "sqlalchemy" else real(name, *a))
    code, err = cli_in_process(simcse, *smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "m", "--report_to",
                                                   "mlflow"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "set MLFLOW_TRACKING_URI" in err, err
    assert not (tmp_path / "m" / "started.json").exists()
    capsys.readouterr()
    simcse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "w", "--warmup_steps", 10,
                                            "--no_test_eval", "--no_align_uniform")])
    assert "note: --warmup_steps 10 is not below the run's 4 steps: its lr never leaves the warm-up" in \
        capsys.readouterr().out


def test_log_model_without_a_tracker_that_keeps_artifacts_is_one_line(tiny_model, corpus, senteval_dir, tmp_path):
    """--log_model alone (or with TensorBoard) would do nothing: one line before any work."""
    from conftest import cli_in_process
    out = tmp_path / "run"
    code, err = cli_in_process(simcse, *smoke_args(tiny_model, corpus, senteval_dir, out, "--log_model",
                                                   "--report_to", "tensorboard"))
    assert code == 2 and err.strip().splitlines() == [
        "error: --log_model sends best/ to W&B or MLflow: add --report_to wandb or mlflow, or leave --log_model out"]
    assert not out.exists()


@pytest.mark.skipif(not importlib.util.find_spec("mlflow"), reason="mlflow-skinny is a test requirement; not here")
def test_a_tracker_added_when_the_run_resumes_gets_the_runs_params(tiny_model, corpus, senteval_dir, tmp_path,
                                                                   monkeypatch):
    """miCSE started with MLflow alone, stopped at step 2 and resumed with TensorBoard and W&B too: the resumed
    MLflow run keeps its params, and both new trackers get every metric (the loss's terms and test/* included) at
    every step once, as MLflow holds them (read back as lists: the steps before the resume replayed from the record,
    none twice). A tracker added at a resume has no files yet: reading what it holds must not fail."""
    import mlflow
    import test_resume
    tracker_env(monkeypatch, tmp_path / "mlruns")
    out = tmp_path / "run"
    argv = [str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--logging_steps", 1, "--queue_size",
                                       16, "--no_align_uniform", "--report_to", "mlflow")]
    test_resume.run("micse", argv, monkeypatch, stop_at=2)  # miCSE: its loss's two terms tracked too
    next_second()
    test_resume.run("micse", argv[:-1] + ["mlflow", "tensorboard", "wandb", "--resume"], monkeypatch)
    results = json.loads((out / "results.json").read_text())
    run = mlflow.MlflowClient().get_run(results["tracking"]["mlflow"])
    assert run.data.params["args.lr"] == "3e-05" and run.data.params["args.seed"] == "42"
    found = tracked(out)
    assert [step for step, _ in found["mlflow"]["train/loss"]] == [1, 2, 3, 4]
    assert [step for step, _ in found["mlflow"]["train/ami"]] == [1, 2, 3, 4] and "test/avg" in found["mlflow"]
    for tracker in ("tensorboard", "wandb"):
        assert found[tracker].keys() == found["mlflow"].keys(), tracker
        for metric, want in found["mlflow"].items():  # TensorBoard keeps float32
            assert [step for step, _ in found[tracker][metric]] == [step for step, _ in want], (tracker, metric)
            assert [value for _, value in found[tracker][metric]] == pytest.approx([v for _, v in want], rel=1e-6)
