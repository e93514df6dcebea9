"""The cluster path against a real Slurm: `report.py run --executor slurm` on the single-node cluster that
tools/local_slurm.sh starts (slurmctld, two slurmd, slurmdbd on MariaDB; .ci/run starts it where it runs as root),
with the tiny model on CPU (--gpus_per_job 0). Every way a cluster stops a job, each applied to a running (or pending)
job as Slurm's own commands apply it: the time limit's warning (`scancel --signal=USR2`) and a real time limit,
`scontrol requeue`, a pre-emption by a job of the higher partition, `scancel` of a pending and of a running job, a
task of an array killed with SIGKILL, its node set DOWN and back, and a run whose time limit keeps coming. Each run
ends with the uninterrupted run's scores, trajectory and weights bit for bit, or is reported as failed once, with
its reason; `status` tells the truth at each moment; a second `run` submits nothing for a queued or done run and
resubmits a failed or lost one. One run as two tasks (gloo, through Slurm's srun) trains as one process and stops
within the warning; one run across both nodes trains as torchrun's two processes and survives its node's fall. Bad
input is one line before anything is queued. Slurm holds a requeued job for 2 minutes before it starts it again
(BeginTime): the tests release such jobs after 15 s (`scontrol update jobid=J starttime=now`), as an impatient admin
would."""
import contextlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch

from conftest import ROOT, smoke_args, write_tiny_model


def cluster_up() -> str | None:
    """Why the tests cannot run here, or None: tools/local_slurm.sh's cluster answers (partitions debug and urgent).
    In CI as root, where .ci/run starts it, its absence fails the tests instead (a skip there would hide it)."""
    why = why_not_up()
    if why and os.environ.get("CI") == "true" and os.geteuid() == 0 and shutil.which("apt-get"):
        pytest.fail(f"{why}; .ci/run's start of it: {os.environ.get('TMPDIR', '/tmp')}/suite-ci-slurm.log",
                    pytrace=False)
    return why


