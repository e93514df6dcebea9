"""No host-device sync inside a training step, counted on CPU (plumbing/syncs.py): the counter itself, the prebuilt 4-D
attention mask that spares transformers' check of the 2-D one, and every script and flag (--count_host_syncs).

The allowance: WhitenedCSE's whitening of groups wider than 2 channels calls torch.linalg.eigh once a whitened view
(m = --num_pos a step), and eigh reads cuSOLVER's convergence flag on the host (PyTorch's _linalg_check_errors inside
the kernel); the full PCA/ZCA whitening of WhitenedCSE Table 3 likewise. Groups of 2 (the recipes') are whitened in
closed form: none. Everything else makes none.
"""
import importlib
import json

import pytest
import torch
import transformers

import common
from plumbing import syncs
from conftest import smoke_args, write_nli
from test_precision import SCRIPTS

# run -> (flags, syncs a step: eigh once a whitened view)
RUNS = {
    "simcse": ([], 0), "simcse_sup": (["--supervised"], 0), "simcse_mlm": (["--do_mlm"], 0),
    "simcse_sup_mlm": (["--supervised", "--do_mlm"], 0), "simcsepp": ([], 0),
    "sscl": (["--neg_layers", "1"], 0), "sscl_projection": (["--neg_layers", "1", "--output_dim", "8"], 0),
    "whitenedcse": (["--num_groups", "16"], 0), "whitenedcse_no_whitening": (["--no_whitening"], 0),
    "whitenedcse_wide": (["--num_groups", "8"], 3),  # groups of 4 channels: eigh
    "micse": (["--queue_size", "16"], 0), "micse_no_queue": (["--queue_size", "0"], 0),
    # GradCache and recomputed layers (#53): still none (WhitenedCSE's eigh once a view, as before)
    "simcse_sup_mlm_micro": (["--supervised", "--do_mlm", "--micro_batch_size", "3", "--gradient_checkpointing"], 0),
    "micse_micro": (["--queue_size", "16", "--micro_batch_size", "3", "--gradient_checkpointing"], 0),
    "whitenedcse_micro": (["--num_groups", "16", "--micro_batch_size", "3"], 0),
    "augmentations": (["--positive", "word_deletion", "--rate", "0.2", "--two_encoders"], 0),
    "noise": (["--positive_noise", "add", "--negative_noise", "reduce", "--mean_passes", "2"], 0),
    "barlow": (["--barlow", "--barlow_padding", "10"], 0),
    "whitening": (["--whitening", "zca"], 3), "whitening_group": (["--whitening", "shuffled_group"], 0),
}


def module_of(run: str):
    """The script a run of test_precision / test_cuda / this file's tables trains with."""
    return importlib.import_module(SCRIPTS.get(run.split("_")[0], run.split("_")[0]))


@pytest.mark.parametrize("run", list(RUNS))
def test_a_training_step_makes_no_host_sync(run, tiny_model, corpus, senteval_dir, tmp_path):
    flags, allowed = RUNS[run]
    data = write_nli(tmp_path / "nli.csv") if "--supervised" in flags else corpus
    out = tmp_path / "run"
    args = smoke_args(tiny_model, data, senteval_dir, out, "--max_steps", 4, "--eval_steps", 4, "--no_test_eval",
                      "--count_host_syncs", 3, *flags)
    module_of(run).main([str(a) for a in args])
    counted = json.loads((out / "results.json").read_text())["host_syncs"]
    assert counted["steps"] == [2, 3, 4] and counted["device"] == "cpu"
    assert counted["per_step"] == [allowed] * 3, counted
    assert set(counted["ops"]) <= {"aten._linalg_eigh"}, counted


