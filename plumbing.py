"""Plumbing: what a reader of the method files can skip. It imports nothing from the suite.

- One-line errors: `UsageError`, the `cli` wrapper (exit status 2, never a traceback), `Parser`, argument range
  checks, the device check, files read with line numbers.
- The Hugging Face Hub: files and models from the hub or a local path, an offline machine told which flag to use,
  `senteval.tar` unpacked once.
- Writing: atomic JSON (NaN written as null), the sentence-transformers metadata of a checkpoint, TensorBoard
  scalars (--report_to, an optional dependency), a results.json's trajectory in either format.
- Progress: on a terminal (stderr is a TTY), a phase gets a tqdm bar with its rate and ETA. In a log file (CI,
  SLURM, nohup, a pipe) bars would be redraws, so a phase writes a plain line instead, every PROGRESS_INTERVAL
  seconds (default 10; after a phase's first 10 minutes, every 6 intervals), and a last one when it ends. Log
  lines go through `write`, which keeps them above the bars.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import socket
import sys
import tarfile
import time
from pathlib import Path
from urllib.parse import urlparse

import torch
from tqdm import tqdm

SIMCSE_DATA_REPO = "princeton-nlp/datasets-for-simcse"
LOCAL_FLAGS = "--model_name_or_path, --train_file and --senteval_dir"


# ----------------------------------------------------------------------------------------------- one-line errors
class UsageError(ValueError):
    """Something the user can fix: printed as one line by `cli`, exit status 2, never a traceback."""


def cli(main) -> None:
    """Run `main()`; a UsageError becomes one line on stderr and exit status 2."""
    try:
        main()
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line instead of usage + error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def check_range(args, name: str, ok, accepted: str) -> None:
    value = getattr(args, name)
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and ok(value)):
        raise UsageError(f"--{name} {value} is out of range: {accepted}")


def resolve_device(name: str | None) -> torch.device:
    """The --device, checked to exist on this machine (default: cuda if available)."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {name} is not a device name; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                         "use --device cpu")
    if device.type not in ("cpu", "cuda") and not getattr(torch, device.type, None):
        raise UsageError(f"--device {name} is not available on this machine; use cpu or cuda")
    return device


