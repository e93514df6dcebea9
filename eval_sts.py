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

A leaf module: it imports nothing from the suite but plumbing.py's progress display (common.py imports it and
reuses its loading, poolers and one-line errors).

    python eval_sts.py --model_name_or_path runs/simcse/best --pooler cls_before_pooler
    python eval_sts.py --model_name_or_path ../shared/models/all-MiniLM-L6-v2 --pooler avg \\
        --senteval_dir ../shared/data/senteval --align_uniform
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import tarfile
import time
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import torch
from scipy.stats import spearmanr

import plumbing

SIMCSE_DATA_REPO = "princeton-nlp/datasets-for-simcse"
POOLERS = ("cls", "cls_before_pooler", "avg", "avg_top2", "avg_first_last")
LOCAL_FLAGS = "--model_name_or_path, --train_file and --senteval_dir"
STS_SUBSETS = {
    "STS12": ["MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"],
    "STS13": ["FNWN", "headlines", "OnWN"],  # SMT is not shipped (licence), as in SentEval
    "STS14": ["deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"],
    "STS15": ["answers-forums", "answers-students", "belief", "headlines", "images"],
    "STS16": ["answer-answer", "headlines", "plagiarism", "postediting", "question-question"],
}
TASKS = ["STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness"]
DEV_TASKS = ["STSBenchmark", "SICKRelatedness"]


# ------------------------------------------------------------------------------------- one-line errors
class UsageError(ValueError):
    """Something the user can fix: printed as one line by `cli`, exit status 2, never a traceback."""


def cli(main) -> None:
    """Run `main()`; a UsageError becomes one line on stderr and exit status 2."""
    try:
        main()
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line instead of usage + error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def check_range(args, name: str, ok, accepted: str) -> None:
    value = getattr(args, name)
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and ok(value)):
        raise UsageError(f"--{name} {value} is out of range: {accepted}")


def resolve_device(name: str | None) -> torch.device:
    """The --device, checked to exist on this machine (default: cuda if available)."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {name} is not a device name; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                         "use --device cpu")
    if device.type not in ("cpu", "cuda") and not getattr(torch, device.type, None):
        raise UsageError(f"--device {name} is not available on this machine; use cpu or cuda")
    return device


def read_lines(path, flag: str) -> list[str]:
    """A text file's lines; missing, unreadable, not UTF-8 or empty is one line naming the file (and line)."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{flag} {path}: no such file" + (" (it is a folder)" if p.is_dir() else ""))
    try:
        data = p.read_bytes()
    except OSError as err:
        raise UsageError(f"{flag} {path}: cannot be read ({err.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line_number = data.count(b"\n", 0, err.start) + 1
        raise UsageError(f"{flag} {path}: line {line_number} is not UTF-8 text") from None
    if not text.strip():
        raise UsageError(f"{flag} {path} is empty")
    return text.splitlines()


def parse_score(value: str, path, line_number: int, flag: str) -> float:
    try:
        score = float(value)
    except ValueError:
        score = math.nan
    if not math.isfinite(score):
        raise UsageError(f"{flag}: {path} line {line_number}: the score '{value}' is not a number")
    return score


# ------------------------------------------------------------------------------------ hub and loading
def hub_reachable(timeout: float = 3.0) -> bool:
    """A fast DNS + TCP check, so an offline machine fails at once instead of after minutes of retries."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # behind a proxy a direct connection says nothing; let huggingface_hub try
    from huggingface_hub import constants
    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def hub_file(repo: str, filename: str, flag: str, local: str = "file") -> str:
    """Path of `filename` in the HF dataset repo `repo`: cached copy, else a download, else a one-line error
    naming `flag`, which takes a local `local` ("file" or "folder")."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import logging as hub_logging
    hub_logging.set_verbosity_error()
    try:
        return hf_hub_download(repo, filename, repo_type="dataset", local_files_only=True)
    except Exception:
        pass
    if not hub_reachable():
        raise UsageError(f"cannot reach the Hugging Face Hub to download {filename} and no cached copy exists; "
                         f"pass a local {local} with {flag} (offline runs need {LOCAL_FLAGS})")
    try:
        return hf_hub_download(repo, filename, repo_type="dataset")
    except Exception as err:
        raise UsageError(f"downloading {filename} from {repo} failed ({type(err).__name__}); "
                         f"pass a local {local} with {flag}") from None


def looks_local(name: str) -> bool:
    """A path, not a hub id ("owner/name"): starts with . / or ~, has two or more slashes, or its parent exists."""
    parent = Path(name).expanduser().parent
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or (parent != Path(".") and parent.is_dir())


def load_pretrained(name_or_path: str, attn_implementation: str | None = None):
    """(tokenizer, backbone) with AutoModel: a local directory, a cached hub copy, else a download.

    Offline and not cached is one clear error naming --model_name_or_path.
    """
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as tf_logging
    from huggingface_hub.utils import logging as hub_logging
    hub_logging.set_verbosity_error()
    tf_logging.disable_progress_bar()
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}

    def load(local_files_only):
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=local_files_only)
        # transformers 5 keeps a checkpoint's own dtype; fp32 here: evaluation in fp32, fp32 master weights
        return tokenizer, AutoModel.from_pretrained(name_or_path, local_files_only=local_files_only,
                                                    dtype=torch.float32, **kwargs)

    path = Path(name_or_path).expanduser()
    if not path.exists() and looks_local(name_or_path):  # e.g. runs/simcse/best before the run wrote it
        raise UsageError(f"--model_name_or_path {name_or_path}: no such folder")
    try:
        if path.exists():
            if not path.is_dir():
                raise UsageError(f"--model_name_or_path {name_or_path} is a file; give the model's directory")
            return load(local_files_only=True)
        verbosity = tf_logging.get_verbosity()
        tf_logging.set_verbosity_error()
        try:
            return load(local_files_only=True)  # a cached copy needs no network
        except OSError:
            pass
        finally:
            tf_logging.set_verbosity(verbosity)
        if not hub_reachable():
            raise UsageError(f"cannot reach the Hugging Face Hub to download '{name_or_path}' and no cached copy "
                             f"exists; pass a local model directory with --model_name_or_path "
                             f"(offline runs need {LOCAL_FLAGS})")
        return load(local_files_only=False)
    except (OSError, ValueError) as err:
        if isinstance(err, UsageError):
            raise
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise UsageError(f"cannot load model '{name_or_path}' ({reason}); check --model_name_or_path") from None


