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

Usable on its own with any `encode(list[str]) -> np.ndarray`; it imports only plumbing.py from the suite (the
one-line errors, the hub download of senteval.tar, atomic JSON, progress), which a reader can skip.

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

import plumbing

POOLERS = ("cls", "cls_before_pooler", "avg", "avg_top2", "avg_first_last")
STS_SUBSETS = {
    "STS12": ["MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"],
    "STS13": ["FNWN", "headlines", "OnWN"],  # SMT is not shipped (licence), as in SentEval
    "STS14": ["deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"],
    "STS15": ["answers-forums", "answers-students", "belief", "headlines", "images"],
    "STS16": ["answer-answer", "headlines", "plagiarism", "postediting", "question-question"],
}
TASKS = ["STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness"]
DEV_TASKS = ["STSBenchmark", "SICKRelatedness"]


# ------------------------------------------------------------------------------------ hub and loading


# -------------------------------------------------------------------------------------------- poolers
def pool(hidden_states, attention_mask, pooler: str, pooler_output=None) -> torch.Tensor:
    """SimCSE's poolers over a model's hidden states (tuple: embeddings, layer 1, ..., layer L)."""
    if pooler == "cls":
        if pooler_output is None:
            raise plumbing.UsageError("this model has no pooler layer; use --pooler cls_before_pooler")
        return pooler_output
    if pooler == "cls_before_pooler":
        return hidden_states[-1][:, 0]
    mask = attention_mask.unsqueeze(-1).float()  # means in fp32, whatever precision the encoder ran in
    if pooler == "avg":
        layer = hidden_states[-1]
    elif pooler == "avg_top2":
        layer = (hidden_states[-2] + hidden_states[-1]) / 2.0
    elif pooler == "avg_first_last":
        layer = (hidden_states[1] + hidden_states[-1]) / 2.0
    else:
        raise plumbing.UsageError(f"unknown pooler '{pooler}'; choose one of {', '.join(POOLERS)}")
    return (layer.float() * mask).sum(1) / mask.sum(1)


