"""#30's ablations: the new losses against loops, the augmentations on fixed strings, MLM masking, and every
command of the ablation table (docs/reproducing.md) run for two steps on ../shared's data."""
import csv
import importlib
import json
import math
import random
import re
import shlex
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import common
import simcse
from conftest import ROOT, SHARED, WORDS

sys.path.insert(0, str(ROOT / "ablations"))
import simcse_augmentations as aug  # noqa: E402
import simcsepp_noise_barlow as noise  # noqa: E402
import whitenedcse_whitening as whitening  # noqa: E402
from plumbing import hub  # noqa: E402


# ----------------------------------------------------------------------------------------- losses against loops
def test_masked_lm_loss_is_the_mean_cross_entropy_over_the_masked_positions():
    import simcse
    torch.manual_seed(0)
    scores = torch.randn(2, 5, 7)
    labels = torch.full((2, 5), -100)
    labels[0, 1], labels[1, 3], labels[1, 4] = 3, 0, 6
    terms = [-(scores[b, t].exp()[labels[b, t]] / scores[b, t].exp().sum()).log()
             for b in range(2) for t in range(5) if labels[b, t] != -100]
    assert simcse.masked_lm_loss(scores, labels).item() == pytest.approx(sum(terms).item() / 3, rel=1e-6)
    assert simcse.masked_lm_loss(scores, torch.full((2, 5), -100)).item() == 0.0  # nothing masked: no NaN


def test_info_nce_with_contradictions_and_neutrals_as_hard_negatives():
    """Table 7's "Contra. + Neutral": Eq. 8 with two hard negatives for each anchor, against a loop."""
    torch.manual_seed(1)
    n, temp, weight = 4, 0.05, 0.7
    z1, z2, contradiction, neutral = (torch.randn(n, 6) for _ in range(4))
    cos = lambda a, b: F.cosine_similarity(a, b, dim=0)  # noqa: E731
    expected = 0.0
    for i in range(n):
        terms = [cos(z1[i], z2[j]) / temp for j in range(n)]
        for hard in (contradiction, neutral):
            terms += [cos(z1[i], hard[j]) / temp + (weight if i == j else 0.0) for j in range(n)]
        expected += -(terms[i] - torch.logsumexp(torch.stack(terms), 0))
    got = simcse.info_nce(z1, z2, temp, torch.cat([contradiction, neutral]), weight)
    assert got.item() == pytest.approx(expected.item() / n, rel=1e-5)


def test_noisy_info_nce_takes_the_positive_and_the_negatives_from_their_own_embeddings():
    torch.manual_seed(2)
    p1, p2, n1, n2 = (torch.randn(5, 4) for _ in range(4))
    s = lambda a, b: F.cosine_similarity(a, b, dim=0) / 0.05  # noqa: E731
    expected = sum(-s(p1[i], p2[i]) + torch.log(s(p1[i], p2[i]).exp() + sum(s(n1[i], n2[j]).exp()
                                                                              for j in range(5) if j != i))
                   for i in range(5)) / 5
    assert noise.noisy_info_nce(p1, p2, n1, n2).item() == pytest.approx(expected.item(), rel=1e-5)
    # with the same embeddings on both sides it is SimCSE's InfoNCE
    assert noise.noisy_info_nce(p1, p2, p1, p2).item() == pytest.approx(simcse.info_nce(p1, p2).item(), rel=1e-6)


def test_gaussian_noise_has_the_variance_and_comes_from_the_generator():
    z = torch.zeros(20000, 8)
    first = noise.add_gaussian_noise(z, 0.1, torch.Generator().manual_seed(3))
    assert first.var().item() == pytest.approx(0.1, rel=0.03) and abs(first.mean().item()) < 0.01
    state = torch.get_rng_state()
    again = noise.add_gaussian_noise(z, 0.1, torch.Generator().manual_seed(3))
    assert torch.equal(first, again) and torch.equal(state, torch.get_rng_state())


