"""What a reader of the method files needs: arguments, data, encoder pieces, InfoNCE, the dev score,
saving, and the pieces of a run's end.

No training loop lives here: each method file runs its own, visibly (CleanRL's bargain). SimCSE's
poolers and the STS protocol come from eval_sts.py; process-group helpers from distributed.py; what
a first reading can skip (one-line errors, the hub, atomic writes, progress) from plumbing.py.
Defaults: unsupervised SimCSE with BERT-base (Table A.1) and the authors' HF Trainer.
"""
from __future__ import annotations

import argparse
import collections
import csv
import itertools
import math
import os
import random
import resource
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

import distributed
import eval_sts
import eval_transfer
import plumbing
import resume
import syncs

MICSE_DATA_REPO = "sap-ai-research/datasets-for-micse"
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
# miCSE's released subsets (seeds 48-52): fraction -> the percentage in the file name
MICSE_SUBSETS = {0.000064: "000.0064", 0.0001: "000.01", 0.0005: "000.05", 0.001: "000.10",
                 0.005: "000.50", 0.01: "001.00", 0.1: "010.00"}


# ------------------------------------------------------------------------------------- arguments
def base_parser(doc: str, method: str) -> plumbing.Parser:
    """The shared arguments, with unsupervised SimCSE's defaults (Table A.1, BERT-base)."""
    p = plumbing.Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("shared arguments (SimCSE unsupervised defaults)")
    g.add_argument("--model_name_or_path", default="bert-base-uncased",
                   help="HF model id or local directory")
    g.add_argument("--train_file", default=None,
                   help="corpus (default: HF wiki1m_for_simcse.txt; see --fraction)")
    g.add_argument("--fraction", type=float, default=1.0,
                   help="train on a subset of round(fraction * n) examples; without "
                        "--train_file, a fraction miCSE released with --seed 48-52 downloads that "
                        "subset")
    g.add_argument("--seed", type=int, default=42,
                   help="seed for the subset, shuffling, dropout and init")
    g.add_argument("--batch_size", type=int, default=64,
                   help="sentences per step, over all processes (Table A.1)")
    g.add_argument("--lr", type=float, default=3e-5, help="peak learning rate (Table A.1: 3e-5)")
    g.add_argument("--max_seq_length", type=int, default=32,
                   help="truncate training sentences to this many tokens")
    g.add_argument("--epochs", type=int, default=1, help="passes over the training examples")
    g.add_argument("--max_steps", type=int, default=None,
                   help="stop after this many steps (overrides --epochs)")
    g.add_argument("--warmup_steps", type=int, default=0,
                   help="linear warm-up steps before the linear decay")
    g.add_argument("--max_grad_norm", type=float, default=1.0,
                   help="gradient clipping (the Trainer's); 0 disables")
    g.add_argument("--temp", type=float, default=0.05, help="InfoNCE temperature tau")
    g.add_argument("--dropout", type=float, default=None,
                   help="the encoder's hidden and attention dropout rate (SimCSE Table 3: 0 to "
                        "0.5; default: the checkpoint's own, 0.1 for BERT and RoBERTa)")
    g.add_argument("--pooler", default="cls", choices=eval_sts.POOLERS,
                   help="training pooler; cls = [CLS] + MLP head")
    g.add_argument("--mlp_only_train", action=argparse.BooleanOptionalAction, default=True,
                   help="with --pooler cls, evaluate [CLS] before the MLP (SimCSE's unsupervised "
                        "setting)")
    g.add_argument("--eval_steps", type=int, default=125,
                   help="evaluate STS-B dev every this many steps")
    g.add_argument("--align_uniform_steps", type=int, default=None,
                   help="also encode STS-B dev every this many steps between the dev gates, for "
                        "the trajectory's l_align / l_uniform (SimCSE Figure 2: 10); each costs a "
                        "dev encoding")
    g.add_argument("--report_to", default="none", choices=["none", "tensorboard"],
                   help="tensorboard: loss, lr, gradient norm, STS-B dev and l_align / l_uniform "
                        "as scalars under <output_dir>/tb (pip install tensorboard)")
    g.add_argument("--logging_steps", type=int, default=None,
                   help="log loss and steps/s every this many steps (default: at the dev steps); "
                        "each log reads the losses from the device: one host sync")
    g.add_argument("--senteval_dir", default=None,
                   help="SentEval data folder (default: HF senteval.tar)")
    g.add_argument("--output_dir", default=None,
                   help="best checkpoint (best/) + results.json (default runs/<method>)")
    g.add_argument("--overwrite_output_dir", action="store_true",
                   help="allow an --output_dir that holds a run")
    g.add_argument("--resume", action="store_true",
                   help="continue the interrupted run in --output_dir from its last/ (the same "
                        "arguments), to exactly the result of an uninterrupted run")
    g.add_argument("--save_steps", type=int, default=None,
                   help="also save last/ every this many steps (saved at every dev gate and on "
                        "Ctrl-C / SIGTERM)")
    g.add_argument("--keep_last", action="store_true",
                   help="keep last/ when the run completes (the weights, twice their size of "
                        "optimiser state, the RNG streams)")
    g.add_argument("--no_test_eval", action="store_true", help="skip the final STS test evaluation")
    g.add_argument("--eval_transfer", nargs="?", const="test", choices=["test", "fasttest"],
                   default=None, help="also evaluate the best checkpoint on SentEval's 7 transfer "
                                      "tasks (eval_transfer.py)")
    g.add_argument("--device", default=None, help="cuda, cuda:N, cpu (default: cuda if available)")
    g.add_argument("--num_workers", type=int, default=0, help="DataLoader worker processes")
    g.add_argument("--precision", default="auto", choices=PRECISIONS,
                   help="the encoder's forward pass: auto = bf16 on a CUDA GPU that has it, else "
                        "fp16 with a GradScaler, fp32 on CPU; losses are always fp32")
    g.add_argument("--fp32", dest="precision", action="store_const", const="fp32",
                   help="alias of --precision fp32")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the encoder for the training passes (batches padded to a "
                        "multiple of 8, so that few shapes compile)")
    g.add_argument("--deterministic", action="store_true",
                   help="deterministic algorithms on CUDA (torch.use_deterministic_algorithms, "
                        "CUBLAS_WORKSPACE_CONFIG): a resumed GPU run is then bit-identical; slower")
    g.add_argument("--count_host_syncs", type=int, default=None, metavar="N",
                   help="count the host-device syncs of training steps 2..N+1 into results.json "
                        "(syncs.py; slow while it counts: for tests and bench.py)")
    p.set_defaults(method=method, presets=None, backbone=None, backbone_config=None)
    return p


