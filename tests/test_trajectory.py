"""The trajectory every run records (dev gates, --align_uniform_steps, lr, gradient norms) and --report_to."""
import json
import sys

import pytest

import plumbing
from plumbing import files
from conftest import gates, smoke_args

SCRIPTS = ["simcse", "simcsepp", "sscl", "whitenedcse", "micse"]
METHOD_FLAGS = {"whitenedcse": ["--num_groups", "16"], "sscl": ["--neg_layers", "1"]}


@pytest.fixture(scope="module")
def au_run(tiny_model, corpus, senteval_dir, tmp_path_factory):
    """simcse.py with alignment/uniformity at every step and dev gates at 0, 2 and 4."""
    import simcse
    out = tmp_path_factory.mktemp("trajectory") / "run"
    simcse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--align_uniform_steps", 1,
                                            "--no_test_eval", "--warmup_steps", 1)])
    return json.loads((out / "results.json").read_text())


def test_every_step_of_align_uniform_steps_has_a_row_and_only_eval_steps_gate(au_run):
    rows = au_run["trajectory"]
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4]
    assert [row["gate"] for row in rows] == [True, False, True, False, True]
    assert all({"stsb_dev", "align", "uniform", "lr", "train_time_s"} <= set(row) for row in rows)
    assert 0 <= min(row["align"] for row in rows) and max(row["uniform"] for row in rows) <= 0
    # the best checkpoint is chosen at the gates only
    assert au_run["best_dev_stsb"] == max(dev for _, dev in gates(au_run))
    assert [row["train_time_s"] for row in rows] == sorted(row["train_time_s"] for row in rows)


def test_lr_and_gradient_norms_follow_the_schedule(au_run):
    """One warm-up step, then linear decay to 0 over the 4 steps; lr at row k is what the scheduler set after step
    k (at row 0 the warm-up's 0); one gradient norm per step, before clipping."""
    lr = 3e-5
    assert [row["lr"] for row in au_run["trajectory"]] == pytest.approx([0, lr, lr * 2 / 3, lr / 3, 0])
    assert len(au_run["grad_norm"]) == len(au_run["train_loss"]) == au_run["steps"] == 4
    assert all(norm > 0 for norm in au_run["grad_norm"])


def test_the_trajectory_ends_are_the_initial_and_best_checkpoints_align_uniform(au_run):
    """Step 0's values are the pretrained model's, the best step's those of best/ reloaded (the final evaluation):
    the gate measures what eval_sts.align_uniform measures."""
    rows = {row["step"]: row for row in au_run["trajectory"]}
    for which, step in (("initial", 0), ("best", au_run["best_step"])):
        for key in ("align", "uniform"):
            assert rows[step][key] == pytest.approx(au_run["align_uniform"][which][key], abs=2e-4), (which, key)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_method_records_the_trajectory(script, tiny_model, corpus, senteval_dir, tmp_path, monkeypatch):
    """... and the quick check (--no_test_eval --no_align_uniform) ends without encoding anything after training."""
    import importlib
    import eval_sts
    monkeypatch.setattr(eval_sts, "load_encode", lambda *a: pytest.fail("the final evaluation encoded"))
    out = tmp_path / "run"
    importlib.import_module(script).main([str(a) for a in smoke_args(
        tiny_model, corpus, senteval_dir, out, "--no_test_eval", "--no_align_uniform", "--max_steps", 2,
        *METHOD_FLAGS.get(script, []))])
    results = json.loads((out / "results.json").read_text())
    assert [(row["step"], row["gate"]) for row in results["trajectory"]] == [(0, True), (2, True)]
    assert all(isinstance(row["align"], float) for row in results["trajectory"])
    assert len(results["grad_norm"]) == 2 and "dev_curve" not in results and "align_uniform" not in results


def test_the_older_format_still_loads():
    old = {"dev_curve": [[0, 70.0], [5, 71.0]], "train_time_curve": [[0, 0.0], [2, 1.0], [5, 2.5]]}
    assert files.trajectory(old) == [{"step": 0, "train_time_s": 0.0, "stsb_dev": 70.0, "gate": True},
                                        {"step": 2, "train_time_s": 1.0},
                                        {"step": 5, "train_time_s": 2.5, "stsb_dev": 71.0, "gate": True}]
    new = {"trajectory": [{"step": 0}]}
    assert files.trajectory(new) is new["trajectory"]


