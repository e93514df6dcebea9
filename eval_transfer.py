"""SentEval's seven transfer tasks as SimCSE ran them (evaluation.py --mode test), fast.

MR, CR, SUBJ, MPQA, SST2 (binary), TREC and MRPC: a logistic regression (one linear layer) on frozen sentence
embeddings, SentEval's PyTorch classifier with SimCSE's settings: Adam, batch 64, the L2 penalty (weight decay)
chosen from {1e-5, 1e-4, 1e-3, 1e-2}, early stopping with tenacity 5, epoch size 4, at most 200 epochs, seed 1111.

- MR, CR, SUBJ, MPQA: 10-fold stratified cross-validation; in each training part an inner 10-fold CV chooses the
  L2 value, a refit on the whole part (early stopping on a 5% split of it) is scored on the held-out fold.
- TREC, MRPC: 10-fold CV on the training set chooses the L2 value; a refit on the whole training set (5% split
  for early stopping) is scored on the test set. MRPC's features are [|u - v|, u * v].
- SST2: the L2 value is chosen on dev (early stopping on dev); that classifier is scored on test.
- `--mode fasttest`: SentEval's prototyping setting (5 folds, RMSprop, batch 128, tenacity 3, epoch size 2).

Accuracy x100, two decimals, and the 7-task average. The data are read as SentEval reads them (latin-1 for MR,
CR, SUBJ, MPQA and TREC; examples sorted by length then label, which fixes the fold assignment), each classifier
starts from the same seeded initialisation and draws its epochs' orders from its own NumPy stream seeded 1111,
and the folds are scikit-learn's StratifiedKFold(shuffle=True, random_state=1111), written out here. What is new
is speed: every classifier of a task phase (for MR: 10 outer folds x 4 L2 values x 10 inner folds = 400) trains
at once as one batched model, a (models x D x classes) weight tensor updated with a per-model mask for the
models whose batch or epoch is over, and each distinct sentence is encoded once, length-sorted.
A leaf evaluator: it imports eval_sts.py (model loading, encoding) and common.py (the poolers), no training loop.

    python eval_transfer.py --model_name_or_path ../shared/models/all-MiniLM-L6-v2 --pooler cls_before_pooler \\
        --senteval_dir ../shared/data/senteval
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch

import common
import eval_sts
import plumbing
from plumbing import files
from plumbing import progress

TASKS = ["MR", "CR", "SUBJ", "MPQA", "SST2", "TREC", "MRPC"]
L2_VALUES = [1e-5, 1e-4, 1e-3, 1e-2]
SEED, MAX_EPOCH, VALIDATION_SPLIT = 1111, 200, 0.05
MODES = {"test": dict(kfold=10, optim="adam", batch_size=64, tenacity=5, epoch_size=4),
         "fasttest": dict(kfold=5, optim="rmsprop", batch_size=128, tenacity=3, epoch_size=2)}
TREC_CLASSES = {"ABBR": 0, "DESC": 1, "ENTY": 2, "HUM": 3, "LOC": 4, "NUM": 5}


# ---------------------------------------------------------------------------------------------- readers
def _lines(path: Path, encoding: str) -> list[str]:
    if not path.is_file():
        raise plumbing.UsageError(f"--senteval_dir: {path}: no such file")
    if encoding == "utf-8":
        return plumbing.read_lines(path, "--senteval_dir")
    return path.read_bytes().decode(encoding).splitlines()  # latin-1 decodes any byte, as SentEval reads it


def _bad_row(path, number, why):
    return plumbing.UsageError(f"--senteval_dir: {path} line {number}: {why}")


def _in_senteval_order(rows) -> tuple[list[str], np.ndarray]:
    """(sentences, labels) of (tokens, label) rows sorted by length, then label, as SentEval orders them (stable:
    ties keep file order)."""
    rows = sorted(rows, key=lambda z: (len(z[0]), z[1]))
    return [" ".join(tokens) for tokens, _ in rows], np.array([label for _, label in rows])


def load_task(senteval_dir, task: str) -> dict:
    """A task's splits as {"train": (sentences, labels), ...} (MRPC: (pairs, labels)), in SentEval's order."""
    root = Path(senteval_dir)
    binary = {"MR": ("MR", "rt-polarity.pos", "rt-polarity.neg"), "CR": ("CR", "custrev.pos", "custrev.neg"),
              "SUBJ": ("SUBJ", "subj.objective", "subj.subjective"), "MPQA": ("MPQA", "mpqa.pos", "mpqa.neg")}
    if task in binary:
        folder, first, second = binary[task]  # SentEval: label 1 for the first file, 0 for the second
        tokens = [(line.split(), label) for name, label in ((first, 1), (second, 0))
                  for line in _lines(root / folder / name, "latin-1")]
        return {"all": _in_senteval_order(tokens)}
    if task == "SST2":
        splits = {}
        for split in ("train", "dev", "test"):
            path, rows = root / "SST" / "binary" / f"sentiment-{split}", []
            for number, line in enumerate(_lines(path, "utf-8"), start=1):
                cols = line.strip().split("\t")
                if len(cols) < 2 or cols[1] not in ("0", "1"):
                    raise _bad_row(path, number, "expected 'sentence<TAB>0 or 1'")
                rows.append((cols[0].split(), int(cols[1])))
            splits[split] = _in_senteval_order(rows)
        return splits
    if task == "TREC":
        splits = {}
        for split, name in (("train", "train_5500.label"), ("test", "TREC_10.label")):
            path, rows = root / "TREC" / name, []
            for number, line in enumerate(_lines(path, "latin-1"), start=1):
                target, _, sample = line.strip().partition(":")
                if target not in TREC_CLASSES or " " not in sample:
                    raise _bad_row(path, number, "expected 'COARSE:fine question'")
                rows.append((sample.split(" ", 1)[1].split(), TREC_CLASSES[target]))
            splits[split] = _in_senteval_order(rows)
        return splits
    if task == "MRPC":
        splits = {}
        for split in ("train", "test"):
            path, rows = root / "MRPC" / f"msr_paraphrase_{split}.txt", []
            for number, line in enumerate(_lines(path, "utf-8")[1:], start=2):
                cols = line.strip().split("\t")
                if len(cols) < 5 or cols[0] not in ("0", "1"):
                    raise _bad_row(path, number, "expected 'quality<TAB>id<TAB>id<TAB>sentence<TAB>sentence'")
                rows.append((cols[3].split(), cols[4].split(), int(cols[0])))
            rows = sorted(rows, key=lambda z: (len(z[0]), len(z[1]), z[2]))  # stable, as SentEval's
            splits[split] = ([(" ".join(a), " ".join(b)) for a, b, _ in rows], np.array([l for _, _, l in rows]))
        return splits
    raise plumbing.UsageError(f"unknown transfer task '{task}'; choose from {', '.join(TASKS)}")


# ------------------------------------------------------------------------------------------------ folds
def stratified_folds(y: np.ndarray, k: int, seed: int = SEED) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train, test) index pairs of scikit-learn's StratifiedKFold(k, shuffle=True, random_state=seed).split."""
    _, first_index, inverse = np.unique(y, return_index=True, return_inverse=True)
    _, class_order = np.unique(first_index, return_inverse=True)
    encoded = class_order[inverse]  # classes numbered in order of first appearance
    n_classes = len(first_index)
    if np.bincount(encoded).max() < k:
        raise plumbing.UsageError(f"too few examples for {k}-fold cross-validation")
    ordered = np.sort(encoded)
    allocation = np.array([np.bincount(ordered[i::k], minlength=n_classes) for i in range(k)])
    rng, test_fold = np.random.RandomState(seed), np.empty(len(y), dtype=int)
    for c in range(n_classes):
        folds = np.arange(k).repeat(allocation[:, c])
        rng.shuffle(folds)
        test_fold[encoded == c] = folds
    return [(np.flatnonzero(test_fold != f), np.flatnonzero(test_fold == f)) for f in range(k)]


