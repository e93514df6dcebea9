"""common.py (and simcse.py's info_nce): info_nce, poolers, data and subsets, the batch sampler, dropout control, presets, the schedule."""
import math
import types

import numpy as np
import pytest
import torch

import common
import simcse
import eval_sts
import plumbing
from plumbing import resume
from plumbing import hub
import data
from plumbing import options


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
    assert simcse.info_nce(z1, z2, temp).item() == pytest.approx(loop_info_nce(z1, z2, temp), rel=1e-5)


@pytest.mark.parametrize("weight", [0.0, 1.0, -0.5])
def test_info_nce_hard_negatives_match_loop(weight):
    g = torch.Generator().manual_seed(1)
    z1, z2, z3 = (torch.randn(5, 4, generator=g) for _ in range(3))
    got = simcse.info_nce(z1, z2, 0.1, z3=z3, hard_negative_weight=weight).item()
    assert got == pytest.approx(loop_info_nce(z1, z2, 0.1, z3, weight), rel=1e-5)


def test_info_nce_hand_checked_case():
    # Orthogonal unit vectors, positives identical: logit 1/temp on the diagonal, 0 elsewhere.
    z = torch.eye(3)
    expected = -math.log(math.exp(1 / 0.5) / (math.exp(1 / 0.5) + 2))
    assert simcse.info_nce(z, z, 0.5).item() == pytest.approx(expected, rel=1e-6)


def test_info_nce_gradcheck():
    g = torch.Generator().manual_seed(2)
    z1, z2, z3 = (torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda a, b: simcse.info_nce(a, b, 0.1), (z1, z2))
    assert torch.autograd.gradcheck(lambda a, b, c: simcse.info_nce(a, b, 0.1, c, 0.7), (z1, z2, z3))


def test_poolers_on_hand_built_hidden_states():
    # 2 sentences, 3 positions, the second sentence padded after one token; hidden states of 3 "layers".
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    emb = torch.tensor([[[2., 0.], [2., 0.], [2., 0.]], [[6., 0.], [1., 1.], [1., 1.]]])
    first = torch.tensor([[[1., 0.], [3., 0.], [5., 0.]], [[2., 2.], [9., 9.], [9., 9.]]])
    last = torch.tensor([[[0., 1.], [0., 3.], [0., 8.]], [[4., 4.], [7., 7.], [7., 7.]]])
    hidden = (emb, first, last)
    assert torch.allclose(common.pool(hidden, mask, "cls_before_pooler"), torch.tensor([[0., 1.], [4., 4.]]))
    assert torch.allclose(common.pool(hidden, mask, "avg"), torch.tensor([[0., 4.], [4., 4.]]))
    assert torch.allclose(common.pool(hidden, mask, "avg_first_last"), torch.tensor([[1.5, 2.0], [3., 3.]]))
    # SimCSE++'s, SSCL's and miCSE's released first-last average: the embedding output and the last layer
    assert torch.allclose(common.pool(hidden, mask, "avg_embeddings_last"), torch.tensor([[1., 2.], [5., 2.]]))
    assert torch.allclose(common.pool(hidden, mask, "avg_top2"), torch.tensor([[1.5, 2.0], [3., 3.]]))
    pooler_output = torch.randn(2, 2)
    assert common.pool(hidden, mask, "cls", pooler_output) is pooler_output
    with pytest.raises(ValueError, match="no pooler"):
        common.pool(hidden, mask, "cls")


def test_subsample_is_deterministic_and_bounded():
    items = list(range(1000))
    a = data.subsample(items, 0.01, seed=3)
    assert a == data.subsample(items, 0.01, seed=3)
    assert a != data.subsample(items, 0.01, seed=4)
    assert len(a) == 10 and a == sorted(a) and set(a) <= set(items)
    assert len(data.subsample(items, 0.0015, seed=0)) == round(1.5)
    assert data.subsample(items, 1.0, seed=0) == items
    with pytest.raises(plumbing.UsageError, match="keeps none"):
        data.subsample(items, 0.0001, seed=0)


