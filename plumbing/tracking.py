"""--report_to: a run's scalars in the trackers researchers use, TensorBoard, Weights & Biases and MLflow (each an
optional install, refused in one line when missing). `Trackers` logs the same scalars to each, at the same steps:
the loss and gradient norm at the log steps, the lr and the dev measures (STS-B dev, l_align, l_uniform) at the gates
and --align_uniform_steps, the final test scores once at the end; the run's arguments and provenance are its
config (W&B) and params (MLflow). Only process 0 tracks. A resumed run continues the same tracked run: W&B's and
MLflow's run ids are kept in last/ and results.json (`ids`).

Each step once in every tracker, with results.json's value, across any stop (a signal, kill -9, a lost node): a
resumed run trains the steps after its last save again (not bit for bit on a GPU in bf16 or without --deterministic)
and logs a metric at a step only where its tracked run does not hold it yet (`held`: what the tracker's own record
says it holds, read when the run resumes); W&B and MLflow cannot drop a step, so they get one once last/ holds it.

- tensorboard: event files under <output_dir>/tb; a resumed run drops the events written after its last save.
- wandb: project $WANDB_PROJECT (default "sentence-embeddings"), files under <output_dir>/wandb; WANDB_MODE=offline
  keeps them there, a part for each start of the run, which one `wandb sync PART ...` uploads in order (the run's
  last line prints it). Online, a resumed run logs after the step where wandb's resume says the server's history
  ends. $WANDB_NAME, $WANDB_TAGS and $WANDB_RUN_GROUP win over --run_name, --run_tags, --run_group.
- mlflow: the tracking server or store of $MLFLOW_TRACKING_URI (MLflow's default otherwise), experiment
  $MLFLOW_EXPERIMENT_NAME (default "sentence-embeddings"); --run_tags and --run_group as its run's tags.
--log_model: at the end, best/ and results.json as a W&B artifact and MLflow artifacts.
"""
from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import math
import os
import re
import shutil
import time
from pathlib import Path
from unittest import mock

import plumbing
from plumbing import files

TRACKERS = ("tensorboard", "wandb", "mlflow")  # --report_to's choices, each the name of the package it needs
PROJECT = "sentence-embeddings"


def chosen(report_to) -> list[str]:
    """--report_to's trackers ("none" left out; a results.json of an earlier version holds one name)."""
    return [name for name in ([report_to] if isinstance(report_to, str) else report_to or []) if name != "none"]


def check(report_to, log_model: bool = False) -> None:
    """Each tracker asked for is installed, else one line naming the install, before any work; --log_model has a
    tracker that keeps artifacts."""
    names = chosen(report_to)
    if "none" in (report_to or []) and names:
        raise plumbing.UsageError(f"--report_to none with {' '.join(names)}: give the trackers, or none alone")
    if log_model and not {"wandb", "mlflow"} & set(names):
        raise plumbing.UsageError("--log_model sends best/ to W&B or MLflow: add --report_to wandb or mlflow, or "
                                  "leave --log_model out")
    for name in names:
        plumbing.check_installed(True, name, f"--report_to {name}")


