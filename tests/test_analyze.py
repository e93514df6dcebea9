"""analyze.py: each measurement against a hand-computed case, SetSim shared with sscl.py, and the CLI end to end."""
import json
import math

import numpy as np
import pytest
import torch

import analyze
import sscl
import plumbing
from conftest import smoke_args

pytest.importorskip("matplotlib", reason="analyze.py draws with matplotlib (requirements.txt)")


def test_spectrum_of_a_known_matrix():
    """U diag(4, 2, 1) V^T with orthonormal U, V: singular values 4, 2, 1, divided by the largest."""
    rng = np.random.default_rng(0)
    u, _ = np.linalg.qr(rng.normal(size=(6, 3)))
    v, _ = np.linalg.qr(rng.normal(size=(5, 3)))
    matrix = u @ np.diag([2.0, 4.0, 1.0]) @ v.T
    np.testing.assert_allclose(analyze.spectrum(matrix)[:3], [1.0, 0.5, 0.25], atol=1e-12)
    np.testing.assert_allclose(analyze.spectrum(matrix)[3:], 0.0, atol=1e-12)  # rank 3 of 5 columns


def test_effective_rank_hand_checked():
    assert analyze.effective_rank(np.ones(7)) == pytest.approx(7.0)  # the identity's singular values
    assert analyze.effective_rank(analyze.spectrum(np.eye(5))) == pytest.approx(5.0)
    assert analyze.effective_rank([3.0, 0.0, 0.0]) == pytest.approx(1.0)
    # p = (1/2, 1/4, 1/4): H = 1.5 ln 2, exp(H) = 2^1.5
    assert analyze.effective_rank([2.0, 1.0, 1.0]) == pytest.approx(2 ** 1.5)


def test_unit_rows_and_spectrum_ignore_row_scale():
    rows = np.array([[3.0, 4.0], [0.0, 2.0], [1.0, 1.0]])
    np.testing.assert_allclose(np.linalg.norm(analyze.unit_rows(rows), axis=1), 1.0)
    scaled = rows * np.array([[10.0], [0.5], [2.0]])
    np.testing.assert_allclose(analyze.spectrum(analyze.unit_rows(scaled)), analyze.spectrum(analyze.unit_rows(rows)))


def test_similarity_groups_hand_checked():
    gold = [0.0, 0.99, 1.0, 2.5, 4.0, 5.0]
    cosines = [0.1, 0.3, 0.5, 0.6, 0.8, 1.0]
    groups = analyze.similarity_groups(cosines, gold)
    assert [g["gold"] for g in groups] == ["0-1", "1-2", "2-3", "3-4", "4-5"]
    assert [g["count"] for g in groups] == [2, 1, 1, 0, 2]  # 5.0 belongs to the last group, 1.0 to the second
    assert groups[0]["mean"] == pytest.approx(0.2) and groups[0]["std"] == pytest.approx(0.1)
    assert groups[4]["cosines"] == [0.8, 1.0] and groups[3]["mean"] is None


def test_set_sim_of_identical_layers_is_one_and_a_hand_built_case():
    mask = torch.tensor([[1, 1], [1, 0]])
    layer = torch.randn(2, 2, 4)
    assert torch.allclose(sscl.set_sim((layer, layer, layer, layer), mask, "avg"), torch.ones(2, 2))
    h1 = torch.tensor([[[1., 0.], [1., 0.]], [[1., 0.], [5., 5.]]])
    h2 = torch.tensor([[[0., 1.], [0., 1.]], [[1., 1.], [9., 9.]]])
    h3 = torch.tensor([[[0., 2.], [0., 2.]], [[2., 2.], [0., 0.]]])
    hidden = (torch.zeros(2, 2, 2), h1, h2, h3)
    s = 1 / math.sqrt(2)
    # avg: sentence 2 masks its second token; cls: the first token, before any MLP
    for pooler in ("avg", "cls", "cls_before_pooler"):
        assert torch.allclose(sscl.set_sim(hidden, mask, pooler), torch.tensor([[0.0, s], [1.0, 1.0]]), atol=1e-6)


def test_trajectory_points_in_time_order_and_from_the_older_format():
    rows = [{"step": 0, "train_time_s": 0.0, "lr": 1.0, "stsb_dev": 70.0, "align": 0.2, "uniform": -2.0,
             "gate": True},
            {"step": 5, "train_time_s": 1.0, "lr": 0.5},  # a log step: no point
            {"step": 10, "train_time_s": 2.0, "lr": 0.0, "stsb_dev": 71.0, "align": 0.3, "uniform": -3.0,
             "gate": True}]
    assert analyze.trajectory_points({"trajectory": rows}) == [{"step": 0, "align": 0.2, "uniform": -2.0},
                                                               {"step": 10, "align": 0.3, "uniform": -3.0}]
    old = {"dev_curve": [[0, 70.0], [10, 71.0]], "best_step": 10,
           "align_uniform": {"initial": {"align": 0.2, "uniform": -2.0}, "best": {"align": 0.3, "uniform": -3.0}}}
    assert analyze.trajectory_points(old) == [{"step": 0, "align": 0.2, "uniform": -2.0},
                                              {"step": 10, "align": 0.3, "uniform": -3.0}]


