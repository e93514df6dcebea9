"""Speed and memory of each method against SimCSE, measured in one session on the same model, data and batch.

    python tools/bench.py --model_name_or_path ../shared/models/all-MiniLM-L6-v2 \\
        --train_file ../shared/data/wiki1m_head.txt --senteval_dir ../shared/data/senteval \\
        --methods simcse simcsepp sscl whitenedcse micse --method_args whitenedcse:--num_groups=192 \\
        --steps 20 --batch_size 32 [--supervised_file ../shared/data/nli_snli_devtest.csv] [--compare_with DIR]

Each method runs as a user runs it (`python <method>.py ... --max_steps W+N --no_test_eval`), one after another,
and its own results.json gives steps/s, peak memory (CUDA: peak allocated and reserved; CPU: the process's
peak RSS, model and evaluation included) and the host-device syncs of a step: --count_host_syncs W-1 counts
warm-up steps 2..W (plumbing/syncs.py; the counting slows those steps, which are not timed), the table shows
the most a step made. Steps/s counts the N steps after W warm-up steps (--warmup; the first
steps of a GPU run pay for allocation, autotuning and compilation): the run logs at step W, where the losses are
read from the device, so its training-time curve has the time of the first W steps. Dev gates are not training
time. --supervised_file adds supervised SimCSE (`simcse.py --supervised`) on that NLI file. --compare_with DIR
runs every row a second time from another checkout of this suite (a git worktree of an older commit), in the same
session, and prints the ratio; its steps/s then include the warm-up on both sides, since an older checkout may not
log at step W. Then the STS test evaluation of eval_sts.py (each distinct sentence once, length-sorted) is timed
against a naive file-order evaluation.

    python tools/bench.py --compare_steps --size bert-base --train_file ../shared/data/wiki1m_head.txt \\
        --senteval_dir ../shared/data/senteval --batch_size 64 --max_seq_length 32 --steps 100 --warmup 10
    python tools/bench.py --recipe_minutes --size bert-large --train_file ../shared/data/wiki1m_head.txt \\
        --supervised_file ../shared/data/nli_snli_devtest.csv --senteval_dir ../shared/data/senteval \\
        --recipe_steps 80 --gate_every 20

--compare_steps times the same SimCSE step each way of --rows, on one device, model, batch and --max_seq_length, in
this process one after another: simcse.py as a user runs it (eager; --compile; --cuda_graph, CUDA only), a bare
eager step (the batch already on the device and padded to --max_seq_length, fused AdamW, SDPA, autocast as
--precision resolves, nothing recorded), that step captured in one torch.cuda.CUDAGraph
and replayed (AdamW capturable, the learning rate a device tensor; CUDA only), and sentence-transformers' trainer
with the same loss (MultipleNegativesRankingLoss at scale 20 = 1 / 0.05, [CLS] pooling; it needs accelerate). Each
row: steps/s over --steps steps after --warmup, examples/s, MFU (6 x parameters x the tokens of both views, over the
GPU's dense peak for the precision from PEAK_TFLOPS; blank where none is known) and simcse.py's steps/s over the
row's. --recipe_minutes gives each paper's recipe (--recipes: the six rows at their presets) in minutes on this
device: each runs --recipe_steps steps with a dev gate every --gate_every and its whole final evaluation, and the
recipe's steps, dev gates and final evaluation are priced from them (recipe_row says how). --size builds a BERT of that
size with random weights and the tokenizer of --model_name_or_path (default ../shared/models/all-MiniLM-L6-v2).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import io
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's modules

import torch  # noqa: E402
import transformers  # noqa: E402

import common  # noqa: E402
import data  # noqa: E402
import eval_sts  # noqa: E402
import plumbing  # noqa: E402
from plumbing import files, hub, options  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]  # the suite


def bench_method(row, args, extra, workdir, root=ROOT, log_warmup=True) -> dict:
    """Run one row (a method script, or "simcse-sup") from `root`; its results.json, with "timed_steps_per_second"."""
    script, train_file = ("simcse", args.supervised_file) if row == "simcse-sup" else (row, args.train_file)
    out = Path(workdir) / f"{row}-{'this' if root == ROOT else 'other'}"
    total = args.warmup + args.steps
    count = args.warmup >= 2 and root == ROOT and "--compile" not in extra  # the counter does not trace compiled
    cmd = [sys.executable, str(root / f"{script}.py"), "--model_name_or_path", args.model_name_or_path,
           "--train_file", train_file, "--batch_size", str(args.batch_size), "--max_steps", str(total),
           "--eval_steps", str(total), "--max_seq_length", str(args.max_seq_length), "--seed", str(args.seed),
           "--output_dir", str(out), "--no_test_eval", *(["--supervised"] if row == "simcse-sup" else []),
           *(["--logging_steps", str(args.warmup)] if log_warmup and args.warmup else []), *extra,
           *(["--count_host_syncs", str(args.warmup - 1)] if count else []),
           *(["--senteval_dir", args.senteval_dir] if args.senteval_dir else []),
           *(["--device", args.device] if args.device else []),
           *(["--precision", args.precision] if getattr(args, "precision", None) else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
    if proc.returncode != 0:
        raise plumbing.UsageError(f"{row} ({root}) failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    results = json.loads((out / "results.json").read_text())
    curve = training_curve(results)
    if log_warmup and args.warmup and args.warmup in curve:
        results["timed_steps_per_second"] = args.steps / (curve[total] - curve[args.warmup])
    else:
        results["timed_steps_per_second"] = results["steps_per_second"]
    return results


def bench_data(args) -> None:
    """A batch's data time: tokenising its sentences every step (the loader before this layout) against gathering
    and padding the pre-tokenised rows (data.TokenizedCorpus); the same token ids either way."""
    tokenizer = hub.load_pretrained(args.model_name_or_path)[0]
    corpora = [("sentences", args.train_file, False)] + ([("NLI triplets", args.supervised_file, True)]
                                                         if args.supervised_file else [])
    for label, path, triplets in corpora:
        examples = data.training_examples(types.SimpleNamespace(train_file=path, fraction=1.0, seed=args.seed),
                                          triplets=triplets)[0]
        start = time.perf_counter()
        corpus = data.TokenizedCorpus(examples, tokenizer, args.max_seq_length)
        setup = time.perf_counter() - start
        columns = [examples[c] for c in examples.column_names]
        batches = [rows for rows, _ in zip(data.BatchSampler(len(corpus), args.batch_size, args.seed), range(20))]
        start = time.perf_counter()
        for rows in batches:
            tokenizer([column[r] for column in columns for r in rows], padding=True, truncation=True,
                      max_length=args.max_seq_length, return_tensors="pt")
        each_step = (time.perf_counter() - start) / len(batches)
        start = time.perf_counter()
        for rows in batches:
            corpus.collate(rows)
        gathered = (time.perf_counter() - start) / len(batches)
        print(f"data, {label}, batch {args.batch_size} ({len(columns) * args.batch_size} sequences): tokenised every "
              f"step {each_step * 1e3:.1f} ms, pre-tokenised {gathered * 1e3:.2f} ms (x{each_step / gathered:.0f}); "
              f"tokenising all {len(corpus)} examples once: {setup:.1f} s (datasets' cache may hold it)")


def bench_eval(args, device):
    encode = eval_sts.load_encode(args.model_name_or_path, "cls_before_pooler", device)
    senteval_dir = eval_sts.resolve_senteval_dir(args.senteval_dir)
    times = {}
    for fast in (True, False):
        start = time.perf_counter()
        scores = eval_sts.evaluate(encode, senteval_dir, args.eval_tasks, fast=fast)
        times[fast] = (time.perf_counter() - start, scores)
    (t_fast, s_fast), (t_naive, s_naive) = times[True], times[False]
    print(f"\neval_sts ({', '.join(args.eval_tasks or eval_sts.TASKS)}): length-sorted unique "
          f"{t_fast:.1f}s, naive file order {t_naive:.1f}s, speed-up x{t_naive / t_fast:.2f}; "
          f"same scores to 0.01: {all(abs(s_fast[k] - s_naive[k]) <= 0.01 for k in s_fast)}")


# The recipes' dev gates (steps // eval_steps + 1, step 0 included) and an H100's SimCSE step (bf16, batch 64, 32
# tokens; #46's figure): what a checkpoint policy costs against the training time.
RECIPES = {"simcse (unsupervised)": 15_625 // 125 + 1, "simcse --supervised": 1_614 // 250 + 1,
           "simcsepp": 15_625 // 125 + 1, "sscl": 15_625 // 125 + 1, "whitenedcse": 15_625 // 125 + 1,
           "micse (100%)": 20_000 // 125 + 1, "micse --fraction 0.01": 7_850 // 500 + 1}
# a device-to-device copy reads and writes each byte: at 1 TB/s of HBM (an H100 has over 3), 2 bytes moved a byte
SIMCSE_STEPS, STEP_S, DEVICE_COPY_BYTES_PER_S = 15_625, 8.5e-3, 1e12 / 2


def bench_saves(device, repeats: int = 3) -> None:
    """What saving costs for a BERT-base-sized model (random weights from BertConfig()): the copy of the best model
    on the device (checkpoint.BestCopy.update, into buffers allocated once), best/ written from it, last/ written
    (the weights, AdamW's two moments, the schedule, the RNG streams: resume.save); each the median of `repeats`.
    Then SimCSE's recipe at STEP_S a step: the old policy (best/ at every improvement, last/ at every gate) and this
    one (a device copy at every improvement, best/ once, last/ after --save_minutes of training), both with every
    gate improving, the worst case; the GPU's copy is estimated (DEVICE_COPY_BYTES_PER_S), the writes are this
    machine's."""
    from plumbing import checkpoint, resume
    config = transformers.BertConfig()
    torch.manual_seed(0)
    backbone = transformers.BertModel(config).to(device)
    head = common.MLPHead(config).to(device)
    params = [p for p in (*backbone.parameters(), *head.parameters())]
    optimizer, scheduler = common.make_optimizer(params, types.SimpleNamespace(lr=3e-5, warmup_steps=0), 100)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW's two moments exist
    with tempfile.TemporaryDirectory() as tmp:
        vocab = Path(tmp) / "vocab.txt"
        vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a"]) + "\n")
        tokenizer = transformers.BertTokenizerFast(vocab_file=str(vocab))
        args = types.SimpleNamespace(output_dir=tmp)
        state = {"backbone": backbone, "head": head, "optimizer": optimizer, "scheduler": scheduler}
        history = types.SimpleNamespace(losses=[], grad_norms=[], terms={}, trajectory=[], resumptions=[], skipped=[])
        times = {"copy": [], "best": [], "last": []}
        best = checkpoint.BestCopy(backbone, head, tokenizer, "cls_before_pooler")  # its buffers, once
        for _ in range(repeats):
            for name, save in (("copy", lambda: best.update(backbone, head)), ("best", lambda: best.write(tmp)),
                               ("last", lambda: resume.save(args, 1, state, range(125), history,
                                                            {"best_dev": 0.0, "best_step": 0, "train_time": 0.0}))):
                start = time.perf_counter()
                save()
                times[name].append(time.perf_counter() - start)
        sizes = {name: sum(f.stat().st_size for f in (Path(tmp) / name).rglob("*") if f.is_file())
                 for name in ("best", "last")}
    median = {k: statistics.median(v) for k, v in times.items()}
    weights = sum(t.numel() * t.element_size() for t in backbone.state_dict().values())
    gates, train_s = RECIPES["simcse (unsupervised)"], SIMCSE_STEPS * STEP_S
    old = gates * (median["best"] + median["last"])
    new = gates * weights / DEVICE_COPY_BYTES_PER_S + median["best"]
    print(f"saves, BERT-base-sized ({weights / 2**20:.0f} MiB of weights), {device}: device copy "
          f"{median['copy']:.2f} s, best/ ({sizes['best'] / 2**30:.2f} GiB) {median['best']:.2f} s, last/ "
          f"({sizes['last'] / 2**30:.2f} GiB) {median['last']:.2f} s (medians of {repeats})")
    print("dev gates (each a possible best/ copy): " + ", ".join(f"{k} {v}" for k, v in RECIPES.items()))
    print(f"SimCSE's recipe, {SIMCSE_STEPS} steps at {STEP_S * 1e3:.1f} ms = {train_s:.0f} s of training, every gate "
          f"improving: best/ and last/ at every gate {old:.0f} s ({100 * old / train_s:.0f}%); a device copy at each "
          f"gate ({2 * DEVICE_COPY_BYTES_PER_S / 1e12:.0f} TB/s) and best/ once {new:.2f} s "
          f"({100 * new / train_s:.1f}%), no last/ within 10 minutes of training")


FLAG_SETTINGS = {"neither": [], "--gradient_checkpointing": ["--gradient_checkpointing"],
                 "--micro_batch_size B/4": ["--micro_batch_size", "{quarter}"],
                 "both": ["--gradient_checkpointing", "--micro_batch_size", "{quarter}"]}


def bench_flags(args) -> None:
    """--gradient_checkpointing and --micro_batch_size against neither, on args.model_name_or_path at
    --batch_size: the step's peak above the training state (plumbing/memory.measured_step: the allocator's events
    of the step's model on real tensors) and the estimate's, then steps/s of simcse.py itself, the four settings
    run one after another twice (the machine's slower spells hit every setting)."""
    import simcse
    from plumbing import memory
    config = hub.local_config(args.model_name_or_path)
    quarter = str(max(args.batch_size // 4, 1))
    flags = {name: [f.format(quarter=quarter) for f in value] for name, value in FLAG_SETTINGS.items()}
    found = {}
    for name, extra in flags.items():
        method = simcse.parse_args(["--model_name_or_path", args.model_name_or_path, "--batch_size",
                                    str(args.batch_size), "--max_seq_length", str(args.max_seq_length),
                                    "--precision", "fp32", *extra])
        estimate = memory.estimate(method, config, evaluations=False)
        found[name] = {"measured": memory.measured_step(method, config),  # above the step's starting state
                       "estimated": estimate["activations"] + estimate["gradients"], "rates": []}
    with tempfile.TemporaryDirectory() as workdir:
        for _ in range(2):
            for name, extra in flags.items():
                found[name]["rates"].append(bench_method("simcse", args, extra, workdir)["timed_steps_per_second"])
                for p in Path(workdir).iterdir():  # the next run's folder
                    shutil.rmtree(p)
    base = found["neither"]
    print(f"\nflags, {args.model_name_or_path}, batch {args.batch_size} x {args.max_seq_length} tokens, fp32, "
          f"{plumbing.resolve_device(args.device)}")
    print(f"{'setting':<26}{'step peak MiB':>15}{'x neither':>11}{'estimated MiB':>15}{'steps/s':>9}{'x neither':>11}")
    for name, row in found.items():
        rate, base_rate = sum(row["rates"]) / 2, sum(base["rates"]) / 2
        print(f"{name:<26}{row['measured'] / 2**20:>15.0f}{row['measured'] / base['measured']:>11.2f}"
              f"{row['estimated'] / 2**20:>15.0f}{rate:>9.3f}{rate / base_rate:>11.2f}")


# ------------------------------------------------------------------------ the same step, six ways (--compare_steps)
TOKENIZER = ROOT.parent / "shared" / "models" / "all-MiniLM-L6-v2"  # bert-base-uncased's WordPiece vocabulary
SIZES = ("bert-base", "bert-large")  # tools/memory.py's configs: bert-base-uncased's shape, and BERT-large's
# Dense (no sparsity) tensor-core peaks in TFLOP/s from NVIDIA's datasheets, SXM parts but the H100 PCIe: MFU's
# denominator. An "NVL" part, another GPU or a CPU: no MFU.
PEAK_TFLOPS = (("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7}),
               ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0}),
               ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7}),
               ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0}))
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}  # autocast's dtype; fp32: no autocast
LR, TEMP = 3e-5, 0.05  # unsupervised SimCSE's (Table A.1), which every row of the comparison trains with


