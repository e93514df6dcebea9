"""All methods under one protocol: train each, then write RESULTS.md and results/dev_curves.png.

    python report.py run      # train every row of RUNS (and evaluate the initial model), then write
    python report.py write    # regenerate RESULTS.md and the plot from results/*.json only

Every run uses the same model, corpus, seed, batch, steps and evaluation schedule (PROTOCOL); each method's own
flags come after. The checkpoints go to runs/report/ (not committed); each run's results.json is copied to
results/<name>.json, which is what RESULTS.md and the plot are made from. The plot needs matplotlib
(`pip install matplotlib`); without it the plot is skipped with a message.
"""
from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SHARED = ROOT.parent / "shared"
RESULTS = ROOT / "results"
MODEL = "../shared/models/all-MiniLM-L6-v2"
PROTOCOL = ["--model_name_or_path", MODEL, "--train_file", "../shared/data/wiki1m_head.txt",
            "--senteval_dir", "../shared/data/senteval", "--seed", "42", "--batch_size", "32", "--lr", "3e-5",
            "--warmup_steps", "0", "--max_steps", "150", "--eval_steps", "50"]
# name, script, method flags, the paper's BERT-base 7-task average for that row (the paper's, not ours)
RUNS = [
    ("simcse", "simcse.py", [], 76.25, "SimCSE, Table 5"),
    ("simcsepp", "simcsepp.py", [], 78.05, "SimCSE++, Table 3"),
    ("simcsepp_off_dropout_only", "simcsepp.py", ["--dcl_weight", "0"], 77.13, "SimCSE++ Table 3, +Off-Info"),
    ("simcsepp_dcl_only", "simcsepp.py", ["--no_off_dropout", "--m", "1"], 77.40, "SimCSE++ Table 3, +DCL"),
    ("sscl", "sscl.py", [], 77.90, "SSCL, Table 2"),
    ("whitenedcse", "whitenedcse.py", ["--num_groups", "192"], 78.78, "WhitenedCSE, Table 1"),
    ("micse", "micse.py", [], 78.13, "miCSE, Table 2 (100%)"),
    ("micse_no_queue", "micse.py", ["--queue_size", "0"], 76.88, "miCSE Table 2, AMI+SimCSE (100%)"),
]
TASK_COLUMNS = ["STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness", "avg"]


def command(script, flags, out_dir):
    return [sys.executable, script, *PROTOCOL, *flags, "--output_dir", str(out_dir), "--overwrite_output_dir"]


def run_all():
    RESULTS.mkdir(exist_ok=True)
    initial = RESULTS / "initial.json"
    subprocess.run([sys.executable, "eval_sts.py", "--model_name_or_path", MODEL, "--pooler", "cls_before_pooler",
                    "--senteval_dir", "../shared/data/senteval", "--json", str(initial)], cwd=ROOT, check=True)
    for name, script, flags, _, _ in RUNS:
        out = ROOT / "runs" / "report" / name
        print(f"== {name}: {' '.join(command(script, flags, out)[1:])}", flush=True)
        start = time.perf_counter()
        subprocess.run(command(script, flags, out), cwd=ROOT, check=True)
        print(f"== {name} took {time.perf_counter() - start:.0f}s", flush=True)
        shutil.copy(out / "results.json", RESULTS / f"{name}.json")
    (RESULTS / "machine.json").write_text(json.dumps(machine(), indent=2))


def machine():
    import os
    import torch
    import transformers
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d")}


