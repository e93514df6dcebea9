"""The SentEval STS protocol exactly as SimCSE reports it (Gao et al. 2021, Table 5 and evaluation.py).

- STS12-16: Spearman over the concatenation of all of a task's subsets (SentEval's "all" setting), pairs whose
  gold line is empty dropped; STS-B and SICK-R: Spearman on the test split (--mode dev: the dev splits of
  STS-B and SICK-R only). Cosine similarity, no regressor. Scores x100 with two decimals; the average is taken
  over the two-decimal scores, as SimCSE's evaluation.py does.
- Sentences are whitespace-split and re-joined with single spaces, as SentEval's batcher does.
- Fast: every distinct sentence is encoded once, in batches sorted by length; the numbers equal encoding in
  file order (to 0.01, padding changes float rounding only).

    python eval_sts.py --model_name_or_path runs/simcse --pooler cls_before_pooler
    python eval_sts.py --model_name_or_path ../shared/models/all-MiniLM-L6-v2 --pooler avg \\
        --senteval_dir ../shared/data/senteval
"""
from __future__ import annotations

import json
import tarfile
import time
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

import common

STS_SUBSETS = {
    "STS12": ["MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"],
    "STS13": ["FNWN", "headlines", "OnWN"],  # SMT is not shipped (licence), as in SentEval
    "STS14": ["deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"],
    "STS15": ["answers-forums", "answers-students", "belief", "headlines", "images"],
    "STS16": ["answer-answer", "headlines", "plagiarism", "postediting", "question-question"],
}
TASKS = ["STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness"]
DEV_TASKS = ["STSBenchmark", "SICKRelatedness"]


def _normalise(sentence: str) -> str:
    return " ".join(sentence.split())


def load_pairs(senteval_dir, task: str, split: str = "test") -> list[tuple[str, str, float]]:
    """(sentence1, sentence2, gold score) triples of one task, in file order."""
    root = Path(senteval_dir)
    pairs = []
    if task in STS_SUBSETS:
        folder = root / "STS" / f"{task}-en-test"
        for subset in STS_SUBSETS[task]:
            inputs = (folder / f"STS.input.{subset}.txt").read_text(encoding="utf-8").splitlines()
            gold = (folder / f"STS.gs.{subset}.txt").read_text(encoding="utf-8").splitlines()
            for line, score in zip(inputs, gold):
                if score.strip():
                    s1, s2 = line.split("\t")[:2]
                    pairs.append((_normalise(s1), _normalise(s2), float(score)))
    elif task == "STSBenchmark":
        path = root / "STS" / "STSBenchmark" / f"sts-{split}.csv"
        for line in path.read_text(encoding="utf-8").splitlines():
            cols = line.strip().split("\t")
            pairs.append((_normalise(cols[5]), _normalise(cols[6]), float(cols[4])))
    elif task == "SICKRelatedness":
        name = {"train": "SICK_train.txt", "dev": "SICK_trial.txt", "test": "SICK_test_annotated.txt"}[split]
        for line in (root / "SICK" / name).read_text(encoding="utf-8").splitlines()[1:]:
            cols = line.strip().split("\t")
            pairs.append((_normalise(cols[1]), _normalise(cols[2]), float(cols[3])))
    else:
        raise common.CLIError(f"unknown task '{task}'; choose from {', '.join(TASKS)}")
    return pairs


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return (a * b).sum(axis=1)