def args_for(train_file, **extra):
    return types.SimpleNamespace(train_file=str(train_file), fraction=1.0, seed=0, **extra)


def test_training_examples_skip_empty_lines_and_reject_bad_files(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("one\n\n  \ntwo  \n")
    examples, source, subset = data.training_examples(args_for(path))
    assert examples["text"] == ["one", "two"] and source == str(path) and subset is None
    path.write_text("\n\n")
    with pytest.raises(plumbing.UsageError, match="is empty"):
        data.training_examples(args_for(path))
    with pytest.raises(plumbing.UsageError, match="no such file"):
        data.training_examples(args_for(tmp_path / "missing.txt"))
    path.write_bytes(b"fine\nstill fine\nbad \xff byte\n")
    with pytest.raises(plumbing.UsageError, match="line 3 is not UTF-8"):
        data.training_examples(args_for(path))


def test_training_triplets_keep_na_strings_and_name_bad_rows(tmp_path):
    path = tmp_path / "nli.csv"
    path.write_text("sent0,sent1,hard_neg\nNA,None,null\na man,a person,a dog\n")
    examples, _, _ = data.training_examples(args_for(path), triplets=True)
    assert list(zip(examples["sent0"], examples["sent1"], examples["hard_neg"])) == [("NA", "None", "null"),
                                                                                 ("a man", "a person", "a dog")]
    path.write_text("sent0,sent1,hard_neg\na,b,c\nd,e\n")
    with pytest.raises(plumbing.UsageError, match="line 3 has 2 column"):
        data.training_examples(args_for(path), triplets=True)
    path.write_text("premise,hypothesis\na,b\n")
    with pytest.raises(plumbing.UsageError, match="the header must name sent0,sent1 \\(and hard_neg"):
        data.training_examples(args_for(path), triplets=True)
    # pairs: a file without hard_neg, or --no_hard_negatives on one with it (SimCSE Table 4)
    path.write_text("sent0,sent1\na man,a person\n")
    assert data.training_examples(args_for(path), triplets=True)[0].column_names == ["sent0", "sent1"]
    path.write_text("sent0,sent1,hard_neg\na man,a person,a dog\n")
    examples = data.training_examples(args_for(path), triplets=True, hard_negatives=False)[0]
    assert examples.column_names == ["sent0", "sent1"]


@pytest.mark.parametrize("fraction, name", [
    (0.000064, "wiki_subset_1M_000.0064percent_seed48.txt"), (0.0001, "wiki_subset_1M_000.01percent_seed48.txt"),
    (0.0005, "wiki_subset_1M_000.05percent_seed48.txt"), (0.001, "wiki_subset_1M_000.10percent_seed48.txt"),
    (0.005, "wiki_subset_1M_000.50percent_seed48.txt"), (0.01, "wiki_subset_1M_001.00percent_seed48.txt"),
    (0.1, "wiki_subset_1M_010.00percent_seed48.txt")])
def test_micse_subset_names_for_each_released_fraction(fraction, name):
    assert data.micse_subset(fraction, 48) == name
    assert data.micse_subset(fraction, 52) == name.replace("seed48", "seed52")
    assert data.micse_subset(fraction, 3) is None  # no released subset: wiki1m is subsampled with the seed
    assert data.micse_subset(0.02, 48) is None


def test_micse_subset_is_downloaded_from_its_repo(tmp_path, monkeypatch):
    subset_file = tmp_path / "subset.txt"
    subset_file.write_text("s1\ns2\ns3\n")
    asked = []
    monkeypatch.setattr(hub, "hub_file", lambda repo, name, flag: asked.append((repo, name, flag)) or str(subset_file))
    args = types.SimpleNamespace(train_file=None, fraction=0.01, seed=50)
    examples, source, subset = data.training_examples(args)
    assert asked == [("sap-ai-research/datasets-for-micse", "wiki_subset_1M_001.00percent_seed50.txt", "--train_file")]
    assert examples["text"] == ["s1", "s2", "s3"] and subset == "wiki_subset_1M_001.00percent_seed50.txt"  # not subsampled


def test_offline_micse_subset_names_the_file_and_the_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(plumbing.UsageError, match="wiki_subset_1M_000.10percent_seed49.txt.*--train_file"):
        data.training_examples(types.SimpleNamespace(train_file=None, fraction=0.001, seed=49))


@pytest.mark.parametrize("n, batch, min_rows, expected", [(10, 4, 2, [4, 4, 2]), (10, 4, 3, [4, 4]),
                                                           (9, 4, 2, [4, 4]), (8, 4, 2, [4, 4])])
def test_batch_sampler_keeps_the_last_batch_unless_too_small(n, batch, min_rows, expected):
    sampler = data.BatchSampler(n, batch, seed=0, min_rows=min_rows)
    batches = list(sampler)
    assert [len(b) for b in batches] == expected and len(sampler) == len(expected)
    assert len({i for b in batches for i in b}) == sum(expected)
    assert list(sampler) != batches  # a new order every epoch
    assert list(data.BatchSampler(n, batch, seed=0, min_rows=min_rows)) == batches  # deterministic per seed


def test_batch_sampler_slices_are_the_global_batch():
    single = list(data.BatchSampler(11, 4, seed=5))
    parts = [list(data.BatchSampler(11, 4, seed=5, rank=r, world_size=2)) for r in range(2)]
    assert [a + b for a, b in zip(*parts)] == single


def test_collate_lays_out_triplets_column_major(tiny_model):
    import datasets
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    examples = datasets.Dataset.from_dict({"sent0": ["a man", "big red ball"], "sent1": ["a dog", "sun"],
                                           "hard_neg": ["the cat", "moon"]})
    batch = data.TokenizedCorpus(examples, tokenizer, 6).collate([0, 1])
    assert batch["input_ids"].shape[0] == 6 and batch["input_ids"].shape[1] <= 6
    decoded = [tokenizer.decode(ids, skip_special_tokens=True) for ids in batch["input_ids"]]
    assert decoded == ["a man", "big red ball", "a dog", "sun", "the cat", "moon"]


def tokenize_each_batch(examples, tokenizer, rows, max_length):
    """The loader before pre-tokenisation: every batch tokenised on its own (column-major for triplets)."""
    columns = [examples[c] for c in examples.column_names]
    return dict(tokenizer([column[r] for column in columns for r in rows], padding=True, truncation=True,
                          max_length=max_length, return_tensors="pt"))


@pytest.mark.parametrize("triplets", [False, True])
def test_pretokenised_loader_gives_the_token_ids_of_tokenising_each_batch(triplets, tiny_model, corpus, tmp_path):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    if triplets:
        import csv
        import random
        from conftest import random_sentence
        rng, path = random.Random(3), tmp_path / "nli.csv"
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows([["sent0", "sent1", "hard_neg"]] + [
                [random_sentence(rng, 1, 20), random_sentence(rng), random_sentence(rng, 0, 3)] for _ in range(30)])
    args = types.SimpleNamespace(train_file=str(path if triplets else corpus), fraction=0.5, seed=4, batch_size=8,
                                 num_workers=0)
    examples, _, _ = data.training_examples(args, triplets=triplets)
    loader = data.make_loader(data.TokenizedCorpus(examples, tokenizer, 12), args, torch.device("cpu"))
    order = data.BatchSampler(len(examples), 8, seed=4)
    steps = 0
    for _ in range(2):  # two epochs: the kept last batch and the new order of the second epoch
        for rows, batch in zip(order, loader):
            expected = tokenize_each_batch(examples, tokenizer, rows, 12)
            assert batch.keys() == expected.keys()
            for key in expected:
                assert torch.equal(batch[key], expected[key]), key
            steps += 1
    assert steps == 2 * len(loader) and len(loader) == -(-len(examples) // 8)


def test_padding_to_a_multiple_of_8_and_on_the_left(tiny_model):
    import datasets
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    examples = datasets.Dataset.from_dict({"text": ["a man runs in the park", "the dog", "sun"]})
    expected = tokenize_each_batch(examples, tokenizer, [2, 0], 32)
    batch = data.TokenizedCorpus(examples, tokenizer, 32, pad_to_multiple_of=8).collate([2, 0])
    assert batch["input_ids"].shape == (2, 8) and expected["input_ids"].shape == (2, 8)  # 6 words, [CLS], [SEP]
    batch = data.TokenizedCorpus(examples, tokenizer, 32, pad_to_multiple_of=16).collate([2, 0])
    assert batch["input_ids"].shape == (2, 16)
    assert torch.equal(batch["input_ids"][:, :8], expected["input_ids"]) and batch["attention_mask"][:, 8:].sum() == 0
    tokenizer.padding_side = "left"
    expected = tokenize_each_batch(examples, tokenizer, [1, 2, 0], 32)
    batch = data.TokenizedCorpus(examples, tokenizer, 32).collate([1, 2, 0])
    assert all(torch.equal(batch[k], expected[k]) for k in expected) and batch["attention_mask"][0, 0] == 0


def test_history_reads_losses_and_norms_at_once_and_names_the_first_bad_step(tmp_path):
    from plumbing.run import History
    history = History(resume.new_run())
    history.add(torch.tensor(1.5), torch.tensor(0.5))
    history.read()
    history.read()  # nothing new: nothing changes
    history.add(torch.tensor(1.25, requires_grad=True) * 1, torch.tensor(3.0))
    history.add(torch.tensor(2.0), torch.tensor(float("inf")))  # an fp16 overflow: recorded, not an error
    assert len(history.losses) == 1 and len(history.pending) == 2  # nothing read before read()
    history.read()
    assert history.losses == [1.5, 1.25, 2.0] and history.grad_norms == [0.5, 3.0, float("inf")]
    assert history.pending == []
    for loss in (1.0, float("inf"), float("nan")):
        history.add(torch.tensor(loss), torch.tensor(1.0))
    with pytest.raises(plumbing.UsageError, match="became inf at step 5"):
        history.read()


def test_the_norm_clipping_returns_is_the_norm_before_clipping_and_zero_does_not_clip():
    """The loop records clip_grad_norm_'s return value; --max_grad_norm 0 passes inf: measured, not clipped."""
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]
    for max_norm, scale in ((1.0, 1 / 5), (math.inf, 1.0)):
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        assert norm.item() == pytest.approx(5.0)
        for p, g in zip(params, grads):
            torch.testing.assert_close(p.grad, g * scale, rtol=1e-5, atol=0)


def test_dev_measures_are_the_dev_score_and_align_uniform_of_the_same_model(tiny_model, senteval_dir):
    """The gate's l_align / l_uniform come from its own encoding, and equal eval_sts.align_uniform's."""
    tokenizer, backbone = hub.load_pretrained(str(tiny_model))
    encode = common.Encoder(backbone, None, tokenizer, "avg", torch.device("cpu"))
    calls = []

    def counting_encode(sentences):
        calls.append(len(sentences))
        return encode(sentences)
    pairs = eval_sts.load_pairs(senteval_dir, "STSBenchmark", "dev")
    from plumbing.run import dev_measures
    measures = dev_measures([backbone], counting_encode, eval_sts.DevGate(senteval_dir, counting_encode))
    assert backbone.training  # the gate hands the model back in training mode
    assert sum(calls) == len({s for p in pairs for s in p[:2]})  # one encoding of each distinct sentence
    backbone.eval()
    expected = eval_sts.align_uniform(encode, senteval_dir)
    assert measures == {"stsb_dev": eval_sts.evaluate(encode, senteval_dir, ["STSBenchmark"], "dev")["STSBenchmark"],
                        "align": expected["align"], "uniform": expected["uniform"]}


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is a test requirement (requirements-test.txt)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    import types
    from plumbing import tracking
    from plumbing.run import History
    args = types.SimpleNamespace(report_to=["tensorboard"], output_dir=str(tmp_path), method="simcse")
    history = History(resume.new_run(), tracking.Trackers(args))
    history.add(torch.tensor(2.0), torch.tensor(0.5))
    history.read()
    history.record({"step": 1, "train_time_s": 0.1, "lr": 3e-5, "stsb_dev": 70.0, "align": 0.2,
                    "uniform": float("-inf"), "gate": True})  # an undefined value is left out
    history.trackers.finish()
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert sorted(events.Tags()["scalars"]) == ["dev/align", "dev/stsb_dev", "train/grad_norm", "train/loss",
                                                "train/lr"]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.0)]
    assert events.Scalars("dev/stsb_dev")[0].value == 70.0


