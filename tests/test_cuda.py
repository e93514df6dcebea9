"""What only a GPU can show, skipped without CUDA: every script and ablation flag in bf16 and fp16 with fp32 losses,
no host sync in a step (the dispatch-mode counter, and torch's own check set to "error"), fused AdamW, --compile
with inductor and no recompiles after warm-up, DDP under NCCL (2 GPUs) and torchrun's one process under NCCL, resume
with and without --deterministic, a checkpoint trained on CUDA evaluated on CPU, the memory estimate against the GPU's
own peak, and --cuda_graph's replayed step against the eager one (tests/test_graph.py: its CPU side).

Its logic runs on CPU too, where that is honest: the tables' scripts import (tests/test_syncs.py), the counter and
its CUDA window with torch.cuda's debug mode faked (test_syncs.py), the same runs with --precision bf16 and fp16
(test_precision.py: torch runs both on a CPU, fp16 with its GradScaler), DDP on gloo in fp32 and bf16 with the sync
count (test_distributed.py), --compile with dynamo's eager backend (test_precision.py), the evaluation tolerance in
fp32 against fp64 (test_eval_sts.py).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import common
from plumbing import options, syncs
from conftest import DEVICE_SCORE_TOLERANCE, ROOT, SPREAD_FLAGS, smoke_args, watch_widths_and_graphs, write_nli
from test_precision import FLAGS, INPUTS, LOSSES, recording
from test_syncs import RUNS, module_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run_on_cuda(run, tiny_model, corpus, senteval_dir, out, *extra, flags=None):
    """`run` (a key of test_precision.LOSSES or test_syncs.RUNS) trained on cuda for 4 steps, eagerly (the graph's
    own tests below run each method captured; a spy that reads a value would fail a capture); its results.json."""
    flags = FLAGS.get(run, []) if flags is None else flags
    data = write_nli(out.parent / f"{out.name}-nli.csv") if "--supervised" in flags or run == "simcse_sup" \
        else corpus
    graph = ["--no_cuda_graph"] if module_of(run).__name__ in options.GRAPHED_METHODS else []  # not the ablations
    args = smoke_args(tiny_model, data, senteval_dir, out, "--device", "cuda", "--no_test_eval", *graph, *flags,
                      *extra)
    module_of(run).main([str(a) for a in args])
    return json.loads((out / "results.json").read_text())


def test_auto_precision_is_bf16_on_a_bf16_gpu_and_fp16_otherwise():
    expected = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    assert options.resolve_precision("auto", torch.device("cuda")) == expected


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("run", list(LOSSES))
def test_losses_are_fp32_outside_autocast_on_cuda(run, precision, tiny_model, corpus, senteval_dir, tmp_path,
                                                  monkeypatch):
    """Expected: every loss gets fp32 tensors with autocast off (--do_mlm's scores in the autocast dtype, cast to
    fp32 inside) and equals its fp32 recomputation; fp16's GradScaler keeps the losses finite."""
    import importlib
    if precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no bf16")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    calls = {name: [] for _, name in LOSSES[run]}
    for owner, name in LOSSES[run]:
        owner = importlib.import_module(owner) if isinstance(owner, str) else owner
        monkeypatch.setattr(owner, name, recording(getattr(owner, name), calls[name], "cuda"))
    results = run_on_cuda(run, tiny_model, corpus, senteval_dir, tmp_path / "run", "--precision", precision)
    assert results["precision"] == precision and results["steps"] == 4
    assert all(v == v for v in results["train_loss"])
    assert results["peak_memory_kind"] == "cuda_max_allocated" and results["peak_memory_reserved_mb"] > 0
    for name, seen in calls.items():
        expected = {dtype} if name in INPUTS else {torch.float32}
        assert seen and all(c["dtypes"] == expected and not c["autocast"] and c["equal"] and
                            c["out_dtype"] == torch.float32 for c in seen), name


