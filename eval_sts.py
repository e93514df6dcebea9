"""The SentEval STS protocol exactly as SimCSE reports it (Gao et al. 2021, Table 5 and evaluation.py).

- STS12-16: Spearman over the concatenation of all of a task's subsets (SentEval's "all" setting), pairs whose
  gold line is empty dropped; STS-B and SICK-R: Spearman on the test split (--mode dev: the dev splits of
  STS-B and SICK-R only). Cosine similarity, no regressor. Scores x100 with two decimals; the average is taken
  over the two-decimal scores, as SimCSE's evaluation.py does.
- Sentences are whitespace-split and re-joined with single spaces, as SentEval's batcher does.
- Fast: every distinct sentence is encoded once, in batches sorted by length; the numbers equal encoding in
  file order (to 0.01, padding changes float rounding only).
- Alignment and uniformity (Wang & Isola 2020, SimCSE Section 2 / Figure 2) with --align_uniform, on the STS-B
  dev split: the split the training runs' dev gate already reads, so the test split stays untouched.

Usable on its own with any `encode(list[str]) -> np.ndarray`. The metric (Spearman of the cosines, l_align and
l_uniform, each distinct sentence encoded once) is the one the training runs' dev gate uses too; the poolers are
common.py's; plumbing/ gives the one-line errors, the hub download of senteval.tar, atomic JSON and progress.

    python eval_sts.py --model_name_or_path runs/simcse/best --pooler cls_before_pooler
    python eval_sts.py --model_name_or_path ../shared/models/all-MiniLM-L6-v2 --pooler avg \\
        --senteval_dir ../shared/data/senteval --align_uniform
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

import common
import plumbing
from plumbing import files, hub, progress

STS_SUBSETS = {
    "STS12": ["MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"],
    "STS13": ["FNWN", "headlines", "OnWN"],  # SMT is not shipped (licence), as in SentEval
    "STS14": ["deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"],
    "STS15": ["answers-forums", "answers-students", "belief", "headlines", "images"],
    "STS16": ["answer-answer", "headlines", "plagiarism", "postediting", "question-question"],
}
TASKS = ["STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness"]
DEV_TASKS = ["STSBenchmark", "SICKRelatedness"]


# -------------------------------------------------------------------------------------------- loading
def load_encode(name_or_path: str, pooler: str, device):
    """encode(list[str]) of a saved model (local directory or hub id) with one of SimCSE's poolers, eval mode; "cls"
    is a run's trained MLP head on the last [CLS] where one is saved beside the model, else the model's pooler layer.
    A linear projection saved beside the model (SSCL Table 5's output dimension) follows the pooler."""
    tokenizer, backbone = hub.load_pretrained(name_or_path)
    head = None
    if pooler == "cls":
        linear = files.load_linear(name_or_path, files.HEAD_FILE)
        head = None if linear is None else torch.nn.Sequential(linear, torch.nn.Tanh()).to(device)
        if head is None and getattr(backbone, "pooler", None) is None:
            raise plumbing.UsageError(f"--pooler cls: {name_or_path} has no pooler layer and no trained MLP head "
                                      f"({files.HEAD_FILE}); use --pooler cls_before_pooler")
    encode = common.model_encode(backbone.to(device).eval(), head, tokenizer, pooler, device)
    projection = files.load_linear(name_or_path, files.PROJECTION_FILE)
    return encode if projection is None else common.project(encode, projection.to(device))


def checkpoint_pooler(name_or_path: str, pooler: str | None) -> str:
    """--pooler, else the one a training run recorded beside its checkpoint, else cls_before_pooler; a note when the
    given one is not the recorded one."""
    recorded = files.recorded_pooler(name_or_path)
    if pooler is not None and recorded is not None and pooler != recorded:
        print(f"note: {name_or_path} was evaluated with --pooler {recorded} by the run that trained it")
    return pooler or recorded or "cls_before_pooler"


# ---------------------------------------------------------------------------------------------- data
def _normalise(sentence: str) -> str:
    return " ".join(sentence.split())


def _columns(line: str, path, number: int, needed: int) -> list[str]:
    cols = line.rstrip("\n").split("\t")
    if len(cols) < needed:
        raise plumbing.UsageError(f"--senteval_dir: {path} line {number} has {len(cols)} tab-separated column(s), "
                         f"expected {needed}")
    return cols


def load_pairs(senteval_dir, task: str, split: str = "test") -> list[tuple[str, str, float]]:
    """(sentence1, sentence2, gold score) triples of one task, in file order; a malformed row names its line."""
    root, flag = Path(senteval_dir), "--senteval_dir"
    pairs = []
    if task in STS_SUBSETS:
        folder = root / "STS" / f"{task}-en-test"
        for subset in STS_SUBSETS[task]:
            input_path, gold_path = folder / f"STS.input.{subset}.txt", folder / f"STS.gs.{subset}.txt"
            inputs, gold = plumbing.read_lines(input_path, flag), plumbing.read_lines(gold_path, flag)
            for number, (line, score) in enumerate(zip(inputs, gold), start=1):
                if score.strip():
                    s1, s2 = _columns(line, input_path, number, 2)[:2]
                    pairs.append((_normalise(s1), _normalise(s2), plumbing.parse_score(score, gold_path, number, flag)))
    elif task == "STSBenchmark":
        path = root / "STS" / "STSBenchmark" / f"sts-{split}.csv"
        for number, line in enumerate(plumbing.read_lines(path, flag), start=1):
            cols = _columns(line, path, number, 7)
            pairs.append((_normalise(cols[5]), _normalise(cols[6]), plumbing.parse_score(cols[4], path, number, flag)))
    elif task == "SICKRelatedness":
        name = {"train": "SICK_train.txt", "dev": "SICK_trial.txt", "test": "SICK_test_annotated.txt"}[split]
        path = root / "SICK" / name
        for number, line in enumerate(plumbing.read_lines(path, flag)[1:], start=2):
            cols = _columns(line, path, number, 4)
            pairs.append((_normalise(cols[1]), _normalise(cols[2]), plumbing.parse_score(cols[3], path, number, flag)))
    else:
        raise plumbing.UsageError(f"unknown task '{task}'; choose from {', '.join(TASKS)}")
    return pairs


# -------------------------------------------------------------------------------------------- metric
def encode_unique(encode, sentences, batch_size: int = 128, desc: str = "encoding") -> dict:
    """{sentence: vector}: each distinct sentence once, length-sorted batches, the longest first."""
    unique = sorted(set(sentences), key=lambda s: (len(s), s))
    table = {}
    with progress.Progress(len(unique), desc, unit="sentence") as bar:
        for i in reversed(range(0, len(unique), batch_size)):
            table.update(zip(unique[i:i + batch_size], encode(unique[i:i + batch_size])))
            bar.update(len(unique[i:i + batch_size]))
    return table


def unit_rows(a: np.ndarray) -> np.ndarray:
    """Each row divided by its norm (a zero row stays zero)."""
    return a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)


