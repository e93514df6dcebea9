"""Mixed precision on CPU (--precision bf16 and fp16, which torch runs on a CPU too): the encoder runs under autocast,
every loss gets fp32 tensors outside it and equals the same loss recomputed in fp32; WhitenedCSE's whitening is fp32
even inside an autocast block. fp16's GradScaler: the gradients unscaled before clipping, an overflow skips its step
and halves the scale, the scale travels with last/, and a run stops only when every step overflows."""
import importlib
import json
import sys

import pytest
import torch

import common
import simcse
import plumbing
from plumbing import hub
from conftest import ROOT, smoke_args, watch_widths_and_graphs
from test_simcse import write_nli

sys.path.insert(0, str(ROOT / "ablations"))

# Every loss a loop calls, by the module attribute the loop looks it up through.
LOSSES = {
    "simcse": [(simcse, "info_nce")],
    "simcse_sup": [(simcse, "info_nce")],
    "simcsepp": [("simcsepp", "off_dropout_info_nce"), ("simcsepp", "dcl_loss")],
    "sscl": [("sscl", "sscl_loss")],
    "whitenedcse": [("whitenedcse", "shuffled_group_whitening"), ("whitenedcse", "multi_positive_info_nce")],
    "micse": [("micse", "moco_info_nce"), ("micse", "ami_loss")],
    # the ablations (#30)
    "simcse_mlm": [("simcse", "masked_lm_loss"), (simcse, "info_nce")],
    "sscl_projection": [("sscl", "sscl_loss")],
    "augmentations": [(simcse, "info_nce")],
    "noise": [("simcsepp_noise_barlow", "noisy_info_nce")],
    "barlow": [("simcsepp_noise_barlow", "barlow_twins_loss"), (simcse, "info_nce")],
    "whitening": [("whitenedcse_whitening", "full_whitening"), ("whitenedcse", "multi_positive_info_nce")],
    # GradCache and recomputed layers (#53): the losses see the cached fp32 embeddings
    "simcse_mlm_micro": [("simcse", "masked_lm_loss"), (simcse, "info_nce")],
    "micse_micro": [("micse", "moco_info_nce"), ("micse", "ami_loss")],
}
FLAGS = {"simcse_sup": ["--supervised"], "sscl": ["--neg_layers", "1"], "whitenedcse": ["--num_groups", "16"],
         "micse": ["--queue_size", "16"], "simcse_mlm": ["--do_mlm"],
         "sscl_projection": ["--neg_layers", "1", "--output_dim", "8"],
         "augmentations": ["--positive", "word_deletion", "--rate", "0.2", "--two_encoders"],
         "noise": ["--positive_noise", "add", "--negative_noise", "reduce", "--mean_passes", "2"],
         "barlow": ["--barlow", "--barlow_padding", "10"], "whitening": ["--whitening", "zca"],
         "simcse_mlm_micro": ["--do_mlm", "--micro_batch_size", "3", "--gradient_checkpointing"],
         "micse_micro": ["--queue_size", "16", "--micro_batch_size", "3", "--gradient_checkpointing"]}
# What a loss receives under half precision, when not the fp32 embeddings: --do_mlm's vocabulary scores come from the
# head run under autocast, as the released code's fp16 runs did (the loss casts them to fp32 before its cross-entropy).
INPUTS = {"masked_lm_loss": "half"}
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
SCRIPTS = {"augmentations": "simcse_augmentations", "noise": "simcsepp_noise_barlow",
           "barlow": "simcsepp_noise_barlow", "whitening": "whitenedcse_whitening"}  # in ablations/


