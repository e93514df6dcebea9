"""simcse.py end to end on the tiny model, the supervised path, and the one-line errors."""
import csv
import json
import random

import numpy as np
import pytest

import common
import simcse
import data
import eval_sts
import plumbing
from conftest import (SHARED, cli_in_process, gates, in_process_scores, needs_shared, offline_cli, random_sentence,
                      run_script, smoke_args, write_nli)


def test_unsupervised_smoke_run_writes_loadable_checkpoint(tiny_model, corpus, senteval_dir, tmp_path):
    out = tmp_path / "run"
    proc = run_script("simcse.py", *smoke_args(tiny_model, corpus, senteval_dir, out))
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "results.json").read_text())
    assert [s for s, _ in gates(results)] == [0, 2, 4] and results["precision"] == "fp32"
    assert [row["step"] for row in results["trajectory"]] == [0, 2, 4]
    assert results["trajectory"][-1]["train_time_s"] == pytest.approx(results["train_time_s"], abs=0.01)
    assert results["best_dev_stsb"] == max(v for _, v in gates(results))
    assert results["best_step"] in (0, 2, 4) and results["steps"] == 4 and results["steps_per_second"] > 0
    assert len(results["train_loss"]) == 4 and results["interrupted"] is False
    assert set(results["test"]) == set(eval_sts.TASKS) | {"avg"}
    assert results["eval_pooler"] == "cls_before_pooler" and results["peak_memory_mb"] > 0
    assert set(results["align_uniform"]) == {"initial", "best"}
    # The checkpoint reproduces the test scores exactly through eval_sts.py's own loading path (fp32 both).
    assert in_process_scores(eval_sts, "--model_name_or_path", out / "best", "--senteval_dir", senteval_dir,
                             "--pooler", "cls_before_pooler") == results["test"]
    # ... and the best gate's STS-B dev score and l_align / l_uniform (the training model, its prebuilt mask)
    best_gate = next(row for row in results["trajectory"] if row["step"] == results["best_step"])
    assert in_process_scores(eval_sts, "--model_name_or_path", out / "best", "--senteval_dir", senteval_dir,
                             "--mode", "dev", "--tasks", "STSBenchmark")["STSBenchmark"] == best_gate["stsb_dev"]
    assert results["align_uniform"]["best"] == {"align": best_gate["align"], "uniform": best_gate["uniform"]}
    assert json.loads((out / "best" / "1_Pooling" / "config.json").read_text())["pooling_mode_cls_token"] is True
    assert sorted(p.name for p in out.iterdir()) == ["best", "results.json", "started.json"]  # no temporary leftovers
    # where the numbers came from, and what the checkpoint says of itself
    made = results["provenance"]
    assert set(made) == {"git", "versions", "device_name", "precision", "processes", "started", "ended"}
    assert set(made["versions"]) == {"python", "torch", "transformers", "datasets", "sentence-transformers"}
    assert made["precision"] == "fp32" and made["processes"] == 1 and made["started"] <= made["ended"]
    assert made["git"] == "not a git checkout" or len(made["git"]["commit"]) == 40
    command = results["args"]["command"]
    assert command.startswith("python simcse.py --model_name_or_path ") and command.endswith("--device cpu")
    card = (out / "best" / "README.md").read_text()
    from plumbing import provenance
    shown = provenance.without_local_paths(command)  # the card names no path of this disk
    assert shown != command and str(tmp_path) not in card and "--model_name_or_path .../tiny_bert" in shown
    for needed in ("SimCSE: Simple Contrastive Learning of Sentence Embeddings", shown, "**`cls_before_pooler`**",
                   "@inproceedings{gao2021simcse", f"| {results['test']['avg']:.2f} |", "library_name: "
                   "sentence-transformers", f"best STS-B dev Spearman {results['best_dev_stsb']:.2f}"):
        assert needed in card, needed


def test_ten_sentences_at_batch_four_are_three_steps_an_epoch(tiny_model, senteval_dir, tmp_path):
    """The last incomplete batch is kept (the Trainer's dataloader_drop_last=False): 4 + 4 + 2."""
    ten = tmp_path / "ten.txt"
    ten.write_text("\n".join(random_sentence(random.Random(i)) for i in range(10)) + "\n")
    out = tmp_path / "ten"
    args = ["--model_name_or_path", tiny_model, "--train_file", ten, "--senteval_dir", senteval_dir, "--batch_size",
            4, "--eval_steps", 100, "--output_dir", out, "--device", "cpu", "--no_test_eval"]
    import simcse  # in-process: the CLI has its own subprocess tests
    simcse.main([str(a) for a in args])
    assert json.loads((out / "results.json").read_text())["steps"] == 3
    simcse.main([str(a) for a in args + ["--epochs", 2, "--overwrite_output_dir"]])
    assert json.loads((out / "results.json").read_text())["steps"] == 6


