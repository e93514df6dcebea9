"""Shared fixtures: a tiny random BERT with a tokenizer from a small vocab file, a corpus and a SentEval tree.

Nothing here needs the network or ../shared.
"""
import csv
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "ablations")]  # the suite, its tools, its studies

WORDS = ("the a man woman dog cat runs walks eats plays on in with park house ball food big small red blue "
         "quickly slowly happy sad child car road tree green old young sings reads book music loud quiet "
         "water river swims jumps over under near far day night sun moon").split()
STS_SUBSETS = {
    "STS12": ["MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"],
    "STS13": ["FNWN", "headlines", "OnWN"],
    "STS14": ["deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"],
    "STS15": ["answers-forums", "answers-students", "belief", "headlines", "images"],
    "STS16": ["answer-answer", "headlines", "plagiarism", "postediting", "question-question"],
}


def available_cores() -> int:
    """The cores this process may use: its CPU affinity, less where a cgroup's CPU quota allows fewer (a container)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    for quota_file, period_file in (("/sys/fs/cgroup/cpu.max", None),  # cgroup v2: "quota period", or "max ..."
                                    ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")):
        try:
            quota, period = (open(quota_file).read().split() + [None])[:2]
            period = open(period_file).read() if period_file else period
            if quota not in ("max", "-1"):
                cores = min(cores, max(1, int(quota) // int(period)))
        except (OSError, ValueError, TypeError):
            pass
    return cores


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's: `-n auto`, as the README runs the tests
def pytest_xdist_auto_num_workers(config):
    """A worker a core (at most 8): the tests are CPU-bound, mostly small tensors and process starts, which one thread
    runs about as fast as two, so two workers of one thread each finish the suite in about 0.6 of the time.
    PYTEST_XDIST_AUTO_NUM_WORKERS, where set, is pytest-xdist's to answer."""
    return None if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") else min(available_cores(), 8)


if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # a worker: its share of the cores, for torch and what it starts
    THREADS = str(max(1, available_cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ.setdefault("OMP_NUM_THREADS", THREADS)  # before torch is imported anywhere; a user's own setting stays
    os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])


FIRST = "tests/test_slurm.py::test_every_way_slurm_stops_a_job"  # five to six minutes, mostly waiting on Slurm


def pytest_collection_modifyitems(config, items):
    """The Slurm scenarios first: pytest-xdist hands tests out in this order, so that its minutes, mostly waits on
    Slurm, overlap the other tests instead of running last beside an idle worker (collected in file order, it started
    near the end: 14 min 24 s for .ci/run on 2 cores)."""
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))


def pytest_terminal_summary(terminalreporter):
    """The versions and the CPU this run of the suite was tested with, after its result line (also under -q, as CI
    runs it): the tolerances' floating point comes from the CPU's kernels (its ISA level) and the libraries."""
    import platform
    from importlib import metadata
    import torch
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               None) if os.path.exists("/proc/cpuinfo") else None
    versions = ", ".join(f"{name} {metadata.version(name)}" for name in (
        "torch", "transformers", "pytest", "numpy", "scipy", "sentence-transformers", "wandb", "mlflow-skinny", "mteb")
        if _installed(name))
    terminalreporter.write_line(f"tested with Python {platform.python_version()}; {versions}")
    workers = getattr(terminalreporter.config.option, "numprocesses", None) or 0
    share = os.environ.get("OMP_NUM_THREADS") or max(1, available_cores() // workers) if workers else None
    threads = f"{workers} workers, torch threads {share} each" if workers else f"torch threads {torch.get_num_threads()}"
    terminalreporter.write_line(f"on CPU {cpu or platform.processor()} ({torch.backends.cpu.get_cpu_capability()}), "
                                f"{os.cpu_count()} cores, {threads}")


def _installed(name: str) -> bool:
    from importlib import metadata
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def random_sentence(rng, lo=3, hi=9):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def write_tiny_model(path: Path, num_layers=2, hidden=32, heads=4, with_pooler=True, dropout=0.1,
                     initializer_range=0.02):
    from transformers import BertConfig, BertModel, BertTokenizerFast
    path.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab=str(path / "vocab.txt"), do_lower_case=True)
    tokenizer.save_pretrained(path)
    config = BertConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=num_layers,
                        num_attention_heads=heads, intermediate_size=2 * hidden, max_position_embeddings=64,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                        initializer_range=initializer_range)
    import torch
    torch.manual_seed(0)
    BertModel(config, add_pooling_layer=with_pooler).save_pretrained(path)
    return path