def test_barlow_twins_loss_against_numpy_and_the_padding_lifts_the_rank():
    rng = np.random.default_rng(4)
    z1, z2 = rng.normal(size=(6, 5)), rng.normal(size=(6, 5))
    c = np.array([[(z1[:, a] * z2[:, b]).sum() / np.sqrt((z1[:, a] ** 2).sum() * (z2[:, b] ** 2).sum())
                   for b in range(5)] for a in range(5)])
    expected = sum((1 - c[a, a]) ** 2 for a in range(5)) + 0.3 * sum(c[a, b] ** 2 for a in range(5)
                                                                     for b in range(5) if a != b)
    got = noise.barlow_twins_loss(torch.tensor(z1), torch.tensor(z2), 0.3)
    assert got.item() == pytest.approx(expected, rel=1e-9)
    # a batch of 4 rows gives a correlation of rank 4 in 8 dimensions; 8 padding rows make it full rank
    a, b, pad = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64), \
        torch.randn(8, 8, dtype=torch.float64)
    rank = lambda x, y: torch.linalg.matrix_rank(F.normalize(x, dim=0).T @ F.normalize(y, dim=0)).item()  # noqa
    assert rank(a, b) == 4 and rank(torch.cat([a, pad]), torch.cat([b, pad])) == 8
    padded = noise.barlow_twins_loss(a, b, 0.3, pad)
    assert padded.item() == pytest.approx(noise.barlow_twins_loss(torch.cat([a, pad]), torch.cat([b, pad]),
                                                                  0.3).item())


@pytest.mark.parametrize("kind", ["pca", "zca"])
def test_full_whitening_whitens_with_the_given_statistics(kind):
    torch.manual_seed(5)
    x = torch.randn(200, 6, dtype=torch.float64) @ torch.randn(6, 6, dtype=torch.float64) + 3
    mean, covariance = whitening.momentum_update(None, None, x, 0.9)
    assert torch.allclose(mean, x.mean(0)) and torch.allclose(covariance, torch.cov(x.T, correction=0))
    white = whitening.full_whitening(x, mean, covariance, kind, eps=0.0)
    assert torch.allclose(torch.cov(white.T, correction=0), torch.eye(6, dtype=torch.float64), atol=1e-8)
    values, vectors = np.linalg.eigh(covariance.numpy())
    pca = (x.numpy() - mean.numpy()) @ vectors / np.sqrt(values)
    expected = pca if kind == "pca" else pca @ vectors.T  # ZCA rotates PCA back (Eq. 12)
    signs = np.sign((white.numpy() * expected).sum(0)) if kind == "pca" else 1  # an eigenvector's sign is free
    assert np.allclose(white.numpy() * signs, expected, atol=1e-8)


def test_momentum_update_is_eq_13():
    torch.manual_seed(6)
    mean, cov = torch.randn(3), torch.eye(3)
    x = torch.randn(10, 3)
    new_mean, new_cov = whitening.momentum_update(mean, cov, x, 0.8)
    batch_cov = sum(torch.outer(r - x.mean(0), r - x.mean(0)) for r in x) / 10
    assert torch.allclose(new_mean, 0.8 * mean + 0.2 * x.mean(0))
    assert torch.allclose(new_cov, 0.8 * cov + 0.2 * batch_cov, atol=1e-6)


# ------------------------------------------------------------------------------------- augmentations, fixed strings
SENTENCE = "the quick brown fox jumps over the lazy dog today".split()  # 10 words


def test_crop_keeps_a_contiguous_span_of_the_length():
    for seed in range(20):
        for rate, keep in ((0.1, 9), (0.2, 8), (0.3, 7)):
            out = aug.crop(SENTENCE, rate, random.Random(seed))
            assert len(out) == keep and " ".join(out) in " ".join(SENTENCE)
    assert aug.crop(SENTENCE, 0.3, random.Random(1)) == aug.crop(SENTENCE, 0.3, random.Random(1))
    assert {tuple(aug.crop(SENTENCE, 0.3, random.Random(s))) for s in range(20)} != {tuple(SENTENCE[:7])}
    assert aug.crop(["one"], 0.3, random.Random(0)) == ["one"]


