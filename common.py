"""Leaf helpers the five method files share: arguments, data, encoder pieces, InfoNCE, saving, the final report.

No training loop lives here: each method file runs its own, visibly (CleanRL's bargain). Model loading, poolers,
the hub download and the one-line errors come from eval_sts.py (a leaf); process-group helpers from
distributed.py. Defaults: unsupervised SimCSE with BERT-base (Table A.1) and the authors' HF Trainer.
"""
from __future__ import annotations

import argparse
import csv
import functools
import math
import random
import resource
import shutil
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import distributed
import eval_sts
import eval_transfer
from eval_sts import POOLERS, UsageError, check_range, cli, load_pretrained, pool, pooled_encode  # noqa: F401

MICSE_DATA_REPO = "sap-ai-research/datasets-for-micse"
MICSE_SUBSETS = {0.000064: "000.0064", 0.0001: "000.01", 0.0005: "000.05", 0.001: "000.10", 0.005: "000.50",
                 0.01: "001.00", 0.1: "010.00"}  # miCSE's released subsets (seeds 48-52): fraction -> name

# ----------------------------------------------------------------------------------------------- arguments
def base_parser(doc: str, method: str) -> eval_sts.Parser:
    """The shared arguments, with unsupervised SimCSE's defaults (Table A.1, BERT-base)."""
    p = eval_sts.Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("shared arguments (SimCSE unsupervised defaults)")
    g.add_argument("--model_name_or_path", default="bert-base-uncased", help="HF model id or local directory")
    g.add_argument("--train_file", default=None, help="corpus (default: HF wiki1m_for_simcse.txt; see --fraction)")
    g.add_argument("--fraction", type=float, default=1.0, help="train on a subset of round(fraction * n) examples; "
                   "without --train_file, a fraction miCSE released with --seed 48-52 downloads that subset")
    g.add_argument("--seed", type=int, default=42, help="seed for the subset, shuffling, dropout and init")
    g.add_argument("--batch_size", type=int, default=64, help="sentences per step, over all processes (Table A.1)")
    g.add_argument("--lr", type=float, default=3e-5, help="peak learning rate (Table A.1: 3e-5)")
    g.add_argument("--max_seq_length", type=int, default=32, help="truncate training sentences to this many tokens")
    g.add_argument("--epochs", type=int, default=1, help="passes over the training examples")
    g.add_argument("--max_steps", type=int, default=None, help="stop after this many steps (overrides --epochs)")
    g.add_argument("--warmup_steps", type=int, default=0, help="linear warm-up steps before the linear decay")
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="gradient clipping (the Trainer's); 0 disables")
    g.add_argument("--temp", type=float, default=0.05, help="InfoNCE temperature tau")
    g.add_argument("--pooler", default="cls", choices=POOLERS, help="training pooler; cls = [CLS] + MLP head")
    g.add_argument("--mlp_only_train", action=argparse.BooleanOptionalAction, default=True,
                   help="with --pooler cls, evaluate [CLS] before the MLP (SimCSE's unsupervised setting)")
    g.add_argument("--eval_steps", type=int, default=125, help="evaluate STS-B dev every this many steps")
    g.add_argument("--senteval_dir", default=None, help="SentEval data folder (default: HF senteval.tar)")
    g.add_argument("--output_dir", default=None, help="best checkpoint (best/) + results.json (default runs/<method>)")
    g.add_argument("--overwrite_output_dir", action="store_true", help="allow an --output_dir that holds a run")
    g.add_argument("--no_test_eval", action="store_true", help="skip the final STS test evaluation")
    g.add_argument("--eval_transfer", nargs="?", const="test", choices=["test", "fasttest"], default=None,
                   help="also evaluate the best checkpoint on SentEval's 7 transfer tasks (eval_transfer.py)")
    g.add_argument("--device", default=None, help="cuda, cuda:N, cpu (default: cuda if available)")
    g.add_argument("--num_workers", type=int, default=0, help="DataLoader worker processes")
    g.add_argument("--fp32", action="store_true", help="disable bf16 autocast on CUDA")
    p.set_defaults(method=method)
    return p


