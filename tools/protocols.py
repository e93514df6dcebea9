"""report.py's protocols: which runs reproduce which table, the papers' numbers to put beside ours, and the page.

A protocol is a dict (built in below, or a JSON file of the same shape given as `--protocol FILE`):

    {"name": "paper",                       # its folder: runs/<name>/ and results/<name>/
     "description": "...",                 # the page's first line
     "args": [...],                         # flags every run gets (before its own)
     "rows": [{"name", "script", "flags", "paper", "precision"}, ...],  # "paper": a key of PAPER, or null;
                                                          # "precision": --precision of the row, or absent
     "seeds": [42, 43, 44, 45, 46],
     "transfer": null | "test" | "fasttest", # --eval_transfer of every run
     "sweep": {"flag": "m", "values": [...]}  # only for a sweep: the rows are its values
    }

A row's name names its runs' folders, runs/<protocol>/<row>.seed<S>, and kept files, with '/' and '\\' as '_': two rows
whose names would give the same folder (`a\\b` and `a_b`) are refused in one line.

Built in: `paper` (SimCSE Table 5 and its followers' BERT-base rows at each script's paper defaults), `fewshot`
(miCSE Table 2 on the authors' subsets, seeds 48-52, and its Figure 3 curve) and `sweep` (one script, one flag,
a list of values: `sweep_protocol`). `smoke` is report.py's own CPU protocol and page (RESULTS.md).
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's modules

import plumbing  # noqa: E402
import tables  # noqa: E402
from plumbing import files, progress  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]  # the suite
RUNS_DIR = Path("runs")  # the runs' output folders, relative to the suite
STS, TRANSFER = tables.STS, tables.TRANSFER

# The papers' numbers, transcribed once: (source, {column: value or (value, ±)}). Checked against
# ../shared/papers/ by tests/test_protocols.py.
PAPER = {
    "simcse": ("SimCSE Table 5, unsup-SimCSE-BERT-base",
               dict(zip(STS, [68.40, 82.41, 74.38, 80.91, 78.56, 76.85, 72.23, 76.25]))),
    "simcse-sup": ("SimCSE Table 5, sup-SimCSE-BERT-base",
                   dict(zip(STS, [75.30, 84.67, 80.19, 85.40, 80.82, 84.25, 80.39, 81.57]))),
    "simcsepp": ("SimCSE++ Table 3, SimCSE++-BERT-base",
                 dict(zip(STS, [73.66, 82.36, 75.86, 83.09, 79.76, 79.71, 71.91, 78.05]))),
    "sscl": ("SSCL Table 2, SSCL-SimCSE-BERT-base",
             dict(zip(STS, [71.68, 83.50, 76.42, 83.46, 78.39, 79.03, 71.76, 77.90]))),
    "whitenedcse": ("WhitenedCSE abstract (Table 1's cells are not in the text)", {"avg": 78.78}),
    "micse": ("miCSE Table 1, miCSE", dict(zip(STS, [71.71, 83.09, 75.46, 83.13, 80.22, 79.70, 73.62, 78.13]))),
    # miCSE Table 2: the 7-task average, mean ± std over the five subsets (none for 100%)
    **{f"{method}-{label}": (f"miCSE Table 2, {paper_name} {label}", {"avg": cell})
       for method, paper_name, cells in (
           ("simcse", "SimCSE", ((67.94, 1.16), (74.96, 0.65), (75.76, 0.24), 76.15)),
           ("ami", "AMI+SimCSE", ((73.85, 0.49), (76.21, 0.28), (76.31, 0.46), 76.88)),
           ("micse", "miCSE", ((73.68, 0.89), (76.40, 0.48), (76.38, 0.35), 78.13)))
       for label, cell in zip(("0.1%", "1%", "10%", "100%"), cells)},
}
# The precision each paper's released training scripts used (the HF Trainer's --fp16, or none): `paper` and
# `fewshot` run each row so; --args "--precision ..." replaces it (a CPU has no fp16).
RELEASED_PRECISION = {
    "simcse": ("fp16", "SimCSE's run_unsup_example.sh and run_sup_example.sh pass --fp16"),
    "simcsepp": ("fp16", "SimCSE++'s run_re.sh and run_re_vicreg.sh pass --fp16"),
    "sscl": ("fp16", "SSCL's run_unsup_example.sh passes --fp16"),
    "whitenedcse": ("fp16", "WhitenedCSE's run_unsup_example.sh passes --fp16"),
    "micse": ("fp32", "miCSE's README commands pass no --fp16"),
}
FEW_SHOT_PRECISION = "miCSE's README commands pass no --fp16; its Table 2's SimCSE baseline, for which the " \
    "authors give no command, runs at the same precision here"
FEW_SHOT_FRACTIONS = {"0.1%": 0.001, "1%": 0.01, "10%": 0.1, "100%": 1.0}
FEW_SHOT_METHODS = {"simcse": ("simcse.py", []), "ami": ("micse.py", ["--queue_size", "0"]), "micse": ("micse.py", [])}

BUILT_IN = {
    "paper": {
        "name": "paper",
        "description": "Every method at its paper's defaults on BERT-base (bert-base-uncased, the full wiki1m, "
                       "NLI for supervised SimCSE, the official SentEval data), five seeds, SentEval's transfer "
                       "tasks in their full protocol: SimCSE Table 5 and the BERT-base rows of its followers.",
        "args": [], "seeds": [42, 43, 44, 45, 46], "transfer": "test",
        "rows": [{"name": name, "script": f"{script}.py", "flags": flags, "paper": name,
                  "precision": RELEASED_PRECISION[script][0]}  # each row at its released scripts' precision
                 for name, script, flags in (("simcse", "simcse", []), ("simcse-sup", "simcse", ["--supervised"]),
                                             ("simcsepp", "simcsepp", []), ("sscl", "sscl", []),
                                             ("whitenedcse", "whitenedcse", []), ("micse", "micse", []))]},
    "fewshot": {
        "name": "fewshot",
        "description": "miCSE Table 2 and Figure 3: SimCSE, AMI+SimCSE (miCSE without its queue) and miCSE on "
                       "0.1%, 1% and 10% of wiki1m (the authors' released subsets: seeds 48-52) and on all of "
                       "it, BERT-base, each with its per-fraction schedule.",
        "args": [], "seeds": [48, 49, 50, 51, 52], "transfer": None,
        "rows": [{"name": f"{method}-{label}", "script": script, "paper": f"{method}-{label}", "precision": "fp32",
                  "flags": [*flags, "--fraction", f"{fraction:g}"] if fraction < 1 else flags}
                 for label, fraction in FEW_SHOT_FRACTIONS.items()
                 for method, (script, flags) in FEW_SHOT_METHODS.items()]},
}
# The CPU protocol of report.py's smoke page, also a base for sweeps on ../shared (--base smoke)
SMOKE_ARGS = ["--model_name_or_path", "../shared/models/all-MiniLM-L6-v2", "--train_file",
              "../shared/data/wiki1m_head.txt", "--senteval_dir", "../shared/data/senteval", "--batch_size", "32",
              "--lr", "3e-5", "--warmup_steps", "0", "--max_steps", "150", "--eval_steps", "50"]


def sweep_protocol(script: str, flag: str, values: list[str], seeds: list[int], flags: list[str],
                   base: str) -> dict:
    """One script, one flag over `values`, the other flags fixed (e.g. SimCSE++ Table 5's m)."""
    name = f"sweep-{Path(script).stem}-{flag.lstrip('-')}"
    check_folders([f"{flag.lstrip('-')}={value}" for value in values], f"--values {' '.join(values)}")
    return {"name": name, "description": f"{script} with --{flag.lstrip('-')} in {{{', '.join(values)}}}"
            + (f", {' '.join(flags)}" if flags else "") + (" on the smoke protocol's MiniLM CPU settings"
                                                           if base == "smoke" else " at the paper's defaults"),
            "args": SMOKE_ARGS if base == "smoke" else [], "seeds": seeds, "transfer": None,
            "sweep": {"flag": flag.lstrip("-"), "values": values},
            "rows": [{"name": f"{flag.lstrip('-')}={value}", "script": script, "paper": None,
                      "flags": [*flags, f"--{flag.lstrip('-')}", value]} for value in values]}


def load(name_or_file: str) -> dict:
    """A built-in protocol by name, or a JSON file; one line for anything else."""
    if name_or_file in BUILT_IN:
        return BUILT_IN[name_or_file]
    path = Path(name_or_file)
    if not path.is_file():
        raise plumbing.UsageError(f"--protocol {name_or_file}: neither a built-in protocol "
                                  f"({', '.join(['smoke', *BUILT_IN, 'sweep'])}) nor a JSON file")
    try:
        protocol = json.loads(path.read_text())
        names = [protocol["name"]] + [row["name"] for row in protocol["rows"]]
        for row in protocol["rows"]:
            flags = row.get("flags", [])
            if not isinstance(row["script"], str) or not isinstance(flags, list) or \
                    not all(isinstance(f, str) for f in flags):
                raise TypeError(f"row {row['name']!r}: its script is a path and its flags a list of strings, "
                                f"e.g. [\"--m\", \"0.9\"], not {flags!r}")
            if row.get("paper") is not None and row["paper"] not in PAPER:
                raise TypeError(f"row {row['name']!r}: paper {row['paper']!r} is none of the page's "
                                f"({', '.join(PAPER)}) or null")
        if not isinstance(protocol.get("args", []), list):
            raise TypeError("its args are a list of strings")
        if not all(isinstance(seed, int) for seed in protocol["seeds"]):
            raise TypeError("its seeds are integers")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        said = str(err) if type(err) is TypeError else repr(err)  # ours: a sentence
        raise plumbing.UsageError(f"--protocol {path}: not a protocol ({said}); see protocols.py") from None
    for name in names:  # each names a folder: runs/<protocol>/<row>.seed<S>
        if not isinstance(name, str) or not name.strip() or "/" in name or "\0" in name or name in (".", ".."):
            raise plumbing.UsageError(f"--protocol {path}: the name {name!r} cannot name a folder (no '/', not "
                                      "empty, not '.' or '..')")
    check_folders(names[1:], f"--protocol {path}")
    return {"description": "", "args": [], "transfer": None, **protocol}


# ----------------------------------------------------------------------------------------------------- runs
def file_name(name: str) -> str:
    """A row's name as a file or folder name (a sweep over paths has slashes in its values)."""
    return re.sub(r"[/\\\0]", "_", name)


def check_folders(names: list[str], where: str) -> None:
    """One line where two rows would share a run folder (runs/<protocol>/<row>.seed<S>) and a kept results file: the
    same name, or names that file_name makes the same (`a\\b` and `a_b`)."""
    seen = {}
    for name in names:
        folder = file_name(name)
        if folder in seen and seen[folder] == name:
            raise plumbing.UsageError(f"{where}: two rows have the same name ({name!r})")
        if folder in seen:
            raise plumbing.UsageError(f"{where}: the rows {seen[folder]!r} and {name!r} would share one folder, "
                                      f"{folder}.seed<S> ('/' and '\\' become '_'); rename one")
        seen[folder] = name


def kept_name(run: dict) -> str:
    """results/<protocol>/<row>.seed<S>.json: where a run's results.json is kept."""
    return f"{file_name(run['row'])}.seed{run['seed']}.json"


def runs(protocol: dict, extra: list[str] = ()) -> list[dict]:
    """Every run of a protocol, seed by seed: {"row", "seed", "out", "argv"} (argv without the interpreter)."""
    found = []
    for seed in protocol["seeds"]:
        for row in protocol["rows"]:
            out = RUNS_DIR / protocol["name"] / f"{file_name(row['name'])}.seed{seed}"
            transfer = ["--eval_transfer", protocol["transfer"]] if protocol.get("transfer") else []
            precision = ["--precision", row["precision"]] if row.get("precision") else []
            # --auto_resume: the same line starts the run, resumes it, or finishes its evaluation (a requeued job)
            argv = [row["script"], *protocol["args"], *precision, *row.get("flags", []), *extra, "--seed",
                    str(seed), *transfer, "--output_dir", str(out), "--auto_resume"]
            found.append({"row": row["name"], "seed": seed, "out": out, "argv": argv})
    return found


def check_commands(every: list[dict]) -> None:
    """Each run's command line read by its own script's parser, as the run will read it, before anything runs or is
    queued: a script that is not here, or a flag it does not take, is one line naming the run (and the flag nearest
    to a misspelt one)."""
    import contextlib
    import importlib
    import io
    parsed = set()
    for run in every:
        script = run["argv"][0]
        if not (ROOT / script).is_file() or Path(script).suffix != ".py":
            raise plumbing.UsageError(f"row {run['row']!r}: {script} is not a script of this suite (simcse.py, "
                                      "simcsepp.py, sscl.py, whitenedcse.py, micse.py)")
        if tuple(run["argv"]) in parsed:
            continue
        parsed.add(tuple(run["argv"]))
        said, argv0, cwd = io.StringIO(), sys.argv[0], os.getcwd()
        try:
            sys.argv[0] = script  # the parser's name in its messages
            os.chdir(ROOT)  # where the run starts: its relative paths
            with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
                importlib.import_module(Path(script).stem).parse_args(run["argv"][1:])
        except SystemExit as stop:
            if stop.code not in (0, None):
                lines = [line for line in said.getvalue().splitlines() if line.strip()]
                raise plumbing.UsageError(f"row {run['row']!r} seed {run['seed']}: "
                                          f"{(lines or ['its command line is refused'])[-1]}") from None
        except plumbing.UsageError as err:
            raise plumbing.UsageError(f"row {run['row']!r} seed {run['seed']}: {err}") from None
        finally:
            sys.argv[0] = argv0
            os.chdir(cwd)


def precision_lines(protocol: dict) -> list[str]:
    """Each row's precision and where it comes from (the released scripts), for `commands` and the page."""
    lines = []
    for row in protocol["rows"]:
        if row.get("precision"):
            source = RELEASED_PRECISION.get(Path(row["script"]).stem, (None, None))[1] \
                if protocol["name"] != "fewshot" else FEW_SHOT_PRECISION
            lines.append(f"{tables.markdown_cell(row['name'])}: --precision {row['precision']}"
                         + (f" ({source})" if source else ""))
    return lines


def command_line(run: dict) -> str:
    return "python " + " ".join(shlex.quote(str(a)) for a in run["argv"])


def read_run(path: Path) -> tuple[dict | None, str]:
    """(a run's results.json, "") or (None, why it is not one): missing, truncated, not an object, or a file of
    another kind (a run's record has its best STS-B dev score and step)."""
    try:
        results = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None, "no such file"
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return None, f"cannot be read ({type(err).__name__}: truncated or damaged)"
    if not isinstance(results, dict) or "best_step" not in results:
        return None, "not a run's results.json"
    return results, ""


def skipped_line(damaged: list, page: Path) -> str:
    """The terminal's one line for the files a page names as skipped ((path, why) each)."""
    return (f"skipped {len(damaged)} file(s) that are not a run's record (named on {page}): "
            + "; ".join(f"{path} ({why})" for path, why in damaged))


def collect(protocol: dict, results_dir: Path, damaged: list | None = None) -> dict[str, dict[int, dict]]:
    """{row: {seed: results.json}}: results/<name>/ first, then any completed run under runs/<name>/ (made by
    `commands` on another machine, say), copied in. A file that is not a run's record is skipped and added to
    `damaged` as (path, why), which the page names."""
    folder = results_dir / protocol["name"]
    found = {}
    damaged = [] if damaged is None else damaged
    for run in runs(protocol):
        kept = folder / kept_name(run)
        made = ROOT / run["out"] / "results.json"
        if not kept.exists() and made.exists():
            results, why = read_run(made)
            if results is None:
                damaged.append((made, why))
            elif not results.get("interrupted"):
                folder.mkdir(parents=True, exist_ok=True)
                files.write_json(kept, results)
        if kept.exists():
            results, why = read_run(kept)
            if results is None:
                damaged.append((kept, why))
            else:
                found.setdefault(run["row"], {})[run["seed"]] = results
    return found


def planned(argv: list[str]) -> dict:
    """The flags of a run's command that set its cost: model, batch size, --max_steps (None: by epochs)."""
    def flag(name, default=None):
        return argv[len(argv) - 1 - argv[::-1].index(name) + 1] if name in argv else default  # the last wins
    steps = flag("--max_steps")
    return {"method": Path(argv[0]).stem, "model": flag("--model_name_or_path", "bert-base-uncased"),
            "batch_size": int(flag("--batch_size", 0)) or None, "steps": int(steps) if steps else None}


def estimate(todo: list[dict], results_dir: Path) -> str:
    """Wall time of the runs still to make, from earlier runs under results/ (any protocol, report.py's
    timings): a run of the same command, or of the same method, model and batch size, scaled by the number of
    steps when --max_steps gives it. Runs with neither are counted as not estimated."""
    earlier = []
    for path in results_dir.rglob("*.json"):
        try:
            results = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(results, dict) and results.get("report", {}).get("wall_s") and results.get("args"):
            earlier.append(results)
    known, unknown = 0.0, 0
    for run in todo:
        want = planned(run["argv"])
        same = [r for r in earlier if r["method"] == want["method"] and r.get("steps")
                and r["args"].get("model_name_or_path") == want["model"]
                and r["args"].get("batch_size") == want["batch_size"]]
        if same and want["steps"]:
            known += sum(r["report"]["wall_s"] * want["steps"] / r["steps"] for r in same) / len(same)
        else:
            unknown += 1
    text = f"about {progress.duration(known)}, from earlier runs of the same settings" if known else ""
    if unknown:
        text += ("; " if text else "") + f"{unknown} run(s) not estimated (no earlier run of their settings)"
    return text or "nothing to run"


# ----------------------------------------------------------------------------------------------------- page
def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1); the deviation is nan for a single value."""
    n = len(values)
    mean = sum(values) / n
    return mean, (math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else math.nan)


def cell(mean: float, std: float, digits: int = 2) -> str:
    return f"{mean:.{digits}f}" if math.isnan(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def paper_cell(value) -> str:
    return cell(*value) if isinstance(value, tuple) else f"{value:.2f}"


def paired_difference(run: dict[int, float], base: dict[int, float]) -> tuple[float, float, bool, int]:
    """Mean of run - base over the seeds both have, its standard error, whether |mean| > 2 SE, and the pair count."""
    diffs = [run[s] - base[s] for s in sorted(run) if s in base]
    if not diffs:
        return math.nan, math.nan, False, 0
    mean, std = mean_std(diffs)
    se = std / math.sqrt(len(diffs))
    return mean, se, len(diffs) > 1 and abs(mean) > 2 * se, len(diffs)


def fmt_diff(mean: float, se: float, marked: bool) -> str:
    if math.isnan(mean):
        return "—"
    text = f"{mean:+.2f}" if math.isnan(se) else f"{mean:+.2f} ± {se:.2f}"
    return f"**{text}**" if marked else text


def score_rows(protocol: dict, found: dict, columns: list[str], key: str,
               baseline: tuple[str, dict] | None = None) -> list[str]:
    """For each row: the paper's cells (with their source), ours (mean ± std over the seeds), and ours − paper. With
    `baseline` ((its column's header, {row: its baseline row or None})), the rows are paired with their baselines
    instead: a last column, the seed-paired difference of the last score column to the baseline ± its standard error
    (in bold beyond two standard errors)."""
    lines = ["| row | n | " + " | ".join(columns) + (f" | {baseline[0]}" if baseline else "") + " |",
             "|---|---|" + "---|" * (len(columns) + bool(baseline))]
    for row in protocol["rows"]:
        by_seed = {s: r[key] for s, r in found.get(row["name"], {}).items() if key in r}
        source, paper = PAPER.get(row.get("paper"), (None, {})) if key == "test" and not baseline else (None, {})
        ours = {c: mean_std([v[c] for v in by_seed.values()]) for c in columns
                if by_seed and all(c in v for v in by_seed.values())}
        name = tables.markdown_cell(row["name"])
        if paper:
            lines.append(f"| {name}: paper ({source}) | | "
                         + " | ".join(paper_cell(paper[c]) if c in paper else "" for c in columns) + " |")
        lines.append(f"| {name}{': ours' if paper else ''} | {len(by_seed)} | "
                     + " | ".join(cell(*ours[c]) if c in ours else "—" for c in columns) + " |")
        if baseline:
            base = {s: r[key][columns[-1]] for s, r in found.get(baseline[1].get(row["name"]), {}).items() if key in r}
            diff = paired_difference({s: v[columns[-1]] for s, v in by_seed.items()}, base)[:3]
            lines[-1] += f" {fmt_diff(*diff) if baseline[1].get(row['name']) else '—'} |"
        if paper and ours:
            diffs = [f"{ours[c][0] - (paper[c][0] if isinstance(paper[c], tuple) else paper[c]):+.2f}"
                     if c in paper and c in ours else "" for c in columns]
            lines.append(f"| {name}: ours − paper | | " + " | ".join(diffs) + " |")
    return lines


def best_dev_rows(protocol: dict, found: dict, note: tuple[str, dict] | None = None) -> list[str]:
    """Each row's best STS-B dev (mean ± std over the seeds) and best steps, seed by seed; `note` ((its header,
    {row: text})): a last column (the smoke page's papers' averages)."""
    lines = ["| row | best dev (mean ± std) | best step (per seed) |" + (f" {note[0]} |" if note else ""),
             "|---|---|---|" + ("---|" if note else "")]
    for row in protocol["rows"]:
        by_seed = found.get(row["name"], {})
        if by_seed:
            devs = [r["best_dev_stsb"] for r in by_seed.values() if r.get("best_dev_stsb") is not None]
            lines.append(f"| {tables.markdown_cell(row['name'])} | {cell(*mean_std(devs)) if devs else '—'} | "
                         + ", ".join(str(by_seed[s].get("best_step")) for s in sorted(by_seed)) + " |"
                         + (f" {note[1][row['name']]} |" if note else ""))
    return lines


def write_page(protocol: dict, results_dir: Path, plots: bool = True, underway: dict | None = None) -> Path:
    """results/<name>/RESULTS.md (and its plots) from whatever runs exist; the missing ones are listed, those whose
    jobs are pending or running (`underway`: {(row, seed): state}, tools/cluster.py) as such."""
    damaged = []
    found = collect(protocol, results_dir, damaged)
    folder = results_dir / protocol["name"]
    folder.mkdir(parents=True, exist_ok=True)
    every = runs(protocol)
    missing = [r for r in every if r["seed"] not in found.get(r["row"], {})]
    lines = [f"# Protocol `{protocol['name']}`", "", protocol.get("description", ""), "",
             f"{len(every) - len(missing)} of {len(every)} runs done (seeds {', '.join(map(str, protocol['seeds']))}"
             f"). Each cell: mean ± sample standard deviation over the seeds; a paper's ± is its own. The tables "
             "are also in `latex/` and every run in `runs.csv`, beside this page.", "",
             *[line + "\n" for line in tables.provenance_lines([r for s in found.values() for r in s.values()])]]
    underway = underway or {}
    for state in ("running", "pending"):
        these = [r for r in missing if underway.get((r["row"], r["seed"])) == state]
        if these:
            lines += [f"{state.capitalize()} (`python tools/report.py status --protocol {protocol['name']}`): "
                      + ", ".join(f"{tables.markdown_cell(r['row'])} seed {r['seed']}" for r in these) + ".", ""]
    missing = [r for r in missing if (r["row"], r["seed"]) not in underway]
    if missing:
        lines += ["Missing (run them with `python tools/report.py run`, or the lines of `commands`): "
                  + ", ".join(f"{tables.markdown_cell(r['row'])} seed {r['seed']}" for r in missing) + ".", ""]
    if damaged:
        lines += ["Skipped, not a run's record: " + "; ".join(f"`{path}` ({why})" for path, why in damaged) + ".", ""]
    lines += ["## STS test (best STS-B dev checkpoint)", ""] + score_rows(protocol, found, STS, "test") + [""]
    if any("transfer" in r for by_seed in found.values() for r in by_seed.values()):
        lines += ["## Transfer (SentEval)", ""] + score_rows(protocol, found, TRANSFER, "transfer") + [""]
    lines += ["## Best STS-B dev", ""] + best_dev_rows(protocol, found)
    if precision_lines(protocol):
        lines += ["", "## Precision", "", "Each row at the precision its paper's released scripts trained in:", ""] \
            + [f"- {line}" for line in precision_lines(protocol)]
    lines += ["", "## Commands", "", "```bash"] + [command_line(r) for r in every] + ["```", ""]
    page = folder / "RESULTS.md"
    save_page(lines, page, protocol, found, damaged, folder)
    if plots:
        plot_dev_curves(protocol, found, folder / "dev_curves.png")
    if plots and protocol.get("sweep"):
        plot_sweep(protocol, found, folder / "sweep.png")
    if plots and protocol["name"] == "fewshot":
        plot_few_shot(found, folder / "few_shot.png")
    return page


def save_page(lines: list[str], page: Path, protocol: dict, found: dict, damaged: list, tables_dir: Path,
              papers: dict | None = None, titles: tuple = ("STS test (best STS-B dev checkpoint)",)) -> None:
    """The page, and for a paper its tables in LaTeX (`papers`, {row: the paper's average}, beside ours in the
    tables `titles` names; default: the rows' PAPER averages) and every run in a CSV, in `tables_dir`."""
    page.write_text("\n".join(lines))
    print(f"wrote {page}")
    if damaged:
        print(skipped_line(damaged, page))
    if papers is None:
        papers = {row["name"]: paper_cell(PAPER[row["paper"]][1]["avg"]).split(" ")[0] for row in protocol["rows"]
                  if "avg" in PAPER.get(row.get("paper"), (None, {}))[1]}
    tables.write_latex(lines, tables_dir / "latex", {title: papers for title in titles})
    tables.write_csv([tables.run_row(row["name"], row["script"], row.get("flags", []), seed, result)
                      for row in protocol["rows"] for seed, result in sorted(found.get(row["name"], {}).items())],
                     tables_dir / "runs.csv")


def plot_text(text) -> str:
    """A name as matplotlib shows it: its dollar signs literal (else mathtext reads them)."""
    return str(text).replace("$", r"\$")


def finish(fig, ax, path: Path, xlabel: str, ylabel: str, title: str, **title_style) -> None:
    """A one-panel figure's axis labels, title, grid (a log axis's minor lines too) and legend, then saved."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, **title_style)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    files.save_figure(fig, path)


def plot_dev_curves(protocol: dict, found: dict, path: Path, panels: list | None = None, title: str = "") -> None:
    """STS-B dev at the dev gates of each row's runs: the mean over seeds, with their min-max band. `panels`:
    [(its title, its rows' names)] side by side (default: every row in one)."""
    plt = files.pyplot()
    every_row = [row["name"] for row in protocol["rows"]]
    panels = panels or [(f"Protocol {protocol['name']}: STS-B dev during training", every_row)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), sharey=True, squeeze=False)
    for ax, (panel, names) in zip(axes[0], panels):
        for name in names:
            curves = [{r["step"]: r["stsb_dev"] for r in files.trajectory(results) if r.get("gate")}
                      for results in found.get(name, {}).values()]
            steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if steps:
                per_step = [[c[s] for c in curves] for s in steps]
                line, = ax.plot(steps, [sum(v) / len(v) for v in per_step], marker="o", markersize=3,
                                label=f"{plot_text(name)} (n={len(curves)})")
                ax.fill_between(steps, [min(v) for v in per_step], [max(v) for v in per_step], alpha=0.15,
                                color=line.get_color())
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no runs yet", transform=ax.transAxes, ha="center", color="gray")
    axes[0][0].set_ylabel("STS-B dev Spearman × 100 (mean; band: min–max over seeds)")
    if title:
        fig.suptitle(title)
    files.save_figure(fig, path)


def plot_sweep(protocol: dict, found: dict, path: Path) -> None:
    """STS-B dev and the 7-task STS average against the swept value: mean over seeds, min-max band."""
    plt = files.pyplot()
    values = protocol["sweep"]["values"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (label, get) in zip(axes, (("best STS-B dev", lambda r: r.get("best_dev_stsb")),
                                       ("STS test, 7-task average", lambda r: r.get("test", {}).get("avg")))):
        xs, means, lows, highs = [], [], [], []
        for value, row in zip(values, protocol["rows"]):
            scores = [get(r) for r in found.get(row["name"], {}).values() if get(r) is not None]
            if scores:
                xs.append(value)
                means.append(sum(scores) / len(scores))
                lows.append(min(scores))
                highs.append(max(scores))
        positions = range(len(xs))
        ax.plot(positions, means, marker="o")
        ax.fill_between(positions, lows, highs, alpha=0.2)
        ax.set_xticks(list(positions), [plot_text(x) for x in xs])
        ax.set_xlabel(f"--{protocol['sweep']['flag']}")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{protocol['description']}\nmean over seeds; band: min–max", fontsize=9)
    files.save_figure(fig, path)


def plot_few_shot(found: dict, path: Path) -> None:
    """miCSE Figure 3: the 7-task average against the training-set fraction, ours (mean ± std) and the paper's."""
    plt = files.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = list(FEW_SHOT_FRACTIONS)
    for method in FEW_SHOT_METHODS:
        paper = [PAPER[f"{method}-{label}"][1]["avg"] for label in labels]
        line, = ax.plot(range(len(labels)), [p[0] if isinstance(p, tuple) else p for p in paper], linestyle="--",
                        marker="x", label=f"{method} (paper)")
        xs, means, stds = [], [], []
        for i, label in enumerate(labels):
            scores = [r["test"]["avg"] for r in found.get(f"{method}-{label}", {}).values() if "test" in r]
            if scores:
                xs.append(i)
                mean, std = mean_std(scores)
                means.append(mean)
                stds.append(0.0 if math.isnan(std) else std)
        if xs:
            ax.errorbar(xs, means, yerr=stds, marker="o", color=line.get_color(), label=f"{method} (ours)")
    ax.set_xticks(range(len(labels)), labels)
    finish(fig, ax, path, "training set (fraction of wiki1m)", "STS 7-task average",
           "Few-shot STS (miCSE Table 2 / Figure 3)")

