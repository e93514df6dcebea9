"""Per-backbone presets (#26): what a model is comes from its config, not its name; each method's
paper settings for that backbone apply unless the user's flags say otherwise."""
import ast
import json

import pytest

import micse
import simcse
import simcsepp
import sscl
import whitenedcse
from conftest import smoke_args, write_tiny_model
from plumbing import options


def write_config(path, model_type: str, hidden: int, layers: int):
    from transformers import BertConfig, RobertaConfig
    config_class = {"bert": BertConfig, "roberta": RobertaConfig}[model_type]
    config_class(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=16).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    return {name: write_config(root / name, *spec) for name, spec in {
        "bert-base": ("bert", 768, 12), "bert-large": ("bert", 1024, 24),
        "roberta-base": ("roberta", 768, 12), "roberta-large": ("roberta", 1024, 24),
        "other": ("bert", 512, 4)}.items()}


def test_the_backbone_is_read_from_the_config_not_the_name(configs, tmp_path):
    for name, path in configs.items():
        kind, _ = options.backbone(path)
        assert kind == (None if name == "other" else name)
    assert options.backbone(configs["other"]) == (None, "bert, 512 wide, 4 layers")
    # a hub id that is not downloaded yet is known by its published config; an unknown id is not
    assert options.backbone("roberta-large")[0] == "roberta-large"
    assert options.backbone("FacebookAI/roberta-base")[0] == "roberta-base"
    assert options.backbone("someone/some-model") == (None, "not read yet")


@pytest.mark.parametrize("module, argv, kind, expected", [
    (simcse, [], "bert-base", {"batch_size": 64, "lr": 3e-5}),
    (simcse, [], "bert-large", {"batch_size": 64, "lr": 1e-5}),
    (simcse, [], "roberta-base", {"batch_size": 512, "lr": 1e-5}),
    (simcse, [], "roberta-large", {"batch_size": 512, "lr": 3e-5}),
    (simcse, ["--supervised"], "bert-base", {"batch_size": 512, "lr": 5e-5}),
    (simcse, ["--supervised"], "roberta-large", {"batch_size": 512, "lr": 1e-5}),
    (simcsepp, [], "bert-base", {"lr": 3e-5}),
    (simcsepp, [], "bert-large", {"lr": 8e-6, "batch_size": 64}),
    (simcsepp, [], "roberta-large", {"lr": 8e-6}),
    (sscl, [], "bert-large", {"lr": 1e-5, "pooler": "avg"}),
    (whitenedcse, [], "bert-base", {"num_groups": None}),  # groups of 2 channels: 384, set in main
    (whitenedcse, [], "bert-large", {"num_groups": 512}),
    (whitenedcse, [], "roberta-base", {"num_groups": 256}),
    (whitenedcse, [], "roberta-large", {"num_groups": 256}),
])
def test_each_paper_sets_its_backbone_settings(configs, module, argv, kind, expected):
    args = module.parse_args(["--model_name_or_path", configs[kind], *argv])
    assert {k: getattr(args, k) for k in expected} == expected and args.backbone == kind


def test_the_users_flags_win_and_the_record_says_which_presets_applied(configs):
    args = simcse.parse_args(["--model_name_or_path", configs["roberta-large"], "--lr", "2e-5"])
    assert (args.batch_size, args.lr) == (512, 2e-5)
    assert args.presets == {"source": "Table A.1, RoBERTa-large", "applied": {"batch_size": 512},
                            "overridden": {"lr": 2e-5}}
    args = simcse.parse_args(["--model_name_or_path", configs["roberta-large"], "--supervised"])
    assert args.presets["source"] == ("supervised SimCSE (Table A.1, Appendix A); "
                                      "Table A.1, supervised roberta-large")


def test_an_unknown_backbone_gets_the_bert_base_settings_and_says_so(configs, capsys):
    args = simcse.parse_args(["--model_name_or_path", configs["other"]])
    assert (args.batch_size, args.lr, args.backbone) == (64, 3e-5, None)
    assert args.presets == {"source": "none: the defaults in --help (BERT-base's)", "applied": {}, "overridden": {}}
    from plumbing import run
    summary = run.summary(args, {"num_train_examples": 10, "micse_subset": None, "train_file": "wiki.txt"}, 1, 5, "cpu")
    assert summary["backbone"] == "bert, 512 wide, 4 layers: no preset for this backbone, the BERT-base settings"
    assert "no preset for this backbone" in capsys.readouterr().out
    # miCSE on the same encoder: the summary names the AMI layers it scaled to the depth (on MiniLM's 6 layers a
    # user read "the BERT-base settings" and got 1:5, not BERT-base's 7:11, with no word)
    args = micse.parse_args(["--model_name_or_path", configs["other"]])
    args.ami_min_layer, args.ami_max_layer = micse.ami_layers(4)
    summary = run.summary(args, {"num_train_examples": 10, "micse_subset": None, "train_file": "wiki.txt"}, 1, 5, "cpu")
    assert summary["backbone"].endswith("the BERT-base settings; AMI on attention layers 0:4 (0-based, the end "
                                        "excluded)"), summary["backbone"]


def test_micse_takes_the_ami_layers_from_the_depth():
    assert micse.ami_layers(12) == (7, 11) and micse.ami_layers(24) == (19, 23)


