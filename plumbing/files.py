"""Files: atomic JSON (NaN written as null), folders swapped in with two renames, the extra files of a checkpoint (a
projection after the pooler, the sentence-transformers metadata), TensorBoard scalars, a results.json's trajectory,
figures."""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from pathlib import Path


import plumbing
from plumbing.progress import write

def _json_safe(value):
    """NaN and infinities become null: JSON has no such numbers (Python would write a bare NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return [_json_safe(v) for v in value] if isinstance(value, (list, tuple)) else value

def is_write_error(err: BaseException) -> bool:
    """An error of writing a file: the OS's (a full disk, a quota, a read-only file system, a file size limit),
    torch.save's (its zip writer's: "PytorchStreamWriter failed writing file", "iostream error", "unexpected pos")
    and safetensors' (an IoError inside)."""
    if isinstance(err, OSError):
        return True
    text = str(err).lower()
    return type(err).__name__ == "SafetensorError" or (isinstance(err, RuntimeError) and any(
        word in text for word in ("writ", "iostream", "inline_container", "no space")))


@contextlib.contextmanager
def failed_write(what, partial: Path | None = None, kept: str = ""):
    """A write that fails becomes one line (UsageError) naming `what` and why; the partial copy `partial` is removed,
    and `kept` says what stayed whole (the previous copy: each is written beside its place and swapped in)."""
    try:
        yield
    except BaseException as err:
        inner = isinstance(err, plumbing.UsageError)  # a write inside this one failed, and said so
        if not (inner or is_write_error(err)):
            raise
        if partial is not None and Path(partial).is_dir():
            shutil.rmtree(partial, ignore_errors=True)
        elif partial is not None:
            Path(partial).unlink(missing_ok=True)
        if inner:
            raise
        reason = getattr(err, "strerror", None) or str(err).strip().splitlines()[0][:160]
        if not isinstance(err, OSError) and disk_full(Path(what).parent):  # torch.save's zip writer says "pos 64"
            reason = "No space left on device"
        raise plumbing.UsageError(f"writing {what} failed ({reason})" + (f"; {kept}" if kept else "")) from None


def disk_full(folder: Path) -> bool:
    try:
        return plumbing.free_bytes(folder) < plumbing.FULL
    except OSError:
        return False


def write_text(path: Path, text: str) -> None:
    """A text file written beside `path` and renamed onto it: a kill never leaves half a file, and a write that fails
    (a full disk) is one line, the previous file as it was."""
    tmp = path.with_name(path.name + ".tmp")
    with failed_write(path, tmp, "the previous file is as it was" if path.exists() else ""):
        tmp.write_text(text)
        os.replace(tmp, path)

def write_json(path: Path, data: dict) -> None:
    """Write valid JSON to a temporary file beside `path`, then rename: a kill never leaves half a file."""
    text = json.dumps(_json_safe(data), indent=2, allow_nan=False)
    if path.exists() and not path.is_file():  # /dev/stdout and the like
        path.write_text(text)
        return
    write_text(path, text)

def trajectory(results: dict) -> list[dict]:
    """The trajectory rows of a results.json (plumbing/run.py: History.record), also from the format before them:
    "dev_curve" [[step, dev]] and "train_time_curve" [[step, seconds]] become rows without lr, align and uniform."""
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
    try:
        with failed_write(path, tmp, "the previous file is as it was" if path.exists() else ""):
            fig.savefig(tmp, dpi=110)
            os.replace(tmp, path)
    finally:
        pyplot().close(fig)
    print(f"wrote {path}")


PROJECTION_FILE = "projection.safetensors"  # a linear layer after the pooler (sscl.py --output_dim)
HEAD_FILE = "mlp_head.safetensors"  # SimCSE's trained MLP head, for the "cls" pooler of any backbone
EVAL_POOLER_FILE = "eval_pooler.json"  # the pooler a run evaluated its checkpoint with


def recorded_pooler(name_or_path: str) -> str | None:
    """The evaluation pooler a run recorded beside its checkpoint (EVAL_POOLER_FILE), or None."""
    path = Path(name_or_path) / EVAL_POOLER_FILE
    try:
        return json.loads(path.read_text())["pooler"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_linear(out_dir: Path, name: str, linear: torch.nn.Linear) -> None:
    """A linear layer's weight and bias, beside a saved model (PROJECTION_FILE, HEAD_FILE)."""
    from safetensors.torch import save_file
    save_file({k: v.detach().cpu().contiguous() for k, v in linear.state_dict().items()}, str(Path(out_dir) / name))

def load_linear(name_or_path: str, name: str) -> torch.nn.Linear | None:
    """The linear layer saved beside a local model under `name`, or None."""
    path = Path(name_or_path) / name
    if not path.is_file():
        return None
    import torch
    from safetensors.torch import load_file
    weights = load_file(str(path))
    linear = torch.nn.Linear(weights["weight"].shape[1], weights["weight"].shape[0])
    linear.load_state_dict(weights)
    return linear

def pooling_mode(pooler: str) -> str | None:
    """sentence-transformers' pooling mode of a pooler, or None where it has none (the two-layer averages)."""
    return {"cls": "cls", "cls_before_pooler": "cls", "avg": "mean"}.get(pooler)

def write_sentence_transformers_config(out_dir: Path, pooler: str, hidden_size: int, head=None) -> None:
    """modules.json + 1_Pooling (+ 2_Dense for the "cls" pooler) so SentenceTransformer(dir) matches eval_sts."""
    mode = pooling_mode(pooler)
    if mode is None:  # the two-layer averages have no sentence-transformers pooling mode
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