def parse_with_presets(parser, argv, presets: dict, source: str, backbone_table=None):
    """parser.parse_args(argv) with `presets` as the defaults (flags the user gives win), and the
    method's settings for this backbone (`backbone_table`: {backbone: (settings, source)}) on top;
    args.presets records where they come from, which applied and which the user's flags replaced
    (the run summary, results.json); args.backbone what the model is."""
    known, _ = parser.parse_known_args(argv)
    kind, config = backbone(known.model_name_or_path)
    parser.set_defaults(backbone=kind, backbone_config=config)
    settings, table_source = (backbone_table or {}).get(kind, ({}, None))
    if settings:
        presets = {**presets, **settings}
        source = f"{source}; {table_source}" if source else table_source
    parser.set_defaults(**presets)
    args = parser.parse_args(argv)
    if presets:
        given = {k: getattr(args, k) for k in presets}
        args.presets = {"source": source,
                        "applied": {k: v for k, v in given.items() if v == presets[k]},
                        "overridden": {k: v for k, v in given.items() if v != presets[k]}}
    return args


# What a model is, from its config (model_type, width, depth), not its name: a local copy of
# roberta-large is roberta-large. A hub id not downloaded yet is known by its published config.
BACKBONES = {("bert", 768, 12): "bert-base", ("bert", 1024, 24): "bert-large",
             ("roberta", 768, 12): "roberta-base", ("roberta", 1024, 24): "roberta-large"}
HUB_BACKBONES = {"bert-base-uncased": "bert-base", "bert-base-cased": "bert-base",
                 "bert-large-uncased": "bert-large", "bert-large-cased": "bert-large",
                 "roberta-base": "roberta-base", "roberta-large": "roberta-large"}


def backbone(name_or_path: str) -> tuple[str | None, str]:
    """(bert-base, bert-large, roberta-base, roberta-large or None, what its config says)."""
    config = plumbing.local_config(name_or_path)
    if config is None:
        kind = HUB_BACKBONES.get(name_or_path.split("/")[-1])
        return kind, "not read yet" if kind is None else f"{kind} (the hub's config)"
    key = (config.model_type, config.hidden_size, config.num_hidden_layers)
    return BACKBONES.get(key), f"{key[0]}, {key[1]} wide, {key[2]} layers"


