"""tools/parity.py, the suite run beside the authors' released code (#45, #90), from ../shared/released (SimCSE, SSCL,
acl2023-micse; or SUITE_RELEASED_CODE naming a folder of clones): one step of each present method on tiny models, a
planted change to the suite's loss reported, and 3 steps of SimCSE and miCSE on MiniLM's real weights, step by step."""
import json
import os
from pathlib import Path

import pytest
import torch

import simcse
import parity
from conftest import SHARED, cli_in_process, needs_shared

RELEASED = Path(os.environ.get("SUITE_RELEASED_CODE") or SHARED / "released")
needs_released = pytest.mark.skipif(not (RELEASED / "SimCSE").is_dir(), reason=f"no released code at {RELEASED} "
                                    "(../shared/released, or SUITE_RELEASED_CODE naming a folder of the clones)")


@needs_released
def test_a_planted_change_to_the_suites_loss_is_reported(monkeypatch, capsys):
    """A one-line change to the suite's InfoNCE (tau 1% off): every SimCSE row that computes it differs, exit 1."""
    real = simcse.info_nce
    monkeypatch.setattr(simcse, "info_nce", lambda z1, z2, temp=0.05, *rest: real(z1, z2, temp * 1.01, *rest))
    assert parity.main(["--released", str(RELEASED), "--only", "simcse"]) == 1
    out = capsys.readouterr().out
    assert out.count("| DIFFERS |") == 6 and "6 differ beyond the tolerance" in out


def test_matched_dropout_gives_a_row_its_mask_in_either_layout():
    """The released code flattens (sentences, views) sentence-major, the suite view-major: with matched dropout a row
    gets the same masks wherever it sits, so the two layouts give the same outputs row for row; with torch's own
    dropout (one stream, positional) they do not."""
    config = parity.tiny_config("bert")
    torch.manual_seed(0)
    encoder = parity.transformers.BertModel(config, add_pooling_layer=False).train()
    batch = parity.token_batch("bert", config, 4)
    released = {k: v.repeat_interleave(2, dim=0) for k, v in batch.items()}  # s0 v0, s0 v1, s1 v0, ...
    suite = {k: v.repeat(2, 1) for k, v in batch.items()}  # all v0, then all v1
    to_suite = torch.tensor([s * 2 + v for v in range(2) for s in range(4)])  # suite row r <- released row

    def run(inputs, keys, matched=True):
        if not matched:
            torch.manual_seed(1)
            return encoder(**inputs).last_hidden_state
        dropout = parity.MatchedDropout()
        with dropout.on(encoder):
            dropout.expect(keys)
            return encoder(**inputs).last_hidden_state
    a = run(released, parity.sentence_major(4, 2))[to_suite]
    b = run(suite, parity.view_major(4, 2))
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert not torch.allclose(a[:4], a[4:], atol=1e-3)  # the two views of a sentence differ: dropout is on
    assert not torch.allclose(run(released, None, False)[to_suite], run(suite, None, False), atol=1e-3)


def test_without_the_released_code_it_says_how_to_get_it(tmp_path, capsys):
    """An absent clone skips its rows and names the command that gets it; none at all is one line, exit 2."""
    code, err = cli_in_process(parity, "--released", tmp_path)
    assert code == 2 and "no released code found" in err and len(err.strip().splitlines()) == 1
    assert f"skipped simcse: no clone at {tmp_path / 'SimCSE'} (git clone https://github.com/princeton-nlp/SimCSE " \
        f"{tmp_path / 'SimCSE'})" in capsys.readouterr().out
    (tmp_path / "SSCL").mkdir()  # a folder that is there but not the clone: refused
    code, err = cli_in_process(parity, "--released", tmp_path)
    assert code == 2 and "is not a clone of nuochenpku/SSCL" in err and "git clone" in err
    code, err = cli_in_process(parity)
    assert code == 2 and "--released DIR" in err and len(err.strip().splitlines()) == 1
    # a clone of a fork has the file the tool loads too (SimCSE++'s simcse/models.py): its README says which it is
    fork = tmp_path / "SimCSE-plus-plus"
    (fork / "simcse").mkdir(parents=True)
    (fork / "simcse" / "models.py").write_text("")
    (fork / "README.md").write_text("# SimCSE++\nThis is the official source code of SimCSE++\n")
    code, err = cli_in_process(parity, "--simcse", fork)
    assert code == 2 and err.strip() == f"error: {fork} is not a clone of princeton-nlp/SimCSE: its README's title " \
        f"is 'SimCSE++', not 'SimCSE: Simple Contrastive Learning'...: git clone " \
        f"https://github.com/princeton-nlp/SimCSE {fork}"
    (fork / "README.md").write_text("## SimCSE: Simple Contrastive Learning of Sentence Embeddings\n")
    assert parity.clones(parity_args(fork)) == {"simcse": fork}


def parity_args(simcse):
    import types
    return types.SimpleNamespace(released=None, only=None, simcse=simcse, simcsepp=None, sscl=None,
                                 whitenedcse=None, micse=None)