def why_not_up() -> str | None:
    if shutil.which("sinfo") is None:
        return "no Slurm here: sudo bash tools/local_slurm.sh start (Debian's slurm-wlm)"
    try:
        info = subprocess.run(["sinfo", "-h", "-o", "%P %t"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo does not answer: sudo bash tools/local_slurm.sh start"
    partitions = {line.split()[0].rstrip("*") for line in info.stdout.splitlines() if line.strip()}
    if info.returncode != 0 or not {"debug", "urgent"} <= partitions:
        return "not tools/local_slurm.sh's cluster (partitions debug and urgent): sudo bash tools/local_slurm.sh start"
    return None


@pytest.fixture(autouse=True)
def slurm_here():
    why = cluster_up()
    if why:
        pytest.skip(why)


# The jobs' torch threads: the straight run's (made in this process), which its numbers depend on (one under -n auto)
THREADS = os.environ.get("OMP_NUM_THREADS") or str(torch.get_num_threads())
# report.py with its results and runs folders in the test's: a user's command, in a process of its own
REPORT = """import sys; from pathlib import Path
sys.path[:0] = [{root!r}, {tools!r}]
import protocols, report
report.RESULTS, protocols.RUNS_DIR = Path(sys.argv[1]), Path(sys.argv[2])
report.main(sys.argv[3:])"""


class Place:
    """One scenario: its protocol (rows of simcse.py on `args`) and its results/ and runs/ folders, under `folder`."""

    def __init__(self, folder: Path, name: str, args: list[str], rows: list[str], seeds=(1,)):
        self.folder, self.name = folder, name
        folder.mkdir(parents=True, exist_ok=True)
        self.protocol = folder / f"{name}.json"
        self.protocol.write_text(json.dumps({
            "name": name, "description": name, "args": args, "seeds": list(seeds), "transfer": None,
            "rows": [{"name": row, "script": "simcse.py", "flags": [], "paper": None} for row in rows]}))

    def report(self, *argv, check=True) -> subprocess.CompletedProcess:
        code = REPORT.format(root=str(ROOT), tools=str(ROOT / "tools"))
        done = subprocess.run([sys.executable, "-c", code, str(self.folder / "results"), str(self.folder / "runs"),
                               argv[0], "--protocol", str(self.protocol), *argv[1:]], capture_output=True,
                              text=True, cwd=ROOT, timeout=400,  # the jobs get sbatch's environment: the threads
                              env=dict(os.environ, OMP_NUM_THREADS=THREADS))  # of the straight run, for its numbers
        if check and done.returncode != 0:
            raise AssertionError(f"report.py {' '.join(argv)} exited {done.returncode}: {done.stderr[-2000:]}")
        return done

    def submit(self, *flags, slurm=("exclude=c2",), wait=False, check=True) -> subprocess.CompletedProcess:
        """`report.py run` on Slurm; node c2 left to the scenario that takes it down (slurm=("nodelist=c2",))."""
        flags = ["--timeout_min", "10", "--signal_delay_s", "60", *flags] if "--timeout_min" not in flags else flags
        done = self.report("run", "--executor", "slurm", "--gpus_per_job", "0", *flags, "--slurm", *slurm,
                           *(["--wait"] if wait else []), check=check)
        assert "submitted" in done.stdout or not check, done.stdout
        return done

    def status(self) -> list[str]:
        return self.report("status").stdout.splitlines()

    def line(self, row: str = "simcse") -> str:
        return next(line for line in self.status() if line.startswith(f"{row} seed 1:"))

    def job_ids(self) -> list[str]:
        return [json.loads(p.read_text())["job"] for p in sorted((self.folder / "results" / self.name / "jobs")
                                                                  .glob("*.seed*.json")) if ".job." not in p.name]

    def progress(self, row: str = "simcse") -> dict:
        path = self.folder / "results" / self.name / "jobs" / f"{row}.seed1.job.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def kept(self, row: str) -> dict:
        return json.loads((self.folder / "results" / self.name / f"{row}.seed1.json").read_text())

    def until(self, what, timeout=240, why="", every=0.5):
        """what()'s value once it is true, asked every `every` s (says() asks status only when it may have
        changed); else the scenario fails, naming `why` and the status."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            value = what()
            if value:
                return value
            time.sleep(every)
        raise AssertionError(f"{self.name}: not {why} within {timeout} s; status: {self.status()}")

    @contextlib.contextmanager
    def held(self, row: str = "simcse", ranks=(None,)):
        """The run's processes stopped (SIGSTOP) while the scenario sends its signal, continued once Slurm's SIGTERM
        is pending (or Slurm continued them, or they are gone: a SIGKILL): a tiny run (90 steps, two seconds or so of
        training) cannot end between the test seeing it train and the signal landing, which on busy cores it did (CI:
        the requeue scenario's run ended first, and the job was done without a stop)."""
        folder = self.folder / "runs" / self.name / f"{row}.seed1"
        pids = [self.until(lambda: run_process(folder, rank), why=f"{row}'s process (rank {rank})", every=0.1)
                for rank in ranks]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            for pid in pids:  # stopped before the signal is sent (SIGSTOP lands asynchronously)
                self.until(lambda: held_without_sigterm(pid), why=f"{row}'s process stopped", every=0.01)
            yield
            for pid in pids:
                self.until(lambda: not held_without_sigterm(pid), why="Slurm's SIGTERM to the held run", every=0.05)
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    def says(self, *words: str, row: str = "simcse", timeout=240) -> str:
        """Until status's line for the row has one of `words`: the line. Status (a new interpreter, squeue and
        sacct: 0.8 s of CPU) is asked at once, then as soon as the row's job note changes (a start, a stop, done:
        the note read every 0.5 s) and every 10 s besides, for what Slurm alone knows (pending, a cancel, a job
        lost); every 3 s, it was 80 interpreters, 64 s of CPU beside the jobs."""
        asked = {"note": None, "at": 0.0}

        def said():
            note = self.progress(row)
            if note == asked["note"] and time.time() - asked["at"] < 10:
                return None
            asked.update(note=note, at=time.time())
            line = self.line(row)
            return line if any(word in line for word in words) else None
        return self.until(said, timeout, f"{row} {' or '.join(words)}", 0.5)

    def training(self, row: str = "simcse", start: int = 1, saved=True):
        """Until the run trains in its job's `start`-th start: the job's note says so, and (`saved`) last/ was saved
        since. A resumed run's save stands for a second or two before it ends: where a scenario only needs the job
        running (its interpreter starting, or the run), saved=False asks for the note alone; the save is asked
        for every 0.1 s (a file's date), the note alone every 0.5 s."""
        last = self.folder / "runs" / self.name / f"{row}.seed1" / "last"

        def trains():
            note = self.progress(row)
            return note.get("state") == "running" and note.get("starts", 0) >= start and (not saved or (
                last.is_dir() and last.stat().st_mtime > note.get("time", 0)))
        self.until(trains, why=f"{row} training (start {start})", every=0.1 if saved else 0.5)


def slurm(*cmd) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (cmd, done.stderr)
    return done.stdout


@pytest.fixture
def release_requeued():
    """Slurm holds a requeued job for 2 minutes (BeginTime): such jobs released after 15 s while the test runs, once
    the job's last processes are surely gone (KillWait, 10 s: a job started again at once finds its credential
    revoked and fails, which is what Slurm's wait is for)."""
    stop, seen = threading.Event(), {}

    def release():
        while not stop.is_set():
            pending = subprocess.run(["squeue", "-h", "-t", "PD", "-o", "%i %r"], capture_output=True, text=True)
            for line in pending.stdout.splitlines():
                job, _, reason = line.partition(" ")
                if reason.strip() != "BeginTime":
                    seen.pop(job, None)
                elif time.time() - seen.setdefault(job, time.time()) > 15:
                    subprocess.run(["scontrol", "update", f"jobid={job}", "starttime=now"], capture_output=True)
            stop.wait(1)
    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join()


@pytest.fixture(scope="module")
def flags(tmp_path_factory, corpus, senteval_dir):
    """The tiny model and the runs' flags (no run: the test of mistakes, on another worker, needs only these)."""
    folder = tmp_path_factory.mktemp("slurm")
    model = write_tiny_model(folder / "model")
    args = [str(a) for a in smoke_args(model, corpus, senteval_dir, "x")[:-4]] + [
        "--device", "cpu", "--no_align_uniform", "--max_steps", "90", "--eval_steps", "30", "--save_steps", "6"]
    return folder, model, args


@pytest.fixture(scope="module")
def setting(flags):
    """The tiny model, the runs' flags, and the uninterrupted run of them (seed 1): its best/ (results.json beside
    it); "one": two_tasks's one-process run (its flags, its results); "torchrun": two_nodes's reference folder."""
    folder, model, args = flags
    straight = folder / "straight"
    importlib.import_module("simcse").main([*args, "--seed", "1", "--output_dir", str(straight)])
    # two_tasks's one-process run, of a model without dropout (here: a new process's start is most of its CPU)
    no_dropout = write_tiny_model(folder / "model_without_dropout", dropout=0.0)
    one = [str(no_dropout) if a == str(model) else a for a in args] + [
        "--dropout", "0", "--max_steps", "200", "--eval_steps", "200", "--no_test_eval"]
    importlib.import_module("simcse").main([*one, "--seed", "1", "--output_dir", str(folder / "one")])
    # two_nodes's reference: the same run as two processes of torchrun on this machine (the jobs' threads)
    launched = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               "simcse.py", *args, "--seed", "1", "--output_dir", str(folder / "torchrun")],
                              cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, OMP_NUM_THREADS=THREADS, HF_HUB_OFFLINE="1"))
    assert launched.returncode == 0, launched.stderr[-3000:]
    return {"folder": folder, "args": args, "best": straight / "best", "torchrun": folder / "torchrun",
            "one": (one, json.loads((folder / "one" / "results.json").read_text()))}