def check_args(args) -> None:
    """Every shared flag against its meaning, the device and the output folder: before any work."""
    check = plumbing.check_range
    check(args, "fraction", lambda v: 0 < v <= 1, "0 < fraction <= 1")
    check(args, "seed", lambda v: 0 <= v < 2**32, "0 <= seed < 2^32")
    check(args, "batch_size", lambda v: v >= 2, "at least 2 (one sentence has no negatives)")
    check(args, "max_seq_length", lambda v: 2 <= v <= 512, "2..512 tokens")
    for name in ("lr", "temp", "epochs", "eval_steps", "logging_steps", "align_uniform_steps",
                 "save_steps"):
        check(args, name, lambda v: v > 0, "a positive number")
    for name in ("max_steps", "warmup_steps", "max_grad_norm", "num_workers"):
        check(args, name, lambda v: v >= 0, "a non-negative number")
    check(args, "dropout", lambda v: 0 <= v < 1, "0 <= rate < 1")
    args.logging_steps = args.logging_steps or args.eval_steps
    plumbing.check_installed(args.report_to == "tensorboard", "tensorboard",
                             "--report_to tensorboard")
    device = plumbing.resolve_device(args.device)
    args.precision = resolve_precision(args.precision, device)
    check(args, "count_host_syncs", lambda v: v >= 1, "a positive number of steps")
    if args.count_host_syncs and args.compile:
        raise plumbing.UsageError("--count_host_syncs counts under a TorchDispatchMode, which "
                                  "--compile does not trace: give one of them")
    syncs.WINDOW = syncs.StepWindow(args.count_host_syncs, device)
    if args.deterministic:
        deterministic_algorithms()
    args.output_dir = str(args.output_dir or Path("runs") / args.method)
    out = Path(args.output_dir)
    if out.exists() and not out.is_dir():
        raise plumbing.UsageError(f"--output_dir {out} is a file; give a folder")
    holds_a_run = any((out / name).exists() for name in ("results.json", "best", "tb", "last"))
    if args.resume and args.overwrite_output_dir:
        raise plumbing.UsageError("--resume continues the run in --output_dir and "
                                  "--overwrite_output_dir replaces it: give one of them")
    if args.resume:
        resume.check(args)  # a last/ to resume from, and the run's own arguments
    elif holds_a_run and not args.overwrite_output_dir:
        raise plumbing.UsageError(f"--output_dir {out} already holds a run; pass "
                                  "--overwrite_output_dir or another folder")