@pytest.mark.parametrize("run", list(RUNS))
def test_no_host_sync_inside_a_training_step_on_cuda(run, tiny_model, corpus, senteval_dir, tmp_path, monkeypatch):
    """Expected: the counter's count on CUDA equals the CPU count (0; WhitenedCSE's eigh once a whitened view), and
    torch's own sync check agrees: set to "error" inside the steps, any sync raises; where eigh is allowed it is
    set to "warn" and warns once per eigh."""
    flags, allowed = RUNS[run]
    monkeypatch.setattr(syncs, "CUDA_DEBUG", "warn" if allowed else "error")
    results = run_on_cuda(run, tiny_model, corpus, senteval_dir, tmp_path / "run", "--max_steps", 5,
                          "--eval_steps", 5, "--count_host_syncs", 3, "--precision", "bf16"
                          if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16", flags=flags)
    counted = results["host_syncs"]
    assert counted["device"] == "cuda" and counted["per_step"] == [allowed] * 3, counted
    assert counted["cuda_sync_warnings_per_step"] == [allowed] * 3, counted


def test_adamw_is_fused_on_cuda():
    import types
    param = torch.nn.Parameter(torch.zeros(4, device="cuda"))
    optimizer, _ = common.make_optimizer([param], types.SimpleNamespace(lr=1e-3, warmup_steps=0), total_steps=2)
    assert optimizer.defaults["fused"] is True


def test_compile_with_inductor_recompiles_nothing_after_warm_up(tiny_model, corpus, senteval_dir, tmp_path,
                                                                monkeypatch):
    """Expected: batches padded to multiples of 8; once two widths have been seen (the second graph has a dynamic
    length) dynamo compiles nothing more."""
    widths, graphs = watch_widths_and_graphs(monkeypatch)
    results = run_on_cuda("simcse", tiny_model, corpus, senteval_dir, tmp_path / "run", "--compile", "--max_steps",
                          12, "--eval_steps", 12, "--batch_size", 2)
    assert results["steps"] == 12 and all(v == v for v in results["train_loss"])
    assert all(w % 8 == 0 for w in widths) and len(set(widths)) >= 2, widths
    warm = next(i for i in range(len(widths)) if len(set(widths[:i + 1])) == 2)
    assert set(graphs[warm:]) == {graphs[warm]}, (widths, graphs)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DDP under NCCL needs 2 GPUs")
def test_two_gpus_under_nccl_train_like_one(tmp_path):
    """Expected: test_distributed.py's equivalence (in fp32 the parameters to 1e-5 and the same losses, in bf16 to
    BF16_ATOL, measured on gloo; DDP for every pass; 0 host syncs in steps 2 and 3 under DDP), with NCCL on 2 GPUs:
    run by that file's own test with the device switched to cuda."""
    env = dict(os.environ, SUITE_DISTRIBUTED_DEVICE="cuda")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", str(ROOT / "tests" / "test_distributed.py"),
                           "-k", "train_like_one"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:]


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("script", ["simcse", "micse"])
def test_resume_on_cuda(script, deterministic, tiny_model, corpus, senteval_dir, tmp_path, monkeypatch):
    """Expected: with --deterministic a run stopped at step 2 and resumed ends bit-identical to the straight run
    (SimCSE: SDPA's backward; miCSE: AMI's generator and the queue on the device); without it, SDPA's backward and
    atomic adds may order their sums differently, so the losses agree to 1e-3."""
    import test_resume
    extra = ["--deterministic", "--no_cuda_graph"] if deterministic else ["--no_cuda_graph"]  # the graph: below
    argv = [str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "straight", "--device", "cuda",
                                       "--max_steps", 6, "--no_test_eval", "--lr", 1e-3, *extra)]
    resumed_argv = [str(tmp_path / "resumed") if a == str(tmp_path / "straight") else a for a in argv]
    try:
        test_resume.run(script, argv, monkeypatch)
        test_resume.run(script, resumed_argv, monkeypatch, stop_at=2)
        test_resume.run(script, resumed_argv + ["--resume"], monkeypatch)
    finally:
        torch.use_deterministic_algorithms(False)
    straight, resumed = (json.loads((tmp_path / name / "results.json").read_text())
                         for name in ("straight", "resumed"))
    assert resumed["resumptions"] == [2]
    if deterministic:
        assert resumed["train_loss"] == straight["train_loss"] and resumed["grad_norm"] == straight["grad_norm"]
    else:
        assert resumed["train_loss"] == pytest.approx(straight["train_loss"], rel=1e-3)


