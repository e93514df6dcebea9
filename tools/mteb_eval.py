"""MTEB on any checkpoint, with the suite's own encoder and pooler (eval_sts.load_encode: the same as eval_sts.py),
so that the numbers belong to the model a run selected; a new sentence encoder is reported on MTEB as well as on
SentEval's STS. The mteb package is an optional install (pip install mteb). Not tools/mteb.py: a script of that
name would shadow the package it imports (run as a script, its folder comes first on the import path).

    python tools/mteb_eval.py --model_name_or_path runs/simcse/best                  # the papers' 7 STS tasks
    python tools/mteb_eval.py --model_name_or_path princeton-nlp/unsup-simcse-bert-base-uncased \\
        --pooler cls_before_pooler --tasks STS12 STSBenchmark STS22
    python tools/mteb_eval.py --model_name_or_path runs/simcse/best --sts_file pairs.csv   # your own pairs, offline

MTEB's own result files go under --output_dir (default: a run's folder/mteb for its best/, <model>/mteb for another
local model, runs/mteb/<name> for a Hub id), in its ResultCache layout (results/<model>/<revision>/<task>.json),
with a table printed and written beside them (scores.md, scores.json): each task's main score (for STS: Spearman of
the cosine similarities) x 100. On a run's best/, the scores of MTEB's Hub tasks also go into the run's
results.json ("mteb") and its model card's model-index (MTEB's task names, datasets, revisions and splits), and the
model is named by the run's --hub_model_id (or this one's) in MTEB's metadata.

MTEB downloads each task's data from the Hub on first use (its cache keeps it); offline, give --sts_file, a CSV or
TSV of sentence1, sentence2, score: a local STS task scored as MTEB scores STS (on STS-B's test pairs, the Spearman
correlation eval_sts.py computes: tests/test_ecosystem.py). How MTEB's STS numbers relate to the papers': docs/using.md.
"""
from __future__ import annotations

import argparse
import csv
import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's modules

import numpy as np  # noqa: E402
import torch  # noqa: E402

import eval_sts  # noqa: E402
import common  # noqa: E402
import plumbing  # noqa: E402
from plumbing import hub, outdir, provenance  # noqa: E402

# the papers' 7 STS tasks by MTEB's names (SentEval's SICKRelatedness is MTEB's SICK-R)
PAPERS_STS = ["STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICK-R"]


class SuiteEncoder:
    """MTEB's encoder protocol around the suite's encode(list[str]) (eval mode, fp32, the pooler given): MTEB's
    batches of texts in, embeddings out; cosine similarity, as the suite scores STS."""

    def __init__(self, encode, name: str, mteb):
        self.encode_texts = encode
        from mteb.models.model_meta import ScoringFunction
        meta = mteb.models.ModelMeta.create_empty()
        self.mteb_model_meta = meta.model_copy(update={"name": name, "revision": "local",
                                                       "similarity_fn_name": ScoringFunction.COSINE})

    def encode(self, inputs, *, task_metadata=None, hf_split=None, hf_subset=None, prompt_type=None, **kwargs):
        return np.concatenate([np.asarray(self.encode_texts(list(batch["text"]))) for batch in inputs])

    def similarity(self, a, b):
        a, b = torch.as_tensor(np.asarray(a), dtype=torch.float32), torch.as_tensor(np.asarray(b), dtype=torch.float32)
        return torch.nn.functional.normalize(a, dim=-1) @ torch.nn.functional.normalize(b, dim=-1).T

    def similarity_pairwise(self, a, b):
        a, b = torch.as_tensor(np.asarray(a), dtype=torch.float32), torch.as_tensor(np.asarray(b), dtype=torch.float32)
        return torch.nn.functional.cosine_similarity(a, b)


def read_pairs(path: Path) -> dict:
    """--sts_file: sentence1, sentence2, score columns (a header names them, else the first three columns)."""
    text = plumbing.read_lines(str(path), "--sts_file")
    rows = list(csv.reader(text, delimiter="\t" if path.suffix in (".tsv", ".txt") else ","))
    header = [c.strip().lower() for c in rows[0]] if rows else []
    columns = [header.index(c) for c in ("sentence1", "sentence2", "score")] if {"sentence1", "sentence2",
                                                                                 "score"} <= set(header) else None
    pairs = {"sentence1": [], "sentence2": [], "score": []}
    for number, row in enumerate(rows[1:] if columns else rows, start=2 if columns else 1):
        try:
            a, b, score = (row[i] for i in columns) if columns else row[:3]
            pairs["score"].append(float(score))
        except (ValueError, IndexError):
            raise plumbing.UsageError(f"--sts_file {path}, line {number}: want sentence1, sentence2 and a numeric "
                                      f"score, got {row[:3]}") from None
        pairs["sentence1"].append(a)
        pairs["sentence2"].append(b)
    if len(pairs["score"]) < 2 or len(set(pairs["score"])) < 2:
        raise plumbing.UsageError(f"--sts_file {path}: fewer than 2 pairs, or every score the same (a correlation "
                                  "needs scores that vary)")
    return pairs


