"""The papers' analyses for any checkpoint or run: a figure (PNG) and its numbers (JSON) each.

    python tools/analyze.py trajectory runs/simcse/results.json runs/micse/results.json
    python tools/analyze.py spectrum --model_name_or_path bert-base-uncased runs/simcse/best --pooler cls_before_pooler
    python tools/analyze.py similarity runs/simcse/results.json runs/sscl/results.json
    python tools/analyze.py setsim --model_name_or_path bert-base-uncased runs/sscl/best --pooler avg

- trajectory: l_align against l_uniform along training, one line per run, arrows in time order (SimCSE Figure 2,
  WhitenedCSE Figure 3, SimCSE++ Appendix A), from results.json's trajectory: a point at every dev gate, and every
  N steps with `--align_uniform_steps N` (SimCSE's Figure 2 used 10). A results.json from before the trajectory
  was recorded gives its initial -> best arrow.
- spectrum: the singular values of the matrix of STS-B test sentence embeddings, divided by the largest (SimCSE
  Figure F.1), on a log scale, and the effective rank (Roy & Vetterli 2007, "The effective rank: a measure of
  effective dimensionality", EUSIPCO): exp of the entropy of the singular values normalised to sum 1 (SimCSE++
  Section 4's rank argument).
- similarity: the cosine similarity of every STS-B test pair by gold-score group [0,1), [1,2), [2,3), [3,4), [4,5]
  (SimCSE Figure G.1), with each pair's cosine and gold score in the JSON.
- setsim: SetSim (SSCL Eq. 2) of adjacent transformer layers, averaged over the distinct STS-B test sentences
  (SSCL Figure 1): sscl.py's set_sim and oversmoothing, which sscl.py --report_oversmoothing uses too.

Models: `--model_name_or_path A B ...` (a hub id or folder, with `--pooler`, one for all or one each), or a run's
results.json given as a positional argument (before the options): its best/ checkpoint with its evaluation
pooler. `--labels` name the lines, the --model_name_or_path models first (default: the paths; a run's method and
folder). Output: `--out DIR` (default analysis/) gets <analysis>.png and <analysis>.json; existing ones are
replaced only with --overwrite.
Choices: the spectrum is of L2-normalised embeddings (the space of cosine similarity and of l_uniform), not
centred, since the shared mean direction is part of the anisotropy it shows (SimCSE F.1 does not say); SimCSE's
figures use STS-B without naming the split, and the test split is used here (--split dev for the dev split); for
SetSim a [CLS] pooler reads [CLS] before any MLP, in every layer.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's modules

import common  # noqa: E402
import eval_sts  # noqa: E402
import plumbing  # noqa: E402
import sscl  # noqa: E402
from plumbing import files, hub  # noqa: E402
from protocols import finish  # noqa: E402

ANALYSES = ("trajectory", "spectrum", "similarity", "setsim")
SCORE_GROUPS = ((0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (3.0, 4.0), (4.0, 5.0))  # SimCSE Figure G.1


# --------------------------------------------------------------------------------------- measurements (pure)
def trajectory_points(results: dict) -> list[dict]:
    """The (step, align, uniform) points of a run in time order: the trajectory's rows that have them, or, for a
    results.json without them, its initial and best checkpoints (steps 0 and best_step)."""
    points = [{"step": row["step"], "align": row["align"], "uniform": row["uniform"]}
              for row in files.trajectory(results) if row.get("align") is not None]
    if not points and "align_uniform" in results:
        ends = results["align_uniform"]
        points = [{"step": step, "align": ends[which]["align"], "uniform": ends[which]["uniform"]}
                  for which, step in (("initial", 0), ("best", results.get("best_step")))]
    return points


def spectrum(matrix: np.ndarray) -> np.ndarray:
    """The singular values of `matrix`, largest first, divided by the largest (SimCSE Figure F.1)."""
    singular_values = np.linalg.svd(np.asarray(matrix, dtype=np.float64), compute_uv=False)
    return singular_values / singular_values[0]


def effective_rank(singular_values: np.ndarray) -> float:
    """Roy & Vetterli (2007): exp(H(p)), p_k = s_k / sum(s), H the Shannon entropy (0 log 0 = 0). n for n equal
    singular values, 1 for one non-zero value."""
    s = np.asarray(singular_values, dtype=np.float64)
    p = s[s > 0] / s.sum()
    return float(np.exp(-(p * np.log(p)).sum()))


def unit_rows(matrix: np.ndarray) -> np.ndarray:
    return eval_sts.unit_rows(np.asarray(matrix, dtype=np.float64))


def similarity_groups(cosines, gold) -> list[dict]:
    """SimCSE Figure G.1's groups: the cosines of the pairs whose gold score lies in [0,1), ..., [3,4), [4,5], with
    their count, mean and standard deviation (None for an empty group)."""
    cosines, gold = np.asarray(cosines, dtype=np.float64), np.asarray(gold, dtype=np.float64)
    groups = []
    for low, high in SCORE_GROUPS:
        inside = (gold >= low) & ((gold < high) if high < 5.0 else (gold <= high))
        values = cosines[inside]
        groups.append({"gold": f"{low:g}-{high:g}", "count": int(inside.sum()),
                       "mean": round(float(values.mean()), 4) if len(values) else None,
                       "std": round(float(values.std()), 4) if len(values) else None,
                       "cosines": [round(float(v), 4) for v in values]})
    return groups


def stsb_embeddings(encode, senteval_dir, split: str = "test"):
    """(pairs, {sentence: vector}) of STS-B `split`, each distinct sentence encoded once."""
    pairs = eval_sts.load_pairs(senteval_dir, "STSBenchmark", split)
    return pairs, eval_sts.encode_unique(encode, [s for p in pairs for s in p[:2]], desc=f"STS-B {split}")


def measure_spectrum(encode, senteval_dir, split: str = "test") -> dict:
    _, table = stsb_embeddings(encode, senteval_dir, split)
    values = spectrum(unit_rows(np.stack(list(table.values()))))
    return {"sentences": len(table), "effective_rank": round(effective_rank(values), 2),
            "singular_values": [round(float(v), 6) for v in values]}


def measure_similarity(encode, senteval_dir, split: str = "test") -> dict:
    pairs, table = stsb_embeddings(encode, senteval_dir, split)
    left, right = (unit_rows(np.stack([table[p[i]] for p in pairs])) for i in (0, 1))
    cosines = np.sum(left * right, axis=1)
    gold = [p[2] for p in pairs]
    return {"groups": similarity_groups(cosines, gold), "cosine": [round(float(c), 4) for c in cosines], "gold": gold}


# ----------------------------------------------------------------------------------------------- figures
def plot_trajectory(runs: dict, path: Path) -> None:
    plt = files.pyplot()
    fig, ax = plt.subplots(figsize=(7, 5.5))
    starts = set()  # runs from the same checkpoint share a start: label it once
    for label, points in runs.items():
        x, y = [p["uniform"] for p in points], [p["align"] for p in points]
        line, = ax.plot(x, y, marker="o", markersize=3, linewidth=0.8, label=label)
        for i in range(len(points) - 1):
            ax.annotate("", xy=(x[i + 1], y[i + 1]), xytext=(x[i], y[i]),
                        arrowprops=dict(arrowstyle="->", color=line.get_color(), lw=1.0))
        if (x[0], y[0]) not in starts:
            ax.annotate(f"step {points[0]['step']}", (x[0], y[0]), fontsize=7, color=line.get_color(),
                        xytext=(4, 4), textcoords="offset points")
            starts.add((x[0], y[0]))
        ax.annotate(f"step {points[-1]['step']}", (x[-1], y[-1]), fontsize=7, color=line.get_color(),
                    xytext=(4, -10), textcoords="offset points")
    finish(fig, ax, path, "ℓ_uniform (lower is better)", "ℓ_align (lower is better)",
           "ℓ_align–ℓ_uniform along training, STS-B dev (SimCSE Figure 2)", fontsize=10)


def plot_spectrum(measured: dict, path: Path) -> None:
    plt = files.pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    for label, m in measured.items():
        values = m["singular_values"]
        ax.plot(range(1, len(values) + 1), values, label=f"{label} (effective rank {m['effective_rank']:.1f})")
    ax.set_yscale("log")
    finish(fig, ax, path, "index", "singular value / largest (log scale)",
           "Singular values of the STS-B sentence embeddings (SimCSE Figure F.1)", fontsize=10)


def plot_similarity(measured: dict, path: Path) -> None:
    """One panel per model: a density of the cosine similarities for each gold-score group, stacked along y."""
    from scipy.stats import gaussian_kde
    plt = files.pyplot()
    fig, axes = plt.subplots(1, len(measured), figsize=(4.2 * len(measured), 4.5), sharey=True, squeeze=False)
    grid = np.linspace(-1, 1, 400)
    for ax, (label, m) in zip(axes[0], measured.items()):
        for level, group in enumerate(m["groups"]):
            values = np.array(group["cosines"])
            if len(values) > 1 and values.std() > 0:
                density = gaussian_kde(values)(grid)
                ax.fill_between(grid, level, level + 0.9 * density / density.max(), alpha=0.6)
            ax.plot(values, np.full(len(values), level), "|", color="black", alpha=0.3, markersize=4)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("cosine similarity")
        ax.set_xlim(min(-0.2, min(min(m["cosine"]), 0)), 1.0)
        ax.grid(alpha=0.3)
    axes[0][0].set_yticks(range(len(SCORE_GROUPS)), [f"{lo:g}-{hi:g}" for lo, hi in SCORE_GROUPS])
    axes[0][0].set_ylabel("gold score group")
    fig.suptitle("Cosine similarity of STS-B pairs by gold score (SimCSE Figure G.1)")
    files.save_figure(fig, path)


def plot_setsim(measured: dict, path: Path) -> None:
    plt = files.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, setsim in measured.items():
        ax.plot(list(setsim), list(setsim.values()), marker="o", label=label)
    finish(fig, ax, path, "adjacent layers", "SetSim (mean cosine)",
           "Inter-layer similarity of sentence representations (SSCL Figure 1)", fontsize=10)


# ------------------------------------------------------------------------------------------------- CLI
def read_results(path: str) -> dict:
    """A run's results.json; one line for a missing, unreadable, truncated or non-object file, or a file of
    another kind (a run's record has its best STS-B dev score and step)."""
    try:
        results = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise plumbing.UsageError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise plumbing.UsageError(f"{path} is a folder; give its results.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise plumbing.UsageError(f"{path} is not a results.json: {err}") from None
    if not isinstance(results, dict) or "best_step" not in results:
        kind = f"a JSON {type(results).__name__}" if not isinstance(results, dict) else "another file"
        raise plumbing.UsageError(f"{path} is not a run's results.json (it has no best_step: {kind})")
    return results


def run_label(path: str, results: dict) -> str:
    """A run's default label: its method and folder."""
    return f"{results.get('method', '?')} ({Path(path).parent.name})"


def models(args) -> list[tuple[str, str, str]]:
    """(label, model path, pooler) of every model: --model_name_or_path with --pooler, then each results.json's
    best/ with its evaluation pooler."""
    if len(args.pooler) not in (1, len(args.model_name_or_path)):
        raise plumbing.UsageError(f"--pooler: give one for all models or one for each of the "
                                  f"{len(args.model_name_or_path)}")
    poolers = args.pooler * len(args.model_name_or_path) if len(args.pooler) == 1 else args.pooler
    found = [(name, name, pooler) for name, pooler in zip(args.model_name_or_path, poolers)]
    for path in args.runs:
        results = read_results(path)
        best = Path(path).parent / "best"
        if not best.is_dir():
            raise plumbing.UsageError(f"{path}: its checkpoint {best} is not there")
        found.append((run_label(path, results), str(best), results.get("eval_pooler", "cls_before_pooler")))
    return found


def main(argv=None) -> None:
    parser = plumbing.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("analysis", choices=ANALYSES)
    parser.add_argument("runs", nargs="*", default=[], help="results.json files (a run's trajectory; for the other "
                                                            "analyses its best/ checkpoint)")
    parser.add_argument("--model_name_or_path", nargs="+", default=[], help="checkpoints: hub ids or folders")
    parser.add_argument("--pooler", nargs="+", default=["cls_before_pooler"], choices=common.POOLERS,
                        help="the --model_name_or_path models' pooler: one for all or one each")
    parser.add_argument("--labels", nargs="+", default=None,
                        help="a name for each line: the --model_name_or_path models first, then the runs")
    parser.add_argument("--senteval_dir", default=None, help="SentEval data folder (default: HF senteval.tar)")
    parser.add_argument("--split", default="test", choices=["test", "dev"], help="the STS-B split (default test)")
    parser.add_argument("--out", default="analysis", help="folder for <analysis>.png and <analysis>.json")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing <analysis>.png / .json")
    parser.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda if available)")
    args = parser.parse_args(argv)
    plumbing.check_installed(True, "matplotlib", "analyze.py")
    out = Path(args.out)
    png, json_path = out / f"{args.analysis}.png", out / f"{args.analysis}.json"
    if out.exists() and not out.is_dir():
        raise plumbing.UsageError(f"--out {out} is a file; give a folder")
    if not args.overwrite and (png.exists() or json_path.exists()):
        raise plumbing.UsageError(f"{png} or {json_path} exists; pass --overwrite or another --out")
    plumbing.check_writable(out, "--out")  # permissions, a read-only file system, a full disk

    measured = {}
    if args.analysis == "trajectory":
        if args.model_name_or_path or not args.runs:
            raise plumbing.UsageError("trajectory reads runs' results.json files: analyze.py trajectory "
                                      "runs/a/results.json runs/b/results.json")
        runs = [(path, read_results(path)) for path in args.runs]  # each file read once
        labels = check_labels(args.labels, [run_label(path, results) for path, results in runs])
        for label, (path, results) in zip(labels, runs):
            points = trajectory_points(results)
            if not points:
                raise plumbing.UsageError(f"{path} has no alignment/uniformity: an interrupted run, or not a "
                                          "training run's results.json")
            measured[label] = points
        out.mkdir(parents=True, exist_ok=True)
        plot_trajectory(measured, png)
    else:
        found = models(args)
        if not found:
            raise plumbing.UsageError(f"{args.analysis} needs models: --model_name_or_path A B ... or runs' "
                                      "results.json files")
        labels = check_labels(args.labels, [label for label, _, _ in found])
        for _, path, _ in found:  # every local model's files read before the first is measured
            if Path(path).is_dir():
                hub.check_model_folder(Path(path), "--model_name_or_path")
        senteval_dir = eval_sts.resolve_senteval_dir(args.senteval_dir, check=["STSBenchmark"])
        device = plumbing.resolve_device(args.device)
        for label, (_, path, pooler) in zip(labels, found):
            if args.analysis == "setsim":
                tokenizer, backbone = hub.load_pretrained(path)
                pairs = eval_sts.load_pairs(senteval_dir, "STSBenchmark", args.split)
                sentences = sorted({s for pair in pairs for s in pair[:2]})
                measured[label] = sscl.oversmoothing(backbone.to(device), tokenizer, pooler, sentences, device,
                                                     f"SetSim: {label}")
                print(f"{label} ({pooler}): SetSim {measured[label]}")
            elif args.analysis == "spectrum":
                measured[label] = measure_spectrum(eval_sts.load_encode(path, pooler, device), senteval_dir, args.split)
                print(f"{label} ({pooler}): effective rank {measured[label]['effective_rank']}")
            else:
                measured[label] = measure_similarity(eval_sts.load_encode(path, pooler, device), senteval_dir,
                                                     args.split)
                means = ", ".join(f"{g['gold']}: {g['mean']}" for g in measured[label]["groups"])
                print(f"{label} ({pooler}): mean cosine by gold score {means}")
        out.mkdir(parents=True, exist_ok=True)
        {"spectrum": plot_spectrum, "similarity": plot_similarity, "setsim": plot_setsim}[args.analysis](measured, png)
    split = "dev" if args.analysis == "trajectory" else args.split  # the trajectory is measured on STS-B dev
    files.write_json(json_path, {"analysis": args.analysis, "stsb_split": split, "results": measured})
    print(f"wrote {json_path}")


def check_labels(labels, defaults: list[str]) -> list[str]:
    labels = defaults if labels is None else labels
    if len(labels) != len(defaults):
        raise plumbing.UsageError(f"--labels: {len(labels)} given for {len(defaults)} lines")
    if len(set(labels)) < len(labels):
        raise plumbing.UsageError(f"two lines would have the same label ({', '.join(labels)}); give --labels")
    return labels


if __name__ == "__main__":
    plumbing.cli(main)
