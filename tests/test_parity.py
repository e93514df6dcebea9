"""tools/parity.py, the suite run beside the authors' released code (#45). Without the clones: the tool's machinery
(weights, layouts, matched dropout, gradient names) gives exactly 0 for the suite against itself, and a planted change
to the suite's loss is reported. With SUITE_RELEASED_CODE naming a folder of the five clones, the comparison itself."""
import os
from pathlib import Path

import pytest
import torch

import common
import simcse
import parity
from conftest import cli_in_process

RELEASED = os.environ.get("SUITE_RELEASED_CODE")


def test_the_suite_against_itself_through_the_machinery_is_exactly_zero():
    rows = parity.self_rows()
    assert [r["name"] for r in rows] == ["self bert: step, unsupervised SimCSE", "self roberta: step, unsupervised SimCSE"]
    for r in rows:
        assert r["loss_abs"] == 0.0 and r["grad_abs"] == 0.0 and r["gradients"] > 50, r


def test_a_planted_change_to_the_suites_loss_is_reported(monkeypatch, capsys):
    real = simcse.info_nce
    monkeypatch.setattr(simcse, "info_nce", lambda z1, z2, temp=0.05, *rest: real(z1, z2, temp * 1.01, *rest))
    assert parity.main(["--self"]) == 1
    out = capsys.readouterr().out
    assert out.count("| DIFFERS |") == 2 and "2 differ beyond the tolerance" in out


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


def test_without_the_released_code_it_says_how_to_get_it(tmp_path):
    code, err = cli_in_process(parity, "--released", tmp_path)
    assert code == 2 and "is not a clone of princeton-nlp/SimCSE" in err and "git clone" in err
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


@pytest.mark.skipif(not RELEASED, reason="set SUITE_RELEASED_CODE to a folder holding clones of the five released "
                                         "repositories (SimCSE, SimCSE-plus-plus, SSCL, WhitenedCSE, acl2023-micse)")
def test_the_released_code_agrees_but_for_the_documented_deviations(tmp_path):
    pytest.importorskip("einops", reason="miCSE's released code imports einops")
    assert parity.main(["--released", RELEASED, "--json", str(tmp_path / "parity.json")]) == 0
    assert Path(tmp_path / "parity.json").is_file()