def peak_flops(device, precision: str) -> float | None:
    """The device's dense peak for the matmuls of `precision` (fp32 runs them in TF32 only where torch allows it)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    kind = "tf32" if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32 else precision
    peaks = next((peaks for part, peaks in PEAK_TFLOPS if part in name and "NVL" not in name), {})
    return peaks[kind] * 1e12 if kind in peaks else None


def encoder_folder(args, workdir) -> str:
    """The model both modes train: --model_name_or_path as it is, or with --size a BERT of that size with random
    weights (torch.manual_seed(0); tools/memory.py's config of it, the vocabulary the tokenizer's), saved with the
    tokenizer of --model_name_or_path (default ../shared/models/all-MiniLM-L6-v2: bert-base-uncased's WordPiece)."""
    source = args.model_name_or_path or str(TOKENIZER)
    if not args.size:
        return source
    import memory
    if not Path(source).is_dir():
        raise plumbing.UsageError(f"--size {args.size} takes the tokenizer of --model_name_or_path {source}: no "
                                  "such folder; give a local model folder")
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    config = memory.config_of(args.size)
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    folder = Path(workdir) / f"{args.size}-random"
    transformers.BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


class LineClock(io.TextIOBase):
    """A run's stdout, kept, with the time at which each of its progress lines ("step k/N ...": plumbing/run.py's
    progress_line, written after that step's log, dev gate included) came."""

    def __init__(self):
        super().__init__()
        self.times, self.lines = {}, []

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        now = time.perf_counter()
        for line in text.splitlines():
            match = re.match(r"step (\d+)/\d+", line)
            if match:
                self.times[int(match.group(1))] = now
            self.lines.append(line)
        return len(text)


def run_in_process(script: str, argv: list[str]) -> tuple[dict, LineClock, float]:
    """A method file's main(argv) in this process, as `python <script>.py ...` runs it (the imports and the GPU's
    context once for every row): its results.json, its stdout's LineClock, and when main() returned."""
    module = importlib.import_module(script)
    clock = LineClock()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with contextlib.redirect_stdout(clock):
            module.main(argv)
    except plumbing.UsageError as err:
        raise plumbing.UsageError(f"{script}.py: {err}") from None
    except BaseException:  # a traceback, or a signal's exit: what the run printed last, for its diagnosis
        print("\n".join([f"{script}.py printed, last:", *clock.lines[-15:]]), file=sys.stderr)
        raise
    finally:  # a run's stop handlers end with it
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    ended = time.perf_counter()
    results = json.loads((Path(argv[argv.index("--output_dir") + 1]) / "results.json").read_text())
    return results, clock, ended


def training_curve(results: dict) -> dict:
    """{step: training time so far}, at the run's log rows (dev gates and logs are not training time)."""
    return {row["step"]: row["train_time_s"] for row in files.trajectory(results) if "train_time_s" in row}


def run_flags(args, model: str, out, train_file: str) -> list[str]:
    """What every run of the two modes shares: the model, the data, the seed, the precision, where it runs."""
    return ["--model_name_or_path", model, "--train_file", train_file, "--seed", str(args.seed), "--precision",
            args.precision, "--output_dir", str(out), *(["--senteval_dir", args.senteval_dir] if args.senteval_dir
                                                        else []), *(["--device", args.device] if args.device else [])]


def suite_step(args, model: str, workdir, flags=()) -> float:
    """simcse.py's steps/s (with `flags`) over --steps steps after --warmup, from its own training-time curve."""
    total = args.warmup + args.steps
    out = Path(workdir) / f"simcse{''.join(flags)}"
    results = run_in_process("simcse", [*run_flags(args, model, out, args.train_file), "--batch_size",
                                        str(args.batch_size), "--max_seq_length", str(args.max_seq_length),
                                        "--max_steps", str(total), "--eval_steps", str(total), "--logging_steps",
                                        str(args.warmup), "--no_test_eval", "--no_align_uniform", *flags])[0]
    shutil.rmtree(out)
    if flags:  # --compile: dynamo's caches hold the compiled model; the next rows do not need them
        torch._dynamo.reset()
    curve = training_curve(results)
    return args.steps / (curve[total] - curve[args.warmup])


def device_batches(args, model: str, device, count: int = 8) -> list[dict]:
    """The suite's first `count` batches (data.TokenizedCorpus of --train_file, data.BatchSampler with --seed) padded
    to --max_seq_length, the static shape a CUDA graph needs, and on the device: the bare steps' data."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    examples = data.training_examples(types.SimpleNamespace(train_file=args.train_file, fraction=1.0,
                                                            seed=args.seed))[0]
    corpus = data.TokenizedCorpus(examples, tokenizer, args.max_seq_length)
    if len(corpus) < args.batch_size:
        raise plumbing.UsageError(f"--train_file {args.train_file}: {len(corpus)} sentences, fewer than "
                                  f"--batch_size {args.batch_size}")
    batches = []
    for rows, _ in zip(data.BatchSampler(len(corpus), args.batch_size, args.seed), range(count)):
        batch = corpus.collate(rows)
        pad = args.max_seq_length - batch["input_ids"].shape[1]
        batches.append({k: torch.nn.functional.pad(v, (0, pad), value=corpus.pad_id if k == "input_ids" else 0)
                        .to(device) for k, v in batch.items()})
    return batches


def bare_model(model: str, device, seed: int):
    """The encoder with SDPA and SimCSE's MLP head, BERT's pooler frozen as the suite freezes it (it is in no loss):
    (backbone, head, the trained parameters)."""
    backbone = hub.load_pretrained(model, attn_implementation="sdpa")[1].to(device).train()
    if getattr(backbone, "pooler", None) is not None:
        backbone.pooler.requires_grad_(False)
    torch.manual_seed(seed)
    head = common.MLPHead(backbone.config).to(device)
    return backbone, head, [p for m in (backbone, head) for p in m.parameters() if p.requires_grad]


def bare_loss(backbone, head, batch: dict, precision: str, cache: bool = True):
    """SimCSE's loss on one batch and nothing else: both dropout views in one pass with the prebuilt 4-D mask (no
    host check of the mask), the encoder under autocast, [CLS] through the head and InfoNCE (tau 0.05) in fp32.
    `cache`: autocast's cache of each weight's cast, which a CUDA graph's capture cannot keep."""
    import simcse
    views = {k: v.repeat(2, 1) for k, v in batch.items()}
    mask = common.attention_mask_4d(views.pop("attention_mask"), "sdpa")
    device_type = batch["input_ids"].device.type
    with torch.autocast(device_type, dtype=HALF.get(precision), enabled=precision in HALF, cache_enabled=cache):
        hidden = backbone(attention_mask=mask, **views).last_hidden_state
    z1, z2 = head(hidden[:, 0].float()).chunk(2)
    return simcse.info_nce(z1, z2, TEMP)