def test_a_checkpoint_trained_on_cuda_evaluates_the_same_on_cpu(tiny_model, corpus, senteval_dir, tmp_path):
    """Expected: best/ loads on the CPU, and its STS test scores there equal the CUDA run's to
    DEVICE_SCORE_TOLERANCE (two-decimal Spearman scores of embeddings that differ in the last float bits), on a
    checkpoint whose cosines spread (SPREAD_FLAGS; tests/test_eval_sts.py holds fp32 against fp64 to it on CPU)."""
    import eval_sts
    results = run_on_cuda("simcse", tiny_model, corpus, senteval_dir, tmp_path / "run", *SPREAD_FLAGS)
    gpu = eval_sts.evaluate(eval_sts.load_encode(str(tmp_path / "run" / "best"), results["eval_pooler"], "cuda"),
                            senteval_dir)
    cpu = eval_sts.evaluate(eval_sts.load_encode(str(tmp_path / "run" / "best"), results["eval_pooler"], "cpu"),
                            senteval_dir)
    assert gpu.keys() == cpu.keys() and all(abs(gpu[k] - cpu[k]) <= DEVICE_SCORE_TOLERANCE for k in gpu), (gpu, cpu)


# The estimate of plumbing/memory.py against the GPU's own count (#53): the same step of the estimate's model, on a
# BERT-base-sized encoder, in each precision and with each flag. Tolerance: 15%, what the allocator's rounding and
# the kernels' workspaces may add (on CPU the trace matches the allocator's events to 6%: tests/test_memory.py).
CUDA_ESTIMATED = {"simcse-fp16": ("simcse", {"precision": "fp16"}),
                  "simcse-sup-bf16": ("simcse", {"supervised": True, "precision": "bf16", "batch_size": 128}),
                  "micse-fp32": ("micse", {"queue_size": 256}),
                  "simcsepp-bf16-both": ("simcsepp", {"precision": "bf16", "gradient_checkpointing": True,
                                                      "micro_batch_size": 16})}


@pytest.mark.parametrize("case", list(CUDA_ESTIMATED))
def test_the_memory_estimate_is_the_gpus_peak(case, monkeypatch):
    import types
    import transformers
    from plumbing import memory
    method, extra = CUDA_ESTIMATED[case]
    args = types.SimpleNamespace(**{"method": method, "batch_size": 64, "max_seq_length": 32, "precision": "fp32",
                                    "pooler": "cls", "dropout": None, **extra})
    config = transformers.BertConfig()
    found = memory.estimate(args, config, evaluations=False)
    precision = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    with torch.device("cuda"):  # the suite's own step on real CUDA tensors, under CUDA's own autocast
        run = memory.recipe(args, config)
    monkeypatch.setattr(memory, "autocast_of", lambda name: torch.autocast(  # the real thing, not the emulation
        "cuda", dtype=precision or torch.float16, enabled=precision is not None))
    run.step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    run.step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() + run.copies  # the best model's copy, which the step does not hold
    estimated = found["step"]
    print(f"{case}: estimated {estimated / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB")
    assert abs(estimated - measured) <= 0.15 * measured, (estimated, measured)



GRAPH_CASES = {"simcse": ("simcse", []), "simcse-sup-mlm": ("simcse", ["--supervised", "--do_mlm"]),
               "simcse-fp16": ("simcse", ["--precision", "fp16"]), "simcsepp": ("simcsepp", ["--dcl_weight", "0.1"]),
               "sscl": ("sscl", ["--neg_layers", "1"]), "whitenedcse": ("whitenedcse", ["--num_groups", "16"]),
               "micse": ("micse", ["--queue_size", "16"])}


