"""What every method in this suite shares: arguments, data, the encoder, InfoNCE and the training loop.

Each method file (simcse.py, simcsepp.py, sscl.py, whitenedcse.py, micse.py) is "SimCSE plus one idea": it
adds its own arguments, its loss as a pure function and a `setup(args, backbone) -> (model, compute_loss)`,
then calls `run(args, setup)`. Everything here follows SimCSE (Gao et al. 2021) and its released code:

- arguments default to unsupervised SimCSE with BERT-base (Table A.1: batch 64, lr 3e-5, 1 epoch,
  max_seq_length 32, temperature 0.05, [CLS] with an MLP used in training only, STS-B dev every 125 steps);
- two dropout views come from one forward pass over the batch repeated twice (SimCSE's trick);
- AdamW, no weight decay, linear decay to 0 (warm-up only where a method asks for it);
- every `eval_steps` (and at step 0 and the last step) the STS-B dev Spearman is measured with eval_sts.py's
  own code, the best checkpoint is kept and at the end evaluated on the 7 STS test tasks.

Choices the issue left open: the last incomplete batch of an epoch is dropped (in-batch negatives and
whitening need full batches); the initial model is evaluated at step 0 and counts as a candidate.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import random
import resource
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HF_DATASET_REPO = "princeton-nlp/datasets-for-simcse"
POOLERS = ("cls", "cls_before_pooler", "avg", "avg_top2", "avg_first_last")
LOCAL_FLAGS = "--model_name_or_path, --train_file and --senteval_dir"


class CLIError(ValueError):
    """A user-facing error: printed as one line by `cli`, never as a traceback."""


def cli(main) -> None:
    """Run `main()`; a CLIError becomes one line on stderr and exit status 2."""
    try:
        main()
    except CLIError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


# ----------------------------------------------------------------------------------------------- arguments
class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line instead of usage + error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def base_parser(doc: str, method: str) -> Parser:
    """The shared arguments, with unsupervised SimCSE's defaults (Table A.1, BERT-base)."""
    p = Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(method=method)
    g = p.add_argument_group("shared arguments (SimCSE unsupervised defaults)")
    g.add_argument("--model_name_or_path", default="bert-base-uncased",
                   help="Hugging Face model id or local directory of the encoder to train")
    g.add_argument("--train_file", default=None,
                   help="training corpus, one sentence a line (default: wiki1m_for_simcse.txt from the HF "
                        f"dataset repo {HF_DATASET_REPO})")
    g.add_argument("--fraction", type=float, default=1.0,
                   help="train on a deterministic random subset of round(fraction * n) sentences, 0 < f <= 1")
    g.add_argument("--seed", type=int, default=42, help="seed for the subset, shuffling, dropout and init")
    g.add_argument("--batch_size", type=int, default=64, help="sentences per step (Table A.1: 64)")
    g.add_argument("--lr", type=float, default=3e-5, help="peak learning rate (Table A.1: 3e-5)")
    g.add_argument("--max_seq_length", type=int, default=32, help="truncate training sentences to this many tokens")
    g.add_argument("--epochs", type=int, default=1, help="passes over the training sentences")
    g.add_argument("--max_steps", type=int, default=None, help="stop after this many steps (overrides --epochs)")
    g.add_argument("--warmup_steps", type=int, default=0, help="linear warm-up steps before the linear decay")
    g.add_argument("--temp", type=float, default=0.05, help="InfoNCE temperature tau")
    g.add_argument("--pooler", default="cls", choices=POOLERS,
                   help="training pooler; cls = last-layer [CLS] through the MLP head")
    g.add_argument("--mlp_only_train", action=argparse.BooleanOptionalAction, default=True,
                   help="with --pooler cls, use the MLP in training only and evaluate [CLS] before it "
                        "(SimCSE's unsupervised setting)")
    g.add_argument("--eval_steps", type=int, default=125, help="evaluate STS-B dev every this many steps")
    g.add_argument("--senteval_dir", default=None,
                   help="SentEval data folder holding STS/ and SICK/ (default: senteval.tar from the HF repo)")
    g.add_argument("--output_dir", default=None, help="where the best checkpoint and results.json go "
                                                      "(default: runs/<method>)")
    g.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda if available)")
    g.add_argument("--num_workers", type=int, default=0, help="DataLoader worker processes")
    g.add_argument("--fp32", action="store_true", help="disable bf16 autocast on CUDA")
    return p