def plot(results):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping results/dev_curves.png (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in results.items():
        steps, scores = zip(*r["dev_curve"])
        ax.plot(steps, scores, marker="o", label=name)
    ax.set_xlabel("training step")
    ax.set_ylabel("STS-B dev Spearman x 100")
    ax.set_title("STS-B dev during training (all-MiniLM-L6-v2, wiki1m head, same protocol)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "dev_curves.png", dpi=120)
    print(f"wrote {RESULTS / 'dev_curves.png'}")


def write():
    results = {name: json.loads((RESULTS / f"{name}.json").read_text()) for name, *_ in RUNS
               if (RESULTS / f"{name}.json").exists()}
    if "simcse" not in results:
        raise SystemExit("error: results/simcse.json is missing; run `python report.py run` first")
    initial = json.loads((RESULTS / "initial.json").read_text())
    info = json.loads((RESULTS / "machine.json").read_text())
    base = results["simcse"]
    paper = {name: (value, source) for name, _, _, value, source in RUNS}
    scripts = {name: (script, flags) for name, script, flags, _, _ in RUNS}

    lines = ["# Results: every method under one protocol", "",
             "Generated by `python report.py run` (training + this page) or `python report.py write` (this page",
             "and the plot from `results/*.json`). Do not edit by hand.", "",
             f"Machine: {info['cpu']}, {info['cores']} cores, CPU only; Python {info['python']}, torch "
             f"{info['torch']}, transformers {info['transformers']}; run on {info['date']}.", "",
             "## Protocol", "",
             f"Every run: `{' '.join(PROTOCOL)}` plus the method's own flags below. Each run's best STS-B dev",
             "checkpoint (steps 0, 50, ..., the last) is evaluated on the 7 STS test tasks (Spearman x 100, \"all\").", "",
             "## STS test results (best STS-B dev checkpoint)", "",
             "| run | " + " | ".join(TASK_COLUMNS) + " | best dev (step) | paper's BERT-base avg |",
             "|---|" + "---|" * (len(TASK_COLUMNS) + 2)]
    lines.append("| initial checkpoint ([CLS]) | " + " | ".join(f"{initial[t]:.2f}" for t in TASK_COLUMNS)
                 + f" | {base['dev_curve'][0][1]:.2f} (0) | — |")
    for name, r in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{r['test'][t]:.2f}" for t in TASK_COLUMNS)
                     + f" | {r['best_dev_stsb']:.2f} ({r['best_step']}) | {paper[name][0]:.2f} ({paper[name][1]}) |")
    lines += ["", "The last column is the paper's number for BERT-base trained on the full million sentences, not "
              "ours: these runs start from all-MiniLM-L6-v2, a small encoder already trained for sentence "
              "embeddings on a billion pairs, and see at most a few thousand of 11,900 Wikipedia sentences, so "
              "neither the starting point nor the data can reproduce the BERT-base gains; the table checks that "
              "every method runs under one protocol and shows how each moves an already-tuned encoder.", "",
              "SSCL trains and evaluates with the average pooler, as its released scripts do (the others evaluate "
              "[CLS]); the initial checkpoint's STS-B dev figure with that pooler is 86.72, not 79.73, so compare "
              "SSCL's row with its own start.", "",
              "## Speed and memory (same runs)", "",
              "| run | steps/s | x simcse | peak memory MiB | x simcse |", "|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['steps_per_second']:.3f} | {r['steps_per_second'] / base['steps_per_second']:.2f}"
                     f" | {r['peak_memory_mb']:.0f} | {r['peak_memory_mb'] / base['peak_memory_mb']:.2f} |")
    lines += ["", f"Steps/s exclude the dev evaluations. Memory is the process's peak RSS on CPU "
              f"(`{base['peak_memory_kind']}`), model loading and evaluation included. The runs go one after "
              "another and are timed as they ran: on a machine that other work shared (as in the run on this "
              "page, where the first three shared the 2 cores with test and evaluation jobs), steps/s are not "
              "comparable across rows; `bench.py` measures speed ratios in one session.", "",
              "## Dev curves", "", "![STS-B dev Spearman against step](results/dev_curves.png)", "",
              "## Commands", "", "```bash",
              f"python eval_sts.py --model_name_or_path {MODEL} --pooler cls_before_pooler "
              "--senteval_dir ../shared/data/senteval --json results/initial.json"]
    for name in results:
        script, flags = scripts[name]
        lines.append(" ".join(["python", script, *PROTOCOL, *flags, "--output_dir", f"runs/report/{name}",
                               "--overwrite_output_dir"]))
    lines += ["```", ""]
    (ROOT / "RESULTS.md").write_text("\n".join(lines))
    print(f"wrote {ROOT / 'RESULTS.md'}")
    plot(results)


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in ("run", "write"):
        raise SystemExit("usage: python report.py run|write")
    if sys.argv[1] == "run":
        if not (SHARED / "models" / "all-MiniLM-L6-v2").is_dir():
            raise SystemExit("error: report.py needs ../shared (all-MiniLM-L6-v2, wiki1m_head.txt, senteval)")
        run_all()
    write()


if __name__ == "__main__":
    main()