def test_word_deletion_removes_that_many_distinct_words_in_order():
    for seed in range(20):
        for rate, left in ((0.1, 9), (0.2, 8), (0.3, 7)):
            out = aug.word_deletion(SENTENCE, rate, random.Random(seed))
            assert len(out) == left
            it = iter(SENTENCE)
            assert all(w in it for w in out)  # a subsequence: order kept
    assert aug.word_deletion(["a", "b"], 0.9, random.Random(0)) in (["a"], ["b"])  # one word stays


def test_delete_one_word_and_its_seeded_choice():
    outs = {tuple(aug.delete_one_word(SENTENCE, random.Random(s))) for s in range(50)}
    assert all(len(o) == 9 for o in outs) and len(outs) > 5
    assert aug.delete_one_word(SENTENCE, random.Random(7)) == aug.delete_one_word(SENTENCE, random.Random(7))
    assert aug.delete_one_word(["alone"], random.Random(0)) == ["alone"]


def test_synonym_replacement_changes_one_word_that_has_synonyms():
    synonyms = {"quick": ["fast", "rapid"], "lazy": ["idle"]}
    for seed in range(20):
        out = aug.synonym_replacement(SENTENCE, synonyms, random.Random(seed))
        changed = [(a, b) for a, b in zip(SENTENCE, out) if a != b]
        assert len(changed) == 1 and changed[0] in {("quick", "fast"), ("quick", "rapid"), ("lazy", "idle")}
    assert aug.synonym_replacement(["no", "match"], synonyms, random.Random(0)) == ["no", "match"]


def test_synonym_file_and_the_missing_wordnet_line(tmp_path):
    path = tmp_path / "syn.tsv"
    path.write_text("Quick\tfast\trapid\nlonely\n")
    assert aug.load_synonyms(str(path), set()) == {"quick": ["fast", "rapid"]}
    import importlib.util
    if importlib.util.find_spec("nltk") is not None:
        pytest.skip("nltk is installed here: WordNet may be there")
    with pytest.raises(Exception, match="--synonyms FILE"):
        aug.load_synonyms(None, {"quick"})


def test_next_sentence_pairs():
    lines = [f"s{i}" for i in range(6)]
    assert aug.next_sentence_pairs(lines, 1, random.Random(0)) == [(f"s{i}", f"s{i + 1}") for i in range(5)]
    for seed in range(10):
        pairs = aug.next_sentence_pairs(lines, 3, random.Random(seed))
        assert [a for a, _ in pairs] == lines[:-1]
        assert all(1 <= int(b[1:]) - int(a[1:]) <= 3 and int(b[1:]) < 6 for a, b in pairs)


@pytest.fixture(scope="module")
def tiny_mlm(tiny_model, tmp_path_factory):
    from transformers import BertConfig, BertForMaskedLM
    from transformers import BertTokenizerFast
    path = tmp_path_factory.mktemp("tiny_mlm")
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig.from_pretrained(tiny_model)).save_pretrained(path)
    BertTokenizerFast.from_pretrained(tiny_model).save_pretrained(path)
    return path


def test_mlm_replacement_changes_only_the_chosen_pieces(tiny_mlm):
    from transformers import AutoTokenizer, BertForMaskedLM
    tokenizer, model = AutoTokenizer.from_pretrained(tiny_mlm), BertForMaskedLM.from_pretrained(tiny_mlm).eval()
    sentences = [" ".join(WORDS[i:i + 8]) for i in range(0, 40, 8)]
    same = aug.mlm_replace(sentences, tokenizer, model, 1e-9, torch.Generator().manual_seed(0), "cpu")
    assert same == sentences
    out = aug.mlm_replace(sentences, tokenizer, model, 0.5, torch.Generator().manual_seed(0), "cpu")
    changed = [sum(a != b for a, b in zip(s.split(), o.split())) for s, o in zip(sentences, out)]
    assert all(len(o.split()) == 8 for o in out) and 0 < sum(changed) < 40  # about half, never the same piece
    assert out == aug.mlm_replace(sentences, tokenizer, model, 0.5, torch.Generator().manual_seed(0), "cpu")