def test_precision_resolves_per_device():
    cpu = torch.device("cpu")
    assert options.resolve_precision("auto", cpu) == "fp32"
    assert options.resolve_precision("bf16", cpu) == "bf16" and options.resolve_precision("fp32", cpu) == "fp32"
    assert options.resolve_precision("fp16", cpu) == "fp16"  # torch runs fp16 on a CPU too: the path is testable
    assert common.grad_scaler(cpu, "fp16").is_enabled()
    import simcse
    assert simcse.parse_args(["--fp32"]).precision == "fp32"  # the old flag is an alias
    assert simcse.parse_args([]).precision == "auto" and simcse.parse_args(["--precision", "bf16"]).precision == "bf16"
    assert not common.grad_scaler(cpu, "bf16").is_enabled()


def test_repeated_views_get_independent_dropout_masks(tiny_model):
    from transformers import AutoModel, AutoTokenizer
    tokenizer, backbone = AutoTokenizer.from_pretrained(tiny_model), AutoModel.from_pretrained(tiny_model)
    head = common.MLPHead(backbone.config)
    views = common.repeat_views(dict(tokenizer(["a man runs", "the dog"], padding=True, return_tensors="pt")), 2)
    backbone.train()
    z1, z2 = common.embed(backbone(**views, output_hidden_states=True).hidden_states, views["attention_mask"],
                          "cls", head).chunk(2)
    assert z1.shape == (2, 32) and not torch.allclose(z1, z2)
    backbone.eval()
    z1, z2 = common.embed(backbone(**views, output_hidden_states=True).hidden_states, views["attention_mask"],
                          "cls", head).chunk(2)
    assert torch.allclose(z1, z2, atol=1e-6)