def timed(step, args, device) -> float:
    """steps/s of step(i) for i in --warmup .. --warmup + --steps, after the --warmup untimed ones; the device's
    queue is drained at both ends of the timed steps only."""
    for i in range(args.warmup):
        step(i)
    _sync(device)
    start = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        step(i)
    _sync(device)
    return args.steps / (time.perf_counter() - start)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_step(args, model: str, batches: list, device, precision: str, graphed: bool = False) -> float | str:
    """The step without the suite: the batch already on the device, fused AdamW and the linear schedule, fp16's
    GradScaler, clipping at 1.0, nothing recorded. `graphed`: replayed from one CUDA graph by plumbing/graph.py's
    StepGraph, as --cuda_graph replays the suite's: its warm-up on a side stream, the capture (AdamW fused and
    capturable, the learning rate a device tensor the schedule writes between replays, autocast's cache off), each
    batch copied into the graph's buffers. fp16's GradScaler decides on the device too (fused AdamW skips the step
    where its found_inf says so)."""
    from plumbing import graph
    if graphed and device.type != "cuda":
        return "needs CUDA (a torch.cuda.CUDAGraph)"
    backbone, head, params = bare_model(model, device, args.seed)
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=True)
    schedule = transformers.get_linear_schedule_with_warmup(optimizer, 0, args.warmup + args.steps)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def train_step(batch):
        optimizer.zero_grad(set_to_none=True)
        loss = bare_loss(backbone, head, batch, precision, cache=not graphed)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(optimizer)
        scaler.update()
        return loss
    replayed = graph.StepGraph(train_step, optimizer, enabled=True) if graphed else train_step

    def step(i):
        replayed(batches[i % len(batches)])
        schedule.step()
    return timed(step, args, device)