@needs_released
def test_the_released_code_agrees_but_for_the_documented_deviations(tmp_path, capsys):
    """One step of each present method on tiny models: a departure of the suite's loss, gradients or evaluation
    poolers from the released code's (beyond 1e-5, undocumented) exits 1; the absent clones' rows are skipped."""
    pytest.importorskip("einops", reason="miCSE's released code imports einops")
    assert parity.main(["--released", str(RELEASED), "--json", str(tmp_path / "parity.json")]) == 0
    names = [r["name"] for r in json.loads((tmp_path / "parity.json").read_text())["comparisons"]]
    present = {key for key, (github, *_) in parity.REPOSITORIES.items() if (RELEASED / github.split("/")[1]).is_dir()}
    assert {"simcse", "sscl", "micse"} <= present and {n.split()[0].rstrip(":") for n in names} == present, names
    out = capsys.readouterr().out
    assert all(f"skipped {key}: no clone at" in out for key in set(parity.REPOSITORIES) - present), out


CLONES = {"simcse": "SimCSE", "micse": "acl2023-micse", "simcsepp off-dropout": "SimCSE-plus-plus",
          "simcsepp dcl": "SimCSE-plus-plus", "whitenedcse": "WhitenedCSE"}


@needs_released
@needs_shared
@pytest.mark.parametrize("method", list(CLONES))
def test_three_steps_on_minilm_agree_step_by_step(method):
    """The released model, given the suite's weights at each step of a run on MiniLM's real weights (torch AdamW at
    the released settings, the same batches, dropout masks, AMI's samples and WhitenedCSE's shuffles): loss and every
    gradient within 1e-5 at steps 1-3, or beyond it by rounding alone as tools/parity.py judges it (the suite within
    1e-5 of the released code run in float64, or no further from it than 4 x the released code's own error: on an
    AVX-512 Xeon WhitenedCSE's step 2 is 1.5e-5 apart, on an AVX2 EPYC within 1e-5). Catches what real features or
    trained weights do to a formula that tiny random models hide (a clamp or floor that bites on real attention maps; a term's rounding on real [CLS] features), and a
    run's machinery that drifts (a step's weights, masks or samples not the suite's own). SimCSE++ and WhitenedCSE,
    which carry no licence, run where SUITE_RELEASED_CODE names a folder holding their clones (not in CI)."""
    pytest.importorskip("einops", reason="miCSE's released code imports einops")
    clone = RELEASED / CLONES[method]
    if not clone.is_dir():
        github = parity.REPOSITORIES[parity.RUNS[method][0]][0]
        pytest.skip(f"no clone at {clone} (git clone https://github.com/{github} {clone})")
    with torch.random.fork_rng(devices=[]):
        run = parity.trajectory(method, clone, SHARED / "models" / "all-MiniLM-L6-v2", 3, free=False)
    assert len(run["strict"]) == 3 and not run["free"] and "dev" not in run
    for r in run["strict"]:
        assert parity.status(r, 1e-5).startswith("ok") and r["gradients"] == 103, r
    assert len({r["loss_suite"] for r in run["strict"]}) == 3  # the weights (and batches) move from step to step
    if method == "micse":  # none of the real steps at the rho = 1 edge; a count that never counts fails on one map
        one, other = torch.randn(2, 4, 2, 2, 6, 6, generator=torch.Generator().manual_seed(0)).softmax(-1)
        assert run["rho_edge_steps"] == 0 and parity.given_samples(one, one, slice(0, 2), 20, torch.Generator())[1]
        assert not parity.given_samples(one, other, slice(0, 2), 20, torch.Generator())[1]


def test_the_2021_adamw_adds_its_eps_before_the_bias_correction():
    """transformers.AdamW (2021), as AdamW2021 writes it out: each step equals torch's AdamW at eps / sqrt(1 -
    beta2^t), the eps it applies after the bias correction. An eps added after the correction (torch's own), a bias
    correction left out or a step count that does not advance fails it."""
    g = torch.Generator().manual_seed(0)
    start = torch.randn(50, generator=g)
    grads = [torch.randn(50, generator=g) * 1e-4 for _ in range(4)]  # small: an eps of 1e-5 shows
    ours, torchs = start.clone().requires_grad_(True), start.clone().requires_grad_(True)
    old, new = parity.AdamW2021([ours], lr=1e-2, eps=1e-5), torch.optim.AdamW([torchs], lr=1e-2, eps=1e-5,
                                                                              weight_decay=0.0)
    for t, grad in enumerate(grads, 1):
        ours.grad, torchs.grad = grad.clone(), grad.clone()
        new.param_groups[0]["eps"] = 1e-5 / (1 - 0.999 ** t) ** 0.5
        old.step()
        new.step()
        torch.testing.assert_close(ours, torchs, rtol=1e-6, atol=1e-9)
    assert (ours - start).abs().max() > 1e-3  # the steps moved the weights (not a no-op)
