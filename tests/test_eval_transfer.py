"""eval_transfer.py: the batched classifiers against SentEval's sequential loop, folds, readers, MRPC features."""
import copy
import json
import os
import random
import re

import numpy as np
import pytest
import torch

import eval_transfer as et
from conftest import SHARED, WORDS, cli_in_process, in_process_scores, needs_shared, run_script


def sentence_classifier_reference(X, y, train, validation, l2, n_classes, mode):
    """SentEval's PyTorchClassifier.fit written out (nn.Linear, CrossEntropyLoss, torch.optim, its early stopping)."""
    cfg = et.MODES[mode]
    np.random.seed(1111)
    torch.manual_seed(1111)
    model = torch.nn.Sequential(torch.nn.Linear(X.shape[1], n_classes))
    optimizer = (torch.optim.Adam if cfg["optim"] == "adam" else torch.optim.RMSprop)(model.parameters())
    optimizer.param_groups[0]["weight_decay"] = l2
    if validation is None:
        permutation = np.random.permutation(len(train))
        cut = int(0.05 * len(train))
        train, validation = train[permutation[cut:]], train[permutation[:cut]]
    trX, trY, dvX, dvY = X[train], y[train], X[validation], y[validation]
    epoch, best, count, stop = 0, -1.0, 0, False
    while not stop and epoch <= 200:
        for _ in range(cfg["epoch_size"]):
            permutation = np.random.permutation(len(trX))
            for i in range(0, len(trX), cfg["batch_size"]):
                idx = torch.from_numpy(permutation[i:i + cfg["batch_size"]])
                loss = torch.nn.functional.cross_entropy(model(trX[idx]), trY[idx])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        epoch += cfg["epoch_size"]
        with torch.no_grad():
            accuracy = (model(dvX).argmax(1) == dvY).double().mean().item()
        if accuracy > best:
            best, best_model = accuracy, copy.deepcopy(model)
        else:
            if count >= cfg["tenacity"]:
                stop = True
            count += 1
    return best, best_model[0].weight.detach().T, best_model[0].bias.detach()


@pytest.fixture(scope="module")
def toy():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(300, 8, generator=g)
    y = (X @ torch.randn(8, 3, generator=g) + 0.8 * torch.randn(300, 3, generator=g)).argmax(1)
    return X, y


