"""--resume: a run's whole training state in <output_dir>/last/, restored so that the resumed run continues exactly
as an uninterrupted one would have (the same losses, dev curve and best checkpoint, bit for bit).

What a reader of a method file can skip: a method file names what its state holds (`run.start(..., **state)`: the
encoder, the head, the optimiser, the schedule, the GradScaler and whatever else its numbers depend on), and its
Run (plumbing/run.py) calls `save` between steps (at a dev gate after --save_minutes of training, every --save_steps,
and when Ctrl-C or SIGTERM stops the run), `restore` before the first step and `drop` after results.json.

last/ holds:
- state.pt, written by process 0 (the state is the same on every process): each `run_state` object's state_dict,
  and the loop's record (best dev score and step, training time, losses, gradient norms, trajectory, resumptions);
- rng_rank<r>.pt, one per process: its RNG streams (torch CPU and CUDA, Python's `random`, NumPy) and the state
  of each torch.Generator in `run_state` (miCSE's AMI samples and WhitenedCSE's shuffles, alike on every process;
  --do_mlm's masking, which differs by process);
- run.json: the arguments, the last step done, its epoch and position in that epoch's seeded order, the run's steps
  (`total_steps`) and the number of processes.
It is written into last.tmp/ and swapped in with two renames, as best/ is: a kill at any moment leaves last/ or,
between the two renames, last.old/, each whole, and `restore` reads whichever is there.

Tensors and plain data only (the RNG streams as tensors too), read with torch.load(weights_only=True): a last/ from
someone else (a shared scratch space, a downloaded run) cannot run code when it is resumed; one holding anything
else is refused in one line before any work (`check_safe`).
"""
from __future__ import annotations

import json
import math
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import torch

import plumbing
from plumbing import distributed, files

STARTED = "started.json"  # written when a run starts: its arguments (--auto_resume knows its own run by them)
# Flags that do not change a run's numbers: they may differ when it is resumed.
FREE_FLAGS = {"resume", "auto_resume", "overwrite_output_dir", "keep_last", "save_steps", "save_minutes",
              "eval_transfer", "num_workers", "report_to", "logging_steps", "align_uniform_steps", "no_test_eval",
              "no_align_uniform",
              "output_dir", "count_host_syncs", "gradient_checkpointing", "cuda_graph", "fit_memory", "command",
              "run_name", "run_tags", "run_group", "hub_model_id", "base_model", "license", "log_model",
              "presets", "backbone_config"}  # the last two are derived


def new_run() -> dict:
    """The record of a run that starts at step 0."""
    return {"next_step": 0, "best_dev": -math.inf, "best_step": None, "train_time": 0.0, "losses": [],
            "grad_norms": [], "trajectory": [], "resumptions": [], "skipped": []}


def folder(output_dir) -> Path | None:
    """last/, or last.old/ when a kill came between the two renames of a save; None when neither is there. A last/
    that lacks a file is still the run's last/: `check` names what is missing, and nothing deletes it."""
    return next((Path(output_dir) / name for name in ("last", "last.old") if (Path(output_dir) / name).is_dir()), None)


def check(args, evaluating: bool = False) -> None:
    """--resume, before any work: a last/ to resume from, whole, and the resumed run's arguments (those known so far;
    `restore` compares the rest). `evaluating`: the training ended and its final evaluation did not; results.json
    holds the record, and its arguments are compared."""
    if evaluating:
        results = Path(args.output_dir) / "results.json"
        compare(vars(args), json.loads(results.read_text())["args"], results, skip_unset=True)
        return
    last = folder(args.output_dir)
    if last is None:
        raise plumbing.UsageError(f"--resume: {args.output_dir} has no last/ to resume from (a run writes it at a "
                                  "dev gate after --save_minutes of training, every --save_steps and on a signal, "
                                  "and deletes it when it completes, unless --keep_last); the same command with "
                                  "--auto_resume instead starts a run that stopped before its first save again")
    compare(vars(args), read_run(last)["args"], last, skip_unset=True)
    for name in ["state.pt", *(p.name for p in sorted(last.glob("rng_rank*.pt")))]:
        readable(last / name)
        check_safe(last / name)
    if not any(last.glob("rng_rank*.pt")):
        raise damaged(last / "rng_rank0.pt", "missing")