def test_do_mlm_masking_is_the_collators_15_80_10_10_from_its_own_generator(tiny_model):
    """simcse.mask_tokens draws exactly what DataCollatorForLanguageModeling.torch_mask_tokens draws from the same
    generator (the masks of the earlier CPU-side masking, bit for bit), with no host sync and without the global
    RNG (dropout's); 15% of the ordinary tokens chosen, of them 80% [MASK], 10% random, 10% kept."""
    import simcse
    from plumbing import syncs
    import transformers
    args = simcse.parse_args(["--do_mlm", "--model_name_or_path", str(tiny_model)])
    assert (args.mlm_weight, args.mlm_probability) == (0.1, 0.15)  # the released code's defaults
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model)
    ids = torch.randint(5, len(tokenizer), (400, 50))
    ids[:, 0], ids[:, -1], ids[::2, -10:] = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id
    special_ids = torch.tensor(tokenizer.all_special_ids)
    masker = transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, seed=3)
    masker.generator = torch.Generator().manual_seed(3)
    expected = [masker.torch_mask_tokens(ids.clone(), special_tokens_mask=torch.isin(ids, special_ids))
                for _ in range(2)]  # two batches in a row: the generator's stream continues alike
    generator, state = torch.Generator().manual_seed(3), torch.get_rng_state()
    with syncs.HostSyncCounter("cpu") as counter:
        got = [simcse.mask_tokens(ids, special_ids, 0.15, tokenizer.mask_token_id, len(tokenizer), generator)
               for _ in range(2)]
    assert not counter.ops and torch.equal(state, torch.get_rng_state())
    for (masked, labels), (want_masked, want_labels) in zip(got, expected):
        assert torch.equal(masked, want_masked) and torch.equal(labels, want_labels)
    masked, labels = got[0]
    chosen = labels != -100
    special = torch.isin(ids, special_ids)
    assert not chosen[special].any() and torch.equal(labels[chosen], ids[chosen])
    assert chosen.sum() / (~special).sum() == pytest.approx(0.15, abs=0.01)
    as_mask = (masked == tokenizer.mask_token_id) & chosen
    kept = (masked == ids) & chosen
    assert as_mask.sum() / chosen.sum() == pytest.approx(0.8, abs=0.03)
    assert kept.sum() / chosen.sum() == pytest.approx(0.1 + 0.1 / len(tokenizer), abs=0.03)
    assert torch.equal(masked[~chosen], ids[~chosen])


def test_the_bert_mlm_head_starts_as_the_released_code_initialised_it(tmp_path):
    """BertForCL's init_weights under transformers 4.2: weights normal(0, initializer_range), biases zero, LayerNorm
    1 and 0, the decoder's bias the head's own zero `bias` (one parameter): transformers 5 builds the head with
    PyTorch's uniform init and an untied decoder bias, which left `bias` outside the loss."""
    import simcse
    from conftest import write_tiny_model
    _, backbone = hub.load_pretrained(str(write_tiny_model(tmp_path / "m", hidden=64)))
    torch.manual_seed(0)
    head = simcse.mlm_head(backbone, "unused")
    std = backbone.config.initializer_range
    assert head.decoder.bias is head.bias and not head.bias.any()
    assert [name for name, _ in head.named_parameters()].count("bias") == 1
    assert len(list(head.parameters())) == 6  # dense (2), LayerNorm (2), the decoder's weight, the tied bias once
    for weight in (head.transform.dense.weight, head.decoder.weight):
        assert abs(weight.mean().item()) < 0.1 * std and weight.std().item() == pytest.approx(std, rel=0.05)
    assert not head.transform.dense.bias.any()
    assert torch.equal(head.transform.LayerNorm.weight, torch.ones(64)) and not head.transform.LayerNorm.bias.any()
    scores = head(torch.randn(3, 64))
    scores.sum().backward()
    assert head.bias.grad is not None and head.bias.grad.abs().sum() > 0  # the bias is in the loss


