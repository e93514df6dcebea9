"""simcse.py end to end on the tiny model, the supervised path, and the one-line errors."""
import csv
import json
import random

import numpy as np
import pytest
import torch

import common
import eval_sts
import simcse
from conftest import SHARED, needs_shared, random_sentence, run_script, smoke_args


def test_unsupervised_smoke_run_writes_loadable_checkpoint(tiny_model, corpus, senteval_dir, tmp_path):
    out = tmp_path / "run"
    proc = run_script("simcse.py", *smoke_args(tiny_model, corpus, senteval_dir, out))
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "results.json").read_text())
    assert [s for s, _ in results["dev_curve"]] == [0, 2, 4]
    assert results["best_dev_stsb"] == max(v for _, v in results["dev_curve"])
    assert results["best_step"] in (0, 2, 4) and results["steps"] == 4 and results["steps_per_second"] > 0
    assert set(results["test"]) == set(eval_sts.TASKS) | {"avg"}
    assert results["eval_pooler"] == "cls_before_pooler" and results["peak_memory_mb"] > 0
    # The checkpoint reproduces the test scores through eval_sts.py's own loading path.
    proc = run_script("eval_sts.py", "--model_name_or_path", out, "--pooler", "cls_before_pooler",
                      "--senteval_dir", senteval_dir, "--json", tmp_path / "s.json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "s.json").read_text()) == results["test"]
    assert json.loads((out / "1_Pooling" / "config.json").read_text())["pooling_mode_cls_token"] is True


def write_nli(path, n=24):
    rng = random.Random(5)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sent0", "sent1", "hard_neg"])
        for _ in range(n):
            w.writerow([random_sentence(rng), random_sentence(rng), random_sentence(rng)])
    return path


def test_supervised_defaults_apply_unless_given():
    args = simcse.parse_args(["--supervised"])
    assert (args.batch_size, args.lr, args.epochs, args.mlp_only_train) == (512, 5e-5, 3, False)
    args = simcse.parse_args(["--supervised", "--batch_size", "16", "--mlp_only_train"])
    assert (args.batch_size, args.lr, args.mlp_only_train) == (16, 5e-5, True)
    assert simcse.parse_args([]).batch_size == 64


def test_supervised_loss_uses_hard_negatives(tiny_model):
    from transformers import AutoModel, AutoTokenizer
    tokenizer, backbone = AutoTokenizer.from_pretrained(tiny_model), AutoModel.from_pretrained(tiny_model)
    args = simcse.parse_args(["--supervised", "--hard_negative_weight", "0.5"])
    model, compute_loss = simcse.setup(args, backbone)
    model.eval()  # no dropout: the loss is then a function of the three columns' embeddings
    batch = common.Collator(tokenizer, 16)([("a man runs", "a man walks", "the cat sleeps"),
                                            ("big red ball", "a red ball", "a blue car")])
    z = model.embed(model.backbone(**common.model_inputs(batch),
                                   output_hidden_states=True).hidden_states, batch["attention_mask"])
    expected = common.info_nce(*z.chunk(3)[:2], args.temp, z.chunk(3)[2], 0.5)
    assert compute_loss(batch).item() == pytest.approx(expected.item(), rel=1e-5)


def test_supervised_smoke_run(tiny_model, senteval_dir, tmp_path):
    nli = write_nli(tmp_path / "nli.csv")
    out = tmp_path / "sup"
    proc = run_script("simcse.py", "--supervised", *smoke_args(tiny_model, nli, senteval_dir, out))
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["eval_pooler"] == "cls" and results["args"]["lr"] == 5e-5
    # eval pooler "cls" is the trained MLP, saved as BERT's pooler: eval_sts --pooler cls reproduces the test row.
    proc = run_script("eval_sts.py", "--model_name_or_path", out, "--pooler", "cls", "--senteval_dir",
                      senteval_dir, "--json", tmp_path / "s.json")
    assert json.loads((tmp_path / "s.json").read_text()) == results["test"]


@pytest.mark.parametrize("supervised", [False, True])
def test_sentence_transformers_matches_eval_sts(tiny_model, corpus, senteval_dir, tmp_path, supervised):
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    out = tmp_path / "run"
    data, extra, pooler = (write_nli(tmp_path / "nli.csv"), ["--supervised"], "cls") if supervised else \
        (corpus, [], "cls_before_pooler")
    proc = run_script("simcse.py", *extra, *smoke_args(tiny_model, data, senteval_dir, out))
    assert proc.returncode == 0, proc.stderr
    from transformers import AutoModel, AutoTokenizer
    sentences = ["a man runs in the park", "the dog eats"]
    tok, backbone = AutoTokenizer.from_pretrained(out), AutoModel.from_pretrained(out).eval()
    encode = common.pooled_encode(backbone, tok, pooler, "cpu")
    np.testing.assert_allclose(st.SentenceTransformer(str(out), device="cpu").encode(sentences), encode(sentences),
                               atol=1e-5)


def one_line_error(proc, needle):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0], lines[0]


@pytest.mark.parametrize("extra, needle", [
    (["--fraction", "0"], "--fraction"),
    (["--fraction", "1.5"], "--fraction"),
    (["--pooler", "max"], "--pooler"),
    (["--batch_size", "500"], "--batch_size"),
])
def test_bad_arguments_fail_in_one_line(tiny_model, corpus, senteval_dir, tmp_path, extra, needle):
    args = smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "o")
    one_line_error(run_script("simcse.py", *args, *extra), needle)


def test_missing_and_empty_train_files_fail_in_one_line(tiny_model, senteval_dir, tmp_path):
    one_line_error(run_script("simcse.py", *smoke_args(tiny_model, tmp_path / "nope.txt", senteval_dir, tmp_path)),
                   "no such file")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    one_line_error(run_script("simcse.py", *smoke_args(tiny_model, empty, senteval_dir, tmp_path)), "no sentences")


def test_offline_without_local_paths_names_the_flags(tmp_path):
    proc = run_script("simcse.py", "--output_dir", tmp_path, env_extra={"HF_HOME": str(tmp_path / "hf")})
    one_line_error(proc, "--train_file")
    proc = run_script("eval_sts.py", "--model_name_or_path", "bert-base-uncased",
                      env_extra={"HF_HOME": str(tmp_path / "hf")})
    one_line_error(proc, "--senteval_dir")


def test_nan_loss_stops_with_the_step_number(tiny_model, corpus, senteval_dir, tmp_path):
    one_line_error(run_script("simcse.py", *smoke_args(tiny_model, corpus, senteval_dir, tmp_path), "--temp", "0"),
                   "at step 1")


@needs_shared
def test_simcse_on_minilm_improves_over_its_start(tmp_path):
    """A short real run: the dev gate sees steps 0, 10, 20 and keeps the best checkpoint."""
    out = tmp_path / "minilm"
    proc = run_script("simcse.py", "--model_name_or_path", SHARED / "models/all-MiniLM-L6-v2", "--train_file",
                      SHARED / "data/wiki1m_head.txt", "--senteval_dir", SHARED / "data/senteval", "--max_steps", 20,
                      "--eval_steps", 10, "--batch_size", 16, "--output_dir", out)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["dev_curve"][0] == [0, 79.73]  # the untrained [CLS] dev figure from ../shared/models/README.md
    assert results["best_dev_stsb"] > 79.73