def test_supervised_smoke_run(tiny_model, senteval_dir, tmp_path):
    nli = write_nli(tmp_path / "nli.csv")
    out = tmp_path / "sup"
    import simcse  # in-process: the CLI has its own subprocess test (the unsupervised smoke run)
    simcse.main([str(a) for a in ["--supervised", *smoke_args(tiny_model, nli, senteval_dir, out)]])
    results = json.loads((out / "results.json").read_text())
    assert results["eval_pooler"] == "cls" and results["args"]["lr"] == 5e-5
    # eval pooler "cls" is the trained MLP, saved as BERT's pooler: eval_sts --pooler cls reproduces the test row.
    assert in_process_scores(eval_sts, "--model_name_or_path", out / "best", "--senteval_dir", senteval_dir,
                             "--pooler", "cls") == results["test"]


def test_supervised_pairs_only_ignore_the_hard_negatives(tiny_model, senteval_dir, tmp_path):
    """Table 4's positive pairs: --no_hard_negatives on triplets trains exactly as the same pairs without the
    hard_neg column, and unlike the triplets."""
    import simcse
    nli = write_nli(tmp_path / "nli.csv", 16)
    rows = list(csv.reader(open(nli)))
    pairs = tmp_path / "pairs.csv"
    with open(pairs, "w", newline="") as f:
        csv.writer(f).writerows([row[:2] for row in rows])
    losses = {}
    for name, train_file, extra in (("triplets", nli, []), ("no_hard", nli, ["--no_hard_negatives"]),
                                    ("pairs", pairs, [])):
        out = tmp_path / name
        simcse.main([str(a) for a in smoke_args(tiny_model, train_file, senteval_dir, out, "--supervised", "--max_steps",
                                                2, "--no_test_eval", *extra)])
        losses[name] = json.loads((out / "results.json").read_text())["train_loss"]
    assert losses["no_hard"] == losses["pairs"] != losses["triplets"]
    with pytest.raises(SystemExit):
        simcse.parse_args(["--no_hard_negatives"])


@pytest.mark.parametrize("supervised", [False, True])
def test_sentence_transformers_matches_eval_sts(tiny_model, corpus, senteval_dir, tmp_path, supervised):
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    out = tmp_path / "run"
    data, extra, pooler = (write_nli(tmp_path / "nli.csv"), ["--supervised"], "cls") if supervised else \
        (corpus, [], "cls_before_pooler")
    import simcse  # in-process: the CLI has its own subprocess tests
    simcse.main([str(a) for a in [*extra, *smoke_args(tiny_model, data, senteval_dir, out)]])
    from transformers import AutoModel, AutoTokenizer
    sentences = ["a man runs in the park", "the dog eats"]
    best = out / "best"
    tok, backbone = AutoTokenizer.from_pretrained(best), AutoModel.from_pretrained(best).eval()
    encode = common.Encoder(backbone, None, tok, pooler, "cpu")
    np.testing.assert_allclose(st.SentenceTransformer(str(best), device="cpu").encode(sentences), encode(sentences),
                               atol=1e-5)


def one_line_error(outcome, needle):
    code, stderr = outcome
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert needle in stderr, stderr


def test_offline_without_local_paths_names_the_flags(tmp_path, monkeypatch):
    """simcse.py as a user runs it, offline with an empty cache: one line, nothing else on stderr (a library's
    warning written there at import, which a test in this process would not see, fails it); eval_sts.py the same
    in this process (conftest.offline_cli; its real CLI's one line: test_missing_senteval_dir_is_one_line), naming
    its own flags only (it named --train_file, which eval_sts.py does not have)."""
    proc = run_script("simcse.py", "--output_dir", tmp_path, env_extra={"HF_HOME": str(tmp_path / "hf")})
    one_line_error((proc.returncode, proc.stderr), "--train_file")
    assert "--model_name_or_path, --train_file and --senteval_dir" in proc.stderr
    local_senteval = ["--senteval_dir", str(SHARED / "data" / "senteval")] if SHARED.is_dir() else None
    for args in filter(None, (["--model_name_or_path", "bert-base-uncased"],
                              local_senteval and ["--model_name_or_path", "bert-base-uncased", *local_senteval])):
        code, stderr = offline_cli(eval_sts, monkeypatch, tmp_path / "hf", *args)
        one_line_error((code, stderr), "--model_name_or_path and --senteval_dir")
        assert "--train_file" not in stderr


