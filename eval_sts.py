"""The SentEval STS protocol exactly as SimCSE reports it (Gao et al. 2021, Table 5 and evaluation.py).

- STS12-16: Spearman over the concatenation of all of a task's subsets (SentEval's "all" setting), pairs whose
  gold line is empty dropped; STS-B and SICK-R: Spearman on the test split (--mode dev: the dev splits of
  STS-B and SICK-R only). Cosine similarity, no regressor. Scores x100 with two decimals; the average is taken
  over the two-decimal scores, as SimCSE's evaluation.py does.
- Sentences are whitespace-split and re-joined with single spaces, as SentEval's batcher does.
- Fast: every distinct sentence is encoded once, in batches sorted by token count (little padding), kept on the
  device until one copy; the numbers equal encoding in file order (to 0.01, padding changes float rounding only).
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
import math
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import common
import plumbing
from plumbing import backbones, files, hub, progress, provenance

STS_SUBSETS = {
    "STS12": ["MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"],
    "STS13": ["FNWN", "headlines", "OnWN"],  # SMT is not shipped (licence), as in SentEval
    "STS14": ["deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"],
    "STS15": ["answers-forums", "answers-students", "belief", "headlines", "images"],
    "STS16": ["answer-answer", "headlines", "plagiarism", "postediting", "question-question"],
}
TASKS = ["STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness"]
DEV_TASKS = ["STSBenchmark", "SICKRelatedness"]
# what an offline machine passes to the evaluators (eval_sts.py, eval_transfer.py, tools/): their own flags alone
OFFLINE_FLAGS = "--model_name_or_path and --senteval_dir"


# -------------------------------------------------------------------------------------------- loading
def load_encode(name_or_path: str, pooler: str, device, offline: str = OFFLINE_FLAGS):
    """encode(list[str]) of a saved model (local directory or hub id) with one of SimCSE's poolers, eval mode; "cls"
    is a run's trained MLP head on the last [CLS] where one is saved beside the model, else the model's pooler layer.
    A linear projection saved beside the model (SSCL Table 5's output dimension) follows the pooler."""
    tokenizer, backbone = hub.load_pretrained(name_or_path, offline=offline)
    head = None
    if pooler == "cls":
        linear = files.load_linear(name_or_path, files.HEAD_FILE)
        head = None if linear is None else torch.nn.Sequential(linear, torch.nn.Tanh()).to(device)
        if head is None and getattr(backbone, "pooler", None) is None:
            raise plumbing.UsageError(f"--pooler cls: {name_or_path} has no pooler layer and no trained MLP head "
                                      f"({files.HEAD_FILE}); use --pooler cls_before_pooler")
    projection = files.load_linear(name_or_path, files.PROJECTION_FILE)
    # the prebuilt 4-D mask (no host check a batch, as the dev gate's) where it gives exactly the model's own outputs
    difference, _ = backbones.mask_probe(backbone, backbones.probe_batch(tokenizer, 32), lambda mask: (
        common.attention_mask_4d(mask, backbone.config._attn_implementation)))
    model = common.BackboneWithHeads(backbone.to(device).eval(), prebuilt_mask=difference == 0.0)
    return common.Encoder(model, head, tokenizer, pooler, device, None if projection is None else projection.to(device))


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
class Sentences:
    """Distinct sentences to encode, once or at every dev gate: sorted by length into batches of `batch_size`, the
    longest first, and where `encode` is a common.Encoder sorted by their token count (a batch pads little: STS's
    test sentences in batches sorted by characters were 44% padding, by tokens 1%) and each batch tokenised once;
    `index` maps a sentence to its row of `embed`'s matrix."""

    def __init__(self, sentences, encode=None, batch_size: int = 128):
        unique = sorted(set(sentences), key=lambda s: (len(s), s))
        tokenizes = isinstance(encode, common.Encoder)  # else any encode(list[str]), e.g. an ST model's
        if tokenizes:  # a stable sort: alike counts stay in the characters' order
            ids = encode.tokenizer(unique, truncation=True, max_length=encode.max_length)["input_ids"]
            unique = [s for _, s in sorted(zip(map(len, ids), unique), key=lambda pair: pair[0])]
        self.batches = [unique[i:i + batch_size] for i in reversed(range(0, len(unique), batch_size))]
        self.index = {s: i for i, s in enumerate(s for batch in self.batches for s in batch)}
        self.tokens = [encode.tokenize(batch) for batch in self.batches] if tokenizes else None

    def embed(self, encode, desc: str = "encoding") -> torch.Tensor:
        """Every sentence's embedding, a row each: computed and kept on the encoder's device by its on_device half
        (no host copy; the caller makes one), else encode(list[str])'s rows."""
        rows = []
        with progress.Progress(len(self.index), desc, unit="sentence") as bar:
            for i, batch in enumerate(self.batches):
                rows.append(encode.on_device(self.tokens[i]) if self.tokens is not None else
                            torch.from_numpy(np.asarray(encode(batch))))
                bar.update(len(batch))
        return torch.cat(rows)


def encode_unique(encode, sentences, batch_size: int = 128, desc: str = "encoding") -> dict:
    """{sentence: vector}: each distinct sentence once, length-sorted batches, the longest first."""
    table = Sentences(sentences, encode, batch_size)
    vectors = table.embed(encode, desc).cpu().numpy()
    return {s: vectors[i] for s, i in table.index.items()}


def unit_rows(a: np.ndarray) -> np.ndarray:
    """Each row divided by its norm (a zero row stays zero)."""
    return a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)