@pytest.fixture(scope="module")
def spread_model(tmp_path_factory):
    """The tiny BERT with weights of std 0.2: its sentences' embeddings spread, so a step's loss depends on its batch
    (the default init's [CLS] embeddings nearly coincide: any batch gives nearly log N)."""
    from conftest import write_tiny_model
    return write_tiny_model(tmp_path_factory.mktemp("spread"), initializer_range=0.2)


def graph_and_eager(case, model, corpus, senteval_dir, tmp_path, monkeypatch, *flags):
    """The case trained with --cuda_graph and with --no_cuda_graph on the same padded batches: their results and
    the graph's replays."""
    import importlib
    replays = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replays.append(1) or replay(self))
    script, method_flags = GRAPH_CASES[case]
    data = write_nli(tmp_path / "nli.csv", n=30) if "--supervised" in method_flags else corpus
    runs = {}
    for mode in ("--no_cuda_graph", "--cuda_graph"):
        args = smoke_args(model, data, senteval_dir, tmp_path / mode, "--device", "cuda", "--no_test_eval",
                          "--no_align_uniform", "--pad_to_max_length", "--logging_steps", 1, *method_flags, *flags,
                          mode)
        importlib.import_module(script).main([str(a) for a in args])
        runs[mode] = json.loads((tmp_path / mode / "results.json").read_text())
    return runs["--no_cuda_graph"], runs["--cuda_graph"], len(replays)


@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_each_methods_graph_trains_as_its_eager_step(case, spread_model, corpus, senteval_dir, tmp_path,
                                                     monkeypatch):
    """Expected: 12 steps at lr 1e-3 with dropout off (the weights move, nothing random), batch 12 (supervised: 30
    triplets, a short batch each epoch, replayed from a graph of its own): the graph's losses and gradient norms are
    the eager step's to 1e-3 (the same kernels; fp32 except fp16's row), every full batch after the warm-up a replay,
    no host sync in the counted steps. Fails where a replay trains the captured batch again (the batch not copied
    into the graph's buffers: a spread model's batches differ by percents), where the schedule's learning rate does
    not reach the graph (frozen at the capture's: the losses part as the eager lr decays), or where a replay skips
    what the step does after the optimizer's (miCSE's EMA and queue)."""
    from plumbing import graph
    flags = ["--dropout", 0, "--max_steps", 12, "--eval_steps", 12, "--batch_size", 12, "--lr", 1e-3,
             "--count_host_syncs", 8]
    flags += [] if case == "simcse-fp16" else ["--precision", "fp32"]
    flags += ["--momentum_dropout", 0] if case == "micse" else []
    eager, graphed, replays = graph_and_eager(case, spread_model, corpus, senteval_dir, tmp_path, monkeypatch,
                                              *flags)
    assert graphed["args"]["cuda_graph"] is True and eager["args"]["cuda_graph"] is False
    assert graphed["host_syncs"]["per_step"] == [0] * 8, graphed["host_syncs"]
    assert graphed["train_loss"] == pytest.approx(eager["train_loss"], rel=1e-3), (graphed, eager)
    assert graphed["grad_norm"] == pytest.approx(eager["grad_norm"], rel=1e-3)
    # supervised, 30 triplets: batches of 12, 12 and 6 an epoch, both shapes warmed up in the first 3 steps
    assert replays == 12 - graph.WARMUP, replays
    assert graphed["cuda_graphs"] == (2 if "--supervised" in GRAPH_CASES[case][1] else 1)
    losses = eager["train_loss"]
    assert max(abs(a - b) / b for a, b in zip(losses[1:], losses)) > 1e-2  # the batches' losses differ


