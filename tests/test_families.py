"""Any encoder a researcher brings (#44): tiny random models of nine transformers families (tests/families.py). The
mask a training pass gives each is the model's own, each method trains on each, what cannot work is refused in one
line before any work, and so are models that are not bidirectional encoders and model folders that cannot be read."""
import argparse
import importlib
import json
import shutil

import numpy as np
import pytest
import torch

import common
import eval_sts
import eval_transfer
import simcse
import simcsepp
from conftest import cli_in_process, in_process_scores, smoke_args, write_nli
from families import FAMILIES, NOT_ENCODERS, POOLERLESS, write_model
from plumbing import backbones, hub

METHODS = {"simcse": [], "simcsepp": [], "sscl": ["--neg_layers", "1"], "whitenedcse": ["--num_groups", "16"],
           "micse": ["--queue_size", "16"]}
OWN_MASK = {"deberta-v2", "modernbert"}  # the prebuilt 4-D mask changes their outputs (NaN, local attention)
NO_DROPOUT = {"albert", "modernbert"}


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: write_model(root / family, family) for family in [*FAMILIES, *NOT_ENCODERS]}


def padded_batch(tokenizer):
    return tokenizer(["the dog runs in the big green park with a red ball near the old river at night",
                      "a cat", "the man sings"], padding=True, return_tensors="pt")


def checked(path, attentions=False, **flags):
    """(tokenizer, backbone, prebuilt mask?, notes, args) as a run's check_encoder finds them."""
    tokenizer, backbone = hub.load_pretrained(str(path), "eager" if attentions else None)
    args = argparse.Namespace(model_name_or_path=str(path), max_seq_length=32, dropout=None)
    prebuilt, notes = backbones.check(backbone, tokenizer, args, lambda m: common.attention_mask_4d(
        m, backbone.config._attn_implementation), attentions, **flags)
    return tokenizer, backbone, prebuilt, notes, args


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_mask_a_training_pass_gives_is_the_models_own(family, family_models):
    tokenizer, backbone, prebuilt, notes, _ = checked(family_models[family])
    assert prebuilt == (family not in OWN_MASK), notes
    batch = {k: v for k, v in padded_batch(tokenizer).items()}
    real = batch["attention_mask"].bool()
    backbone.eval()
    with torch.no_grad():
        own = backbone(**batch, output_hidden_states=True).hidden_states
        suite = common.BackboneWithHeads(backbone, prebuilt_mask=prebuilt)(**batch, output_hidden_states=True).hidden_states
        forced = common.BackboneWithHeads(backbone, prebuilt_mask=True)(**batch, output_hidden_states=True).hidden_states
    for a, b in zip(own, suite):
        assert torch.isfinite(b[real]).all()
        torch.testing.assert_close(b[real], a[real], atol=1e-5, rtol=0)
    if family in OWN_MASK:  # the probe's reason: the 4-D mask would give another model (or NaN)
        assert max((a[real] - b[real]).abs().nan_to_num(np.inf).max() for a, b in zip(own, forced)) > 1e-4
    assert ("a prebuilt 4-D mask" in notes[0]) == prebuilt and ("2-D mask" in notes[0]) != prebuilt


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_trains_on_every_family(method, family, family_models, corpus, senteval_dir, tmp_path):
    out = tmp_path / "run"
    args = smoke_args(family_models[family], corpus, senteval_dir, out, "--max_steps", 2, "--no_test_eval",
                      *METHODS[method])
    code, err = cli_in_process(importlib.import_module(method), *args)
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 2 and all(np.isfinite(results["train_loss"]))
    assert np.isfinite(results["best_dev_stsb"])  # the sentences are told apart
    assert json.loads((out / "best" / "config.json").read_text())["model_type"] == family
    assert (results["args"]["dropout"] == 0.1) == (family in NO_DROPOUT)