def local_sts_task(mteb, path: Path):
    """An MTEB STS task of the pairs in `path` (its test split), with STS-B's metadata but its own name: scored
    exactly as MTEB scores its STS tasks."""
    import datasets
    pairs = read_pairs(path)
    low, high = min(pairs["score"]), max(pairs["score"])

    class LocalSTS(mteb.abstasks.AbsTaskSTS):
        metadata = mteb.get_task("STSBenchmark").metadata.model_copy(update={
            "name": f"local-{path.stem}", "description": f"STS pairs of {path}", "reference": None,
            "dataset": {"path": str(path), "revision": "local"}, "eval_splits": ["test"],
            "superseded_by": None})
        min_score, max_score = low, high

        def load_data(self, **kwargs):
            self.dataset = {"default": {"test": datasets.Dataset.from_dict(pairs)}}
            self.data_loaded = True
    return LocalSTS()


def main_score(result) -> float:
    """A task's main score: its test split's (else the split it is scored on), the mean over its subsets (a
    multilingual task's languages: give --tasks of one language's task to compare with SentEval)."""
    split = "test" if "test" in result.scores else next(iter(result.scores))
    return float(np.mean([subset["main_score"] for subset in result.scores[split]]))


def card_entries(metadata: dict, task_results) -> list[dict]:
    """The model-index entries (huggingface_hub.EvalResult's fields) of the tasks with a dataset on the Hub: one a
    split and subset, MTEB's main score x 100 (a local --sts_file task has none). `metadata`: {name: the task's
    metadata}, as the tasks had it before the evaluation."""
    return [{"task_type": meta.type, "dataset_type": meta.dataset["path"], "dataset_name": f"MTEB {result.task_name}",
             "dataset_config": subset["hf_subset"], "dataset_split": split,
             "dataset_revision": meta.dataset["revision"], "metric_type": meta.main_score,
             "metric_value": round(100 * subset["main_score"], 2), "metric_name": f"{meta.main_score} x 100 (MTEB)"}
            for result in task_results if (meta := metadata[result.task_name]).dataset["revision"] != "local"
            for split, subsets in result.scores.items() for subset in subsets]


def into_run(model: str, entries: list[dict], pooler: str) -> str | None:
    """A run's best/: MTEB's entries added to its results.json and card (replacing a task's earlier ones); what was
    written, or why not."""
    run_dir = Path(model).expanduser().parent
    if Path(model).name != "best" or not (run_dir / outdir.RESULTS).is_file():
        return None
    if not entries:
        return "note: a local --sts_file task is not written into the run's card (its data is a local file)"
    results = outdir.read_results(run_dir)
    if pooler != results.get("eval_pooler"):
        return f"note: not written into {run_dir}'s card: its pooler is {results.get('eval_pooler')}, not {pooler}"
    if results.get("interrupted"):
        return f"note: not written into {run_dir}'s card: the run has not ended (finish it with --auto_resume)"
    new = {(e["dataset_name"], e["dataset_config"], e["dataset_split"]) for e in entries}
    kept = [e for e in results.get("mteb") or []
            if (e["dataset_name"], e["dataset_config"], e["dataset_split"]) not in new]
    try:
        provenance.record_scores(run_dir, mteb=kept + entries)
    except plumbing.UsageError:  # the folder's lock: a run holds it
        return f"note: not written into {run_dir}'s card: a run is using the folder (run this again once it ends)"
    return f"wrote MTEB's scores into {run_dir / outdir.RESULTS} and {run_dir / 'best' / 'README.md'}"


def output_folder(model: str, given: str | None) -> Path:
    if given:
        return Path(given)
    local = Path(model).expanduser()
    if local.is_dir():  # a run's best/: the run's folder; another model's folder: inside it
        return local.parent / "mteb" if local.name == "best" else local / "mteb"
    return Path("runs") / "mteb" / model.replace("/", "__")


