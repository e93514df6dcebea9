"""whitenedcse.py: SGW's whitening, permutation handling and detached covariance; the multi-positive loss."""
import json
import math

import numpy as np
import pytest
import torch

import common
import simcse
import eval_sts
import whitenedcse
from conftest import cli_in_process, in_process_scores, run_script, smoke_args

sgw = whitenedcse.shuffled_group_whitening


def numpy_group_whitening(x, num_groups):
    """Plain group whitening (no shuffle) written out with numpy."""
    n, d = x.shape
    w = d // num_groups
    out = np.zeros_like(x)
    for g in range(num_groups):
        block = x[:, g * w:(g + 1) * w]
        centred = block - block.mean(0)
        values, vectors = np.linalg.eigh(centred.T @ centred / n)
        out[:, g * w:(g + 1) * w] = centred @ vectors @ np.diag(values ** -0.5) @ vectors.T
    return out


def random_x(n=32, d=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(d, d, generator=g, dtype=torch.float64)
    return torch.randn(n, d, generator=g, dtype=torch.float64) @ mixing + 3.0


@pytest.mark.parametrize("num_groups", [1, 3, 6])
def test_each_group_has_identity_covariance_and_zero_mean(num_groups):
    x = random_x()
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(1))
    out = sgw(x, num_groups, perm)
    grouped = out[:, perm].reshape(32, num_groups, -1)
    for g in range(num_groups):
        block = grouped[:, g]
        assert torch.allclose(block.mean(0), torch.zeros(block.shape[1], dtype=torch.float64), atol=1e-10)
        assert torch.allclose(block.T @ block / 32, torch.eye(block.shape[1], dtype=torch.float64), atol=1e-8)


def test_identity_permutation_is_plain_group_whitening():
    x = random_x()
    got = sgw(x, 4, torch.arange(12))
    np.testing.assert_allclose(got.numpy(), numpy_group_whitening(x.numpy(), 4), atol=1e-8)


def test_permutation_is_undone():
    x = random_x()
    g = torch.Generator().manual_seed(2)
    p, q = torch.randperm(12, generator=g), torch.randperm(12, generator=g)
    assert torch.allclose(sgw(x[:, q], 4, p), sgw(x, 4, q[p])[:, q], atol=1e-10)
    # and the shuffle matters: another permutation groups other channels together
    assert not torch.allclose(sgw(x, 4, p), sgw(x, 4, q), atol=1e-3)


def test_no_gradient_through_the_covariance():
    x = random_x().requires_grad_(True)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(3))
    weights = torch.randn(32, 12, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (sgw(x, 3, perm) * weights).sum().backward()
    # Manual: W computed once as a constant, gradient only through the centring and X W.
    x2 = x.detach().clone().requires_grad_(True)
    blocks = x.detach()[:, perm].reshape(32, 3, 4)
    constants = []
    for g in range(3):
        c = blocks[:, g] - blocks[:, g].mean(0)
        values, vectors = torch.linalg.eigh(c.T @ c / 32)
        constants.append(vectors @ torch.diag(values.rsqrt()) @ vectors.T)
    grouped = x2[:, perm].reshape(32, 3, 4)
    outs = [(grouped[:, g] - grouped[:, g].mean(0)) @ constants[g] for g in range(3)]
    manual = torch.cat(outs, dim=1)[:, torch.argsort(perm)]
    (manual * weights).sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-8)


def test_closed_form_2x2_is_the_eigh_zca_matrix_to_its_condition_times_fp32_rounding():
    """Groups of 2 channels (the recipes') are whitened without eigh (which reads the host: no CUDA graph), by
    C^-1/2 in closed form. Against float64 eigh's U diag(lambda^-1/2) U^T, for covariances whose condition kappa runs
    from 1 to 1e4: both compute from the same fp32 entries, whose rounding (u = 6e-8) the inverse square root
    amplifies by up to kappa (det C = ac - b^2 cancels by that much), so they agree to 10 kappa u of the matrix. The
    whole whitening in groups of 2, float64 closed form against numpy's eigh, to 1e-12."""
    g = torch.Generator().manual_seed(0)
    for kappa in (1.0, 10.0, 1e2, 1e3, 1e4):
        angle = torch.rand(64, generator=g) * math.pi
        rotation = torch.stack([angle.cos(), -angle.sin(), angle.sin(), angle.cos()], -1).view(-1, 2, 2)
        scale = torch.rand(64, 1, generator=g) * 3 + 0.1
        covariance = rotation @ torch.diag_embed(torch.cat([scale, scale / kappa], 1)) @ rotation.transpose(1, 2)
        covariance = covariance.float()
        values, vectors = torch.linalg.eigh(covariance.double())
        reference = vectors @ torch.diag_embed(values.rsqrt()) @ vectors.transpose(1, 2)
        got = whitenedcse.inverse_sqrt_2x2(covariance).double()
        error = (got - reference).flatten(1).norm(dim=1) / reference.flatten(1).norm(dim=1)
        assert error.max() <= 10 * kappa * 2.0 ** -24, (kappa, error.max())
    x = random_x()
    np.testing.assert_allclose(sgw(x, 6, torch.arange(12)).numpy(), numpy_group_whitening(x.numpy(), 6), atol=1e-12)