def test_report_to_tensorboard_writes_the_scalars(tiny_model, corpus, senteval_dir, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is a test requirement (requirements-test.txt)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    import simcse
    out = tmp_path / "run"
    simcse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--no_test_eval",
                                            "--report_to", "tensorboard")])
    events = EventAccumulator(str(out / "tb")).Reload()
    assert sorted(events.Tags()["scalars"]) == ["dev/align", "dev/stsb_dev", "dev/uniform", "train/grad_norm",
                                                "train/loss", "train/lr"]
    results = json.loads((out / "results.json").read_text())
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(results["train_loss"])
    assert [(e.step, round(e.value, 2)) for e in events.Scalars("dev/stsb_dev")] == [tuple(g) for g in gates(results)]
    # a second run over it (--overwrite_output_dir) replaces the first run's events instead of mixing them in
    simcse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--no_test_eval", "--max_steps",
                                            2, "--report_to", "tensorboard", "--overwrite_output_dir")])
    assert [e.step for e in EventAccumulator(str(out / "tb")).Reload().Scalars("train/loss")] == [1, 2]


def test_report_to_tensorboard_without_the_package_is_one_line(tiny_model, corpus, senteval_dir, tmp_path,
                                                               monkeypatch):
    import simcse
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what importlib sees when it is not installed
    out = tmp_path / "run"
    with pytest.raises(plumbing.UsageError, match="--report_to tensorboard needs the tensorboard package: pip "
                                                  "install tensorboard"):
        simcse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--report_to",
                                                "tensorboard")])
    assert not out.exists()


@pytest.mark.parametrize("script, flags, names", [
    ("micse", ["--queue_size", "16"], ["info_nce", "ami"]),
    ("simcsepp", [], ["info_nce", "dcl"]),
    ("simcse", ["--do_mlm", "--micro_batch_size", "2"], ["mlm"]),  # GradCache: the MLM parts summed
])
def test_each_methods_loss_terms_are_logged_beside_the_loss_and_kept_across_a_resume(
        script, flags, names, tiny_model, corpus, senteval_dir, tmp_path, monkeypatch):
    """The loss's weighted terms (miCSE's InfoNCE and lambda x AMI, SimCSE++'s InfoNCE and the weighted DCL,
    SimCSE's lambda x MLM) at every step in results.json ("train_terms") and the trackers (train/<term>): where they
    are the whole objective they sum to the loss (to fp32's rounding of one addition); a run stopped at step 2 and
    resumed keeps them, each step's the straight run's. A term left out, taken before its weight, or not kept in
    last/ fails it."""
    pytest.importorskip("tensorboard", reason="tensorboard is a test requirement (requirements-test.txt)")
    import importlib
    import test_resume
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    module = importlib.import_module(script)
    runs = {}
    for name in ("straight", "resumed"):
        out = tmp_path / name
        argv = [str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--no_test_eval",
                                           "--no_align_uniform", "--logging_steps", 1, "--report_to", "tensorboard",
                                           *flags)]
        if name == "resumed":
            test_resume.run(script, argv, monkeypatch, stop_at=2)
            argv.append("--resume")
        module.main(argv)
        runs[name] = json.loads((out / "results.json").read_text())
    results = runs["straight"]
    terms = results["train_terms"]
    assert list(terms) == names and all(len(values) == results["steps"] == 4 for values in terms.values())
    if len(names) == 2:  # the whole objective: their sum is the loss
        for step, loss in enumerate(results["train_loss"]):
            assert sum(terms[n][step] for n in names) == pytest.approx(loss, rel=2 ** -22, abs=1e-7)
    else:  # MLM: a part of it
        assert all(0 < mlm < loss for mlm, loss in zip(terms["mlm"], results["train_loss"]))
    events = EventAccumulator(str(tmp_path / "straight" / "tb")).Reload()
    for name in names:
        assert [(e.step, e.value) for e in events.Scalars(f"train/{name}")] == [
            (step, pytest.approx(value)) for step, value in enumerate(terms[name], start=1)]
    assert runs["resumed"]["resumptions"] == [2] and runs["resumed"]["train_terms"] == terms
    if script == "simcse":  # GradCache in one part trains the full batch bit for bit: its MLM term once, not twice
        whole = {}
        for parts in ([], ["--micro_batch_size", "8"]):
            out = tmp_path / f"whole{len(parts)}"
            module.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--no_test_eval",
                                                    "--no_align_uniform", "--do_mlm", *parts)])
            whole[len(parts)] = json.loads((out / "results.json").read_text())
        assert whole[0]["train_loss"] == whole[2]["train_loss"] and whole[0]["train_terms"] == whole[2]["train_terms"]