@pytest.mark.parametrize("mode", ["test", "fasttest"])
def test_batched_classifiers_equal_the_sequential_loop(toy, mode):
    X, y = toy
    specs = [(np.arange(0, 200), np.arange(200, 300)), (np.arange(50, 300), np.arange(0, 50)),
             (np.arange(0, 290), None)]  # the last one: SentEval's 5% validation split
    l2 = [[1e-5, 1e-2], [1e-3, 1e-4], [1e-2, 1e-5]]
    results = et.fit(X, y, [et.Job(train, val) for train, val in specs], l2, 3, mode)
    for (train, val), values, per_job in zip(specs, l2, results):
        for value, (accuracy, W, b) in zip(values, per_job):
            ref_accuracy, ref_W, ref_b = sentence_classifier_reference(X, y, train, val, value, 3, mode)
            assert accuracy == ref_accuracy
            torch.testing.assert_close(W, ref_W, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(b, ref_b, atol=2e-5, rtol=1e-4)


def test_initial_weights_are_sentevals_seeded_linear_layer():
    torch.manual_seed(1111)
    layer = torch.nn.Linear(5, 2)
    W, b = et.initial_weights(5, 2)
    assert torch.equal(W, layer.weight.detach().T) and torch.equal(b, layer.bias.detach())


def test_stratified_folds_are_stratified_deterministic_and_partition():
    y = np.array([0] * 23 + [1] * 11 + [2] * 7)
    np.random.RandomState(3).shuffle(y)
    folds = et.stratified_folds(y, 5)
    assert [(a == c).all() and (b == d).all() for (a, b), (c, d) in zip(folds, et.stratified_folds(y, 5))] == [True] * 5
    tests = np.concatenate([test for _, test in folds])
    assert sorted(tests) == list(range(len(y)))
    for train, test in folds:
        assert set(train).isdisjoint(test) and len(train) + len(test) == len(y)
        for c, total in ((0, 23), (1, 11), (2, 7)):
            assert (y[test] == c).sum() in (total // 5, total // 5 + 1)  # each class spread evenly


def test_stratified_folds_equal_scikit_learn():
    sklearn = pytest.importorskip("sklearn.model_selection", reason="scikit-learn is not installed")
    y = np.random.RandomState(0).randint(0, 4, size=137)
    for k in (5, 10):
        reference = sklearn.StratifiedKFold(n_splits=k, shuffle=True, random_state=1111).split(np.zeros(len(y)), y)
        for (a, b), (c, d) in zip(et.stratified_folds(y, k), reference):
            assert (a == c).all() and (b == d).all()


def test_mrpc_pair_features():
    u, v = np.array([[1.0, -2.0, 3.0]]), np.array([[2.0, 2.0, -1.0]])
    assert et.pair_features(u, v).tolist() == [[1.0, 4.0, 4.0, 2.0, -4.0, -3.0]]


def write_transfer_tree(root, n=40, seed=0):
    """SentEval's transfer layout in miniature; labels follow a word so that a classifier can learn them."""
    rng = random.Random(seed)

    def sentence(word):
        return " ".join([word] + [rng.choice(WORDS) for _ in range(rng.randint(2, 6))])
    for folder, files in {"MR": ("rt-polarity.pos", "rt-polarity.neg"), "CR": ("custrev.pos", "custrev.neg"),
                          "SUBJ": ("subj.objective", "subj.subjective"), "MPQA": ("mpqa.pos", "mpqa.neg")}.items():
        (root / folder).mkdir(parents=True)
        for name, word in zip(files, ("happy", "sad")):
            (root / folder / name).write_bytes("\n".join(sentence(word) for _ in range(n)).encode("latin-1") + b"\n")
    (root / "SST" / "binary").mkdir(parents=True)
    for split in ("train", "dev", "test"):
        rows = [f"{sentence(w)}\t{label}" for _ in range(n) for w, label in (("happy", 1), ("sad", 0))]
        (root / "SST" / "binary" / f"sentiment-{split}").write_text("\n".join(rows) + "\n")
    (root / "TREC").mkdir()
    for name in ("train_5500.label", "TREC_10.label"):
        rows = [f"{c}:fine {sentence(w)}" for _ in range(n // 2)
                for c, w in zip(et.TREC_CLASSES, ("man", "dog", "cat", "car", "park", "sun"))]
        (root / "TREC" / name).write_text("\n".join(rows) + "\n")
    (root / "MRPC").mkdir()
    for split in ("train", "test"):
        rows = ["Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"]
        for i in range(n):
            a = sentence("red")
            rows.append(f"1\t{i}\t{i + 1}\t{a}\t{a}" if i % 2 else f"0\t{i}\t{i + 1}\t{a}\t{sentence('blue')}")
        (root / "MRPC" / f"msr_paraphrase_{split}.txt").write_text("\n".join(rows) + "\n")
    return root


def test_readers_on_a_miniature_tree(tmp_path):
    root = write_transfer_tree(tmp_path / "se")
    mr = et.load_task(root, "MR")["all"]
    assert len(mr[0]) == 80 and sorted(mr[1].tolist()) == [0] * 40 + [1] * 40
    lengths = [(len(s.split()), label) for s, label in zip(*mr)]
    assert lengths == sorted(lengths)  # SentEval's order: by length, then label
    assert all(s.startswith("happy") == (label == 1) for s, label in zip(*mr))
    sst = et.load_task(root, "SST2")
    assert set(sst) == {"train", "dev", "test"} and len(sst["dev"][0]) == 80
    trec = et.load_task(root, "TREC")
    assert sorted(set(trec["train"][1].tolist())) == list(range(6)) and not trec["train"][0][0].startswith("fine")
    mrpc = et.load_task(root, "MRPC")["train"]
    assert len(mrpc[0]) == 40 and isinstance(mrpc[0][0], tuple) and set(mrpc[1].tolist()) == {0, 1}
    (root / "TREC" / "TREC_10.label").write_text("DESC:manner how ?\nnonsense line\n")
    with pytest.raises(et.plumbing.UsageError, match="TREC_10.label line 2"):
        et.load_task(root, "TREC")


def label_encode(sentences):
    """A toy encoder that sees the label word: a well separated cluster per word, plus hashed noise."""
    keys = ["happy", "sad", "man", "dog", "cat", "car", "park", "sun", "red", "blue"]
    out = np.zeros((len(sentences), len(keys)), dtype=np.float32)
    for i, s in enumerate(sentences):
        out[i, keys.index(s.split()[0])] = 5.0
        out[i] += np.random.RandomState(sum(map(ord, s)) % 2**31).normal(scale=0.3, size=len(keys))
    return out


def test_evaluate_all_tasks_on_the_miniature_tree(tmp_path):
    root = write_transfer_tree(tmp_path / "se", n=60)
    scores = et.evaluate(label_encode, root, mode="fasttest")
    assert list(scores) == et.TASKS + ["avg"]
    for task in ("MR", "CR", "SUBJ", "MPQA", "SST2", "TREC"):
        assert scores[task] >= 60.0, (task, scores)  # above chance: the first word, the label, is a feature
    assert 0.0 <= scores["MRPC"] <= 100.0
    assert scores["avg"] == pytest.approx(np.mean([scores[t] for t in et.TASKS]), abs=0.006)


def test_cli_on_tiny_model(tiny_model, tmp_path):
    root = write_transfer_tree(tmp_path / "se", n=20)
    (root / "STS").mkdir()  # resolve_senteval_dir looks for SentEval's data root
    proc = run_script("eval_transfer.py", "--model_name_or_path", tiny_model, "--pooler", "avg", "--senteval_dir", root,
                      "--mode", "fasttest", "--tasks", "CR", "MRPC", "--json", tmp_path / "t.json")
    assert proc.returncode == 0, proc.stderr
    scores = json.loads((tmp_path / "t.json").read_text())
    assert set(scores) == {"CR", "MRPC", "avg"}
    assert re.search(r"wall time [0-9.]+s: encoding [0-9.]+s, classifiers [0-9.]+s", proc.stdout), proc.stdout
    code, stderr = cli_in_process(et, "--model_name_or_path", tiny_model, "--senteval_dir", root, "--batch_size", 0)
    assert code == 2 and "--batch_size" in stderr and "Traceback" not in stderr


def minilm_transfer(tmp_path, *tasks, senteval_dir=SHARED / "data/senteval"):
    """eval_transfer.py's scores of MiniLM, run in this process (its CLI has its own subprocess test above)."""
    return in_process_scores(et, "--model_name_or_path", SHARED / "models/all-MiniLM-L6-v2", "--pooler",
                             "cls_before_pooler", "--senteval_dir", senteval_dir, "--mode", "fasttest",
                             *(["--tasks", *tasks] if tasks else []))


@needs_shared
def test_minilm_fasttest_on_cr(tmp_path):
    """CR: the nested k-fold protocol of four of the seven tasks, on real data: CR's first 550 reviews in its
    proportions (350 positive, 200 negative; the whole of CR, 3,775, took 48 s of CPU, mostly MiniLM's encoding;
    1,100 took 15 s)."""
    (tmp_path / "CR").mkdir()
    (tmp_path / "STS").symlink_to(SHARED / "data/senteval/STS")  # what --senteval_dir is known by
    for name, n in (("custrev.pos", 350), ("custrev.neg", 200)):
        lines = (SHARED / "data/senteval/CR" / name).read_bytes().splitlines(keepends=True)
        (tmp_path / "CR" / name).write_bytes(b"".join(lines[:n]))
    scores = minilm_transfer(tmp_path, "CR", senteval_dir=tmp_path)
    assert list(scores) == ["CR", "avg"] and 70.0 < scores["CR"] <= 100.0, scores


@needs_shared
@pytest.mark.skipif(not os.environ.get("SUITE_SLOW"), reason="over 2 minutes on 2 CPU cores (the 10-minute CI "
                    "budget); set SUITE_SLOW=1 to run it")
def test_minilm_fasttest_on_one_task_of_each_protocol(tmp_path):
    """CR (nested k-fold), TREC (k-fold, then test) and MRPC (pair features)."""
    scores = minilm_transfer(tmp_path, "CR", "TREC", "MRPC")
    assert list(scores) == ["CR", "TREC", "MRPC", "avg"] and all(50.0 < scores[t] <= 100.0 for t in ("CR", "TREC", "MRPC"))


@needs_shared
@pytest.mark.skipif(not os.environ.get("SUITE_SLOW"), reason="encodes 108k sentences (minutes on 2 CPU cores); "
                    "set SUITE_SLOW=1 to run it")
def test_minilm_fasttest_runs_all_seven_tasks(tmp_path):
    scores = minilm_transfer(tmp_path)
    assert list(scores) == et.TASKS + ["avg"] and all(50.0 < scores[t] <= 100.0 for t in et.TASKS)


def test_eval_transfer_flag_in_a_training_run(tiny_model, corpus, senteval_dir, tmp_path):
    import shutil
    from conftest import smoke_args
    root = tmp_path / "se"
    shutil.copytree(senteval_dir, root)
    write_transfer_tree(root, n=20)
    out = tmp_path / "run"
    import sscl  # in-process: the CLI has its own subprocess tests
    sscl.main([str(a) for a in smoke_args(tiny_model, corpus, root, out, "--neg_layers", 1, "--no_test_eval",
                                          "--eval_transfer", "fasttest")])
    results = json.loads((out / "results.json").read_text())
    assert list(results["transfer"]) == et.TASKS + ["avg"] and "test" not in results
    # The same numbers as eval_transfer.py on the saved checkpoint.
    assert in_process_scores(et, "--model_name_or_path", out / "best", "--pooler", "avg", "--senteval_dir",
                             root, "--mode", "fasttest") == results["transfer"]