def deterministic_algorithms() -> None:
    """--deterministic: every op's deterministic algorithm (PyTorch raises where there is none; SDPA
    then picks a deterministic kernel), cuBLAS's fixed workspace (read when cuBLAS starts: before
    any CUDA work) and no cuDNN autotuning."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False


def resolve_precision(precision: str, device: torch.device) -> str:
    """"auto": bf16 on a CUDA GPU that supports it, fp16 (with a GradScaler) on an older one, fp32
    on CPU."""
    cuda = device.type == "cuda"
    bf16_ok = not cuda or torch.cuda.is_bf16_supported(including_emulation=False)
    if precision == "auto":
        return ("bf16" if bf16_ok else "fp16") if cuda else "fp32"
    if precision == "bf16" and not bf16_ok:
        raise plumbing.UsageError("--precision bf16: this GPU has no bf16; use --precision fp16 "
                                  "(or auto)")
    if precision == "fp16" and not cuda:
        raise plumbing.UsageError("--precision fp16 needs a CUDA device; on CPU use --precision "
                                  "bf16 or fp32")
    return precision


def run_summary(args, num_examples: int, train_file, subset, steps_per_epoch: int,
                total_steps: int, device) -> dict:
    """What this run is, printed before training and kept in results.json: the presets and their
    source, the data, the model, device and precision, the schedule, the output folder."""
    if subset:
        data = f"miCSE's released subset {subset}: {num_examples:,} examples (Table 2's data)"
    elif args.fraction < 1:
        data = (f"{num_examples:,} examples, a {args.fraction:g} subset of {train_file} drawn "
                f"with --seed {args.seed}")
        if args.fraction in MICSE_SUBSETS and not args.train_file:
            data += " (not the authors' subset: theirs are --seed 48-52)"
    else:
        data = f"{num_examples:,} examples from {train_file}"
    presets = "none: the defaults in --help (BERT-base's)"
    if args.presets:
        applied, overridden = args.presets["applied"], args.presets["overridden"]
        presets = args.presets["source"] + ": " + ", ".join(f"{k} {v}" for k, v in applied.items())
        if overridden:
            presets += "; your flags replaced " + ", ".join(f"{k} (now {v})"
                                                            for k, v in overridden.items())
    compiled = ", torch.compile" if args.compile else ""
    if args.backbone:
        model = f"{args.backbone} ({args.backbone_config})"
    else:
        model = f"{args.backbone_config}: no preset for this backbone, the BERT-base settings"
    summary = {"presets": presets, "backbone": model, "data": data,
               "model": f"{args.model_name_or_path}, trained with pooler {args.pooler}, "
                        f"evaluated with {eval_pooler(args)}",
               "device": f"{device} x {distributed.world_size()}, precision {args.precision}"
                         f"{compiled}",
               "schedule": f"{total_steps:,} steps ({steps_per_epoch:,} an epoch), batch "
                           f"{args.batch_size}, lr {args.lr:g}, STS-B dev every {args.eval_steps} "
                           "steps; the ETA comes with the first log line",
               "output": args.output_dir}
    lines = [f"  {key:<9} {value}" for key, value in summary.items()]
    distributed.log("\n".join([args.method] + lines))
    return summary


def nearest_fraction(table: dict, fraction: float) -> float:
    """The fraction of a per-fraction settings table nearest to --fraction, on a log scale."""
    return min(table, key=lambda f: abs(math.log10(f) - math.log10(fraction)))


def eval_pooler(args) -> str:
    """SimCSE: with --mlp_only_train the [CLS] pooler is evaluated before the MLP."""
    return "cls_before_pooler" if args.pooler == "cls" and args.mlp_only_train else args.pooler

# ------------------------------------------------------------------------------------------ data
def micse_subset(fraction: float, seed: int) -> str | None:
    """The file name of miCSE's released subset for (fraction, seed), or None if they released
    none."""
    percent = MICSE_SUBSETS.get(fraction)
    if percent is None or not 48 <= seed <= 52:
        return None
    return f"wiki_subset_1M_{percent}percent_seed{seed}.txt"


def training_examples(args, default_file: str = "wiki1m_for_simcse.txt", triplets: bool = False,
                      hard_negatives: bool = True, neutral: bool = False):
    """(examples, path, miCSE subset or None): a `datasets` Dataset with a "text" column (lines
    stripped, empty ones skipped) or, with `triplets`, NLI's sent0/sent1/hard_neg columns
    (sent0/sent1 only when the file has no hard_neg or `hard_negatives` is off; + neutral with
    `neutral`), --fraction applied deterministically."""
    subset = None if args.train_file or triplets else micse_subset(args.fraction, args.seed)
    repo, name = (MICSE_DATA_REPO, subset) if subset else (plumbing.SIMCSE_DATA_REPO, default_file)
    path = args.train_file or plumbing.hub_file(repo, name, "--train_file")
    if Path(path).is_file() and Path(path).stat().st_size > 20 * 2**20:
        distributed.log(f"reading {path} (datasets caches it: the next run is faster)")
    # missing, unreadable, not UTF-8, empty: one line
    lines = plumbing.read_lines(path, "--train_file")
    if triplets:
        rows = csv.reader(lines)
        header = next(rows)
        if {"sent0", "sent1"} - set(header):
            raise plumbing.UsageError(f"--train_file {path}: the header must name sent0,sent1 "
                                      "(and hard_neg for hard negatives: nli_for_simcse.csv)")
        columns = ["sent0", "sent1"] + (["hard_neg"] if hard_negatives and "hard_neg" in header
                                        else [])
        if neutral and not {"hard_neg", "neutral"} <= set(header):
            raise plumbing.UsageError(f"--train_file {path}: --neutral_hard_negatives needs "
                                      "sent0,sent1,hard_neg,neutral columns (README: Ablations)")
        columns += ["neutral"] if neutral else []
        for row in rows:
            if len(row) < len(header):
                raise plumbing.UsageError(f"--train_file {path} line {rows.line_num} has "
                                          f"{len(row)} column(s), expected {len(header)}")
    import datasets
    datasets.disable_progress_bars()  # one line instead, for a corpus big enough to take a while
    if triplets:  # keep_default_na: a sentence "NA" or "null" stays a sentence
        data = datasets.load_dataset("csv", data_files=str(path), split="train",
                                     keep_default_na=False)
        data = data.select_columns(columns)
        data = data.filter(lambda b: [bool(a and p) for a, p in zip(b["sent0"], b["sent1"])],
                           batched=True)
    else:
        data = datasets.load_dataset("text", data_files=str(path), split="train")
        data = data.map(lambda b: {"text": [s.strip() for s in b["text"]]}, batched=True)
        data = data.filter(lambda b: [bool(s) for s in b["text"]], batched=True)
    if len(data) == 0:
        raise plumbing.UsageError(f"--train_file {path} holds no sentences")
    if not triplets and {"sent0", "sent1"} <= set(data[0]["text"].split(",")):
        raise plumbing.UsageError(f"--train_file {path} is NLI triplets (a sent0,sent1,... "
                                  "header), not one sentence a line; simcse.py trains on it with "
                                  "--supervised")
    if not subset:
        data = data.select(subsample(range(len(data)), args.fraction, args.seed))
    return data, str(path), subset


def subsample(items, fraction: float, seed: int) -> list:
    """A deterministic random subset of round(fraction * n) items, kept in file order (miCSE's
    few-shot sets)."""
    k = round(fraction * len(items))
    if k < 1:
        raise plumbing.UsageError(f"--fraction {fraction} of {len(items)} examples keeps none; "
                                  "use a larger fraction")
    return [items[i] for i in sorted(random.Random(seed).sample(range(len(items)), k))]


class BatchSampler:
    """Global batches of a seeded shuffle, a new order each epoch, the last incomplete batch kept
    (the Trainer's dataloader_drop_last=False) unless it has fewer than `min_rows`. Process `rank`
    of `world_size` takes its contiguous slice of every global batch: the union of the slices is the
    batch one process would draw."""
    def __init__(self, num_examples: int, batch_size: int, seed: int, min_rows: int = 2, rank=0,
                 world_size=1):
        self.n, self.batch_size, self.seed = num_examples, batch_size, seed
        self.rank, self.world = rank, world_size
        self.min_rows, self.epoch, last = max(min_rows, world_size), 0, num_examples % batch_size
        self.skip = 0  # --resume: batches of the next epoch's order already trained on
        self.rows = collections.deque()  # the global row count of each batch handed out (batches())
        if 0 < last < self.min_rows:
            distributed.log(f"note: the last batch of each epoch has {last} example(s), fewer "
                            f"than the {self.min_rows} this method needs; it is skipped")

    def __len__(self):
        return self.n // self.batch_size + (self.n % self.batch_size >= self.min_rows)

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=generator).tolist()
        self.epoch += 1
        batches = [order[i:i + self.batch_size] for i in range(0, self.n, self.batch_size)]
        batches = [rows for rows in batches if len(rows) >= self.min_rows]
        skip, self.skip = self.skip, 0
        for rows in batches[skip:]:
            n = len(rows)
            self.rows.append(n)
            yield rows[n * self.rank // self.world:n * (self.rank + 1) // self.world]


class TokenizedCorpus:
    """Every example tokenised once (datasets' batched `map`, cached as SimCSE's train.py does), its
    token ids kept in one flat array with each sequence's offsets. `collate(rows)` gathers those
    rows and pads them to their longest; a triplet's sequences are laid out column-major (all sent0,
    then all sent1, then all hard_neg)."""

    def __init__(self, examples, tokenizer, max_length: int, pad_to_multiple_of: int = 1):
        columns = examples.column_names  # ["text"] or ["sent0", "sent1", "hard_neg"]

        def tokenize(batch):
            return {f"{c}_ids": tokenizer(batch[c], truncation=True,
                                          max_length=max_length)["input_ids"]
                    for c in columns}
        if len(examples) > 100_000:
            distributed.log(f"tokenising {len(examples):,} examples (cached: the next run is "
                            "faster)")
        ids = examples.map(tokenize, batched=True, remove_columns=columns).with_format("arrow")
        flat, offsets = [], [np.zeros(1, dtype=np.int64)]
        for c in columns:
            sequences = ids[f"{c}_ids"].combine_chunks()
            flat.append(sequences.flatten().to_numpy())
            offsets.append(np.diff(sequences.offsets.to_numpy()).cumsum() + offsets[-1][-1])
        self.flat, self.offsets = np.concatenate(flat), np.concatenate(offsets)
        self.num_columns = len(columns)
        self.pad_id, self.multiple = tokenizer.pad_token_id, pad_to_multiple_of
        self.left = tokenizer.padding_side == "left"
        self.with_token_types = "token_type_ids" in tokenizer.model_input_names

    def __len__(self):
        return (len(self.offsets) - 1) // self.num_columns

    def collate(self, rows: list[int]) -> dict:
        """What tokenizer(sentences, padding=True) returns for these rows (one sequence each, token
        types 0)."""
        sequences = np.array([c * len(self) + r for c in range(self.num_columns) for r in rows])
        starts = self.offsets[sequences]
        lengths = self.offsets[sequences + 1] - starts
        width = -(-int(lengths.max()) // self.multiple) * self.multiple
        position = np.arange(width) - (width - lengths[:, None] if self.left else 0)
        valid = (position >= 0) & (position < lengths[:, None])
        tokens = self.flat[np.clip(starts[:, None] + position, 0, len(self.flat) - 1)]
        input_ids = np.where(valid, tokens, self.pad_id)
        batch = {"input_ids": torch.from_numpy(input_ids),
                 "attention_mask": torch.from_numpy(valid.astype(np.int64))}
        if self.with_token_types:
            batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
        return batch


def make_loader(corpus: TokenizedCorpus, args, device,
                min_rows: int = 2) -> torch.utils.data.DataLoader:
    world = distributed.world_size()
    if args.batch_size > len(corpus):
        raise plumbing.UsageError(f"--batch_size {args.batch_size} is larger than the "
                                  f"{len(corpus)} training examples")
    if args.batch_size % world:
        raise plumbing.UsageError(f"--batch_size {args.batch_size} must be divisible by the "
                                  f"{world} processes")
    sampler = BatchSampler(len(corpus), args.batch_size, args.seed, min_rows, distributed.rank(),
                           world)
    # its own generator: starting an epoch draws nothing from the RNG stream dropout uses (--resume)
    return torch.utils.data.DataLoader(range(len(corpus)), batch_sampler=sampler,
                                       collate_fn=corpus.collate, num_workers=args.num_workers,
                                       pin_memory=device.type == "cuda",
                                       generator=torch.Generator().manual_seed(args.seed))


def batches(loader):
    """The loader's batches, epoch after epoch. Each tells distributed.gather the global batch's row
    count, known from the sampler (no collective), and opens a step's window for
    --count_host_syncs."""
    sampler = loader.batch_sampler
    for _ in itertools.count():
        for batch in loader:
            distributed.set_rows(sampler.rows.popleft())
            syncs.begin_step()
            yield batch


def repeat_views(batch: dict, num_views: int) -> dict:
    """The batch stacked `num_views` times, view-major: one forward pass gives each copy its own
    dropout mask."""
    return {k: v.repeat(num_views, 1) for k, v in batch.items()}

# ----------------------------------------------------------------------------------------- model
class MLPHead(nn.Sequential):
    """SimCSE's training head on [CLS]: Linear(D, D) + Tanh, freshly initialised (BERT's
    initializer_range)."""
    def __init__(self, config):
        super().__init__(nn.Linear(config.hidden_size, config.hidden_size), nn.Tanh())
        nn.init.normal_(self[0].weight, std=getattr(config, "initializer_range", 0.02))
        nn.init.zeros_(self[0].bias)


class Encoder(nn.Module):
    """What a step trains, as one module: the backbone, whose forward this is, and the heads the
    loop applies to its outputs. Under torchrun DistributedDataParallel wraps it
    (distributed.data_parallel), so that its all-reduce averages the heads' gradients too. BERT's
    pooler takes part in no loss (SimCSE trains its own head): frozen, DDP expects no gradient for
    it (it never had one, and never changed)."""

    def __init__(self, backbone, *heads):
        super().__init__()
        self.backbone, self.heads = backbone, nn.ModuleList(h for h in heads if h is not None)
        if getattr(backbone, "pooler", None) is not None:
            backbone.pooler.requires_grad_(False)

    def forward(self, attention_mask, **inputs):
        mask = attention_mask_4d(attention_mask, self.backbone.config._attn_implementation)
        return self.backbone(attention_mask=mask, **inputs)


def attention_mask_4d(attention_mask, attn_implementation: str):
    """The padding mask as transformers builds it for the attention, prebuilt: given a 2-D mask,
    transformers 5 checks its values on the host (masking_utils, padding_mask.all()), a sync every
    pass; a 4-D mask it uses as it is. SDPA: True where a key is attended; eager: 0 there and the
    fp32 minimum elsewhere, added to the scores. The same outputs, bit for bit (tests)."""
    mask = attention_mask[:, None, None, :].bool()
    if attn_implementation == "sdpa":
        return mask
    if attn_implementation == "eager":
        minimum = torch.finfo(torch.float32).min
        return torch.where(mask, torch.zeros((), device=mask.device), minimum)
    return attention_mask  # flash attention unpads with the 2-D mask


def set_dropout(module: nn.Module, p: float | None) -> None:
    """--dropout: the rate of every nn.Dropout (BERT's and RoBERTa's attention read `dropout.p`
    too) and the config's hidden and attention rates, so a saved checkpoint says what it trained
    with. None keeps the checkpoint's own rates."""
    if p is None:
        return
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = p
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
        if hasattr(getattr(module, "config", None), name):
            setattr(module.config, name, p)


