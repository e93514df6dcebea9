"""The papers' objective in less memory (#53): --gradient_checkpointing and --micro_batch_size (GradCache) train what
the full batch trains: one step's loss and every parameter's gradient, for each method, supervised SimCSE, --do_mlm
and SimCSE++'s DCL, in fp32 on CPU. Micro-batches draw their dropout masks one after another (as torchrun's
processes do), so --micro_batch_size is compared with dropout off; gradient checkpointing replays each layer's masks,
so it is compared with dropout on."""
import importlib
import itertools
import json

import pytest
import torch

import common
import plumbing
from conftest import cli_in_process, smoke_args, write_nli, write_tiny_model

CASES = {  # name: (script, flags)
    "simcse": ("simcse", []), "simcse-sup": ("simcse", ["--supervised"]),
    "simcse-mlm": ("simcse", ["--do_mlm"]), "simcse-sup-mlm": ("simcse", ["--supervised", "--do_mlm"]),
    "simcsepp": ("simcsepp", ["--dcl_weight", "0.1"]), "simcsepp-dcl": ("simcsepp", ["--dcl_only"]),
    "sscl": ("sscl", ["--neg_layers", "1"]), "whitenedcse": ("whitenedcse", ["--num_groups", "16"]),
    "micse": ("micse", ["--queue_size", "16"]),
}


class StepDone(BaseException):
    """Raised once the step's gradients are read: the run ends there."""


def first_step(name, flags, tiny_model, corpus, senteval_dir, tmp_path, monkeypatch, steps=1):
    """The loss and every trainable parameter's gradient of the run's first `steps` steps (each read where the loop
    clips them: after the backward, unscaled)."""
    script, method_flags = CASES[name]
    data = write_nli(tmp_path / "nli.csv", 24) if "--supervised" in method_flags else corpus
    seen, calls = [], itertools.count(1)
    real_clip, real_record = torch.nn.utils.clip_grad_norm_, None

    def clip(params, *args, **kwargs):
        params = list(params)
        seen.append({"grads": [p.grad.detach().clone() for p in params]})
        return real_clip(params, *args, **kwargs)

    from plumbing import run as run_module
    real_record = run_module.Run.record

    def record(self, loss, grad_norm):
        seen[-1]["loss"] = loss.detach().clone()
        real_record(self, loss, grad_norm)
        if next(calls) == steps:
            raise StepDone
    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
        patch.setattr(run_module.Run, "record", record)
        with pytest.raises(StepDone):
            importlib.import_module(script).main([str(a) for a in smoke_args(
                tiny_model, data, senteval_dir, tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}",
                "--lr", 1e-3, "--max_steps", 4, "--eval_steps", 4, *method_flags, *flags)])
    return seen