class Trackers:
    def __init__(self, args, enabled: bool = True, resume_at: int | None = None, ids: dict | None = None,
                 config: dict | None = None):
        """The trackers of --report_to, started (process 0: `enabled`). `resume_at`: the step a resumed run continues
        after, with `ids` the tracked runs it continues; `config`: the run's arguments and provenance."""
        self.names = chosen(args.report_to) if enabled else []
        self.ids, self.tensorboard, self.wandb, self.mlflow = dict(ids or {}), None, None, None
        out, config, new = Path(args.output_dir), flat(config or {}), resume_at is None
        self.out, self.held = out, {}  # held: {tracker: defaultdict(metric: the last step its run holds)}
        self.waiting = []  # W&B's and MLflow's scalars until last/ holds their steps: (step, values, time in ms)
        self.log_model = getattr(args, "log_model", False)
        name, tags, group = run_names(args)
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter
            folder = out / "tb"
            if folder.exists() and new:
                files.write(f"removing the previous run's TensorBoard events in {folder}")
                shutil.rmtree(folder)
            if not new:  # what its events hold before the resumed step (the later ones are purged)
                self.held["tensorboard"] = collections.defaultdict(lambda: -1, tensorboard_held(folder, resume_at))
            self.tensorboard = SummaryWriter(str(folder), flush_secs=10, purge_step=resume_at)
        if "wandb" in self.names:
            import wandb
            (out / "wandb").mkdir(parents=True, exist_ok=True)
            if not new and self.ids.get("wandb"):  # what the run's earlier offline parts hold
                self.held["wandb"] = collections.defaultdict(lambda: -1, wandb_held(out, self.ids["wandb"]))
            with refused("wandb", "check wandb login and the network, or WANDB_MODE=offline to sync later"):
                self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), dir=str(out),
                                        name=os.environ.get("WANDB_NAME", name), id=self.ids.get("wandb"),
                                        resume="allow", reinit="create_new",  # a tracker new to the run: its config
                                        config=config if new or not self.ids.get("wandb") else None,
                                        tags=None if "WANDB_TAGS" in os.environ else tags or None,
                                        group=os.environ.get("WANDB_RUN_GROUP", group))
            self.ids["wandb"] = self.wandb.id
            if not new and self.wandb.settings.mode not in ("offline", "dryrun") and self.wandb.resumed:
                first = self.wandb.starting_step  # online: the server's history ends before it (wandb's resume)
                self.held["wandb"] = collections.defaultdict(lambda: first - 1)
        if "mlflow" in self.names:
            with refused("mlflow", "check MLFLOW_TRACKING_URI (docs/using.md)"):
                self._start_mlflow(config, new, name, tags, group)

    def _start_mlflow(self, config: dict, new: bool, name: str, tags: list, group: str | None) -> None:
        """MLflow's run: created in the experiment (its params the config, its tags --run_tags and the group), or the
        resumed run's, running again, with the metrics' steps it holds."""
        import mlflow
        from mlflow.entities import Param
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        if "MLFLOW_TRACKING_URI" not in os.environ and importlib.util.find_spec("sqlalchemy") is None:
            raise RuntimeError("no MLFLOW_TRACKING_URI, and MLflow's default store, SQLite, needs the full mlflow "
                               "package: set MLFLOW_TRACKING_URI to your server (or pip install mlflow)")
        self.mlflow = mlflow.MlflowClient()
        new = new or not self.ids.get("mlflow")  # a tracker added when the run resumes starts with the params
        if self.ids.get("mlflow"):
            run = self.mlflow.get_run(self.ids["mlflow"])
            self.held["mlflow"] = collections.defaultdict(lambda: -1, {
                key: max(m.step for m in self.mlflow.get_metric_history(run.info.run_id, key))
                for key in run.data.metrics})
        else:
            mlflow.set_experiment(experiment)
            run = self.mlflow.create_run(mlflow.get_experiment_by_name(experiment).experiment_id, run_name=name,
                                         tags={**{tag: "" for tag in tags}, **({"group": group} if group else {})})
        self.ids["mlflow"] = run.info.run_id
        if new:  # a resumed run's params are its run's already (MLflow keeps a param's first value)
            self.mlflow.log_batch(run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in config.items()])
        else:
            self.mlflow.update_run(run.info.run_id, status="RUNNING")

    def scalars(self, step: int, values: dict) -> None:
        """The scalars at `step` ("train/loss", "dev/stsb_dev", ...); undefined values (None, NaN, inf) left out."""
        values = {k: float(v) for k, v in values.items() if v is not None and math.isfinite(v)}
        if self.tensorboard is not None:
            for tag, value in self.new("tensorboard", step, values).items():
                self.tensorboard.add_scalar(tag, value, step)
        if self.wandb is not None or self.mlflow is not None:
            self.waiting.append((step, values, int(time.time() * 1000)))

    def release(self) -> None:
        """The waiting scalars sent to W&B and MLflow: last/ (or results.json) holds them, no resume trains them."""
        for step, values, now in self.waiting:
            if self.wandb is not None and (new := self.new("wandb", step, values)):
                self.wandb.log(new, step=step)
            if self.mlflow is not None and (new := self.new("mlflow", step, values)):
                from mlflow.entities import Metric
                self.mlflow.log_batch(self.ids["mlflow"], metrics=[Metric(k, v, now, step) for k, v in new.items()])
        self.waiting.clear()

    def log_record(self, losses: list, grad_norms: list, terms: dict, trajectory: list) -> None:
        """A run's record (each step's loss, gradient norm and terms; the trajectory's lr and dev measures), logged
        where a tracker lacks it: a trajectory row, or a resumed run's (a kill loses what W&B had not written)."""
        rows = collections.defaultdict(dict)
        for name, values in {"loss": losses, "grad_norm": grad_norms, **terms}.items():
            for step, value in enumerate(values, start=1):
                rows[step][f"train/{name}"] = value
        for point in trajectory:
            rows[point["step"]].update({f"{'train' if k == 'lr' else 'dev'}/{k}": v for k, v in point.items()
                                        if k in ("lr", "stsb_dev", "align", "uniform")})
        for step in sorted(rows):
            self.scalars(step, rows[step])

    def new(self, tracker: str, step: int, values: dict) -> dict:
        """What `tracker`'s run does not hold yet (held's [] calls its default: online W&B's is every metric's)."""
        return {k: v for k, v in values.items() if tracker not in self.held or step > self.held[tracker][k]}

    def finish(self, results: dict | None = None, release: bool = True) -> None:
        """The end of the run: the final test scores (and transfer tasks) at the last step, the waiting scalars sent
        unless a resume trains them again (`release`), the trackers closed; a run stopped before its end leaves its
        W&B and MLflow runs unfinished, to be resumed."""
        if results is not None:
            self.scalars(results.get("steps", 0), {f"{kind}/{task}": value for kind in ("test", "transfer")
                                                   for task, value in (results.get(kind) or {}).items()
                                                   if isinstance(value, (int, float))})
        if release:
            self.release()
        ended = results is not None and not results.get("interrupted")
        if ended and self.log_model:
            try:
                self._log_model()
            except Exception as err:  # the run's results stand; the trackers are still closed below
                files.write(f"note: --log_model: best/ could not be sent ({str(err).splitlines()[0][:160]}); "
                            "the run's results and best/ are complete on disk")
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            offline = self.wandb.settings.mode in ("offline", "dryrun")
            self.wandb.finish(exit_code=0 if ended else 1)
            parts = wandb_parts(self.out, self.ids["wandb"])
            if offline and parts:  # the parts in the order they were written (their names begin with the time)
                files.write(f"W&B, offline: `wandb sync {' '.join(map(str, parts))}` uploads this run, all its "
                            f"{len(parts)} part(s) in order")
        if self.mlflow is not None:
            self.mlflow.set_terminated(self.ids["mlflow"], "FINISHED" if ended else "KILLED")
        self.tensorboard = self.wandb = self.mlflow = None

    def _log_model(self) -> None:
        """--log_model: best/ and results.json as a W&B artifact of type model (named for the run), and MLflow's."""
        best, results = self.out / "best", self.out / "results.json"
        if self.wandb is not None:
            import wandb
            staged = os.environ.get("WANDB_DATA_DIR") or str(self.out / "wandb")  # the run's wandb/ unless set
            with mock.patch.dict(os.environ, WANDB_DATA_DIR=staged):  # where W&B stages the files; then as it was
                artifact = wandb.Artifact(f"model-{self.ids['wandb']}", type="model")
                artifact.add_dir(str(best), name="best")
                artifact.add_file(str(results))
                self.wandb.log_artifact(artifact)
        if self.mlflow is not None:
            self.mlflow.log_artifacts(self.ids["mlflow"], str(best), "best")
            self.mlflow.log_artifact(self.ids["mlflow"], str(results))