def gate_floor(args) -> dict:
    """--gate_floor: the STS-B dev gate as a run runs it (plumbing/run.dev_measures: eval mode, fp32, the sentences
    tokenised once, l_align / l_uniform on the device, one host copy, the Spearman) against its floor, a bare fp32
    forward of the same tokenised sentences in the same batches through the same model (its prebuilt mask). Each
    timed --steps times after one untimed; the medians and their ratio (the target: 1.3)."""
    from plumbing import run
    device = plumbing.resolve_device(args.device)
    with tempfile.TemporaryDirectory() as workdir:
        model = encoder_folder(args, workdir)
        tokenizer, backbone = hub.load_pretrained(model)
        backbone.to(device).eval()
        encoder = common.Encoder(common.BackboneWithHeads(backbone), None, tokenizer, "cls_before_pooler", device)
        gate = eval_sts.DevGate(eval_sts.resolve_senteval_dir(args.senteval_dir), encoder)

        @torch.no_grad()
        def floor():
            backbone.eval()  # as the gate encodes (dev_measures leaves the model in training mode after it)
            for batch in gate.sentences.tokens:
                encoder.backbone(**batch)
        times = {}
        for name, measure in (("gate", lambda: run.dev_measures([backbone], encoder, gate)), ("floor", floor)):
            seconds = []
            for i in range(args.steps + 1):
                _sync(device)
                start = time.perf_counter()
                with contextlib.redirect_stderr(io.StringIO()):  # the gate's progress bar
                    measure()
                _sync(device)
                seconds.append(time.perf_counter() - start)
            times[name] = statistics.median(seconds[1:])
        precision = options.resolve_precision("fp32", device)
        print(f"the STS-B dev gate, {describe_setting(args, model, device, precision)}: {len(gate.sentences.index)} "
              f"sentences in {len(gate.sentences.tokens)} batches; the median of {args.steps} after one")
        print(f"\n| what | seconds |\n|---|---|\n| the dev gate (dev_measures) | {times['gate']:.3f} |\n"
              f"| its floor: the bare fp32 forward of the same batches | {times['floor']:.3f} |\n"
              f"| gate / floor | {times['gate'] / times['floor']:.2f} |")
    return times


