"""Speed and memory of each method against SimCSE, measured in one process on the same model, batch and sentences.

    python bench.py --model_name_or_path ../shared/models/all-MiniLM-L6-v2 \\
        --train_file ../shared/data/wiki1m_head.txt --senteval_dir ../shared/data/senteval \\
        --methods simcse simcsepp sscl whitenedcse micse --steps 20 --batch_size 32

For every method: `--steps` optimisation steps (after 2 warm-up steps) of the method's own `setup` and loss,
timed, with the same batches in the same order. Memory: on CUDA the peak allocated memory of those steps; on
CPU, where no allocator statistics exist, the bytes of the tensors autograd saves for backward in one step
(unique storages), which is what differs between methods. Then the STS test evaluation of eval_sts.py (each
distinct sentence once, length-sorted) is timed against a naive file-order evaluation (`--eval_tasks` narrows it).
"""
from __future__ import annotations

import importlib
import time

import torch

import common
import eval_sts


def method_args(module, cli_args, extra=()):
    argv = ["--model_name_or_path", cli_args.model_name_or_path, "--batch_size", str(cli_args.batch_size),
            "--seed", str(cli_args.seed), *extra]
    return module.parse_args(argv)


def saved_activation_bytes(fn):
    """Run fn() and count the bytes of the distinct storages autograd saves for backward."""
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def bench_method(name, cli_args, batches, device, extra=()):
    module = importlib.import_module(name)
    args = method_args(module, cli_args, extra)
    common.seed_everything(args.seed)
    _, backbone = common.load_pretrained(cli_args.model_name_or_path, getattr(module, "ATTN_IMPLEMENTATION", None))
    model, compute_loss = module.setup(args, backbone.to(device))
    model.to(device).train()
    optimizer, scheduler = common.make_optimizer(model, args, total_steps=len(batches) + 2)
    for batch in batches[:2]:  # warm-up
        common.train_step(model, compute_loss, batch, optimizer, scheduler, device)
    first = {**batches[0], **common.model_inputs(batches[0], device)}
    with common.autocast(device):
        _, activation = saved_activation_bytes(lambda: compute_loss(first))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for batch in batches[2:]:
        common.train_step(model, compute_loss, batch, optimizer, scheduler, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else activation
    return (len(batches) - 2) / elapsed, memory / 2**20


def bench_eval(cli_args, device):
    tokenizer, model = common.load_pretrained(cli_args.model_name_or_path)
    model.to(device).eval()
    encode = common.pooled_encode(model, tokenizer, "cls_before_pooler", device)
    senteval_dir = eval_sts.resolve_senteval_dir(cli_args.senteval_dir)
    times = {}
    for fast in (True, False):
        start = time.perf_counter()
        scores = eval_sts.evaluate(encode, senteval_dir, cli_args.eval_tasks, fast=fast)
        times[fast] = (time.perf_counter() - start, scores)
    (t_fast, s_fast), (t_naive, s_naive) = times[True], times[False]
    print(f"\neval_sts ({', '.join(cli_args.eval_tasks or eval_sts.TASKS)}): length-sorted unique "
          f"{t_fast:.1f}s, naive file order {t_naive:.1f}s, speed-up x{t_naive / t_fast:.2f}; "
          f"same scores to 0.01: {all(abs(s_fast[k] - s_naive[k]) <= 0.01 for k in s_fast)}")


def main(argv=None):
    parser = common.Parser(description=__doc__, formatter_class=common.argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--train_file", required=True, help="sentences to draw the batches from")
    parser.add_argument("--senteval_dir", default=None, help="SentEval data for the evaluation timing")
    parser.add_argument("--methods", nargs="+", default=["simcse"], help="method modules; simcse is always included")
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

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer, _ = common.load_pretrained(args.model_name_or_path)
    sentences = common.load_sentences(args.train_file)
    collate = common.Collator(tokenizer, args.max_seq_length)
    batches = [collate(sentences[i * args.batch_size:(i + 1) * args.batch_size]) for i in range(args.steps + 2)]
    extra = {}
    for item in args.method_args:
        name, flag = item.split(":", 1)
        extra.setdefault(name, []).extend(flag.split("=", 1))

    methods = ["simcse"] + [m for m in args.methods if m != "simcse"]
    rows = {m: bench_method(m, args, batches, device, extra.get(m, ())) for m in methods}
    memory_kind = "peak CUDA MiB" if device.type == "cuda" else "saved-activation MiB"
    base_sps, base_mem = rows["simcse"]
    print(f"\n{args.steps} steps, batch {args.batch_size}, {args.model_name_or_path}, {device}")
    print(f"{'method':<14}{'steps/s':>9}{'x simcse':>10}{memory_kind:>22}{'x simcse':>10}")
    for m, (sps, mem) in rows.items():
        print(f"{m:<14}{sps:>9.2f}{sps / base_sps:>10.2f}{mem:>22.1f}{mem / base_mem:>10.2f}")
    if not args.skip_eval:
        bench_eval(args, device)


if __name__ == "__main__":
    common.cli(main)
