"""The papers' objective in less memory (#53): --gradient_checkpointing and --micro_batch_size (GradCache) train what
the full batch trains: one step's loss and every parameter's gradient, for each method, supervised SimCSE, --do_mlm
and SimCSE++'s DCL, in fp32 on CPU. Micro-batches draw their dropout masks one after another (as torchrun's
processes do), so --micro_batch_size is compared with dropout off, on a well-conditioned model (fp32's rounding is
then about 1e-6 of a gradient, on AMD and Intel CPUs alike), and with dropout on where one part is the whole batch
(bit for bit, --do_mlm's own pass included); gradient checkpointing replays each layer's masks, so it is compared
with dropout on."""
import importlib
import itertools
import json

import pytest
import torch

import common
import simcse
import data
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

    def record(self, loss, grad_norm, terms=None):
        seen[-1]["loss"] = loss.detach().clone()
        real_record(self, loss, grad_norm, terms)
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


U = 2.0 ** -24  # fp32's unit roundoff (6e-8)
LONGEST_SUM, LAYERS = 64, 2  # the tiny BERT's longest reduction (its intermediate width) and its depth
# Two orders of one K-term sum differ by at most 2 K u of its terms' magnitudes (Higham's gamma_K, once each way), on
# any CPU and whatever order its kernels take; LayerNorm renormalises each layer, so the layers' changes add. The
# embeddings' relative change when the encoder's sums run in another order (padding: the attention's sums over exact
# zeros and kernels of another shape; micro-batches: other shapes, the parts' gradients added one by one):
EPS = 2 * LONGEST_SUM * LAYERS * U  # 1.5e-5


def rounding_bounds(temp: float, kappa: float = 1.0) -> tuple[float, float]:
    """How far one step's loss (absolute) and gradient (relative, the whole vector) can move when the encoder's sums
    run in another order: the loss's inputs move by kappa EPS, kappa what comes between the encoder and the loss
    amplifies (1; WhitenedCSE: its covariances' condition, whitening_condition). A cosine moves by 2 kappa EPS, a
    logit by that over temp, a cross-entropy by at most twice its logits' largest move; the gradient by the backward's
    own sums (kappa EPS again) and by the softmax's weights, which move as their logits do (4 kappa EPS / temp
    relative). The papers' temperature 0.05 gives 1.2e-3 for both (kappa 1). A real error is orders of magnitude
    outside: a mask that lets padding in moves the loss by 3e-2 to 14 times itself and the gradient by 70% to 11
    times its norm (test_a_mask_that_lets_padding_in_is_far_outside_the_bounds); a dropped or doubled row of a batch
    of 8 moves both by about 1/8."""
    eps = kappa * EPS
    return 4 * eps / temp, eps * (1 + 4 / temp)


def assert_rounding_apart(got, want, temp=0.05, kappa=1.0):
    """Each step's loss and whole gradient within rounding_bounds of `want`'s."""
    loss_atol, grad_rtol = rounding_bounds(temp, kappa)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert abs(float(g["loss"] - w["loss"])) <= loss_atol, (g["loss"], w["loss"], loss_atol)
        assert len(g["grads"]) == len(w["grads"])
        difference = torch.cat([(a - b).flatten() for a, b in zip(g["grads"], w["grads"])]).norm()
        norm = torch.cat([b.flatten() for b in w["grads"]]).norm()
        assert difference <= grad_rtol * norm, (float(difference / norm), grad_rtol)


def whitening_condition(monkeypatch) -> list:
    """WhitenedCSE's kappa: each whitening's largest condition number of a group's covariance (float64), appended as
    the run whitens. Its inverse square root moves by up to that times its covariance's relative change."""
    import whitenedcse
    conditions, whiten = [], whitenedcse.shuffled_group_whitening

    def measured(x, num_groups, perm, *rest, **kwargs):
        groups = x.detach().double()[:, perm].reshape(len(x), num_groups, -1).transpose(0, 1)
        centred = groups - groups.mean(1, keepdim=True)
        eigenvalues = torch.linalg.eigvalsh(centred.transpose(1, 2) @ centred / len(x))
        conditions.append(float((eigenvalues[:, -1] / eigenvalues[:, 0]).max()))
        return whiten(x, num_groups, perm, *rest, **kwargs)
    monkeypatch.setattr(whitenedcse, "shuffled_group_whitening", measured)
    return conditions


