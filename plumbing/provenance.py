"""Where a run's numbers came from, and what a checkpoint says of itself.

- `collect`: the suite's git commit and whether its code had uncommitted changes (or "not a git checkout"), the versions
  of Python, torch, transformers, datasets and sentence-transformers, the device's name, the precision, the number of
  processes, and the start and end times: `results.json`'s "provenance"; `resumed`: each part of a resumed run.
- `model_card`: `best/README.md`, the file the Hugging Face Hub and sentence-transformers show: the method and its
  paper, the exact command, the data, the base model, the pooler to evaluate with, the run's scores, the suite's commit
  and the citations.
- PAPERS: each method's paper and BibTeX (docs/methods.md shows the same entries; a test keeps them equal).
"""
from __future__ import annotations

import datetime
import importlib.metadata
import platform
import subprocess
from pathlib import Path

import plumbing

ROOT = Path(__file__).resolve().parents[1]  # the suite

PAPERS = {
    "simcse": ("SimCSE: Simple Contrastive Learning of Sentence Embeddings (Gao, Yao & Chen, EMNLP 2021)", """\
@inproceedings{gao2021simcse,
  title = {{SimCSE}: Simple Contrastive Learning of Sentence Embeddings},
  author = {Gao, Tianyu and Yao, Xingcheng and Chen, Danqi},
  booktitle = {Proceedings of the 2021 Conference on Empirical Methods in Natural Language Processing},
  pages = {6894--6910},
  year = {2021},
  doi = {10.18653/v1/2021.emnlp-main.552}
}"""),
    "simcsepp": ("SimCSE++: Improving Contrastive Learning for Sentence Embeddings from Two Perspectives (Xu, Shao, "
                 "Chen & Liu, EMNLP 2023)", """\
@inproceedings{xu2023simcsepp,
  title = {{SimCSE++}: Improving Contrastive Learning for Sentence Embeddings from Two Perspectives},
  author = {Xu, Jiahao and Shao, Wei and Chen, Lihui and Liu, Lemao},
  booktitle = {Proceedings of the 2023 Conference on Empirical Methods in Natural Language Processing},
  year = {2023},
  doi = {10.18653/v1/2023.emnlp-main.737}
}"""),
    "sscl": ("Alleviating Over-smoothing for Unsupervised Sentence Representation (Chen et al., ACL 2023)", """\
@inproceedings{chen2023sscl,
  title = {Alleviating Over-smoothing for Unsupervised Sentence Representation},
  author = {Chen, Nuo and Shou, Linjun and Pei, Jian and Gong, Ming and Cao, Bowen and Chang, Jianhui and
            Li, Jia and Jiang, Daxin},
  booktitle = {Proceedings of the 61st Annual Meeting of the Association for Computational Linguistics},
  year = {2023},
  doi = {10.18653/v1/2023.acl-long.197}
}"""),
    "whitenedcse": ("WhitenedCSE: Whitening-based Contrastive Learning of Sentence Embeddings (Zhuo et al., ACL "
                    "2023)", """\
@inproceedings{zhuo2023whitenedcse,
  title = {{WhitenedCSE}: Whitening-based Contrastive Learning of Sentence Embeddings},
  author = {Zhuo, Wenjie and Sun, Yifan and Wang, Xiaohan and Zhu, Linchao and Yang, Yi},
  booktitle = {Proceedings of the 61st Annual Meeting of the Association for Computational Linguistics},
  year = {2023},
  doi = {10.18653/v1/2023.acl-long.677}
}"""),
    "micse": ("miCSE: Mutual Information Contrastive Learning for Low-shot Sentence Embeddings (Klein & Nabi, ACL "
              "2023)", """\
@inproceedings{klein2023micse,
  title = {{miCSE}: Mutual Information Contrastive Learning for Low-shot Sentence Embeddings},
  author = {Klein, Tassilo and Nabi, Moin},
  booktitle = {Proceedings of the 61st Annual Meeting of the Association for Computational Linguistics},
  year = {2023},
  doi = {10.18653/v1/2023.acl-long.339}
}"""),
}
# an ablation script's study belongs to its method's paper
PAPER_OF = {"simcse_augmentations": "simcse", "simcsepp_noise_barlow": "simcsepp",
            "whitenedcse_whitening": "whitenedcse"}
SUITE_CITATION = """\
@software{contrastive_sentence_embeddings_suite,
  title = {Contrastive sentence embeddings: a reference suite},
  note = {SimCSE, SimCSE++, SSCL, WhitenedCSE and miCSE, one file each (CITATION.cff)},
  year = {2026}
}"""


