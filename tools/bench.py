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
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's modules

import torch  # noqa: E402

import eval_sts  # noqa: E402
import plumbing  # noqa: E402
from plumbing import files, hub  # noqa: E402

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
           *(["--device", args.device] if args.device else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
    if proc.returncode != 0:
        raise plumbing.UsageError(f"{row} ({root}) failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    results = json.loads((out / "results.json").read_text())
    curve = {row["step"]: row["train_time_s"] for row in files.trajectory(results) if "train_time_s" in row}
    if log_warmup and args.warmup and args.warmup in curve:
        results["timed_steps_per_second"] = args.steps / (curve[total] - curve[args.warmup])
    else:
        results["timed_steps_per_second"] = results["steps_per_second"]
    return results


def bench_data(args) -> None:
    """A batch's data time: tokenising its sentences every step (the loader before this layout) against gathering
    and padding the pre-tokenised rows (data.TokenizedCorpus); the same token ids either way."""
    import data
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


def bench_saves(device, repeats: int = 3) -> dict:
    """What saving costs for a BERT-base-sized model (random weights from BertConfig()): the copy of the best model
    on the device (checkpoint.BestCopy.update, into buffers allocated once), best/ written from it, last/ written
    (the weights, AdamW's two moments, the schedule, the RNG streams: resume.save); each the median of `repeats`.
    Then SimCSE's recipe at STEP_S a step: the old policy (best/ at every improvement, last/ at every gate) and this
    one (a device copy at every improvement, best/ once, last/ after --save_minutes of training), both with every
    gate improving, the worst case; the GPU's copy is estimated (DEVICE_COPY_BYTES_PER_S), the writes are this
    machine's."""
    import statistics
    import transformers
    import common
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
        history = types.SimpleNamespace(losses=[], grad_norms=[], trajectory=[], resumptions=[], skipped=[])
        times = {"copy": [], "best": [], "last": []}
        best = checkpoint.BestCopy(backbone, head, tokenizer, "cls_before_pooler")  # its buffers, once
        for _ in range(repeats):
            start = time.perf_counter()
            best.update(backbone, head)
            times["copy"].append(time.perf_counter() - start)
            start = time.perf_counter()
            best.write(tmp)
            times["best"].append(time.perf_counter() - start)
            start = time.perf_counter()
            resume.save(args, 1, state, range(125), history, {"best_dev": 0.0, "best_step": 0, "train_time": 0.0})
            times["last"].append(time.perf_counter() - start)
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
    return {"seconds": median, "bytes": sizes, "weights_bytes": weights, "old_s": old, "new_s": new,
            "train_s": train_s}


FLAG_SETTINGS = {"neither": [], "--gradient_checkpointing": ["--gradient_checkpointing"],
                 "--micro_batch_size B/4": ["--micro_batch_size", "{quarter}"],
                 "both": ["--gradient_checkpointing", "--micro_batch_size", "{quarter}"]}


def bench_flags(args) -> dict:
    """--gradient_checkpointing and --micro_batch_size against neither, on args.model_name_or_path at
    --batch_size: the step's peak above the training state (plumbing/memory.measured_step: the allocator's events
    of the step's model on real tensors) and the estimate's, then steps/s of simcse.py itself, the four settings
    run one after another twice (the machine's slower spells hit every setting)."""
    import shutil
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
    print(f"{'setting':<26}{'step peak MiB':>15}{'x neither':>11}{'estimated MiB':>15}{'steps/s':>9}"
          f"{'x neither':>11}")
    for name, row in found.items():
        rate, base_rate = sum(row["rates"]) / 2, sum(base["rates"]) / 2
        print(f"{name:<26}{row['measured'] / 2**20:>15.0f}{row['measured'] / base['measured']:>11.2f}"
              f"{row['estimated'] / 2**20:>15.0f}{rate:>9.3f}{rate / base_rate:>11.2f}")
    return found


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
    parser.add_argument("--flag_cost", action="store_true",
                        help="only measure --gradient_checkpointing and --micro_batch_size against neither "
                             "(bench_flags)")
    parser.add_argument("--save_cost", action="store_true",
                        help="only measure what saving a BERT-base-sized checkpoint costs (bench_saves)")
    parser.add_argument("--model_name_or_path", default=None, help="the model to train (required but with "
                                                                   "--save_cost)")
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
    if not (args.model_name_or_path and args.train_file):
        parser.error("--model_name_or_path and --train_file are required (but with --save_cost)")
    if args.flag_cost:
        for name in ("model_name_or_path", "train_file", "senteval_dir"):  # the runs' cwd is the suite
            if getattr(args, name) and Path(getattr(args, name)).exists():
                setattr(args, name, str(Path(getattr(args, name)).resolve()))
        bench_flags(args)
        return
    plumbing.check_range(args, "steps", lambda v: v >= 1, "a positive integer")
    plumbing.check_range(args, "warmup", lambda v: v >= 0, "a non-negative integer")
    if args.compare_with and not (Path(args.compare_with) / "simcse.py").is_file():
        raise plumbing.UsageError(f"--compare_with {args.compare_with}: no simcse.py there; "
                                  "give a checkout of this suite")
    device = plumbing.resolve_device(args.device)
    for name in ("model_name_or_path", "train_file", "senteval_dir", "supervised_file"):  # the runs' cwd is the suite
        path = getattr(args, name)
        if path and Path(path).exists():
            setattr(args, name, str(Path(path).resolve()))
    extra = {}
    for item in args.method_args:
        name, flag = item.split(":", 1)
        extra.setdefault(name, []).extend(flag.split("=", 1))

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