def assert_same_steps(got, want, rtol=1e-3, whole_vector=False):
    """Each step's loss, and its gradients to `rtol` of their norm: the gradient checkpointing's replayed layers
    (forward bit for bit, the backward's sums in another order; each parameter's gradient against its own norm or,
    where its terms cancel, 1% of the largest, rtol / 10 the whole vector), and half precision (`whole_vector`: its
    rounding of 4e-3 (bf16) or 5e-4 (fp16) a product, the whole vector only). A missing or doubled part is off by its
    whole share (a third or more)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.allclose(g["loss"], w["loss"], rtol=rtol / 256, atol=1e-7), (g["loss"], w["loss"])
        assert len(g["grads"]) == len(w["grads"])
        difference = torch.cat([(a - b).flatten() for a, b in zip(g["grads"], w["grads"])]).norm()
        norm = torch.cat([b.flatten() for b in w["grads"]]).norm()
        if whole_vector:  # half precision: all the gradients as one vector (a small one is rounding noise)
            assert difference <= rtol * norm, difference
            continue
        assert difference <= rtol / 10 * norm, (difference, norm)
        largest = max(b.norm() for b in w["grads"])
        for i, (a, b) in enumerate(zip(g["grads"], w["grads"])):
            assert (a - b).norm() <= rtol * max(b.norm(), 1e-2 * largest), (i, (a - b).norm(), b.norm())


@pytest.fixture(scope="module")
def well_conditioned_model(tmp_path_factory):
    """The tiny BERT with weights of std 0.2 instead of 0.02: its sentences' embeddings spread (cosines 0.99 apart,
    not 4e-6 as the default init's [CLS]), so the contrastive gradients are not differences of nearly equal vectors,
    whose cancellation turns fp32's rounding into 1e-3 of a gradient (and differs between AMD and Intel CPUs)."""
    return write_tiny_model(tmp_path_factory.mktemp("well_conditioned"), initializer_range=0.2)


@pytest.mark.parametrize("name", list(CASES))
def test_micro_batches_train_what_the_whole_batch_trains(name, well_conditioned_model, corpus, senteval_dir,
                                                         tmp_path, monkeypatch):
    """Dropout off: the loss and every gradient of two steps (miCSE: the second with a queue) are the whole
    batch's, with parts of 3, 3 and 2 examples (batch 8), or of 5 and 3. The learning rate is tiny, so that the
    second step starts from the same weights: AdamW's first update is lr times the gradient's sign, which a rounding
    difference flips where a gradient is near 0."""
    flags = ["--dropout", "0", "--lr", "1e-9"]
    conditions = whitening_condition(monkeypatch) if name == "whitenedcse" else [1.0]
    whole = first_step(name, flags, well_conditioned_model, corpus, senteval_dir, tmp_path, monkeypatch, steps=2)
    for size in (3, 5):
        parts = first_step(name, flags + ["--micro_batch_size", size], well_conditioned_model, corpus, senteval_dir,
                           tmp_path, monkeypatch, steps=2)
        assert_rounding_apart(parts, whole, kappa=max(conditions))
    assert not all(torch.equal(a, b) for a, b in zip(whole[0]["grads"], whole[1]["grads"]))  # two real steps


@pytest.mark.parametrize("name", [name for name in CASES if "mlm" not in name and name != "micse"])
def test_padding_every_batch_to_max_seq_length_trains_what_padding_to_its_longest_row_trains(
        name, well_conditioned_model, corpus, senteval_dir, tmp_path, monkeypatch):
    """--pad_to_max_length (one shape a step, as a CUDA graph needs) changes no loss and no gradient beyond fp32's
    rounding of sums in another order (rounding_bounds: the attention's sums run over the masked positions too, which
    add exact zeros, and every kernel has another shape), in fp32 with dropout off (the momentum encoder's too):
    dropout and --do_mlm's masking draw over the padded shape. miCSE pads every batch (AMI draws its sample over the
    maps' width: one layout eagerly and in a CUDA graph; tests/test_micse.py). WhitenedCSE: kappa its covariances'
    condition (10 to 60 here). With dropout off its views coincide and its loss is near 0 (2e-4), below its loss
    bound: its gradient carries the check."""
    flags = ["--dropout", "0", "--lr", "1e-9"]
    dynamic, padded, widths, shapes, conditions = padded_and_dynamic(name, flags, well_conditioned_model, corpus,
                                                                     senteval_dir, tmp_path, monkeypatch)
    assert max(widths) < 24 and set(shapes) == {24}, (widths, shapes)
    assert_rounding_apart(padded, dynamic, kappa=max(conditions))