def read_lines(path, flag: str) -> list[str]:
    """A text file's lines; missing, unreadable, not UTF-8 or empty is one line naming the file (and line)."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{flag} {path}: no such file" + (" (it is a folder)" if p.is_dir() else ""))
    try:
        data = p.read_bytes()
    except OSError as err:
        raise UsageError(f"{flag} {path}: cannot be read ({err.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line_number = data.count(b"\n", 0, err.start) + 1
        raise UsageError(f"{flag} {path}: line {line_number} is not UTF-8 text") from None
    if not text.strip():
        raise UsageError(f"{flag} {path} is empty")
    return text.splitlines()


def parse_score(value: str, path, line_number: int, flag: str) -> float:
    try:
        score = float(value)
    except ValueError:
        score = math.nan
    if not math.isfinite(score):
        raise UsageError(f"{flag}: {path} line {line_number}: the score '{value}' is not a number")
    return score


# --------------------------------------------------------------------------------------- the hub and local paths
def hub_reachable(timeout: float = 3.0) -> bool:
    """A fast DNS + TCP check, so an offline machine fails at once instead of after minutes of retries."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # behind a proxy a direct connection says nothing; let huggingface_hub try
    from huggingface_hub import constants
    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def hub_file(repo: str, filename: str, flag: str, local: str = "file") -> str:
    """Path of `filename` in the HF dataset repo `repo`: cached copy, else a download, else a one-line error
    naming `flag`, which takes a local `local` ("file" or "folder")."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import logging as hub_logging
    hub_logging.set_verbosity_error()
    try:
        return hf_hub_download(repo, filename, repo_type="dataset", local_files_only=True)
    except Exception:
        pass
    if not hub_reachable():
        raise UsageError(f"cannot reach the Hugging Face Hub to download {filename} and no cached copy exists; "
                         f"pass a local {local} with {flag} (offline runs need {LOCAL_FLAGS})")
    try:
        return hf_hub_download(repo, filename, repo_type="dataset")
    except Exception as err:
        raise UsageError(f"downloading {filename} from {repo} failed ({type(err).__name__}); "
                         f"pass a local {local} with {flag}") from None


def looks_local(name: str) -> bool:
    """A path, not a hub id ("owner/name"): starts with . / or ~, has two or more slashes, or its parent exists."""
    parent = Path(name).expanduser().parent
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or (parent != Path(".") and parent.is_dir())


def load_pretrained(name_or_path: str, attn_implementation: str | None = None, auto_class=None,
                    flag: str = "--model_name_or_path"):
    """(tokenizer, model) with AutoModel (or `auto_class`, e.g. AutoModelForMaskedLM): a local directory, a cached
    hub copy, else a download.

    Offline and not cached is one clear error naming `flag`, the option that gave the model.
    """
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as tf_logging
    from huggingface_hub.utils import logging as hub_logging
    hub_logging.set_verbosity_error()
    tf_logging.disable_progress_bar()
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}

    def load(local_files_only):
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=local_files_only)
        # transformers 5 keeps a checkpoint's own dtype; fp32 here: evaluation in fp32, fp32 master weights
        return tokenizer, (auto_class or AutoModel).from_pretrained(
            name_or_path, local_files_only=local_files_only, dtype=torch.float32, **kwargs)

    path = Path(name_or_path).expanduser()
    if not path.exists() and looks_local(name_or_path):  # e.g. runs/simcse/best before the run wrote it
        raise UsageError(f"{flag} {name_or_path}: no such folder")
    try:
        if path.exists():
            if not path.is_dir():
                raise UsageError(f"{flag} {name_or_path} is a file; give the model's directory")
            return load(local_files_only=True)
        verbosity = tf_logging.get_verbosity()
        tf_logging.set_verbosity_error()
        try:
            return load(local_files_only=True)  # a cached copy needs no network
        except OSError:
            pass
        finally:
            tf_logging.set_verbosity(verbosity)
        if not hub_reachable():
            raise UsageError(f"cannot reach the Hugging Face Hub to download '{name_or_path}' and no cached copy "
                             f"exists; pass a local model directory with {flag} "
                             f"(offline runs need {LOCAL_FLAGS})")
        return load(local_files_only=False)
    except (OSError, ValueError) as err:
        if isinstance(err, UsageError):
            raise
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise UsageError(f"cannot load model '{name_or_path}' ({reason}); check {flag}") from None


def local_config(name_or_path: str):
    """The model's config from a local folder or the hub cache, without the network; None if there
    is none (the model itself is loaded, or refused in one line, later)."""
    from transformers import AutoConfig
    from transformers.utils import logging as tf_logging
    verbosity = tf_logging.get_verbosity()
    tf_logging.set_verbosity_error()
    try:
        return AutoConfig.from_pretrained(name_or_path, local_files_only=True)
    except Exception:
        return None
    finally:
        tf_logging.set_verbosity(verbosity)


def _find_data_root(folder: Path, marker: str = "STS") -> Path | None:
    """The folder that holds `marker`/ (SentEval's data/downstream), searched a few levels down."""
    for candidate in [folder, *sorted(folder.glob("*")), *sorted(folder.glob("*/*")), *sorted(folder.glob("*/*/*"))]:
        if (candidate / marker).is_dir():
            return candidate
    return None


def senteval_folder(senteval_dir: str | None) -> Path:
    """SentEval's data folder: the given one (or the folder holding STS/ a few levels down), else senteval.tar
    from the HF dataset repo, downloaded with huggingface_hub and unpacked once next to the cached file."""
    if senteval_dir is not None:
        folder = Path(senteval_dir).expanduser()
        if not folder.exists():
            raise UsageError(f"--senteval_dir {senteval_dir}: no such folder")
        root = _find_data_root(folder) if folder.is_dir() else None
        if root is None:
            raise UsageError(f"--senteval_dir {senteval_dir}: no SentEval STS/ folder found there")
        return root
    tar_path = Path(hub_file(SIMCSE_DATA_REPO, "senteval.tar", "--senteval_dir", local="folder"))
    target = tar_path.parent / "senteval_unpacked"
    if _find_data_root(target) is None:
        with tarfile.open(tar_path) as tar:
            try:
                tar.extractall(target, filter="data")
            except TypeError:  # Python releases before the extraction filters
                tar.extractall(target)
    root = _find_data_root(target)
    if root is None:
        raise UsageError(f"{tar_path} has no STS/ folder; pass --senteval_dir")
    return root


# ------------------------------------------------------------------------------------------------------- writing
def _json_safe(value):
    """NaN and infinities become null: JSON has no such numbers (Python would write a bare NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return [_json_safe(v) for v in value] if isinstance(value, (list, tuple)) else value


def write_json(path: Path, data: dict) -> None:
    """Write valid JSON to a temporary file beside `path`, then rename: a kill never leaves half a file."""
    text = json.dumps(_json_safe(data), indent=2, allow_nan=False)
    if path.exists() and not path.is_file():  # /dev/stdout and the like
        path.write_text(text)
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def refuse_flags(args, names, why: str) -> None:
    """Shared flags a script does not implement: one line naming those given, instead of ignoring them."""
    given = [f"--{name}" for name in names if getattr(args, name) not in (None, False)]
    if given:
        raise UsageError(f"{' '.join(given)}: {why}")


def check_installed(needed: bool, package: str, flag: str) -> None:
    """An optional dependency a flag needs: one line naming the package, before any work."""
    if needed and importlib.util.find_spec(package) is None:
        raise UsageError(f"{flag} needs the {package} package: pip install {package}")


def tensorboard(report_to: str, folder: Path, enabled: bool = True, resume_at: int | None = None):
    """--report_to tensorboard: a SummaryWriter on `folder`, flushed every 10 s; None otherwise. A previous run's
    events there are removed (--overwrite_output_dir replaces that run), unless the run resumes at step
    `resume_at`: then its events from that step on, written after its last save, are dropped."""
    if report_to != "tensorboard" or not enabled:
        return None
    from torch.utils.tensorboard import SummaryWriter
    if folder.exists() and resume_at is None:
        write(f"removing the previous run's TensorBoard events in {folder}")
        shutil.rmtree(folder)
    return SummaryWriter(str(folder), flush_secs=10, purge_step=resume_at)


def add_scalars(writer, step: int, values: dict) -> None:
    """TensorBoard scalars at `step`; undefined values (None, NaN, inf) are left out."""
    if writer is not None:
        for tag, value in values.items():
            if value is not None and math.isfinite(value):
                writer.add_scalar(tag, value, step)


def trajectory(results: dict) -> list[dict]:
    """The trajectory rows of a results.json (common.History.record), also from the format before them:
    "dev_curve" [[step, dev]] and "train_time_curve" [[step, seconds]] become rows without lr, align and
    uniform."""
    if "trajectory" in results:
        return results["trajectory"]
    rows = {step: {"step": step, "train_time_s": t} for step, t in results.get("train_time_curve", [])}
    for step, dev in results.get("dev_curve", []):
        rows.setdefault(step, {"step": step}).update(stsb_dev=dev, gate=True)
    return [rows[step] for step in sorted(rows)]


def swap_in(tmp: Path, target: Path) -> None:
    """Replace the folder `target` by the complete folder `tmp` with two renames: a kill between them leaves the
    previous one whole in <target>.old (and a kill before them leaves `target` as it was)."""
    old = target.with_name(target.name + ".old")
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def pyplot():
    """matplotlib's pyplot without a display (Agg)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: Path) -> None:
    """A figure to `path` (PNG, 110 dpi) through a temporary file, then closed."""
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
    pyplot().close(fig)
    print(f"wrote {path}")


def check_json_path(path: str | None) -> None:
    """--json must be writable and must not be a folder (checked before any work)."""
    if path is None or path == "/dev/stdout":
        return
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"--json {path} is a folder; give a file name")
    if not p.parent.is_dir():
        raise UsageError(f"--json {path}: the folder {p.parent} does not exist")


