"""The data: wiki1m's sentences or NLI triplets (and miCSE's few-shot subsets), tokenised once; the
seeded batch order, each process's slice of a global batch, and the loader. A file comes from the
Hub (cached) or --train_file; `datasets` reads and caches it as SimCSE's train.py does."""
from __future__ import annotations

import collections
import itertools
import random
from pathlib import Path

import numpy as np
import torch

import plumbing
from plumbing import distributed, hub, syncs

MICSE_DATA_REPO = "sap-ai-research/datasets-for-micse"
# miCSE's released subsets (seeds 48-52): fraction -> the percentage in the file name
MICSE_SUBSETS = {0.000064: "000.0064", 0.0001: "000.01", 0.0005: "000.05", 0.001: "000.10",
                 0.005: "000.50", 0.01: "001.00", 0.1: "010.00"}


def micse_subset(fraction: float, seed: int) -> str | None:
    """The file name of miCSE's released subset for (fraction, seed); None where there is none."""
    percent = MICSE_SUBSETS.get(fraction)
    if percent is None or not 48 <= seed <= 52:
        return None
    return f"wiki_subset_1M_{percent}percent_seed{seed}.txt"


def training_examples(args, default_file: str = "wiki1m_for_simcse.txt", triplets: bool = False,
                      hard_negatives: bool = True, neutral: bool = False):
    """(examples, path, miCSE subset or None): a `datasets` Dataset with a "text" column (lines
    stripped, empty ones skipped) or, with `triplets`, NLI's sent0/sent1/hard_neg columns (no
    hard_neg when the file has none or `hard_negatives` is off; + neutral with `neutral`),
    --fraction applied unless the file is miCSE's subset for (--fraction, --seed)."""
    subset = None if triplets else micse_subset(args.fraction, args.seed)
    if args.train_file and Path(args.train_file).name != subset:
        subset = None  # a local copy of the authors' subset keeps its name and is read whole
    repo, name = (MICSE_DATA_REPO, subset) if subset else (hub.SIMCSE_DATA_REPO, default_file)
    path = args.train_file or hub.hub_file(repo, name, "--train_file")
    if Path(path).is_file() and Path(path).stat().st_size > 20 * 2**20:
        distributed.log(f"reading {path} (datasets caches it: the next run is faster)")
    lines = plumbing.read_lines(path, "--train_file")  # missing, unreadable, not UTF-8: one line
    if triplets:  # the columns it has and a run wants; a short row: one line
        columns = plumbing.triplet_columns(lines, path, hard_negatives, neutral)
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
    """A seeded random subset of round(fraction * n) items in file order (miCSE's few-shot sets)."""
    k = round(fraction * len(items))
    if k < 1:
        raise plumbing.UsageError(f"--fraction {fraction} of {len(items)} examples keeps none; "
                                  "use a larger fraction")
    return [items[i] for i in sorted(random.Random(seed).sample(range(len(items)), k))]


class BatchSampler:
    """Global batches of a seeded shuffle, a new order each epoch, the last short batch kept (as the
    Trainer's) unless it has fewer than `min_rows`. Process `rank` of `world_size` takes its
    contiguous slice of each global batch: the slices make the batch one process would draw."""
    def __init__(self, num_examples, batch_size, seed, min_rows=2, rank=0, world_size=1):
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
    """Every example tokenised once (datasets' `map`, cached as SimCSE's train.py does), its token
    ids in one flat array with each sequence's offsets. `collate(rows)` pads those rows; a triplet
    is laid out column-major (all sent0, all sent1, all hard_neg); `example_ids`: the rows' ids."""

    def __init__(self, examples, tokenizer, max_length: int, pad_to_multiple_of: int = 1,
                 example_ids: bool = False):
        columns = examples.column_names  # ["text"] or ["sent0", "sent1", "hard_neg"]

        def tokenize(batch):
            return {f"{c}_ids": tokenizer(batch[c], truncation=True, max_length=max_length)[
                "input_ids"] for c in columns}
        if len(examples) > 100_000:
            distributed.log(f"tokenising {len(examples):,} examples (cached for the next run)")
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
        self.example_ids = example_ids  # each batch also says which examples it holds

    def __len__(self):
        return (len(self.offsets) - 1) // self.num_columns

    def collate(self, rows: list[int]) -> dict:
        """What tokenizer(sentences, padding=True) returns for these rows (token types 0)."""
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
        if self.example_ids:
            batch["example_ids"] = torch.tensor(rows, dtype=torch.long)
        return batch


def make_loader(corpus: TokenizedCorpus, args, device, min_rows: int = 2):
    world = distributed.world_size()
    if args.batch_size > len(corpus):
        raise plumbing.UsageError(f"--batch_size {args.batch_size} is larger than the "
                                  f"{len(corpus)} training examples")
    if args.batch_size % world:
        raise plumbing.UsageError(f"--batch_size {args.batch_size} must be divisible by the "
                                  f"{world} processes")
    sampler = BatchSampler(len(corpus), args.batch_size, args.seed, min_rows, distributed.rank(),
                           world)
    # its own generator (an epoch draws nothing from dropout's RNG stream); workers ignore Ctrl-C
    return torch.utils.data.DataLoader(range(len(corpus)), batch_sampler=sampler,
                                       collate_fn=corpus.collate, num_workers=args.num_workers,
                                       pin_memory=device.type == "cuda",
                                       worker_init_fn=distributed.ignore_stop_signals,
                                       generator=torch.Generator().manual_seed(args.seed))


def pad_multiple(args) -> int:
    """Batches padded to their longest row (1), to a multiple of 8 (--compile: few shapes), or all
    --max_seq_length wide (--pad_to_max_length: a CUDA graph's one shape)."""
    return args.max_seq_length if args.pad_to_max_length else 8 if args.compile else 1


def part_of(batch: dict, part: slice | None, sections: int = 1) -> dict:
    """Some of a batch's examples (part None: all of it), for a batch laid out in `sections` stacked
    sections of rows (NLI's columns, repeated views): each section's rows of those examples."""
    if part is None:
        return batch
    return {k: torch.cat([rows[part] for rows in v.chunk(sections)]) for k, v in batch.items()}


def batches(loader):
    """(rows, batch): the loader's batches, epoch after epoch, with the global batch's row count
    (the sampler's: no collective) that distributed.gather takes; --count_host_syncs' windows."""
    sampler = loader.batch_sampler
    for _ in itertools.count():
        with distributed.stop_signals_held():  # the epoch's workers start ignoring them
            epoch = iter(loader)
        for batch in epoch:
            syncs.begin_step()
            yield sampler.rows.popleft(), batch