def test_the_counter_sees_what_reads_a_device_value_on_the_host():
    t = torch.randn(6)
    with syncs.HostSyncCounter("cpu") as counter:
        t.sum().item()
        bool(t.max() > 0)
        t[t > 0]
        t.nonzero()
        t.masked_select(t > 0)
        torch.equal(t, t)
        torch.unique(t)
        t.clone()[t > 0] = 1.0
        torch.linalg.eigh(torch.eye(3))
        torch.repeat_interleave(torch.tensor([1, 2]))
    assert counter.ops == {"aten._local_scalar_dense": 2, "aten.index (boolean index)": 1, "aten.nonzero": 1,
                           "aten.masked_select": 1, "aten.equal": 1, "aten._unique2": 1,
                           "aten.index_put_ (boolean index)": 1, "aten._linalg_eigh": 1,
                           "aten.repeat_interleave (repeats from a tensor)": 1}
    with syncs.HostSyncCounter("cpu") as counter:  # shapes and values that stay on the device
        index = t.topk(3).indices
        torch.where(t > 0, t, 0.0).sum() / (t > 0).sum().clamp_min(1)
        t[index], t[1:4], t.gather(0, index), torch.bernoulli(torch.full((4,), 0.5))
    assert not counter.ops
    with syncs.HostSyncCounter("cuda") as counter:  # on a GPU run, a CPU tensor's value is no sync
        t.sum().item()
        t.nonzero()
    assert not counter.ops


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_the_prebuilt_mask_gives_the_same_outputs_without_transformers_host_check(attn_implementation, tiny_model):
    """A 2-D mask makes transformers 5 read it on the host (padding_mask.all()); common.BackboneWithHeads's 4-D mask gives the
    same hidden states and attentions, bit for bit, in fp32 and under bf16 autocast, and reads nothing."""
    backbone = transformers.AutoModel.from_pretrained(tiny_model, attn_implementation=attn_implementation).eval()
    ids = torch.randint(5, 40, (6, 9))
    mask = torch.ones(6, 9, dtype=torch.long)
    mask[1, 5:], mask[3, 2:] = 0, 0
    inputs = {"input_ids": ids, "attention_mask": mask, "output_hidden_states": True,
              "output_attentions": attn_implementation == "eager"}
    encoder = common.BackboneWithHeads(backbone)
    for precision in ("fp32", "bf16"):
        with common.autocast(torch.device("cpu"), precision):
            with syncs.HostSyncCounter("cpu") as plain:
                reference = backbone(**inputs)
            with syncs.HostSyncCounter("cpu") as prebuilt:
                got = encoder(**inputs)
        assert sum(plain.ops.values()) >= 1 and not prebuilt.ops
        for a, b in zip(reference.hidden_states + (reference.attentions or ()), got.hidden_states +
                        (got.attentions or ())):
            assert torch.equal(a, b)


def test_encoder_freezes_only_the_pooler_that_no_loss_trains(tiny_model):
    backbone = transformers.AutoModel.from_pretrained(tiny_model)
    head = common.MLPHead(backbone.config)
    model = common.BackboneWithHeads(backbone, head, None)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"backbone.pooler.dense.weight", "backbone.pooler.dense.bias"}
    assert list(model.heads) == [head]


def test_the_window_counts_steps_two_to_n_plus_one_and_sets_cuda_debug_mode(monkeypatch):
    """StepWindow's bookkeeping, with torch.cuda's sync debug mode faked (its CUDA path, exercised on CPU)."""
    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(syncs, "CUDA_DEBUG", "error")
    window = syncs.StepWindow(2, torch.device("cuda"))
    import warnings
    for step in range(4):
        window.begin()
        torch.ones(2).sum().item()  # a CPU value: not a sync of a CUDA run
        warnings.warn("a module imported now says that it synchronizes", DeprecationWarning)  # not torch's
        if step == 2:
            warnings.warn("called a synchronizing CUDA operation")  # torch's own (set_sync_debug_mode "warn")
        window.end()
    assert modes == ["error", 0, "error", 0]  # set for steps 2 and 3 only, then restored
    assert window.record() == {"steps": [2, 3], "per_step": [0, 0], "ops": {}, "device": "cuda",
                               "cuda_sync_warnings_per_step": [0, 1]}
    assert syncs.StepWindow(None, torch.device("cpu")).record() is None


def test_every_run_of_the_gpu_tests_names_a_script():
    """tests/test_cuda.py (skipped without CUDA) takes its runs from test_precision.LOSSES and RUNS here: each names
    a script that imports (its runs named after modules that do not exist failed there before measuring anything)."""
    import test_precision
    for run in [*test_precision.LOSSES, *RUNS]:
        assert callable(module_of(run).main), run
