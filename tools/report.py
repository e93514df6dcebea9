"""All methods under one protocol, over several seeds: train each, then write the page and the plots.

    python tools/report.py run --protocol paper [--gpus 0,1,2,3]   # a paper's protocol (protocols.py): paper, fewshot,
    python tools/report.py commands --protocol fewshot             # sweep or a JSON file; `commands` prints its runs
    python tools/report.py write --protocol paper                  # results/<protocol>/RESULTS.md from what exists

The default protocol, `smoke`, is this suite's own CPU comparison (RESULTS.md):

    python tools/report.py run                      # every row of RUNS and FEW_SHOT with seeds 42 43 44, then the page
    python tools/report.py run --seeds 42 43 --only simcse micse   # a part of it
    python tools/report.py run --no_transfer        # STS, dev curves and alignment/uniformity only (much cheaper)
    python tools/report.py write                    # RESULTS.md, results/dev_curves.png and results/align_uniform.png
                                                    # from results/*.json alone

Every run uses the same model, corpus, batch, steps and evaluation schedule (PROTOCOL) with its seed; each method's
own flags come after. Resumable: a run whose results/<name>.seed<S>.json exists is not trained again, and a run
whose JSON has no "transfer" yet only gets its transfer evaluation, so `report.py run` can be stopped and started
again and completes in pieces. Checkpoints go to runs/report/<row>.seed<S>/ (a protocol's: runs/<protocol>/; neither
committed); each run's results.json is copied to results/ (results/<protocol>/) with the run's wall and CPU time
under "report". The transfer tasks run with `eval_transfer.py --mode fasttest` on each best checkpoint
(TRANSFER_MODE). The plots need matplotlib (in requirements.txt); without it they are skipped with a message.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's modules

import plumbing  # noqa: E402
from plumbing import files, progress, provenance  # noqa: E402
import cluster  # noqa: E402
import protocols  # noqa: E402
import tables  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]  # the suite
SHARED = ROOT.parent / "shared"
RESULTS = ROOT / "results"
MODEL = "../shared/models/all-MiniLM-L6-v2"
SENTEVAL = "../shared/data/senteval"
SEEDS = [42, 43, 44]
# the pretrained model under each pooler a row evaluates with (SSCL: avg), so every row has its own start
INITIAL = (("initial", "cls_before_pooler", "[CLS]"), ("initial_avg", "avg", "avg"))
TRANSFER_MODE = "fasttest"  # SentEval's prototyping setting: the full protocol is ~4x the classifier time
PROTOCOL = protocols.SMOKE_ARGS  # MODEL, wiki1m_head.txt and SENTEVAL, batch 32, 150 steps, a dev gate every 50
# name, script, method flags, the paper's BERT-base 7-task average for that row (the paper's, not ours), source
RUNS = [
    ("simcse", "simcse.py", [], "76.25", "SimCSE, Table 5"),
    ("simcsepp", "simcsepp.py", [], "78.05", "SimCSE++, Table 3"),
    ("simcsepp_off_dropout_only", "simcsepp.py", ["--dcl_weight", "0"], "77.13", "SimCSE++ Table 3, +Off-Info"),
    ("simcsepp_dcl_only", "simcsepp.py", ["--no_off_dropout", "--m", "1"], "77.40", "SimCSE++ Table 3, +DCL"),
    ("sscl", "sscl.py", [], "77.90", "SSCL, Table 2"),
    ("whitenedcse", "whitenedcse.py", ["--num_groups", "192"], "78.78", "WhitenedCSE, Table 1"),
    ("micse", "micse.py", [], "78.13", "miCSE, Table 2 (100%)"),
    ("micse_no_queue", "micse.py", ["--queue_size", "0"], "76.88", "miCSE Table 2, AMI+SimCSE (100%)"),
]
# The few-shot protocol on the shared corpus: --fraction of wiki1m_head.txt, a different subset per seed.
FEW_SHOT = [
    ("simcse_10pct", "simcse.py", ["--fraction", "0.1"], "75.76 ± 0.24", "miCSE Table 2, SimCSE 10%"),
    ("micse_10pct", "micse.py", ["--fraction", "0.1"], "76.38 ± 0.35", "miCSE Table 2, miCSE 10%"),
    ("simcse_1pct", "simcse.py", ["--fraction", "0.01"], "74.96 ± 0.65", "miCSE Table 2, SimCSE 1%"),
    ("micse_1pct", "micse.py", ["--fraction", "0.01"], "76.40 ± 0.48", "miCSE Table 2, miCSE 1%"),
]
BASELINE = {"simcse_10pct": None, "micse_10pct": "simcse_10pct", "simcse_1pct": None, "micse_1pct": "simcse_1pct",
            "simcse": None, **{name: "simcse" for name, *_ in RUNS[1:]}}
STS_COLUMNS, TRANSFER_COLUMNS = protocols.STS, protocols.TRANSFER


def smoke(rows: list[tuple]) -> dict:
    """Rows of RUNS or FEW_SHOT as a protocol's rows, for protocols.py's tables, CSV and plot."""
    return {"name": "smoke", "rows": [{"name": name, "script": script, "flags": flags}
                                      for name, script, flags, *_ in rows]}


MAIN, FEW, EVERY = smoke(RUNS), smoke(FEW_SHOT), smoke(RUNS + FEW_SHOT)


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


# ---- aggregation (pure; tested against hand-computed numbers) ----
mean_std, fmt = protocols.mean_std, protocols.cell  # one implementation each, shared with the protocol pages
paired_difference, fmt_diff = protocols.paired_difference, protocols.fmt_diff


# ---- running ----
def smoke_runs(seeds: list, only, root: Path = Path()) -> list[dict]:
    """The smoke runs of `only`'s rows (all when empty), seed by seed, as cluster.attach gives a protocol's: {"row",
    "seed", "out", "argv", "kept"}, their checkpoints under root/runs/report/ (not committed), their results.json kept
    as results/<row>.seed<S>.json. With the default root, the command lines the page and `commands` print."""
    found = []
    for seed in seeds:
        for name, script, flags, *_ in RUNS + FEW_SHOT:
            if not only or name in only:
                out = root / "runs" / "report" / f"{name}.seed{seed}"
                argv = [script, *PROTOCOL, "--seed", str(seed), *flags, "--output_dir", str(out),
                        "--overwrite_output_dir"]
                found.append({"row": name, "seed": seed, "out": out, "argv": argv,
                              "kept": RESULTS / f"{name}.seed{seed}.json"})
    return found


def timed(cmd, env=None) -> dict:
    """Run cmd in ROOT (an error raises); its wall time and its processes' CPU time (all children's, when runs
    go on at once)."""
    print("== " + " ".join(str(c) for c in cmd[1:]), flush=True)
    cpu_before, start = cluster.cpu_of_children(), time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, env=env)
    cost = {"wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(cluster.cpu_of_children() - cpu_before, 1)}
    print(f"== took {cost['wall_s']:.0f}s wall, {cost['cpu_s']:.0f}s CPU", flush=True)
    return cost


def make_here(run: dict) -> None:
    """One run in a subprocess here (a protocol's, with --auto_resume: it starts, resumes or finishes), its
    results.json kept at run["kept"] (as a job keeps it) with its wall and CPU time under "report"."""
    cost = timed([sys.executable, *run["argv"]])
    results = json.loads((ROOT / run["out"] / "results.json").read_text())
    Path(run["kept"]).parent.mkdir(parents=True, exist_ok=True)
    files.write_json(Path(run["kept"]), {**results, "report": cost})


def made_here(run: dict):
    """make_here(run): None, or the error of a run that failed (the others go on)."""
    try:
        make_here(run)
    except (subprocess.CalledProcessError, OSError, json.JSONDecodeError) as err:
        return err
    return None


def evaluate(script: str, model, pooler: str, tmp: Path, *flags: str) -> tuple[dict, dict]:
    """eval_sts.py or eval_transfer.py on `model` with `--json tmp`: (its scores, its cost); tmp is removed."""
    cost = timed([sys.executable, script, "--model_name_or_path", str(model), "--pooler", pooler, "--senteval_dir",
                  SENTEVAL, *flags, "--json", str(tmp)])
    scores = json.loads(tmp.read_text())
    tmp.unlink()
    return scores, cost


def evaluate_initial(script: str, suffix: str, *flags: str) -> None:
    """The pretrained model under each pooler of INITIAL, by `script`, kept as results/<stem><suffix>.json."""
    for stem, pooler, _ in INITIAL:
        if not (RESULTS / f"{stem}{suffix}.json").exists():
            scores, cost = evaluate(script, MODEL, pooler, RESULTS / f"{stem}{suffix}.tmp.json", *flags)
            files.write_json(RESULTS / f"{stem}{suffix}.json", {**scores, "report": cost})


def run_all(seeds: list[int], only: list[str] | None, transfer: bool) -> None:
    RESULTS.mkdir(exist_ok=True)
    evaluate_initial("eval_sts.py", "")
    every = smoke_runs(seeds, only, ROOT)  # every row of a seed first: a report stopped early has comparable rows
    todo = [run for run in every if not run["kept"].exists()]
    start = time.perf_counter()
    for done, run in enumerate(todo):
        eta = progress.duration((time.perf_counter() - start) / done * (len(todo) - done)) if done else "?"
        print(f"== training run {done + 1}/{len(todo)} ({done} done, ETA {eta})", flush=True)
        make_here(run)
    if todo or not (RESULTS / "machine.json").exists():  # the machine of the latest runs
        (RESULTS / "machine.json").write_text(json.dumps(machine(), indent=2))
    if not transfer:
        return
    evaluate_initial("eval_transfer.py", "_transfer", "--mode", TRANSFER_MODE)
    for run in every:
        path, which = run["kept"], f"{run['row']} seed {run['seed']}"
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            data, why = None, f"cannot be read ({type(err).__name__})"
        if not isinstance(data, dict):
            print(f"== {which}: {path} {why if data is None else 'is not a JSON object'}; delete it to train the "
                  "run again", flush=True)
            continue
        if "transfer" in data:
            continue
        best = run["out"] / "best"
        if not best.is_dir():
            print(f"== {which}: no checkpoint at {best}; delete {path} to train it again", flush=True)
            continue
        scores, cost = evaluate("eval_transfer.py", best, data["eval_pooler"], path.with_suffix(".transfer.tmp.json"),
                                "--mode", TRANSFER_MODE)
        data["transfer"] = {**scores, "mode": TRANSFER_MODE}
        data.setdefault("report", {}).update(transfer_wall_s=cost["wall_s"], transfer_cpu_s=cost["cpu_s"])
        files.write_json(path, data)


def machine():
    import torch
    import transformers
    cpu = provenance.device_name(torch.device("cpu"))  # the CPU's model name, as each run's provenance records it
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d")}


# ---- the page ----
def load(results_dir: Path, damaged: list | None = None) -> dict[str, dict[int, dict]]:
    """{row name: {seed: results.json}} for every results/<name>.seed<S>.json of a known row; a file that is not a
    run's record is skipped and added to `damaged` as (path, why)."""
    runs = {}
    for name, *_ in RUNS + FEW_SHOT:
        for path in sorted(results_dir.glob(f"{name}.seed*.json")):
            seed = path.name[len(name) + len(".seed"):-len(".json")]
            if seed.isdigit():
                results, why = protocols.read_run(path)
                if results is None:
                    (damaged if damaged is not None else []).append((path, why))
                else:
                    runs.setdefault(name, {})[int(seed)] = results
    return runs


def read_json(path: Path) -> dict:
    """A JSON object the page needs (machine.json, the initial model's scores); one line if it is damaged."""
    try:
        found = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        fail(f"{path} cannot be read ({type(err).__name__}); delete it and run `python tools/report.py run` to "
             "make it again")
    if not isinstance(found, dict):
        fail(f"{path} is not a JSON object; delete it and run `python tools/report.py run` to make it again")
    return found


def write(results_dir: Path | None = None, page: Path | None = None, plots: bool = True,
          tables_dir: Path | None = None) -> None:
    """RESULTS.md from results/*.json, one function per section; every fact on it comes from there. Its tables as
    LaTeX and its runs as CSV go to `tables_dir` (default: results/)."""
    results_dir = results_dir or RESULTS
    tables_dir = tables_dir or results_dir
    page = page or ROOT / "RESULTS.md"
    damaged = []
    runs = load(results_dir, damaged)
    if "simcse" not in runs:
        fail(f"no {results_dir.name}/simcse.seed*.json; run `python tools/report.py run` first")
    for needed in ("initial.json", "machine.json"):
        if not (results_dir / needed).exists():
            fail(f"no {results_dir.name}/{needed}; run `python tools/report.py run` first")
    ctx = context(results_dir, runs)
    ctx.damaged = damaged
    lines = (header(ctx) + protocol_section(ctx) + sts_section(ctx) + few_shot_section(ctx)
             + transfer_section(ctx) + align_uniform_section(ctx) + speed_section(ctx)
             + commands_section(ctx))
    paper = {name: cell.split(" ")[0] for name, _, _, cell, _ in RUNS + FEW_SHOT}
    titles = ("STS test (best STS-B dev checkpoint)", "Few-shot: SimCSE and miCSE on a fraction of the corpus")
    protocols.save_page(lines, page, EVERY, runs, damaged, tables_dir, paper, titles)
    print(f"wrote {tables_dir / 'latex'}/*.tex and {tables_dir / 'runs.csv'}")
    if plots and pyplot():
        protocols.plot_dev_curves(EVERY, runs, results_dir / "dev_curves.png",
                                  [("every method, full wiki1m head", ctx.main_names),
                                   ("few-shot (fraction of the head)", ctx.few_names)],
                                  "STS-B dev during training (all-MiniLM-L6-v2, same protocol)")
        plot_align_uniform(runs, results_dir, ctx.main_names, ctx.few_names)


def context(results_dir: Path, runs: dict) -> types.SimpleNamespace:
    """What the sections share: the runs, the initial checkpoint's scores, the machine, the rows."""
    initial_sts, initial_transfer = {}, {}  # {pooler label: scores}; only initial.json is required
    for stem, _, label in INITIAL:
        for found, path in ((initial_sts, results_dir / f"{stem}.json"),
                            (initial_transfer, results_dir / f"{stem}_transfer.json")):
            if path.exists():
                found[label] = read_json(path)
    every_run = [r for by_seed in runs.values() for r in by_seed.values()]
    return types.SimpleNamespace(
        runs=runs, every_run=every_run, initial_sts=initial_sts, initial_transfer=initial_transfer,
        info=read_json(results_dir / "machine.json"),
        main_names=[name for name, *_ in RUNS], few_names=[name for name, *_ in FEW_SHOT],
        seeds=sorted({s for by_seed in runs.values() for s in by_seed}),
        done=len(every_run), with_transfer=sum("transfer" in r for r in every_run),
        diff_header="avg − SimCSE (paired)")


def protocol_value(flag: str) -> int:
    return int(PROTOCOL[PROTOCOL.index(flag) + 1])


def corpus(ctx, name: str, what: str = "Wikipedia sentences") -> str:
    """'11,900 Wikipedia sentences, about 40% of one pass': the row's recorded corpus size against the
    protocol's steps x batch; empty when the runs did not record it."""
    sizes = {r["num_train_examples"] for r in ctx.runs.get(name, {}).values() if "num_train_examples" in r}
    if len(sizes) != 1:
        return ""
    size = sizes.pop()
    passes = protocol_value("--max_steps") * protocol_value("--batch_size") / size
    share = f"about {round(passes * 100, -1):.0f}% of one pass" if passes < 1 else f"about {passes:.0f} passes"
    return f"{size:,} {what}, {share}"


def device_text(ctx) -> str:
    """'CPU only' or the GPUs the runs recorded, and the encoder's precision where it was not fp32."""
    devices = sorted({r["device"] for r in ctx.every_run if "device" in r})
    if not devices:
        text = "device not recorded"
    elif all(d.startswith("cpu") for d in devices):
        text = "CPU only"
    else:
        text = "GPU: " + ", ".join(devices)
    precisions = sorted({r.get("precision") or r.get("args", {}).get("precision") or "fp32"
                         for r in ctx.every_run} - {"fp32"})
    return text + (f", the encoder in {' and '.join(precisions)}" if precisions else "")


def memory_text(ctx) -> str:
    kinds = {r.get("peak_memory_kind") for r in ctx.every_run}
    texts = {"cpu_max_rss": "the process's peak RSS on CPU, model loading and evaluation included",
             "cuda_max_allocated": "the GPU's peak allocated memory (torch.cuda.max_memory_allocated), "
                                   "model loading and evaluation included"}
    return "; ".join(texts.get(kind, "the peak memory each run recorded") for kind in sorted(kinds, key=str))


def header(ctx) -> list[str]:
    info = ctx.info
    full = corpus(ctx, "simcse")
    return ["# Results: every method under one protocol, over seeds", "",
            "Generated by `python tools/report.py run` (training + this page) or `python tools/report.py write` "
            "(this page and",
            "the plots from `results/*.json`). Do not edit by hand.", "",
            f"Machine: {info['cpu']}, {info['cores']} cores, {device_text(ctx)}; Python {info['python']}, "
            f"torch {info['torch']}, transformers {info['transformers']}; last run on {info['date']}.", "",
            *[line + "\n" for line in tables.provenance_lines(ctx.every_run)],
            *([f"Skipped, not a run's record: " + "; ".join(f"`{p.name}` ({why})" for p, why in ctx.damaged)
               + ".", ""] if getattr(ctx, "damaged", None) else []),
            "The tables below are also in LaTeX (`results/latex/`, booktabs) and every run in a CSV "
            "(`results/runs.csv`), for a paper.", "",
            "## What these numbers can and cannot show", "",
            "Every run starts from all-MiniLM-L6-v2, a 6-layer encoder *already trained for sentence embeddings* "
            f"on a billion sentence pairs, and takes {protocol_value('--max_steps')} steps of batch "
            f"{protocol_value('--batch_size')} on `wiki1m_head.txt`" + (f" ({full})" if full else "") + ". The "
            "rows show whether each method runs under one protocol, how it moves an already-tuned encoder, and how "
            "large seed noise is at this scale. They cannot show the papers' gains, which are measured from "
            "`bert-base-uncased` (no sentence training) on the full million sentences; the papers' column is "
            "theirs, not ours. A difference marked in **bold** exceeds two standard errors of the seed-paired "
            "differences (over 2 or 3 seeds: a rough screen, not a test).", ""]


def protocol_section(ctx) -> list[str]:
    """The protocol, what is on the page and what it cost, what is missing and what a full run costs."""
    runs, done, with_transfer = ctx.runs, ctx.done, ctx.with_transfer
    costs = [r.get("report", {}) for r in ctx.every_run]
    costs += [scores.get("report", {}) for scores in [*ctx.initial_sts.values(), *ctx.initial_transfer.values()]]
    cpu_s = sum(c.get("cpu_s", 0) + c.get("transfer_cpu_s", 0) for c in costs)
    wall_s = sum(c.get("wall_s", 0) + c.get("transfer_wall_s", 0) for c in costs)
    untimed = sum("wall_s" not in c for c in costs)
    expected = len(RUNS + FEW_SHOT) * len(SEEDS)
    run_cpu = [r["report"]["cpu_s"] for r in ctx.every_run if "cpu_s" in r.get("report", {})]
    transfer_cpu = [r["report"]["transfer_cpu_s"] for r in ctx.every_run if "transfer_cpu_s" in r.get("report", {})]
    estimate = ""
    # the measured total falls short of a full run while runs are missing or untimed
    if run_cpu and (done < expected or with_transfer < expected or untimed):
        per_run, per_transfer = sum(run_cpu) / len(run_cpu), sum(transfer_cpu) / max(len(transfer_cpu), 1)
        estimate = (f" At the mean cost of the timed runs ({per_run / 60:.0f} CPU-minutes a run"
                    + (f", {per_transfer / 60:.0f} a transfer evaluation), " if transfer_cpu else "; transfer "
                       "evaluations not timed yet), ")
                    + f"all {expected} runs{' and their transfer evaluations' if transfer_cpu else ''} are about "
                    f"{expected * (per_run + per_transfer * bool(transfer_cpu)) / 3600:.1f} CPU-hours.")
    missing = []
    for name in ctx.main_names + ctx.few_names:
        absent = [str(s) for s in SEEDS if s not in runs.get(name, {})]
        if absent:
            missing.append(f"{name} (seed{'s' if len(absent) > 1 else ''} {', '.join(absent)})")
    gates = ", ".join(str(s) for s in range(0, protocol_value("--max_steps") + 1, protocol_value("--eval_steps")))
    return ["## Protocol", "",
            f"Every run: `{' '.join(PROTOCOL)} --seed S` plus the method's own flags (Commands, below), seeds "
            f"{', '.join(map(str, ctx.seeds))}. Each run's best STS-B dev checkpoint (steps {gates}) is evaluated "
            "on the 7 STS test tasks (Spearman × 100, \"all\"), on SentEval's 7 transfer tasks "
            f"(`eval_transfer.py --mode {TRANSFER_MODE}`: SentEval's prototyping setting, since the full protocol "
            "does not fit this CPU budget) and for ℓ_align/ℓ_uniform on STS-B dev. Cells are mean ± sample standard "
            "deviation over the seeds (n runs); the last column is the mean of the seed-paired differences of the "
            "average to SimCSE ± its standard error.", "",
            f"Runs on this page: {done} ({with_transfer} with transfer scores). Total cost: "
            f"{cpu_s / 3600:.1f} CPU-hours, {wall_s / 3600:.1f} hours of wall time on {ctx.info['cores']} cores"
            + (f" ({untimed} runs made before report.py timed its runs are not counted)" if untimed else "") + ".",
            "", ("Not run yet (`python tools/report.py run` resumes with them): " + "; ".join(missing) + "." if missing
                 else f"Every row has every default seed ({', '.join(map(str, SEEDS))}).")
            + (f" Transfer scores are missing for {done - with_transfer} of the {done} runs."
               if done > with_transfer else "") + estimate, ""]


def initial_dev(ctx, name: str) -> float | None:
    """The step-0 STS-B dev score of a row's runs: the initial checkpoint under that row's pooler (the first dev gate
    of each run's trajectory, or of the older "dev_curve")."""
    gates = [[r for r in files.trajectory(results) if r.get("gate")] for results in ctx.runs.get(name, {}).values()]
    scores = [curve[0]["stsb_dev"] for curve in gates if curve and curve[0]["step"] == 0]
    return sum(scores) / len(scores) if scores else None


def initial_rows(scores: dict, columns: list[str]) -> list[str]:
    """The initial checkpoint's rows of a table, one per pooler evaluated."""
    return [f"| initial checkpoint ({label}) | 1 | " + " | ".join(f"{found[t]:.2f}" for t in columns) + " | — |"
            for label, found in scores.items()]


def sts_section(ctx) -> list[str]:
    table = protocols.score_rows(MAIN, ctx.runs, STS_COLUMNS, "test", (ctx.diff_header, BASELINE))
    avg_dev, cls_dev = initial_dev(ctx, "sscl"), initial_dev(ctx, "simcse")
    figures = (f"; the initial checkpoint's STS-B dev figure with that pooler is {avg_dev:.2f}, not {cls_dev:.2f}"
               if avg_dev is not None and cls_dev is not None else "")
    papers = {name: f"{paper} ({source})" for name, _, _, paper, source in RUNS + FEW_SHOT}
    return ["## STS test (best STS-B dev checkpoint)", "", *table[:2], *initial_rows(ctx.initial_sts, STS_COLUMNS),
            *table[2:], "", "SSCL trains and evaluates with the average pooler, as its released scripts do (the "
            "others evaluate [CLS]), so compare SSCL's rows with the initial checkpoint (avg) here and in the transfer "
            f"table{figures}.", "",
            *protocols.best_dev_rows(EVERY, ctx.runs, ("paper's BERT-base avg (not ours)", papers))]


def few_shot_section(ctx) -> list[str]:
    tenth, hundredth = corpus(ctx, "simcse_10pct", "sentences"), corpus(ctx, "simcse_1pct", "sentences")
    lines = ["", "## Few-shot: SimCSE and miCSE on a fraction of the corpus", "",
             "The same protocol on `--fraction 0.1`"
             + (f" ({tenth} in {protocol_value('--max_steps')} steps)" if tenth else "")
             + " and `--fraction 0.01`" + (f" ({hundredth})" if hundredth else "") + " of `wiki1m_head.txt`; "
             "each seed draws its own subset (data.subsample), as miCSE's five subsets do, and miCSE takes its "
             "per-fraction λ (micse.py's PRESETS) while the protocol's batch, learning rate and steps override the "
             "rest of those settings. The paper's column is miCSE's Table 2: BERT-base on fractions of the full "
             "wiki1m, mean ± std over 5 subsets. The last column pairs miCSE with SimCSE on the same subsets.", ""]
    return lines + protocols.score_rows(FEW, ctx.runs, STS_COLUMNS, "test", ("miCSE − SimCSE (paired)", BASELINE))


def transfer_section(ctx) -> list[str]:
    table = protocols.score_rows(EVERY, ctx.runs, TRANSFER_COLUMNS, "transfer", (ctx.diff_header, BASELINE))
    lines = ["", f"## Transfer tasks (`--mode {TRANSFER_MODE}`, accuracy × 100)", "", *table[:2],
             *initial_rows(ctx.initial_transfer, TRANSFER_COLUMNS), *table[2:]]
    if "avg" in ctx.initial_transfer:
        lines += ["", "SSCL's row is avg-pooled, the others [CLS]: its difference to SimCSE mixes the method with "
                  "the pooler, and what SSCL's training changed is its distance to the initial checkpoint (avg)."]
    return lines + ["", "Papers, BERT-base, `--mode test` (not ours): SimCSE 85.81 (SimCSE Table E.1), SSCL-BERT "
                    "(avg.) 83.68 (SSCL Table 3), WhitenedCSE +0.59 over SimCSE (WhitenedCSE §4.3).", ""]


def align_uniform_section(ctx) -> list[str]:
    lines = ["## Alignment and uniformity (STS-B dev, lower is better for both)", "",
             "| run | n | ℓ_align initial | ℓ_align best | ℓ_uniform initial | ℓ_uniform best |",
             "|---|---|---|---|---|---|"]
    for name in ctx.main_names + ctx.few_names:
        au = [r["align_uniform"] for r in ctx.runs.get(name, {}).values() if "align_uniform" in r]
        if au:
            cells = [fmt(*mean_std([a[when][m] for a in au]), digits=3) for m in ("align", "uniform")
                     for when in ("initial", "best")]
            lines.append(f"| {name} | {len(au)} | " + " | ".join(cells) + " |")
    return lines + ["", "![ℓ_align against ℓ_uniform](results/align_uniform.png)", "",
                    "## Dev curves", "", "![STS-B dev Spearman against step, band over seeds](results/dev_curves.png)",
                    ""]


def speed_section(ctx) -> list[str]:
    lines = ["## Speed and memory (same runs)", "", "| run | steps/s | × simcse | peak memory MiB | × simcse |",
             "|---|---|---|---|---|"]
    base_speed = mean_std([r["steps_per_second"] for r in ctx.runs["simcse"].values()])[0]
    base_memory = mean_std([r["peak_memory_mb"] for r in ctx.runs["simcse"].values()])[0]
    for name in ctx.main_names + ctx.few_names:
        if name in ctx.runs:
            speed = mean_std([r["steps_per_second"] for r in ctx.runs[name].values()])[0]
            memory = mean_std([r["peak_memory_mb"] for r in ctx.runs[name].values()])[0]
            lines.append(f"| {name} | {speed:.3f} | {speed / base_speed:.2f} | {memory:.0f} | "
                         f"{memory / base_memory:.2f} |")
    return lines + ["", f"Means over the seeds. Steps/s exclude the dev evaluations; memory is {memory_text(ctx)}. "
                    "Runs go one after another and are timed as they ran, so work sharing the machine slows some "
                    "rows: `tools/bench.py` measures speed ratios in one session.", ""]


def commands_section(ctx) -> list[str]:
    lines = ["## Commands", "", "```bash",
             f"python tools/report.py run --seeds {' '.join(map(str, ctx.seeds))}     # all of the below, resumable",
             *[f"python eval_sts.py --model_name_or_path {MODEL} --pooler {pooler} --senteval_dir {SENTEVAL} "
               f"--json results/{stem}.json" for stem, pooler, _ in INITIAL]]
    lines += [protocols.command_line(run) for run in smoke_runs(["S"], ctx.runs)]  # the rows with runs
    lines += [f"python eval_transfer.py --model_name_or_path runs/report/NAME.seedS/best --pooler POOLER "
              f"--senteval_dir {SENTEVAL} --mode {TRANSFER_MODE}", "```", "",
              "The papers' setting on a GPU (`bert-base-uncased`, the full wiki1m, the scripts' defaults are the "
              "papers' hyper-parameters; downloads from the Hugging Face Hub):", "", "```bash"]
    for script, extra in (("simcse.py", ""), ("simcsepp.py", ""), ("sscl.py", ""), ("whitenedcse.py", ""),
                          ("micse.py", ""),
                          ("simcse.py", " --fraction 0.01   # S in 48-52: miCSE's released 1% subsets"),
                          ("micse.py", " --fraction 0.01   # Table 2's few-shot row, with its per-fraction settings")):
        lines.append(f"python {script} --model_name_or_path bert-base-uncased --seed S --eval_transfer{extra}")
    return lines + ["```", ""]


def pyplot():
    try:
        return files.pyplot()
    except ImportError:
        print("matplotlib is not installed: skipping the plots (pip install matplotlib)")
        return None


def plot_align_uniform(runs, results_dir, main_names, few_names):
    """SimCSE's Figure 2 style: each run's initial -> best checkpoint (means over seeds) as an arrow."""
    plt = files.pyplot()
    fig, ax = plt.subplots(figsize=(7, 6))
    tab20 = plt.get_cmap("tab20").colors
    colors = tab20[0::2] + tab20[1::2]  # 20 distinct colours: the default cycle repeats after 10 rows
    for i, name in enumerate(main_names + few_names):
        au = [r["align_uniform"] for r in runs.get(name, {}).values() if "align_uniform" in r]
        if not au:
            continue
        (x0, y0), (x1, y1) = [(mean_std([a[w]["align"] for a in au])[0], mean_std([a[w]["uniform"] for a in au])[0])
                              for w in ("initial", "best")]
        color = colors[i % len(colors)]
        ax.plot([x1], [y1], marker="s" if name in few_names else "o", linestyle="none", color=color, label=name)
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops=dict(arrowstyle="->", color=color))
        ax.plot([x0], [y0], marker="x", color=color)
    protocols.finish(fig, ax, results_dir / "align_uniform.png", "ℓ_align (lower is better)",
                     "ℓ_uniform (lower is better)",
                     "initial (x) → best checkpoint (o; few-shot □), STS-B dev, mean over seeds")