def test_a_model_without_dropout_gets_simcses_and_every_rate_goes_on_and_off(family_models):
    """ModernBERT keeps its attention's dropout as a float rate, not an nn.Dropout: --dropout and SimCSE++'s
    dropout-off pass reach it too."""
    tokenizer, backbone, _, notes, args = checked(family_models["modernbert"])
    assert args.dropout == 0.1 and "no dropout in this model" in notes[-1]
    common.set_dropout(backbone, args.dropout)
    rates = {slot: getattr(m, slot) for m, slot in common.dropout_slots(backbone)}
    assert rates == {"p": 0.1, "attention_dropout": 0.1} and backbone.config.attention_dropout == 0.1
    batch = padded_batch(tokenizer)
    backbone.train()
    torch.manual_seed(0)
    assert not torch.equal(backbone(**batch).last_hidden_state, backbone(**batch).last_hidden_state)
    _, _, off = simcsepp.simcsepp_views(backbone, batch)  # its dropout-off pass: eval mode, attention too
    backbone.eval()
    torch.testing.assert_close(off, backbone(**batch).last_hidden_state[:, 0], atol=0, rtol=0)
    backbone.train()
    assert {slot: getattr(m, slot) for m, slot in common.dropout_slots(backbone)} == rates  # untouched
    _, _, _, _, given = checked(family_models["modernbert"])
    given.dropout = 0.0  # --dropout 0: none, as asked
    backbones.check(backbone, tokenizer, given, lambda m: m)
    assert given.dropout == 0.0


def test_a_2d_mask_pays_transformers_host_check_and_the_count_says_so(family_models, corpus, senteval_dir, tmp_path):
    counts = {}
    for family in ("modernbert", "bert"):
        out = tmp_path / family
        simcse.main([str(a) for a in smoke_args(family_models[family], corpus, senteval_dir, out, "--max_steps", 3,
                                                "--eval_steps", 3, "--no_test_eval", "--count_host_syncs", 1)])
        counts[family] = json.loads((out / "results.json").read_text())["host_syncs"]["per_step"]
    assert counts["bert"] == [0] and counts["modernbert"][0] > 0  # its full and sliding-window masks


@pytest.mark.parametrize("family", ["distilbert", "modernbert", "bert"])
def test_num_layers_keeps_the_first_layers_of_each_layout(family, family_models, tmp_path):
    tokenizer, backbone = hub.load_pretrained(str(family_models[family]))
    batch = padded_batch(tokenizer)
    backbone.eval()
    with torch.no_grad():
        full = backbone(**batch, output_hidden_states=True).hidden_states
        simcse.keep_first_layers(backbone, 1)
        short = backbone(**batch, output_hidden_states=True).hidden_states
        # the first layer, unchanged (ModernBERT's last hidden state comes through its final norm)
        first = backbone.final_norm(full[1]) if family == "modernbert" else full[1]
    assert len(short) == 2
    torch.testing.assert_close(short[1], first, atol=1e-6, rtol=0)
    backbone.save_pretrained(tmp_path / "short")
    tokenizer.save_pretrained(tmp_path / "short")
    assert backbone.__class__.from_pretrained(tmp_path / "short").config.num_hidden_layers == 1


