"""--report_to: a run's scalars in the trackers researchers use, TensorBoard, Weights & Biases and MLflow (each an
optional install, refused in one line when missing). `Trackers` logs the same scalars to each, at the same steps:
the loss and gradient norm at the log steps, the lr and the dev measures (STS-B dev, l_align, l_uniform) at the gates
and --align_uniform_steps, the final test scores once at the end; the run's arguments and provenance are its
config (W&B) and params (MLflow). Only process 0 tracks. A resumed run continues the same tracked run: W&B's and
MLflow's run ids are kept in last/ and results.json (`ids`).

- tensorboard: event files under <output_dir>/tb; a resumed run drops the events written after its last save.
- wandb: project $WANDB_PROJECT (default "sentence-embeddings"), files under <output_dir>/wandb; WANDB_MODE=offline
  keeps them there for `wandb sync`. W&B keeps a run's steps increasing: a resumed run's steps that were logged
  before the stop (after the last save) are not logged again.
- mlflow: the tracking server or store of $MLFLOW_TRACKING_URI (MLflow's default otherwise), experiment
  $MLFLOW_EXPERIMENT_NAME (default "sentence-embeddings"); a resumed run logs its steps again after the last save.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from pathlib import Path

import plumbing
from plumbing import files

TRACKERS = ("tensorboard", "wandb", "mlflow")  # --report_to's choices, each the name of the package it needs
PROJECT = "sentence-embeddings"


def given(report_to) -> list[str]:
    """--report_to as a list (a results.json of an earlier version holds one name)."""
    return [report_to] if isinstance(report_to, str) else list(report_to or [])


def chosen(report_to) -> list[str]:
    """--report_to's trackers ("none" left out)."""
    return [name for name in given(report_to) if name != "none"]


def check(report_to) -> None:
    """Each tracker asked for is installed, else one line naming the install, before any work."""
    names = chosen(report_to)
    if "none" in given(report_to) and names:
        raise plumbing.UsageError(f"--report_to none with {' '.join(names)}: give the trackers, or none alone")
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
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter
            folder = out / "tb"
            if folder.exists() and new:
                files.write(f"removing the previous run's TensorBoard events in {folder}")
                shutil.rmtree(folder)
            self.tensorboard = SummaryWriter(str(folder), flush_secs=10, purge_step=resume_at)
        if "wandb" in self.names:
            import wandb
            (out / "wandb").mkdir(parents=True, exist_ok=True)
            with refused("wandb", "check wandb login and the network, or WANDB_MODE=offline to sync later"):
                self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), dir=str(out),
                                        name=f"{args.method} {out.name}", id=self.ids.get("wandb"), resume="allow",
                                        config=config if new else None, reinit="create_new")
            self.ids["wandb"] = self.wandb.id
        if "mlflow" in self.names:
            with refused("mlflow", "check MLFLOW_TRACKING_URI (docs/using.md)"):
                self._start_mlflow(args, out, config, new)

    def _start_mlflow(self, args, out: Path, config: dict, new: bool) -> None:
        """MLflow's run: created in the experiment (its params the config), or the resumed run's, running again."""
        import mlflow
        from mlflow.entities import Param
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        self.mlflow = mlflow.MlflowClient()
        if self.ids.get("mlflow"):
            run = self.mlflow.get_run(self.ids["mlflow"])
        else:
            mlflow.set_experiment(experiment)
            run = self.mlflow.create_run(mlflow.get_experiment_by_name(experiment).experiment_id,
                                         run_name=f"{args.method} {out.name}")
        self.ids["mlflow"] = run.info.run_id
        if new:  # a resumed run's params are its run's already (MLflow keeps a param's first value)
            self.mlflow.log_batch(run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in config.items()])
        else:
            self.mlflow.update_run(run.info.run_id, status="RUNNING")

    def scalars(self, step: int, values: dict) -> None:
        """The scalars at `step` ("train/loss", "dev/stsb_dev", ...); undefined values (None, NaN, inf) left out."""
        values = {k: float(v) for k, v in values.items() if v is not None and math.isfinite(v)}
        if not values:
            return
        if self.tensorboard is not None:
            for tag, value in values.items():
                self.tensorboard.add_scalar(tag, value, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)
        if self.mlflow is not None:
            from mlflow.entities import Metric
            now = int(time.time() * 1000)
            self.mlflow.log_batch(self.ids["mlflow"], metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def finish(self, results: dict | None = None) -> None:
        """The end of the run: the final test scores (and transfer tasks) at the last step, the trackers closed; a
        run stopped before its end leaves its W&B and MLflow runs unfinished, to be resumed."""
        if results is not None:
            step = results.get("steps", 0)
            scores = {f"test/{task}": value for task, value in (results.get("test") or {}).items()}
            scores.update({f"transfer/{task}": value for task, value in (results.get("transfer") or {}).items()
                           if isinstance(value, (int, float))})
            self.scalars(step, scores)
        ended = results is not None and not results.get("interrupted")
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish(exit_code=0 if ended else 1)
        if self.mlflow is not None:
            self.mlflow.set_terminated(self.ids["mlflow"], "FINISHED" if ended else "KILLED")
        self.tensorboard = self.wandb = self.mlflow = None


@contextlib.contextmanager
def refused(tracker: str, advice: str):
    """A tracker that cannot start (not logged in, a server out of reach) stops the run before training, in one
    line."""
    try:
        yield
    except Exception as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]  # whole: it may hold the fix
        raise plumbing.UsageError(f"--report_to {tracker}: it could not start ({reason}); {advice}, or leave "
                                  f"{tracker} out of --report_to") from None


def flat(config: dict, prefix: str = "") -> dict:
    """A nested dict as one level ("provenance.commit"), lists as JSON: the params MLflow takes."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, f"{name}."))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, tuple)) else value
    return out