def explicit_flags(parser: argparse.ArgumentParser, argv) -> set[str]:
    """Names of the arguments the user actually gave on the command line (to apply per-setting defaults)."""
    saved = {a.dest: a.default for a in parser._actions}
    try:
        for a in parser._actions:
            a.default = argparse.SUPPRESS
        given, _ = parser.parse_known_args(argv)
    finally:
        for a in parser._actions:
            a.default = saved[a.dest]
    return set(vars(given)) - set(parser._defaults)  # set_defaults() values are not user flags


def check_fraction(fraction: float) -> None:
    if not 0.0 < fraction <= 1.0:
        raise CLIError(f"--fraction must be in (0, 1], got {fraction}")


def check_args(args) -> None:
    check_fraction(args.fraction)
    for name in ("batch_size", "max_seq_length", "epochs", "eval_steps"):
        if getattr(args, name) < 1:
            raise CLIError(f"--{name} must be a positive integer, got {getattr(args, name)}")
    if args.max_steps is not None and args.max_steps < 0:
        raise CLIError(f"--max_steps must be >= 0, got {args.max_steps}")
    if args.pooler not in POOLERS:
        raise CLIError(f"unknown pooler '{args.pooler}'; choose one of {', '.join(POOLERS)}")


def eval_pooler(args) -> str:
    """SimCSE: with --mlp_only_train the [CLS] pooler is evaluated before the MLP."""
    return "cls_before_pooler" if args.pooler == "cls" and args.mlp_only_train else args.pooler


# ------------------------------------------------------------------------------------- hub and local files
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


