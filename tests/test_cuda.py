"""What can only fail on a GPU: bf16/fp16 autocast and the GradScaler on CUDA, no host sync inside a training step,
fused AdamW, --compile. Skipped without CUDA (the CPU suite covers the same loops with --precision bf16)."""
import importlib
import json
import warnings

import pytest
import torch

import common
from conftest import smoke_args
from test_precision import FLAGS, LOSSES, recording
from test_simcse import write_nli

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
RUNS = list(LOSSES)


def run_on_cuda(run, tiny_model, corpus, senteval_dir, tmp_path, *extra):
    module = importlib.import_module(run.split("_")[0])
    data = write_nli(tmp_path / "nli.csv") if run == "simcse_sup" else corpus
    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    args = smoke_args(tiny_model, data, senteval_dir, out, "--device", "cuda", "--no_test_eval",
                      *FLAGS.get(run, []), *extra)
    module.main([str(a) for a in args])
    return json.loads((out / "results.json").read_text())


def test_auto_precision_is_bf16_on_a_bf16_gpu_and_fp16_otherwise():
    expected = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    assert common.resolve_precision("auto", torch.device("cuda")) == expected


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("run", RUNS)
def test_losses_are_fp32_outside_autocast_on_cuda(run, precision, tiny_model, corpus, senteval_dir, tmp_path,
                                                  monkeypatch):
    if precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no bf16")
    calls = {name: [] for _, name in LOSSES[run]}
    for owner, name in LOSSES[run]:
        owner = importlib.import_module(owner) if isinstance(owner, str) else owner
        monkeypatch.setattr(owner, name, recording(getattr(owner, name), calls[name], "cuda"))
    results = run_on_cuda(run, tiny_model, corpus, senteval_dir, tmp_path, "--precision", precision)
    assert results["precision"] == precision and results["steps"] == 4
    assert all(v == v for v in results["train_loss"])  # fp16's scaler kept the losses finite
    assert results["peak_memory_kind"] == "cuda_max_allocated" and results["peak_memory_reserved_mb"] > 0
    for name, seen in calls.items():
        assert seen and all(c["dtypes"] == {torch.float32} and not c["autocast"] and c["equal"] for c in seen), name


def sync_warnings(run, steps, tiny_model, corpus, senteval_dir, tmp_path):
    """Host-device syncs of a whole run (dev gates at step 0 and the last step only), counted by torch."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run_on_cuda(run, tiny_model, corpus, senteval_dir, tmp_path, "--max_steps", steps, "--eval_steps", 1000)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


# Syncs a training step may have: none, except AMI's data-dependent tile dropping (as the authors' code does it)
# and torch.linalg.eigh's convergence check, once per whitened view.
ALLOWED_PER_STEP = {"micse": 8, "whitenedcse": 2 * 3}


@pytest.mark.parametrize("run", RUNS)
def test_no_host_sync_inside_a_training_step(run, tiny_model, corpus, senteval_dir, tmp_path):
    short = sync_warnings(run, 2, tiny_model, corpus, senteval_dir, tmp_path)
    long = sync_warnings(run, 6, tiny_model, corpus, senteval_dir, tmp_path)
    assert long - short <= 4 * ALLOWED_PER_STEP.get(run, 0), (short, long)


def test_adamw_is_fused_on_cuda():
    import types
    param = torch.nn.Parameter(torch.zeros(4, device="cuda"))
    optimizer, _ = common.make_optimizer([param], types.SimpleNamespace(lr=1e-3, warmup_steps=0), total_steps=2)
    assert optimizer.defaults["fused"] is True


def test_compile_runs_on_cuda(tiny_model, corpus, senteval_dir, tmp_path):
    results = run_on_cuda("simcse", tiny_model, corpus, senteval_dir, tmp_path, "--compile")
    assert results["steps"] == 4 and all(v == v for v in results["train_loss"])
