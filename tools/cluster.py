"""A protocol's runs as jobs, through submitit: on Slurm (`--executor slurm`, a job array, where `srun` exists) or as
local processes (`--executor local`, one job per GPU of --gpus, times --runs_per_gpu), on one engine.

    python tools/report.py run --protocol paper --executor slurm --partition gpu --gpus_per_job 1 --timeout_min 240
    python tools/report.py run --protocol paper --executor local --gpus 0,1,2,3 --runs_per_gpu 2 --wait
    python tools/report.py status --protocol paper

Each job runs its runs one after another, each as its command line (`python <method>.py ... --auto_resume`), and
keeps each finished run's results.json in results/<protocol>/. When Slurm signals the job (a pre-emption, or its time
limit near: submitit's SIGUSR2, `--signal_delay_s` before it), the job passes the signal on to its run as SIGTERM,
which saves last/ at the end of its step; the job waits for it, then submitit requeues the job, and the requeued job
resumes the run where it stopped (--auto_resume), to the weights an uninterrupted run ends with. A run that fails for
another reason fails its job, which is not requeued: `status` shows the reason and its log's last lines. The run
scripts know nothing of the cluster.

`--nodes N --gpus_per_job G`: each run across N x G processes, one task each, torch.distributed's environment from
submitit's (TorchDistributedEnvironment), as torchrun would set it. What each job is and did lives in
results/<protocol>/jobs/: submitit's folders and logs, and <row>.seed<S>.json with the job's id, state and requeues.
"""
from __future__ import annotations

import contextlib
import getpass
import io
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import plumbing  # noqa: E402
from plumbing import files, lock, provenance  # noqa: E402
import protocols  # noqa: E402
import slurm  # noqa: E402


class Job:
    """What one job runs: `runs` ({"row", "seed", "out", "argv", "kept", "status"} each) one after another, those
    kept already skipped (a requeued job continues where it stopped). submitit pickles it; `checkpoint` is its
    requeue. What the job did goes to each run's job file (`progress_of`), written by the job alone."""

    def __init__(self, runs: list[dict]):
        self.runs, self.child, self.terminated, self.started = runs, None, False, None

    def __call__(self) -> list[str]:
        import submitit
        if submitit.JobEnvironment().num_tasks > 1:  # --nodes, --tasks_per_node: what torchrun would set
            submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        env, first = dict(os.environ), os.environ.get("RANK", "0") == "0"
        # Slurm's pre-emption, `scontrol requeue` and `scancel` send SIGTERM to every process of the job, the run's
        # too: noted, so that the run is not sent a second one (which stops it at once, without its save);
        # submitit's SIGUSR2 is the job's alone
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "terminated", True))
        for run in self.runs:
            if Path(run["kept"]).is_file():
                continue
            if self.terminated:
                raise SystemExit(143)
            was, log = progress_of(run), Path(submitit.JobEnvironment().paths.stdout)
            self._note(run, first, state="running", starts=was.get("starts", 0) + 1, pid=os.getpid(),
                       log_offset=log.stat().st_size if log.is_file() else 0)  # this start's lines follow
            self.started = time.perf_counter(), cpu_of_children()
            self.child = subprocess.Popen([sys.executable, *run["argv"]], cwd=ROOT, env=env,
                                          preexec_fn=lambda: signal.signal(signal.SIGUSR2, signal.SIG_IGN))
            if self.terminated:  # the signal came while the run was starting: it is passed on
                self.child.send_signal(signal.SIGTERM)
            code = self.child.wait()
            self.child = None
            if self.terminated and code != 0:  # Slurm stopped the job: requeued, or cancelled (status asks Slurm)
                self._note(run, first, state="stopped", reason="SIGTERM from Slurm", code=code, **self._spent(run))
                raise SystemExit(143)
            if code != 0:
                self._note(run, first, state="failed", reason=f"the run exited with status {code}", **self._spent(run))
                if not first and code in (130, 143):  # stopped with the other tasks' run: the first reports it
                    raise SystemExit(code)
                raise RuntimeError(f"{protocols.command_line(run)} exited with status {code}")
            if first:
                spent = self._spent(run)
                results = json.loads((ROOT / run["out"] / "results.json").read_text())
                files.write_json(Path(run["kept"]), {**results, "report": spent})
                self._note(run, first, state="done", **spent)
            if self.terminated:  # the run had ended: kept, and the job goes as Slurm asks
                raise SystemExit(143)
        return [run["kept"] for run in self.runs]

    def checkpoint(self, *args, **kwargs):
        """Slurm's signal (or the local executor's at its time limit): the run gets SIGTERM, saves last/ at the end
        of its step and exits; then the job comes back as it is, to resume it."""
        import submitit
        if self.child is not None:  # (a signal handler: not Popen.wait, whose lock __call__'s wait holds)
            if not self.terminated:  # the time limit's warning: the job's alone
                self.child.send_signal(signal.SIGTERM)
            with contextlib.suppress(ChildProcessError):  # reaped already
                _, status = os.waitpid(self.child.pid, 0)
                run = next(run for run in self.runs if not Path(run["kept"]).is_file())
                self._note(run, True, state="stopped", code=os.waitstatus_to_exitcode(status),
                           reason="Slurm's SIGUSR2 (the time limit near, or a pre-emption)", **self._spent(run))
        return submitit.helpers.DelayedSubmission(Job(self.runs))

    def _spent(self, run: dict) -> dict:
        """The run's wall and CPU time in this job, added to those of its earlier starts (the first task's)."""
        was, (wall, cpu) = progress_of(run), self.started
        return {"wall_s": round(was.get("wall_s", 0) + time.perf_counter() - wall, 1),
                "cpu_s": round(was.get("cpu_s", 0) + cpu_of_children() - cpu, 1)}

    @staticmethod
    def _note(run: dict, first: bool, **what) -> None:
        """The run's job file (the first task's alone)."""
        if first:
            files.write_json(progress_path(run), {**progress_of(run), **what, "time": time.time()})