def check_args(args) -> None:
    """Every shared flag against its meaning, the device and the output folder: before any work."""
    positive, non_negative = (lambda v: v > 0, "a positive number"), (lambda v: v >= 0, "a non-negative number")
    for name, (ok, accepted) in {"fraction": (lambda v: 0 < v <= 1, "0 < fraction <= 1"),
                                 "seed": (lambda v: 0 <= v < 2**32, "0 <= seed < 2^32"),
                                 "batch_size": (lambda v: v >= 2, "at least 2 (one sentence has no negatives)"),
                                 "max_seq_length": (lambda v: 2 <= v <= 512, "2..512 tokens"),
                                 "lr": positive, "temp": positive, "epochs": positive, "eval_steps": positive,
                                 "max_steps": non_negative, "warmup_steps": non_negative,
                                 "max_grad_norm": non_negative, "num_workers": non_negative}.items():
        check_range(args, name, ok, accepted)
    eval_sts.resolve_device(args.device)
    args.output_dir = str(args.output_dir or Path("runs") / args.method)
    out = Path(args.output_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--output_dir {out} is a file; give a folder")
    if not args.overwrite_output_dir and ((out / "results.json").exists() or (out / "best").exists()):
        raise UsageError(f"--output_dir {out} already holds a run; pass --overwrite_output_dir or another folder")


def eval_pooler(args) -> str:
    """SimCSE: with --mlp_only_train the [CLS] pooler is evaluated before the MLP."""
    return "cls_before_pooler" if args.pooler == "cls" and args.mlp_only_train else args.pooler

# ------------------------------------------------------------------------------------------------------ data
def micse_subset(fraction: float, seed: int) -> str | None:
    """The file name of miCSE's released subset for (fraction, seed), or None if they released none."""
    percent = MICSE_SUBSETS.get(fraction)
    return f"wiki_subset_1M_{percent}percent_seed{seed}.txt" if percent and 48 <= seed <= 52 else None


def training_examples(args, default_file: str = "wiki1m_for_simcse.txt", triplets: bool = False):
    """(examples, path, miCSE subset or None), loaded with `datasets`; --fraction applied deterministically."""
    subset = None if args.train_file or triplets else micse_subset(args.fraction, args.seed)
    repo, name = (MICSE_DATA_REPO, subset) if subset else (eval_sts.SIMCSE_DATA_REPO, default_file)
    path = args.train_file or eval_sts.hub_file(repo, name, "--train_file")
    lines = eval_sts.read_lines(path, "--train_file")  # missing, unreadable, not UTF-8, empty: one line
    if triplets:
        rows = csv.reader(lines)
        if {"sent0", "sent1", "hard_neg"} - set(next(rows)):
            raise UsageError(f"--train_file {path}: the header must name sent0,sent1,hard_neg (nli_for_simcse.csv)")
        for row in rows:
            if len(row) < 3:
                raise UsageError(f"--train_file {path} line {rows.line_num} has {len(row)} column(s), expected 3")
    import datasets
    datasets.disable_progress_bars()
    if triplets:  # keep_default_na: a sentence "NA" or "null" stays a sentence
        data = datasets.load_dataset("csv", data_files=str(path), split="train", keep_default_na=False)
        examples = [(r["sent0"], r["sent1"], r["hard_neg"]) for r in data if r["sent0"] and r["sent1"]]
    else:
        data = datasets.load_dataset("text", data_files=str(path), split="train")
        examples = [s.strip() for s in data["text"] if s.strip()]
    if not examples:
        raise UsageError(f"--train_file {path} holds no sentences")
    return (examples if subset else subsample(examples, args.fraction, args.seed)), str(path), subset


def subsample(items: list, fraction: float, seed: int) -> list:
    """A deterministic random subset of round(fraction * n) items, kept in file order (miCSE's few-shot sets)."""
    k = round(fraction * len(items))
    if k < 1:
        raise UsageError(f"--fraction {fraction} of {len(items)} examples keeps none; use a larger fraction")
    return [items[i] for i in sorted(random.Random(seed).sample(range(len(items)), k))]


class BatchSampler:
    """Global batches of a seeded shuffle, a new order each epoch, the last incomplete batch kept (the Trainer's
    dataloader_drop_last=False) unless it has fewer than `min_rows`. Process `rank` of `world_size` takes its
    contiguous slice of every global batch: the union of the slices is the batch one process would draw."""
    def __init__(self, num_examples: int, batch_size: int, seed: int, min_rows: int = 2, rank=0, world_size=1):
        self.n, self.batch_size, self.seed, self.rank, self.world = num_examples, batch_size, seed, rank, world_size
        self.min_rows, self.epoch, last = max(min_rows, world_size), 0, num_examples % batch_size
        if 0 < last < self.min_rows:
            distributed.log(f"note: the last batch of each epoch has {last} example(s), fewer than the "
                            f"{self.min_rows} this method needs; it is skipped")

    def __len__(self):
        return self.n // self.batch_size + (self.n % self.batch_size >= self.min_rows)

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        self.epoch += 1
        for start in range(0, self.n, self.batch_size):
            rows = order[start:start + self.batch_size]
            if len(rows) >= self.min_rows:
                yield rows[len(rows) * self.rank // self.world:len(rows) * (self.rank + 1) // self.world]


def collate(items, tokenizer, max_length: int) -> dict:
    """Tokenise sentences, or tuples of sentences laid out column-major (all sent0, then all sent1, ...)."""
    columns = list(zip(*items)) if isinstance(items[0], tuple) else [items]
    return dict(tokenizer([s for column in columns for s in column], padding=True, truncation=True,
                          max_length=max_length, return_tensors="pt"))


def make_loader(examples, tokenizer, args, device, min_rows: int = 2) -> torch.utils.data.DataLoader:
    world = distributed.world_size()
    if args.batch_size > len(examples):
        raise UsageError(f"--batch_size {args.batch_size} is larger than the {len(examples)} training examples")
    if args.batch_size % world:
        raise UsageError(f"--batch_size {args.batch_size} must be divisible by the {world} processes")
    sampler = BatchSampler(len(examples), args.batch_size, args.seed, min_rows, distributed.rank(), world)
    collate_fn = functools.partial(collate, tokenizer=tokenizer, max_length=args.max_seq_length)
    return torch.utils.data.DataLoader(examples, batch_sampler=sampler, collate_fn=collate_fn,
                                       num_workers=args.num_workers, pin_memory=device.type == "cuda")


def repeat_views(batch: dict, num_views: int) -> dict:
    """The batch stacked `num_views` times, view-major: one forward pass gives each copy its own dropout mask."""
    return {k: v.repeat(num_views, 1) for k, v in batch.items()}

# ----------------------------------------------------------------------------------------------------- model
class MLPHead(nn.Sequential):
    """SimCSE's training head on [CLS]: Linear(D, D) + Tanh, freshly initialised (BERT's initializer_range)."""
    def __init__(self, config):
        super().__init__(nn.Linear(config.hidden_size, config.hidden_size), nn.Tanh())
        nn.init.normal_(self[0].weight, std=getattr(config, "initializer_range", 0.02))
        nn.init.zeros_(self[0].bias)


def embed(hidden_states, attention_mask, pooler: str, head=None) -> torch.Tensor:
    """Training embedding z (float32): the pooled sentence; for "cls" the last [CLS] through the head."""
    z = head(hidden_states[-1][:, 0]) if pooler == "cls" else pool(hidden_states, attention_mask, pooler)
    return z.float()


def model_encode(backbone, head, tokenizer, eval_pooler: str, device):
    """encode(list[str]) for the dev gate: "cls" is the trained head, other poolers read the backbone alone."""
    if eval_pooler != "cls":
        return pooled_encode(backbone, tokenizer, eval_pooler, device)
    return eval_sts.make_encode(lambda batch: head(backbone(**batch).last_hidden_state[:, 0]), tokenizer, device)


def cos_sim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """All-pairs cosine similarity, (N, D) x (M, D) -> (N, M)."""
    return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T


def info_nce(z1, z2, temp: float = 0.05, z3=None, hard_negative_weight: float = 0.0) -> torch.Tensor:
    """SimCSE InfoNCE with in-batch negatives (Eq. 1, unsupervised Eq. 4); with `z3` (hard negatives) the
    supervised Eq. 5, `hard_negative_weight` being Eq. 8's alpha in the authors' form: added to the logit of each
    anchor's own hard negative (alpha = exp(weight))."""
    logits = cos_sim(z1, z2) / temp
    if z3 is not None:
        hard = cos_sim(z1, z3) / temp
        hard = hard + hard_negative_weight * torch.eye(len(z1), device=hard.device, dtype=hard.dtype)
        logits = torch.cat([logits, hard], dim=1)
    return F.cross_entropy(logits, torch.arange(len(z1), device=z1.device))

# ------------------------------------------------------------------------------------------------- training
def autocast(device: torch.device, enabled: bool = True):
    """bf16 autocast on CUDA where supported; fp32 elsewhere (and always for evaluation)."""
    use = enabled and device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use)


def make_optimizer(params, args, total_steps: int):
    """AdamW without weight decay and transformers' get_linear_schedule_with_warmup (the authors' Trainer)."""
    optimizer = torch.optim.AdamW([p for p in params if p.requires_grad], lr=args.lr, weight_decay=0.0)
    warmup = args.warmup_steps  # linear warm-up, then linear decay to 0 at total_steps
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: s / max(1, warmup) if s < warmup
                                                        else max(0.0, (total_steps - s) / max(1, total_steps - warmup)))