def spearman(pairs, embed) -> float:
    """Spearman x 100 (two decimals) of the pairs' cosines (embed(list[str]) -> np.ndarray) against their gold scores,
    as SentEval's STS."""
    left, right, gold = zip(*pairs)
    cosine = (unit_rows(embed(list(left))) * unit_rows(embed(list(right)))).sum(axis=1)
    return round(float(spearmanr(cosine, np.array(gold)).correlation) * 100, 2)


def alignment_uniformity(pairs, table: dict) -> dict:
    """l_align / l_uniform (Wang & Isola 2020, SimCSE Eq. 2-3) on unit vectors, four decimals: the pairs with gold
    score > 4 as positives, every distinct sentence of `table` as the data."""
    def unit(rows):  # in fp64
        return unit_rows(np.asarray(rows, dtype=np.float64))
    x, y = (unit([table[p[i]] for p in pairs if p[2] > 4.0]) for i in (0, 1))
    data = unit(list(table.values()))
    exponent = -2.0 * np.maximum(2.0 - 2.0 * data @ data.T, 0.0)[np.triu_indices(len(data), k=1)]
    uniform = np.log(np.mean(np.exp(exponent - exponent.max()))) + exponent.max()
    return {"align": round(float(np.mean(np.sum((x - y) ** 2, axis=1))), 4), "uniform": round(float(uniform), 4)}


# ---------------------------------------------------------------------------------------- evaluation
def evaluate(encode, senteval_dir, tasks=None, mode: str = "test", batch_size: int = 128,
             fast: bool = True, desc: str | None = None) -> dict:
    """Spearman x100 (two decimals) per task and their average, for `encode(list[str]) -> np.ndarray`.

    mode "test": the 7 tasks (STS-B / SICK-R on their test split); mode "dev": the dev splits of STS-B and
    SICK-R. `fast=False` encodes every pair in file order with no de-duplication (the reference it must match).
    """
    if mode not in ("test", "dev"):
        raise plumbing.UsageError(f"unknown mode '{mode}'; use test or dev")
    tasks = list(tasks or (TASKS if mode == "test" else DEV_TASKS))
    if mode == "dev" and set(tasks) - set(DEV_TASKS):
        raise plumbing.UsageError(f"--mode dev has only {', '.join(DEV_TASKS)}")
    pairs = {task: load_pairs(senteval_dir, task, "dev" if mode == "dev" else "test") for task in tasks}

    if fast:
        table = encode_unique(encode, [s for task_pairs in pairs.values() for p in task_pairs for s in p[:2]],
                              batch_size, desc or f"STS {mode}: encoding")

        def embed(sentences):
            return np.stack([table[s] for s in sentences])
    else:
        def embed(sentences):
            return np.concatenate([encode(sentences[i:i + batch_size]) for i in range(0, len(sentences), batch_size)])

    scores = {task: spearman(task_pairs, embed) for task, task_pairs in pairs.items()}
    scores["avg"] = round(sum(scores[t] for t in tasks) / len(tasks), 2)
    return scores