def tensors_in(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from tensors_in(v)


def as_fp32(v):
    if isinstance(v, torch.Tensor):
        return v.detach().float() if v.is_floating_point() else v
    return type(v)(as_fp32(x) for x in v) if isinstance(v, (list, tuple)) else v


def recording(loss_fn, calls, device_type="cpu"):
    """`loss_fn`, noting the dtypes it gets, whether autocast is on, and whether it equals an fp32 recomputation
    (with the same random draws: a torch.Generator argument is rewound for the recomputation)."""
    def wrapper(*args, **kwargs):
        generators = [v for v in [*args, *kwargs.values()] if isinstance(v, torch.Generator)]
        before = [g.get_state() for g in generators]
        out = loss_fn(*args, **kwargs)
        after = [g.get_state() for g in generators]
        for g, state in zip(generators, before):
            g.set_state(state)
        with torch.no_grad(), torch.autocast(device_type, enabled=False):
            reference = loss_fn(*as_fp32(args), **{k: as_fp32(v) for k, v in kwargs.items()})
        for g, state in zip(generators, after):
            g.set_state(state)
        calls.append({"dtypes": {t.dtype for t in tensors_in([*args, *kwargs.values()]) if t.is_floating_point()},
                      "autocast": torch.is_autocast_enabled(device_type), "out_dtype": out.dtype,
                      "equal": torch.equal(out.detach(), reference)})
        return out
    return wrapper


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("run", list(LOSSES))
def test_half_precision_encoder_fp32_losses(run, precision, tiny_model, corpus, senteval_dir, tmp_path, monkeypatch):
    script = SCRIPTS.get(run, run.split("_")[0])
    module = importlib.import_module(script)
    calls = {name: [] for _, name in LOSSES[run]}
    for owner, name in LOSSES[run]:
        owner = importlib.import_module(owner) if isinstance(owner, str) else owner
        monkeypatch.setattr(owner, name, recording(getattr(owner, name), calls[name]))
    encoder_autocast = set()  # (enabled, dtype) at each call of the encoder
    load_pretrained = hub.load_pretrained

    def load_and_watch(*args, **kwargs):
        tokenizer, backbone = load_pretrained(*args, **kwargs)
        backbone.register_forward_pre_hook(lambda m, a: encoder_autocast.add(
            (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))))
        return tokenizer, backbone
    monkeypatch.setattr(hub, "load_pretrained", load_and_watch)

    data = write_nli(tmp_path / "nli.csv") if run == "simcse_sup" else corpus
    out = tmp_path / "run"
    args = smoke_args(tiny_model, data, senteval_dir, out, "--precision", precision, "--max_steps", 3,
                      "--eval_steps", 3, "--no_test_eval", *FLAGS.get(run, []))
    module.main([str(a) for a in args])
    results = json.loads((out / "results.json").read_text())
    assert results["precision"] == precision and results["args"]["precision"] == precision and results["steps"] == 3
    assert (True, HALF[precision]) in encoder_autocast  # the training passes ran in half precision
    assert any(not enabled for enabled, _ in encoder_autocast)  # the dev gate in fp32
    for name, seen in calls.items():
        assert len(seen) >= 3, name  # once a step at least (the whitening once a view)
        for call in seen:
            expected = {HALF[precision]} if INPUTS.get(name) == "half" else {torch.float32}
            assert call["dtypes"] == expected and not call["autocast"], (name, call)
            assert call["out_dtype"] == torch.float32 and call["equal"], (name, call)


def test_whitening_under_bf16_autocast_equals_fp32():
    import whitenedcse
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 48, generator=g) * 3 + 1
    perm = torch.randperm(48, generator=g)
    reference = whitenedcse.shuffled_group_whitening(x, 12, perm)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = whitenedcse.shuffled_group_whitening(x, 12, perm)
        head = whitenedcse.WhitenedHead(48, 12)
        assert head.linear(mixed).dtype == torch.bfloat16  # autocast is on around it
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, reference, atol=1e-6, rtol=1e-6)  # bf16 matmuls would be off by ~1e-2


def fp16_run(tiny_model, corpus, senteval_dir, out, monkeypatch, overflow_at=(), *extra):
    """simcse.py in fp16 with an inf planted in a gradient at the steps `overflow_at`; (results, the GradScaler's
    scale and a watched parameter after each step's update)."""
    import simcse
    after_update = []
    real_scaler = common.grad_scaler

    def watched_scaler(device, precision):
        scaler = real_scaler(device, precision)
        update = scaler.update

        def update_and_record(*args, **kwargs):
            update(*args, **kwargs)
            after_update.append((scaler.get_scale(), watched[0].detach().clone()))
        scaler.update = update_and_record
        return scaler
    monkeypatch.setattr(common, "grad_scaler", watched_scaler)
    watched, load = [], hub.load_pretrained

    def load_and_plant(*args, **kwargs):
        tokenizer, backbone = load(*args, **kwargs)
        weight = backbone.encoder.layer[0].output.dense.weight
        watched.append(weight)
        steps = iter(range(1, 10_000))
        weight.register_hook(lambda g: g * float("inf") if next(steps) in overflow_at else g)
        return tokenizer, backbone
    monkeypatch.setattr(hub, "load_pretrained", load_and_plant)
    simcse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--precision", "fp16",
                                            "--no_test_eval", "--logging_steps", 1, *extra)])
    return json.loads((out / "results.json").read_text()), after_update


