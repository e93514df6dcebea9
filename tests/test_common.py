"""common.py: info_nce, poolers, subsets, dropout control, argument handling."""
import math

import numpy as np
import pytest
import torch

import common


def loop_info_nce(z1, z2, temp, z3=None, weight=0.0):
    """Eq. 1 / 5 / 8 written out sentence by sentence."""
    def cos(a, b):
        return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
    z1, z2 = z1.double().numpy(), z2.double().numpy()
    z3 = None if z3 is None else z3.double().numpy()
    total = 0.0
    for i in range(len(z1)):
        logits = [cos(z1[i], z2[j]) / temp for j in range(len(z2))]
        if z3 is not None:
            logits += [cos(z1[i], z3[j]) / temp + (weight if i == j else 0.0) for j in range(len(z3))]
        total += -(logits[i] - math.log(sum(math.exp(x) for x in logits)))
    return total / len(z1)


@pytest.mark.parametrize("temp", [0.05, 0.5, 1.0])
def test_info_nce_matches_loop(temp):
    g = torch.Generator().manual_seed(0)
    z1, z2 = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    assert common.info_nce(z1, z2, temp).item() == pytest.approx(loop_info_nce(z1, z2, temp), rel=1e-5)


@pytest.mark.parametrize("weight", [0.0, 1.0, -0.5])
def test_info_nce_hard_negatives_match_loop(weight):
    g = torch.Generator().manual_seed(1)
    z1, z2, z3 = (torch.randn(5, 4, generator=g) for _ in range(3))
    got = common.info_nce(z1, z2, 0.1, z3=z3, hard_negative_weight=weight).item()
    assert got == pytest.approx(loop_info_nce(z1, z2, 0.1, z3, weight), rel=1e-5)


def test_info_nce_hand_checked_case():
    # Orthogonal unit vectors, positives identical: logit 1/temp on the diagonal, 0 elsewhere.
    z = torch.eye(3)
    expected = -math.log(math.exp(1 / 0.5) / (math.exp(1 / 0.5) + 2))
    assert common.info_nce(z, z, 0.5).item() == pytest.approx(expected, rel=1e-6)


def test_info_nce_gradcheck():
    g = torch.Generator().manual_seed(2)
    z1, z2, z3 = (torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda a, b: common.info_nce(a, b, 0.1), (z1, z2))
    assert torch.autograd.gradcheck(lambda a, b, c: common.info_nce(a, b, 0.1, c, 0.7), (z1, z2, z3))


def test_poolers_on_hand_built_hidden_states():
    # 2 sentences, 3 positions, the second sentence padded after one token; hidden states of 3 "layers".
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    emb = torch.zeros(2, 3, 2)
    first = torch.tensor([[[1., 0.], [3., 0.], [5., 0.]], [[2., 2.], [9., 9.], [9., 9.]]])
    last = torch.tensor([[[0., 1.], [0., 3.], [0., 8.]], [[4., 4.], [7., 7.], [7., 7.]]])
    hidden = (emb, first, last)
    assert torch.allclose(common.pool(hidden, mask, "cls_before_pooler"), torch.tensor([[0., 1.], [4., 4.]]))
    assert torch.allclose(common.pool(hidden, mask, "avg"), torch.tensor([[0., 4.], [4., 4.]]))
    assert torch.allclose(common.pool(hidden, mask, "avg_first_last"), torch.tensor([[1.5, 2.0], [3., 3.]]))
    assert torch.allclose(common.pool(hidden, mask, "avg_top2"), torch.tensor([[1.5, 2.0], [3., 3.]]))
    pooler_output = torch.randn(2, 2)
    assert common.pool(hidden, mask, "cls", pooler_output) is pooler_output
    with pytest.raises(common.CLIError, match="no pooler"):
        common.pool(hidden, mask, "cls")
    with pytest.raises(common.CLIError, match="unknown pooler"):
        common.pool(hidden, mask, "max")