def write_senteval(root: Path, seed=0, pairs_per_subset=12) -> Path:
    """A miniature SentEval tree in SentEval's layout, including one empty gold line in STS12."""
    rng = random.Random(seed)
    for task, subsets in STS_SUBSETS.items():
        folder = root / "STS" / f"{task}-en-test"
        folder.mkdir(parents=True, exist_ok=True)
        for subset in subsets:
            lines, gold = [], []
            for i in range(pairs_per_subset):
                lines.append(f"{random_sentence(rng)}\t{random_sentence(rng)}")
                gold.append(f"{rng.uniform(0, 5):.3f}")
            if task == "STS12" and subset == "MSRpar":
                gold[3] = ""  # an unscored pair, dropped by the protocol
            (folder / f"STS.input.{subset}.txt").write_text("\n".join(lines) + "\n")
            (folder / f"STS.gs.{subset}.txt").write_text("\n".join(gold) + "\n")
    stsb = root / "STS" / "STSBenchmark"
    stsb.mkdir(parents=True, exist_ok=True)
    for split in ("train", "dev", "test"):
        rows = [f"main-captions\tMSRvid\t2012test\t{i:04d}\t{rng.uniform(0, 5):.3f}\t{random_sentence(rng)}\t"
                f"{random_sentence(rng)}" for i in range(40)]
        (stsb / f"sts-{split}.csv").write_text("\n".join(rows) + "\n")
    sick = root / "SICK"
    sick.mkdir(parents=True, exist_ok=True)
    for name in ("SICK_train.txt", "SICK_trial.txt", "SICK_test_annotated.txt"):
        rows = ["pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment"]
        rows += [f"{i}\t{random_sentence(rng)}\t{random_sentence(rng)}\t{rng.uniform(1, 5):.1f}\tNEUTRAL"
                 for i in range(40)]
        (sick / name).write_text("\n".join(rows) + "\n")
    return root


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny_bert"))