def make_encode(embed_batch, tokenizer, device):
    """encode(list[str]) -> np.ndarray, from `embed_batch(tokenised batch on device) -> tensor`; fp32, no grad."""
    max_length = min(getattr(tokenizer, "model_max_length", 512) or 512, 512)

    @torch.no_grad()
    def encode(sentences):
        batch = tokenizer(sentences, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        return embed_batch({k: v.to(device) for k, v in batch.items()}).float().cpu().numpy()
    return encode


def load_encode(name_or_path: str, pooler: str, device):
    """encode(list[str]) of a saved model (local directory or hub id) with one of SimCSE's poolers, eval mode; a
    linear projection saved beside the model (SSCL Table 5's output dimension) follows the pooler."""
    tokenizer, backbone = plumbing.load_pretrained(name_or_path)
    encode = pooled_encode(backbone.to(device).eval(), tokenizer, pooler, device)
    projection = plumbing.load_projection(name_or_path)
    return encode if projection is None else project(encode, projection.to(device))


def project(encode, projection: torch.nn.Module):
    """encode(list[str]) followed by a linear `projection` (its current weights), in fp32."""
    @torch.no_grad()
    def projected(sentences):
        return projection(torch.from_numpy(encode(sentences)).to(projection.weight.device)).cpu().numpy()
    return projected


def pooled_encode(backbone, tokenizer, pooler: str, device):
    """encode(list[str]) -> np.ndarray for a plain Hugging Face model with one of SimCSE's poolers."""
    def embed_batch(batch):
        outputs = backbone(**batch, output_hidden_states=True)
        return pool(outputs.hidden_states, batch["attention_mask"], pooler, getattr(outputs, "pooler_output", None))
    return make_encode(embed_batch, tokenizer, device)


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


# ---------------------------------------------------------------------------------------- evaluation
def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return (a * b).sum(axis=1)


def encode_unique(encode, sentences, batch_size: int = 128, desc: str = "encoding") -> dict:
    """{sentence: vector}, each distinct sentence encoded once, in length-sorted batches: the longest batch first,
    so that the ETA errs long and a batch too big for memory fails at once."""
    unique = sorted(set(sentences), key=lambda s: (len(s), s))
    table = {}
    with plumbing.Progress(len(unique), desc, unit="sentence") as bar:
        for i in reversed(range(0, len(unique), batch_size)):
            table.update(zip(unique[i:i + batch_size], encode(unique[i:i + batch_size])))
            bar.update(len(unique[i:i + batch_size]))
    return table


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


def pair_cosines(pairs, embed) -> np.ndarray:
    """The cosine similarity of each (sentence1, sentence2, gold) pair, `embed(list[str]) -> np.ndarray`."""
    left, right, _ = zip(*pairs)
    return _cosine(embed(list(left)), embed(list(right)))


def spearman(pairs, embed) -> float:
    """Spearman x100 (two decimals) between the pairs' cosine similarities and their gold scores."""
    gold = np.array([p[2] for p in pairs])
    return round(float(spearmanr(pair_cosines(pairs, embed), gold).correlation) * 100, 2)


def align_uniform_loss(x: np.ndarray, y: np.ndarray, data: np.ndarray) -> tuple[float, float]:
    """(l_align, l_uniform) of Wang & Isola (2020) on L2-normalised embeddings (SimCSE Eq. 2-3).

    l_align = mean_i ||f(x_i) - f(y_i)||^2 over the positive pairs (x_i, y_i); l_uniform = log mean over all
    pairs i < j of distinct rows of `data` of exp(-2 ||f(d_i) - f(d_j)||^2).
    """
    def unit(a):
        a = np.asarray(a, dtype=np.float64)
        return a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    x, y, data = unit(x), unit(y), unit(data)
    align = float(np.mean(np.sum((x - y) ** 2, axis=1)))
    squared = np.maximum(2.0 - 2.0 * data @ data.T, 0.0)  # ||a - b||^2 of unit vectors
    upper = squared[np.triu_indices(len(data), k=1)]
    log_terms = -2.0 * upper
    uniform = float(np.log(np.mean(np.exp(log_terms - log_terms.max()))) + log_terms.max())
    return align, uniform


def align_uniform(encode, senteval_dir, batch_size: int = 128, desc: str = "alignment/uniformity") -> dict:
    """SimCSE's alignment/uniformity: STS-B dev pairs with gold score > 4 as positives, all its sentences as data."""
    pairs = load_pairs(senteval_dir, "STSBenchmark", "dev")
    return pairs_align_uniform(pairs, encode_unique(encode, [s for p in pairs for s in p[:2]], batch_size, desc))


def pairs_align_uniform(pairs, table: dict) -> dict:
    """{"align", "uniform"} (four decimals) of encoded STS pairs (`table`: {sentence: vector}, every distinct
    sentence of `pairs`): the pairs with gold score > 4 as positives, every distinct sentence as data."""
    positives = [p for p in pairs if p[2] > 4.0]
    align, uniform = align_uniform_loss(np.stack([table[a] for a, _, _ in positives]),
                                        np.stack([table[b] for _, b, _ in positives]), np.stack(list(table.values())))
    return {"align": round(align, 4), "uniform": round(uniform, 4)}


def stsb_dev(encode, senteval_dir, batch_size: int = 128, desc: str = "STS-B dev") -> dict:
    """{"STSBenchmark", "align", "uniform"}: the dev score of `evaluate(..., ["STSBenchmark"], "dev")` and the
    `align_uniform` of the same embeddings, from one encoding of STS-B dev (the training runs' dev gate)."""
    pairs = load_pairs(senteval_dir, "STSBenchmark", "dev")
    table = encode_unique(encode, [s for p in pairs for s in p[:2]], batch_size, desc)
    score = spearman(pairs, lambda sentences: np.stack([table[s] for s in sentences]))
    return {"STSBenchmark": score, **pairs_align_uniform(pairs, table)}


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
    root = plumbing.senteval_folder(senteval_dir)  # the given folder, or senteval.tar from the hub
    for task in check:
        for split in ("test", "dev") if task in DEV_TASKS else ("test",):
            load_pairs(root, task, split)
    return root


def main(argv=None) -> None:
    parser = plumbing.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="Hugging Face model id or local directory")
    parser.add_argument("--pooler", default="cls_before_pooler", choices=POOLERS,
                        help="cls = BERT's pooler output (a SimCSE checkpoint's MLP); cls_before_pooler = last "
                             "[CLS]; avg, avg_top2, avg_first_last = masked means")
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
        plumbing.write_json(Path(args.json), scores)


if __name__ == "__main__":
    plumbing.cli(main)