def git_state(root: Path = ROOT) -> dict | str:
    """{"commit", "uncommitted_changes", "changed_code"} of the suite's own checkout, or "not a git checkout" (also
    for a copy of the suite inside another repository, whose commit says nothing of the suite). Uncommitted changes
    are the code's: its Python files, tracked or not (not ignored), changed from the commit; what the suite writes
    itself (results/, runs.csv) is not code and does not count."""
    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    try:
        top = git("rev-parse", "--show-toplevel")
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != Path(root).resolve():
            return "not a git checkout"
        head = git("rev-parse", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=all", "--", "*.py")
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout"
    if head.returncode != 0 or status.returncode != 0:
        return "not a git checkout"
    changed = [line[3:] for line in status.stdout.splitlines() if line.strip()]
    return {"commit": head.stdout.strip(), "uncommitted_changes": bool(changed), "changed_code": changed[:20]}


def versions() -> dict:
    found = {"python": platform.python_version()}
    for package in ("torch", "transformers", "datasets", "sentence-transformers"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def device_name(device) -> str:
    import torch
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def collect(device, precision: str, processes: int, started: str) -> dict:
    """results.json's "provenance" (its "ended" is set when the file is written)."""
    return {"git": git_state(), "versions": versions(), "device_name": device_name(device), "precision": precision,
            "processes": processes, "started": started, "ended": None}


def resumed(previous: dict | None, current: dict, after_step: int) -> dict:
    """The provenance of a resumed run: the run's first start, this part's commit, versions and device, and "parts":
    each part's commit and start (and the step it resumed after); "crosses_commits" when they differ."""
    previous = previous or {}
    parts = previous.get("parts") or [{"git": previous.get("git", "unknown"), "started": previous.get("started"),
                                       "after_step": None}]
    parts = parts + [{"git": current["git"], "started": current["started"], "after_step": after_step}]
    commits = {part_commit(p["git"]) for p in parts}
    merged = {**current, "started": previous.get("started", current["started"]), "parts": parts,
              "crosses_commits": len(commits) > 1}
    if merged["crosses_commits"]:
        from plumbing import distributed  # here: the tools that read a run's provenance need no torch
        distributed.log("note: this run's parts ran under different commits of the suite: "
                        + ", then ".join(part_commit(p["git"]) for p in parts) + " (results.json: provenance.parts)")
    return merged


def part_commit(git) -> str:
    if not isinstance(git, dict):
        return str(git or "unknown")
    return git["commit"][:12] + (" (uncommitted changes)" if git["uncommitted_changes"] else "")


def commit_text(provenance: dict) -> str:
    """The commit a run came from, short, as the model card and tools/report.py's pages show it; a resumed run whose
    parts ran under different commits names each."""
    if provenance.get("crosses_commits"):
        return ", then ".join(part_commit(p["git"]) for p in provenance["parts"])
    return part_commit(provenance.get("git"))


def base_model(args) -> str:
    """The base model as the card names it: --base_model (a Hub id for a local folder), else the Hub id, else a local
    folder's name (its path says nothing once the card is elsewhere, and is nobody else's business)."""
    name = args.model_name_or_path
    given = getattr(args, "base_model", None)
    if given:
        return f"`{given}` (Hugging Face Hub)" + (f", trained from a local copy, `{Path(name).name}`"
                                                   if Path(name).expanduser().exists() else "")
    if not Path(name).expanduser().exists():
        return f"`{name}` (Hugging Face Hub)"
    return f"a local folder, `{Path(name).name}` (--base_model names its Hub id)"


def without_local_paths(command: str) -> str:
    """The command with each absolute path shortened to its last part: the card leaves the user's disk out."""
    return " ".join(f".../{Path(word).name}" if word.startswith(("/", "~")) and len(Path(word).parts) > 1 else word
                    for word in command.split())


LICENSES = {"bert-base-uncased": "apache-2.0", "bert-large-uncased": "apache-2.0", "bert-base-cased": "apache-2.0",
            "roberta-base": "mit", "roberta-large": "mit", "FacebookAI/roberta-base": "mit",
            "FacebookAI/roberta-large": "mit", "google-bert/bert-base-uncased": "apache-2.0",
            "google-bert/bert-large-uncased": "apache-2.0"}  # the papers' backbones' licenses (their Hub cards)
# SentEval's STS tasks by the Hub's names of the same data: MTEB's for STS12-16 and STS-B; SICK-R's test split (4,927
# pairs) is not MTEB's sickr-sts (the whole corpus), so the SICK dataset's own name
PROTOCOL = {**{task: "SentEval 'all': the subsets' pairs pooled" for task in ("STS12", "STS13", "STS14", "STS15",
                                                                                 "STS16")},
            "STSBenchmark": "the test split's pairs", "SICKRelatedness": "the test split's pairs"}
STS_DATASETS = {"STS12": "mteb/sts12-sts", "STS13": "mteb/sts13-sts", "STS14": "mteb/sts14-sts",
                "STS15": "mteb/sts15-sts", "STS16": "mteb/sts16-sts", "STSBenchmark": "mteb/stsbenchmark-sts",
                "SICKRelatedness": "sick"}


def hub_metadata(args, paper: str, title: str, best: dict, sentence_transformers: bool) -> str:
    """The card's YAML metadata in the Hub's format (huggingface_hub.ModelCardData): library, base model (a Hub id;
    a local folder is not named), the training data's Hub dataset (the authors' corpus unless --train_file),
    pipeline tag, tags, the base model's license where known, and a model-index with each STS test task's Spearman
    x 100 (SimCSE's protocol) once the run has them."""
    from huggingface_hub import EvalResult, ModelCardData
    on_hub = not Path(args.model_name_or_path).expanduser().exists()
    base = getattr(args, "base_model", None) or (args.model_name_or_path if on_hub else None)
    corpus = None if args.train_file else "sap-ai-research/datasets-for-micse" if args.method == "micse" and \
        args.fraction < 1 else "princeton-nlp/datasets-for-simcse"
    results = [EvalResult(task_type="sentence-similarity", dataset_type=STS_DATASETS[task], dataset_name=task,
                          dataset_split="test", metric_type="spearman", metric_value=score,
                          metric_name=f"Spearman x 100 (SimCSE's STS protocol, {PROTOCOL[task]})")
               for task, score in (best.get("test") or {}).items() if task in STS_DATASETS]
    results += [EvalResult(**result) for result in best.get("mteb") or []]  # tools/mteb_eval.py's, MTEB's names
    data = ModelCardData(library_name="sentence-transformers" if sentence_transformers else "transformers",
                         base_model=base, datasets=[corpus] if corpus else None, pipeline_tag="sentence-similarity",
                         license=getattr(args, "license", None) or LICENSES.get(base),
                         tags=["sentence-embeddings", "contrastive-learning", paper,
                               *(["sentence-transformers"] if sentence_transformers else [])],
                         model_name=f"{args.method} {Path(base or args.model_name_or_path).name}" if results else None,
                         eval_results=results or None)
    return data.to_yaml()


def model_card(args, eval_pooler: str, provenance: dict, best: dict, sentence_transformers: bool,
               untested: str | None = None) -> str:
    """best/README.md. `best`: {"step", "stsb_dev"} and, after the final evaluation, "test" (the 7 STS tasks).
    `untested`: why a run that ended has no STS test scores (without it, they come when the run ends)."""
    paper = PAPER_OF.get(args.method, args.method)
    title, bibtex = PAPERS.get(paper, (args.method, ""))
    base = getattr(args, "base_model", None) or args.model_name_or_path
    here = getattr(args, "hub_model_id", None) or "PATH_TO_THIS_FOLDER"  # where a user loads it from
    data = Path(args.train_file).name if args.train_file else \
        "the Hugging Face Hub's default corpus of the method (princeton-nlp/datasets-for-simcse)"
    command = without_local_paths(args.command) if getattr(args, "command", None) else f"python {args.method}.py"
    lines = ["---", hub_metadata(args, paper, title, best, sentence_transformers).strip(), "---", "",
             f"# {args.method}: {Path(base).name} trained with {title.split(':')[0]}", "",
              f"Trained by `{args.method}.py` of the contrastive sentence-embedding reference suite, which reproduces "
              f"{title}.", "", "## Training", "", "```bash", command, "```", "",
              f"- base model: {base_model(args)}",
              f"- data: `{data}`" + (f", fraction {args.fraction:g} (seed {args.seed})" if args.fraction < 1 else ""),
              f"- precision {provenance['precision']}, {provenance['processes']} process(es) on "
              f"{provenance['device_name']}", f"- the suite's commit: {commit_text(provenance)}",
              f"- best STS-B dev Spearman {best['stsb_dev']:.2f} at step {best['step']}", "",
              "## Use", "", f"The pooler to evaluate with: **`{eval_pooler}`**, recorded in `eval_pooler.json`:", "",
              "```bash", f"python eval_sts.py --model_name_or_path {here}   # the recorded pooler", "```"]
    if sentence_transformers:
        lines += ["", "```python", "from sentence_transformers import SentenceTransformer",
                  f"embeddings = SentenceTransformer(\"{here}\").encode([\"A sentence.\"])", "```"]
    lines += ["", "## Scores", ""]
    if best.get("test"):
        tasks = list(best["test"])
        lines += ["STS test, Spearman × 100 (SimCSE's protocol, `eval_sts.py`: STS12-16 each subset's pairs pooled, "
                  "SentEval's 'all'; STS-B and SICK-R their test split's pairs):", "",
                  "| " + " | ".join(tasks) + " |", "|" + "---|" * len(tasks),
                  "| " + " | ".join(f"{best['test'][t]:.2f}" for t in tasks) + " |"]
    elif untested:
        lines += [f"Not evaluated on the STS test tasks: {untested}; `python eval_sts.py --model_name_or_path "
                  f"{here} --into_run` evaluates it and writes the scores here and into the run's results.json."]
    else:
        lines += ["Not evaluated on the STS test tasks yet (the run writes them here when it ends)."]
    lines += ["", "## Citation", "", "```bibtex", bibtex, "", SUITE_CITATION, "```", ""]
    return "\n".join(lines)


def run_of(model: str, into_run: bool, all_test_tasks: bool, pooler: str | None = None) -> Path | None:
    """eval_sts.py's and tools/mteb_eval.py's model: a run's folder given for its best/ is one line naming best/; with
    --into_run, best/'s run folder (no run holding it, ended, evaluated with its recorded pooler), else one line. None
    without --into_run."""
    from plumbing import lock, outdir
    path = Path(model)
    if (path / "best").is_dir() and not (path / "config.json").is_file() and \
            ((path / outdir.RESULTS).is_file() or (path / lock.NAME).is_file()):
        raise plumbing.UsageError(f"--model_name_or_path {model} is a training run's folder; its model is "
                                  f"--model_name_or_path {path / 'best'}")
    if not into_run:
        return None
    if path.name == "best":  # a run still writing its folder (check_free: no lock file, nothing to check)
        try:
            lock.check_free(path.parent)
        except plumbing.UsageError:
            raise plumbing.UsageError(f"--into_run: the run in {path.parent} is still running "
                                      f"({lock.holder(path.parent)}); run this again once it has ended") from None
    if path.name != "best" or not (path.parent / outdir.RESULTS).is_file():
        raise plumbing.UsageError(f"--into_run: {model} is not a run's best/ (no {outdir.RESULTS} beside it)")
    if not all_test_tasks:
        raise plumbing.UsageError("--into_run writes the 7 STS test tasks' scores: leave out --mode dev and --tasks")
    results = outdir.read_results(path.parent)  # readable, else one line
    if results.get("interrupted"):
        raise plumbing.UsageError(f"--into_run: the run in {path.parent} has not ended; finish it with the same "
                                  "command and --auto_resume (its final evaluation writes the test scores)")
    if pooler is not None and pooler != results.get("eval_pooler"):
        raise plumbing.UsageError(f"--into_run writes the scores of the run's recorded pooler "
                                  f"({results.get('eval_pooler')}): leave out --pooler {pooler}")
    return path.parent


def record_scores(run_dir: Path, **scores) -> None:
    """Scores of a run's best/ written after the fact into its results.json and its model card: eval_sts.py
    --into_run's "test" (with "test_by"), tools/mteb_eval.py's "mteb" (the card's model-index entries)."""
    import types
    from plumbing import files, lock, outdir
    lock.hold(run_dir, now())  # one line if a run has taken the folder meanwhile
    try:
        results = outdir.read_results(run_dir)
        results.update(scores)
        files.write_json(run_dir / outdir.RESULTS, results)
        args = types.SimpleNamespace(method=results["method"], **results["args"])
        best = {"step": results["best_step"], "stsb_dev": results["best_dev_stsb"], "test": results.get("test"),
                "mteb": results.get("mteb")}
        plain = files.pooling_mode(results["eval_pooler"]) is not None and \
            not (run_dir / "best" / files.PROJECTION_FILE).is_file()
        untested = None if results.get("test") else "the run was given --no_test_eval"  # it ended (run_of)
        files.write_text(run_dir / "best" / "README.md", model_card(args, results["eval_pooler"],
                                                                    results["provenance"], best, plain, untested))
    finally:
        lock.release(run_dir)