def test_the_dropout_off_pass_is_eval_mode_and_restores_the_modes(tiny_model):
    """SimCSE++'s third pass (simcsepp_views): with a dropout rate of 0.5 the two views differ, the dropout-off
    encoding is the eval-mode one (attention dropout off too), and the encoder is back in train mode after it."""
    from transformers import AutoModel, AutoTokenizer
    import simcsepp
    tokenizer, backbone = AutoTokenizer.from_pretrained(tiny_model), AutoModel.from_pretrained(tiny_model)
    common.set_dropout(backbone, 0.5)
    batch = dict(tokenizer(["a man runs in the park"], return_tensors="pt"))
    backbone.eval()
    reference = backbone(**batch).last_hidden_state[:, 0]
    backbone.train()
    z1, z2, off = simcsepp.simcsepp_views(backbone, batch)
    assert torch.allclose(off, reference, atol=1e-6) and not torch.allclose(z1, z2)
    dropouts = [m for m in backbone.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.training and m.p == 0.5 for m in dropouts) and backbone.training
    assert not torch.allclose(backbone(**batch).last_hidden_state[:, 0], reference)


def test_presets_use_set_defaults_and_user_flags_win():
    import simcse
    args = simcse.parse_args(["--supervised"])
    assert (args.batch_size, args.lr, args.epochs, args.mlp_only_train) == (512, 5e-5, 3, False)
    args = simcse.parse_args(["--supervised", "--batch_size", "16", "--mlp_only_train"])
    assert (args.batch_size, args.lr, args.mlp_only_train) == (16, 5e-5, True)
    assert simcse.parse_args([]).batch_size == 64