def spearman(pairs, embed) -> float:
    """Spearman x 100 (two decimals) of the pairs' cosines (embed(list[str]) -> np.ndarray) against their gold scores,
    as SentEval's STS computes it: scipy.stats.spearmanr. NaN where scipy's is (a constant input, a NaN among the
    cosines or the gold scores, a single pair), its warnings left to the caller's own line (plumbing/run.py's dev
    gate). scipy.stats is imported here, at the first score, not at the script's start: its import costs 0.6 s of CPU,
    which a --help or a one-line refusal need not pay."""
    from scipy.stats import spearmanr
    left, right, gold = zip(*pairs)
    with np.errstate(all="ignore"), warnings.catch_warnings():  # NaN or inf embeddings; scipy's ConstantInputWarning
        warnings.simplefilter("ignore")
        cosine = (unit_rows(embed(list(left))) * unit_rows(embed(list(right)))).sum(axis=1)
        return round(float(spearmanr(cosine, gold)[0]) * 100, 2)


def alignment_uniformity(pairs, table: dict, vectors: torch.Tensor | None = None) -> dict:
    """l_align / l_uniform (Wang & Isola 2020, SimCSE Eq. 2-3) on unit vectors in fp64, four decimals: the pairs with
    gold score > 4 as positives, every distinct sentence of `table` as the data. `table`: {sentence: vector}; or
    {sentence: row} of `vectors`, a tensor on any device, where it is computed (the dev gate's: on the GPU)."""
    if vectors is None:
        vectors, table = torch.as_tensor(np.stack(list(table.values()))), {s: i for i, s in enumerate(table)}
    vectors = F.normalize(vectors.double(), dim=1)  # a zero row stays zero

    def rows(column):
        return vectors[[table[p[column]] for p in pairs if p[2] > 4.0]]
    align = (rows(0) - rows(1)).square().sum(1).mean()
    exponent = -2.0 * (2.0 - 2.0 * vectors @ vectors.T).clamp_min(0.0)  # -2 |x - y|^2 of each pair
    pairs_above = torch.ones_like(exponent, dtype=torch.bool).triu(1)  # each pair once (no boolean index: no sync)
    uniform = torch.logsumexp(exponent.masked_fill(~pairs_above, -math.inf).flatten(), 0) - \
        math.log(len(vectors) * (len(vectors) - 1) / 2)
    align, uniform = torch.stack([align, uniform]).tolist()
    return {"align": round(align, 4), "uniform": round(uniform, 4)}


