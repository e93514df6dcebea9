"""Several processes (torchrun, gloo on CPU): the same training as one process with the same global batch.

With dropout switched off both runs compute the same function, so after four steps the parameters must agree to
1e-5: this is what proves the gathers (negatives over the global batch, DCL's and the whitening's batch
statistics, miCSE's queue) and DistributedDataParallel's gradient averaging. The driver runs a method's own main()
under torchrun and records, at every dev gate, the parameters it evaluates, and what crossed the processes: DDP's
forward passes, and the stop's exchanges (one a step, read the next, and one at the end); the one-process reference
runs the same main() in the test's own process with the same recording dev gate. A run stopped by signals to either
process and resumed ends as the straight two-process run.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, gates, smoke_args, write_nli, write_tiny_model

DRIVER = '''
import contextlib, datetime, importlib, json, os, shutil, signal, sys, time, traceback
sys.path[:0] = [{root!r}, {tests!r}]
import torch.distributed as dist
import eval_sts, plumbing
from plumbing import distributed, outdir, run, tracking
from test_distributed import recording_dev_measures
rank = os.environ["RANK"]
real_dev_measures, real_largest_next, real_record = run.dev_measures, distributed.largest_next, run.Run.record
real_evaluate, real_settle = eval_sts.evaluate, distributed.StopSignal.settle
real_handle, real_finish, received = distributed.StopSignal._handle, tracking.Trackers.finish, []
seen, signals = {{}}, {{}}

def slow_final_evaluation(timeout, sleep):  # the group's timeout `timeout` s from the training's last exchange on
    def settle(self):  # (before it, a start or a dev gate slowed by a busy machine could outlast it), and process 0's
        real_settle(self)  # final evaluation `sleep` s longer
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout))

    def evaluate(encode, senteval_dir, tasks=None, mode="test", **kwargs):
        if mode == "test":
            time.sleep(sleep)
        return real_evaluate(encode, senteval_dir, tasks, mode, **kwargs)
    eval_sts.evaluate, distributed.StopSignal.settle = evaluate, settle

def handle(self, signum, frame):  # each signal this process's handler got
    received.append(signum)
    return real_handle(self, signum, frame)

def slow_finish(self, *args, **kwargs):  # process 0's trackers finish once torchrun's SIGTERM has come (process 1 has
    deadline = time.time() + 20  # exited 143), before torchrun's SIGKILL 30 s after it
    while len(received) < 2 and time.time() < deadline:
        time.sleep(0.05)
    return real_finish(self, *args, **kwargs)

class CountingDDP(distributed.DistributedDataParallel):
    def forward(self, *args, **kwargs):
        seen["ddp_forwards"] += 1
        return super().forward(*args, **kwargs)

def largest_next(value):
    seen["stop_flag_exchanges"] += 1
    return real_largest_next(value)

def record(self, *args, **kwargs):  # a signal to this process alone during the step, as from outside
    if signals.get(rank, {{}}).get(str(self.current_step)):
        os.kill(os.getpid(), getattr(signal, signals[rank][str(self.current_step)]))
    return real_record(self, *args, **kwargs)

def init_process_group(*args, **kwargs):  # a process waiting on one that is gone fails in 2 minutes, not gloo's 30
    return real_init(*args, **kwargs, timeout=datetime.timedelta(seconds=120))

real_init, dist.init_process_group = dist.init_process_group, init_process_group
distributed.DistributedDataParallel, distributed.largest_next, run.Run.record = CountingDDP, largest_next, record
distributed.StopSignal._handle = handle
runs = json.load(open(sys.argv[1]))
for i, (script, out, argv, logs, signals, slow) in enumerate(runs):  # one run after another
    while i and not os.path.exists(f"{{runs[i - 1][3]}}/seen_rank{{1 - int(rank)}}.json"):
        time.sleep(0.05)  # the run before ended on both processes: this one may resume it
    eval_sts.evaluate, distributed.StopSignal.settle = real_evaluate, real_settle
    tracking.Trackers.finish, relay = real_finish, bool(slow and "relay" in slow)
    received.clear()
    if relay:  # the last run: process 1's exit is the launch's
        tracking.Trackers.finish = slow_finish if rank == "0" else real_finish
    elif slow:
        slow_final_evaluation(**slow)
    # each run's process group under keys of its own in torchrun's store, as a restarted attempt's
    # (plumbing/distributed.init): the last group's addresses, still there, would be read and tried
    os.environ["TORCHELASTIC_RESTART_COUNT"] = f"run{{i}}" if i else "0"
    seen = dict(ddp_forwards=0, stop_flag_exchanges=0, exit=0)
    run.dev_measures = recording_dev_measures(real_dev_measures, out)
    with open(f"{{logs}}/stdout_rank{{rank}}.txt", "w") as stdout, open(f"{{logs}}/stderr_rank{{rank}}.txt",
                                                                      "w") as err:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(err):
            try:
                plumbing.cli(lambda: importlib.import_module(script).main(argv))
            except SystemExit as exit:
                seen["exit"] = exit.code
            except BaseException:
                traceback.print_exc()
                seen["exit"] = "traceback"
    if rank == "0" and logs != out:  # a part of a run: what it left, before the next part changes it
        seen.update(state=outdir.state(out)[0], last=sorted(os.listdir(f"{{out}}/last")) if os.path.isdir(
            f"{{out}}/last") else None)
        shutil.copy(f"{{out}}/results.json", logs)
    open(f"{{logs}}/seen_rank{{rank}}.json", "w").write(json.dumps({{**seen, "signals": received}} if relay else seen))
    if seen["exit"] == "traceback":  # this process ends, and torchrun stops the other: none waits for a process
        os._exit(1)  # that is gone (a group left behind can hold the other one's exit for ever)
if relay:
    sys.exit(seen["exit"])
'''


def recording_dev_measures(real_dev_measures, out):
    """The dev gate, saving first the parameters it evaluates to out/params_rank<rank>.pt (the last gate's file
    is what remains: the parameters after the last step)."""
    from plumbing import distributed

    def dev_measures(modules, encode, dev_set):
        state = {f"{i}.{k}": v.detach().clone() for i, m in enumerate(modules) for k, v in m.state_dict().items()}
        torch.save(state, Path(out) / f"params_rank{distributed.rank()}.pt")
        return real_dev_measures(modules, encode, dev_set)
    return dev_measures


METHOD_FLAGS = {
    # the host syncs of steps 2 and 3 counted under DDP too (plumbing/syncs.py)
    "simcse": ["--count_host_syncs", "2"], "simcsepp": [], "sscl": ["--neg_layers", "1"],
    # each process whitens its own rows (the released code): the reference whitens each half of its batch
    # (16 rows a covariance: with 4, float32's rounding of a 2 x 2 whitening sets the two runs apart)
    "whitenedcse": ["--num_groups", "16", "--batch_size", "32"], "whitenedcse-global": ["--num_groups", "16", "--global_whitening"],
    "micse": ["--momentum_dropout", "0", "--queue_size", "12"],  # AMI over the global batch's maps too
    # hard negatives, and a second DDP pass a step with the MLM head in DDP's buckets (weight 0: each process
    # masks its own rows from its own generator, so the MLM term is not the one-process term); avg pooling: the
    # random tiny BERT's [CLS] is nearly one vector for all sentences, whose chance-level gradient is float noise
    "simcse-sup-mlm": ["--supervised", "--pooler", "avg", "--do_mlm", "--mlm_weight", "0"],
    # bf16 (--precision auto on a GPU): each process rounds its own rows' activations, so the gradients differ from
    # one process's in bf16's last bits (BF16_ATOL)
    "simcse-bf16": ["--precision", "bf16"],
    # GradCache under DDP (#53): parts of 3 and 1 of each process's 4 rows, DDP's no_sync but for the last part,
    # recomputed layers; the global whitening's head is in the loss (its gradient joins the synced backward); on the
    # well-conditioned model (WELL_CONDITIONED): on the default one the parts' and DDP's fp32 sums differ by 1e-5 of
    # the gradient norm on an AMD CPU, since its [CLS] embeddings nearly coincide
    "simcse-micro": ["--micro_batch_size", "3", "--gradient_checkpointing", "--count_host_syncs", "2"],
    "whitenedcse-global-micro": ["--num_groups", "16", "--global_whitening", "--micro_batch_size", "2"],
}
# Adam moves a parameter by about lr a step whatever the gradient's size: a gradient whose bf16 rounding differs
# can at most reverse a step, 2 lr, in each of the 4 steps (measured on gloo: 8.8e-5; lr 3e-5: 2.4e-4)
BF16_ATOL = 2 * 4 * 3e-5
DEVICE = os.environ.get("SUITE_DISTRIBUTED_DEVICE", "cpu")  # cuda: NCCL on 2 GPUs (tests/test_cuda.py)
# Where Adam turns float-noise-sized gradients into lr-sized steps: the per-process whitening's 2 x 2 covariances
# differ in the last bits between the runs, so a parameter whose gradient is near 0 may step the other way, and the
# parameters after 4 steps can only agree to Adam's step size (a test that could not fail). Step 1's loss and
# gradient norm carry the proof there: a whitening with the global statistics misses step 1's loss by 25%.
ADAM_NOISE = {"whitenedcse"}
# DDP forward passes a step (SimCSE++'s dropout-off pass; GradCache: each part twice)
PASSES = {"simcsepp": 2, "simcse-sup-mlm": 2, "simcse-micro": 4, "whitenedcse-global-micro": 4}


WELL_CONDITIONED = {"simcse-micro"}  # cases run on weights of std 0.2 (test_memory.py's well_conditioned_model)


@pytest.fixture(scope="module")
def no_dropout_model(tmp_path_factory):
    """A model without dropout, trained with --dropout 0 (a run gives a model without any dropout SimCSE's 0.1)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny_no_dropout"), dropout=0.0)


@pytest.fixture(scope="module")
def well_conditioned_no_dropout_model(tmp_path_factory):
    """The same with weights of std 0.2: its sentences' embeddings spread, so fp32's rounding stays small."""
    return write_tiny_model(tmp_path_factory.mktemp("well_conditioned_no_dropout"), dropout=0.0,
                            initializer_range=0.2)


def run_in_this_process(script, args, out, monkeypatch):
    """The one-process reference: the method's main() here, behind the same recording dev gate as DRIVER's."""
    import importlib
    from plumbing import run
    out.mkdir(parents=True)
    monkeypatch.setattr(run, "dev_measures", recording_dev_measures(run.dev_measures, out))
    importlib.import_module(script).main([*map(str, args), "--output_dir", str(out), "--overwrite_output_dir"])
    return out


def launch(runs, workdir):
    """DRIVER under torchrun with two processes, once for several runs ([(script, args, out), ...]): the
    interpreters' start and imports (most of a tiny run's time) paid once. Each run's output folder gets what its
    processes printed (stdout_rank<r>.txt, stderr_rank<r>.txt) and saw (seen_rank<r>.json: the DDP passes, the stop
    flag's exchanges, the exit status or "traceback"). A part of a run that is stopped and resumed is (script, args,
    out, logs, signals): args with --resume but for the first part, the files above in `logs` (with process 0's
    results.json, the folder's state and last/'s files as the part left them), and `signals` {rank: {step: "SIGTERM"}}
    sent to that process alone during that step. A run given as (script, args, out, {"timeout": T, "sleep": S}) has its
    process group's timeout T s from the training's last exchange on, and process 0's final evaluation S s longer. The
    last run may be (script, args, out, out, signals, {"relay": True}): process 0's trackers finish once a second
    signal has come, and each process exits with that run's status."""
    workdir.mkdir(parents=True, exist_ok=True)
    driver = workdir / "driver.py"
    driver.write_text(DRIVER.format(root=str(ROOT), tests=str(ROOT / "tests")))
    entries = []
    for script, args, out, *part in runs:
        slow = part.pop() if part and isinstance(part[-1], dict) and {"sleep", "relay"} & set(part[-1]) else None
        logs, signals = part or (out, {})
        logs.mkdir(parents=True)  # each run's or part's own
        out.mkdir(exist_ok=True)  # a run's parts share it
        fresh = [] if "--resume" in args else ["--overwrite_output_dir"]
        entries.append([script, str(out), [*map(str, args), "--output_dir", str(out), *fresh], str(logs), signals,
                        slow])
    (workdir / "runs.json").write_text(json.dumps(entries))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    return subprocess.run([*launcher, str(driver), str(workdir / "runs.json")], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=900)


def case_args(case, no_dropout_model, well_conditioned_no_dropout_model, corpus, senteval_dir, nli):
    data = nli if "--supervised" in METHOD_FLAGS[case] else corpus
    model = well_conditioned_no_dropout_model if case in WELL_CONDITIONED else no_dropout_model
    args = smoke_args(model, data, senteval_dir, "unused")[:-4]  # without --output_dir and --device
    return args + ["--dropout", 0, "--device", DEVICE, "--max_steps", 4, "--eval_steps", 2, "--batch_size", 8,
                   "--no_test_eval", "--logging_steps", 2, "--precision", "fp32", *METHOD_FLAGS[case]]  # last wins


STOPS = [{1: {1: "SIGINT"}, 0: {2: "SIGTERM"}},  # both, at different steps: the stop after step 2
         {0: {3: "SIGTERM"}},  # process 0 alone: after step 4
         {1: {6: "SIGTERM"}},  # process 1 alone, in the last step: no step after it; the final evaluation stops
         {}]  # the evaluation alone


@pytest.fixture(scope="module")
def two_processes(tiny_model, no_dropout_model, well_conditioned_no_dropout_model, corpus, senteval_dir,
                  tmp_path_factory):
    """Every case of METHOD_FLAGS, a global batch of 7, a run of 6 steps straight and in the parts of STOPS, and a
    final evaluation longer than the group's timeout, under one torchrun launch: {case: output folder}, "launch": the
    launcher's CompletedProcess."""
    workdir = tmp_path_factory.mktemp("two_processes")
    nli = write_nli(workdir / "nli.csv")
    runs = [(case.split("-")[0], case_args(case, no_dropout_model, well_conditioned_no_dropout_model, corpus,
                                           senteval_dir, nli), workdir / case) for case in METHOD_FLAGS]
    indivisible = smoke_args(no_dropout_model, corpus, senteval_dir, "unused")[:-4] + ["--device", "cpu",
                                                                                         "--batch_size", 7]
    runs.append(("simcse", indivisible, workdir / "indivisible"))
    six = smoke_args(tiny_model, corpus, senteval_dir, "unused")[:-4] + ["--device", "cpu", "--max_steps", 6,
                                                                        "--no_test_eval", "--no_align_uniform"]
    runs.append(("simcse", six, workdir / "straight"))
    runs += [("simcse", six + (["--resume"] if i else []), workdir / "stopped", workdir / f"part{i}", signals)
             for i, signals in enumerate(STOPS)]
    two = smoke_args(no_dropout_model, corpus, senteval_dir, "unused")[:-4] + ["--device", "cpu", "--max_steps", 2]
    runs.append(("simcse", two, workdir / "slow_final_evaluation", {"timeout": 8, "sleep": 14}))
    relayed = two + ["--max_steps", 4, "--logging_steps", 1, "--report_to", "tensorboard"]  # the last
    runs.append(("simcse", relayed, workdir / "relayed", workdir / "relayed", {0: {2: "SIGTERM"}, 1: {2: "SIGTERM"}},
                 {"relay": True}))
    proc = launch(runs, workdir)
    return {"launch": proc, "launch_dir": workdir, "runs": len(runs), **{run[2].name: run[2] for run in runs}}


def launch_ended(two_processes) -> bool:
    """Every run of the launch ended on both processes without a traceback (torchrun's own status is 1: the last
    run's processes exit 143)."""
    ends = [json.loads(p.read_text())["exit"] for p in two_processes["launch_dir"].rglob("seen_rank*.json")]
    return len(ends) == 2 * two_processes["runs"] and "traceback" not in ends


def launch_failure(two_processes) -> str:
    """Why the launch failed: the stderr of the run whose traceback ended it (DRIVER stops there), else torchrun's."""
    for seen in sorted(two_processes["launch_dir"].rglob("seen_rank*.json")):
        if json.loads(seen.read_text())["exit"] == "traceback":
            return f"{seen.parent.name}: " + (seen.parent / f"stderr_{seen.stem[5:]}.txt").read_text()[-3000:]
    return two_processes["launch"].stderr[-3000:]


def two_process_run(two_processes, case) -> Path:
    """The case's output folder, once both its processes ended it without a traceback."""
    launched, out = two_processes["launch"], two_processes[case]
    assert launch_ended(two_processes), launch_failure(two_processes)
    for rank in (0, 1):
        seen = json.loads((out / f"seen_rank{rank}.json").read_text())
        assert seen["exit"] == 0, (out / f"stderr_rank{rank}.txt").read_text()[-3000:]
    return out


@pytest.mark.parametrize("case", list(METHOD_FLAGS))
def test_two_processes_train_like_one(case, two_processes, no_dropout_model, well_conditioned_no_dropout_model,
                                     corpus, senteval_dir, tmp_path, monkeypatch):
    script = case.split("-")[0]
    args = case_args(case, no_dropout_model, well_conditioned_no_dropout_model, corpus, senteval_dir,
                     write_nli(tmp_path / "nli.csv"))
    if case == "whitenedcse":
        import whitenedcse
        whiten = whitenedcse.shuffled_group_whitening
        monkeypatch.setattr(whitenedcse, "shuffled_group_whitening", lambda x, *rest: torch.cat(
            [whiten(half, *rest) for half in x.split(len(x) // 2)]))  # the processes' slices: 16 + 16 rows
    one_out = run_in_this_process(script, args, tmp_path / "one", monkeypatch)
    two_out = two_process_run(two_processes, case)
    single, rank0, rank1 = (torch.load(p) for p in (one_out / "params_rank0.pt", two_out / "params_rank0.pt",
                                                    two_out / "params_rank1.pt"))
    assert single.keys() == rank0.keys() == rank1.keys()
    for name in single:
        torch.testing.assert_close(rank0[name], rank1[name], atol=0, rtol=0)  # the processes never drift apart
        if case.endswith("bf16"):
            torch.testing.assert_close(rank0[name], single[name], atol=BF16_ATOL, rtol=0, msg=name)
        elif name.endswith("attention.self.key.bias"):  # no gradient in exact arithmetic (the softmax over the keys
            # ignores what a bias adds to every key of a query), so its float noise, which Adam turns into steps of lr
            torch.testing.assert_close(rank0[name], single[name], atol=BF16_ATOL, rtol=0, msg=name)
        elif case not in ADAM_NOISE:
            torch.testing.assert_close(rank0[name], single[name], atol=1e-5, rtol=1e-5, msg=name)
    r1, r2 = (json.loads((o / "results.json").read_text()) for o in (one_out, two_out))
    assert r2["world_size"] == 2 and r1["world_size"] == 1
    assert r1["steps"] == r2["steps"] == 4
    assert [s for s, _ in gates(r1)] == [s for s, _ in gates(r2)] == [0, 2, 4]
    # step 1, from the same parameters: the loss, and the norm of the averaged gradient (a sum instead of an
    # average would double it; Adam would not tell)
    half = case.endswith("bf16")  # bf16's 8 bits of mantissa: 4e-3 relative
    assert r1["train_loss"][0] == pytest.approx(r2["train_loss"][0], rel=1e-2 if half else 1e-5, abs=1e-6)
    assert r1["grad_norm"][0] == pytest.approx(r2["grad_norm"][0], rel=1e-2 if half else 1e-5)
    assert r1["train_loss"] == pytest.approx(r2["train_loss"], rel=1e-2 if half else 1e-3 if case in ADAM_NOISE
                                             else 1e-5, abs=1e-6)
    # DistributedDataParallel ran every training pass; the processes exchanged the stop once after each of the 5
    # steps (0 to 4), without waiting for it (a signal stops them all at the next step), and once at the end (settle)
    for rank in (0, 1):
        seen = json.loads((two_out / f"seen_rank{rank}.json").read_text())
        assert seen == {"ddp_forwards": 4 * PASSES.get(case, 1), "stop_flag_exchanges": 6, "exit": 0}, seen
    # written once, by process 0: one results.json, one checkpoint, one "wrote" line
    assert sorted(p.name for p in two_out.iterdir() if not p.name.startswith(("params", "seen", "std"))) == \
        ["best", "results.json", "started.json"]
    if "--count_host_syncs" in METHOD_FLAGS[case]:  # DDP's bucket rebuild is in step 1, which is not counted
        assert r2["host_syncs"]["per_step"] == r1["host_syncs"]["per_step"] == [0, 0], r2["host_syncs"]
    printed = [(two_out / f"stdout_rank{rank}.txt").read_text() for rank in (0, 1)]
    assert printed[0].count("wrote ") == 1 and "wrote " not in printed[1]


def test_global_batch_must_divide_over_the_processes(two_processes):
    out = two_processes["indivisible"]
    for rank in (0, 1):
        assert json.loads((out / f"seen_rank{rank}.json").read_text())["exit"] == 2
    assert "--batch_size 7 must be divisible by the 2 processes" in (out / "stderr_rank0.txt").read_text()
    assert not (out / "results.json").exists()


def test_a_signal_to_any_process_stops_every_process_and_the_resumes_end_as_the_straight_run(two_processes):
    """One run of 6 steps stopped three times (STOPS), each time by a signal to one process or to both at different
    steps, then resumed, in the launch of the straight two-process run. Each stop: both processes exit 143 (Ctrl-C to
    one and SIGTERM to the other: the largest, SIGTERM), results.json says interrupted with the stop, last/ stays whole
    and the folder is resumable (or, stopped in the last step, its final evaluation is owed), and each process prints
    one line: its own signal's, or the other's. The last resume ends with the straight run's losses, gradient norms,
    dev curve, best/ and parameters, bit for bit. Where only the signalled process recorded the stop, process 0 wrote
    a completed run (interrupted false, no test scores), deleted last/ and exited 0."""
    launched, out, parts = two_processes["launch"], two_processes["stopped"], two_processes["stopped"].parent
    assert launch_ended(two_processes), launch_failure(two_processes)

    def seen(i, rank):
        return json.loads((parts / f"part{i}" / f"seen_rank{rank}.json").read_text())

    def printed(i, rank):
        return (parts / f"part{i}" / f"stdout_rank{rank}.txt").read_text().strip().splitlines()
    for i, (step, during) in enumerate([(2, "training"), (4, "training"), (6, "final evaluation")]):
        assert [seen(i, rank)["exit"] for rank in (0, 1)] == [143, 143], (parts / f"part{i}" /
                                                                           "stderr_rank1.txt").read_text()[-2000:]
        record = json.loads((parts / f"part{i}" / "results.json").read_text())
        assert record["interrupted"] is True and record["interrupted_during"] == during, (i, record["interrupted"])
        assert record["stop"] == {"by": "SIGTERM", "step": step} and record["steps"] == step, record["stop"]
        assert seen(i, 0)["state"] == ("resumable" if during == "training" else "evaluating")
        assert seen(i, 0)["last"] == ["rng_rank0.pt", "rng_rank1.pt", "run.json", "state.pt"], seen(i, 0)
    other = "signal SIGTERM to another process: this one stops with it"
    assert printed(0, 1) == ["signal SIGINT: stopping at the end of this step"]
    assert printed(1, 1) == [other] and "signal SIGTERM: stopping at the end of this step" in printed(1, 0)
    assert printed(1, 0)[-1].startswith("stopped after step 4 of 6 (last/ holds it)"), printed(1, 0)
    assert printed(2, 1) == ["signal SIGTERM: stopping at the end of this step"] and other in printed(2, 0)
    assert printed(2, 0)[-1].startswith("stopped during the final evaluation"), printed(2, 0)
    assert [seen(3, rank)["exit"] for rank in (0, 1)] == [0, 0]
    got, want = (json.loads((o / "results.json").read_text()) for o in (out, two_processes["straight"]))
    assert got["interrupted"] is False and got["resumptions"] == [2, 4, 6] and got["world_size"] == 2
    for key in ("train_loss", "grad_norm", "best_step", "best_dev_stsb"):
        assert got[key] == want[key], key  # floats compared exactly
    assert gates(got) == gates(want)
    for name in ("best/model.safetensors", "params_rank0.pt", "params_rank1.pt"):  # the last gate's: step 6's
        a, b = (load_file(o / name) if name.endswith("safetensors") else torch.load(o / name)
                for o in (out, two_processes["straight"]))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_a_final_evaluation_longer_than_the_group_timeout_ends_well(two_processes):
    """NCCL's default timeout is 10 minutes and a BERT-base transfer evaluation is longer: the other processes must
    not wait in a barrier for process 0's final evaluation. Here the timeout is 8 s from the training's last exchange
    on (the stop's settle) and the evaluation 14 s (the last run of the launch). Broken on purpose (the group torn
    down after the evaluation), it fails."""
    out = two_process_run(two_processes, "slow_final_evaluation")
    results = json.loads((out / "results.json").read_text())
    assert results["world_size"] == 2 and results["steps"] == 2 and "test" in results


def test_a_process_finishing_its_record_absorbs_the_sigterm_torchrun_sends_when_another_exits(two_processes):
    """SIGTERM to both processes in step 2 (Slurm's, or torchrun's own relayed): both stop after step 3; process 1,
    with nothing to write, exits 143 at once, and torchrun sends SIGTERM to process 0 while it finishes its record
    (its trackers' finish made slow on purpose: until that second signal has come, under torchrun's 30 s before its
    SIGKILL). Process 0 absorbs it, one line, writes results.json, last/ and TensorBoard's events whole, and exits 143.
    Fails where a second signal while finishing raises KeyboardInterrupt (exit 130, the trackers unfinished): the
    handler was Python's default by then."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    launched, out = two_processes["launch"], two_processes["relayed"]
    assert launch_ended(two_processes), launch_failure(two_processes)
    assert launched.returncode == 1 and "exitcode  : 143" in launched.stderr, launched.stderr[-3000:]
    ranks = [json.loads((out / f"seen_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [seen["exit"] for seen in ranks] == [143, 143] and ranks[0]["signals"] == [15, 15], ranks
    printed = (out / "stdout_rank0.txt").read_text().strip().splitlines()
    assert printed.count("signal SIGTERM: stopping at the end of this step") == 1, printed
    assert "signal SIGTERM while writing results.json: finishing that first" in printed, printed
    assert printed[-1].startswith("stopped after step 3 of 4 (last/ holds it)"), printed
    results = json.loads((out / "results.json").read_text())
    assert results["stop"] == {"by": "SIGTERM", "step": 3} and "tracking_unfinished" not in results
    events = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0}).Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