def hub_dataset_file(filename: str, flag: str) -> str:
    """Path of `filename` from the SimCSE dataset repo: cached copy, else a download, else a one-line error."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import logging as hub_logging
    hub_logging.set_verbosity_error()
    try:
        return hf_hub_download(HF_DATASET_REPO, filename, repo_type="dataset", local_files_only=True)
    except Exception:
        pass
    if not hub_reachable():
        raise CLIError(f"cannot reach the Hugging Face Hub to download {filename} and no cached copy exists; "
                       f"pass a local file with {flag} (offline runs need {LOCAL_FLAGS})")
    try:
        return hf_hub_download(HF_DATASET_REPO, filename, repo_type="dataset")
    except Exception as err:
        raise CLIError(f"downloading {filename} from {HF_DATASET_REPO} failed ({type(err).__name__}); "
                       f"pass a local file with {flag}") from None


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
        return tokenizer, AutoModel.from_pretrained(name_or_path, local_files_only=local_files_only, **kwargs)

    path = Path(name_or_path)
    try:
        if path.exists():
            if not path.is_dir():
                raise CLIError(f"--model_name_or_path {name_or_path} is a file; give the model's directory")
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
            raise CLIError(f"cannot reach the Hugging Face Hub to download '{name_or_path}' and no cached copy "
                           f"exists; pass a local model directory with --model_name_or_path "
                           f"(offline runs need {LOCAL_FLAGS})")
        return load(local_files_only=False)
    except (OSError, ValueError) as err:
        if isinstance(err, CLIError):
            raise
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise CLIError(f"cannot load model '{name_or_path}' ({reason}); check --model_name_or_path") from None


# ------------------------------------------------------------------------------------------------------ data
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _check_file(path: str, flag: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise CLIError(f"{flag} {path}: no such file")
    return p


def load_sentences(path: str, flag: str = "--train_file") -> list[str]:
    """One sentence a line; empty lines skipped (SimCSE's wiki1m format)."""
    with open(_check_file(path, flag), encoding="utf-8") as f:
        sentences = [line.strip() for line in f if line.strip()]
    if not sentences:
        raise CLIError(f"{flag} {path} holds no sentences")
    return sentences


def load_triplets(path: str, flag: str = "--train_file") -> list[tuple[str, str, str]]:
    """(sent0, sent1, hard_neg) rows of SimCSE's nli_for_simcse.csv."""
    with open(_check_file(path, flag), encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        missing = {"sent0", "sent1", "hard_neg"} - set(reader.fieldnames or [])
        if missing:
            raise CLIError(f"{flag} {path} lacks the column(s) {', '.join(sorted(missing))} "
                           "(expected sent0,sent1,hard_neg as in nli_for_simcse.csv)")
        rows = [(r["sent0"], r["sent1"], r["hard_neg"]) for r in reader if r["sent0"] and r["sent1"]]
    if not rows:
        raise CLIError(f"{flag} {path} holds no rows")
    return rows


def subsample(items: list, fraction: float, seed: int) -> list:
    """A deterministic random subset of round(fraction * n) items, kept in file order (miCSE's few-shot sets)."""
    check_fraction(fraction)
    if fraction == 1.0:
        return list(items)
    k = round(fraction * len(items))
    if k < 1:
        raise CLIError(f"--fraction {fraction} of {len(items)} examples keeps none; use a larger fraction")
    keep = sorted(random.Random(seed).sample(range(len(items)), k))
    return [items[i] for i in keep]


class Collator:
    """Tokenise a list of sentences (or of tuples of sentences) with dynamic padding.

    Tuples are laid out column-major: for N triplets the batch holds all sent0, then all sent1, then all
    hard_neg, so a method can split the encoded batch with `.chunk(num_columns)`.
    """

    def __init__(self, tokenizer, max_length: int):
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, items):
        columns = list(zip(*items)) if isinstance(items[0], tuple) else [items]
        flat = [sentence for column in columns for sentence in column]
        batch = dict(self.tokenizer(flat, padding=True, truncation=True, max_length=self.max_length,
                                    return_tensors="pt"))
        batch["num_columns"] = len(columns)
        return batch


def model_inputs(batch: dict, device=None) -> dict:
    """The tensors of a collated batch (without the `num_columns` count), optionally moved to `device`."""
    return {k: (v if device is None else v.to(device)) for k, v in batch.items() if torch.is_tensor(v)}


def make_loader(examples: list, tokenizer, args) -> torch.utils.data.DataLoader:
    if args.batch_size > len(examples):
        raise CLIError(f"--batch_size {args.batch_size} is larger than the {len(examples)} training examples")
    generator = torch.Generator().manual_seed(args.seed)
    return torch.utils.data.DataLoader(examples, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                       generator=generator, num_workers=args.num_workers,
                                       collate_fn=Collator(tokenizer, args.max_seq_length))


# ----------------------------------------------------------------------------------------------------- model
def pool(hidden_states, attention_mask, pooler: str, pooler_output=None) -> torch.Tensor:
    """SimCSE's poolers over a model's hidden states (tuple: embeddings, layer 1, ..., layer L)."""
    if pooler == "cls":
        if pooler_output is None:
            raise CLIError("this model has no pooler layer; use --pooler cls_before_pooler")
        return pooler_output
    if pooler == "cls_before_pooler":
        return hidden_states[-1][:, 0]
    mask = attention_mask.unsqueeze(-1).to(hidden_states[-1].dtype)
    if pooler == "avg":
        layer = hidden_states[-1]
    elif pooler == "avg_top2":
        layer = (hidden_states[-2] + hidden_states[-1]) / 2.0
    elif pooler == "avg_first_last":
        layer = (hidden_states[1] + hidden_states[-1]) / 2.0
    else:
        raise CLIError(f"unknown pooler '{pooler}'; choose one of {', '.join(POOLERS)}")
    return (layer * mask).sum(1) / mask.sum(1)


class MLPHead(nn.Sequential):
    """SimCSE's training head on [CLS]: Linear(D, D) + Tanh, freshly initialised."""

    def __init__(self, hidden_size: int, init_std: float = 0.02):
        super().__init__(nn.Linear(hidden_size, hidden_size), nn.Tanh())
        nn.init.normal_(self[0].weight, std=init_std)
        nn.init.zeros_(self[0].bias)


class SentenceEncoder(nn.Module):
    """A pretrained backbone plus the training head; what every method trains and saves."""

    def __init__(self, backbone: nn.Module, pooler: str = "cls", head: nn.Module | None = None,
                 eval_pooler: str | None = None):
        super().__init__()
        self.backbone, self.pooler = backbone, pooler
        init_std = getattr(backbone.config, "initializer_range", 0.02)
        self.head = head if head is not None else (MLPHead(backbone.config.hidden_size, init_std)
                                                   if pooler == "cls" else nn.Identity())
        self.eval_pooler = eval_pooler or pooler

    def forward_views(self, batch: dict, num_views: int = 2, **kwargs):
        """Encode the batch `num_views` times in one pass: each copy gets its own dropout mask.

        The copies are stacked view-major, so `pool(...).chunk(num_views)` gives one tensor per view.
        """
        inputs = {k: v.repeat(num_views, 1) for k, v in model_inputs(batch).items()}
        outputs = self.backbone(**inputs, output_hidden_states=True, **kwargs)
        return outputs, inputs["attention_mask"]

    def embed(self, hidden_states, attention_mask) -> torch.Tensor:
        """Training embedding z: the pooled sentence, through the head for the [CLS] pooler (float32)."""
        if self.pooler == "cls":
            return self.head(hidden_states[-1][:, 0]).float()
        return pool(hidden_states, attention_mask, self.pooler).float()

    def encode(self, batch: dict) -> torch.Tensor:
        """Evaluation embedding with `eval_pooler`; "cls" here is the trained head (saved as BERT's pooler)."""
        if self.eval_pooler == "cls":
            return self.head(self.backbone(**batch).last_hidden_state[:, 0]).float()
        return pooled_output(self.backbone, batch, self.eval_pooler)


def pooled_output(backbone: nn.Module, batch: dict, pooler: str) -> torch.Tensor:
    """A plain Hugging Face model's sentence embedding with one of SimCSE's poolers (what eval_sts.py uses)."""
    outputs = backbone(**batch, output_hidden_states=True)
    return pool(outputs.hidden_states, batch["attention_mask"], pooler,
                getattr(outputs, "pooler_output", None)).float()


@contextlib.contextmanager
def dropout_off(module: nn.Module):
    """Switch off every nn.Dropout in `module` for one pass, then restore each one's mode and rate.

    Setting eval() alone is not enough in transformers 5: BERT's attention dropout is applied under the
    attention module's own training flag with rate `self.dropout.p`, so the rate is zeroed as well.
    """
    saved = [(m, m.training, m.p) for m in module.modules() if isinstance(m, nn.Dropout)]
    try:
        for m, _, _ in saved:
            m.eval()
            m.p = 0.0
        yield
    finally:
        for m, training, p in saved:
            m.train(training)
            m.p = p


def set_dropout(module: nn.Module, p: float) -> None:
    """Set the rate of every nn.Dropout (attention dropout included: BERT reads `dropout.p`)."""
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = p


# ------------------------------------------------------------------------------------------------------ loss
def cos_sim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """All-pairs cosine similarity, (N, D) x (M, D) -> (N, M)."""
    return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T


def info_nce(z1, z2, temp: float = 0.05, z3=None, hard_negative_weight: float = 0.0) -> torch.Tensor:
    """SimCSE InfoNCE with in-batch negatives (Eq. 1, unsupervised Eq. 4).

    With `z3` (hard negatives) this is the supervised Eq. 5; `hard_negative_weight` is Eq. 8's alpha in the
    authors' form: added to the logit of each anchor's own hard negative (alpha = exp(weight)).
    """
    logits = cos_sim(z1, z2) / temp
    if z3 is not None:
        hard = cos_sim(z1, z3) / temp
        hard = hard + hard_negative_weight * torch.eye(len(z1), device=hard.device, dtype=hard.dtype)
        logits = torch.cat([logits, hard], dim=1)
    labels = torch.arange(len(z1), device=z1.device)
    return F.cross_entropy(logits, labels)


# ------------------------------------------------------------------------------------------------- training
def autocast(device: torch.device, enabled: bool = True):
    """bf16 autocast on CUDA where supported; fp32 elsewhere."""
    use = enabled and device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use)