def damaged(path: Path, why: str) -> plumbing.UsageError:
    return plumbing.UsageError(f"--resume: {path} cannot be read ({why}): the run cannot continue from it; start "
                               "it again with --overwrite_output_dir, or copy a whole last/ of it back")


def read_run(last: Path) -> dict:
    """last/run.json, or one line naming it."""
    try:
        return json.loads((last / "run.json").read_text())
    except (OSError, ValueError) as err:
        raise damaged(last / "run.json", type(err).__name__) from None


def readable(path: Path) -> None:
    """A file torch.save wrote (a zip archive) that is whole: its directory, written last, is there."""
    import zipfile
    if not path.is_file():
        raise damaged(path, "missing")
    if not zipfile.is_zipfile(path):
        raise damaged(path, "truncated or not a torch.save file")


def numpy_arrays() -> list:
    """What the RNG files of earlier versions hold besides tensors and plain data: NumPy's uint32 arrays (its Mersenne
    Twister's state), and no other NumPy type; rebuilding one copies bytes and calls nothing else. Named as NumPy 1
    and NumPy 2 pickle them."""
    reconstruct = (getattr(np, "_core", None) or np.core).multiarray._reconstruct
    return [np.ndarray, np.dtype, type(np.dtype(np.uint32)), (reconstruct, "numpy.core.multiarray._reconstruct"),
            (reconstruct, "numpy._core.multiarray._reconstruct")]


def unsafe(path: Path) -> plumbing.UsageError:
    return plumbing.UsageError(
        f"--resume: {path} holds Python objects other than tensors and plain data, which unpickling could run as code: "
        "it is not loaded (a file of an older version of the suite, or not of the suite); start the run again in "
        "another --output_dir, or here with --overwrite_output_dir")


def check_safe(path: Path) -> None:
    """A file of last/ holds only what torch.load(weights_only=True) builds (tensors, plain data, numpy_arrays), read
    from its pickle's opcodes without running them (a folder from someone else: a shared scratch space, a downloaded
    run); one line otherwise, before any work."""
    try:
        with torch.serialization.safe_globals(numpy_arrays()):
            found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as err:  # a damaged archive
        raise damaged(path, type(err).__name__) from None
    if found:
        raise unsafe(path)


def load(path: Path, device=None):
    """A file of last/, with torch.load(weights_only=True): tensors and plain data only (numpy_arrays for an earlier
    version's RNG files), so that no file can run code when it is read."""
    try:
        with torch.serialization.safe_globals(numpy_arrays()):
            return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError:  # weights_only's refusal (a global not allowed)
        raise unsafe(path) from None
    except Exception as err:  # a damaged archive: zipfile's, pickle's or torch's error
        raise damaged(path, type(err).__name__) from None