def progress_path(run: dict) -> Path:
    """What the job did with the run (its state, starts, times): written by the job alone, beside the submission's
    note (`status`), which the submitting command alone writes."""
    return Path(run["status"][:-len(".json")] + ".job.json")


def progress_of(run: dict) -> dict:
    return status_json(progress_path(run))


def status_of(run: dict) -> dict:
    return status_json(Path(run["status"]))


def cpu_of_children() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def make_executor(folder: Path, executor: str, gpus_per_job: int, nodes: int, timeout_min: int,
                  partition: str | None, account: str | None, signal_delay_s: int, extra: dict,
                  tasks_per_node: int | None = None, max_timeouts: int = 3):
    """submitit's executor for the jobs; what it refuses (an unknown Slurm parameter), or what the cluster cannot
    give (slurm.check_request), is one line."""
    plumbing.check_installed(True, "submitit", "report.py run --executor")  # else one line naming the install
    import submitit
    if executor == "slurm" and shutil.which("srun") is None:
        raise plumbing.UsageError("--executor slurm: this machine has no srun (Slurm's commands); submit from a "
                                  "login node of the cluster, or use --executor local")
    if executor == "local" and nodes > 1:
        raise plumbing.UsageError(f"--nodes {nodes}: the local executor runs on this machine alone; use "
                                  "--executor slurm")
    if executor == "slurm":
        slurm.check_request(partition, account, gpus_per_job, nodes, timeout_min)
    made = submitit.AutoExecutor(folder=str(folder / "%j"), cluster=executor,
                                 **({"slurm_max_num_timeout": max_timeouts} if executor == "slurm" else {}))
    named = {f"slurm_{k}": v for k, v in {"partition": partition, "account": account}.items() if v}
    try:
        made.update_parameters(timeout_min=timeout_min, nodes=nodes, tasks_per_node=tasks_per_node or gpus_per_job or 1,
                               gpus_per_node=gpus_per_job, **named, **extra)
        if executor == "slurm":  # --requeue: a site's JobRequeue=0 would cancel a pre-empted job instead
            made.update_parameters(slurm_signal_delay_s=signal_delay_s,
                                   slurm_additional_parameters={"requeue": True,
                                                                **extra.get("slurm_additional_parameters", {})})
    except (ValueError, TypeError, NameError) as err:  # NameError: an unknown parameter, with the known ones
        raise plumbing.UsageError(f"submitit refuses a parameter: {str(err).splitlines()[0][:300]}") from None
    return made


