"""Several processes (torchrun, gloo on CPU): the same training as one process with the same global batch.

With dropout switched off both runs compute the same function, so after two steps the parameters must agree to
1e-5: this is what proves the gathers (negatives over the global batch, DCL's and the whitening's batch
statistics, miCSE's queue) and the gradient averaging. The driver runs a method's own main() under torchrun and
records, at every dev gate, the parameters it evaluates; the one-process reference runs the same main() in the
test's own process with the same recording gate.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, gates, smoke_args, write_tiny_model

DRIVER = '''
import sys
sys.path[:0] = [{root!r}, {tests!r}]
import common, importlib, plumbing
from test_distributed import recording_dev_measures
script, out, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
common.dev_measures = recording_dev_measures(common.dev_measures, out)
plumbing.cli(lambda: importlib.import_module(script).main(argv))
'''


def recording_dev_measures(real_dev_measures, out):
    """The dev gate, saving first the parameters it evaluates to out/params_rank<rank>.pt (the last gate's file
    is what remains: the parameters after the last step)."""
    import distributed

    def dev_measures(modules, encode, senteval_dir):
        state = {f"{i}.{k}": v.detach().clone() for i, m in enumerate(modules) for k, v in m.state_dict().items()}
        torch.save(state, Path(out) / f"params_rank{distributed.rank()}.pt")
        return real_dev_measures(modules, encode, senteval_dir)
    return dev_measures


METHOD_FLAGS = {
    "simcse": [], "simcsepp": [], "sscl": ["--neg_layers", "1"], "whitenedcse": ["--num_groups", "16"],
    "micse": ["--ami_lambda", "0", "--momentum_dropout", "0", "--queue_size", "12"],  # AMI is per process
}


@pytest.fixture(scope="module")
def no_dropout_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny_no_dropout"), dropout=0.0)


def run_in_this_process(script, args, out, monkeypatch):
    """The one-process reference: the method's main() here, behind the same recording dev gate as DRIVER's."""
    import importlib
    import common
    out.mkdir(parents=True)
    monkeypatch.setattr(common, "dev_measures", recording_dev_measures(common.dev_measures, out))
    importlib.import_module(script).main([*map(str, args), "--output_dir", str(out), "--overwrite_output_dir"])
    return out


def launch(script, args, workdir):
    """DRIVER under torchrun with two processes."""
    workdir.mkdir(parents=True, exist_ok=True)
    driver = workdir / "driver.py"
    driver.write_text(DRIVER.format(root=str(ROOT), tests=str(ROOT / "tests")))
    out = workdir / "run"
    out.mkdir(parents=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run([*launcher, str(driver), script, str(out), *map(str, args), "--output_dir", str(out),
                           "--overwrite_output_dir"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    return proc, out


@pytest.mark.parametrize("script", list(METHOD_FLAGS))
def test_two_processes_train_like_one(script, no_dropout_model, corpus, senteval_dir, tmp_path, monkeypatch):
    args = smoke_args(no_dropout_model, corpus, senteval_dir, "unused")[:-4]  # without --output_dir and --device
    args += ["--device", "cpu", "--max_steps", 2, "--eval_steps", 1, "--batch_size", 8, "--no_test_eval",
             *METHOD_FLAGS[script]]  # argparse: the last occurrence of a flag wins
    one_out = run_in_this_process(script, args, tmp_path / "one", monkeypatch)
    two, two_out = launch(script, args, tmp_path / "two")
    assert two.returncode == 0, two.stderr[-3000:]
    single, rank0, rank1 = (torch.load(p) for p in (one_out / "params_rank0.pt", two_out / "params_rank0.pt",
                                                    two_out / "params_rank1.pt"))
    assert single.keys() == rank0.keys() == rank1.keys()
    for name in single:
        torch.testing.assert_close(rank0[name], rank1[name], atol=0, rtol=0)  # the processes never drift apart
        torch.testing.assert_close(rank0[name], single[name], atol=1e-5, rtol=1e-5, msg=name)
    r1, r2 = (json.loads((o / "results.json").read_text()) for o in (one_out, two_out))
    assert r2["world_size"] == 2 and r1["world_size"] == 1
    assert r1["steps"] == r2["steps"] == 2
    assert [s for s, _ in gates(r1)] == [s for s, _ in gates(r2)] == [0, 1, 2]
    assert r1["train_loss"] == pytest.approx(r2["train_loss"], rel=1e-5)
    # written once, by process 0: one results.json, one checkpoint, one "wrote" line
    assert sorted(p.name for p in two_out.iterdir() if not p.name.startswith("params")) == ["best", "results.json"]
    assert two.stdout.count("wrote ") == 1


def test_global_batch_must_divide_over_the_processes(no_dropout_model, corpus, senteval_dir, tmp_path):
    args = smoke_args(no_dropout_model, corpus, senteval_dir, "unused")[:-4] + ["--device", "cpu", "--batch_size", 7]
    proc, out = launch("simcse", args, tmp_path)
    assert proc.returncode != 0
    assert "--batch_size 7 must be divisible by the 2 processes" in proc.stderr
    assert not (out / "results.json").exists()


SLOW_FINAL_EVALUATION_DRIVER = '''
import datetime, functools, sys, time
sys.path[:0] = [{root!r}]
import torch.distributed as dist
dist.init_process_group = functools.partial(dist.init_process_group, timeout=datetime.timedelta(seconds={timeout}))
import common, eval_sts, plumbing, simcse
real_evaluate = eval_sts.evaluate

def slow_evaluate(encode, senteval_dir, tasks=None, mode="test", **kwargs):
    if mode == "test":  # process 0's final evaluation outlasts the process group's timeout
        time.sleep({sleep})
    return real_evaluate(encode, senteval_dir, tasks, mode, **kwargs)

eval_sts.evaluate = slow_evaluate
plumbing.cli(lambda: simcse.main(sys.argv[1:]))
'''


def test_a_final_evaluation_longer_than_the_group_timeout_ends_well(no_dropout_model, corpus, senteval_dir, tmp_path):
    """NCCL's default timeout is 10 minutes and a BERT-base transfer evaluation is longer: the other processes must
    not wait in a barrier for process 0's final evaluation. Here the timeout is 8 s and the evaluation 14 s."""
    driver = tmp_path / "driver.py"
    driver.write_text(SLOW_FINAL_EVALUATION_DRIVER.format(root=str(ROOT), timeout=8, sleep=14))
    out = tmp_path / "run"
    args = smoke_args(no_dropout_model, corpus, senteval_dir, out)[:-2] + ["--device", "cpu", "--max_steps", 2]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(driver), *map(str, args)], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["world_size"] == 2 and results["steps"] == 2 and "test" in results