def embed(hidden_states, attention_mask, pooler: str, head=None) -> torch.Tensor:
    """Training embedding z in fp32: the pooled sentence; for "cls" the last [CLS] through the head.
    Called after the autocast block, so the head and pooling run in fp32 whatever precision the
    encoder ran in."""
    if pooler == "cls":
        return head(hidden_states[-1][:, 0].float())
    return eval_sts.pool(hidden_states, attention_mask, pooler).float()


def model_encode(backbone, head, tokenizer, eval_pooler: str, device):
    """encode(list[str]) for the dev gate: "cls" is the trained head, other poolers read the
    backbone alone."""
    if eval_pooler != "cls":
        return eval_sts.pooled_encode(backbone, tokenizer, eval_pooler, device)
    def embed_batch(batch):
        return head(backbone(**batch).last_hidden_state[:, 0])
    return eval_sts.make_encode(embed_batch, tokenizer, device)


def cos_sim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """All-pairs cosine similarity, (N, D) x (M, D) -> (N, M)."""
    return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T


def info_nce(z1, z2, temp: float = 0.05, z3=None,
             hard_negative_weight: float = 0.0) -> torch.Tensor:
    """SimCSE InfoNCE with in-batch negatives (Eq. 1, unsupervised Eq. 4); with `z3` (hard
    negatives) the supervised Eq. 5, `hard_negative_weight` being Eq. 8's alpha in the authors'
    form: added to the logit of each anchor's own hard negative (alpha = exp(weight)). `z3` may
    stack several blocks of N (Table 7's contradictions, then neutrals): each block's row i is
    anchor i's own."""
    logits = cos_sim(z1, z2) / temp
    if z3 is not None:
        hard = cos_sim(z1, z3) / temp
        own = torch.eye(len(z1), device=hard.device, dtype=hard.dtype)
        hard = hard + hard_negative_weight * own.repeat(1, len(z3) // len(z1))
        logits = torch.cat([logits, hard], dim=1)
    return F.cross_entropy(logits, torch.arange(len(z1), device=z1.device))


def positive_only_loss(z1, z2, temp: float = 0.05) -> torch.Tensor:
    """InfoNCE's positive term alone: mean of -cos(z1_i, z2_i) / temp, no negatives (miCSE Table 4's
    "w/o negatives" rows; the paper gives no formula, so this is Eq. 1 without its denominator)."""
    return -(F.cosine_similarity(z1, z2, dim=-1) / temp).mean()


# -------------------------------------------------------------------------------------- training
def autocast(device: torch.device, precision: str):
    """Mixed precision for the encoder's forward pass only (--precision); fp32 is no autocast at
    all."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None)


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """fp16 needs loss scaling (the authors' --fp16 runs had it through the Trainer); otherwise a
    pass-through."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def make_optimizer(params, args, total_steps: int):
    """AdamW without weight decay and transformers' get_linear_schedule_with_warmup (the authors'
    Trainer). Fused, on CUDA and CPU alike: one kernel, its step counts stay on the device (the
    foreach path reads them with .item()), and with a GradScaler no host sync to check for inf
    gradients."""
    params = [p for p in params if p.requires_grad]
    fused = params[0].device.type in ("cuda", "cpu") or None
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, fused=fused)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, args.warmup_steps,
                                                             total_steps)
    return optimizer, scheduler