# ---------------------------------------------------------------------------------- batched classifiers
class Job:
    """SentEval classifiers that share their data: training rows, early-stopping rows and one RNG stream.

    SentEval reseeds NumPy (1111) in every classifier, so classifiers with the same rows draw the same epoch
    orders: the L2 values of one fold train on identical batches, and fit() gathers those batches once. With
    `validation` None, SentEval's validation_split: the first 5% of a permutation of `train` (drawn from the
    stream) stop early, the rest train.
    """

    def __init__(self, train: np.ndarray, validation: np.ndarray | None):
        self.rng = np.random.RandomState(SEED)
        if validation is None:
            permutation = self.rng.permutation(len(train))
            cut = int(VALIDATION_SPLIT * len(train))
            train, validation = train[permutation[cut:]], train[permutation[:cut]]
        self.train, self.validation = train, validation


def initial_weights(dim: int, n_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """nn.Linear(dim, n_classes) as SentEval builds it right after torch.manual_seed(1111): (dim x C, C)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        layer = torch.nn.Linear(dim, n_classes)
    return layer.weight.detach().T.contiguous(), layer.bias.detach().clone()


def accuracy(X, y, W, b, rows) -> float:
    predicted = (X[rows] @ W + b).argmax(dim=1)
    return (predicted == y[rows]).double().mean().item() if len(rows) else 0.0


def fit(X: torch.Tensor, y: torch.Tensor, jobs: list[Job], l2, n_classes: int, mode: str):
    """Train len(jobs) x K logistic regressions at once (job j with the L2 values l2[j]); returns, per job, a list
    of K (best validation accuracy, W, b).

    Equal, step for step, to training them one after another with SentEval's PyTorchClassifier: the same initial
    weights, the same per-epoch orders, Adam (or RMSprop) with the L2 value as weight decay on every parameter,
    mean cross-entropy, and its early stopping (the best model kept; stop once `tenacity` epochs have brought no
    new best, counted over the whole run, or past 200 epochs). Weights are (jobs, D, K * C). A job whose epoch has
    no batch left at a step is masked out of that update; a model that has stopped may go on training with its
    job (its columns touch no other model) but its result is frozen, and a job is dropped once all its K stopped.
    """
    cfg, C, device = MODES[mode], n_classes, X.device
    bs, K = cfg["batch_size"], len(l2[0])
    W0, b0 = initial_weights(X.shape[1], C)
    live = np.arange(len(jobs))  # the jobs still training; every state tensor below is indexed like `live`
    W = W0.to(device).repeat(len(jobs), 1, K).contiguous()  # (jobs, D, K*C)
    b = b0.to(device).repeat(len(jobs), K)  # (jobs, K*C)
    state = [torch.zeros_like(t) for t in (W, b, W, b)]  # Adam: m_W, m_b, v_W, v_b (RMSprop: v_W, v_b)
    steps = torch.zeros(len(jobs), 1, device=device)
    decay = torch.as_tensor(np.asarray(l2, dtype=np.float32), device=device).repeat_interleave(C, dim=1)
    best = [[(-1.0, W0, b0)] * K for _ in jobs]
    misses, running = np.zeros((len(jobs), K), dtype=int), np.ones((len(jobs), K), dtype=bool)
    epoch = 0
    while running.any() and epoch <= MAX_EPOCH:
        keep = running[live].any(axis=1)
        if not keep.all():  # drop the jobs whose K models have all stopped
            live, kept = live[keep], torch.from_numpy(np.flatnonzero(keep)).to(device)
            W, b, steps, decay = W[kept], b[kept], steps[kept], decay[kept]
            state = [t[kept] for t in state]
        for _ in range(cfg["epoch_size"]):
            orders = [jobs[j].train[jobs[j].rng.permutation(len(jobs[j].train))] for j in live]
            width = max(math.ceil(len(o) / bs) for o in orders) * bs
            rows = torch.zeros(len(live), width, dtype=torch.long)
            valid = torch.zeros(len(live), width, dtype=torch.bool)
            for i, order in enumerate(orders):
                rows[i, :len(order)], valid[i, :len(order)] = torch.from_numpy(order), True
            rows, valid = rows.to(device), valid.to(device)
            for start in range(0, width, bs):
                batch_rows, batch_valid = rows[:, start:start + bs], valid[:, start:start + bs]
                counts = batch_valid.sum(dim=1).clamp_min(1).to(X.dtype).view(-1, 1, 1, 1)
                xb = X[batch_rows]  # (jobs, bs, D): one gather serves the K models of a job
                logits = torch.baddbmm(b.unsqueeze(1), xb, W).view(len(live), -1, K, C)
                dlogits = torch.softmax(logits, dim=-1)
                dlogits -= torch.nn.functional.one_hot(y[batch_rows], C).to(X.dtype).unsqueeze(2)
                dlogits *= batch_valid.view(len(live), -1, 1, 1) / counts  # mean over the real rows
                dlogits = dlogits.view(len(live), -1, K * C)
                grads = [xb.transpose(1, 2) @ dlogits, dlogits.sum(dim=1)]
                has_batch = batch_valid[:, 0]
                _optimizer_step(cfg["optim"], [W, b], grads, state, steps, decay,
                                None if has_batch.all() else has_batch)
        epoch += cfg["epoch_size"]
        for i, j in enumerate(live):  # SentEval: a new best is kept; else stop once `tenacity` misses accumulated
            validation = torch.from_numpy(jobs[j].validation).to(device)
            predicted = (X[validation] @ W[i] + b[i]).view(len(validation), K, C).argmax(dim=-1)
            scores = (predicted == y[validation].unsqueeze(1)).double().mean(dim=0).tolist()
            for k in np.flatnonzero(running[j]):
                if scores[k] > best[j][k][0]:
                    best[j][k] = (scores[k], W[i][:, k * C:(k + 1) * C].clone(), b[i][k * C:(k + 1) * C].clone())
                elif misses[j, k] >= cfg["tenacity"]:
                    running[j, k] = False
                else:
                    misses[j, k] += 1
    return best


def _optimizer_step(optim: str, params, grads, state, steps, decay, has_batch):
    """torch.optim.Adam / RMSprop with default hyper-parameters and weight_decay = the L2 value, per job; the
    jobs outside `has_batch` (None: all have one) keep their parameters and moments."""
    mask = None if has_batch is None else has_batch.view(-1, 1)
    steps += 1 if mask is None else mask.to(steps.dtype)
    for k, (p, g) in enumerate(zip(params, grads)):
        view = (-1, *[1] * (p.dim() - 2), p.shape[-1])
        g = g + decay.view(view) * p
        if optim == "adam":
            m_new, v_new = 0.9 * state[k] + 0.1 * g, 0.999 * state[k + 2] + 0.001 * g * g
            t = steps.view(-1, *[1] * (p.dim() - 1))
            new = p - (1e-3 / (1 - 0.9 ** t)) * m_new / (v_new.sqrt() / torch.sqrt(1 - 0.999 ** t) + 1e-8)
            updates = [(state[k], m_new), (state[k + 2], v_new), (p, new)]
        else:
            v_new = 0.99 * state[k + 2] + 0.01 * g * g
            updates = [(state[k + 2], v_new), (p, p - 0.01 * g / (v_new.sqrt() + 1e-8))]
        for target, value in updates:
            target.copy_(value if mask is None else torch.where(mask.view(-1, *[1] * (p.dim() - 1)), value, target))


# ---------------------------------------------------------------------------------------------- protocols
def _best_l2(scores: np.ndarray) -> float:
    """SentEval's choice: the L2 value with the best mean accuracy over the folds (rounded to 0.01 %, first max)."""
    return L2_VALUES[int(np.argmax(np.round(100 * scores.mean(axis=0), 2)))]


def _accuracies(results) -> np.ndarray:
    return np.array([[score for score, _, _ in per_job] for per_job in results])  # (jobs, K)


def inner_kfold(X, y, n_classes, mode) -> float:
    """MR/CR/SUBJ/MPQA: outer k-fold; an inner k-fold on each training part picks L2; mean test accuracy."""
    k, labels = MODES[mode]["kfold"], y.cpu().numpy()
    outer = stratified_folds(labels, k)
    jobs = [Job(train[inner_train], train[inner_val]) for train, _ in outer
            for inner_train, inner_val in stratified_folds(labels[train], k)]
    scores = _accuracies(fit(X, y, jobs, [L2_VALUES] * len(jobs), n_classes, mode)).reshape(k, k, len(L2_VALUES))
    chosen = [[_best_l2(fold)] for fold in scores]
    refits = fit(X, y, [Job(train, None) for train, _ in outer], chosen, n_classes, mode)
    tests = [round(100 * accuracy(X, y, W, b, torch.from_numpy(test).to(X.device)), 2)
             for (_, test), ((_, W, b),) in zip(outer, refits)]
    return round(float(np.mean(tests)), 2)


def kfold_then_test(X, y, X_test, y_test, n_classes, mode) -> float:
    """TREC/MRPC: k-fold CV on train picks L2; a refit on all of train (5% early-stopping split) on test."""
    folds = stratified_folds(y.cpu().numpy(), MODES[mode]["kfold"])
    scores = _accuracies(fit(X, y, [Job(tr, te) for tr, te in folds], [L2_VALUES] * len(folds), n_classes, mode))
    ((_, W, b),), = fit(X, y, [Job(np.arange(len(y)), None)], [[_best_l2(scores)]], n_classes, mode)
    return round(100 * accuracy(X_test, y_test, W, b, torch.arange(len(y_test), device=X.device)), 2)


def dev_then_test(X, y, X_dev, y_dev, X_test, y_test, n_classes, mode) -> float:
    """SST2: each L2 value trained with early stopping on dev; the best on dev is scored on test."""
    n = len(y)
    results, = fit(torch.cat([X, X_dev]), torch.cat([y, y_dev]), [Job(np.arange(n), np.arange(n, n + len(y_dev)))],
                   [L2_VALUES], n_classes, mode)
    _, W, b = results[int(np.argmax([round(100 * s, 2) for s, _, _ in results]))]  # its refit is this same run
    return round(100 * accuracy(X_test, y_test, W, b, torch.arange(len(y_test), device=X.device)), 2)


def pair_features(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """MRPC's features of a sentence pair: [|u - v|, u * v] (SentEval's mrpc.py)."""
    return np.concatenate([np.abs(u - v), u * v], axis=1)


def evaluate(encode, senteval_dir, tasks=None, mode: str = "test", batch_size: int = 128, device="cpu") -> dict:
    """Accuracy x100 (two decimals) per transfer task and their average, for `encode(list[str]) -> np.ndarray`."""
    if mode not in MODES:
        raise plumbing.UsageError(f"unknown mode '{mode}'; use test or fasttest")
    tasks = list(tasks or TASKS)
    data = {task: load_task(senteval_dir, task) for task in tasks}
    sentences = [s for splits in data.values() for xs, _ in splits.values() for x in xs
                 for s in (x if isinstance(x, tuple) else (x,))]
    table = eval_sts.encode_unique(encode, sentences, batch_size, "transfer: encoding")

    def features(xs):
        if isinstance(xs[0], tuple):
            xs = pair_features(np.stack([table[a] for a, _ in xs]), np.stack([table[b] for _, b in xs]))
        else:
            xs = np.stack([table[s] for s in xs])
        return torch.as_tensor(xs, dtype=torch.float32, device=device)

    scores = {}
    bar = progress.Progress(len(data), "transfer: classifiers", unit="task", report_each=True)
    for task, splits in data.items():
        split = {name: (features(xs), torch.as_tensor(ys, device=device)) for name, (xs, ys) in splits.items()}
        n_classes = int(max(int(ys.max()) for _, ys in split.values())) + 1
        if "all" in split:
            scores[task] = inner_kfold(*split["all"], n_classes, mode)
        elif "dev" in split:
            scores[task] = dev_then_test(*split["train"], *split["dev"], *split["test"], n_classes, mode)
        else:
            scores[task] = kfold_then_test(*split["train"], *split["test"], n_classes, mode)
        bar.set_postfix(**{task: scores[task]})
        bar.update()
    bar.close()
    scores["avg"] = round(sum(scores[t] for t in tasks) / len(tasks), 2)
    return scores


def main(argv=None) -> None:
    parser = plumbing.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="Hugging Face model id or local directory")
    parser.add_argument("--pooler", default=None, choices=common.POOLERS,
                        help="as in eval_sts.py (default: the checkpoint's recorded pooler, else cls_before_pooler)")
    parser.add_argument("--senteval_dir", default=None, help="SentEval data folder (default: HF senteval.tar)")
    parser.add_argument("--mode", default="test", choices=list(MODES), help="test: SimCSE's setting; fasttest: "
                        "SentEval's prototyping setting")
    parser.add_argument("--tasks", nargs="+", default=None, choices=TASKS, help="subset of tasks")
    parser.add_argument("--batch_size", type=int, default=128, help="sentences per encoding batch")
    parser.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda if available)")
    parser.add_argument("--json", default=None, help="write the scores to this JSON file")
    args = parser.parse_args(argv)
    plumbing.check_range(args, "batch_size", lambda v: v >= 1, "a positive integer")
    plumbing.check_json_path(args.json)
    device = plumbing.resolve_device(args.device)
    senteval_dir = eval_sts.resolve_senteval_dir(args.senteval_dir)
    args.pooler = eval_sts.checkpoint_pooler(args.model_name_or_path, args.pooler)
    encode = eval_sts.load_encode(args.model_name_or_path, args.pooler, device)
    encoding_s = [0.0]

    def timed_encode(sentences):
        before = time.perf_counter()
        embeddings = encode(sentences)
        encoding_s[0] += time.perf_counter() - before
        return embeddings

    start = time.perf_counter()
    scores = evaluate(timed_encode, senteval_dir, args.tasks, args.mode, args.batch_size, device)
    wall_s = time.perf_counter() - start
    print(f"{args.model_name_or_path} ({args.pooler}, transfer --mode {args.mode})")
    eval_sts.print_table(scores)
    print(f"transfer evaluation wall time {wall_s:.1f}s: encoding {encoding_s[0]:.1f}s, "
          f"classifiers {wall_s - encoding_s[0]:.1f}s")
    if args.json:
        files.write_json(Path(args.json), scores)


if __name__ == "__main__":
    plumbing.cli(main)