@pytest.mark.parametrize("family, flags, needle", [
    ("albert", ["--num_layers", "1"], "--num_layers: "),  # one layer shared across the depth: no list
    ("deberta-v2", ["--do_mlm"], "--do_mlm: the released code has an MLM head for bert, roberta, xlm-roberta"),
    ("modernbert", ["--do_mlm"], "not for"),
])
def test_what_cannot_work_is_refused_in_one_line_before_any_work(family, flags, needle, family_models, corpus,
                                                                  senteval_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(simcse.data, "training_examples", lambda *a, **k: pytest.fail("the data was read"))
    out = tmp_path / "run"
    code, err = cli_in_process(simcse, *smoke_args(family_models[family], corpus, senteval_dir, out, *flags))
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_xlm_roberta_trains_with_the_mlm_head(family_models, corpus, senteval_dir, tmp_path):
    out = tmp_path / "run"
    simcse.main([str(a) for a in smoke_args(family_models["xlm-roberta"], corpus, senteval_dir, out, "--max_steps",
                                            2, "--no_test_eval", "--do_mlm")])
    assert json.loads((out / "results.json").read_text())["steps"] == 2


@pytest.mark.parametrize("family", sorted(POOLERLESS - {"electra", "deberta-v2"}))
def test_supervised_simcse_on_a_poolerless_backbone_evaluates_its_head_from_best(family, family_models,
                                                                                 senteval_dir, tmp_path):
    """The MLP head kept at evaluation (the "cls" pooler) travels with best/: the run's final evaluation, eval_sts.py
    and sentence-transformers read it."""
    out = tmp_path / "run"
    simcse.main([str(a) for a in smoke_args(family_models[family], write_nli(tmp_path / "nli.csv"), senteval_dir,
                                            out, "--supervised", "--batch_size", 8, "--max_steps", 2)])
    results = json.loads((out / "results.json").read_text())
    assert results["eval_pooler"] == "cls" and (out / "best" / "mlp_head.safetensors").is_file()
    scores = in_process_scores(eval_sts, "--model_name_or_path", out / "best", "--pooler", "cls",
                               "--senteval_dir", senteval_dir, "--device", "cpu")
    assert scores == results["test"]
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is a test requirement")
    sentences = ["a man runs in the park", "the dog eats"]
    np.testing.assert_allclose(st.SentenceTransformer(str(out / "best"), device="cpu").encode(sentences),
                               eval_sts.load_encode(str(out / "best"), "cls", "cpu")(sentences), atol=1e-5)


def test_cls_on_a_poolerless_model_without_a_head_is_one_line(family_models, senteval_dir):
    code, err = cli_in_process(eval_sts, "--model_name_or_path", family_models["distilbert"], "--pooler", "cls",
                               "--senteval_dir", senteval_dir, "--device", "cpu")
    assert code == 2 and "has no pooler layer and no trained MLP head" in err and len(err.strip().splitlines()) == 1


def evaluator_args(tool, model, senteval_dir, tmp_path):
    return {"eval_sts": [eval_sts, "--model_name_or_path", model, "--senteval_dir", senteval_dir],
            "eval_transfer": [eval_transfer, "--model_name_or_path", model, "--senteval_dir", senteval_dir,
                              "--tasks", "CR"],
            "analyze": [importlib.import_module("analyze"), "spectrum", "--model_name_or_path", model,
                        "--senteval_dir", senteval_dir, "--out", tmp_path / "analysis"]}[tool]


@pytest.mark.parametrize("family, needle", [("gpt2", "is a decoder-only model (gpt2)"),
                                            ("t5", "is an encoder-decoder model (t5)")])
@pytest.mark.parametrize("tool", [*METHODS, "eval_sts", "analyze"])
def test_models_that_are_not_bidirectional_encoders_are_one_line(tool, family, needle, family_models, corpus,
                                                                 senteval_dir, tmp_path):
    out = tmp_path / "run"
    if tool in METHODS:
        module, *args = importlib.import_module(tool), *smoke_args(family_models[family], corpus, senteval_dir, out)
    else:
        module, *args = evaluator_args(tool, family_models[family], senteval_dir, tmp_path)
    code, err = cli_in_process(module, *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not (tmp_path / "analysis").exists()


DAMAGES = {  # what happens to a copy of a model folder -> the file the line must name
    "truncated weights": (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[
        :3000]), "model.safetensors is truncated or damaged"),
    "no weights": (lambda p: (p / "model.safetensors").unlink(), "has no weights (model.safetensors"),
    "no tokenizer": (lambda p: [(p / name).unlink() for name in ("vocab.txt", "tokenizer.json")],
                     "has no tokenizer files"),
    "bad config": (lambda p: (p / "config.json").write_text("{"), "config.json cannot be read"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("tool", ["simcse", "micse", "eval_sts", "eval_transfer", "analyze"])
def test_a_model_folder_that_cannot_be_read_is_one_line_naming_the_file(tool, damage, family_models, corpus,
                                                                        senteval_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(family_models["bert"], model)
    DAMAGES[damage][0](model)
    before = sorted((p.name, p.stat().st_size) for p in model.iterdir())
    out = tmp_path / "run"
    if tool in METHODS:
        module, *args = importlib.import_module(tool), *smoke_args(model, corpus, senteval_dir, out)
    else:
        module, *args = evaluator_args(tool, model, senteval_dir, tmp_path)
    code, err = cli_in_process(module, *args)
    assert code == 2 and DAMAGES[damage][1] in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not (tmp_path / "analysis").exists()
    assert sorted((p.name, p.stat().st_size) for p in model.iterdir()) == before  # touched nothing



@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_memory_estimate_of_every_family(family, family_models, monkeypatch, capsys):
    """#58: `tools/bench.py --memory --model_name_or_path DIR` traces each family with the attention a run of it
    gets (its SDPA, else its eager attention: DeBERTa-v2, MPNet; miCSE's online encoder eager); the check before a
    GPU run, given the loaded model's config as Run.start gives it, estimates too (None: it fits, no 'no estimate'
    line)."""
    import bench
    from torch._subclasses.fake_tensor import FakeTensorMode
    from plumbing import memory
    path = family_models[family]
    code, err = cli_in_process(bench, "--memory", "--recipes", "micse", "--model_name_or_path", path, "--gpus", 80)
    assert code == 0, err
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith(f"| micse | {family} | 50 | fp32 |") and row.endswith("| fits |"), row
    _, backbone = hub.load_pretrained(str(path))  # as a run loads it
    with FakeTensorMode(allow_non_fake_inputs=True):
        traced = memory.build(hub.local_config(str(path)), "sdpa")
    assert traced.config._attn_implementation == backbone.config._attn_implementation
    assert backbone.config._attn_implementation == ("eager" if family in ("deberta-v2", "mpnet") else "sdpa")
    monkeypatch.setattr(memory, "device_free", lambda device: 1 << 40)
    args = simcse.parse_args(["--model_name_or_path", str(path), "--batch_size", "16"])
    assert memory.check_device(args, backbone.config, torch.device("cpu")) is None


def test_a_family_without_gradient_checkpointing_is_offered_micro_batches_alone(family_models):
    """MPNet and ALBERT have no gradient checkpointing in transformers: the planner's settings for a GPU too small
    leave it out (it raised before), and asking for it is the run's own line."""
    import bench
    from plumbing import memory
    path = str(family_models["mpnet"])
    config = hub.local_config(path)
    assert not memory.checkpointing(config) and memory.checkpointing(hub.local_config(str(family_models["bert"])))
    assert memory.settings(16, memory.checkpointing(config)) == [{"micro_batch_size": 8}]
    args = simcse.parse_args(["--model_name_or_path", path, "--batch_size", "16"])
    # nothing fits 0 bytes: the evaluations alone exceed it (no setting traced), and with evaluations of 0 bytes
    # the one setting, micro-batches of 8, is traced and does not fit either; no exception
    assert memory.first_fit(args, config, 0) == (None, None)
    found = {**memory.estimate(args, config), "dev_gate": 0, "final_eval": 0}
    assert memory.first_fit(args, config, 0, found=found) == (None, None)
    code, err = cli_in_process(bench, "--memory", "--recipes", "simcse", "--model_name_or_path", path,
                               "--gradient_checkpointing")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--gradient_checkpointing: " in err and "has no gradient checkpointing in transformers" in err
