"""simcsepp.py: off-dropout InfoNCE and DCL against explicit loops, the ablation equality, dropout restore."""
import json
import math

import numpy as np
import pytest
import torch

import common
import simcse
import eval_sts
import simcsepp
from conftest import in_process_scores, run_script, smoke_args


def cos(a, b):
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def loop_off_dropout(z1, z2, z0, temp, m):
    z1, z2, z0 = (t.double().numpy() for t in (z1, z2, z0))
    total = 0.0
    for i in range(len(z1)):
        pos = cos(z1[i], z2[i]) / temp
        negs = [cos(z0[i], z0[j]) / temp for j in range(len(z0)) if j != i]
        total += -m * pos + math.log(math.exp(m * pos) + sum(math.exp(s) for s in negs))
    return total / len(z1)


def loop_dcl(z1, z2, temp):
    z1, z2 = z1.double().numpy(), z2.double().numpy()
    n, d = z1.shape
    std = lambda z: (z - z.mean(0)) / np.sqrt(z.var(0) + 1e-5)
    a, b = std(z1), std(z2)
    total = 0.0
    for c in range(d):
        row = [sum(a[k, c] * b[k, e] for k in range(n)) / (n * temp) for e in range(d)]
        total += -row[c] + math.log(sum(math.exp(x) for x in row))
    return total / d


@pytest.mark.parametrize("m", [0.9, 1.0, 1.2])
def test_off_dropout_info_nce_matches_loop(m):
    g = torch.Generator().manual_seed(0)
    z1, z2, z0 = (torch.randn(6, 5, generator=g) for _ in range(3))
    got = simcsepp.off_dropout_info_nce(z1, z2, z0, temp=0.05, m=m).item()
    assert got == pytest.approx(loop_off_dropout(z1, z2, z0, 0.05, m), rel=1e-5)


@pytest.mark.parametrize("temp", [1.0, 5.0, 20.0])
def test_dcl_loss_matches_loop(temp):
    g = torch.Generator().manual_seed(1)
    z1, z2 = torch.randn(7, 4, generator=g), torch.randn(7, 4, generator=g)
    assert simcsepp.dcl_loss(z1, z2, temp).item() == pytest.approx(loop_dcl(z1, z2, temp), rel=1e-5)


@pytest.mark.parametrize("weight", [0.0, 0.1, 0.5])
def test_total_loss_with_dcl_weights(weight):
    g = torch.Generator().manual_seed(2)
    z1, z2, z0 = (torch.randn(5, 3, generator=g) for _ in range(3))
    total = simcsepp.off_dropout_info_nce(z1, z2, z0, 0.05, 0.9) + weight * simcsepp.dcl_loss(z1, z2, 5.0)
    assert total.item() == pytest.approx(loop_off_dropout(z1, z2, z0, 0.05, 0.9) + weight * loop_dcl(z1, z2, 5.0),
                                         rel=1e-5)


def test_gradient_reaches_dropout_off_embeddings():
    g = torch.Generator().manual_seed(3)
    z1, z2, z0 = (torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    simcsepp.off_dropout_info_nce(z1, z2, z0).backward()
    assert z0.grad is not None and z0.grad.abs().sum() > 0
    assert torch.autograd.gradcheck(lambda a, b, c: simcsepp.off_dropout_info_nce(a, b, c, 0.1, 0.9), (z1, z2, z0))
    assert torch.autograd.gradcheck(lambda a, b: simcsepp.dcl_loss(a, b, 5.0), (z1, z2))


def test_dcl_invariant_to_per_dimension_scale_and_shift():
    g = torch.Generator().manual_seed(4)
    z1, z2 = torch.randn(16, 6, generator=g, dtype=torch.float64), torch.randn(16, 6, generator=g, dtype=torch.float64)
    scale, shift = torch.rand(6, dtype=torch.float64) * 3 + 0.5, torch.randn(6, dtype=torch.float64)
    base = simcsepp.dcl_loss(z1, z2)
    # eps 1e-5 in the variance makes the invariance approximate; unit-variance-ish inputs keep it tight.
    assert simcsepp.dcl_loss(z1 * scale + shift, z2 * scale.flip(0) - shift).item() == pytest.approx(base.item(),
                                                                                                     abs=1e-4)


def test_ablation_equals_info_nce_exactly():
    g = torch.Generator().manual_seed(5)
    z1, z2 = torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g)
    assert torch.equal(simcsepp.view_negatives_info_nce(z1, z2, 0.05, m=1.0), simcse.info_nce(z1, z2, 0.05))


