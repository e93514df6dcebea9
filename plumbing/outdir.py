"""The output folder of a run: what it holds, what a command may do with it, whether it can take the run, and what
--overwrite_output_dir clears.

A run writes there: started.json when it starts, best/ (its best checkpoint), last/ (what --resume reads),
results.json (its record), tb/ (--report_to), each written beside its place and swapped in; .lock while it runs
(plumbing/lock.py). What a folder holds, read from those files (`state`):

- empty:       nothing of a run (absent, or other files only);
- started:     started.json (and perhaps best/, tb/) but no last/ and no results.json, or the results.json of a run
               that ran out of memory: stopped before its first save;
- resumable:   last/ (or last.old/, between the two renames of a save): stopped during training;
- evaluating:  results.json says the training ended and the final evaluation did not (a signal or a kill during it,
               or while the end's best/ was written): a resume runs the evaluation alone;
- completed:   results.json of a run that ended; nothing rewrites it;
- stopped:     results.json of a run that stopped itself (divergence, fp16 overflow): it would stop again;
- lost:        results.json of a run stopped during training whose last/ is gone;
- damaged:     a results.json that cannot be read.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import plumbing
from plumbing import progress, resume, tracking

RESULTS = "results.json"
RUN_FILES = (RESULTS, "best", "tb", "last", "last.old", resume.STARTED)  # a folder holding one of them holds a run
CLEARED = RUN_FILES + ("best.tmp", "best.old", "last.tmp", RESULTS + ".tmp", resume.STARTED + ".tmp",
                       "wandb", "mteb")  # --report_to wandb's local files, tools/mteb_eval.py's results
SELF_STOPS = ("divergence", "fp16 overflow")  # a resume would meet them again


def read_results(out: Path) -> dict:
    """results.json as a dict; one line (UsageError) if it is truncated, not JSON or not an object."""
    path = Path(out) / RESULTS
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise plumbing.UsageError(f"{path} cannot be read ({type(err).__name__}: a truncated or damaged file)") \
            from None
    if not isinstance(results, dict):
        raise plumbing.UsageError(f"{path} is not a run's record (a JSON {type(results).__name__}, not an object)")
    return results


def state(out) -> tuple[str, str]:
    """(what the folder holds: one of the names above, a few words on why)."""
    out = Path(out)
    if (out / RESULTS).exists():
        try:
            results = read_results(out)
        except plumbing.UsageError as err:
            return "damaged", str(err)
        stop = results.get("stop") or {}
        if not results.get("interrupted"):
            return "completed", f"its best STS-B dev at step {results.get('best_step')}; results.json"
        if results.get("interrupted_during") == "final evaluation":
            return "evaluating", "its training ended; its final evaluation did not"
        if stop.get("by") in SELF_STOPS:
            return "stopped", stop.get("reason") or stop["by"]
        saves = (results.get("checkpoint_time_s") or {}).get("last_writes", 0)
        if resume.folder(out) is None and stop.get("by") == "out of memory" and saves:  # the record and the folder
            # disagree (it saved last/, which is gone): nothing is guessed, nothing overwritten
            return "damaged", f"{out / RESULTS} records {saves} save(s) of last/ and a stop at step " \
                              f"{stop.get('step', results.get('steps'))}, but there is no last/"
        if finished_card(out):
            return "damaged", f"{out / 'best' / 'README.md'} holds a finished run's test scores, but {out / RESULTS} " \
                              "a run that did not finish"
        if resume.folder(out) is None and stop.get("by") == "out of memory":  # before its first save: it starts
            return "started", "stopped by running out of memory before its first save of last/"  # again, as killed
        if resume.folder(out) is None:
            return "lost", f"results.json of a run stopped during training at step {results.get('steps')}, " \
                           "and no last/"
    if resume.folder(out) is not None:
        return "resumable", f"{resume.folder(out).name}/"
    if any((out / name).exists() for name in RUN_FILES):
        return "started", f"{resume.STARTED}, no last/ and no results.json"
    return "empty", ""


def finished_card(out: Path) -> bool:
    """Whether best/'s model card holds STS test scores: the outcome of a finished run."""
    card = out / "best" / "README.md"
    return card.is_file() and "STS test, Spearman" in card.read_text(errors="replace")


def escaping(out: Path) -> tuple[Path, Path] | None:
    """(a run file or folder of `out`, or a file in best/ or last/, that is a symbolic link leading out of the
    folder; where it leads), or None. --output_dir itself may be a link (to a scratch disk, say)."""
    home = out.resolve()
    names = [*CLEARED, ".lock"]
    for path in [out / name for name in names] + [p for d in ("best", "last") if (out / d).is_dir() and
                                                  not (out / d).is_symlink() for p in (out / d).iterdir()]:
        if path.is_symlink() and not path.resolve().is_relative_to(home):
            return path, path.resolve()
    return None