PROJECTION_FILE = "projection.safetensors"  # a linear layer after the pooler (sscl.py --output_dim)


def save_projection(out_dir: Path, projection: torch.nn.Linear) -> None:
    from safetensors.torch import save_file
    save_file({k: v.detach().cpu().contiguous() for k, v in projection.state_dict().items()},
              str(Path(out_dir) / PROJECTION_FILE))


def load_projection(name_or_path: str) -> torch.nn.Linear | None:
    """The projection saved beside a local model, or None."""
    path = Path(name_or_path) / PROJECTION_FILE
    if not path.is_file():
        return None
    from safetensors.torch import load_file
    weights = load_file(str(path))
    projection = torch.nn.Linear(weights["weight"].shape[1], weights["weight"].shape[0])
    projection.load_state_dict(weights)
    return projection


def write_sentence_transformers_config(out_dir: Path, pooler: str, hidden_size: int, head=None) -> None:
    """modules.json + 1_Pooling (+ 2_Dense for the "cls" pooler) so SentenceTransformer(dir) matches eval_sts."""
    mode = {"cls": "cls", "cls_before_pooler": "cls", "avg": "mean"}.get(pooler)
    if mode is None:  # avg_top2 / avg_first_last have no sentence-transformers pooling mode
        return
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (out_dir / "1_Pooling").mkdir()
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden_size, "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False}, indent=2))
    if pooler == "cls":
        from safetensors.torch import save_file
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
        (out_dir / "2_Dense").mkdir()
        (out_dir / "2_Dense" / "config.json").write_text(json.dumps({
            "in_features": hidden_size, "out_features": hidden_size, "bias": True,
            "activation_function": "torch.nn.modules.activation.Tanh"}))
        save_file({"linear.weight": head[0].weight.detach().cpu().contiguous(),
                   "linear.bias": head[0].bias.detach().cpu().contiguous()},
                  str(out_dir / "2_Dense" / "model.safetensors"))
    (out_dir / "modules.json").write_text(json.dumps(modules, indent=2))
    (out_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))