def padded_and_dynamic(name, flags, model, corpus, senteval_dir, tmp_path, monkeypatch, leak=False):
    """Two steps padded to each batch's longest row, and padded to 24 tokens (`leak`: with an attention mask of
    ones, which lets the padding in): their steps, the widths of each, WhitenedCSE's covariance conditions."""
    shapes = []
    real_collate = data.TokenizedCorpus.collate
    monkeypatch.setattr(data.TokenizedCorpus, "collate", lambda self, rows: shapes.append(
        real_collate(self, rows)["input_ids"].shape[1]) or real_collate(self, rows))
    conditions = whitening_condition(monkeypatch) if name == "whitenedcse" else [1.0]
    dynamic = first_step(name, flags, model, corpus, senteval_dir, tmp_path, monkeypatch, steps=2)
    widths, shapes[:] = list(shapes), []
    if leak:
        forward = common.BackboneWithHeads.forward
        monkeypatch.setattr(common.BackboneWithHeads, "forward", lambda self, attention_mask, **inputs: forward(
            self, torch.ones_like(attention_mask), **inputs))
    padded = first_step(name, flags + ["--pad_to_max_length", "--max_seq_length", 24], model, corpus, senteval_dir,
                        tmp_path, monkeypatch, steps=2)
    return dynamic, padded, widths, shapes, conditions


@pytest.mark.parametrize("name", ["simcse-sup", "whitenedcse"])
def test_a_mask_that_lets_padding_in_is_far_outside_the_bounds(name, well_conditioned_model, corpus, senteval_dir,
                                                               tmp_path, monkeypatch):
    """The bounds can fail: padded rows whose padding is attended (a mask of ones) move the gradient by 700 times its
    bound (supervised SimCSE: the smallest loss move of the methods) and 140 times (WhitenedCSE: the loosest bound);
    asserted: 10 times."""
    dynamic, padded, _, _, conditions = padded_and_dynamic(name, ["--dropout", "0", "--lr", "1e-9"],
                                                           well_conditioned_model, corpus, senteval_dir, tmp_path,
                                                           monkeypatch, leak=True)
    _, grad_rtol = rounding_bounds(0.05, max(conditions))
    for a, b in zip(padded, dynamic):
        difference = torch.cat([(x - y).flatten() for x, y in zip(a["grads"], b["grads"])]).norm()
        assert difference > 10 * grad_rtol * torch.cat([y.flatten() for y in b["grads"]]).norm()


@pytest.mark.parametrize("name", ["simcse-mlm", "simcse-sup-mlm"])
def test_one_part_is_the_whole_batch_bit_for_bit_with_dropout_on(name, tiny_model, corpus, senteval_dir, tmp_path,
                                                                 monkeypatch):
    """--micro_batch_size K >= the batch: one part, the whole batch's passes in the whole batch's order, so three
    steps with dropout on (the MLM pass's masks drawn after the contrastive ones, the next step's after both) give
    the same losses and gradients bit for bit."""
    whole = first_step(name, [], tiny_model, corpus, senteval_dir, tmp_path, monkeypatch, steps=3)
    one_part = first_step(name, ["--micro_batch_size", 8], tiny_model, corpus, senteval_dir, tmp_path, monkeypatch,
                          steps=3)
    for a, b in zip(one_part, whole):
        assert torch.equal(a["loss"], b["loss"]) and all(map(torch.equal, a["grads"], b["grads"]))


