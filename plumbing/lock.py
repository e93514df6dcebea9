"""One process writes a run's folder: a lock on <output_dir>/.lock, held from the run's start to its exit.

The lock is the kernel's (`fcntl.flock`), not the file: it goes with the process that holds it, however that process
ends (a SIGKILL, a lost node), so a stale lock file never blocks a resume. The file holds the holder's process id,
host and start, which the refusal names; a run that ends removes it. Under torchrun process 0 holds it for the run's
processes.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path

import plumbing

NAME = ".lock"
_HELD = {}  # {folder: its open lock file}: this process's locks (a process may run several runs, one after another)


def holder(folder) -> str:
    """Who holds the lock of `folder`, as its file says."""
    try:
        info = json.loads((Path(folder) / NAME).read_text())
        return f"process {info['pid']} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def refused(folder) -> plumbing.UsageError:
    return plumbing.UsageError(f"--output_dir {folder} is in use by {holder(folder)}: one run writes a folder at a "
                               "time; wait for it to end, or give another --output_dir")


def check_free(folder) -> None:
    """Before any work: one line if a live process holds `folder`'s lock (nothing is created)."""
    path = Path(folder) / NAME
    if not path.is_file() or key(folder) in _HELD:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # unreadable: hold() says what is wrong
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise refused(folder) from None
    finally:
        os.close(fd)


def hold(folder, started: str):
    """The lock of `folder` (its file created if need be), held until `release` or the process's exit; one line if
    another live process holds it. Returns its open file."""
    if key(folder) in _HELD:
        return _HELD[key(folder)]
    path = Path(folder) / NAME
    while True:
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise refused(folder) from None
        try:  # the file may have been released and removed between our open and our lock: then take the new one
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        handle.close()
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}))
    handle.flush()
    _HELD[key(folder)] = handle
    return handle


def release(folder) -> None:
    """The lock given back at a run's end and its file removed (a process that dies gives the lock back and leaves
    the file, which the next run takes over)."""
    handle = _HELD.pop(key(folder), None)
    if handle is not None:
        Path(handle.name).unlink(missing_ok=True)
        handle.close()


def key(folder) -> str:
    return os.path.realpath(folder)