class History:
    """What the loop measures, for results.json and --report_to: each step's loss and gradient norm
    (`add`: kept on the device until `read`, one host sync at a log step), and the trajectory
    (`record`: a row at every log, dev and --align_uniform_steps step). Step k's loss is
    losses[k - 1]."""

    def __init__(self, args, saved: dict):
        """`saved`: resume.new_run() or the record of the run being resumed (--resume)."""
        self.losses, self.grad_norms = list(saved["losses"]), list(saved["grad_norms"])
        self.trajectory, self.resumptions = list(saved["trajectory"]), list(saved["resumptions"])
        self.pending = []
        self.writer = plumbing.tensorboard(args.report_to, Path(args.output_dir) / "tb",
                                           distributed.rank() == 0,
                                           saved["next_step"] if args.resume else None)

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.pending.append(torch.stack([loss.detach().float(), grad_norm.float()]))
        syncs.end_step()  # the step is queued: --count_host_syncs' window closes

    def read(self) -> None:
        """The pending steps' values as floats: one host sync. The first NaN or inf loss stops the
        run with its step."""
        if not self.pending:
            return
        values = torch.stack(self.pending).tolist()
        self.pending.clear()
        for step, (loss, grad_norm) in enumerate(values, start=len(self.losses) + 1):
            if not math.isfinite(loss):
                raise plumbing.UsageError(f"the loss became {loss} at step {step}: the run "
                                          "diverged (a lower --lr may help)")
            self.losses.append(loss)
            self.grad_norms.append(grad_norm)
            plumbing.add_scalars(self.writer, step,
                                 {"train/loss": loss, "train/grad_norm": grad_norm})

    def record(self, point: dict) -> None:
        """One row of the trajectory: {"step", "train_time_s", "lr"} and, where STS-B dev was
        encoded, {"stsb_dev", "align", "uniform", "gate"}."""
        self.trajectory.append(point)
        plumbing.add_scalars(self.writer, point["step"],
                             {f"{'train' if k == 'lr' else 'dev'}/{k}": v for k, v in point.items()
                              if k in ("lr", "stsb_dev", "align", "uniform")})