@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_each_methods_graph_draws_fresh_randomness_at_each_replay(case, spread_model, corpus, senteval_dir,
                                                                  tmp_path, monkeypatch):
    """Expected: one batch over and over (the data's collate fixed to the first batch's rows) at lr 1e-9 (the
    weights stay): the losses change only by what the step draws, dropout's masks (and SimCSE's MLM masks,
    WhitenedCSE's shuffles, miCSE's AMI samples); the graph's replays draw anew as the eager steps do: their losses
    are not all alike. Fails where the dropout RNG, or a generator of the method's that the graph does not register,
    is frozen at the capture (each replay the same masks, the same loss)."""
    import data
    collate = data.TokenizedCorpus.collate
    first = {}
    monkeypatch.setattr(data.TokenizedCorpus, "collate", lambda self, rows: collate(self, first.setdefault(
        id(self), list(rows))))
    flags = ["--max_steps", 10, "--eval_steps", 10, "--batch_size", 12, "--lr", 1e-9, "--precision", "fp32"]
    flags += ["--queue_size", 0] if case == "micse" else []  # the queue would change the loss anyway
    eager, graphed, replays = graph_and_eager(case, spread_model, corpus, senteval_dir, tmp_path, monkeypatch,
                                              *flags)
    from plumbing import graph
    replayed = graphed["train_loss"][graph.WARMUP:]
    assert len(set(eager["train_loss"])) > 5 and len(set(replayed)) > 5, (eager["train_loss"], replayed)


def test_the_capturable_optimizer_steps_exactly_as_the_eager_one_on_cuda(tiny_model):
    import test_graph
    test_graph.test_the_capturable_optimizer_with_its_lr_a_tensor_steps_exactly_as_the_eager_one(tiny_model, "cuda")


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_cuda_graph_run_resumes(deterministic, tiny_model, corpus, senteval_dir, tmp_path, monkeypatch):
    """Expected: stopped at step 6 (after its capture) and resumed with --cuda_graph (warm-up and capture again), the
    losses are the straight graph run's within bf16's rounding; with --deterministic in fp32, bit for bit (what
    docs/cluster.md promises a requeued job; first added 2026-11-28 without a GPU to run it: docs/gpu.md)."""
    import test_resume
    exact = ["--deterministic", "--precision", "fp32"] if deterministic else []
    argv = [str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "straight", "--device", "cuda",
                                       "--max_steps", 12, "--no_test_eval", "--lr", 1e-3, "--cuda_graph", *exact)]
    resumed_argv = [str(tmp_path / "resumed") if a == str(tmp_path / "straight") else a for a in argv]
    test_resume.run("simcse", argv, monkeypatch)
    test_resume.run("simcse", resumed_argv, monkeypatch, stop_at=6)
    test_resume.run("simcse", resumed_argv + ["--resume"], monkeypatch)
    straight, resumed = (json.loads((tmp_path / name / "results.json").read_text())
                         for name in ("straight", "resumed"))
    assert resumed["resumptions"] == [6]
    if deterministic:
        assert resumed["train_loss"] == straight["train_loss"] and resumed["grad_norm"] == straight["grad_norm"]
    assert resumed["train_loss"] == pytest.approx(straight["train_loss"], rel=2e-2)


def test_torchrun_with_one_process_under_nccl_trains_as_python_does(tiny_model, corpus, senteval_dir, tmp_path):
    """Expected: `torchrun --nproc_per_node 1 simcse.py ... --device cuda` joins an NCCL group of one (and the gloo
    group for the host's values), trains, evaluates and exits 0 with world size 1; its losses are plain python's
    within the non-deterministic kernels' 1e-3 (test_resume_on_cuda's tolerance)."""
    runs = {}
    for name, launcher in (("python", [sys.executable]),
                           ("torchrun", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                         "--nproc_per_node", "1"])):
        args = smoke_args(tiny_model, corpus, senteval_dir, tmp_path / name, "--device", "cuda", "--max_steps", 6,
                          "--lr", 1e-3)
        proc = subprocess.run([*launcher, str(ROOT / "simcse.py"), *map(str, args)], capture_output=True, text=True,
                              cwd=ROOT, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = json.loads((tmp_path / name / "results.json").read_text())
    assert runs["torchrun"]["world_size"] == 1 and runs["torchrun"]["test"]
    assert runs["torchrun"]["train_loss"] == pytest.approx(runs["python"]["train_loss"], rel=1e-3)