@pytest.fixture(scope="module")
def sscl_run(tiny_model, corpus, senteval_dir, tmp_path_factory):
    import sscl
    out = tmp_path_factory.mktemp("analyze") / "sscl"
    sscl.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--no_test_eval", "--neg_layers", 1,
                                          "--report_oversmoothing", "--align_uniform_steps", 1)])
    return out


def is_png(path):
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trajectory_cli(sscl_run, tmp_path, capsys):
    analyze.main(["trajectory", str(sscl_run / "results.json"), "--labels", "sscl", "--out", str(tmp_path)])
    assert is_png(tmp_path / "trajectory.png")
    points = json.loads((tmp_path / "trajectory.json").read_text())["results"]["sscl"]
    assert [p["step"] for p in points] == [0, 1, 2, 3, 4]
    with pytest.raises(plumbing.UsageError, match="exists; pass --overwrite"):
        analyze.main(["trajectory", str(sscl_run / "results.json"), "--out", str(tmp_path)])


def test_setsim_cli_is_what_sscl_reports(sscl_run, tiny_model, senteval_dir, tmp_path):
    """One implementation: analyze.py setsim on a run's best/ gives that run's own --report_oversmoothing numbers,
    and on the pretrained model the run's "before"."""
    analyze.main(["setsim", str(sscl_run / "results.json"), "--model_name_or_path", str(tiny_model), "--pooler",
                  "avg", "--labels", "best", "initial", "--senteval_dir", str(senteval_dir), "--out", str(tmp_path),
                  "--device", "cpu"])
    measured = json.loads((tmp_path / "setsim.json").read_text())["results"]
    reported = json.loads((sscl_run / "results.json").read_text())["setsim"]
    assert measured == {"best": reported["after"], "initial": reported["before"]}
    assert is_png(tmp_path / "setsim.png")


@pytest.mark.parametrize("analysis", ["spectrum", "similarity"])
def test_spectrum_and_similarity_cli(analysis, sscl_run, tiny_model, senteval_dir, tmp_path):
    analyze.main([analysis, "--model_name_or_path", str(tiny_model), str(sscl_run / "best"), "--pooler", "avg",
                  "--senteval_dir", str(senteval_dir), "--out", str(tmp_path), "--device", "cpu"])
    assert is_png(tmp_path / f"{analysis}.png")
    results = json.loads((tmp_path / f"{analysis}.json").read_text())["results"]
    assert list(results) == [str(tiny_model), str(sscl_run / "best")]
    import eval_sts
    pairs = eval_sts.load_pairs(senteval_dir, "STSBenchmark", "test")
    for measured in results.values():
        if analysis == "spectrum":
            values = measured["singular_values"]
            assert values[0] == 1.0 and values == sorted(values, reverse=True)
            assert 1.0 <= measured["effective_rank"] <= min(measured["sentences"], 32)  # tiny model: 32 wide
        else:
            assert measured["gold"] == [p[2] for p in pairs] and len(measured["cosine"]) == len(pairs)
            assert sum(g["count"] for g in measured["groups"]) == len(pairs)


def test_cli_errors_are_one_line(sscl_run, tmp_path):
    with pytest.raises(plumbing.UsageError, match="--labels: 1 given for 2 lines"):
        analyze.main(["spectrum", "--model_name_or_path", "a", "b", "--labels", "x", "--out", str(tmp_path)])
    with pytest.raises(plumbing.UsageError, match="--pooler: give one for all models or one for each of the 2"):
        analyze.main(["spectrum", "--model_name_or_path", "a", "b", "--pooler", "avg", "cls", "avg",
                      "--out", str(tmp_path)])
    with pytest.raises(plumbing.UsageError, match="trajectory reads runs' results.json files"):
        analyze.main(["trajectory", "--model_name_or_path", "a", "--out", str(tmp_path)])
    with pytest.raises(plumbing.UsageError, match="no such file"):
        analyze.main(["trajectory", str(tmp_path / "missing.json"), "--out", str(tmp_path)])
    with pytest.raises(plumbing.UsageError, match="same label"):
        analyze.main(["similarity", "--model_name_or_path", "a", "a", "--out", str(tmp_path)])
    # a truncated file, a JSON that is not an object, a file of another kind, a folder: one line each
    (tmp_path / "truncated.json").write_text('{"method": "simcse", "best_st')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "scores.json").write_text('{"STS12": 60.0, "avg": 70.0}')  # eval_sts.py --json, not a run
    for name, needle in (("truncated.json", "is not a results.json"), ("list.json", "a JSON list"),
                         ("scores.json", "another file"), (".", "is a folder")):
        with pytest.raises(plumbing.UsageError, match=needle):
            analyze.main(["trajectory", str(tmp_path / name), "--out", str(tmp_path / "out")])