def test_keep_first_layers(tiny_model):
    import plumbing
    import simcse
    _, backbone = hub.load_pretrained(str(tiny_model))
    simcse.keep_first_layers(backbone, 1)
    assert len(backbone.encoder.layer) == 1 and backbone.config.num_hidden_layers == 1
    assert len(backbone(input_ids=torch.tensor([[2, 7, 3]]), output_hidden_states=True).hidden_states) == 2
    with pytest.raises(plumbing.UsageError, match="only 1 layers"):
        simcse.keep_first_layers(backbone, 5)


# ------------------------------------------------------------------ every command of the ablation table on ../shared
DATA = SHARED / "data"
needs_shared_data = pytest.mark.skipif(not (DATA / "wiki1m_head.txt").is_file(),
                                       reason="../shared/data (wiki1m_head.txt, nli_snli_devtest.csv) is not beside "
                                              "this checkout")
# (the table's command, what the test adds: the tiny model has 2 layers, 32 channels and 4 groups' worth)
COMMANDS = [
    ("simcse.py --supervised --no_hard_negatives", ""),
    ("simcse.py --supervised --train_file nli_neutral.csv --neutral_hard_negatives", ""),
    ("simcse.py --supervised --do_mlm", ""),
    ("simcse.py --do_mlm", ""),
    ("simcse.py --no_negatives", ""),
    ("simcse.py --fixed_dropout_mask", ""),
    ("simcse.py --num_layers 10", "--num_layers 1"),
    ("simcsepp.py --dcl_only", ""),
    ("simcsepp.py --no_off_dropout --m 1", ""),
    ("sscl.py --layer_negatives anchor", "--neg_layers 1"),
    ("sscl.py --no_dropout_positive", "--neg_layers 1"),
    ("sscl.py --output_dim 256", "--neg_layers 1 --output_dim 8"),
    ("whitenedcse.py --no_whitening", "--num_groups 16"),
    ("whitenedcse.py --num_pos 2", "--num_groups 16"),
    ("micse.py --no_negatives --queue_size 0", ""),
    ("ablations/simcse_augmentations.py --positive crop --rate 0.1", ""),
    ("ablations/simcse_augmentations.py --positive word_deletion --rate 0.1", ""),
    ("ablations/simcse_augmentations.py --positive delete_one_word --dropout 0", ""),
    ("ablations/simcse_augmentations.py --positive synonym --synonyms synonyms.tsv", ""),
    ("ablations/simcse_augmentations.py --positive mlm --rate 0.15", ""),
    ("ablations/simcse_augmentations.py --positive next_sentence --two_encoders", ""),
    ("ablations/simcse_augmentations.py --positive next_3_sentences", ""),
    ("ablations/simcsepp_noise_barlow.py --positive_noise add", ""),
    ("ablations/simcsepp_noise_barlow.py --negative_noise reduce", "--mean_passes 3"),
    ("ablations/simcsepp_noise_barlow.py --barlow --barlow_padding 704", "--barlow_padding 40"),
    ("ablations/whitenedcse_whitening.py --whitening pca", ""),
    ("ablations/whitenedcse_whitening.py --whitening group", "--num_groups 16"),
]


def test_every_command_here_is_in_the_ablation_table():
    table = (ROOT / "docs" / "reproducing.md").read_text().split("## Ablations", 1)[1].split("\n## ", 1)[0]
    missing = [command for command, _ in COMMANDS if f"`{command}`" not in table]
    assert not missing, missing