# ------------------------------------------------------------------------------------------------------ progress
def interactive() -> bool:
    return sys.stderr.isatty()


def width() -> dict:
    """The bar follows the terminal's width; a terminal that reports no size (a bare pty) gets 100 x 50."""
    try:
        columns = os.get_terminal_size(sys.stderr.fileno()).columns
    except OSError:
        columns = 0
    return {"dynamic_ncols": True} if columns else {"ncols": 100, "nrows": 50}


def write(message: str) -> None:
    """print(message) to stdout, above any bar."""
    tqdm.write(message, file=sys.stdout)
    sys.stdout.flush()


def duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


class Progress:
    """Progress of one phase of `total` units: `update(n)` after each piece of work, `set_postfix(**values)` to
    show values beside it (None is left out). `report_each`: in a log, a line for every update (slow units).
    Costs a clock read per update: nothing waits for a GPU."""

    def __init__(self, total: int, desc: str, unit: str = "it", enabled: bool = True, leave: bool = False,
                 report_each: bool = False, initial: int = 0):
        self.total, self.desc, self.unit, self.n, self.postfix = total, desc, unit, initial, ""
        self.initial = initial  # done before (a resumed run): not in the rate
        self.enabled, self.report_each = enabled, report_each  # report_each: a plain line for every update
        self.interval = float(os.environ.get("PROGRESS_INTERVAL", 10))
        self.bar = tqdm(total=total, desc=desc, unit=unit, leave=leave, initial=initial, **width()) \
            if enabled and interactive() else None
        self.start = self.last = self.last_update = time.monotonic()
        self.lines = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.last_update = time.monotonic()
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled:
            if self.report_each or now - self.last >= self.interval * (1 if now - self.start < 600 else 6):
                self.last = now
                self.lines += 1
                write(self.line(now))

    def unpause(self) -> None:
        """The time since the last update (a dev gate, say) counts neither in the rate nor in the ETA."""
        gap = time.monotonic() - self.last_update
        self.start, self.last, self.last_update = self.start + gap, self.last + gap, self.last_update + gap
        if self.bar is not None:
            self.bar.unpause()

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                 for k, v in values.items() if v is not None)
        if self.bar is not None:
            self.bar.set_postfix_str(self.postfix, refresh=False)

    def line(self, now: float) -> str:
        elapsed = now - self.start
        rate = (self.n - self.initial) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.n) / rate if rate > 0 else None
        done = f"{self.n}/{self.total} {self.unit}s ({100 * self.n / max(self.total, 1):.0f}%)"
        postfix = f"  {self.postfix}" if self.postfix else ""
        return f"{self.desc}: {done}, {rate:.3g} {self.unit}s/s, {duration(elapsed)} elapsed, ETA " \
               f"{duration(eta)}{postfix}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.enabled and self.lines and not self.report_each:  # a phase that reported once reports its end
            elapsed = time.monotonic() - self.start
            self.lines = 0
            write(f"{self.desc}: {self.n}/{self.total} {self.unit}s in {duration(elapsed)}")