def check(args) -> str:
    """What --output_dir holds against what the command asks (a new run, --resume, --auto_resume,
    --overwrite_output_dir), before any work: one line where they disagree, naming the safe next step first.
    --auto_resume sets args.resume; on a completed run of this command it says so and exits 0 (a requeued job that
    had finished). A run writes and deletes only inside the folder: a link that leads out of it is one line. The
    folder's state."""
    out = Path(args.output_dir)
    if out.exists() and not out.is_dir():
        raise plumbing.UsageError(f"--output_dir {out} is a file; give a folder")
    link = escaping(out) if out.is_dir() else None
    if link:
        raise plumbing.UsageError(f"--output_dir {out}: {link[0].relative_to(out)} is a symbolic link to {link[1]}, "
                                  "outside the run's folder, where a run writes nothing; put the folder's own copy "
                                  "in its place, then run the command again")
    if (args.resume or args.auto_resume) and args.overwrite_output_dir:
        raise plumbing.UsageError("--resume continues the run in --output_dir and --overwrite_output_dir replaces "
                                  "it: give one of them")
    name, why = state(out)
    if args.overwrite_output_dir:
        return name  # cleared when the run starts (clear), under its lock
    if not (args.resume or args.auto_resume):
        if name != "empty":
            raise plumbing.UsageError(f"--output_dir {out} {holds(out, name, why)}")
        return name
    flag = "--auto_resume" if args.auto_resume else "--resume"
    if args.auto_resume and name == "completed":
        finished(args, out)
    if name in ("completed", "stopped", "lost", "damaged"):
        raise plumbing.UsageError(f"{flag}: {out} {holds(out, name, why)}")
    if args.auto_resume:
        args.resume = name in ("resumable", "evaluating")
        if name == "started":
            resume.check_restart(args)  # the same run, stopped before its first save: it starts again
    if args.resume:
        resume.check(args, evaluating=name == "evaluating")  # what it resumes from, whole, and its arguments
    return name


def holds(out: Path, name: str, why: str) -> str:
    """What the folder holds, for a command that cannot use it as it asks, and the safe next step first (the flag that
    deletes a run last)."""
    other = "or give another --output_dir for a new run (--overwrite_output_dir deletes this one)"
    return {
        "resumable": f"holds a run stopped {resume.how_far(out)}: {next_step(False)}; {other}",
        "evaluating": f"holds a run whose training ended and whose final evaluation did not: {next_step(True)}; "
                      f"{other}",
        "started": "holds a run stopped before its first save of last/: the same command with --auto_resume starts "
                   f"it again; {other}",
        "completed": f"holds a completed run ({why}); nothing is rewritten: give another --output_dir, or "
                     "--overwrite_output_dir to replace it",
        "stopped": f"holds a run that stopped itself ({why}); resumed, it would stop again: start it with other "
                   "settings in another --output_dir, or with --overwrite_output_dir",
        "lost": f"holds {why}: it cannot continue; give another --output_dir, or --overwrite_output_dir to start it "
                "again",
        "damaged": f"holds a damaged run: {why}; give another --output_dir, or --overwrite_output_dir to replace it",
    }[name]


def next_step(evaluation: bool) -> str:
    """How a stopped run goes on: the same command again, with --auto_resume."""
    if evaluation:
        return "to finish it, run the same command with --auto_resume (or --resume): it runs the final evaluation alone"
    return "to continue it, run the same command with --auto_resume (or --resume)"


def finished(args, out: Path) -> None:
    """--auto_resume on a completed run: this command's run (its arguments) is done, one line and exit 0, nothing
    rewritten (a requeued job that had finished, a protocol's second pass); another run's is one line, exit 2."""
    other = resume.difference(vars(args), (results := read_results(out))["args"], skip_unset=True)
    if other:
        raise plumbing.UsageError(f"--auto_resume: {out} holds a completed run of other arguments ({other}); nothing "
                                  "is rewritten: give another --output_dir, or --overwrite_output_dir to replace it")
    if os.environ.get("RANK", "0") == "0":  # before the process group: torchrun's processes all get here
        done = tracking.complete(args, results) if results.get("tracking_unfinished") else "nothing left to do"
        progress.write(f"complete: results in {out / RESULTS} (--auto_resume: {done})")
    raise SystemExit(0)  # every process, before any work


def size(path: Path) -> int:
    """Bytes of a file or folder (0 if absent)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def check_room(out, best_bytes: int, last_bytes: int) -> None:
    """Room on --output_dir's disk for the saves of a run whose best/ takes `best_bytes` and last/ `last_bytes`: each
    is written beside its previous copy and swapped in, so the peak is best/ and two last/. What the folder holds
    already counts as room. One line before training otherwise."""
    out = Path(out)
    need = best_bytes + 2 * last_bytes
    held = sum(size(out / name) for name in ("best", "last", "last.old", "best.old"))
    free = plumbing.free_bytes(out)
    if free + held < need:
        raise plumbing.UsageError(
            f"--output_dir {out}: {free / 2**20:,.0f} MiB free, but this run's saves need up to {need / 2**20:,.0f} "
            f"MiB (best/ {best_bytes / 2**20:,.0f} MiB and last/ {last_bytes / 2**20:,.0f} MiB, each written beside "
            "its previous copy); free some space or give a folder on another disk")


def clear(out) -> None:
    """--overwrite_output_dir: what the run being replaced left (its record, checkpoints, TensorBoard events), removed
    before the new run writes anything, so that nothing of it is read as the new run's. Other files stay."""
    found = [Path(out) / name for name in CLEARED if (Path(out) / name).exists()]
    if found:
        progress.write(f"--overwrite_output_dir: removing the previous run's {', '.join(p.name for p in found)} "
                       f"from {out}")
    for path in found:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