def evaluate(encode, senteval_dir, tasks=None, mode: str = "test", batch_size: int = 128,
             fast: bool = True) -> dict:
    """Spearman x100 (two decimals) per task and their average, for `encode(list[str]) -> np.ndarray`.

    mode "test": the 7 tasks (STS-B / SICK-R on their test split); mode "dev": the dev splits of STS-B and
    SICK-R. `fast=False` encodes every pair in file order with no de-duplication (the reference it must match).
    """
    if mode not in ("test", "dev"):
        raise common.CLIError(f"unknown mode '{mode}'; use test or dev")
    tasks = list(tasks or (TASKS if mode == "test" else DEV_TASKS))
    if mode == "dev" and set(tasks) - set(DEV_TASKS):
        raise common.CLIError(f"--mode dev has only {', '.join(DEV_TASKS)}")
    pairs = {task: load_pairs(senteval_dir, task, "dev" if mode == "dev" else "test") for task in tasks}

    if fast:
        unique = sorted({s for task_pairs in pairs.values() for p in task_pairs for s in p[:2]},
                        key=lambda s: (len(s), s))
        vectors = np.concatenate([encode(unique[i:i + batch_size]) for i in range(0, len(unique), batch_size)])
        index = {s: i for i, s in enumerate(unique)}

        def embed(sentences):
            return vectors[[index[s] for s in sentences]]
    else:
        def embed(sentences):
            return np.concatenate([encode(sentences[i:i + batch_size]) for i in range(0, len(sentences), batch_size)])

    scores = {}
    for task, task_pairs in pairs.items():
        left, right, gold = zip(*task_pairs)
        predicted = _cosine(embed(list(left)), embed(list(right)))
        scores[task] = round(float(spearmanr(predicted, np.array(gold)).correlation) * 100, 2)
    scores["avg"] = round(sum(scores[t] for t in tasks) / len(tasks), 2)
    return scores


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


def _find_data_root(folder: Path) -> Path | None:
    """The folder that holds STS/ (SentEval's data/downstream), searched a few levels down."""
    for candidate in [folder, *sorted(folder.glob("*")), *sorted(folder.glob("*/*")), *sorted(folder.glob("*/*/*"))]:
        if (candidate / "STS").is_dir():
            return candidate
    return None


def resolve_senteval_dir(senteval_dir: str | None) -> Path:
    """The given folder, or senteval.tar from the HF dataset repo (downloaded with huggingface_hub, unpacked once)."""
    if senteval_dir is not None:
        root = _find_data_root(Path(senteval_dir)) if Path(senteval_dir).is_dir() else None
        if root is None:
            raise common.CLIError(f"--senteval_dir {senteval_dir}: no SentEval STS/ folder found there")
        return root
    tar_path = Path(common.hub_dataset_file("senteval.tar", "--senteval_dir"))
    target = tar_path.parent / "senteval_unpacked"
    if _find_data_root(target) is None:
        with tarfile.open(tar_path) as tar:
            try:
                tar.extractall(target, filter="data")
            except TypeError:  # Python releases before the extraction filters
                tar.extractall(target)
    root = _find_data_root(target)
    if root is None:
        raise common.CLIError(f"{tar_path} has no STS/ folder; pass --senteval_dir")
    return root


def main(argv=None) -> None:
    import torch
    parser = common.Parser(description=__doc__, formatter_class=common.argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="Hugging Face model id or local directory")
    parser.add_argument("--pooler", default="cls_before_pooler", choices=common.POOLERS,
                        help="cls = BERT's pooler output (a SimCSE checkpoint's MLP); cls_before_pooler = last "
                             "[CLS]; avg, avg_top2, avg_first_last = masked means")
    parser.add_argument("--senteval_dir", default=None, help="SentEval data folder (default: HF senteval.tar)")
    parser.add_argument("--mode", default="test", choices=["test", "dev"], help="test: 7 tasks; dev: STS-B/SICK-R dev")
    parser.add_argument("--tasks", nargs="+", default=None, choices=TASKS, help="subset of tasks")
    parser.add_argument("--batch_size", type=int, default=128, help="sentences per encoding batch")
    parser.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda if available)")
    parser.add_argument("--json", default=None, help="write the scores to this JSON file")
    args = parser.parse_args(argv)

    senteval_dir = resolve_senteval_dir(args.senteval_dir)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer, model = common.load_pretrained(args.model_name_or_path)
    model.to(device).eval()
    encode = common.pooled_encode(model, tokenizer, args.pooler, device)
    start = time.perf_counter()
    scores = evaluate(encode, senteval_dir, args.tasks, args.mode, args.batch_size)
    print(f"{args.model_name_or_path} ({args.pooler}, {args.mode})")
    print_table(scores)
    print(f"evaluation wall time {time.perf_counter() - start:.1f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(scores, indent=2))


if __name__ == "__main__":
    common.cli(main)