def progress(step: int, total_steps: int, losses: list, train_time: float) -> str:
    """The log line: step, loss, training speed and the training time left at that speed (dev gates
    aside)."""
    if not losses:  # step 0: nothing trained yet
        return f"step {step}/{total_steps}"
    rate = step / max(train_time, 1e-9)
    left = f"  ETA {plumbing.duration((total_steps - step) / rate)}" if step < total_steps else ""
    return f"step {step}/{total_steps}  loss {losses[-1]:.4f}  {rate:.2f} steps/s{left}"

# ------------------------------------------------------------------------- evaluation and saving
def dev_measures(modules, encode, senteval_dir) -> dict:
    """STS-B dev in fp32 and eval mode, one encoding: {"stsb_dev": Spearman x100 (-inf when it is
    undefined), "align", "uniform"} (l_align / l_uniform of the same embeddings, SimCSE Figure 2).
    Process 0 evaluates; every process gets the score."""
    measures = {"stsb_dev": math.nan}
    if distributed.rank() == 0:
        for m in modules:
            m.eval()
        scores = eval_sts.stsb_dev(encode, senteval_dir, desc="dev gate: STS-B dev")
        measures = {"stsb_dev": scores["STSBenchmark"], "align": scores["align"],
                    "uniform": scores["uniform"]}
        # constant embeddings have no Spearman: the score is the worst, not NaN
        if not math.isfinite(measures["stsb_dev"]):
            distributed.log("note: the STS-B dev score is undefined (the embeddings are constant: "
                            "a collapsed or degenerate model); it counts as the worst score")
            measures["stsb_dev"] = -math.inf
        for m in modules:
            m.train()
    measures["stsb_dev"] = distributed.broadcast_float(measures["stsb_dev"])
    return measures