def assert_same_steps(got, want, rtol=1e-3, whole_vector=False):
    """Each step's loss and each parameter's gradient to `rtol` of its norm, or of the largest gradient's norm for
    one near 0 (fp32 rounding: the parts' sums are added in another order); a missing or doubled part would be off
    by its whole share."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.allclose(g["loss"], w["loss"], rtol=rtol / 1000, atol=rtol / 10000), (g["loss"], w["loss"])
        assert len(g["grads"]) == len(w["grads"])
        largest = max(b.norm() for b in w["grads"])
        if whole_vector:  # half precision: all the gradients as one vector (a small one is rounding noise)
            difference = torch.cat([(a - b).flatten() for a, b in zip(g["grads"], w["grads"])]).norm()
            assert difference <= rtol * torch.cat([b.flatten() for b in w["grads"]]).norm(), difference
            continue
        for i, (a, b) in enumerate(zip(g["grads"], w["grads"])):
            assert (a - b).norm() <= rtol * max(b.norm(), 1e-3 * largest), (i, (a - b).norm(), b.norm())


@pytest.mark.parametrize("name", list(CASES))
def test_micro_batches_train_what_the_whole_batch_trains(name, tiny_model, corpus, senteval_dir, tmp_path,
                                                         monkeypatch):
    """Dropout off: the loss and every gradient of two steps (miCSE: the second with a queue) are the whole
    batch's, with parts of 3, 3 and 2 examples (batch 8), or of 5 and 3. The learning rate is tiny, so that the
    second step starts from the same weights: AdamW's first update is lr times the gradient's sign, which a rounding
    difference flips where a gradient is near 0."""
    flags = ["--dropout", "0", "--lr", "1e-9"]
    whole = first_step(name, flags, tiny_model, corpus, senteval_dir, tmp_path, monkeypatch, steps=2)
    for size in (3, 5):
        parts = first_step(name, flags + ["--micro_batch_size", size], tiny_model, corpus, senteval_dir, tmp_path,
                           monkeypatch, steps=2)
        assert_same_steps(parts, whole)
    assert not all(torch.equal(a, b) for a, b in zip(whole[0]["grads"], whole[1]["grads"]))  # two real steps


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_checkpointing_trains_what_the_stored_activations_train(name, tiny_model, corpus, senteval_dir,
                                                                         tmp_path, monkeypatch):
    """Dropout on: the recomputation replays each layer's masks, so the loss is the same bit for bit and the
    gradients within fp32 rounding."""
    stored = first_step(name, [], tiny_model, corpus, senteval_dir, tmp_path, monkeypatch)
    recomputed = first_step(name, ["--gradient_checkpointing"], tiny_model, corpus, senteval_dir, tmp_path,
                            monkeypatch)
    assert torch.equal(recomputed[0]["loss"], stored[0]["loss"])
    assert_same_steps(recomputed, stored)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("name", ["simcse-mlm", "micse"])
def test_both_flags_in_half_precision(name, precision, tiny_model, corpus, senteval_dir, tmp_path, monkeypatch):
    """fp16 with its GradScaler, and bf16: the step with both flags is the step without them to half precision's
    rounding (the parts' matmuls round on their own), the gradients unscaled before they are read and finite, and
    the scale where it was (no step skipped)."""
    from plumbing import run as run_module
    flags = ["--dropout", "0", "--lr", "1e-9", "--precision", precision]
    scales = []
    real_step = torch.amp.GradScaler.step
    monkeypatch.setattr(torch.amp.GradScaler, "step", lambda self, *a, **k: scales.append(
        self.get_scale() if self.is_enabled() else None) or real_step(self, *a, **k))
    whole = first_step(name, flags, tiny_model, corpus, senteval_dir, tmp_path, monkeypatch, steps=2)
    both = first_step(name, flags + ["--micro_batch_size", 3, "--gradient_checkpointing"], tiny_model, corpus,
                      senteval_dir, tmp_path, monkeypatch, steps=2)
    assert all(torch.isfinite(g).all() for step in both for g in step["grads"])
    assert_same_steps(both, whole, rtol=3e-2 if precision == "bf16" else 3e-3, whole_vector=True)
    assert scales == ([65536.0] * 4 if precision == "fp16" else [None] * 4)


# ------------------------------------------------------------------------------------------ the estimate
SMALL = dict(vocab_size=1000, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512,
             max_position_embeddings=64)
ESTIMATED = {  # the step of plumbing/memory.py, traced and measured: every pass layout, each precision, both flags
    "simcse": ("simcse", {}), "simcse-sup-bf16": ("simcse", {"supervised": True, "precision": "bf16"}),
    "simcse-mlm-micro": ("simcse", {"do_mlm": True, "micro_batch_size": 4}),
    "simcsepp-fp16-checkpointing": ("simcsepp", {"precision": "fp16", "gradient_checkpointing": True}),
    "sscl": ("sscl", {"pooler": "avg"}), "whitenedcse": ("whitenedcse", {"num_pos": 3}),
    "micse-bf16-both": ("micse", {"queue_size": 32, "precision": "bf16", "gradient_checkpointing": True,
                                  "micro_batch_size": 8}),
}


def recipe_args(method, **extra):
    import types
    return types.SimpleNamespace(**{"method": method, "batch_size": 16, "max_seq_length": 32, "precision": "fp32",
                                    "pooler": "cls", "dropout": None, **extra})


def traced_step(args, config) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from plumbing import memory
    with FakeTensorMode(allow_non_fake_inputs=True):
        run = memory.recipe(args, config)
        run.step()
        tracker = memory.PeakTracker(run.trainable)
        with tracker:
            tracker.track(*memory.persistent(run))
            start = tracker.now
            run.step()
    return tracker.peak - start


@pytest.mark.parametrize("case", list(ESTIMATED))
def test_the_traced_peak_is_the_measured_peak_of_the_same_step(case):
    """The fake trace counts what the real step allocates, to 10% (measured: within 6%; the allocator's own
    temporaries inside kernels are what it cannot see)."""
    import transformers
    config = transformers.BertConfig(**SMALL)
    method, extra = ESTIMATED[case]
    args = recipe_args(method, **extra)
    from plumbing import memory
    torch.manual_seed(0)
    traced, measured = traced_step(args, config), memory.measured_step(args, config)
    assert measured > 1 << 20 and abs(traced - measured) <= 0.1 * measured, (traced, measured)


def test_cuda_autocast_follows_cudas_lists_and_caches_each_weights_cast():
    """What a GPU's autocast does and a CPU's does not: softmax, layer norm and sums in fp32; matmuls in half
    precision; a weight cast once a pass; mixed inputs of cat promoted."""
    from plumbing.memory import CudaAutocast
    x, weight = torch.randn(4, 8), torch.nn.Parameter(torch.randn(8, 8))
    with CudaAutocast(torch.float16):
        y = torch.nn.functional.linear(x, weight)
        again = torch.nn.functional.linear(x, weight)
        assert y.dtype == again.dtype == torch.float16
        assert torch.softmax(y, -1).dtype == torch.float32 and y.sum().dtype == torch.float32
        assert torch.nn.functional.layer_norm(y, (8,)).dtype == torch.float32
        assert torch.cat([y, x]).dtype == torch.float32 and torch.tanh(y).dtype == torch.float16
    mode = CudaAutocast(torch.bfloat16)
    with mode:
        torch.nn.functional.linear(x, weight)
        torch.matmul(x, weight)
    assert len(mode.cache) == 1 and next(iter(mode.cache.values())).dtype == torch.bfloat16  # one cast of the weight
    with torch.autocast("cpu", dtype=torch.float16):  # a CPU's autocast, for contrast
        assert torch.softmax(torch.nn.functional.linear(x, weight), -1).dtype == torch.float16


def test_a_gpu_fused_attention_keeps_no_attention_matrix_and_eager_attention_does():
    """miCSE's eager attention keeps its n x n probabilities; SDPA on a GPU (memory-efficient or flash) does not:
    at 128 tokens the same step needs more with eager attention than with the fused kernel."""
    import transformers
    from plumbing import memory
    config = transformers.BertConfig(**SMALL)
    fused = memory.estimate(recipe_args("simcse", max_seq_length=64), config, evaluations=False)
    eager = memory.estimate(recipe_args("micse", queue_size=0, ami_lambda=0.0, max_seq_length=64), config,
                            evaluations=False)
    heads, layers = SMALL["num_attention_heads"], SMALL["num_hidden_layers"]
    probabilities = 2 * 16 * heads * 64 * 64 * 4 * layers  # two views, fp32, each layer
    assert eager["activations"] - fused["activations"] >= probabilities


def test_the_estimate_splits_the_step_and_counts_what_the_flags_save():
    import transformers
    from plumbing import memory
    config = transformers.BertConfig(**SMALL)
    plain = memory.estimate(recipe_args("simcse", batch_size=64), config)
    weights = sum(t.numel() * 4 for t in transformers.BertModel(config).state_dict().values())
    head = 128 * 128 * 4 + 128 * 4
    assert plain["weights"] == 2 * (weights + head)  # the model and the best model's copy
    assert plain["optimizer"] >= 2 * (weights + head - (128 * 128 + 128) * 4)  # AdamW's moments (not the pooler's)
    assert plain["step"] == sum(plain[k] for k in ("weights", "gradients", "optimizer", "activations"))
    assert plain["dev_gate"] > plain["weights"] and plain["final_eval"] > plain["weights"]
    checkpointed = memory.estimate(recipe_args("simcse", batch_size=64, gradient_checkpointing=True), config, 1,
                                   evaluations=False)
    parts = memory.estimate(recipe_args("simcse", batch_size=64, micro_batch_size=8), config, 1, evaluations=False)
    assert checkpointed["activations"] < 0.5 * plain["activations"] and parts["activations"] < 0.3 * plain["activations"]
    two = memory.estimate(recipe_args("simcse", batch_size=64), config, world_size=2, evaluations=False)
    assert two["activations"] < 0.6 * plain["activations"]  # torchrun: half the rows a process


def test_a_gpu_with_too_little_free_memory_is_one_line_before_training_naming_what_fits(
        tiny_model, corpus, senteval_dir, tmp_path, monkeypatch, capsys):
    """Injected: a GPU whose free memory lies between the run's estimated peak and --gradient_checkpointing's. The
    line comes before the first step, names the setting, and the run goes on."""
    import simcse
    from plumbing import memory
    big = write_tiny_model(tmp_path / "wide", hidden=256)  # activations that recomputation visibly shrinks
    argv = [str(a) for a in smoke_args(big, corpus, senteval_dir, tmp_path / "run", "--batch_size", 32,
                                       "--max_steps", 1, "--eval_steps", 1, "--no_test_eval")]
    monkeypatch.setattr(memory, "CONTEXT", 0)
    monkeypatch.setattr(memory, "FRAGMENTATION", 0.0)
    args = simcse.parse_args(argv)
    args.precision = "fp32"
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(big)
    full = memory.peak(memory.estimate(args, config))
    args.gradient_checkpointing = True
    checkpointed = memory.peak(memory.estimate(args, config))
    assert checkpointed < full
    monkeypatch.setattr(memory, "device_free", lambda device: (full + checkpointed) // 2)
    simcse.main(argv)
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("memory: "))
    assert "--gradient_checkpointing fits" in line and "Going on" in line
    assert out.index("memory: ") < out.index("step 1/1")  # before training
    assert json.loads((tmp_path / "run" / "results.json").read_text())["steps"] == 1


def test_running_out_of_gpu_memory_is_one_line(tiny_model, corpus, senteval_dir, tmp_path, monkeypatch):
    import simcse
    monkeypatch.setattr(common, "info_nce", lambda *a, **k: (_ for _ in ()).throw(
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")))
    code, err = cli_in_process(simcse, *smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "run"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--micro_batch_size" in err, err
    assert "Tried to allocate 2.00 GiB" in err


def test_the_memory_table_of_a_local_model(tiny_model, capsys):
    import memory as memory_tool
    lines = memory_tool.table(["simcse", "micse"], [], [16], model=str(tiny_model))
    assert len(lines) == 4 and lines[2].startswith("| simcse | ") and lines[3].startswith("| micse | ")
    assert all(line.endswith("| fits |") for line in lines[2:])
    assert "| 64 | fp16 |" in lines[2] and "| 50 | fp32 |" in lines[3]  # the presets, the released precision


def test_a_model_the_estimate_cannot_trace_still_trains(tiny_model, corpus, senteval_dir, tmp_path, monkeypatch,
                                                        capsys):
    import simcse
    from plumbing import memory
    monkeypatch.setattr(memory, "device_free", lambda device: 1 << 40)
    monkeypatch.setattr(memory, "estimate", lambda *a, **k: (_ for _ in ()).throw(NotImplementedError("an op")))
    simcse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "run", "--no_test_eval")])
    assert "memory: no estimate for this model (NotImplementedError); going on" in capsys.readouterr().out


def table_rows(out: str) -> tuple[list[str], list[str]]:
    """The printed memory table: (its header's column names, its rows), after checking the separator line."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| recipe |"))
    names = [cell.strip() for cell in lines[start].strip("|").split("|")]
    assert lines[start + 1] == "|" + "---|" * len(names)
    return names, [line for line in lines[start + 2:] if line.startswith("| ")]


def test_bench_memory_prints_its_header_and_takes_the_methods_flags(tiny_model, capsys):
    """`tools/bench.py --memory` (#58): the header names the columns above the rows; miCSE's few-shot preset is a
    row (batch 64, fp32); the method's own flags (--batch_size, --precision, --fraction, the memory flags) apply."""
    import bench
    base = ["--memory", "--model_name_or_path", str(tiny_model), "--gpus", "16"]
    bench.main([*base, "--recipes", "micse", "micse-fewshot"])
    names, rows = table_rows(capsys.readouterr().out)
    assert names == ["recipe", "backbone", "batch", "precision", "weights", "gradients", "optimizer", "activations",
                     "step", "dev gate", "final eval", "16 GB"]
    assert [row.split(" | ")[0] for row in rows] == ["| micse", "| micse-fewshot"]
    assert "| 50 | fp32 |" in rows[0] and "| 64 | fp32 |" in rows[1]  # 100%'s preset, then 1%'s
    bench.main([*base, "--recipes", "simcse", "--batch_size", "24", "--precision", "bf16", "--gradient_checkpointing"])
    assert f"| simcse | {tiny_model.name} | 24 | bf16 |" in table_rows(capsys.readouterr().out)[1][0]
    import memory as memory_tool
    args = memory_tool.recipe_args("micse", str(tiny_model), ["--fraction", "0.01", "--gradient_checkpointing",
                                                              "--micro_batch_size", "4", "--max_seq_length", "16"])
    assert (args.batch_size, args.fraction, args.gradient_checkpointing, args.micro_batch_size,
            args.max_seq_length) == (64, 0.01, True, 4, 16)  # what memory.estimate reads


def test_bench_memory_refuses_a_flag_no_method_has_before_any_table(tiny_model, capsys):
    import bench
    with pytest.raises(SystemExit):
        bench.main(["--memory", "--model_name_or_path", str(tiny_model), "--recipes", "simcse", "--no_such_flag"])
    captured = capsys.readouterr()
    assert "| recipe |" not in captured.out and "--no_such_flag" in captured.err