# What a run must show beyond finishing: (module, function spied on, check of its calls' arguments)
SPIES = {
    "simcse.py --supervised --train_file nli_neutral.csv --neutral_hard_negatives":
        ("simcse", "info_nce", lambda calls: all(len(a[3]) == 2 * len(a[0]) for a in calls)),
    "simcse.py --do_mlm": ("simcse", "masked_lm_loss", lambda calls: len(calls) == 2),
    "simcse.py --supervised --do_mlm": ("simcse", "masked_lm_loss", lambda calls: len(calls) == 2),
    "simcsepp.py --dcl_only": ("simcsepp", "off_dropout_info_nce", lambda calls: not calls),
    "sscl.py --no_dropout_positive": ("sscl", "sscl_loss", lambda calls: all(a[0] is a[1] for a in calls)),
    "sscl.py --output_dim 256": ("sscl", "sscl_loss", lambda calls: all(
        x.shape[1] == 8 for a in calls for x in [a[0], a[1], *a[2][0]])),
    "whitenedcse.py --no_whitening": ("whitenedcse", "shuffled_group_whitening", lambda calls: not calls),
    "ablations/whitenedcse_whitening.py --whitening pca": ("whitenedcse_whitening", "full_whitening",
                                                             lambda calls: len(calls) == 2 * 3),
}


@pytest.fixture(scope="module")
def shared_inputs(tmp_path_factory):
    """../shared's NLI rows with a stand-in neutral column (the next row's entailment; ../shared has no neutral
    hypotheses), and a synonym file."""
    tmp = tmp_path_factory.mktemp("ablation_data")
    rows = list(csv.reader((DATA / "nli_snli_devtest.csv").open()))[1:]
    with open(tmp / "nli_neutral.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sent0", "sent1", "hard_neg", "neutral"])
        w.writerows(row + [rows[(i + 1) % len(rows)][1]] for i, row in enumerate(rows))
    (tmp / "synonyms.tsv").write_text("the\ta\nof\tfrom\nin\tinside\n")
    return tmp