def test_whitenedcse_default_works_on_a_1024_wide_encoder(tmp_path, corpus, senteval_dir):
    wide = write_tiny_model(tmp_path / "wide", num_layers=1, hidden=1024, heads=8)
    out = tmp_path / "run"
    args = smoke_args(wide, corpus, senteval_dir, out, "--no_test_eval")
    args[args.index("--max_steps") + 1] = 2
    whitenedcse.main([str(a) for a in args])
    results = json.loads((out / "results.json").read_text())
    assert results["args"]["num_groups"] == 512 and results["steps"] == 2


def write_tiny_roberta(path, corpus_sentences):
    """A random 2-layer RoBERTa with a byte-level BPE tokenizer trained here on the corpus."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaConfig, RobertaModel, RobertaTokenizerFast
    import torch
    path.mkdir(parents=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus_sentences, vocab_size=400, min_frequency=1,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    bpe.save_model(str(path))
    tokenizer = RobertaTokenizerFast(vocab=str(path / "vocab.json"), merges=str(path / "merges.txt"))
    tokenizer.save_pretrained(path)
    config = RobertaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=66, pad_token_id=1, bos_token_id=0,
                           eos_token_id=2, type_vocab_size=1)
    torch.manual_seed(0)
    RobertaModel(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_roberta(tmp_path_factory, corpus):
    return write_tiny_roberta(tmp_path_factory.mktemp("tiny_roberta") / "model",
                              corpus.read_text().split("\n"))


def test_the_tiny_roberta_tokenises_sentences_apart(tiny_roberta):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_roberta)
    a, b = tokenizer(["the dog runs in the park", "a red car"])["input_ids"]
    assert a != b and a[0] == b[0] == tokenizer.bos_token_id and "token_type_ids" not in tokenizer.model_input_names


@pytest.mark.parametrize("script, extra", [("simcse", []), ("simcsepp", []), ("sscl", ["--neg_layers", "1"]),
                                           ("whitenedcse", ["--num_groups", "16"]), ("micse", [])])
def test_every_method_trains_a_roberta(script, extra, tiny_roberta, corpus, senteval_dir, tmp_path):
    import importlib
    out = tmp_path / script
    args = smoke_args(tiny_roberta, corpus, senteval_dir, out, "--no_test_eval", *extra)
    importlib.import_module(script).main([str(a) for a in args])
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 4 and all(loss == loss for loss in results["train_loss"])
    assert results["best_dev_stsb"] is not None  # a defined dev score: the sentences are told apart
    assert json.loads((out / "best" / "config.json").read_text())["model_type"] == "roberta"


def test_a_roberta_checkpoint_gives_the_same_embeddings_in_eval_sts_and_sentence_transformers(
        tiny_roberta, corpus, senteval_dir, tmp_path):
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    import numpy as np
    import eval_sts
    out = tmp_path / "run"
    simcse.main([str(a) for a in smoke_args(tiny_roberta, corpus, senteval_dir, out, "--no_test_eval")])
    sentences = ["a man runs in the park", "the dog eats"]
    encode = eval_sts.load_encode(str(out / "best"), "cls_before_pooler", "cpu")
    np.testing.assert_allclose(st.SentenceTransformer(str(out / "best"), device="cpu").encode(sentences),
                               encode(sentences), atol=1e-5)


def test_a_24_layer_encoder_gets_its_layer_defaults(tmp_path, corpus, senteval_dir):
    deep = write_tiny_model(tmp_path / "deep", num_layers=24, hidden=16, heads=2)
    out = tmp_path / "micse"
    micse.main([str(a) for a in smoke_args(deep, corpus, senteval_dir, out, "--no_test_eval", "--max_steps", 2)])
    args = json.loads((out / "results.json").read_text())["args"]
    assert (args["ami_min_layer"], args["ami_max_layer"]) == (19, 23)
    out = tmp_path / "sscl"
    sscl.main([str(a) for a in smoke_args(deep, corpus, senteval_dir, out, "--no_test_eval", "--max_steps", 2,
                                          "--report_oversmoothing")])
    setsim = json.loads((out / "results.json").read_text())["setsim"]
    assert list(setsim["before"]) == [f"{layer}-{layer + 1}" for layer in range(1, 24)]
    assert sscl.negative_layers(24, 2) == [23, 22]


@pytest.mark.parametrize("module", [simcse, simcsepp, sscl, whitenedcse, micse], ids=lambda m: m.__name__)
def test_each_method_files_recipe_is_the_one_place_its_defaults_come_from(module, configs):
    """A method file's RECIPE (read first) is what a run on BERT-base trains with when no flag is given, and its
    argparse group declares no default of its own for a RECIPE key: a second default beside the recipe (as
    --ami_lambda's default=2.5e-3 beside the presets once was) fails here, and so does a recipe that a BERT-base
    preset row silently changes."""
    tree = ast.parse(open(module.__file__).read())
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "add_argument":
            dest = call.args[0].value.lstrip("-")
            assert not (dest in module.RECIPE and any(k.arg == "default" for k in call.keywords)), dest
    args = module.parse_args(["--model_name_or_path", configs["bert-base"]])
    assert {key: getattr(args, key) for key in module.RECIPE} == module.RECIPE