def check_finite(loss: torch.Tensor, step: int) -> float:
    if not math.isfinite(value := loss.item()):
        raise UsageError(f"the loss became {value} at step {step}: the run diverged (a lower --lr may help)")
    return value

# ------------------------------------------------------------------------------------- evaluation and saving
def dev_score(modules, encode, senteval_dir) -> float:
    """STS-B dev Spearman x100, in fp32 and eval mode; process 0 evaluates, every process gets the score."""
    score = math.nan
    if distributed.rank() == 0:
        for m in modules:
            m.eval()
        score = eval_sts.evaluate(encode, senteval_dir, ["STSBenchmark"], mode="dev")["STSBenchmark"]
        for m in modules:
            m.train()
    return distributed.broadcast_float(score)


def save_checkpoint(backbone, head, tokenizer, eval_pooler: str, out_dir) -> None:
    """`out_dir/best` (process 0): save_pretrained + tokenizer + sentence-transformers metadata, written beside
    it and swapped in only when complete. The MLP head goes into BERT's pooler weights (as SimCSE's
    simcse_to_huggingface.py does), so `eval_sts.py --pooler cls` on the checkpoint is the head."""
    if distributed.rank() == 0:
        target, tmp, old = (Path(out_dir) / name for name in ("best", "best.tmp", "best.old"))
        shutil.rmtree(tmp, ignore_errors=True)
        state = backbone.state_dict()  # the training model itself stays untouched
        if isinstance(head, MLPHead) and "pooler.dense.weight" in state:
            state.update({"pooler.dense.weight": head[0].weight, "pooler.dense.bias": head[0].bias})
        backbone.save_pretrained(tmp, state_dict=state)
        tokenizer.save_pretrained(tmp)
        eval_sts.write_sentence_transformers_config(tmp, eval_pooler, backbone.config.hidden_size,
                                                    head if eval_pooler == "cls" else None)
        if target.exists():
            target.rename(old)  # a kill between the two renames leaves the previous best whole in best.old
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    distributed.barrier()