def started_args(out: Path) -> dict | None:
    """The arguments a run in `out` started with (its started.json), or None where there is none readable."""
    try:
        return json.loads((Path(out) / STARTED).read_text())["args"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_restart(args) -> None:
    """--auto_resume without a last/ or results.json: the folder holds this same run stopped before its first save
    (its started.json has these arguments), which starts again; anything else is one line."""
    out = Path(args.output_dir)
    started = started_args(out)
    if started is None:
        raise plumbing.UsageError(f"--auto_resume: {out} holds a run but no {STARTED} saying which; give another "
                                  "--output_dir, or --overwrite_output_dir to replace it")
    compare(vars(args), started, out / STARTED, skip_unset=True)
    distributed.log(f"--auto_resume: {out} has no last/ yet (the run stopped before its first save): starting "
                    "it again")


PATH_FLAGS = {"model_name_or_path", "train_file", "senteval_dir"}


def same_value(name: str, value, saved) -> bool:
    """A flag's value against the saved run's; paths as paths (DIR/ and DIR, ./DIR and DIR: one folder)."""
    value = json.loads(json.dumps(value))
    if value == saved:
        return True
    if name in PATH_FLAGS and isinstance(value, str) and isinstance(saved, str):
        if os.path.normpath(value) == os.path.normpath(saved):
            return True
        try:
            return os.path.samefile(value, saved)
        except OSError:
            return False
    return False


def difference(current: dict, saved: dict, skip_unset: bool = False) -> str | None:
    """The first argument that defines the run and differs from the saved run's ("--lr is 0.002 here but 0.001"), or
    None."""
    for name, value in current.items():
        if name in FREE_FLAGS or name not in saved or (skip_unset and value is None):
            continue
        if not same_value(name, value, saved[name]):
            return f"--{name} is {value} here but {saved[name]}"
    return None


def compare(current: dict, saved: dict, last: Path, skip_unset: bool = False) -> None:
    """The first argument that defines the run and differs from the saved run's, in one line."""
    other = difference(current, saved, skip_unset)
    if other:
        flag = "--auto_resume" if current.get("auto_resume") else "--resume"
        raise plumbing.UsageError(f"{flag}: {other} in the run in {last}; resume it with its own arguments, or "
                                  "start a new run in another --output_dir")


def how_far(output_dir) -> str:
    """How far the run in last/ came: "after step 120 of 400" (without "of" for a last/ of an earlier version)."""
    try:
        run = read_run(folder(output_dir))
        total = run.get("total_steps")
        return f"after step {run['step']}" + (f" of {total}" if total else "")
    except (plumbing.UsageError, KeyError, TypeError):
        return "in training (its last/)"


def save(args, step: int, run_state: dict, loader, history, loop: dict) -> None:
    """last/ after `step`: `run_state`, the RNG streams, the data position, and the record so far (`history` and
    `loop`: best_dev, best_step, train_time, checkpoint_time, provenance, total_steps, eval_pooler). Every process
    takes part. A write that fails is one line, the previous last/ whole."""
    out = Path(args.output_dir)
    tmp = out / "last.tmp"
    kept = "last/ and best/ hold the last complete save; free some space, then run the same command with --auto_resume"
    with files.failed_write(out / "last", tmp, kept):  # a full disk: one line, the previous last/ whole
        if distributed.rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        distributed.barrier()
        generators = {name: g.get_state() for name, g in run_state.items() if isinstance(g, torch.Generator)}
        torch.save({"rng": rng_state(), "generators": generators}, tmp / f"rng_rank{distributed.rank()}.pt")
        distributed.barrier()
        if distributed.rank() == 0:
            state = {name: obj.state_dict() for name, obj in run_state.items()
                     if obj is not None and not isinstance(obj, torch.Generator)}
            state["record"] = {**loop, "losses": history.losses, "grad_norms": history.grad_norms,
                               "terms": history.terms, "trajectory": history.trajectory,
                               "resumptions": history.resumptions, "skipped": history.skipped}
            torch.save(state, tmp / "state.pt")
            per_epoch = len(loader)
            files.write_json(tmp / "run.json", {"args": vars(args), "step": step, "epoch": step // per_epoch,
                                                "position": step % per_epoch, "total_steps": loop["total_steps"],
                                                "world_size": distributed.world_size()})
            files.swap_in(tmp, out / "last")
    distributed.barrier()


def restore(args, run_state: dict, loader, device, evaluating: bool = False) -> dict:
    """last/ into `run_state` on every process, the batch sampler moved to where the run stopped, and the RNG
    streams last of all; the loop's record, with "next_step". `evaluating`: the training ended and its final
    evaluation did not: the record is results.json's, and nothing is left to train."""
    if evaluating:
        return record_of_results(args)
    last = folder(args.output_dir)
    run = read_run(last)
    compare(vars(args), run["args"], last)  # now with what the method filled in (miCSE's AMI layers)
    if run["world_size"] != distributed.world_size():
        raise plumbing.UsageError(f"--resume: the run in {last} had {run['world_size']} process(es), this one "
                                  f"has {distributed.world_size()}; resume it with as many")
    state = load(last / "state.pt", device)
    for name, obj in run_state.items():
        if obj is not None and not isinstance(obj, torch.Generator) and state[name]:
            obj.load_state_dict(state[name])  # an empty state is a disabled GradScaler's
    loader.batch_sampler.epoch, loader.batch_sampler.skip = run["epoch"], run["position"]
    per_process = load(last / f"rng_rank{distributed.rank()}.pt")
    for name, generator_state in per_process["generators"].items():
        run_state[name].set_state(generator_state)
    set_rng_state(per_process["rng"])
    record = state["record"]
    record.update(next_step=run["step"] + 1, resumptions=record["resumptions"] + [run["step"]])
    distributed.log(f"resuming {args.output_dir} after step {run['step']} (epoch {run['epoch']}, batch "
                    f"{run['position']} of its order) from {last}")
    return record


# results.json's values of where and how the training ran, which an evaluation-only resume keeps (Run._results)
TRAINING_RECORD = ("device", "world_size", "summary", "peak_memory_mb", "peak_memory_kind", "peak_memory_reserved_mb",
                   "host_syncs")


def record_of_results(args) -> dict:
    """The loop's record from the results.json of a run whose training ended: its final evaluation is what is left
    (next_step after the last step); "trained": where and how the training ran (TRAINING_RECORD)."""
    path = Path(args.output_dir) / "results.json"
    results = json.loads(path.read_text())
    compare(vars(args), results["args"], path)
    best_dev = results["best_dev_stsb"]
    distributed.log(f"resuming {args.output_dir}: its {results['steps']} steps are done (results.json); the final "
                    "evaluation of best/ is what is left")
    return {"next_step": results["steps"] + 1, "best_dev": -math.inf if best_dev is None else best_dev,
            "best_step": results["best_step"], "train_time": results["train_time_s"],
            "losses": results["train_loss"], "grad_norms": results["grad_norm"], "trajectory": results["trajectory"],
            "terms": results.get("train_terms", {}),
            "resumptions": results["resumptions"] + [results["steps"]], "skipped": results.get("skipped_steps", []),
            "checkpoint_time": results.get("checkpoint_time_s"), "provenance": results.get("provenance"),
            "eval_pooler": results.get("eval_pooler"), "tracking": results.get("tracking"),
            "trained": {key: results[key] for key in TRAINING_RECORD if key in results}}


def drop(args, results: dict) -> None:
    """A completed run needs no last/: deleted (process 0) unless --keep_last or the run was interrupted."""
    if not results["interrupted"] and not args.keep_last:
        for name in ("last", "last.old", "last.tmp"):
            shutil.rmtree(Path(args.output_dir) / name, ignore_errors=True)


def rng_state() -> dict:
    """This process's RNG streams as tensors and plain data (what torch.load(weights_only=True) reads): Python's
    `random` and NumPy's Mersenne Twisters' words as int64 tensors."""
    version, words, gauss_next = random.getstate()
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "python": {"version": version, "words": torch.tensor(words, dtype=torch.int64), "gauss_next": gauss_next},
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": position,
                      "has_gauss": has_gauss, "cached_gaussian": cached_gaussian},
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None}


def set_rng_state(state: dict) -> None:
    """rng_state's streams back; an earlier version's (Python's tuple, NumPy's tuple with its array) too."""
    torch.set_rng_state(state["torch"])
    python, numpy = state["python"], state["numpy"]
    if isinstance(python, dict):
        python = (python["version"], tuple(python["words"].tolist()), python["gauss_next"])
    if isinstance(numpy, dict):
        numpy = (numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["position"], numpy["has_gauss"],
                 numpy["cached_gaussian"])
    random.setstate(python)
    np.random.set_state(numpy)
    if state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])