def test_closed_form_2x2_clamps_each_eigenvalue_at_eighs_floor():
    """A group whose covariance is singular or nearly so (channel 2 = 2 x channel 1, or that plus noise of 1e-7:
    smallest eigenvalue far below 1e-12) whitens as eigh's path does, each eigenvalue clamped at 1e-12: the same
    matrix (norm 1e6, not the 1.5e12 of a clamp on the determinant) to float64's rounding, and to fp32's rounding of
    the norm from fp32 entries; a well-conditioned group keeps the plain closed form bit for bit. Fails where the
    clamp is on det C (the 1e-24 floor) instead of on each eigenvalue."""
    def eigh_path(covariance):  # shuffled_group_whitening's eigh branch
        values, vectors = torch.linalg.eigh(covariance.double())
        return vectors @ torch.diag_embed(values.clamp_min(1e-12).rsqrt()) @ vectors.transpose(1, 2)

    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 1, generator=g, dtype=torch.float64)
    near = 2 * x + 1e-7 * torch.randn(8, 1, generator=g, dtype=torch.float64)
    groups = {"rank-deficient": torch.cat([x, 2 * x], 1), "nearly singular": torch.cat([x, near], 1),
              "zero": torch.zeros(8, 2, dtype=torch.float64)}
    groups.update({f"variance {scale:g}": torch.randn(8, 2, generator=g, dtype=torch.float64) * scale
                   for scale in (1e-14, 1e-16, 1e-17)})  # every eigenvalue below the floor: 1e6 I
    for name, columns in groups.items():
        for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
            centred = (columns - columns.mean(0)).to(dtype)
            covariance = (centred.T @ centred / 8)[None]
            reference, got = eigh_path(covariance), whitenedcse.inverse_sqrt_2x2(covariance).double()
            assert reference.norm() > 9e5, name  # the floor is reached
            assert (got - reference).norm() <= tolerance * reference.norm(), (name, dtype, got, reference)
    covariance = torch.tensor([[[2.0, 0.3], [0.3, 0.5]]])  # well-conditioned: the closed form as it was
    a, b, c = covariance[:, 0, 0], covariance[:, 0, 1], covariance[:, 1, 1]
    s = (a * c - b * b).clamp_min(1e-24).sqrt()  # the form before the per-eigenvalue clamp, as it was
    plain = torch.stack([c + s, -b, -b, a + s], dim=-1).view(-1, 2, 2) / (s * (a + c + 2 * s).sqrt())[:, None, None]
    assert torch.equal(whitenedcse.inverse_sqrt_2x2(covariance), plain)


def test_eigendecomposition_runs_in_fp32_under_autocast():
    x = random_x(d=8).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sgw(x, 4, torch.arange(8))
    assert torch.isfinite(out).all()


def test_bad_shapes_are_clear_errors():
    x = random_x(n=4, d=12)
    with pytest.raises(ValueError, match="equal groups"):
        sgw(x, 5, torch.arange(12))
    with pytest.raises(ValueError, match="singular"):
        sgw(x, 2, torch.arange(12))  # groups of 6 channels, batch of 4
    assert torch.isfinite(sgw(x, 2, torch.arange(12), eps=1e-3)).all()


def loop_multi_positive(views, temp):
    def cos(a, b):
        return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
    views = [v.double().numpy() for v in views]
    total = 0.0
    for z in views[1:]:
        for i in range(len(z)):
            logits = [cos(views[0][i], z[j]) / temp for j in range(len(z))]
            total += (-logits[i] + math.log(sum(math.exp(l) for l in logits))) / len(z)
    return total


@pytest.mark.parametrize("m", [2, 3, 5])
def test_multi_positive_info_nce_matches_loop(m):
    g = torch.Generator().manual_seed(m)
    views = [torch.randn(6, 4, generator=g) for _ in range(m)]
    assert whitenedcse.multi_positive_info_nce(views, 0.05).item() == pytest.approx(loop_multi_positive(views, 0.05),
                                                                                     rel=1e-5)


def test_two_views_equal_info_nce():
    g = torch.Generator().manual_seed(0)
    z1, z2 = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    assert torch.equal(whitenedcse.multi_positive_info_nce([z1, z2], 0.05), simcse.info_nce(z1, z2, 0.05))


def test_group_count_must_divide_hidden_size(tiny_model, corpus, senteval_dir, tmp_path):
    import whitenedcse
    code, stderr = cli_in_process(whitenedcse, *smoke_args(tiny_model, corpus, senteval_dir, tmp_path),
                                  "--num_groups", 5)
    assert code == 2 and "--num_groups 16" in stderr and len(stderr.strip().splitlines()) == 1, stderr


def test_smoke_run(tiny_model, corpus, senteval_dir, tmp_path):
    out = tmp_path / "w"
    proc = run_script("whitenedcse.py", *smoke_args(tiny_model, corpus, senteval_dir, out), "--num_groups", 16)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["eval_pooler"] == "cls_before_pooler" and results["args"]["num_pos"] == 3
    assert in_process_scores(eval_sts, "--model_name_or_path", out / "best", "--senteval_dir", senteval_dir,
                             "--pooler", "cls_before_pooler") == results["test"]


def test_batch_narrower_than_a_group_is_skipped(tiny_model, senteval_dir, tmp_path, capsys):
    """10 sentences at batch 4 with groups of 2 channels: the last batch (2 rows) cannot be whitened (in-process: the
    CLI has its own subprocess test)."""
    import whitenedcse
    ten = tmp_path / "ten.txt"
    ten.write_text("\n".join(f"the man {w} the dog" for w in "runs walks eats plays sings reads swims jumps".split()
                             + ["sleeps", "sits"]) + "\n")
    out = tmp_path / "w"
    whitenedcse.main([str(a) for a in ["--model_name_or_path", tiny_model, "--train_file", ten, "--senteval_dir",
                                       senteval_dir, "--batch_size", 4, "--eval_steps", 100, "--num_groups", 16,
                                       "--output_dir", out, "--device", "cpu", "--no_test_eval"]])
    assert json.loads((out / "results.json").read_text())["steps"] == 2
    assert capsys.readouterr().out.count("it is skipped") == 1