def test_subsample_is_deterministic_and_bounded():
    items = list(range(1000))
    a = common.subsample(items, 0.01, seed=3)
    assert a == common.subsample(items, 0.01, seed=3)
    assert a != common.subsample(items, 0.01, seed=4)
    assert len(a) == 10 and a == sorted(a) and set(a) <= set(items)
    assert len(common.subsample(items, 0.0015, seed=0)) == round(1.5)
    assert common.subsample(items, 1.0, seed=0) == items
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(common.CLIError, match="fraction"):
            common.subsample(items, bad, seed=0)
    with pytest.raises(common.CLIError, match="keeps none"):
        common.subsample(items, 0.0001, seed=0)


def test_load_sentences_skips_empty_lines_and_rejects_empty_files(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("one\n\n  \ntwo  \n")
    assert common.load_sentences(str(path)) == ["one", "two"]
    path.write_text("\n\n")
    with pytest.raises(common.CLIError, match="no sentences"):
        common.load_sentences(str(path))
    with pytest.raises(common.CLIError, match="no such file"):
        common.load_sentences(str(tmp_path / "missing.txt"))


def test_collator_lays_out_triplets_column_major(tiny_model):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    batch = common.Collator(tokenizer, max_length=6)([("a man", "a dog", "the cat"), ("big red ball", "sun", "moon")])
    assert batch["num_columns"] == 3 and batch["input_ids"].shape[0] == 6
    assert batch["input_ids"].shape[1] <= 6
    decoded = [tokenizer.decode(ids, skip_special_tokens=True) for ids in batch["input_ids"]]
    assert decoded == ["a man", "big red ball", "a dog", "sun", "the cat", "moon"]


def test_forward_views_gives_independent_dropout_masks(tiny_model):
    from transformers import AutoModel, AutoTokenizer
    tokenizer, backbone = AutoTokenizer.from_pretrained(tiny_model), AutoModel.from_pretrained(tiny_model)
    model = common.SentenceEncoder(backbone, pooler="cls").train()
    batch = dict(tokenizer(["a man runs", "the dog"], padding=True, return_tensors="pt"))
    outputs, mask = model.forward_views(batch, num_views=2)
    z1, z2 = model.embed(outputs.hidden_states, mask).chunk(2)
    assert z1.shape == (2, 32) and not torch.allclose(z1, z2)
    model.eval()
    outputs, mask = model.forward_views(batch, num_views=2)
    z1, z2 = model.embed(outputs.hidden_states, mask).chunk(2)
    assert torch.allclose(z1, z2, atol=1e-6)


def test_dropout_off_is_deterministic_and_restores_modes(tiny_model):
    from transformers import AutoModel, AutoTokenizer
    tokenizer, backbone = AutoTokenizer.from_pretrained(tiny_model), AutoModel.from_pretrained(tiny_model)
    backbone.config.attention_probs_dropout_prob = 0.5
    common.set_dropout(backbone, 0.5)
    batch = dict(tokenizer(["a man runs in the park"], return_tensors="pt"))
    backbone.eval()
    reference = backbone(**batch).last_hidden_state
    backbone.train()
    with common.dropout_off(backbone):
        off = backbone(**batch).last_hidden_state
    assert torch.allclose(off, reference, atol=1e-6)  # attention dropout is off too
    dropouts = [m for m in backbone.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.training and m.p == 0.5 for m in dropouts)
    assert not torch.allclose(backbone(**batch).last_hidden_state, reference)


def test_explicit_flags_sees_only_what_the_user_gave():
    parser = common.base_parser("doc", "x")
    assert common.explicit_flags(parser, ["--lr", "1e-5", "--fp32"]) == {"lr", "fp32"}
    assert parser.parse_args([]).lr == 3e-5  # defaults are restored


def test_linear_schedule_warmup_then_decay():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = common.linear_schedule(opt, warmup_steps=2, total_steps=6)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25])
    from transformers import get_linear_schedule_with_warmup
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    reference = get_linear_schedule_with_warmup(opt2, 2, 6)
    assert [reference.lr_lambdas[0](s) for s in range(6)] == pytest.approx(lrs)
