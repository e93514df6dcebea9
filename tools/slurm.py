"""What Slurm itself says, through its own commands: the jobs' states (squeue, then sacct for those squeue has
forgotten) and, before anything is queued, whether the partition, account, GPUs, nodes and time limit asked for can be
had (sinfo, sacctmgr). A question a command cannot answer (accounting off, a command missing) is left unanswered,
never guessed; a failing squeue stops the caller, since a job it cannot see might still be queued.

Job ids are as squeue prints them (an array's task: 36_2), which is how submitit names them too."""
from __future__ import annotations

import getpass
import re
import shutil
import subprocess

import plumbing

# a job's states once it has ended (sacct's; squeue lists only jobs still queued, unless asked for more); any other
# state is alive: pending, held (SPECIAL_EXIT, RESV_DEL_HOLD: releasable), running, suspended, completing, ...
ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
         "OUT_OF_MEMORY"}


def _run(cmd: list[str]) -> subprocess.CompletedProcess | None:
    """The command's outcome, or None where it is not installed or does not answer in time."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return None


def states(job_ids: list[str]) -> dict[str, tuple[str, str]]:
    """{job id: (state, squeue's reason or "")} for the jobs Slurm knows: squeue's (those still queued), then sacct's
    (where accounting is on) for the others. A job neither knows is absent: Slurm has lost it."""
    found: dict[str, tuple[str, str]] = {}
    if not job_ids:
        return found
    listed = _run(["squeue", "-a", "-h", "-r", "-u", getpass.getuser(), "-o", "%i|%T|%r"])  # -a: hidden partitions
    if listed is None or listed.returncode != 0:
        why = (listed.stderr.strip().splitlines() or ["no answer"])[-1] if listed else \
            "not installed here" if shutil.which("squeue") is None else "no answer in 60 s"
        raise plumbing.UsageError(f"squeue failed ({why}): the jobs' states are unknown; try again when Slurm "
                                  "answers (nothing was submitted)")
    for line in listed.stdout.splitlines():
        job, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        found[job] = (state, "" if reason == "None" else reason)
    others = [job for job in job_ids if job not in found]
    if others:
        acct = _run(["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(others)])
        if acct is not None and acct.returncode == 0:
            for line in acct.stdout.splitlines():
                job, _, state = line.strip().partition("|")
                if job in others and state:
                    found[job] = (state.split()[0], "")  # "CANCELLED by 0"
    return {job: found[job] for job in job_ids if job in found}


def alive(state: str | None) -> bool:
    return state is not None and state not in ENDED


def check_request(partition: str | None, account: str | None, gpus_per_job: int, nodes: int,
                  timeout_min: int) -> None:
    """One line, before anything is queued, for what this cluster cannot give: a partition it does not have, an
    account the user has no association with, GPUs on a partition without them, more nodes than the partition has,
    a time limit beyond the partition's. What sinfo or sacctmgr do not answer is left to sbatch."""
    info = _run(["sinfo", "-a", "-h", "-o", "%P|%D|%l|%G"])  # a line a partition's GRES group: added up
    if info is not None and info.returncode == 0 and not (partition and "," in partition):  # a list: sbatch's
        rows = {}
        for line in info.stdout.splitlines():
            name, count, limit, gres = line.strip().split("|")
            default, had, _, kinds = rows.get(name.rstrip("*"), (False, 0, limit, ""))
            rows[name.rstrip("*")] = (default or name.endswith("*"), had + int(count), limit, f"{kinds},{gres}")
        name = partition or next((p for p, row in rows.items() if row[0]), None)
        if partition and partition not in rows:
            raise plumbing.UsageError(f"--partition {partition}: this cluster has no such partition (sinfo: "
                                      f"{', '.join(rows)})")
        if name in rows:
            _, count, limit, gres = rows[name]
            if gpus_per_job and "gpu" not in gres:
                raise plumbing.UsageError(f"--gpus_per_job {gpus_per_job}: partition {name} has no GPUs (sinfo's "
                                          f"GRES: {gres.strip(',')}); --gpus_per_job 0 runs on CPUs")
            if nodes > count:
                raise plumbing.UsageError(f"--nodes {nodes}: partition {name} has {count} node(s)")
            most = minutes(limit)
            if most is not None and timeout_min > most:
                raise plumbing.UsageError(f"--timeout_min {timeout_min}: partition {name}'s time limit is {limit} "
                                          f"({most} min)")
    if account:
        assoc = _run(["sacctmgr", "-n", "-P", "show", "assoc", f"user={getpass.getuser()}", "format=account"])
        if assoc is not None and assoc.returncode == 0 and assoc.stdout.strip():
            accounts = sorted({line.strip() for line in assoc.stdout.splitlines() if line.strip()})
            if account not in accounts:
                raise plumbing.UsageError(f"--account {account}: Slurm has no association of user "
                                          f"{getpass.getuser()} with it (sacctmgr: {', '.join(accounts)})")


def minutes(limit: str) -> int | None:
    """A Slurm time limit in minutes, seconds rounded up, in each form Slurm documents: minutes, minutes:seconds,
    hours:minutes:seconds, days-hours, days-hours:minutes, days-hours:minutes:seconds; None for UNLIMITED, INFINITE
    (sinfo's "infinite") or anything else: no limit known."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", limit.strip())
    if not match:
        return None
    days, fields = match.group(1), [int(f) for f in match.groups()[1:] if f is not None]
    if days is not None:  # after days- the first field is hours, never minutes
        hours, mins, secs = fields + [0] * (3 - len(fields))
    else:  # minutes, minutes:seconds, hours:minutes:seconds
        hours, mins, secs = {1: (0, *fields, 0), 2: (0, *fields), 3: tuple(fields)}[len(fields)]
    return int(days or 0) * 1440 + hours * 60 + mins + (secs > 0)