class DevGate:
    """STS-B dev as a training run's dev gate measures it (plumbing/run.py): its pairs read and its distinct sentences
    tokenised once a run, then at each gate encoded in fp32 with the embeddings kept on the device: l_align /
    l_uniform computed there, one host copy for the Spearman (on the host, as `evaluate`'s)."""

    def __init__(self, senteval_dir, encode, batch_size: int = 128):
        self.pairs = load_pairs(senteval_dir, "STSBenchmark", "dev")
        self.sentences = Sentences([s for p in self.pairs for s in p[:2]], encode, batch_size)

    def __call__(self, encode) -> dict:
        """{"stsb_dev": Spearman x 100, "align", "uniform"} of `encode` (the same encoder, in eval mode)."""
        vectors = self.sentences.embed(encode, "dev gate: STS-B dev")
        measures = alignment_uniformity(self.pairs, self.sentences.index, vectors)
        host, index = vectors.cpu().numpy(), self.sentences.index
        return {"stsb_dev": spearman(self.pairs, lambda sentences: host[[index[s] for s in sentences]]), **measures}


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

    if fast:  # one host copy of the embeddings
        table = Sentences([s for task_pairs in pairs.values() for p in task_pairs for s in p[:2]], encode, batch_size)
        vectors = table.embed(encode, desc or f"STS {mode}: encoding").cpu().numpy()

        def embed(sentences):
            return vectors[[table.index[s] for s in sentences]]
    else:
        def embed(sentences):
            return np.concatenate([encode(sentences[i:i + batch_size]) for i in range(0, len(sentences), batch_size)])

    scores = {task: spearman(task_pairs, embed) for task, task_pairs in pairs.items()}
    scores["avg"] = round(sum(scores[t] for t in tasks) / len(tasks), 2)
    return scores


def align_uniform(encode, senteval_dir, batch_size: int = 128, desc: str = "alignment/uniformity") -> dict:
    """SimCSE's alignment/uniformity: STS-B dev pairs with gold score > 4 as positives, all its sentences as data."""
    pairs = load_pairs(senteval_dir, "STSBenchmark", "dev")
    table = Sentences([s for p in pairs for s in p[:2]], encode, batch_size)
    return alignment_uniformity(pairs, table.index, table.embed(encode, desc))


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


def resolve_senteval_dir(senteval_dir: str | None, check=(), offline: str = OFFLINE_FLAGS) -> Path:
    """The given folder, or senteval.tar from the HF dataset repo (downloaded with huggingface_hub, unpacked once).

    The tasks in `check` are read once (test split, and dev for STS-B and SICK-R), so that a training run finds a
    missing or malformed file before it trains, not after.
    """
    root = hub.senteval_folder(senteval_dir, offline)  # the given folder, or senteval.tar from the hub
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
    parser.add_argument("--into_run", action="store_true",
                        help="a run's best/ (one trained with --no_test_eval, say): write the 7 STS test scores "
                             "into its results.json and its model card")
    args = parser.parse_args(argv)
    plumbing.check_range(args, "batch_size", lambda v: v >= 1, "a positive integer")
    plumbing.check_json_path(args.json)
    run_dir = provenance.run_of(args.model_name_or_path, args.into_run, args.mode == "test" and not args.tasks,
                                args.pooler)
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
    if run_dir is not None:
        provenance.record_scores(run_dir, test={k: v for k, v in scores.items() if k not in ("align", "uniform")},
                                  test_by="eval_sts.py --into_run")
        print(f"wrote the test scores into {run_dir / 'results.json'} and {run_dir / 'best' / 'README.md'}")


if __name__ == "__main__":
    plumbing.cli(main)