def align_uniform(encode, senteval_dir, batch_size: int = 128, desc: str = "alignment/uniformity") -> dict:
    """SimCSE's alignment/uniformity: STS-B dev pairs with gold score > 4 as positives, all its sentences as data."""
    pairs = load_pairs(senteval_dir, "STSBenchmark", "dev")
    return alignment_uniformity(pairs, encode_unique(encode, [s for p in pairs for s in p[:2]], batch_size,
                                                            desc))


def print_table(scores: dict) -> None:
    """A table like SimCSE's evaluation.py."""
    names = list(scores)
    widths = [max(len(n), 6) for n in names]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    print(line)
    print("| " + " | ".join(n.ljust(w) for n, w in zip(names, widths)) + " |")
    print(line)
    print("| " + " | ".join(f"{scores[n]:.2f}".ljust(w) for n, w in zip(names, widths)) + " |")
    print(line)


def resolve_senteval_dir(senteval_dir: str | None, check=()) -> Path:
    """The given folder, or senteval.tar from the HF dataset repo (downloaded with huggingface_hub, unpacked once).

    The tasks in `check` are read once (test split, and dev for STS-B and SICK-R), so that a training run finds a
    missing or malformed file before it trains, not after.
    """
    root = hub.senteval_folder(senteval_dir)  # the given folder, or senteval.tar from the hub
    for task in check:
        for split in ("test", "dev") if task in DEV_TASKS else ("test",):
            load_pairs(root, task, split)
    return root


def main(argv=None) -> None:
    parser = plumbing.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="Hugging Face model id or local directory")
    parser.add_argument("--pooler", default=None, choices=common.POOLERS,
                        help="cls = a run's MLP head (else BERT's pooler output); cls_before_pooler = last [CLS]; "
                             "avg, avg_top2, avg_first_last (layer 1 + last), avg_embeddings_last (the embedding "
                             "output + last, SimCSE++'s, SSCL's and miCSE's first-last) = masked means; default: "
                             "the pooler a run recorded in its checkpoint, else cls_before_pooler")
    parser.add_argument("--senteval_dir", default=None, help="SentEval data folder (default: HF senteval.tar)")
    parser.add_argument("--mode", default="test", choices=["test", "dev"], help="test: 7 tasks; dev: STS-B/SICK-R dev")
    parser.add_argument("--tasks", nargs="+", default=None, choices=TASKS, help="subset of tasks")
    parser.add_argument("--align_uniform", action="store_true",
                        help="also report l_align and l_uniform on STS-B dev (SimCSE Figure 2)")
    parser.add_argument("--batch_size", type=int, default=128, help="sentences per encoding batch")
    parser.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda if available)")
    parser.add_argument("--json", default=None, help="write the scores to this JSON file")
    args = parser.parse_args(argv)
    plumbing.check_range(args, "batch_size", lambda v: v >= 1, "a positive integer")
    plumbing.check_json_path(args.json)
    device = plumbing.resolve_device(args.device)

    senteval_dir = resolve_senteval_dir(args.senteval_dir)
    args.pooler = checkpoint_pooler(args.model_name_or_path, args.pooler)
    encode = load_encode(args.model_name_or_path, args.pooler, device)
    start = time.perf_counter()
    scores = evaluate(encode, senteval_dir, args.tasks, args.mode, args.batch_size)
    print(f"{args.model_name_or_path} ({args.pooler}, {args.mode})")
    print_table(scores)
    if args.align_uniform:
        scores.update(align_uniform(encode, senteval_dir, args.batch_size))
        print(f"l_align {scores['align']:.4f}  l_uniform {scores['uniform']:.4f}  (STS-B dev)")
    print(f"evaluation wall time {time.perf_counter() - start:.1f}s")
    if args.json:
        files.write_json(Path(args.json), scores)


if __name__ == "__main__":
    plumbing.cli(main)