def sentence_transformers_trainer(args, model: str, device, precision: str, workdir, contrastive=False) -> float | str:
    """sentence-transformers' own trainer on the same step: MultipleNegativesRankingLoss at scale 20 (1 / tau),
    [CLS] pooling, each sentence its own positive (dropout makes the views: two passes of the batch, the same
    tokens), the same batch, --max_seq_length, learning rate, clipping at 1.0 and precision; steps/s between the
    ends of step --warmup and of the last step (the device's queue drained at those two points only). `contrastive`:
    st_losses.SimCSELoss through ContrastiveTrainer instead (simcse.py's block: one pass of 2N rows, the MLP head)."""
    missing = [name for name in ("sentence_transformers", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        return f"not installed here: {', '.join(missing)} (pip install sentence-transformers accelerate)"
    try:
        import sentence_transformers as st
        import accelerate
        del accelerate  # the transformers Trainer's, imported here so that a broken install is this row's line
    except ImportError as err:
        return f"cannot be imported here: {str(err).splitlines()[0]}"
    try:  # sentence-transformers 5 and later; 3 and 4 call them models
        from sentence_transformers.sentence_transformer import losses, modules
    except ImportError:
        from sentence_transformers import losses, models as modules
    import datasets
    encoder = modules.Transformer(model, max_seq_length=args.max_seq_length)
    network = st.SentenceTransformer(modules=[encoder, modules.Pooling(hub.local_config(model).hidden_size,
                                                                        pooling_mode="cls")], device=str(device))
    total = args.warmup + args.steps
    sentences = list(data.training_examples(types.SimpleNamespace(train_file=args.train_file, fraction=1.0,
                                                                  seed=args.seed))[0]["text"])
    sentences = (sentences * -(-total * args.batch_size // len(sentences)))[:total * args.batch_size]
    marks = {}

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, training_args, state, control, **kwargs):
            if state.global_step in (args.warmup, total):
                _sync(device)
                marks[state.global_step] = time.perf_counter()
    training = st.SentenceTransformerTrainingArguments(
        output_dir=str(Path(workdir) / "sentence-transformers"), per_device_train_batch_size=args.batch_size,
        max_steps=total, learning_rate=LR, warmup_steps=0, max_grad_norm=1.0, bf16=precision == "bf16",
        fp16=precision == "fp16", save_strategy="no", report_to="none", logging_steps=total, seed=args.seed,
        use_cpu=device.type == "cpu", disable_tqdm=True, dataloader_drop_last=True)
    if contrastive:
        import st_losses
        with contextlib.redirect_stdout(io.StringIO()):  # its lines: the pooling and truncation it keeps
            loss = st_losses.SimCSELoss(network, TEMP, max_seq_length=args.max_seq_length)
        trainer = st_losses.ContrastiveTrainer(model=network, args=training, loss=loss, callbacks=[Clock()],
                                               train_dataset=datasets.Dataset.from_dict({"text": sentences}))
    else:
        trainer = st.SentenceTransformerTrainer(
            model=network, args=training, train_dataset=datasets.Dataset.from_dict({"anchor": sentences,
                                                                                    "positive": sentences}),
            loss=losses.MultipleNegativesRankingLoss(network, scale=1 / TEMP), callbacks=[Clock()])
    with contextlib.redirect_stdout(io.StringIO()):  # its log lines: this table has its figures
        trainer.train()
    return args.steps / (marks[total] - marks[args.warmup])


COMPARE_ROWS = {  # --rows: what each row of the comparison is
    "suite": "`simcse.py` (eager, the default)",
    "suite-compile": "`simcse.py --compile` (inductor's default mode)",
    "suite-graph": "`simcse.py --cuda_graph` (the step replayed from one CUDA graph)",
    "suite-graph-compile": "`simcse.py --cuda_graph --compile` (inductor's kernels captured in the graph)",
    "bare": "a bare eager step (the batch on the device, fused AdamW, SDPA, autocast)",
    "bare-graph": "the bare step in one `torch.cuda.CUDAGraph`, replayed (AdamW capturable, lr a tensor)",
    "sentence-transformers": "sentence-transformers' trainer (MultipleNegativesRankingLoss, scale 20, CLS)",
    "contrastive-trainer": "st_losses' `SimCSELoss` through `ContrastiveTrainer` (simcse.py's block)",
}


def encoder_parameters(model: str) -> int:
    """The parameters whose matrix products a step runs, forward and backward (MFU's 6 N a token): the encoder
    layers' linear weights (built on the meta device: no memory) and SimCSE's MLP head; not the embeddings (a
    lookup), nor the frozen pooler (no gradient), nor the attention's own products (under 1% at 32 tokens)."""
    config = hub.local_config(model)
    with torch.device("meta"):
        encoder = transformers.AutoModel.from_config(config)
    layers = [m for name, m in encoder.named_modules() if isinstance(m, torch.nn.Linear) and "pooler" not in name]
    return sum(m.weight.numel() for m in layers) + config.hidden_size * config.hidden_size


def describe_setting(args, model: str, device, precision: str) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    size = f"{args.size} with random weights" if args.size else model
    return (f"{device} ({name}), {size}, precision {precision}; torch {torch.__version__}, transformers "
            f"{transformers.__version__}")


def one_row(measure):
    """measure(), or where it fails, the row's one line saying how (its traceback on stderr): on a GPU lent for
    minutes, one row's failure does not cost the others."""
    try:
        return measure()
    except SystemExit as err:  # a script's own exit (its arguments refused); an interrupt's or a signal's ends the tool
        if err.code in (130, 143):
            raise
        return f"failed: the script exited with status {err.code}"
    except Exception as err:
        if not isinstance(err, plumbing.UsageError):
            traceback.print_exc()
        return f"failed: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}"
    finally:  # the row's model, optimizer and graph pool gone before the next row; its run's out-of-memory hook too
        plumbing.on_out_of_memory(None)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def compare_steps(args) -> dict:
    """--compare_steps, as the module's docstring says: {row: steps/s, or why it did not run}."""
    device = plumbing.resolve_device(args.device)
    precision = args.precision = options.resolve_precision(args.precision, device)
    found = {}
    with tempfile.TemporaryDirectory() as workdir:
        model = encoder_folder(args, workdir)
        batches = device_batches(args, model, device)
        runs = {"suite": lambda: suite_step(args, model, workdir),
                "suite-compile": lambda: suite_step(args, model, workdir, ["--compile"]),
                "suite-graph": lambda: suite_step(args, model, workdir, ["--cuda_graph"]) if device.type == "cuda"
                else "needs CUDA (simcse.py --cuda_graph)",
                "suite-graph-compile": lambda: suite_step(args, model, workdir, ["--cuda_graph", "--compile"])
                if device.type == "cuda" else "needs CUDA (simcse.py --cuda_graph)",
                "bare": lambda: bare_step(args, model, batches, device, precision),
                "bare-graph": lambda: bare_step(args, model, batches, device, precision, graphed=True),
                "sentence-transformers": lambda: sentence_transformers_trainer(args, model, device, precision,
                                                                                workdir),
                "contrastive-trainer": lambda: sentence_transformers_trainer(args, model, device, precision,
                                                                              workdir, contrastive=True)}
        for row in args.rows:
            found[row] = one_row(runs[row])
            print(f"measured {row}: {found[row]}", flush=True)  # what is done so far, should a limit stop the rest
        parameters = encoder_parameters(model)
    tokens = 2 * args.batch_size * args.max_seq_length  # two views
    flops, peak = 6 * parameters * tokens, peak_flops(device, precision)
    print(f"\nthe same SimCSE step, {describe_setting(args, model, device, precision)}; batch {args.batch_size} x "
          f"{args.max_seq_length} tokens, {args.steps} steps timed after {args.warmup}")
    mfu = f"MFU against {peak / 1e12:.1f} TFLOP/s ({precision}, dense, the datasheet's)" if peak else \
        f"no MFU: PEAK_TFLOPS has no {precision} peak for this device"
    print(f"FLOPs a step: 6 x {parameters / 1e6:.1f}M parameters x {tokens} tokens (two views, padded to "
          f"--max_seq_length; simcse.py and sentence-transformers pad a batch to its longest row) = "
          f"{flops / 1e12:.3f} TFLOP; {mfu}")
    print("\n| the same SimCSE step | steps/s | examples/s | MFU | simcse.py ÷ it |\n|---|---|---|---|---|")
    suite = found.get("suite")
    for row, rate in found.items():
        if isinstance(rate, str):
            print(f"| {COMPARE_ROWS[row]} | {rate} | | | |")
            continue
        mfu = f"{100 * rate * flops / peak:.1f}%" if peak else ""
        ratio = f"{suite / rate:.2f}" if isinstance(suite, float) else ""
        print(f"| {COMPARE_ROWS[row]} | {rate:.2f} | {rate * args.batch_size:.0f} | {mfu} | {ratio} |")
    return found


# ----------------------------------------------------------------------------- each paper's recipe (--recipe_minutes)
WIKI1M, NLI = 1_000_000, 275_601  # wiki1m_for_simcse.txt's sentences, nli_for_simcse.csv's triplets
# the paper protocol's six rows, by tools/memory.py's names (its RECIPES: the method file and flags), miCSE at 1%
RECIPE_NAMES = ("simcse", "simcse-sup", "simcsepp", "sscl", "whitenedcse", "micse-fewshot")


def recipe_schedule(script: str, flags: list, model: str, extra: list) -> tuple[int, int, int]:
    """(batch, steps, eval_steps) of a whole recipe: the method's presets for these flags and model, on the papers'
    data (wiki1m's sentences or --fraction of them, NLI's triplets with --supervised), each epoch's last short batch
    kept as data.BatchSampler keeps it."""
    recipe = importlib.import_module(script).parse_args(["--model_name_or_path", model, *flags, *extra])
    examples = NLI if getattr(recipe, "supervised", False) else round(recipe.fraction * WIKI1M)
    with contextlib.redirect_stdout(io.StringIO()):  # its note on a short last batch is for a run
        sampler = data.BatchSampler(examples, recipe.batch_size, 0)
    steps = recipe.max_steps or recipe.epochs * len(sampler)
    return recipe.batch_size, steps, recipe.eval_steps


def recipe_row(name: str, args, model: str, workdir, extra: dict) -> dict | str:
    """One recipe run for --recipe_steps steps with a dev gate every --gate_every and its whole final evaluation:
    the step's time after the first gate (training-time curve), a gate's (the wall time between the progress lines
    of gate 0 and the last, less the training time between them, over the gates), the final evaluation's (from the
    last gate's line to main()'s return); and the whole recipe's minutes from them."""
    import memory
    script, flags = memory.RECIPES[name]
    train_file = args.supervised_file if "--supervised" in flags else args.train_file
    if not train_file:
        return "needs --supervised_file (NLI triplets)"
    n, m = args.recipe_steps, args.gate_every
    batch, steps, eval_steps = recipe_schedule(script, flags, model, extra.get(script, []))
    out = Path(workdir) / name
    results, clock, ended = run_in_process(script, [*run_flags(args, model, out, train_file), *flags, "--max_steps",
                                                    str(n), "--eval_steps", str(m), *extra.get(script, [])])
    shutil.rmtree(out)  # its best/: BERT-large's is 1.3 GB
    curve, gates = training_curve(results), [row["step"] for row in results["trajectory"] if row.get("gate")]
    step_s = (curve[n] - curve[m]) / (n - m)
    gate_s = (clock.times[n] - clock.times[0] - curve[n]) / (len(gates) - 1)
    final_s = ended - clock.times[n]
    recipe_gates = steps // eval_steps + 1 + (steps % eval_steps > 0)  # step 0, every eval_steps, the last
    minutes = {"steps": (curve[m] + (steps - m) * step_s) / 60, "gates": recipe_gates * gate_s / 60,
               "final evaluation": final_s / 60}
    return {"batch": batch, "steps": steps, "gates": recipe_gates, "step_s": step_s, "gate_s": gate_s,
            "final_s": final_s, "minutes": minutes, "precision": results["precision"]}


def recipe_minutes(args, extra: dict) -> dict:
    """--recipe_minutes: each of --recipes as `python <method>.py` runs it (its presets), on one device and model,
    one after another in this process, a row printed as each is measured. {recipe: its figures, or why not}."""
    device = plumbing.resolve_device(args.device)
    found = {}
    with tempfile.TemporaryDirectory() as workdir:
        model = encoder_folder(args, workdir)
        precision = options.resolve_precision(args.precision, device)
        print(f"each paper's recipe in minutes, {describe_setting(args, model, device, precision)}: "
              f"{args.recipe_steps} steps run with a dev gate every {args.gate_every} and the whole final evaluation; "
              f"steps = the first {args.gate_every} steps as run + the recipe's other steps at the step time "
              "measured after them; gates = the recipe's dev gates (step 0 and the last included) x a gate's mean "
              "time; the final evaluation once (best/ written and reloaded, the 7 STS test tasks, "
              "alignment/uniformity)")
        print("\n| recipe | batch | steps | gates | step ms | gate s | final s | steps min | gates min | final min "
              "| total min |\n|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
        for name in args.recipes:
            row = found[name] = one_row(lambda: recipe_row(name, args, model, workdir, extra))
            if isinstance(row, str):
                print(f"| {name} | {row} | | | | | | | | | |", flush=True)
                continue
            parts = row["minutes"]
            print(f"| {name} | {row['batch']} | {row['steps']:,} | {row['gates']} | {1e3 * row['step_s']:.1f} | "
                  f"{row['gate_s']:.2f} | {row['final_s']:.1f} | {parts['steps']:.1f} | {parts['gates']:.1f} | "
                  f"{parts['final evaluation']:.1f} | {sum(parts.values()):.1f} |", flush=True)
    return found


def method_args(items) -> dict:
    """--method_args' method:flag=value items: {method: [flag, value, ...]}."""
    extra = {}
    for item in items:
        name, flag = item.split(":", 1)
        extra.setdefault(name, []).extend(flag.split("=", 1))
    return extra


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--memory" in argv:  # the GPU memory of each paper recipe, estimated: tools/memory.py, its flags
        import memory
        return memory.main([a for a in argv if a != "--memory"])
    parser = plumbing.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory", action="store_true",
                        help="estimate the GPU memory of each paper recipe instead (tools/memory.py: its own flags, "
                             "and the method's, e.g. --fraction, --precision, --batch_size, --gradient_checkpointing, "
                             "--micro_batch_size, which each row takes as a run would)")
    parser.add_argument("--flag_cost", action="store_true", help="only measure --gradient_checkpointing and "
                        "--micro_batch_size against neither (bench_flags)")
    parser.add_argument("--save_cost", action="store_true",
                        help="only measure what saving a BERT-base-sized checkpoint costs (bench_saves)")
    parser.add_argument("--compare_steps", action="store_true",
                        help="time the same SimCSE step each way of --rows instead: simcse.py eager and --compile, "
                             "a bare eager step, the bare step in a CUDA graph, sentence-transformers' trainer")
    parser.add_argument("--gate_floor", action="store_true",
                        help="time the STS-B dev gate against a bare fp32 forward of the same batches")
    parser.add_argument("--recipe_minutes", action="store_true",
                        help="give each of --recipes in minutes on this device instead, from --recipe_steps steps "
                             "with a dev gate every --gate_every and the whole final evaluation")
    parser.add_argument("--size", default=None, choices=SIZES,
                        help="--compare_steps, --recipe_minutes: a BERT of this size with random weights "
                             "(bert-base-uncased's config shape) and the tokenizer of --model_name_or_path "
                             "(default ../shared/models/all-MiniLM-L6-v2); without it, --model_name_or_path itself")
    parser.add_argument("--rows", nargs="+", default=list(COMPARE_ROWS), choices=list(COMPARE_ROWS),
                        help="--compare_steps: the ways to time (default: all)")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPE_NAMES), choices=list(RECIPE_NAMES),
                        help="--recipe_minutes: the recipes, each with its presets (default: the six)")
    parser.add_argument("--recipe_steps", type=int, default=100, help="--recipe_minutes: steps run of each recipe")
    parser.add_argument("--gate_every", type=int, default=25, help="--recipe_minutes: a dev gate every this many steps "
                        "of them (the step time is measured after the first)")
    parser.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                        help="each run's --precision (auto: bf16 on a GPU that has it, fp16 on an older one, fp32 "
                             "on CPU); the bare steps' autocast follows it")
    parser.add_argument("--model_name_or_path", help="the model to train (required but with --save_cost and --size)")
    parser.add_argument("--train_file", default=None, help="sentences to draw the batches from")
    parser.add_argument("--senteval_dir", default=None, help="SentEval data (dev gate and evaluation timing)")
    parser.add_argument("--methods", nargs="+", default=["simcse"], help="method scripts; simcse is always included")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per method")
    parser.add_argument("--warmup", type=int, default=3,
                        help="steps run before the timed ones (not timed; steps 2..W count the host syncs)")
    parser.add_argument("--supervised_file", default=None, help="NLI csv: also time simcse.py --supervised on it")
    parser.add_argument("--compare_with", default=None, help="another checkout of this suite to time the same rows")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--max_seq_length", type=int, default=32)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--device", default=None)
    parser.add_argument("--method_args", nargs="*", default=[],
                        help="extra flags as method:flag=value, e.g. whitenedcse:--num_groups=192")
    parser.add_argument("--eval_tasks", nargs="*", default=None, choices=eval_sts.TASKS,
                        help="tasks for the evaluation timing (default: all 7)")
    parser.add_argument("--skip_eval", action="store_true", help="time training only")
    args = parser.parse_args(argv)
    if args.save_cost:
        bench_saves(plumbing.resolve_device(args.device))
        return
    if args.gate_floor:
        if not ((args.model_name_or_path or args.size) and args.senteval_dir):
            parser.error("--gate_floor: give --model_name_or_path (or --size) and --senteval_dir")
        plumbing.check_range(args, "steps", lambda v: v >= 1, "a positive integer")
        return gate_floor(args)
    if not ((args.model_name_or_path or args.size) and args.train_file):
        parser.error("--model_name_or_path (or --size) and --train_file are required (but with --save_cost)")
    if args.compare_steps or args.recipe_minutes:
        plumbing.check_range(args, "steps", lambda v: v >= 1, "a positive integer")
        plumbing.check_range(args, "warmup", lambda v: v >= 1, "at least 1 (the timed steps start after it)")
        plumbing.check_range(args, "gate_every", lambda v: v >= 1, "a positive integer")
        plumbing.check_range(args, "recipe_steps", lambda v: v > args.gate_every,
                             f"more than --gate_every {args.gate_every} (the step time is measured after the first "
                             "gate)")
        if args.size and args.model_name_or_path is None and not TOKENIZER.is_dir():
            raise plumbing.UsageError(f"--size {args.size}: no tokenizer at {TOKENIZER}; give --model_name_or_path "
                                      "a local folder with one")
        return compare_steps(args) if args.compare_steps else recipe_minutes(args, method_args(args.method_args))
    for name in ("model_name_or_path", "train_file", "senteval_dir", "supervised_file"):  # the runs' cwd is the suite
        path = getattr(args, name)
        if path and Path(path).exists():
            setattr(args, name, str(Path(path).resolve()))
    if args.flag_cost:
        bench_flags(args)
        return
    plumbing.check_range(args, "steps", lambda v: v >= 1, "a positive integer")
    plumbing.check_range(args, "warmup", lambda v: v >= 0, "a non-negative integer")
    if args.compare_with and not (Path(args.compare_with) / "simcse.py").is_file():
        raise plumbing.UsageError(f"--compare_with {args.compare_with}: no simcse.py there; "
                                  "give a checkout of this suite")
    device = plumbing.resolve_device(args.device)
    extra = method_args(args.method_args)

    rows = ["simcse"] + [m for m in args.methods if m != "simcse"] + (["simcse-sup"] if args.supervised_file else [])
    compare = Path(args.compare_with).resolve() if args.compare_with else None
    new, old = {}, {}
    with tempfile.TemporaryDirectory() as workdir:
        for r in rows:  # the two checkouts alternate, so that a slower spell of the machine hits both
            new[r] = bench_method(r, args, extra.get(r, ()), workdir, log_warmup=compare is None)
            if compare:
                old[r] = bench_method(r, args, extra.get(r, ()), workdir, compare, log_warmup=False)
    base, cuda = new["simcse"], new["simcse"]["peak_memory_kind"] == "cuda_max_allocated"
    timed = f"{args.steps} steps after {args.warmup} warm-up" if compare is None else \
        f"{args.warmup + args.steps} steps"
    print(f"\n{timed}, batch {args.batch_size}, {args.model_name_or_path}, {device}, "
          f"precision {base.get('precision', '?')}")
    print(f"{'method':<14}{'steps/s':>9}{'x simcse':>10}{'syncs/step':>12}"
          f"{base['peak_memory_kind'] + ' MiB':>24}{'x simcse':>10}"
          + (f"{'reserved MiB':>14}" if cuda else "") + (f"{'old steps/s':>13}{'new/old':>9}" if compare else ""))
    for r, res in new.items():
        counted = res.get("host_syncs")
        line = (f"{r:<14}{res['timed_steps_per_second']:>9.2f}"
                f"{res['timed_steps_per_second'] / base['timed_steps_per_second']:>10.2f}"
                f"{max(counted['per_step']) if counted else '-':>12}"
                f"{res['peak_memory_mb']:>24.1f}{res['peak_memory_mb'] / base['peak_memory_mb']:>10.2f}")
        line += f"{res['peak_memory_reserved_mb']:>14.1f}" if cuda else ""
        if compare:
            before = old[r]["timed_steps_per_second"]
            line += f"{before:>13.2f}{res['timed_steps_per_second'] / before:>9.2f}"
        print(line)
    bench_data(args)
    if not args.skip_eval:
        bench_eval(args, device)


if __name__ == "__main__":
    plumbing.cli(main)
