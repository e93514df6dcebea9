"""What a first reading skips: the suite's plumbing. A method file calls it in one line where it needs it; nothing
here is part of a method, and a reader who came for the papers can leave this folder closed (as CleanRL's
cleanrl_utils/).

- This module: one-line errors (`UsageError`, the `cli` wrapper: exit status 2, never a traceback, `Parser`), the
  range, device and file checks (a folder that can be written, a disk that is not full).
- hub.py: files and models from the Hugging Face Hub or a local path, an offline machine told which flag to use, a
  damaged model folder named, `senteval.tar` unpacked once.
- backbones.py: what a method needs of the encoder it is given, checked when it is loaded: a bidirectional encoder,
  the attention mask it reads as its own, dropout, and what a flag needs (docs/backbones.md).
- files.py: atomic JSON (NaN written as null), two-rename folder swaps, the checkpoint's extra files (a projection,
  the sentence-transformers metadata), TensorBoard scalars, figures.
- progress.py: progress bars on a terminal, plain lines in a log file.
- options.py: the run flags every script shares, presets merged under the user's flags, the option checks.
- run.py: a training run's bookkeeping (the record, logging, progress, the trajectory, resume saves, the stop signal,
  the end of a run and results.json), written once and called in one line from each loop.
- distributed.py: torchrun's process group, DistributedDataParallel, the gather with gradients.
- resume.py: --resume's last/ folder. checkpoint.py: best/ and the device copy of the best model it is written from.
- outdir.py: what an output folder holds (a started, resumable, evaluating, completed or stopped run) against what a
  command asks, room for the saves, what --overwrite_output_dir clears. lock.py: one process writes a folder.
- syncs.py: the host-device sync counter (--count_host_syncs).
- graph.py: --cuda_graph's training step, captured once in a CUDA graph and replayed.
- memory.py: what a run needs of a GPU's memory, traced on fake tensors before any GPU (tools/bench.py --memory), and
  the one line before training on a GPU too small.
- provenance.py: where a run came from (commit, versions, device, times) and best/'s model card with the citations.
"""
from __future__ import annotations

import argparse
import atexit
import csv
import gc
import importlib.util
import math
import os
import shlex
import sys
import traceback
from pathlib import Path


class UsageError(ValueError):
    """Something the user can fix: printed as one line by `cli`, exit status 2, never a traceback."""


_keep_after_out_of_memory = None  # the run in progress's (plumbing/run.py: Run.out_of_memory), else None


def on_out_of_memory(keep) -> None:
    """What `cli` calls when the device runs out of memory: `keep(reason)` keeps what the run reached and returns
    what the one line says of it (a run registers it when it starts); None: nothing to keep."""
    global _keep_after_out_of_memory
    _keep_after_out_of_memory = keep


_after_main = []  # what `cli` calls once main() has returned, however it ended (after_main)


def after_main(call) -> None:
    """Have `cli` call `call()` once main() has returned and its objects are freed."""
    _after_main.append(call)


def cli(main) -> None:
    """Run `main()`; a UsageError becomes one line on stderr and exit status 2, and so does running out of memory,
    once the run in progress has kept what it reached (Run.out_of_memory)."""
    on_out_of_memory(None)
    # at the process's end, what is left is frozen: the interpreter's last garbage collections then skip torch's and
    # transformers' objects, which took 2-3 s after a run's last line (Slurm's KillWait counts them); frozen only then,
    # since a process that runs several mains (tests/test_distributed.py's driver) needs its collections between them
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    try:
        main()
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except Exception as err:  # torch's OutOfMemoryError (torch imported by whatever ran out: the tools need it not)
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(err, torch.OutOfMemoryError):
            raise
        reason = str(err).splitlines()[0][:120]
        traceback.clear_frames(err.__traceback__)  # the failed pass's tensors, held by its frames, freed
        keep = _keep_after_out_of_memory
        print("error: the GPU ran out of memory " + (keep(reason) if keep else f"({reason}): --gradient_checkpointing "
              "and --micro_batch_size K train the same objective in less (python tools/bench.py --memory says what "
              "each needs)"), file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        while _after_main:  # torchrun's processes: the process groups last (distributed.shutdown)
            _after_main.pop()()


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line instead of usage + error, takes flags only as spelled out (no
    abbreviation: `--max_step 5` is not `--max_steps`, and a flag added later cannot change what an old command
    means) and names the nearest flag of an unknown one; a training script's arguments also record the exact
    command (`command`: results.json, the model card)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # parse_known_args too: a method's first pass over its flags
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def unrecognized(self, extras: list[str]) -> str:
        """The error for flags this parser does not have, naming the flag the first unknown one is nearest to: the
        shortest it begins (an abbreviation: `--micro_batch`), else a close spelling (difflib, 70% alike: `--batchsize`;
        below that the suggestions were more often wrong than right)."""
        import difflib
        message = f"unrecognized arguments: {' '.join(extras)}"
        flags = [s for action in self._actions for s in action.option_strings if s.startswith("--")]
        unknown = next((extra.split("=", 1)[0] for extra in extras if extra.startswith("--")), None)
        if unknown is None:
            return message
        close = sorted((f for f in flags if f.startswith(unknown)), key=len)[:1] or \
            difflib.get_close_matches(unknown, flags, n=1, cutoff=0.7)
        return message + (f"; did you mean {close[0]}?" if close else "")

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self.unrecognized(extras))
        if getattr(parsed, "method", None):
            root = Path(__file__).resolve().parents[1]
            script = f"{parsed.method}.py" if (root / f"{parsed.method}.py").is_file() else \
                f"ablations/{parsed.method}.py"
            parsed.command = shlex.join(["python", script, *(sys.argv[1:] if args is None else map(str, args))])
        return parsed