def complete(args, results: dict) -> str:
    """--auto_resume on a completed run whose trackers a kill left unfinished (results.json's "tracking_unfinished"):
    each tracked run continued, given what it lacks of the record, and finished; then results.json without the mark."""
    record = type(args)(**{**vars(args), **results["args"], "output_dir": args.output_dir})  # the run's trackers
    trackers = Trackers(record, True, results["steps"] + 1, results.get("tracking"),
                        {"args": vars(record), "provenance": results["provenance"]})
    trackers.log_record(*(results.get(key, {}) for key in ("train_loss", "grad_norm", "train_terms", "trajectory")))
    trackers.finish(results)
    names = results.pop("tracking_unfinished")
    files.write_json(Path(args.output_dir) / "results.json", results)
    return f"its trackers left unfinished, {', '.join(names)}, finished now"


@contextlib.contextmanager
def refused(tracker: str, advice: str):
    """A tracker that cannot start (not logged in, a server out of reach) stops the run before training, in one line."""
    try:
        yield
    except Exception as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]  # whole: it may hold the fix
        raise plumbing.UsageError(f"--report_to {tracker}: it could not start ({reason}); {advice}, or leave "
                                  f"{tracker} out of --report_to") from None


def run_names(args) -> tuple[str, list, str | None]:
    """(name, tags, group) of the tracked runs: --run_name (default the method and the output folder's name),
    --run_tags, --run_group."""
    name = getattr(args, "run_name", None) or f"{args.method} {Path(args.output_dir).name}"
    return name, list(getattr(args, "run_tags", None) or []), getattr(args, "run_group", None)