def test_dropout_off_pass_equals_eval_mode_keeps_its_gradients_and_restores_dropout(tiny_model):
    """The block's dropout-off pass: the eval-mode encoding, back-propagated (the authors keep its gradients), the
    encoder in train mode again after it, even where the pass fails."""
    from transformers import AutoModel, AutoTokenizer
    tokenizer, backbone = AutoTokenizer.from_pretrained(tiny_model), AutoModel.from_pretrained(tiny_model)
    batch = dict(tokenizer(["a man runs", "the dog eats food", "a red car", "sun and moon"], padding=True,
                           return_tensors="pt"))
    backbone.eval()
    reference = backbone(**batch).last_hidden_state[:, 0]
    backbone.train()
    _, _, off = simcsepp.simcsepp_views(backbone, batch)
    assert torch.allclose(off, reference, atol=1e-6)
    off.sum().backward()  # the dropout-off pass keeps its gradients
    assert backbone.embeddings.word_embeddings.weight.grad is not None
    dropouts = [m for m in backbone.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.training and m.p == 0.1 for m in dropouts)

    class FailsInEval(torch.nn.Module):  # a dropout-off pass that fails (out of memory, say)
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **inputs):
            if not self.training:
                raise RuntimeError("the dropout-off pass failed")
            return self.inner(**inputs)
    wrapped = FailsInEval(backbone).train()
    with pytest.raises(RuntimeError, match="dropout-off pass failed"):
        simcsepp.simcsepp_views(wrapped, batch)
    assert wrapped.training and backbone.training


def test_smoke_run(tiny_model, corpus, senteval_dir, tmp_path):
    out = tmp_path / "pp"
    proc = run_script("simcsepp.py", *smoke_args(tiny_model, corpus, senteval_dir, out))
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["method"] == "simcsepp" and results["args"]["m"] == 0.9 and len(results["trajectory"]) == 3
    assert in_process_scores(eval_sts, "--model_name_or_path", out / "best", "--senteval_dir", senteval_dir,
                             "--pooler", "cls_before_pooler") == results["test"]


def test_dcl_at_temperature_10_is_the_released_models_vicreg_term():
    """models_vicreg.py (SimCSE++'s "DCL SimCSE"): BatchNorm1d without affine in training mode on each view,
    cov = z1^T z2 / batch / 10, loss = mean(-diag + logsumexp over each row): simcsepp.py --dcl_temp 10."""
    g = torch.Generator().manual_seed(4)
    z1, z2 = torch.randn(16, 12, generator=g) * 3 + 1, torch.randn(16, 12, generator=g)
    bn = torch.nn.BatchNorm1d(12, affine=False).train()
    cov = bn(z1).T @ bn(z2) / 16 / 10
    released = (-torch.diagonal(cov) + torch.logsumexp(cov, dim=-1)).mean()
    torch.testing.assert_close(simcsepp.dcl_loss(z1, z2, 10.0), released, rtol=1e-6, atol=1e-6)


def test_first_last_average_is_the_released_codes_and_travels_with_best(tiny_model, corpus, senteval_dir, tmp_path,
                                                                       capsys):
    """SimCSE++'s (and miCSE's) released avg_first_last averages hidden_states[0], the embedding output
    (avg_embeddings_last; SimCSE's own averages layer 1): trained so (Table 4's --dcl_only), recorded in results.json
    and best/, and eval_sts.py evaluates best/ with it by default."""
    import micse
    model = ["--model_name_or_path", str(tiny_model)]
    assert simcsepp.parse_args(model + ["--dcl_only"]).pooler == "avg_embeddings_last"
    assert simcsepp.parse_args(model + ["--pooler", "avg_first_last"]).pooler == "avg_embeddings_last"
    micse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "micse", "--pooler",
                                           "avg_first_last", "--max_steps", 1, "--no_test_eval", "--no_align_uniform")])
    assert json.loads((tmp_path / "micse" / "results.json").read_text())["args"]["pooler"] == "avg_embeddings_last"
    out = tmp_path / "run"
    simcsepp.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--dcl_only", "--max_steps", 2)])
    results = json.loads((out / "results.json").read_text())
    assert results["eval_pooler"] == "avg_embeddings_last"
    assert json.loads((out / "best" / "eval_pooler.json").read_text()) == {"pooler": "avg_embeddings_last"}
    best = ["--model_name_or_path", out / "best", "--senteval_dir", senteval_dir, "--device", "cpu"]
    assert in_process_scores(eval_sts, *best) == results["test"]
    capsys.readouterr()
    assert in_process_scores(eval_sts, *best, "--pooler", "avg_first_last") != results["test"]
    assert "was evaluated with --pooler avg_embeddings_last" in capsys.readouterr().out


def test_view_negatives_info_nce_keeps_m_on_the_positive_against_a_loop():
    g = torch.Generator().manual_seed(6)
    z1, z2 = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    s = torch.nn.functional.normalize(z1, dim=1) @ torch.nn.functional.normalize(z2, dim=1).T / 0.05
    loop = sum(-0.9 * s[i, i] + math.log(math.exp(0.9 * s[i, i]) + sum(math.exp(s[i, j]) for j in range(6)
                                                                         if j != i)) for i in range(6)) / 6
    assert simcsepp.view_negatives_info_nce(z1, z2, 0.05, 0.9).item() == pytest.approx(float(loop), rel=1e-5)