def same_trajectory(got: list[dict], want: list[dict], resumed_at: list[int]) -> bool:
    """The uninterrupted run's trajectory rows, in order, times left out; besides them only the rows a stop logs
    at its step (a resumption's)."""
    untimed = [[{k: v for k, v in row.items() if "time" not in k} for row in rows] for rows in (got, want)]
    extra = [row for row in untimed[0] if row not in untimed[1]]
    return [row for row in untimed[0] if row in untimed[1]] == untimed[1] and \
        all(row["step"] in resumed_at for row in extra)


def same_as_straight(place: Place, row: str, setting: dict, reference: Path | None = None) -> None:
    """The kept results and best/ weights: the uninterrupted run's (the straight run's, or the run folder
    `reference`'s: the two-process torchrun run's), bit for bit; its timing kept beside them."""
    from safetensors.torch import load_file
    reference = reference or setting["best"].parent
    kept, want = place.kept(row), json.loads((reference / "results.json").read_text())
    for key in ("train_loss", "grad_norm", "best_step", "best_dev_stsb", "test"):
        assert kept[key] == want[key], (place.name, row, key)  # floats compared exactly
    assert same_trajectory(kept["trajectory"], want["trajectory"], kept.get("resumptions", [])), (place.name, row)
    got = load_file(place.folder / "runs" / place.name / f"{row}.seed1" / "best" / "model.safetensors")
    ref = load_file(reference / "best" / "model.safetensors")
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), (place.name, row)
    assert kept["report"]["wall_s"] > 0 and kept["report"]["cpu_s"] > 0, kept.get("report")