# -------------------------------------------------------------------------------------------- poolers
def pool(hidden_states, attention_mask, pooler: str, pooler_output=None) -> torch.Tensor:
    """SimCSE's poolers over a model's hidden states (tuple: embeddings, layer 1, ..., layer L)."""
    if pooler == "cls":
        if pooler_output is None:
            raise UsageError("this model has no pooler layer; use --pooler cls_before_pooler")
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
        raise UsageError(f"unknown pooler '{pooler}'; choose one of {', '.join(POOLERS)}")
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
    """encode(list[str]) of a saved model (local directory or hub id) with one of SimCSE's poolers, eval mode."""
    tokenizer, backbone = load_pretrained(name_or_path)
    return pooled_encode(backbone.to(device).eval(), tokenizer, pooler, device)


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
        raise UsageError(f"--senteval_dir: {path} line {number} has {len(cols)} tab-separated column(s), "
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
            inputs, gold = read_lines(input_path, flag), read_lines(gold_path, flag)
            for number, (line, score) in enumerate(zip(inputs, gold), start=1):
                if score.strip():
                    s1, s2 = _columns(line, input_path, number, 2)[:2]
                    pairs.append((_normalise(s1), _normalise(s2), parse_score(score, gold_path, number, flag)))
    elif task == "STSBenchmark":
        path = root / "STS" / "STSBenchmark" / f"sts-{split}.csv"
        for number, line in enumerate(read_lines(path, flag), start=1):
            cols = _columns(line, path, number, 7)
            pairs.append((_normalise(cols[5]), _normalise(cols[6]), parse_score(cols[4], path, number, flag)))
    elif task == "SICKRelatedness":
        name = {"train": "SICK_train.txt", "dev": "SICK_trial.txt", "test": "SICK_test_annotated.txt"}[split]
        path = root / "SICK" / name
        for number, line in enumerate(read_lines(path, flag)[1:], start=2):
            cols = _columns(line, path, number, 4)
            pairs.append((_normalise(cols[1]), _normalise(cols[2]), parse_score(cols[3], path, number, flag)))
    else:
        raise UsageError(f"unknown task '{task}'; choose from {', '.join(TASKS)}")
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
        raise UsageError(f"unknown mode '{mode}'; use test or dev")
    tasks = list(tasks or (TASKS if mode == "test" else DEV_TASKS))
    if mode == "dev" and set(tasks) - set(DEV_TASKS):
        raise UsageError(f"--mode dev has only {', '.join(DEV_TASKS)}")
    pairs = {task: load_pairs(senteval_dir, task, "dev" if mode == "dev" else "test") for task in tasks}

    if fast:
        table = encode_unique(encode, [s for task_pairs in pairs.values() for p in task_pairs for s in p[:2]],
                              batch_size, desc or f"STS {mode}: encoding")

        def embed(sentences):
            return np.stack([table[s] for s in sentences])
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
    table = encode_unique(encode, [s for p in pairs for s in p[:2]], batch_size, desc)
    positives = [p for p in pairs if p[2] > 4.0]
    align, uniform = align_uniform_loss(np.stack([table[a] for a, _, _ in positives]),
                                        np.stack([table[b] for _, b, _ in positives]), np.stack(list(table.values())))
    return {"align": round(align, 4), "uniform": round(uniform, 4)}


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


def _find_data_root(folder: Path, marker: str = "STS") -> Path | None:
    """The folder that holds `marker`/ (SentEval's data/downstream), searched a few levels down."""
    for candidate in [folder, *sorted(folder.glob("*")), *sorted(folder.glob("*/*")), *sorted(folder.glob("*/*/*"))]:
        if (candidate / marker).is_dir():
            return candidate
    return None


def resolve_senteval_dir(senteval_dir: str | None, check=()) -> Path:
    """The given folder, or senteval.tar from the HF dataset repo (downloaded with huggingface_hub, unpacked once).

    The tasks in `check` are read once (test split, and dev for STS-B and SICK-R), so that a training run finds a
    missing or malformed file before it trains, not after.
    """
    root = _resolve_senteval_dir(senteval_dir)
    for task in check:
        for split in ("test", "dev") if task in DEV_TASKS else ("test",):
            load_pairs(root, task, split)
    return root


def _resolve_senteval_dir(senteval_dir: str | None) -> Path:
    if senteval_dir is not None:
        folder = Path(senteval_dir).expanduser()
        if not folder.exists():
            raise UsageError(f"--senteval_dir {senteval_dir}: no such folder")
        root = _find_data_root(folder) if folder.is_dir() else None
        if root is None:
            raise UsageError(f"--senteval_dir {senteval_dir}: no SentEval STS/ folder found there")
        return root
    tar_path = Path(hub_file(SIMCSE_DATA_REPO, "senteval.tar", "--senteval_dir", local="folder"))
    target = tar_path.parent / "senteval_unpacked"
    if _find_data_root(target) is None:
        with tarfile.open(tar_path) as tar:
            try:
                tar.extractall(target, filter="data")
            except TypeError:  # Python releases before the extraction filters
                tar.extractall(target)
    root = _find_data_root(target)
    if root is None:
        raise UsageError(f"{tar_path} has no STS/ folder; pass --senteval_dir")
    return root


def write_sentence_transformers_config(out_dir: Path, pooler: str, hidden_size: int, head=None) -> None:
    """modules.json + 1_Pooling (+ 2_Dense for the "cls" pooler) so SentenceTransformer(dir) matches eval_sts."""
    mode = {"cls": "cls", "cls_before_pooler": "cls", "avg": "mean"}.get(pooler)
    if mode is None:  # avg_top2 / avg_first_last have no sentence-transformers pooling mode
        return
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (out_dir / "1_Pooling").mkdir()
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden_size, "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False}, indent=2))
    if pooler == "cls":
        from safetensors.torch import save_file
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
        (out_dir / "2_Dense").mkdir()
        (out_dir / "2_Dense" / "config.json").write_text(json.dumps({
            "in_features": hidden_size, "out_features": hidden_size, "bias": True,
            "activation_function": "torch.nn.modules.activation.Tanh"}))
        save_file({"linear.weight": head[0].weight.detach().cpu().contiguous(),
                   "linear.bias": head[0].bias.detach().cpu().contiguous()},
                  str(out_dir / "2_Dense" / "model.safetensors"))
    (out_dir / "modules.json").write_text(json.dumps(modules, indent=2))
    (out_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))


def _json_safe(value):
    """NaN and infinities become null: JSON has no such numbers (Python would write a bare NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return [_json_safe(v) for v in value] if isinstance(value, (list, tuple)) else value


def write_json(path: Path, data: dict) -> None:
    """Write valid JSON to a temporary file beside `path`, then rename: a kill never leaves half a file."""
    text = json.dumps(_json_safe(data), indent=2, allow_nan=False)
    if path.exists() and not path.is_file():  # /dev/stdout and the like
        path.write_text(text)
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def check_json_path(path: str | None) -> None:
    """--json must be writable and must not be a folder (checked before any work)."""
    if path is None or path == "/dev/stdout":
        return
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"--json {path} is a folder; give a file name")
    if not p.parent.is_dir():
        raise UsageError(f"--json {path}: the folder {p.parent} does not exist")


def main(argv=None) -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    check_range(args, "batch_size", lambda v: v >= 1, "a positive integer")
    check_json_path(args.json)
    device = resolve_device(args.device)

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
        write_json(Path(args.json), scores)


if __name__ == "__main__":
    cli(main)