def test_linear_schedule_warmup_then_decay():
    param = torch.nn.Parameter(torch.zeros(1))
    opt, sched = common.make_optimizer([param], types.SimpleNamespace(lr=1.0, warmup_steps=2), total_steps=6)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25])
    assert opt.param_groups[0]["weight_decay"] == 0.0
    from transformers import get_linear_schedule_with_warmup
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    reference = get_linear_schedule_with_warmup(opt2, 2, 6)
    assert [reference.lr_lambdas[0](s) for s in range(6)] == pytest.approx(lrs)


def test_dropout_flag_sets_every_rate_and_zero_makes_the_two_views_equal(tiny_model):
    from transformers import AutoModel, AutoTokenizer
    tokenizer, backbone = AutoTokenizer.from_pretrained(tiny_model), AutoModel.from_pretrained(tiny_model)
    batch = common.repeat_views(dict(tokenizer(["a man runs in the park", "the dog eats"], padding=True,
                                               return_tensors="pt")), 2)

    def views():
        hidden_states = backbone(**batch, output_hidden_states=True).hidden_states
        return common.embed(hidden_states, batch["attention_mask"], "avg").chunk(2)

    backbone.train()
    common.set_dropout(backbone, None)  # the checkpoint's own rates stay
    assert backbone.config.hidden_dropout_prob == 0.1 and not torch.equal(*views())
    common.set_dropout(backbone, 0.0)
    dropouts = [m for m in backbone.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.p == 0.0 for m in dropouts)
    assert backbone.config.hidden_dropout_prob == backbone.config.attention_probs_dropout_prob == 0.0
    z1, z2 = views()
    assert torch.equal(z1, z2)  # no noise, no second view: SimCSE Table 3's dropout 0 row
    common.set_dropout(backbone, 0.3)
    assert all(m.p == 0.3 for m in dropouts) and backbone.config.attention_probs_dropout_prob == 0.3
    assert not torch.equal(*views())