@needs_shared_data
@pytest.mark.parametrize("command, extra", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_an_ablation_command_runs_on_shared_data(command, extra, tiny_model, tiny_mlm, senteval_dir, shared_inputs,
                                                 tmp_path, monkeypatch):
    script, *flags = shlex.split(command)
    flags = [str(shared_inputs / f) if f in ("nli_neutral.csv", "synonyms.tsv") else f for f in flags]
    given = shlex.split(extra)
    for name, value in zip(given[::2], given[1::2]):  # the test's value replaces the table's
        if name in flags:
            flags[flags.index(name) + 1] = value
        else:
            flags += [name, value]
    supervised = "--supervised" in flags
    train = [] if "--train_file" in flags else \
        ["--train_file", DATA / ("nli_snli_devtest.csv" if supervised else "wiki1m_head.txt")]
    out = tmp_path / "run"
    argv = [str(a) for a in [*flags, *train, "--model_name_or_path", tiny_model, "--senteval_dir", senteval_dir,
                             "--fraction", 0.02, "--max_steps", 2, "--eval_steps", 2, "--batch_size", 8,
                             "--max_seq_length", 16, "--no_test_eval", "--device", "cpu", "--output_dir", out,
                             "--count_host_syncs", 1]]
    if "--positive mlm" in command:
        argv += ["--mlm_model", str(tiny_mlm)]
    calls = []
    if command in SPIES:
        spied_module, name, check = SPIES[command]
        spied = importlib.import_module(spied_module)
        real = getattr(spied, name)

        def spy(*args, **kwargs):
            calls.append(args)
            return real(*args, **kwargs)
        monkeypatch.setattr(spied, name, spy)
    module = importlib.import_module(re.sub(r"\.py$", "", script.split("/")[-1]))
    module.main(argv)
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 2 and all(math.isfinite(x) for x in results["train_loss"])
    # step 2's host syncs (tests/test_syncs.py): none, but torch.linalg.eigh's, once a whitened view (the full
    # whitening; groups of 2 channels are whitened in closed form)
    eigh = {"ablations/whitenedcse_whitening.py --whitening pca": 3}
    assert results["host_syncs"]["per_step"] == [eigh.get(command, 0)], results["host_syncs"]
    assert (out / "best" / "config.json").is_file()
    if command in SPIES:
        assert check(calls), command
    if "--num_layers" in command:
        assert json.loads((out / "best" / "config.json").read_text())["num_hidden_layers"] == 1
    if "--output_dim" in command:  # kept at evaluation: eval_sts reads the projection from best/
        import eval_sts
        assert eval_sts.load_encode(str(out / "best"), "avg", torch.device("cpu"))(["a man"]).shape == (1, 8)


def test_an_ablation_script_runs_as_a_script_and_bad_input_is_one_line(tiny_model, senteval_dir):
    """The real CLI once (the scripts find the suite's modules from ablations/), the other two in-process."""
    from conftest import cli_in_process, run_script
    proc = run_script("ablations/simcse_augmentations.py", "--positive", "crop", "--model_name_or_path", tiny_model)
    assert proc.returncode == 2 and "--rate" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
        proc.stderr
    code, stderr = cli_in_process(noise, "--barlow", "--positive_noise", "add")
    assert code == 2 and "one study" in stderr and len(stderr.strip().splitlines()) == 1
    code, stderr = cli_in_process(whitening, "--momentum", "1.5")
    assert code == 2 and "--momentum" in stderr and len(stderr.strip().splitlines()) == 1
    code, stderr = cli_in_process(aug, "--positive", "synonym", "--resume", "--compile")
    assert code == 2 and "--resume --compile: not in the ablation scripts" in stderr
    code, stderr = cli_in_process(noise, "--barlow", "--gradient_checkpointing", "--micro_batch_size", "4")
    assert code == 2 and "--gradient_checkpointing --micro_batch_size: not in the ablation scripts" in stderr
    code, stderr = cli_in_process(whitening, "--pad_to_max_length")  # it would pad to the longest row regardless
    assert code == 2 and "--pad_to_max_length: not in the ablation scripts" in stderr


def test_misused_ablation_flags_are_one_line(tiny_model, senteval_dir, tmp_path):
    import simcse
    from conftest import cli_in_process, write_nli
    base = ["--model_name_or_path", tiny_model, "--senteval_dir", senteval_dir, "--output_dir", tmp_path / "o",
            "--device", "cpu"]
    nli = write_nli(tmp_path / "nli.csv")  # no neutral column
    for flags, needle in (
            (["--supervised", "--neutral_hard_negatives", "--train_file", nli], "sent0,sent1,hard_neg,neutral"),
            (["--neutral_hard_negatives"], "--neutral_hard_negatives goes with --supervised"),
            (["--supervised", "--no_hard_negatives", "--neutral_hard_negatives"], "hard negatives"),
            (["--num_layers", "0"], "--num_layers 0"),
            (["--num_layers", "5", "--batch_size", "8", "--train_file", nli.with_name("x.txt")], None)):
        if needle is None:  # more layers than the encoder has
            nli.with_name("x.txt").write_text("the man runs\n" * 20)
            needle = "the encoder has only 2 layers"
        code, stderr = cli_in_process(simcse, *flags, *base)
        assert code == 2 and needle in stderr and len(stderr.strip().splitlines()) == 1, stderr
    # a missing replacer model is named by its own flag (hub.load_pretrained's `flag`)
    code, stderr = cli_in_process(aug, "--positive", "mlm", "--rate", "0.15", "--mlm_model", tmp_path / "no_mlm",
                                  "--batch_size", "8", "--train_file", nli.with_name("x.txt"), *base)
    assert code == 2 and f"--mlm_model {tmp_path / 'no_mlm'}: no such folder" in stderr, stderr