def run_protocol(protocol: dict, extra: list[str], gpus: list[int] | None, jobs: dict | None = None) -> None:
    """Every run of `protocol` not finished yet (a stopped one resumes from its last/): one at a time here, or as
    submitit's jobs (`jobs`: --executor, --gpus and the job flags; tools/cluster.py), which this command waits for
    with --wait; each run's results.json, with its wall and CPU time under "report", goes to results/<name>/. Every
    command line is read by its script's parser first (but one submitted before as it is, which was read then): a
    mistake is one line, before anything runs or is queued."""
    folder = RESULTS / protocol["name"] / "jobs"  # the runs' submission notes (cluster.attach)
    every = [cluster.attach(run, RESULTS / protocol["name"], folder) for run in protocols.runs(protocol, extra)]
    # a command submitted before as it is was read then (its note holds it): else each `run` imports torch, 4 s
    protocols.check_commands([run for run in every if cluster.status_of(run).get("argv") != run["argv"]])
    done = protocols.collect(protocol, RESULTS)
    todo = [run for run in every if run["seed"] not in done.get(run["row"], {})]

    def plan(todo: list[dict]) -> None:  # what this command makes (with jobs: once it knows which are queued)
        how = f"{jobs['executor']} jobs" if jobs else "one at a time"
        print(f"protocol {protocol['name']}: {len(every)} runs, {len(every) - len(todo)} done"
              f"{' or queued' if jobs else ''}, {len(todo)} to make ({how}); wall time: "
              f"{protocols.estimate(todo, RESULTS)}", flush=True)
    if jobs:
        with cluster.holding(folder):  # what is queued, then the rest submitted: one `run` command at a time
            queued = cluster.queued(todo)  # pending, requeued or running: a second `run` resubmits none of them
            waiting = [run for run, is_queued in zip(todo, queued) if is_queued]
            todo = [run for run, is_queued in zip(todo, queued) if not is_queued]
            plan(todo)
            options = {k: v for k, v in jobs.items() if k not in ("executor", "runs_per_gpu", "wait")}
            submitted = cluster.submit(todo, folder, jobs["executor"], gpus, jobs["runs_per_gpu"], **options) \
                if todo else []
        print(f"submitted {len(submitted)} job(s); their runs' states: python tools/report.py status --protocol "
              f"{protocol['name']}; logs under {folder}", flush=True)
        if not jobs["wait"]:
            return
        ended = todo + waiting
        cluster.wait(ended)
        failed = [(run, said) for run, (state, said) in zip(ended, cluster.situations(ended)) if state != "done"]
    else:
        plan(todo)
        failed = [(run, err) for run, err in ((run, made_here(run)) for run in todo) if err]
    for run, err in failed:
        print(f"== failed: {protocols.command_line(run)} ({err})", flush=True)
    # after --wait none of its runs is queued; here, an earlier submission's may be
    underway = {} if jobs else cluster.underway(protocol, RESULTS / protocol["name"])
    protocols.write_page(protocol, RESULTS, underway=underway)
    if failed:
        raise SystemExit(1)