@pytest.fixture(scope="session")
def senteval_dir(tmp_path_factory):
    return write_senteval(tmp_path_factory.mktemp("senteval"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(random_sentence(rng) for _ in range(200)) + "\n\n")
    return path


def run_script(script, *args, env_extra=None, timeout=600):
    """Run a suite script as a user would; returns the CompletedProcess."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **(env_extra or {}))
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


def cli_in_process(module, *args):
    """`module.main` run as `plumbing.cli` runs it, in this process (cheaper than a subprocess; each script keeps a
    subprocess test of its real CLI): (exit status, stderr). A traceback propagates and fails the test."""
    import contextlib
    import io
    import plumbing
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            plumbing.cli(lambda: module.main([*map(str, args)]))
            code = 0
        except SystemExit as exit:
            code = exit.code
    return code, err.getvalue()


def offline_cli(module, monkeypatch, cache, *args):
    """cli_in_process on a machine without the network and with an empty Hugging Face cache at `cache` (the hub's
    and transformers' lookups read it at each call): what a first offline run of the command meets, as
    HF_HUB_OFFLINE=1 and a fresh HF_HOME give it in a new process."""
    from huggingface_hub import constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cli_in_process(module, *args)


def in_process_scores(evaluator, *args):
    """An evaluator's main() run in this process (each CLI has its own subprocess tests): the scores it writes."""
    with tempfile.TemporaryDirectory() as tmp:
        evaluator.main([*map(str, args), "--json", f"{tmp}/scores.json"])
        return json.loads(Path(f"{tmp}/scores.json").read_text())


def write_nli(path, n=24):
    """An NLI triplet file (sent0, sent1, hard_neg) of `n` random rows."""
    rng = random.Random(5)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sent0", "sent1", "hard_neg"])
        for _ in range(n):
            w.writerow([random_sentence(rng), random_sentence(rng), random_sentence(rng)])
    return path


def gates(results: dict) -> list[list]:
    """[[step, STS-B dev], ...] at a run's dev gates, from its trajectory."""
    return [[row["step"], row["stsb_dev"]] for row in results["trajectory"] if row.get("gate")]


# A checkpoint whose STS cosines spread (the average pooler of the tiny model after a few steps at a large lr: 0.89 to
# 0.97; its [CLS] gives cosines within 3e-6 of 1, with ties, whose Spearman moves by 1 between fp32 and fp64), and the
# largest difference of its two-decimal STS scores between two devices: tests/test_eval_sts.py measures it on CPU
# (fp32 against fp64), tests/test_cuda.py holds CUDA against CPU to it.
SPREAD_FLAGS = ["--pooler", "avg", "--lr", "1e-3"]
DEVICE_SCORE_TOLERANCE = 0.02


TRACKED = ["--report_to", "tensorboard", "mlflow", "wandb", "--logging_steps", "1"]  # every tracker, every step


def tracker_env(monkeypatch, store: Path) -> None:
    """W&B offline (its files in the run's wandb/), MLflow on a local file store at `store`."""
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": store.as_uri(),
                       "MLFLOW_ALLOW_FILE_STORE": "true"}.items():
        monkeypatch.setenv(key, value)


def next_second() -> None:
    """Wait for the clock's next second: TensorBoard orders a folder's event files by name, whose first field is the
    second the writer opened it (then the process and a counter compared as text), and W&B names an offline part by
    its second too. A resumed job starts seconds after its stop; an in-process test's resume must not share its
    stop's second."""
    import time
    time.sleep(1.02 - time.time() % 1)


def tracked(out: Path) -> dict:
    """What each tracker holds of a run, read back by its own reader, as lists: {tracker: {metric: [(step, value),
    ...]}}, every value written (a step written twice appears twice). TensorBoard: its EventAccumulator (which drops
    what a resumed run purged); MLflow: the metric histories of the run's store, by step; W&B offline: the history
    records of the run's parts in order, as `wandb sync` uploads them."""
    import mlflow
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from plumbing.tracking import wandb_parts, wandb_records
    ids = json.loads((out / "results.json").read_text())["tracking"]
    found = {"tensorboard": {}, "mlflow": {}, "wandb": {}}
    events = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    for tag in events.Tags()["scalars"]:
        found["tensorboard"][tag] = [(e.step, e.value) for e in events.Scalars(tag)]
    client = mlflow.MlflowClient()
    for key in client.get_run(ids["mlflow"]).data.metrics:
        history = client.get_metric_history(ids["mlflow"], key)
        found["mlflow"][key] = sorted((m.step, m.value) for m in history)
    for part in wandb_parts(out, ids["wandb"]):  # in the order they were written
        for record in wandb_records(part / f"run-{ids['wandb']}.wandb"):
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                for key, value in items.items():
                    if not key.startswith("_"):
                        found["wandb"].setdefault(key, []).append((items["_step"], value))
    return found


def smoke_args(tiny_model, corpus, senteval_dir, out, *extra):
    return ["--model_name_or_path", tiny_model, "--train_file", corpus, "--senteval_dir", senteval_dir,
            "--max_steps", 4, "--eval_steps", 2, "--batch_size", 8, "--output_dir", out, "--device", "cpu", *extra]


needs_shared = pytest.mark.skipif(not (SHARED / "models" / "all-MiniLM-L6-v2").is_dir(),
                                  reason="../shared (pretrained MiniLM and SentEval data) is not beside this checkout")


@pytest.fixture(autouse=True)
def restore_signal_handlers():
    """A method's main() run in-process installs its Ctrl-C / SIGTERM handler; put pytest's back."""
    import signal
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def watch_widths_and_graphs(monkeypatch) -> tuple[list, list]:
    """--compile's tests: each batch's padded width (data.TokenizedCorpus.collate) and, at each step the run records,
    how many graphs dynamo has compiled so far."""
    import data
    from plumbing.run import History
    from torch._dynamo.utils import counters
    widths, graphs = [], []
    collate, add = data.TokenizedCorpus.collate, History.add
    monkeypatch.setattr(data.TokenizedCorpus, "collate",
                        lambda self, rows: widths.append(collate(self, rows)["input_ids"].shape[1]) or collate(self, rows))
    monkeypatch.setattr(History, "add", lambda self, *a: graphs.append(counters["stats"]["unique_graphs"])
                        or add(self, *a))
    counters.clear()
    return widths, graphs
