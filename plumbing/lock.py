"""One process writes a run's folder: a lock on <output_dir>/.lock, held from the run's start to its exit.

The lock is filelock's (`filelock.FileLock`: the kernel's `flock`), not the file: it goes with the process that holds
it, however that process ends (a SIGKILL, a lost node), so a stale lock file never blocks a resume. The file holds the
holder's process id, host and start, which the refusal names (filelock 4 leaves a contender's open of it untouched and
empties it for its winner); a run that ends removes it. Under torchrun process 0 holds it for the run's processes.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import filelock

import plumbing

NAME = ".lock"
_HELD = {}  # {folder: its FileLock}: this process's locks (a process may run several runs, one after another)


def holder(folder) -> str:
    """Who holds the lock of `folder`, as its file says."""
    try:
        info = json.loads((Path(folder) / NAME).read_text())
        return f"process {info['pid']} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def taken(folder) -> filelock.FileLock:
    """The lock of `folder`, taken now (its file created if need be), or one line naming the live process that has
    it."""
    held = filelock.FileLock(Path(folder) / NAME, timeout=0, thread_local=False, fallback_to_soft=False)
    try:
        held.acquire()
    except filelock.Timeout:
        raise plumbing.UsageError(f"--output_dir {folder} is in use by {holder(folder)}: one run writes a folder at "
                                  "a time; wait for it to end, or give another --output_dir") from None
    return held


def check_free(folder) -> None:
    """Before any work: one line if a live process holds `folder`'s lock (no file is created)."""
    if (Path(folder) / NAME).is_file() and key(folder) not in _HELD:
        taken(folder).release()


def hold(folder, started: str) -> filelock.FileLock:
    """The lock of `folder`, held until `release` or the process's exit, its file naming this process; one line if
    another live process holds it."""
    if key(folder) not in _HELD:
        _HELD[key(folder)] = taken(folder)
        (Path(folder) / NAME).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                     "started": started}))
    return _HELD[key(folder)]


def release(folder) -> None:
    """The lock given back at a run's end and its file removed (a process that dies gives the lock back and leaves
    the file, which the next run takes over)."""
    held = _HELD.pop(key(folder), None)
    if held is not None:
        (Path(folder) / NAME).unlink(missing_ok=True)
        held.release()


def key(folder) -> str:
    return os.path.realpath(folder)