def check_gpus(text: str | None) -> list[int] | None:
    """--gpus 0,1,2: those CUDA devices must exist here (one line otherwise)."""
    if text is None:
        return None
    try:
        gpus = [int(g) for g in text.split(",")]
    except ValueError:
        fail(f"--gpus {text}: give GPU indices separated by commas, e.g. 0,1,2,3")
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus or min(gpus) < 0 or max(gpus) >= count:
        fail(f"--gpus {text}: this machine has {count} CUDA GPU(s)")
    return gpus


def main(argv=None):
    parser = plumbing.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["run", "write", "commands", "status"])
    parser.add_argument("--protocol", default="smoke",
                        help="smoke (RESULTS.md), paper, fewshot, sweep, or a protocol JSON file (protocols.py)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="seeds of every run (default: the protocol's; smoke: 42 43 44)")
    parser.add_argument("--only", nargs="+", help="these rows only")
    parser.add_argument("--no_transfer", action="store_true", help="skip the transfer evaluations")
    parser.add_argument("--gpus", default=None, help="run concurrently as local jobs, one per GPU: 0,1,2,3")
    cluster.add_arguments(parser)
    parser.add_argument("--args", default="", help="flags added to every run, e.g. \"--model_name_or_path DIR "
                                                   "--train_file FILE --senteval_dir DIR\" on a machine offline")
    g = parser.add_argument_group("--protocol sweep")
    g.add_argument("--script", help="the method script, e.g. simcsepp.py")
    g.add_argument("--flag", help="the swept flag, e.g. m")
    g.add_argument("--values", nargs="+", help="its values, e.g. 0.8 0.9 1.0")
    g.add_argument("--flags", default="", help="other flags of every run of the sweep")
    g.add_argument("--base", choices=["paper", "smoke"], default="paper",
                   help="paper: the script's paper defaults; smoke: the MiniLM CPU settings on ../shared")
    args = parser.parse_args(argv)
    try:
        if args.protocol == "smoke" and args.action == "status":  # the smoke page runs here, not as jobs
            folders = sorted(path.parent.name for path in RESULTS.glob("*/jobs"))
            print("status reports a protocol's jobs: python tools/report.py status --protocol NAME"
                  + (f" (jobs were submitted for: {', '.join(folders)})" if folders else " (none submitted here)"))
            return
        if args.protocol == "smoke":
            unknown = set(args.only or []) - {name for name, *_ in RUNS + FEW_SHOT}
            if unknown:
                fail(f"--only {' '.join(sorted(unknown))}: invalid choice, no such row of the smoke protocol")
            if args.action == "commands":
                for run in smoke_runs(args.seeds or SEEDS, args.only):
                    print(protocols.command_line(run))
                return
            if args.action == "run":
                if not (SHARED / "models" / "all-MiniLM-L6-v2").is_dir():
                    fail("report.py run needs ../shared (all-MiniLM-L6-v2, wiki1m_head.txt, senteval)")
                run_all(args.seeds or SEEDS, args.only, not args.no_transfer)
            write()
            return
        protocol = protocols_for(args)
        gpus = check_gpus(args.gpus)
        extra = split_flags(args.args, "--args")
        jobs = cluster.options(args, gpus)
        if args.action == "status":
            print("\n".join(cluster.status_lines(protocol, RESULTS / protocol["name"])))
        elif args.action == "commands":
            for line in protocols.precision_lines(protocol):
                print(f"# {line}")
            for run in protocols.runs(protocol, extra):
                print(protocols.command_line(run))
        elif args.action == "run":
            run_protocol(protocol, extra, gpus, jobs)
        else:
            protocols.write_page(protocol, RESULTS, underway=cluster.underway(protocol, RESULTS / protocol["name"]))
    except plumbing.UsageError as err:
        fail(str(err))


def split_flags(text: str, flag: str) -> list[str]:
    """--args / --flags as a shell splits them; an unbalanced quote is one line."""
    try:
        return shlex.split(text)
    except ValueError as err:
        fail(f"{flag} {text!r}: {err} (quote as a shell does)")


def protocols_for(args) -> dict:
    """The protocol the flags name, with --seeds, --only and --no_transfer applied."""
    if args.protocol == "sweep":
        if not (args.script and args.flag and args.values):
            fail("--protocol sweep needs --script, --flag and --values (e.g. --script simcsepp.py --flag m "
                 "--values 0.8 0.9 1.0)")
        if not (ROOT / args.script).is_file():
            fail(f"--script {args.script}: no such script here")
        protocol = protocols.sweep_protocol(args.script, args.flag, args.values, args.seeds or [42, 43],
                                            split_flags(args.flags, "--flags"), args.base)
    else:
        protocol = dict(protocols.load(args.protocol))
    if args.seeds:
        protocol["seeds"] = args.seeds
    if args.only:
        unknown = set(args.only) - {row["name"] for row in protocol["rows"]}
        if unknown:
            fail(f"--only {' '.join(sorted(unknown))}: no such row in protocol {protocol['name']}")
        protocol["rows"] = [row for row in protocol["rows"] if row["name"] in args.only]
    if args.no_transfer:
        protocol["transfer"] = None
    return protocol


if __name__ == "__main__":
    main()