def tensorboard_held(folder: Path, before: int) -> dict:
    """{tag: the last step} of the scalars that the events in `folder` hold before step `before`, as TensorBoard's
    own reader reads them: what a killed writer never flushed, and the test scores of a run stopped in its final
    evaluation, are not there, so the resumed run writes them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    if not folder.is_dir():  # TensorBoard added when the run resumes: it holds nothing yet
        return {}
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    steps = {tag: [e.step for e in events.Scalars(tag) if e.step < before] for tag in events.Tags()["scalars"]}
    return {tag: max(held) for tag, held in steps.items() if held}


def wandb_held(out: Path, run_id: str) -> dict:
    """{metric: the last step} of the history that this run's offline parts in <out>/wandb hold (a record cut short
    by a kill ends the reading)."""
    held = {}
    for part in wandb_parts(out, run_id):
        for record in wandb_records(part / f"run-{run_id}.wandb"):
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                step = int(json.loads(items.get("_step", "-1")))
                held.update({key: max(step, held.get(key, -1)) for key in items if not key.startswith("_")})
    return held


def wandb_parts(out: Path, run_id: str) -> list[Path]:
    """The offline parts of the W&B run `run_id` in <out>/wandb, in the order they were written: offline-run-<the
    second it began>-<id>, and -<id>-1, -2, ... where parts began in the same second."""
    pattern = re.compile(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?")
    parts = [(pattern.fullmatch(p.name), p) for p in out.glob(f"wandb/offline-run-*-{run_id}*")]
    return [p for *_, p in sorted((m.group(1), int(m.group(2) or 0), p) for m, p in parts if m)]


def wandb_records(path: Path):
    """The records of an offline W&B run file (run-<id>.wandb): a 7-byte header, then a log of 32 KiB blocks, each
    record a 7-byte header (checksum, length, type: 1 whole, 2 first, 3 middle, 4 last part) and a protobuf Record
    (wandb's own reader of these files is in its Go core). It stops at a record cut short."""
    from wandb.proto import wandb_internal_pb2
    data = path.read_bytes() if path.is_file() else b""
    pos, block, pending = 7, 32768, b""
    while data[:4] == b":W&B" and pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header: zeros
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):
            return
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def flat(config: dict, prefix: str = "") -> dict:
    """A nested dict as one level ("provenance.commit"), lists as JSON: the params MLflow takes."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, (list, tuple)) else value
    return out