def save_checkpoint(backbone, head, tokenizer, eval_pooler: str, out_dir,
                    projection=None) -> None:
    """`out_dir/best` (process 0): save_pretrained + tokenizer + sentence-transformers metadata,
    written beside it and swapped in only when complete. The MLP head goes into BERT's pooler
    weights (as SimCSE's simcse_to_huggingface.py does), so `eval_sts.py --pooler cls` on the
    checkpoint is the head. A `projection` (nn.Linear after the pooler) is saved beside it, and
    eval_sts.load_encode applies it."""
    if distributed.rank() == 0:
        target, tmp = Path(out_dir) / "best", Path(out_dir) / "best.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        state = backbone.state_dict()  # the training model itself stays untouched
        if isinstance(head, MLPHead) and "pooler.dense.weight" in state:
            state.update({"pooler.dense.weight": head[0].weight, "pooler.dense.bias": head[0].bias})
        backbone.save_pretrained(tmp, state_dict=state)
        tokenizer.save_pretrained(tmp)
        if projection is not None:
            plumbing.save_projection(tmp, projection)
        else:  # sentence-transformers' modules do not hold the projection
            plumbing.write_sentence_transformers_config(
                tmp, eval_pooler, backbone.config.hidden_size,
                head if eval_pooler == "cls" else None)
        umask = os.umask(0)
        os.umask(umask)
        # save_pretrained writes the weights through a 0600 temporary file
        for path in tmp.rglob("*"):
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
        plumbing.swap_in(tmp, target)  # a kill leaves the previous best whole (best.old at worst)
    distributed.barrier()


def run_record(args, eval_pooler: str, device, stop, history: History, train_time: float,
               **run) -> dict:
    """results.json before the final evaluation: the method, every argument, where and how it ran,
    what the loop measured (`run`; from `history` the steps, their losses and gradient norms and
    the trajectory; the training speed), peak memory, and whether a signal stopped the training."""
    if history.writer is not None:
        history.writer.close()
    losses = history.losses
    cuda = device.type == "cuda"
    peak = torch.cuda.max_memory_allocated(device) if cuda else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    arguments = {k: v for k, v in vars(args).items() if k != "method"}
    results = {"method": args.method, "args": arguments,
               "device": str(device), "world_size": distributed.world_size(),
               "precision": args.precision, "eval_pooler": eval_pooler, **run,
               "steps": len(losses), "train_loss": losses, "grad_norm": history.grad_norms,
               "trajectory": history.trajectory, "resumptions": history.resumptions,
               "train_time_s": round(train_time, 2),
               "steps_per_second": round(len(losses) / train_time, 3) if train_time else 0.0,
               "peak_memory_mb": round(peak / 2**20, 1),
               "peak_memory_kind": "cuda_max_allocated" if cuda else "cpu_max_rss",
               "interrupted": stop.signum is not None}
    if args.count_host_syncs:
        results["host_syncs"] = syncs.WINDOW.record()
    if stop.signum is not None:
        results["interrupted_during"] = "training"
    if cuda:
        reserved = torch.cuda.max_memory_reserved(device)
        results["peak_memory_reserved_mb"] = round(reserved / 2**20, 1)
    return results


def sts_test_scores(encode, senteval_dir) -> dict:
    """The 7 STS test tasks (SimCSE's Table 5 protocol), printed as SimCSE's evaluation.py prints
    them."""
    scores = eval_sts.evaluate(encode, senteval_dir, mode="test")
    eval_sts.print_table(scores)
    return scores


def align_uniform(encode, args, eval_pooler: str, senteval_dir, device) -> dict:
    """l_align / l_uniform on STS-B dev of the pretrained checkpoint and of best/ (SimCSE Figure
    2)."""
    # a fresh head is not "initial"
    pooler = "cls_before_pooler" if eval_pooler == "cls" else eval_pooler
    initial = eval_sts.load_encode(args.model_name_or_path, pooler, device)
    return {"initial": eval_sts.align_uniform(initial, senteval_dir,
                                              desc="initial model: alignment/uniformity"),
            "best": eval_sts.align_uniform(encode, senteval_dir)}


def transfer_scores(encode, senteval_dir, args, device, results: dict) -> dict:
    """--eval_transfer: SentEval's 7 transfer tasks (eval_transfer.py), after writing `results`
    first, so that an error in this long evaluation loses nothing."""
    plumbing.write_json(Path(args.output_dir) / "results.json", results)
    scores = eval_transfer.evaluate(encode, senteval_dir, mode=args.eval_transfer, device=device)
    eval_sts.print_table(scores)
    return scores