def evaluate(model: str, pooler: str | None, tasks: list[str], sts_file: str | None, output_dir: str | None,
             device, batch_size: int = 128, hub_model_id: str | None = None) -> dict:
    """{task: main score x 100} of `model` on MTEB's `tasks` (and the --sts_file task), MTEB's result files and the
    table under the output folder."""
    plumbing.check_installed(True, "mteb", "tools/mteb_eval.py")
    mteb = importlib.import_module("mteb")
    pooler = eval_sts.checkpoint_pooler(model, pooler)
    chosen = [local_sts_task(mteb, Path(sts_file))] if sts_file else []
    if tasks:
        try:
            chosen += list(mteb.get_tasks(tasks=tasks))
        except (KeyError, ValueError) as err:
            reason = str(err.args[0] if err.args else err).strip("'\"").splitlines()[0]
            raise plumbing.UsageError(f"--tasks: {reason}; the STS tasks' names: python -c \"import mteb; "
                                      "print([t.metadata.name for t in mteb.get_tasks(task_types=['STS'])])\"") \
                from None
    out = output_folder(model, output_dir)
    plumbing.check_writable(str(out), "--output_dir")
    encode = eval_sts.load_encode(model, pooler, device)
    local = Path(model).expanduser().resolve()
    # a run's best/ by its run's folder (runs would collide in a shared cache as "best")
    own = (local.parent.name + "-best") if local.name == "best" else local.name
    name = hub_model_id or recorded_hub_id(local) or (f"suite/{own}" if local.is_dir() else model)
    encoder = SuiteEncoder(encode, name, mteb)
    metadata = {task.metadata.name: task.metadata for task in chosen}
    try:
        found = mteb.evaluate(encoder, chosen, cache=mteb.ResultCache(str(out)), show_progress_bar=False,
                              encode_kwargs={"batch_size": batch_size}, overwrite_strategy="always")
    except (OSError, ConnectionError) as err:  # an MTEB task's data not in the Hub cache, offline
        other = "leave out --tasks: --sts_file alone scores your pairs offline" if sts_file else "give --sts_file"
        raise plumbing.UsageError(f"an MTEB task's data could not be loaded ({str(err).splitlines()[0][:160]}): run "
                                  f"once with internet (the Hub's cache keeps it), or {other}") from None
    scores = {result.task_name: round(100 * main_score(result), 2) for result in found.task_results}
    table = "\n".join([f"MTEB on {model} (pooler {pooler}); main score x 100 (STS: Spearman of the cosine "
                       "similarities)", "", "| task | score |", "|---|---|",
                       *(f"| {task} | {score:.2f} |" for task, score in scores.items())])
    (out / "scores.md").write_text(table + "\n")
    (out / "scores.json").write_text(json.dumps({"model": model, "pooler": pooler, "scores": scores}, indent=2))
    print(table)
    print(f"\nwrote {out / 'scores.md'} and MTEB's result files under {out / 'results'}")
    written = into_run(model, card_entries(metadata, found.task_results), pooler)
    if written:
        print(written)
    return scores


def recorded_hub_id(local: Path) -> str | None:
    """The --hub_model_id a run recorded, for its best/."""
    if local.name != "best" or not (local.parent / outdir.RESULTS).is_file():
        return None
    return outdir.read_results(local.parent)["args"].get("hub_model_id")


def main(argv=None) -> dict:
    parser = plumbing.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="a run's best/, any local model or a Hub id")
    parser.add_argument("--pooler", default=None, choices=common.POOLERS, help="default: the one the training run "
                        "recorded (best/eval_pooler.json), else cls_before_pooler, as eval_sts.py")
    parser.add_argument("--tasks", nargs="*", default=None,
                        help="MTEB task names (default: the papers' 7 STS tasks, unless --sts_file is given)")
    parser.add_argument("--sts_file", default=None, help="a local STS task: CSV/TSV of sentence1, sentence2, score")
    parser.add_argument("--output_dir", default=None, help="MTEB's result files and the table")
    parser.add_argument("--hub_model_id", default=None,
                        help="the model's name in MTEB's metadata (default: the run's --hub_model_id, for its best/)")
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda if available)")
    args = parser.parse_args(argv)
    tasks = args.tasks if args.tasks is not None else [] if args.sts_file else PAPERS_STS
    if not tasks and not args.sts_file:
        parser.error("give --tasks or --sts_file")
    provenance.run_of(args.model_name_or_path, False, True)  # a run's folder: one line naming its best/
    hub.check_local_model(args.model_name_or_path)
    if args.sts_file:
        plumbing.check_file(args.sts_file, "--sts_file")
    return evaluate(args.model_name_or_path, args.pooler, tasks, args.sts_file, args.output_dir,
                    plumbing.resolve_device(args.device), args.batch_size, args.hub_model_id)


if __name__ == "__main__":
    plumbing.cli(main)