def submit(todo: list[dict], folder: Path, executor: str, gpus: list[int] | None, runs_per_gpu: int,
           **options) -> list:
    """The runs of `todo` (attach's) submitted: one job per run on Slurm (a job array, all or nothing); locally one
    job per GPU of `gpus` times `runs_per_gpu` (else one), each with its share of the runs. The submitit jobs."""
    check_owner(folder)
    made = make_executor(folder, executor, **options)
    # the job's process unpickles Job from this module: the suite and its tools on its path (Slurm and the local
    # executor pass the environment on)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tools"),
                                                             os.environ.get("PYTHONPATH")]))
    folder.mkdir(parents=True, exist_ok=True)
    before, earlier = set(folder.iterdir()), [progress_of(run) for run in todo]
    for run, was in zip(todo, earlier):  # a new job for each: what an ended job did is no longer the run's state
        files.write_json(progress_path(run), {k: was[k] for k in ("wall_s", "cpu_s") if k in was})
    if executor == "slurm":
        groups = [[run] for run in todo]
        try:  # sbatch's own lines are quoted below, once
            with contextlib.redirect_stderr(io.StringIO()), made.batch():  # (it submits on leaving)
                jobs = [made.submit(Job(group)) for group in groups]
        except Exception as err:  # sbatch refused the array: none of it was queued
            for path in set(folder.iterdir()) - before:  # submitit's pickles and script of the refused array
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            for run, was in zip(todo, earlier):
                if was:
                    files.write_json(progress_path(run), was)
            said = [line.strip() for line in str(err).splitlines() if "error:" in line]
            raise plumbing.UsageError(f"sbatch refused the jobs: {(said or [str(err).strip()])[-1][:300]}; nothing "
                                      "was queued") from None
    else:
        if gpus and runs_per_gpu > 1:
            runs_per_gpu = runs_that_fit(todo, gpus, runs_per_gpu)
            note_without_mps(runs_per_gpu)
        slots = [(gpu, k) for gpu in (gpus or [None]) for k in range(runs_per_gpu if gpus else 1)]
        groups = [todo[i::len(slots)] for i in range(len(slots))]
        jobs = []
        for (gpu, _), group in zip(slots, groups):
            if group:
                if gpu is not None:
                    made.update_parameters(visible_gpus=[gpu], gpus_per_node=1)
                jobs.append(made.submit(Job(group)))
    for job, group in zip(jobs, groups):
        for run in group:  # the submission's note: this command's alone (the job writes progress_path)
            files.write_json(Path(run["status"]), {"job": str(job.job_id), "executor": executor,
                                                   "user": getpass.getuser(), "log": str(Path(job.paths.stdout)),
                                                   "errors": str(Path(job.paths.stderr)), "time": time.time(),
                                                   "tasks": job.num_tasks, "argv": run["argv"]})
    files.write_json(folder / "owner.json", {"user": getpass.getuser()})
    return jobs