# ---- the scenarios: each a protocol of its own, all at once, each in a thread ----
def usr2(place: Place, setting: dict) -> None:
    """(a) the time limit's warning as Slurm sends it (`scancel --signal=USR2`): the run saves last/, submitit
    requeues the job, which resumes the run."""
    place.submit()
    job, = place.job_ids()
    place.training()
    with place.held():
        slurm("scancel", "--signal=USR2", job)
    place.training(start=2, saved=False)
    assert "requeued 1 time(s)" in place.line()
    place.says("done")
    assert place.line() == "simcse seed 1: done, requeued 1 time(s)"
    same_as_straight(place, "simcse", setting)


def requeue(place: Place, setting: dict) -> None:
    """(b) `scontrol requeue`, what PreemptMode=REQUEUE does: SIGTERM to every process of the job; the run saves
    and exits 143, which is no failure: status says requeued and pending, and a second `run` submits nothing."""
    place.submit()
    job, = place.job_ids()
    place.training()
    with place.held():
        slurm("scontrol", "requeue", job)
    place.until(lambda: place.progress().get("state") == "stopped", why="stopped")
    assert place.progress()["code"] == 143  # the run saved last/ and exited as a SIGTERM asks, not killed
    line = place.says("requeued 1")
    assert line.startswith("simcse seed 1: pending (job") or line.startswith("simcse seed 1: running (job"), line
    again = place.submit().stdout
    assert "0 to make" in again and "submitted 0 job(s)" in again, again
    place.says("done")
    assert place.line() == "simcse seed 1: done, requeued 1 time(s)" and place.job_ids() == [job]
    same_as_straight(place, "simcse", setting)


def preemption_then_node_down(place: Place, setting: dict) -> None:
    """(c) a job of partition urgent (PriorityTier 10) needs node c2's two CPUs: Slurm pre-empts the run's job
    there (PreemptMode=REQUEUE), which is requeued. (f) then c2 is set DOWN under the resumed run's job and resumed:
    Slurm requeues the job again. Both times the run goes on to the uninterrupted run's results."""
    subprocess.run(["scontrol", "update", "nodename=c2", "state=resume"], capture_output=True)  # if left down
    place.submit(slurm=["nodelist=c2"])
    job, = place.job_ids()
    place.training()
    with place.held():
        slurm("sbatch", "-p", "urgent", "-c", "2", "-o", "/dev/null", "--wrap", "sleep 2")
    place.training(start=2, saved=False)  # the resumed job running: the node falls under it (its save can't be waited)
    node_falls_under(place, job)
    assert place.line() == "simcse seed 1: done, requeued 2 time(s)" and place.job_ids() == [job], place.line()
    same_as_straight(place, "simcse", setting)
    two_nodes(Place(place.folder, "two_nodes", setting["args"], ["simcse"]), setting)  # c2 is this thread's


def node_falls_under(place: Place, job: str, ranks=(None,)) -> None:
    """Node c2 set DOWN under the running job (its run's processes held till Slurm signals them), then back: Slurm
    requeues the job, which runs to its end."""
    try:
        with place.held(ranks=ranks):
            slurm("scontrol", "update", "nodename=c2", "state=down", "reason=suite-test")
        # its processes end (KillWait) before it comes back, as a node that fell would have lost them
        place.until(lambda: place.progress().get("state") != "running", why="stopped by its node's fall")
        time.sleep(3)
    finally:
        subprocess.run(["scontrol", "update", "nodename=c2", "state=resume"], capture_output=True)
    line = place.says("done", "scontrol release", timeout=300)
    if "scontrol release" in line:  # Slurm held the job: its launch failed on the node coming back
        slurm("scontrol", "release", job)
    place.says("done", timeout=300)


def two_nodes(place: Place, setting: dict) -> None:
    """#89 item 6: one run across both nodes (--nodes 2: a task on each through srun, gloo, the rendezvous from
    Slurm's variables as submitit gives them) trains as torchrun's two processes on one machine do, bit for bit;
    node c2 set DOWN under it takes the job down on both nodes, Slurm requeues it, and it resumes from last/ to the
    same results. squeue places it on both nodes; status says running, then done, requeued 1 time(s). (After
    preempt_node, in its thread: both take c2 down.)"""
    place.submit("--nodes", "2", slurm=["nodelist=c1,c2"])
    job, = place.job_ids()
    place.training()
    line = place.line()
    assert line.startswith(f"simcse seed 1: running (job {job}):"), line
    assert slurm("squeue", "-h", "-j", job, "-o", "%N").strip() == "c[1-2]"  # a task on each node
    node_falls_under(place, job, ranks=(0, 1))
    assert place.line() == "simcse seed 1: done, requeued 1 time(s)" and place.job_ids() == [job], place.line()
    kept = place.kept("simcse")
    assert kept["world_size"] == 2 and kept["resumptions"], kept["resumptions"]
    same_as_straight(place, "simcse", setting, reference=setting["torchrun"])


def cancel_pending_then_running(place: Place, setting: dict) -> None:
    """(d) `scancel` of a pending job (held back by a dependency): status says pending with Slurm's reason, then
    failed (cancelled); a second `run` resubmits it. Then `scancel` of that job running: SIGTERM, the run saves
    last/; the job is CANCELLED, not requeued: status says failed (cancelled), and a third `run` resubmits it, which
    resumes from last/ to the same results. (One scenario: the resubmitted run is the running job to cancel.)"""
    holder = slurm("sbatch", "--parsable", "-x", "c2", "-o", "/dev/null", "--wrap", "sleep 300").strip()
    try:
        place.submit(slurm=["exclude=c2", f"dependency=afterok:{holder}"])
        pending, = place.job_ids()
        line = place.line()
        assert line == f"simcse seed 1: pending (job {pending}, Slurm: Dependency)", line
        slurm("scancel", pending)
        assert f"job {pending}: CANCELLED" in place.says("failed")
    finally:
        slurm("scancel", holder)
    out = place.submit().stdout
    job, = place.job_ids()
    assert "1 to make" in out and job != pending, out
    place.training()
    with place.held():
        slurm("scancel", job)
    assert f"job {job}: CANCELLED" in place.says("failed")  # sacct's word can come before the job's own note
    place.until(lambda: place.progress().get("state") == "stopped", why="stopped")
    assert place.progress()["code"] == 143
    place.submit(wait=True)
    assert place.line() == "simcse seed 1: done"
    same_as_straight(place, "simcse", setting)


def array_task_killed(place: Place, setting: dict) -> None:
    """(e) a job array of two runs (rows a and b: the same command); task b is killed with SIGKILL and writes
    nothing. Its id is the array task's (J_1); Slurm's answer makes it failed, not queued; `run` resubmits b alone."""
    place.submit()
    ids = place.job_ids()
    assert len(ids) == 2 and all("_" in job for job in ids), ids
    place.training("b")
    slurm("scancel", "--signal=KILL", ids[1])
    line = place.says("failed", "lost", row="b")
    assert f"job {ids[1]}:" in line, line
    out = place.submit(wait=True).stdout
    assert "submitted 1 job(s)" in out and "1 to make" in out, out
    for row in ("a", "b"):
        assert place.line(row) == f"{row} seed 1: done"
        same_as_straight(place, row, setting)


def time_limit_keeps_coming(place: Place, setting: dict) -> None:
    """(a, g) a real time limit: --timeout_min 1 on a run that needs far longer, --max_timeouts 1. Slurm's warning
    (USR2, 20 s before the limit) stops the run and submitit requeues it once; the second warning ends it: failed,
    with submitit's reason; `run --wait` returns, and a second `run` would resubmit it. Slurm checks its time limits
    every 30 s and sends the warning at the first check within 30 s of its time: 10 to 40 s after the job's start
    here (30 s before the limit was 0 to 30 s: a warning in the job's first second killed its interpreter before
    submitit's handler, once in CI)."""
    done = place.submit("--timeout_min", "1", "--signal_delay_s", "20", "--max_timeouts", "1", wait=True,
                        check=False)
    assert done.returncode == 1, (done.stdout, done.stderr)
    line = place.line()
    assert line.startswith("simcse seed 1: failed (") and "timed-out too many times" in line, line
    assert "requeued 1 time(s)" in line and place.progress()["starts"] == 2, line


def two_tasks(place: Place, setting: dict) -> None:
    """Item 4 and 8: one run as two tasks on one node (--tasks_per_node 2: two processes through Slurm's srun, gloo)
    trains as one process does (dropout off: the same function; test_distributed.py's tolerance). #80: a SIGTERM to
    the second task's run alone (a worker stopped by hand, the OOM-killer's) stops both processes at the next step;
    process 0 records the run as interrupted and keeps last/, both exit 143, and since the job did not ask for the
    stop, status says failed with that status (not done: before #80, process 0 wrote a completed run, deleted last/
    and exited 0, and the truncated run was kept as done); a second `run` resumes it. Then the time limit's warning,
    which reaches the first task's run alone, stops both at the next step (a dev gate is 200 steps away), the job is
    requeued and the run ends as it would have."""
    args, want = setting["one"]  # the one-process run's flags and results
    place = Place(place.folder, place.name, args, ["simcse"])
    place.submit("--tasks_per_node", "2")
    place.training()
    folder = place.folder / "runs" / place.name / "simcse.seed1"
    rank_1 = run_process(folder, rank=1)
    assert rank_1, f"no process of rank 1 writes {folder}"
    os.kill(rank_1, signal.SIGTERM)
    line = place.says("failed")
    assert "(the run exited with status 143)" in line, line
    stopped = json.loads((folder / "results.json").read_text())
    assert stopped["interrupted"] and stopped["stop"]["by"] == "SIGTERM" and (folder / "last").is_dir(), stopped
    place.submit("--tasks_per_node", "2")  # the failed run again (a new job): --auto_resume continues it from last/
    job, = place.job_ids()
    place.training()
    signalled = time.time()
    slurm("scancel", "--signal=USR2", job)
    place.until(lambda: place.progress().get("state") == "stopped", why="stopped")
    stopped_in = place.progress()["time"] - signalled
    place.says("done")
    two = place.kept("simcse")
    assert two["world_size"] == 2 and want["world_size"] == 1
    # two tasks sum their gradients in gloo's order, one process in its own: fp32 rounding that Adam carries over
    # 200 steps (measured: 1e-5 on an AVX2 EPYC, 2.5e-5 from step 155 on an AVX-512 Xeon, 2026-12-02); a resume
    # that skips or repeats a step moves the losses by 1e-2 and more
    assert two["train_loss"] == pytest.approx(want["train_loss"], rel=1e-4, abs=1e-6)
    first, stop = two["resumptions"]  # where the warning stopped it: the step after the signal's, not the gate at 200
    assert first == stopped["steps"] and stop < 190 and stopped_in < 20, (first, stop, stopped_in)


def run_process(folder: Path, rank: int | None = None) -> int | None:
    """The process (of `rank`, where the run has several) of the run that writes `folder`, else None: its command
    line names the folder and its environment the rank (a DataLoader worker, a child of it, would match too: none
    here, --num_workers 0)."""
    for proc in Path("/proc").iterdir():
        try:
            if str(folder) in (proc / "cmdline").read_text() and (rank is None or f"\0RANK={rank}\0" in "\0" + (
                    proc / "environ").read_text(errors="replace")):
                return int(proc.name)
        except (OSError, ValueError):
            continue
    return None


def held_without_sigterm(pid: int) -> bool:
    """The process is stopped and no SIGTERM is pending for it (/proc's State and its pending signals' masks)."""
    try:
        status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    except (OSError, ValueError):
        return False  # gone
    pending = int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)
    return status["State"].startswith("T") and not pending & 1 << (signal.SIGTERM - 1)


SCENARIOS = {"two_tasks": (two_tasks, ["simcse"], []), "usr2": (usr2, ["simcse"], []),
             "requeue": (requeue, ["simcse"], []),
             "preempt_node": (preemption_then_node_down, ["simcse"], []),
             "cancel": (cancel_pending_then_running, ["simcse"], []),
             "array": (array_task_killed, ["a", "b"], []),
             "time_limit": (time_limit_keeps_coming, ["simcse"], ["--max_steps", "100000", "--eval_steps", "100000"])}


def test_every_way_slurm_stops_a_job(setting, release_requeued):
    """The scenarios above at once, each in its own protocol folder; a mistake in any fails the test with the
    scenario's name. Broken on purpose, it fails: exit 143 taken for a failure (requeue, preempt_node, usr2), the
    raw job id of an array task recorded (array), a run's starts not counted (every requeue count), an ended job
    counted as queued (cancel, array, time_limit)."""
    errors, threads = {}, []

    def play(name, scenario, rows, flags):
        try:
            scenario(Place(setting["folder"] / name, name, setting["args"] + flags, rows), setting)
        except BaseException:
            errors[name] = traceback.format_exc()[-3000:]
    for name, (scenario, rows, flags) in SCENARIOS.items():
        threads.append(threading.Thread(target=play, args=(name, scenario, rows, flags)))
        threads[-1].start()
    for thread in threads:
        thread.join()
    assert not errors, "\n\n".join(f"== {name}\n{error}" for name, error in errors.items())


def test_mistakes_are_one_line_before_anything_is_queued(flags, tmp_path, monkeypatch, capsys):
    """Each mistake of a user's first days on a cluster is one line, exit 2, with no job queued and no file left
    in jobs/: a misspelt flag in --args (named by its script's own parser), a script the suite does not have,
    flags as a string, a paper the page does not know; then what this cluster cannot give, asked of sinfo and
    sacctmgr (a partition, GPUs, nodes, a time limit, an account); and what only sbatch refuses (a QOS), quoted.
    Broken on purpose (the parse skipped, the checks skipped), a job is queued and the test fails."""
    import protocols
    import report
    monkeypatch.setattr(protocols, "RUNS_DIR", tmp_path / "runs")
    monkeypatch.setattr(report, "RESULTS", tmp_path / "results")
    row = {"name": "simcse", "script": "simcse.py", "flags": [], "paper": None}

    def refused(needle, *argv, **changed):
        path = tmp_path / "mistake.json"
        path.write_text(json.dumps({"name": "mistake", "args": flags[2], "seeds": [1], "transfer": None,
                                    "rows": [{**row, **changed}]}))
        with pytest.raises(SystemExit) as stop:
            report.main(["run", "--protocol", str(path), "--executor", "slurm", "--gpus_per_job", "0",
                         "--timeout_min", "10", *argv])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, (needle, err)
        jobs = tmp_path / "results" / "mistake" / "jobs"
        assert not jobs.is_dir() or not [p for p in jobs.iterdir() if p.name != "owner.json"], list(jobs.iterdir())
    refused("unrecognized arguments: --max_step 10; did you mean --max_steps?", "--args", "--max_step 10")
    refused("simcse_pp.py is not a script of this suite", script="simcse_pp.py")
    refused("its flags a list of strings", flags="--m 0.9")
    refused("paper 'simcse++' is none of the page's", paper="simcse++")
    refused("--partition nope: this cluster has no such partition (sinfo: debug, urgent)", "--partition", "nope")
    refused("--gpus_per_job 2: partition debug has no GPUs", "--gpus_per_job", "2")
    refused("--nodes 3: partition debug has 2 node(s)", "--nodes", "3")
    refused("--timeout_min 500: partition urgent's time limit is 2:00:00", "--timeout_min", "500", "--partition",
            "urgent")
    refused("--account nope: Slurm has no association of user", "--account", "nope")
    refused("sbatch refused the jobs: sbatch: error: Batch job submission failed: Invalid qos specification",
            "--slurm", "qos=nope")  # (a job queued would have left its folder and notes in jobs/)


def test_status_asks_squeue_and_sacct_and_says_lost_where_neither_knows(tmp_path, monkeypatch):
    """A job's state from squeue (pending, with Slurm's reason), then sacct for one squeue has forgotten; one that
    neither knows (accounting off: sacct errs) is lost, not pending, and a second `run` would resubmit it; sacct's
    error stays out of status's lines. A lost job counted as queued fails it."""
    import cluster
    holder = slurm("sbatch", "--parsable", "-x", "c2", "-o", "/dev/null", "--wrap", "sleep 300").strip()
    ended = slurm("sbatch", "--parsable", "-x", "c2", "-o", "/dev/null", "--wrap", "true").strip()
    waiting = slurm("sbatch", "--parsable", "-x", "c2", "-o", "/dev/null", f"--dependency=afterok:{holder}",
                    "--wrap", "true").strip()
    try:
        runs = []
        for job in (waiting, ended, "999999"):
            run = {"row": f"r{job}", "seed": 1, "kept": str(tmp_path / f"r{job}.seed1.json"),
                   "status": str(tmp_path / f"r{job}.seed1.json.note.json")}
            Path(run["status"]).write_text(json.dumps({"job": job, "executor": "slurm"}))
            runs.append(run)
        deadline = time.time() + 240  # the scenarios' jobs start beside it, on busy cores: Slurm may be slow
        while (state := slurm("squeue", "-h", "-j", ended, "-o", "%T").strip()) not in ("", "COMPLETED"):
            assert time.time() < deadline, f"job {ended} (`true`) still {state} after 240 s"
            time.sleep(0.5)
        said = cluster.situations(runs)
        assert said[0] == ("pending", f"pending (job {waiting}, Slurm: Dependency)"), said
        assert said[1][0] == "failed" and f"job {ended}: COMPLETED" in said[1][1], said
        assert said[2][0] == "lost" and "Slurm no longer knows job 999999" in said[2][1], said
        fake = tmp_path / "bin"
        fake.mkdir()
        (fake / "sacct").write_text("#!/bin/sh\necho 'sacct: error: Slurm accounting storage is disabled' >&2\n"
                                    "exit 1\n")
        (fake / "sacct").chmod(0o755)
        monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
        assert cluster.queued(runs) == [True, False, False]
        assert cluster.situations(runs)[2][0] == "lost"
    finally:
        slurm("scancel", holder, waiting)