def test_diverging_loss_stops_with_the_first_bad_step(tiny_model, corpus, senteval_dir, tmp_path, capsys):
    """Losses are read from the device at log and dev steps only (here step 4), yet the error names step 2, the
    first NaN: step 1's update (lr 1e30, no clipping) is what breaks the model."""
    import simcse  # in-process, as plumbing.cli runs main(): each script's CLI has its own subprocess tests
    code, stderr = cli_in_process(simcse, *smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "o"), "--lr",
                                  "1e30", "--max_grad_norm", "0", "--eval_steps", 4)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "the loss became nan at step 2:" in stderr and "--temp" not in stderr
    assert "step 1/4  loss" not in capsys.readouterr().out
    # a log step reads and checks the losses too
    args = smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "p", "--lr", "1e30", "--max_grad_norm", "0",
                      "--eval_steps", 4, "--logging_steps", 1)
    with pytest.raises(plumbing.UsageError, match="the loss became nan at step 2:"):
        simcse.main([str(a) for a in args])
    assert "step 1/4  loss" in capsys.readouterr().out


@needs_shared
def test_simcse_on_minilm_improves_over_its_start(tmp_path):
    """A short real run: the dev gate sees steps 0 and 5 and keeps the best checkpoint. Its STS-B dev split is every
    third pair of sts-dev.csv (500, its genres in their shares: a gate is 6 s of CPU, not 18); the whole split's
    untrained [CLS] figure, the README's 79.73, is held by the slow test of tests/test_eval_sts.py."""
    import simcse  # in-process: the CLI has its own subprocess tests
    out = tmp_path / "minilm"
    simcse.main([str(a) for a in ["--model_name_or_path", SHARED / "models/all-MiniLM-L6-v2", "--train_file",
                                  SHARED / "data/wiki1m_head.txt", "--senteval_dir", senteval_thirds(tmp_path),
                                  "--max_steps", 5, "--eval_steps", 5, "--batch_size", 16, "--output_dir", out,
                                  "--no_test_eval", "--no_align_uniform", "--device", "cpu"]])
    results = json.loads((out / "results.json").read_text())
    assert gates(results)[0] == [0, 80.29]  # the untrained [CLS] figure of these 500 pairs
    assert [s for s, _ in gates(results)] == [0, 5] and results["best_step"] == 5
    assert results["best_dev_stsb"] > 80.29 and (out / "best" / "model.safetensors").is_file()
    assert results["precision"] == "fp32"


def senteval_thirds(folder):
    """../shared's SentEval folder, linked file by file, but for STS-B's dev split: every third pair of it."""
    source, copy = SHARED / "data" / "senteval", folder / "senteval"
    for path in source.rglob("*"):
        if path.is_file():
            (copy / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
            (copy / path.relative_to(source)).symlink_to(path)
    dev = copy / "STS" / "STSBenchmark" / "sts-dev.csv"
    dev.unlink()
    dev.write_text("".join((source / dev.relative_to(copy)).read_text().splitlines(keepends=True)[::3]))
    return copy


def test_the_few_shot_baseline_takes_simcses_hyperparameters_and_micses_schedule():
    import simcse
    args = simcse.parse_args(["--fraction", "0.01", "--seed", "48"])
    assert (args.batch_size, args.lr, args.epochs, args.eval_steps) == (64, 3e-5, 50, 500)
    assert args.presets["source"] == "miCSE's few-shot schedule for fraction 0.01 (SimCSE's batch and lr)"
    assert data.micse_subset(args.fraction, args.seed) == "wiki_subset_1M_001.00percent_seed48.txt"
    assert simcse.parse_args(["--fraction", "0.0001", "--epochs", "3"]).epochs == 3  # the user's flag wins
    assert simcse.parse_args(["--fraction", "0.0001"]).eval_steps == 250
    assert simcse.parse_args(["--fraction", "0.5"]).presets["applied"] == {}  # not few-shot: SimCSE's defaults


def test_a_fixed_dropout_mask_gives_both_views_the_same_embeddings(tiny_model, corpus, senteval_dir, tmp_path,
                                                                   monkeypatch):
    """SimCSE Table 3's "Fixed 0.1": dropout stays on, but the pair shares its mask."""
    import torch
    import simcse
    pairs = []
    info_nce = simcse.info_nce

    def recording(z1, z2, *rest, **kw):
        pairs.append((z1.detach().clone(), z2.detach().clone()))
        return info_nce(z1, z2, *rest, **kw)

    monkeypatch.setattr(simcse, "info_nce", recording)
    args = smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "fixed", "--no_test_eval")
    simcse.main([str(a) for a in args + ["--fixed_dropout_mask"]])
    assert len(pairs) == 4 and all(torch.equal(z1, z2) for z1, z2 in pairs)
    pairs.clear()
    simcse.main([str(a) for a in args + ["--overwrite_output_dir"]])
    assert len(pairs) == 4 and not any(torch.equal(z1, z2) for z1, z2 in pairs)
    with pytest.raises(SystemExit) as exit_info:
        simcse.parse_args(["--supervised", "--fixed_dropout_mask"])  # one line: the mask is unsupervised
    assert exit_info.value.code == 2