def runs_that_fit(todo: list[dict], gpus: list[int], wanted: int) -> int:
    """How many of these runs each GPU takes at once, at most `wanted`: the least free memory of `gpus` over the
    largest peak that plumbing/memory.py estimates for their commands, a CUDA context each, the allocator's 10% kept;
    one line where it is fewer, or where a model's config is not here to estimate (then `wanted`)."""
    import importlib
    import torch
    from plumbing import hub, memory
    peaks = {}
    for run in todo:
        args = importlib.import_module(Path(run["argv"][0]).stem).parse_args(run["argv"][1:])
        command = repr(sorted((k, v) for k, v in vars(args).items() if k not in ("seed", "output_dir", "command")))
        if command in peaks:  # a row's other seeds: the same tensors (a trace of about a second each)
            continue
        config = hub.local_config(args.model_name_or_path)
        if config is None:
            print(f"note: --runs_per_gpu {wanted}: no local config of {args.model_name_or_path} to estimate its "
                  "memory; taken as given", flush=True)
            return wanted
        peaks[command] = memory.peak(memory.estimate(args, config))
    free, largest = min(memory.device_free(torch.device("cuda", gpu)) for gpu in gpus), max(peaks.values())
    fits = max(1, min(wanted, int(free * (1 - memory.FRAGMENTATION) // (largest + memory.CONTEXT))))
    if fits < wanted:
        print(f"note: --runs_per_gpu {wanted}: {memory.gib(free)} free holds {fits} of these runs at once (up to "
              f"{memory.gib(largest)} each, the memory estimate's, and a CUDA context): {fits} a GPU", flush=True)
    return fits


def note_without_mps(runs_per_gpu: int) -> None:
    """One line where K > 1 runs would share a GPU without an NVIDIA MPS daemon (its control pipe): the processes then
    take turns; 4 SimCSE runs at once gave 1.09 x one's throughput on an H200 (docs/cluster.md)."""
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")) / "control"
    if runs_per_gpu > 1 and not pipe.exists():
        print(f"note: --runs_per_gpu {runs_per_gpu}: no NVIDIA MPS daemon is running ({pipe} is missing), so the runs "
              "on a GPU take turns and gain little over one at a time (docs/cluster.md)", flush=True)


def attach(run: dict, results: Path, folder: Path) -> dict:
    """The run with where its results.json is kept (`results`, the protocol's) and its job status file (`folder`)."""
    return {**run, "kept": str(results / protocols.kept_name(run)), "status": str(folder / protocols.kept_name(run))}


def check_owner(folder: Path) -> None:
    """A protocol folder whose jobs another user submitted is theirs: one line, nothing submitted."""
    owner = status_json(folder / "owner.json").get("user")
    if owner and owner != getpass.getuser():
        raise plumbing.UsageError(f"{folder} holds the jobs of user {owner}; give this protocol another name (a "
                                  "protocol JSON file), or ask them")


@contextlib.contextmanager
def holding(folder: Path):
    """The protocol's jobs folder locked (plumbing/lock.py's lock, as a run's folder has) while this command asks
    which runs are queued and submits the others: of two `run` commands at once one submits, the other is one line
    naming the holder."""
    check_owner(folder)  # (another user's folder: their lock file is not ours to write)
    made = [path for path in (folder, folder.parent) if not path.exists()]  # removed again if left empty
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock.hold(folder, provenance.now())
    except plumbing.UsageError:
        raise plumbing.UsageError(f"{folder} is in use by {lock.holder(folder)}, another `report.py run` submitting "
                                  "this protocol's runs: nothing was submitted; run again once it has") from None
    except OSError as err:
        raise plumbing.UsageError(f"{folder}: {err.strerror}; nothing was submitted") from None
    try:
        yield
    finally:
        lock.release(folder)
        for path in made:  # a refused command leaves no empty jobs folder (which `status` would list)
            with contextlib.suppress(OSError):
                path.rmdir()


def status_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


PENDING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "RESV_DEL_HOLD"}
PROGRESS = re.compile(r"^(step \d+/\d+|training: \d+/\d+)")


def situations(runs: list[dict]) -> list[tuple[str, str]]:
    """Each run's (state, what to say of it), Slurm asked once for all: "done"; "pending" or "running" (queued: a
    second `run` submits nothing for it); "failed" or "lost" (resubmitted by a second `run`); "not submitted"."""
    notes = [status_of(run) for run in runs]
    ids = [n["job"] for n in notes if n.get("executor") == "slurm" and "job" in n]
    # the jobs' states asked before the kept files are looked at, Slurm's and the local ones': a job ending now is done
    known = slurm.states(ids) if ids else {}
    alive = [bool(note) and note.get("executor") != "slurm" and local_alive(note) for note in notes]
    found = []
    for run, note, local in zip(runs, notes, alive):
        job, did = note.get("job"), progress_of(run)
        requeued = did.get("starts", 0) - 1  # this job's starts of the run: each after the first, a requeue
        again = f", requeued {requeued} time(s)" if requeued > 0 else ""
        if Path(run["kept"]).is_file():
            found.append(("done", f"done{again}"))
        elif not note:
            found.append(("not submitted", "not submitted"))
        elif note.get("executor") == "slurm":
            state, reason = known.get(job, (None, ""))
            if state is None and did.get("state") == "failed":  # forgotten by Slurm, but the job said why
                found.append(("failed", failed_line(note, did, f"job {job}", again)))
            elif state in PENDING:
                held = f"; `scontrol release {job}` lets it start" if "held" in reason.lower() else ""
                found.append(("pending", f"pending (job {job}{again}{', Slurm: ' + reason if reason else ''}{held})"))
            elif state in ("SUSPENDED", "STOPPED"):
                found.append(("running", f"{state.lower()} (job {job}{again})"))
            elif slurm.alive(state):
                found.append(("running", f"running (job {job}{again}): {latest_progress(run, note, did)}"))
            elif state is None:
                found.append(("lost", f"lost (Slurm no longer knows job {job}{again}; its log: {note.get('log')})"))
            elif state in ("NODE_FAIL", "BOOT_FAIL"):
                found.append(("lost", f"lost (job {job}: {state}{again}; its log: {note.get('log')})"))
            else:
                found.append(("failed", failed_line(note, did, f"job {job}: {state}", again)))
        elif local:
            found.append(("running", f"running (job {job}{again}): {latest_progress(run, note, did)}"))
        else:
            found.append(("failed", failed_line(note, did, f"job {job} ended", again)))
    return found


def failed_line(note: dict, did: dict, ended: str, again: str) -> str:
    """Why the run failed (the run's own reason where it gave one) and its log's error lines."""
    errors = last_lines(note.get("errors"), 400)
    own = errors[:next((i for i, line in enumerate(errors) if line.startswith("submitit ERROR")),
                       len(errors))]  # the run's own, before submitit's traceback of the job
    said = [line for line in own if line.startswith("error:") or ": error:" in line][-2:] or own[-2:]
    gave_up = [line.split("Job not requeued because: ", 1)[1] for line in errors if "Job not requeued because" in line]
    reason = did.get("reason") if did.get("state") == "failed" else \
        (f"{ended}, not requeued: {gave_up[-1].rstrip('.')}" if gave_up else f"{ended} without the run's results")
    tail = " | ".join(said or last_lines(note.get("log"), 3))
    return f"failed ({reason}){again}; its log: {tail} ({note.get('errors')})"


def latest_progress(run: dict, note: dict, did: dict) -> str:
    """The run's latest progress line (its step and ETA) since its job last started it."""
    if did.get("state") != "running":
        return "starting"
    try:
        with open(note["log"], "rb") as log:
            log.seek(did.get("log_offset", 0))
            lines = log.read().decode(errors="replace").splitlines()
    except (OSError, KeyError, TypeError):
        return "started"
    return next((line.strip() for line in reversed(lines) if PROGRESS.match(line.strip())), "started")


def local_alive(note: dict) -> bool:
    """A local job: its controller process alive (not a zombie its submitting process has not reaped) and not every
    task's outcome of submitit's written yet. A job ends with its last task: one task's outcome is not the job's (the
    first task may still be keeping the run's results)."""
    if note.get("log"):
        folder = Path(note["log"]).parent
        if all((folder / f"{note.get('job')}_{k}_result.pkl").is_file() for k in range(note.get("tasks", 1))):
            return False
    try:
        stat = Path(f"/proc/{int(note['job'])}/stat")
        if stat.exists():
            return stat.read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        os.kill(int(note["job"]), 0)
        return True
    except (OSError, ValueError, KeyError):
        return False


def queued(runs: list[dict]) -> list[bool]:
    """Whether each run's job is pending or running: a second `run` submits nothing for it."""
    return [state in ("pending", "running") for state, _ in situations(runs)]


def wait(runs: list[dict]) -> None:
    """Until none of these runs' jobs is pending or running (a second `run --wait` waits for the first's): asked
    every 10 s (2 s for local jobs), a question Slurm does not answer asked again."""
    every = 10 if any(status_of(run).get("executor") == "slurm" for run in runs) else 2
    while True:
        try:
            if not any(queued(runs)):
                return
        except plumbing.UsageError as err:
            print(f"note: {err}; asking again", flush=True)
        time.sleep(every)


def status_lines(protocol: dict, results: Path) -> list[str]:
    """Each run's state: done, running (its step and ETA, from its log since its latest start), pending (Slurm's
    reason), requeued N times, failed (the reason and its log's error lines), lost, or not submitted."""
    runs = [attach(run, results, results / "jobs") for run in protocols.runs(protocol)]
    return [f"{run['row']} seed {run['seed']}: {said}" for run, (_, said) in zip(runs, situations(runs))]


def underway(protocol: dict, results: Path) -> dict[tuple[str, int], str]:
    """{(row, seed): "running" or "pending"} for the protocol's runs (kept in `results`, as status_lines') whose jobs
    are queued (the page names them)."""
    runs = [attach(run, results, results / "jobs") for run in protocols.runs(protocol)]
    runs = [run for run in runs if Path(run["status"]).is_file() and not Path(run["kept"]).is_file()]
    try:
        return {(run["row"], run["seed"]): state for run, (state, _) in zip(runs, situations(runs))
                if state in ("pending", "running")}
    except plumbing.UsageError:  # Slurm does not answer (or is not here): the page lists them as missing
        return {}


def last_lines(log: str | None, n: int) -> list[str]:
    try:
        return [line.strip() for line in Path(log).read_text(errors="replace").splitlines() if line.strip()][-n:]
    except (OSError, TypeError):
        return []


def add_arguments(parser) -> None:
    """report.py run's flags for jobs."""
    g = parser.add_argument_group("jobs (submitit: tools/cluster.py)")
    g.add_argument("--executor", choices=["local", "slurm"], default=None,
                   help="submit the runs as jobs: slurm (a job array) or local processes")
    g.add_argument("--wait", action="store_true", help="wait for the jobs, then write the page")
    g.add_argument("--gpus_per_job", type=int, default=0, help="GPUs of each job (with --nodes: a node's)")
    g.add_argument("--nodes", type=int, default=1, help="each run across this many nodes (torch.distributed)")
    g.add_argument("--tasks_per_node", type=int, default=None, help="processes of a run on each node (default: "
                   "--gpus_per_job, else 1); on CPUs, e.g. 2 runs one run as two processes (gloo)")
    g.add_argument("--runs_per_gpu", type=int, default=1, help="local: runs at once on each GPU of --gpus")
    g.add_argument("--timeout_min", type=int, default=None, help="a job's time limit (Slurm: 240; local: none)")
    g.add_argument("--partition", default=None, help="Slurm's partition")
    g.add_argument("--account", default=None, help="Slurm's account")
    g.add_argument("--max_timeouts", type=int, default=3,
                   help="Slurm: a job that reaches its time limit is requeued this many times, then ends failed "
                        "(submitit's count; a pre-emption is always requeued)")
    g.add_argument("--signal_delay_s", type=int, default=120,
                   help="Slurm: the signal this long before the time limit (a run saves last/ at its step's end); "
                        "Slurm sends it up to 30 s early, so at most the limit less 40 s")
    g.add_argument("--slurm", nargs="*", default=[], metavar="KEY=VALUE",
                   help="more of submitit's Slurm parameters, e.g. qos=high constraint=a100 (slurm_ prefixed)")


def options(args, gpus) -> dict | None:
    """--executor's (and --gpus's, the local executor's) options, or None: one run at a time here."""
    if not (args.executor or gpus):
        return None
    extra = {}
    for item in args.slurm:
        key, _, value = item.partition("=")
        if not value:
            raise plumbing.UsageError(f"--slurm {item}: give KEY=VALUE, e.g. qos=high")
        extra[f"slurm_{key}"] = int(value) if value.isdigit() else value
    executor = args.executor or "local"
    if extra and executor != "slurm":
        raise plumbing.UsageError("--slurm's parameters go with --executor slurm")
    timeout = args.timeout_min or (240 if executor == "slurm" else 7 * 24 * 60)
    if executor == "slurm" and args.signal_delay_s > timeout * 60 - 40:  # Slurm checks its limits every 30 s
        raise plumbing.UsageError(f"--signal_delay_s {args.signal_delay_s}: the warning (up to 30 s early) could come "
                                  f"before the job has started (--timeout_min {timeout}); give at most "
                                  f"{timeout * 60 - 40}")
    if (args.tasks_per_node or 1) < 1 or args.nodes < 1 or args.max_timeouts < 0:
        raise plumbing.UsageError("--tasks_per_node and --nodes are at least 1, --max_timeouts at least 0")
    return {"executor": executor, "wait": args.wait, "runs_per_gpu": args.runs_per_gpu,
            "gpus_per_job": args.gpus_per_job or (1 if gpus else 0), "nodes": args.nodes, "timeout_min": timeout,
            "partition": args.partition, "account": args.account, "signal_delay_s": args.signal_delay_s,
            "extra": extra, "tasks_per_node": args.tasks_per_node, "max_timeouts": args.max_timeouts}