def check_range(args, name: str, ok, accepted: str) -> None:
    value = getattr(args, name)
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and ok(value)):
        raise UsageError(f"--{name} {value} is out of range: {accepted}")


def resolve_device(name: str | None) -> torch.device:
    """The --device, checked to exist on this machine (default: cuda if available)."""
    import torch
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


def check_file(path, flag: str) -> Path:
    """A file that exists, is not a folder and can be read; one line naming `flag` otherwise."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{flag} {path}: no such file" + (" (it is a folder)" if p.is_dir() else ""))
    if not os.access(p, os.R_OK):
        raise UsageError(f"{flag} {path}: cannot be read (not readable by this user)")
    return p


def read_lines(path, flag: str) -> list[str]:
    """A text file's lines; missing, unreadable, not UTF-8 or empty is one line naming the file (and line)."""
    p = check_file(path, flag)
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


def triplet_columns(lines: list[str], path, hard_negatives: bool, neutral: bool) -> list[str]:
    """An NLI file's columns a run reads (data.training_examples): sent0, sent1, hard_neg where the file has it
    and `hard_negatives`, neutral with `neutral`; a header without them or a short row is one line."""
    rows = csv.reader(lines)
    header = next(rows)
    if {"sent0", "sent1"} - set(header):
        raise UsageError(f"--train_file {path}: the header must name sent0,sent1 (and hard_neg for hard negatives: "
                         "nli_for_simcse.csv)")
    if neutral and not {"hard_neg", "neutral"} <= set(header):
        raise UsageError(f"--train_file {path}: --neutral_hard_negatives needs sent0,sent1,hard_neg,neutral columns "
                         "(docs/reproducing.md)")
    for row in rows:
        if len(row) < len(header):
            raise UsageError(f"--train_file {path} line {rows.line_num} has {len(row)} column(s), expected "
                             f"{len(header)}")
    return ["sent0", "sent1"] + (["hard_neg"] if hard_negatives and "hard_neg" in header else []) + \
        (["neutral"] if neutral else [])


def parse_score(value: str, path, line_number: int, flag: str) -> float:
    try:
        score = float(value)
    except ValueError:
        score = math.nan
    if not math.isfinite(score):
        raise UsageError(f"{flag}: {path} line {line_number}: the score '{value}' is not a number")
    return score


def refuse_flags(args, names, why: str) -> None:
    """Shared flags a script does not implement: one line naming those given, instead of ignoring them."""
    given = [f"--{name}" for name in names if getattr(args, name) not in (None, False)]
    if given:
        raise UsageError(f"{' '.join(given)}: {why}")


def check_installed(needed: bool, package: str, flag: str) -> None:
    """An optional dependency a flag needs: one line naming the package, before any work."""
    if needed and importlib.util.find_spec(package) is None:
        raise UsageError(f"{flag} needs the {package} package: pip install {package}")


def check_json_path(path: str | None, flag: str = "--json") -> None:
    """--json (or another output file) must not be a folder and must be writable (checked before any work)."""
    if path is None or path == "/dev/stdout":
        return
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {path} is a folder; give a file name")
    if not p.parent.is_dir():
        raise UsageError(f"{flag} {path}: the folder {p.parent} does not exist")
    check_writable(p.parent, flag, shown=path)
    if p.exists() and not os.access(p, os.W_OK):
        raise UsageError(f"{flag} {path}: the file is not writable by this user")


FULL = 1 << 20  # bytes: a disk with less free is full


def check_writable(path, flag: str, shown=None) -> None:
    """`path` (a folder, made later if need be) can be written: its nearest existing folder is writable (permissions,
    a read-only file system) and its disk is not full; one line naming `flag` otherwise, before any work."""
    path = Path(path)
    shown = path if shown is None else shown
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag} {shown}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
        raise UsageError(f"{flag} {shown}: {existing} is " + ("on a read-only file system" if read_only else
                                                             "not writable by this user") + "; give a folder you can "
                         "write")
    free = free_bytes(existing)
    if free < FULL:
        raise UsageError(f"{flag} {shown}: the disk of {existing} is full ({free / 2**20:.1f} MiB free); free some "
                         "space or give a folder on another disk")


def free_bytes(folder) -> int:
    """The bytes this user may still write on the disk of `folder`."""
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize
