"""sscl.py: the loss against a loop, the negative layers, a smoke run with the over-smoothing report (SetSim
itself: test_analyze.py)."""
import json
import math
import types

import numpy as np
import pytest
import torch

import common
import simcse
import eval_sts
import plumbing
import sscl
from conftest import in_process_scores, run_script, smoke_args


def loop_sscl(z1, z2, negatives, temp):
    def cos(a, b):
        return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
    z1, z2 = z1.double().numpy(), z2.double().numpy()
    negatives = [tuple(n.double().numpy() for n in layer) for layer in negatives]
    with_layers = plain = 0.0
    for i in range(len(z1)):
        batch_logits = [cos(z1[i], z2[j]) / temp for j in range(len(z2))]
        layer_logits = [cos(z1[i], n[j]) / temp for pair in negatives for n in pair for j in range(len(n))]
        pos = batch_logits[i]
        with_layers += -pos + math.log(sum(math.exp(x) for x in batch_logits + layer_logits))
        plain += -pos + math.log(sum(math.exp(x) for x in batch_logits))
    return (with_layers + plain) / (2 * len(z1))


@pytest.mark.parametrize("k", [0, 1, 2])
def test_sscl_loss_matches_loop(k):
    g = torch.Generator().manual_seed(k)
    z1, z2 = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    negatives = [(torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)) for _ in range(k)]
    assert sscl.sscl_loss(z1, z2, negatives, 0.05).item() == pytest.approx(loop_sscl(z1, z2, negatives, 0.05), rel=1e-5)
    anchor_only = [layer[:1] for layer in negatives]  # --layer_negatives anchor: N negatives a layer, not 2N
    assert sscl.sscl_loss(z1, z2, anchor_only, 0.05).item() == pytest.approx(loop_sscl(z1, z2, anchor_only, 0.05),
                                                                             rel=1e-5)


def test_anchor_only_layer_negatives_run_and_differ_from_both(tiny_model, corpus, senteval_dir, tmp_path):
    losses = {}
    for which in ("both", "anchor"):
        out = tmp_path / which
        sscl.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--max_steps", 2,
                                              "--no_test_eval", "--neg_layers", 1, "--layer_negatives", which)])
        losses[which] = json.loads((out / "results.json").read_text())["train_loss"]
    assert losses["both"][0] != losses["anchor"][0] and all(math.isfinite(v) for v in losses["anchor"])


def test_no_layers_equals_info_nce_exactly():
    g = torch.Generator().manual_seed(9)
    z1, z2 = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    assert torch.equal(sscl.sscl_loss(z1, z2, [], 0.05), simcse.info_nce(z1, z2, 0.05))


def test_negative_layer_indices():
    assert sscl.negative_layers(12, 2) == [11, 10]
    assert sscl.negative_layers(6, 1) == [5]
    assert sscl.negative_layers(12, 0) == []
    assert sscl.negative_layers(12, 2, index=4) == [4]
    with pytest.raises(plumbing.UsageError):
        sscl.negative_layers(12, 2, index=12)
    with pytest.raises(plumbing.UsageError):
        sscl.negative_layers(6, 6)


def test_the_views_negatives_come_from_the_right_layers_of_the_same_pass():
    """sscl_views on an encoder whose layer l's hidden state is the constant l (view 1) or 10 + l (view 2): the
    average pooler gives that constant, so z's views are layer 5's and the negatives layers 4 and 3's (L-1, L-2: the
    default), both views' each; a chosen layer and the anchor's view alone; with the [CLS] pooler the layer's first
    token through the same MLP head as z. Fails where a layer's index is off by one (hidden_states[0] is the
    embeddings) or the views' order is swapped."""
    n, length, dim, num_layers = 3, 4, 2, 5
    hidden = tuple(torch.cat([torch.full((n, length, dim), float(l)), torch.full((n, length, dim), 10.0 + l)])
                   for l in range(num_layers + 1))
    encoder = lambda **inputs: types.SimpleNamespace(hidden_states=hidden)  # noqa: E731
    batch = {"input_ids": torch.ones(n, length, dtype=torch.long), "attention_mask": torch.ones(n, length)}
    z1, z2, *negatives = sscl.sscl_views(encoder, batch)
    assert (float(z1[0, 0]), float(z2[0, 0])) == (5.0, 15.0)
    assert [float(v[0, 0]) for v in negatives] == [4.0, 14.0, 3.0, 13.0]
    _, _, *negatives = sscl.sscl_views(encoder, batch, [2], both_views=False)
    assert [float(v[0, 0]) for v in negatives] == [2.0]
    head = common.MLPHead(types.SimpleNamespace(hidden_size=dim, initializer_range=0.02))
    _, _, anchor, _ = sscl.sscl_views(encoder, batch, [2], pool=common.block_pool("cls", head, "avg"))
    assert torch.allclose(anchor, head(hidden[2][:n, 0]))
    for wrong in ([5], [0], [6]):  # the last layer, the embeddings, past the last: one clear line
        with pytest.raises(ValueError, match="intermediate ones, 1..4"):
            sscl.sscl_views(encoder, batch, wrong)


def test_only_cls_and_avg_poolers_and_avg_by_default():
    with pytest.raises(SystemExit):
        sscl.parse_args(["--pooler", "avg_top2"])
    assert sscl.parse_args([]).pooler == "avg"  # the released scripts' --pooler_type avg


@pytest.mark.parametrize("pooler", ["cls", "avg"])
def test_smoke_run_with_oversmoothing_report(tiny_model, corpus, senteval_dir, tmp_path, pooler):
    out = tmp_path / "sscl"
    argv = [*smoke_args(tiny_model, corpus, senteval_dir, out), "--pooler", pooler, "--neg_layers", 1,
            "--report_oversmoothing"]
    if pooler == "cls":  # the real CLI once; the other in-process (each new interpreter costs seconds)
        proc = run_script("sscl.py", *argv)
        assert proc.returncode == 0, proc.stderr
    else:
        import sscl
        sscl.main([str(a) for a in argv])
    results = json.loads((out / "results.json").read_text())
    assert results["eval_pooler"] == {"cls": "cls_before_pooler", "avg": "avg"}[pooler]
    assert in_process_scores(eval_sts, "--model_name_or_path", out / "best", "--senteval_dir", senteval_dir,
                             "--pooler", results["eval_pooler"]) == results["test"]
    for when in ("before", "after"):
        assert list(results["setsim"][when]) == ["1-2"]  # the tiny model has 2 layers
        assert -1.0 <= results["setsim"][when]["1-2"] <= 1.0


def test_a_projection_is_trained_and_evaluated_on_the_same_input(tiny_model, corpus, senteval_dir, tmp_path):
    """--output_dim with --pooler cls trains the projection on the MLP head's output: evaluated on it too
    (--no-mlp_only_train, the head saved in best/), or refused in one line."""
    from conftest import cli_in_process
    out = tmp_path / "run"
    code, err = cli_in_process(sscl, *smoke_args(tiny_model, corpus, senteval_dir, out, "--pooler", "cls",
                                                 "--output_dim", 8))
    assert code == 2 and "--no-mlp_only_train" in err and len(err.strip().splitlines()) == 1 and not out.exists()
    sscl.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--pooler", "cls", "--output_dim", 8,
                                          "--no-mlp_only_train", "--neg_layers", 1, "--max_steps", 2)])
    results = json.loads((out / "results.json").read_text())
    assert results["eval_pooler"] == "cls" and (out / "best" / "mlp_head.safetensors").is_file()
    encode = eval_sts.load_encode(str(out / "best"), "cls", torch.device("cpu"))
    assert encode(["a man runs"]).shape == (1, 8)
    assert in_process_scores(eval_sts, "--model_name_or_path", out / "best", "--senteval_dir", senteval_dir,
                             "--device", "cpu") == results["test"]