def test_fp16_unscales_before_clipping_and_an_overflow_skips_its_step_and_halves_the_scale(
        tiny_model, corpus, senteval_dir, tmp_path, monkeypatch):
    import simcse
    results, after = fp16_run(tiny_model, corpus, senteval_dir, tmp_path / "fp16", monkeypatch, (2,),
                              "--max_steps", 4, "--eval_steps", 4)
    scales = [scale for scale, _ in after]
    assert scales == [65536.0, 32768.0, 32768.0, 32768.0]  # halved by step 2's overflow, then kept
    assert torch.equal(after[1][1], after[0][1]) and not torch.equal(after[2][1], after[1][1])  # step 2 skipped
    assert results["skipped_steps"] == [2] and results["steps"] == 4
    assert results["grad_norm"][1] is None  # inf: JSON has no such number
    simcse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "fp32", "--max_steps", 1,
                                            "--eval_steps", 1, "--no_test_eval")])
    fp32 = json.loads((tmp_path / "fp32" / "results.json").read_text())
    # the gradients are unscaled before clipping: step 1's norm is fp32's (not 65536 times it), to fp16's rounding
    assert results["grad_norm"][0] == pytest.approx(fp32["grad_norm"][0], rel=1e-2)
    assert results["train_loss"][0] == pytest.approx(fp32["train_loss"][0], rel=1e-2)


def test_fp16_stops_only_when_every_step_overflows_and_says_why(tiny_model, corpus, senteval_dir, tmp_path,
                                                                  monkeypatch):
    from plumbing.run import FP16_SKIP_LIMIT
    with pytest.raises(plumbing.UsageError, match=r"the 25 steps up to step 25 were all skipped.*try --precision "
                                                  r"bf16"):
        fp16_run(tiny_model, corpus, senteval_dir, tmp_path / "run", monkeypatch, range(1, 100), "--max_steps",
                 30, "--eval_steps", 30)
    assert FP16_SKIP_LIMIT == 25
    # the run keeps what it had: best/ (step 0's) and results.json with the stop and the record up to it
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["stop"]["by"] == "fp16 overflow" and results["stop"]["step"] == 25 and results["interrupted"]
    assert results["skipped_steps"] == list(range(1, 26)) and results["best_step"] == 0
    assert (tmp_path / "run" / "best" / "config.json").is_file()


def test_compile_trains_through_the_compiled_encoder_with_batches_padded_to_8(tiny_model, corpus, senteval_dir,
                                                                              tmp_path, monkeypatch):
    """--compile's plumbing on CPU, with dynamo's eager backend (inductor's C++ build takes a minute here): the
    training passes go through the compiled module, each batch is padded to a multiple of 8, the run completes, and
    dynamo compiles nothing more once it has seen two widths (its second graph has a dynamic length): no
    recompiles after the warm-up. tests/test_cuda.py repeats this with inductor."""
    import simcse
    compiled = []
    real_compile = torch.compile

    def eager_compile(module, **kwargs):
        compiled.append(module)
        return real_compile(module, backend="eager")
    monkeypatch.setattr(torch, "compile", eager_compile)
    widths, graphs = watch_widths_and_graphs(monkeypatch)
    out = tmp_path / "run"
    simcse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--compile", "--no_test_eval",
                                            "--max_steps", 12, "--eval_steps", 12, "--batch_size", 2)])
    results = json.loads((out / "results.json").read_text())
    assert len(compiled) == 1 and results["steps"] == 12 and results["args"]["compile"] is True
    assert widths and all(w % 8 == 0 for w in widths) and len(set(widths)) >= 2, widths
    warm = next(i for i in range(len(widths)) if len(set(widths[:i + 1])) == 2)  # the step that saw a 2nd width
    assert graphs[warm] <= 2 and set(graphs[warm:]) == {graphs[warm]}, (widths, graphs)