def test_a_run_with_dropout_zero_records_it_in_the_checkpoint(tiny_model, corpus, senteval_dir, tmp_path):
    import json
    import simcse
    from conftest import smoke_args
    out = tmp_path / "run"
    simcse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--dropout", "0.0",
                                            "--no_test_eval")])
    assert json.loads((out / "results.json").read_text())["args"]["dropout"] == 0.0
    config = json.loads((out / "best" / "config.json").read_text())
    assert config["hidden_dropout_prob"] == config["attention_probs_dropout_prob"] == 0.0


def test_positive_only_loss_matches_a_loop_and_ignores_the_other_rows():
    g = torch.Generator().manual_seed(3)
    z1, z2 = torch.randn(4, 5, generator=g, requires_grad=True), torch.randn(4, 5, generator=g)
    expected = -sum(float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b))) / 0.05
                    for a, b in zip(z1.detach().numpy(), z2.numpy())) / 4
    loss = simcse.positive_only_loss(z1, z2, 0.05)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()  # row i's gradient depends on its own pair only
    z1b = z1.detach().clone().requires_grad_(True)
    other = z2.clone()
    other[1:] = torch.randn(3, 5, generator=g)
    simcse.positive_only_loss(z1b, other, 0.05).backward()
    torch.testing.assert_close(z1b.grad[0], z1.grad[0])