def test_each_parts_row_loss_draws_fresh_dropout_after_the_encodings():
    """grad_cache's RNG, on a toy encoder whose 'dropout' is torch.rand: each part's replay draws what its cached
    encoding drew; the row losses (the MLM term) draw on from where the encodings ended, one part after another, as
    the whole batch's MLM pass follows its contrastive pass (not the next part's replayed masks); the next draw after
    it is the one after all of them."""
    x, w, draws = torch.randn(6, 3), torch.ones(3, requires_grad=True), []

    def encode(part):
        draws.append(("encode", part.start, torch.rand(len(x[part]))))
        return ((x[part] @ w) * draws[-1][2])[:, None],

    def row_loss(part):
        draws.append(("row", part.start, torch.rand(len(x[part]))))
        return ((x[part] @ w) * draws[-1][2]).sum()
    torch.manual_seed(0)
    common.grad_cache(encode, lambda z: z.square().sum(), 6, 2, lambda loss: loss, torch.nn.Module(), row_loss)
    after = torch.rand(1)
    torch.manual_seed(0)
    expected = [torch.rand(2) for _ in range(6)]  # the three encodings, then the three row losses
    encodings = [noise for kind, _, noise in draws if kind == "encode"]
    rows = [noise for kind, _, noise in draws if kind == "row"]
    assert all(map(torch.equal, encodings, expected[:3] * 2))  # cached, then replayed
    assert all(map(torch.equal, rows, expected[3:]))
    assert torch.equal(after, torch.rand(1))
    assert w.grad is not None


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
def test_both_flags_in_half_precision(name, precision, well_conditioned_model, corpus, senteval_dir, tmp_path,
                                      monkeypatch):
    """fp16 with its GradScaler, and bf16: the step with both flags is the step without them to half precision's
    rounding (the parts' matmuls round on their own), the gradients unscaled before they are read and finite, and
    the scale where it was (no step skipped)."""
    from plumbing import run as run_module
    flags = ["--dropout", "0", "--lr", "1e-9", "--precision", precision]
    scales = []
    real_step = torch.amp.GradScaler.step
    monkeypatch.setattr(torch.amp.GradScaler, "step", lambda self, *a, **k: scales.append(
        self.get_scale() if self.is_enabled() else None) or real_step(self, *a, **k))
    whole = first_step(name, flags, well_conditioned_model, corpus, senteval_dir, tmp_path, monkeypatch, steps=2)
    both = first_step(name, flags + ["--micro_batch_size", 3, "--gradient_checkpointing"], well_conditioned_model,
                      corpus, senteval_dir, tmp_path, monkeypatch, steps=2)
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
    monkeypatch.setattr(simcse, "info_nce", lambda *a, **k: (_ for _ in ()).throw(
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


READS_A_VALUE = "its step reads a tensor's value on the host (aten._local_scalar_dense.default), and the trace has " \
                "shapes, no values"


def reading_a_value(monkeypatch):
    """Injected: a step that reads a tensor's value on the host (as ModernBERT's initialiser did), which a trace on
    fake tensors cannot; a real step runs it."""
    embed = common.embed
    monkeypatch.setattr(common, "embed", lambda *a, **k: embed(*a, **k) + 0 * a[1].sum().item())


def test_a_model_the_estimate_cannot_trace_is_one_line_and_still_trains(tiny_model, corpus, senteval_dir, tmp_path,
                                                                        monkeypatch, capsys):
    import simcse
    from plumbing import memory
    monkeypatch.setattr(memory, "device_free", lambda device: 1 << 40)
    reading_a_value(monkeypatch)
    out = tmp_path / "run"
    simcse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--no_test_eval")])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("memory: ")]
    assert lines == [f"memory: no memory estimate is possible for {tiny_model} (bert): {READS_A_VALUE}; going on"]
    assert json.loads((out / "results.json").read_text())["steps"] == 4


def test_the_planner_on_a_model_it_cannot_trace_is_one_line(tiny_model, monkeypatch):
    import bench
    reading_a_value(monkeypatch)
    code, err = cli_in_process(bench, "--memory", "--recipes", "simcse", "--model_name_or_path", tiny_model)
    assert code == 2 and err == f"error: no memory estimate is possible for {tiny_model} (bert): {READS_A_VALUE}\n"


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
