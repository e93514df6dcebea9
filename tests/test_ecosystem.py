"""Where researchers already work (#59): W&B and MLflow tracking (offline, under a resume), MTEB on a checkpoint, a
Hub-ready model card read back by huggingface_hub's own parsers, --fit_memory's choice, and the trained model in use
in sentence-transformers and transformers."""
import importlib.util
import json
import types

import numpy as np
import pytest
import torch

import simcse
from conftest import smoke_args
from plumbing import provenance


@pytest.fixture(scope="module")
def finished_run(tiny_model, corpus, senteval_dir, tmp_path_factory):
    """A tiny SimCSE run with its final evaluation: its folder."""
    out = tmp_path_factory.mktemp("ecosystem") / "run"
    simcse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--no_align_uniform")])
    return out


def test_the_model_card_metadata_is_the_hubs_and_holds_the_test_scores(finished_run):
    """Expected: huggingface_hub's ModelCard parses best/README.md: library sentence-transformers, the pipeline tag,
    the tags, and a model-index whose results are each STS test task's Spearman as results.json has it; a local
    base model and a local --train_file are not named as Hub ids."""
    from huggingface_hub import ModelCard
    results = json.loads((finished_run / "results.json").read_text())
    card = ModelCard.load(finished_run / "best" / "README.md")
    assert card.data.library_name == "sentence-transformers" and card.data.pipeline_tag == "sentence-similarity"
    assert {"sentence-embeddings", "contrastive-learning", "simcse"} <= set(card.data.tags)
    assert card.data.base_model is None and card.data.datasets is None
    found = {r.dataset_name: (r.dataset_type, r.dataset_split, r.metric_type, r.metric_value)
             for r in card.data.eval_results}
    assert found == {task: (provenance.STS_DATASETS[task], "test", "spearman", score)
                     for task, score in results["test"].items() if task != "avg"}
    assert "## Scores" in card.text  # the prose stays


def test_a_hub_base_model_and_the_authors_data_are_named_with_the_license():
    from huggingface_hub import ModelCardData
    import yaml
    for method, fraction, dataset in (("simcse", 1.0, "princeton-nlp/datasets-for-simcse"),
                                      ("micse", 0.01, "sap-ai-research/datasets-for-micse")):
        args = types.SimpleNamespace(method=method, model_name_or_path="roberta-base", train_file=None,
                                     fraction=fraction)
        data = ModelCardData(**yaml.safe_load(provenance.hub_metadata(args, method, "Title: x", {}, False)))
        assert data.base_model == "roberta-base" and data.license == "mit" and data.datasets == [dataset]
        assert data.library_name == "transformers" and data.eval_results is None


def test_the_trained_model_in_use_as_docs_show_it(finished_run):
    """docs/using.md's code on a tiny best/: sentence-transformers' encode, similarity and semantic_search (what the
    released simcse package's encode / similarity / search do), and transformers with the recorded pooler, which
    gives sentence-transformers' embeddings."""
    from sentence_transformers import SentenceTransformer, util
    from transformers import AutoModel, AutoTokenizer
    best = str(finished_run / "best")
    corpus = ["A man is playing a guitar.", "A woman is slicing an onion.", "The cat sleeps on the sofa.",
              "Someone plays an instrument."]
    model = SentenceTransformer(best, device="cpu")
    embeddings = model.encode(corpus, convert_to_tensor=True)
    scores = model.similarity(embeddings[:1], embeddings)  # cosine similarity, as the suite scores STS
    assert scores.shape == (1, 4) and scores[0, 0] == pytest.approx(1.0, abs=1e-5)
    hits = util.semantic_search(model.encode(["A person plays music."], convert_to_tensor=True), embeddings, top_k=2)
    assert len(hits[0]) == 2 and hits[0][0]["score"] >= hits[0][1]["score"]
    # transformers alone: the pooler best/eval_pooler.json records
    pooler = json.loads((finished_run / "best" / "eval_pooler.json").read_text())["pooler"]
    tokenizer, encoder = AutoTokenizer.from_pretrained(best), AutoModel.from_pretrained(best).eval()
    batch = tokenizer(corpus, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = encoder(**batch).last_hidden_state
    assert pooler == "cls_before_pooler"  # SimCSE unsupervised: [CLS] without the MLP head
    vectors = hidden[:, 0]
    np.testing.assert_allclose(vectors.numpy(), embeddings.numpy(), atol=1e-5)


def test_fit_memory_switches_on_the_first_exact_setting_that_fits_and_a_resume_keeps_it(
        tiny_model, corpus, senteval_dir, tmp_path, monkeypatch, capsys):
    """--fit_memory with a GPU's free memory given (the CPU has no figure): the estimate of this command (batch 64)
    exceeds it, recomputation alone does not fit, GradCache's parts of 32 do; the run says so in one line, trains
    with them, and records the choice; stopped and resumed where the GPU has room, it keeps parts of 32."""
    import test_resume
    import transformers
    from plumbing import memory
    argv = [str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "run", "--batch_size", 64,
                                       "--max_steps", 4, "--no_test_eval", "--no_align_uniform", "--fit_memory")]
    args = simcse.parse_args(argv)
    args.precision = "fp32"
    config = transformers.AutoConfig.from_pretrained(str(tiny_model))
    step = memory.estimate(args, config)["step"]
    capacity = int(0.6 * step)  # usable bytes: what the GPU's free memory leaves after the context and 10%
    free = memory.CONTEXT + int(capacity / (1 - memory.FRAGMENTATION)) + 1
    monkeypatch.setattr(memory, "device_free", lambda device: free)
    test_resume.run("simcse", argv, monkeypatch, stop_at=2)
    line = [l for l in capsys.readouterr().out.splitlines() if "--fit_memory" in l]
    assert len(line) == 1 and line[0].startswith("memory: --fit_memory switched on --micro_batch_size 32: the same "
                                                 "objective in about"), line
    monkeypatch.setattr(memory, "device_free", lambda device: 2 ** 40)  # room for anything now
    test_resume.run("simcse", argv + ["--resume"], monkeypatch)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["args"]["micro_batch_size"] == 32 and not results["args"]["gradient_checkpointing"]
    assert results["fit_memory"] == {"chose": "--micro_batch_size 32", "at": "the run's start"}
    assert results["resumptions"] == [2] and results["steps"] == 4
    assert "--micro_batch_size 32 (GradCache" in json.dumps(results["summary"])  # the run's summary says it