def linear_schedule(optimizer, warmup_steps: int, total_steps: int):
    """transformers' get_linear_schedule_with_warmup, which the authors' Trainer-based code used."""
    def factor(step):
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cpu_max_rss"


def train_step(model, compute_loss, batch, optimizer, scheduler, device, bf16=True) -> torch.Tensor:
    """One optimisation step; shared by the training loop and bench.py."""
    batch = {**batch, **model_inputs(batch, device)}
    with autocast(device, bf16):
        loss = compute_loss(batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.detach()


def make_optimizer(model: nn.Module, args, total_steps: int):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    return optimizer, linear_schedule(optimizer, args.warmup_steps, total_steps)


def make_encode(embed_batch, tokenizer, device):
    """encode(list[str]) -> np.ndarray for eval_sts.evaluate, from `embed_batch(tokenised batch) -> tensor`."""
    max_length = min(getattr(tokenizer, "model_max_length", 512) or 512, 512)

    @torch.no_grad()
    def encode(sentences):
        batch = tokenizer(sentences, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        return embed_batch(model_inputs(batch, device)).float().cpu().numpy()
    return encode


def pooled_encode(backbone: nn.Module, tokenizer, pooler: str, device):
    """encode(list[str]) -> np.ndarray for a plain Hugging Face model with one of SimCSE's poolers."""
    return make_encode(lambda batch: pooled_output(backbone, batch, pooler), tokenizer, device)


def save_checkpoint(model: SentenceEncoder, tokenizer, out_dir: str | Path) -> None:
    """save_pretrained + tokenizer + sentence-transformers metadata for the evaluation pooler.

    The MLP head is written into BERT's pooler weights (as SimCSE's simcse_to_huggingface.py does), so
    `eval_sts.py --pooler cls` on the checkpoint is the trained head.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dense = getattr(getattr(model.backbone, "pooler", None), "dense", None)
    if isinstance(model.head, MLPHead) and isinstance(dense, nn.Linear):
        with torch.no_grad():
            dense.weight.copy_(model.head[0].weight)
            dense.bias.copy_(model.head[0].bias)
    model.backbone.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    write_sentence_transformers_config(out_dir, model.eval_pooler, model.backbone.config.hidden_size,
                                       model.head if model.eval_pooler == "cls" else None)


def write_sentence_transformers_config(out_dir: Path, pooler: str, hidden_size: int, head=None) -> None:
    """modules.json + 1_Pooling (+ 2_Dense for the "cls" pooler) so SentenceTransformer(dir) matches eval_sts."""
    modes = {"cls": "cls", "cls_before_pooler": "cls", "avg": "mean"}
    if pooler not in modes:  # avg_top2 / avg_first_last have no sentence-transformers pooling mode
        return
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    pooling = {"word_embedding_dimension": hidden_size, "pooling_mode_cls_token": modes[pooler] == "cls",
               "pooling_mode_mean_tokens": modes[pooler] == "mean", "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False}
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    if pooler == "cls":
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
        (out_dir / "2_Dense").mkdir(exist_ok=True)
        (out_dir / "2_Dense" / "config.json").write_text(json.dumps(
            {"in_features": hidden_size, "out_features": hidden_size, "bias": True,
             "activation_function": "torch.nn.modules.activation.Tanh"}))
        from safetensors.torch import save_file
        save_file({"linear.weight": head[0].weight.detach().cpu().contiguous(),
                   "linear.bias": head[0].bias.detach().cpu().contiguous()},
                  str(out_dir / "2_Dense" / "model.safetensors"))
    (out_dir / "modules.json").write_text(json.dumps(modules, indent=2))
    (out_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))


def train(args, model: SentenceEncoder, compute_loss, loader, dev_score, save, device) -> dict:
    """The training loop: AdamW + linear schedule, STS-B dev gate every `eval_steps`, best checkpoint kept."""
    from tqdm.auto import tqdm
    total_steps = args.max_steps if args.max_steps is not None else args.epochs * len(loader)
    optimizer, scheduler = make_optimizer(model, args, total_steps)
    state = {"best_dev": -math.inf, "best_step": None, "dev_curve": [], "eval_time_s": 0.0}

    def gate(step):
        gate_start = time.perf_counter()
        model.eval()
        score = dev_score()
        model.train()
        state["dev_curve"].append([step, score])
        if score > state["best_dev"]:
            state["best_dev"], state["best_step"] = score, step
            save()
        state["eval_time_s"] += time.perf_counter() - gate_start
        return score

    bar = tqdm(total=total_steps, desc=args.method, dynamic_ncols=True, disable=None)
    last_dev = gate(0)
    bar.write(f"step 0/{total_steps}  STS-B dev {last_dev:.2f}")
    state["eval_time_s"] = 0.0
    step, start = 0, time.perf_counter()
    model.train()
    while step < total_steps:
        for batch in loader:
            loss = train_step(model, compute_loss, batch, optimizer, scheduler, device, not args.fp32)
            step += 1
            if not torch.isfinite(loss):
                raise CLIError(f"loss became {loss.item()} at step {step}; lower --lr or check the data")
            evaluate_now = step % args.eval_steps == 0 or step == total_steps
            if evaluate_now:
                last_dev = gate(step)
            steps_per_second = step / (time.perf_counter() - start - state["eval_time_s"])
            if evaluate_now:
                bar.write(f"step {step}/{total_steps}  loss {loss.item():.4f}  STS-B dev {last_dev:.2f}  "
                          f"best {state['best_dev']:.2f} (step {state['best_step']})  {steps_per_second:.2f} steps/s")
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.4f}", dev=f"{last_dev:.2f}", best=f"{state['best_dev']:.2f}",
                            sps=f"{steps_per_second:.2f}")
            if step >= total_steps:
                break
    bar.close()
    train_time = time.perf_counter() - start - state["eval_time_s"]  # steps/s excludes dev evaluation
    state.update(steps=step, train_time_s=round(train_time, 2),
                 steps_per_second=round(step / train_time, 3) if step else 0.0)
    return state


def run(args, setup, load_examples=load_sentences, default_train_file="wiki1m_for_simcse.txt",
        attn_implementation=None, analyze=None) -> dict:
    """Everything around a method's loss: data, model, training loop, final evaluation and results.json.

    `setup(args, backbone) -> (SentenceEncoder, compute_loss(batch) -> loss)` is the method; `analyze(backbone,
    tokenizer, senteval_dir, device) -> dict`, if given, runs on the initial and on the best model.
    """
    import eval_sts  # eval_sts imports common; importing it here keeps the module graph one-way at load time

    check_args(args)
    wall_start = time.perf_counter()
    seed_everything(args.seed)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out_dir = Path(args.output_dir or Path("runs") / args.method)

    # Resolve every input up front, so an offline machine fails in one line before any work.
    train_file = args.train_file or hub_dataset_file(default_train_file, "--train_file")
    examples = subsample(load_examples(train_file), args.fraction, args.seed)
    senteval_dir = eval_sts.resolve_senteval_dir(args.senteval_dir)
    tokenizer, backbone = load_pretrained(args.model_name_or_path, attn_implementation)
    loader = make_loader(examples, tokenizer, args)
    backbone.to(device)
    model, compute_loss = setup(args, backbone)
    model.to(device)
    print(f"{args.method}: {len(examples)} training examples from {train_file}, {len(loader)} steps/epoch, "
          f"device {device}, bf16 {device.type == 'cuda' and not args.fp32}")

    encode = make_encode(model.encode, tokenizer, device)

    def dev_score():
        with autocast(device, not args.fp32):
            return eval_sts.evaluate(encode, senteval_dir, ["STSBenchmark"], mode="dev")["STSBenchmark"]

    analysis = {"before": analyze(backbone, tokenizer, senteval_dir, device)} if analyze else {}
    log = train(args, model, compute_loss, loader, dev_score, lambda: save_checkpoint(model, tokenizer, out_dir),
                device)
    peak, peak_kind = peak_memory_mb(device)

    # The test scores come from the saved checkpoint as a plain AutoModel: what `eval_sts.py` reproduces.
    print(f"best STS-B dev {log['best_dev']:.2f} at step {log['best_step']}; evaluating it on the test sets")
    best_tokenizer, best = load_pretrained(str(out_dir))
    best.to(device).eval()
    with autocast(device, not args.fp32):
        test = eval_sts.evaluate(pooled_encode(best, best_tokenizer, model.eval_pooler, device), senteval_dir,
                                 mode="test")
    eval_sts.print_table(test)
    if analyze:
        analysis["after"] = analyze(best, best_tokenizer, senteval_dir, device)

    results = {
        "method": args.method, "args": {k: v for k, v in vars(args).items() if k != "method"},
        "train_file": str(train_file), "num_train_examples": len(examples), "device": str(device),
        "eval_pooler": model.eval_pooler, "best_dev_stsb": log["best_dev"], "best_step": log["best_step"],
        "dev_curve": log["dev_curve"], "test": test, "steps": log["steps"], "train_time_s": log["train_time_s"],
        "eval_time_s": round(log["eval_time_s"], 2),
        "steps_per_second": log["steps_per_second"], "peak_memory_mb": round(peak, 1),
        "peak_memory_kind": peak_kind, "wall_time_s": round(time.perf_counter() - wall_start, 2),
    }
    if analysis:
        results["analysis"] = analysis
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out_dir / 'results.json'} and the best checkpoint to {out_dir}")
    return results