def finish(args, eval_pooler: str, senteval_dir, device, stop, **run) -> dict:
    """The final report: peak memory, the best checkpoint reloaded as a plain AutoModel (what `eval_sts.py` sees)
    on the STS test tasks in fp32, its alignment/uniformity, then results.json. An interrupted run records what
    it reached instead and exits 130 (Ctrl-C) / 143 (SIGTERM)."""
    out_dir, cuda = Path(args.output_dir), device.type == "cuda"
    peak = torch.cuda.max_memory_allocated(device) if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    results = {"method": args.method, "args": {k: v for k, v in vars(args).items() if k != "method"},
               "device": str(device), "world_size": distributed.world_size(), "eval_pooler": eval_pooler, **run,
               "peak_memory_mb": round(peak / 2**20, 1), "interrupted": stop.signum is not None,
               "peak_memory_kind": "cuda_max_allocated" if cuda else "cpu_max_rss"}
    if distributed.rank() == 0 and stop.signum is None:
        distributed.log(f"best STS-B dev {run['best_dev_stsb']:.2f} at step {run['best_step']}; evaluating it")
        encode = eval_sts.load_encode(str(out_dir / "best"), eval_pooler, device)
        if not args.no_test_eval:
            results["test"] = eval_sts.evaluate(encode, senteval_dir, mode="test")
            eval_sts.print_table(results["test"])
        pooler = "cls_before_pooler" if eval_pooler == "cls" else eval_pooler  # a fresh head is not "initial"
        initial = eval_sts.load_encode(args.model_name_or_path, pooler, device)  # the pretrained checkpoint
        results["align_uniform"] = {"initial": eval_sts.align_uniform(initial, senteval_dir),
                                    "best": eval_sts.align_uniform(encode, senteval_dir)}
    if distributed.rank() == 0:
        eval_sts.write_json(out_dir / "results.json", results)
        if args.eval_transfer and stop.signum is None:  # after a first write: a transfer error loses nothing
            results["transfer"] = eval_transfer.evaluate(encode, senteval_dir, mode=args.eval_transfer, device=device)
            eval_sts.print_table(results["transfer"])
            eval_sts.write_json(out_dir / "results.json", results)
        distributed.log(f"wrote {out_dir / 'results.json'} (best checkpoint: {out_dir / 'best'})")
    distributed.shutdown()
    if stop.signum is not None:
        raise SystemExit(128 + stop.signum)
    return results
