"""Speed and memory of each method against SimCSE, measured in one session on the same model, data and batch.

    python bench.py --model_name_or_path ../shared/models/all-MiniLM-L6-v2 \\
        --train_file ../shared/data/wiki1m_head.txt --senteval_dir ../shared/data/senteval \\
        --methods simcse simcsepp sscl whitenedcse micse --method_args whitenedcse:--num_groups=192 \\
        --steps 20 --batch_size 32

Each method runs as a user runs it (`python <method>.py ... --max_steps N --no_test_eval`), one after another, and
its own results.json gives steps/s (training steps only: the timer stops around each dev gate) and peak memory
(CUDA: peak allocated; CPU: the process's peak RSS, model and evaluation included). Nothing is timed outside a
training step, so the method files' loops are measured exactly as they train. Then the STS test evaluation of
eval_sts.py (each distinct sentence once, length-sorted) is timed against a naive file-order evaluation.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import eval_sts

ROOT = Path(__file__).resolve().parent


def bench_method(name, args, extra, workdir) -> dict:
    out = Path(workdir) / name
    cmd = [sys.executable, str(ROOT / f"{name}.py"), "--model_name_or_path", args.model_name_or_path,
           "--train_file", args.train_file, "--batch_size", str(args.batch_size), "--max_steps", str(args.steps),
           "--eval_steps", str(args.steps), "--max_seq_length", str(args.max_seq_length), "--seed", str(args.seed),
           "--output_dir", str(out), "--no_test_eval", *extra,
           *(["--senteval_dir", args.senteval_dir] if args.senteval_dir else []),
           *(["--device", args.device] if args.device else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise eval_sts.UsageError(f"{name} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads((out / "results.json").read_text())


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


def main(argv=None):
    parser = eval_sts.Parser(description=__doc__, formatter_class=eval_sts.argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--train_file", required=True, help="sentences to draw the batches from")
    parser.add_argument("--senteval_dir", default=None, help="SentEval data (dev gate and evaluation timing)")
    parser.add_argument("--methods", nargs="+", default=["simcse"], help="method scripts; simcse is always included")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per method")
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
    eval_sts.check_range(args, "steps", lambda v: v >= 1, "a positive integer")
    device = eval_sts.resolve_device(args.device)
    extra = {}
    for item in args.method_args:
        name, flag = item.split(":", 1)
        extra.setdefault(name, []).extend(flag.split("=", 1))

    methods = ["simcse"] + [m for m in args.methods if m != "simcse"]
    with tempfile.TemporaryDirectory() as workdir:
        rows = {m: bench_method(m, args, extra.get(m, ()), workdir) for m in methods}
    base = rows["simcse"]
    print(f"\n{args.steps} steps, batch {args.batch_size}, {args.model_name_or_path}, {device}")
    print(f"{'method':<14}{'steps/s':>9}{'x simcse':>10}{base['peak_memory_kind'] + ' MiB':>24}{'x simcse':>10}")
    for m, r in rows.items():
        print(f"{m:<14}{r['steps_per_second']:>9.2f}{r['steps_per_second'] / base['steps_per_second']:>10.2f}"
              f"{r['peak_memory_mb']:>24.1f}{r['peak_memory_mb'] / base['peak_memory_mb']:>10.2f}")
    if not args.skip_eval:
        bench_eval(args, device)


if __name__ == "__main__":
    eval_sts.cli(main)
