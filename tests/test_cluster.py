"""A protocol's runs as submitit jobs (tools/cluster.py, `report.py run --executor`): on submitit's local executor for
real, a two-row x two-seed protocol on the tiny model, one job pre-empted as Slurm would (submitit's SIGUSR2 to the
job), requeued and finished to an uninterrupted run's results; one run across two tasks (gloo) as one process
trains; the sbatch script submitit writes for the Slurm flags (no Slurm here); bad input in one line."""
import importlib.util
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, smoke_args, write_tiny_model

pytestmark = pytest.mark.skipif(not importlib.util.find_spec("submitit"), reason="submitit is a test requirement")


@pytest.fixture
def protocol_files(tiny_model, corpus, senteval_dir, tmp_path, monkeypatch):
    import protocols
    import report
    monkeypatch.setattr(protocols, "RUNS_DIR", tmp_path / "runs")
    monkeypatch.setattr(report, "RESULTS", tmp_path / "results")
    shared = [str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, "x")[:-4]] + ["--device", "cpu",
                                                                                        "--no_align_uniform"]
    protocol = {"name": "tiny", "description": "two rows", "args": shared + ["--max_steps", "12", "--eval_steps",
                                                                              "6", "--save_steps", "3"],
                "seeds": [1, 2], "transfer": None,
                "rows": [{"name": "simcse", "script": "simcse.py", "flags": [], "paper": "simcse"},
                         {"name": "sscl", "script": "sscl.py", "flags": ["--neg_layers", "1"], "paper": None}]}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(protocol))
    return path


def status_files(results: Path) -> dict:
    return {p.name: json.loads(p.read_text()) for p in (results / "tiny" / "jobs").glob("*.seed*.json")}


def test_a_protocol_runs_as_local_jobs_and_a_preempted_job_is_requeued_to_the_same_results(
        protocol_files, tmp_path, capsys, monkeypatch):
    """`report.py run --executor local --wait`: the protocol's two runs of seed 1 in one local job, one after
    another (each a new interpreter: seed 2's two more took 20 s of CPU for nothing new). While the second run
    trains, the job gets SIGUSR2, what submitit handles as Slurm's pre-emption: the run gets SIGTERM and saves
    last/, submitit requeues the job (its local executor restarts it), the requeued job resumes the run with
    --auto_resume. `status` shows the requeue; the requeued run's scores and best/ weights are those of the same
    command run straight; a second `run` submits nothing, and parses no command again (each submitted as it is)."""
    import importlib
    import protocols
    import report
    from safetensors.torch import load_file
    protocol = {**json.loads(protocol_files.read_text()), "seeds": [1]}
    # the second run trains 48 steps, 8 dev gates: a window of seconds to stop it in (at 12 steps, with its last/
    # there for about a second, the poll below missed it in two CI runs of three on busy cores)
    protocol["rows"][1]["flags"] += ["--max_steps", "48"]
    protocol_files.write_text(json.dumps(protocol))
    parsed, check_commands = [], protocols.check_commands
    monkeypatch.setattr(protocols, "check_commands", lambda runs: [parsed.append([r["row"] for r in runs]),
                                                                   check_commands(runs)])
    report.main(["run", "--protocol", str(protocol_files), "--executor", "local", "--timeout_min", "10"])
    out = capsys.readouterr().out
    assert "2 to make (local jobs)" in out and "submitted 1 job(s)" in out, out
    results = tmp_path / "results"
    deadline = time.time() + 240
    while time.time() < deadline:  # the second run's last/ (a save every 3 steps): it is training
        notes = status_files(results)
        running = [n for n in notes.values() if n.get("state") == "running"]
        last = list((tmp_path / "runs" / "tiny").glob("*/last"))
        if len([n for n in notes.values() if n.get("state") == "done"]) == 1 and running and last:
            os.kill(running[0]["pid"], signal.SIGUSR2)
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"no second run training in time: {status_files(results)}")
    report.main(["run", "--protocol", str(protocol_files), "--executor", "local", "--wait"])  # waits, queues none
    out = capsys.readouterr().out
    assert "2 done or queued, 0 to make" in out, out
    report.main(["status", "--protocol", str(protocol_files)])
    status = capsys.readouterr().out.splitlines()
    assert sum("done" in line for line in status) == 2 and sum("requeued 1 time(s)" in line for line in status) == 1
    requeued = [line.split(":")[0] for line in status if "requeued" in line]
    for run in protocols.runs(json.loads(protocol_files.read_text())):  # the others ran straight in their job
        if f"{run['row']} seed {run['seed']}" not in requeued:
            continue
        straight = tmp_path / "straight" / run["out"].name
        argv = [*run["argv"][1:-3], "--output_dir", str(straight)]  # the same command, not --auto_resume
        importlib.import_module(run["argv"][0][:-3]).main(argv)
        kept = json.loads((results / "tiny" / protocols.kept_name(run)).read_text())
        want = json.loads((straight / "results.json").read_text())
        assert kept["train_loss"] == want["train_loss"] and kept["test"] == want["test"], run["row"]
        got, ref = (load_file(p / "best" / "model.safetensors") for p in (run["out"], straight))
        assert all(torch.equal(got[k], ref[k]) for k in ref), run["row"]
    report.main(["run", "--protocol", str(protocol_files), "--executor", "local"])
    assert "2 done or queued, 0 to make" in capsys.readouterr().out
    assert parsed == [["simcse", "sscl"], [], []], parsed
    with pytest.raises(SystemExit) as stop:  # a command changed since it was submitted: read again, and refused
        report.main(["run", "--protocol", str(protocol_files), "--executor", "local", "--args", "--lrr 1e-5"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--lrr" in err and len(err.strip().splitlines()) == 1, err
    assert parsed[-1] == ["simcse", "sscl"], parsed


def test_one_run_across_two_tasks_trains_as_one_process(tmp_path, corpus, senteval_dir, capsys, monkeypatch):
    """--gpus_per_job 2 on the local executor: one run as two tasks, torch.distributed's environment from submitit's
    (TorchDistributedEnvironment), gloo on CPU: its losses are the one-process run's within test_distributed.py's
    tolerance (dropout off: the same function), its world size 2."""
    import importlib
    import protocols
    import report
    model = write_tiny_model(tmp_path / "model", dropout=0.0)
    monkeypatch.setattr(protocols, "RUNS_DIR", tmp_path / "runs")
    monkeypatch.setattr(report, "RESULTS", tmp_path / "results")
    args = [str(a) for a in smoke_args(model, corpus, senteval_dir, "x")[:-4]] + [
        "--device", "cpu", "--dropout", "0", "--max_steps", "4", "--no_test_eval", "--no_align_uniform"]
    path = tmp_path / "two.json"
    path.write_text(json.dumps({"name": "tiny", "description": "one run", "args": args, "seeds": [1],
                                "transfer": None, "rows": [{"name": "simcse", "script": "simcse.py", "flags": [],
                                                            "paper": None}]}))
    report.main(["run", "--protocol", str(path), "--executor", "local", "--gpus_per_job", "2", "--wait",
                 "--timeout_min", "10"])
    two = json.loads((tmp_path / "results" / "tiny" / "simcse.seed1.json").read_text())
    importlib.import_module("simcse").main([*args, "--seed", "1", "--output_dir", str(tmp_path / "one")])
    one = json.loads((tmp_path / "one" / "results.json").read_text())
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert two["train_loss"] == pytest.approx(one["train_loss"], rel=1e-5, abs=1e-6)


def fake_slurm(tmp_path, monkeypatch) -> None:
    """An `srun` (and Slurm's other commands) on PATH that do nothing and answer nothing: submitit's Slurm executor is
    then built, its script written; nothing is submitted, whether or not this machine runs a Slurm."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "sbatch", "sinfo", "sacctmgr", "squeue", "sacct"):
        (bin_dir / name).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / name).chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_the_sbatch_script_submitit_writes_for_the_flags(tmp_path, monkeypatch):
    """--executor slurm --partition gpu --account lab --gpus_per_job 4 --nodes 2 --timeout_min 240 --signal_delay_s
    120 --slurm qos=high: the script asks Slurm for them, its signal (USR2) 120 s before the time limit, a job that
    may be requeued (a site's JobRequeue=0 would cancel it on a pre-emption), and runs submitit's job (which requeues
    itself on the signal: `scontrol requeue`)."""
    import cluster
    fake_slurm(tmp_path, monkeypatch)
    made = cluster.make_executor(tmp_path / "jobs", "slurm", gpus_per_job=4, nodes=2, timeout_min=240,
                                 partition="gpu", account="lab", signal_delay_s=120, extra={"slurm_qos": "high"})
    script = made._executor._make_submission_file_text("python -u -m submitit.core._submit FOLDER", "uid")
    for line in ("#SBATCH --partition=gpu", "#SBATCH --account=lab", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --time=240", "#SBATCH --qos=high",
                 "#SBATCH --signal=USR2@120", "#SBATCH --open-mode=append", "#SBATCH --requeue"):
        assert line in script, (line, script)
    assert "submitit.core._submit" in script


def test_bad_input_is_one_line_before_anything_is_submitted(protocol_files, tmp_path, monkeypatch, capsys):
    """No submitit, --executor slurm without srun, a Slurm parameter submitit does not know, a warning that could
    come as the job starts, a protocol folder whose jobs another user submitted: one line each, exit 2, nothing
    submitted."""
    import sys
    import report
    jobs = tmp_path / "results" / "tiny" / "jobs"

    def refused(argv, needle):
        with pytest.raises(SystemExit) as stop:
            report.main(["run", "--protocol", str(protocol_files), *argv])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
        assert not list(jobs.glob("*.seed*.json"))
    monkeypatch.setitem(sys.modules, "submitit", None)
    refused(["--executor", "local"], "needs the submitit package: pip install submitit")
    monkeypatch.delitem(sys.modules, "submitit")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    refused(["--executor", "slurm"], "--executor slurm: this machine has no srun")
    fake_slurm(tmp_path, monkeypatch)
    refused(["--executor", "slurm", "--slurm", "not_a_parameter=1"], "submitit refuses a parameter")
    refused(["--executor", "slurm", "--timeout_min", "1", "--signal_delay_s", "21"], "give at most 20")
    import argparse
    import cluster
    parser = argparse.ArgumentParser()
    cluster.add_arguments(parser)  # the limit itself is taken: test_slurm.py's time limit
    accepted = parser.parse_args(["--executor", "slurm", "--timeout_min", "1", "--signal_delay_s", "20"])
    assert cluster.options(accepted, None)["signal_delay_s"] == 20
    jobs.mkdir(parents=True)
    (jobs / "owner.json").write_text(json.dumps({"user": "someone-else"}))
    refused(["--executor", "local"], "holds the jobs of user someone-else")


def test_a_run_that_fails_fails_its_job_once_and_status_says_why(protocol_files, tmp_path, capsys):
    """A run that exits with an error (here a flag it refuses) is not requeued: its job fails, `run --wait` names
    it, and `status` gives the reason and its log's last lines (the run's one line among them)."""
    import report
    protocol = json.loads(protocol_files.read_text())
    protocol["rows"], protocol["seeds"] = protocol["rows"][:1], [1]
    protocol["args"] += ["--lr", "-1"]
    protocol_files.write_text(json.dumps(protocol))
    with pytest.raises(SystemExit) as stop:
        report.main(["run", "--protocol", str(protocol_files), "--executor", "local", "--wait"])
    out = capsys.readouterr().out
    assert stop.value.code == 1 and "== failed: python simcse.py" in out and "status 2" in out, out
    report.main(["status", "--protocol", str(protocol_files)])
    line, = capsys.readouterr().out.splitlines()
    assert line.startswith("simcse seed 1: failed (the run exited with status 2)") and "--lr" in line, line
    assert "requeued" not in line


def test_runs_per_gpu_is_capped_by_what_the_memory_estimate_fits(protocol_files, monkeypatch, capsys):
    """--runs_per_gpu K: the memory estimate of the protocol's runs (plumbing/memory.py) and the GPU's free memory
    decide the largest K that fits, a CUDA context each: here a GPU with room for 2.5 of them takes 2 (K 4 asked),
    one line says so; a GPU with room for 5 takes the 4 asked."""
    import importlib
    import cluster
    import protocols
    from plumbing import hub, memory
    todo = protocols.runs(json.loads(protocol_files.read_text()))
    parsed = [importlib.import_module(Path(run["argv"][0]).stem).parse_args(run["argv"][1:]) for run in todo
              if run["seed"] == todo[0]["seed"]]  # each row once: a seed changes no tensor's size
    largest = max(memory.peak(memory.estimate(args, hub.local_config(args.model_name_or_path))) for args in parsed)
    per_run = (largest + memory.CONTEXT) / (1 - memory.FRAGMENTATION)
    traced, estimate = [], memory.estimate
    monkeypatch.setattr(memory, "estimate", lambda args, *rest, **kw: [traced.append(args.seed),
                                                                        estimate(args, *rest, **kw)][1])
    for room, want in ((2.5, 2), (5.2, 4)):
        monkeypatch.setattr(memory, "device_free", lambda device: int(room * per_run))
        assert cluster.runs_that_fit(todo, [0], 4) == want
    assert len(traced) == 2 * len(parsed), traced  # each row's estimate once a call, whatever its seeds
    assert "--runs_per_gpu 4:" in capsys.readouterr().out


def test_runs_sharing_a_gpu_without_mps_get_one_line(tmp_path, monkeypatch, capsys):
    """Without an NVIDIA MPS daemon (its control pipe) the K runs on a GPU take turns (measured on an H200): K > 1
    says so in one line, K = 1 or a running daemon does not. A note printed always, or never, fails it."""
    import cluster
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    for k in (1, 2):
        cluster.note_without_mps(k)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and printed[0].startswith("note: --runs_per_gpu 2: no NVIDIA MPS daemon"), printed
    (tmp_path / "control").touch()
    cluster.note_without_mps(2)
    assert capsys.readouterr().out == ""


def test_status_reads_the_latest_start_and_the_page_names_running_runs(protocol_files, tmp_path, monkeypatch,
                                                                        capsys):
    """A running run's progress comes from its log since its job last started it: after a requeue the old ETA is
    not shown ("starting" until the new start's first line). The page lists a queued run as running, not missing;
    `status` without --protocol reports and writes nothing. Reading the log from its start, or listing every run
    not done as missing, fails it."""
    import cluster
    import protocols
    import report
    protocol = json.loads(protocol_files.read_text())
    run = cluster.attach(protocols.runs(protocol)[0], tmp_path / "results" / "tiny", tmp_path / "results" / "tiny" /
                         "jobs")
    log = tmp_path / "job.log"
    log.write_text("step 20/60  loss 2.0  3.00 steps/s  ETA 1m47s\n")
    Path(run["status"]).parent.mkdir(parents=True)
    Path(run["status"]).write_text(json.dumps({"job": str(os.getpid()), "executor": "local", "log": str(log)}))
    cluster.progress_path(run).write_text(json.dumps({"state": "running", "starts": 2,
                                                      "log_offset": log.stat().st_size}))
    line = cluster.status_lines(protocol, tmp_path / "results" / "tiny")[0]
    assert line == f"simcse seed 1: running (job {os.getpid()}, requeued 1 time(s)): started", line
    with log.open("a") as more:
        more.write("training: 39/60 steps (65%), 2.1 steps/s, 18s elapsed, ETA 10s\n")
    line = cluster.status_lines(protocol, tmp_path / "results" / "tiny")[0]
    assert line.endswith("requeued 1 time(s)): training: 39/60 steps (65%), 2.1 steps/s, 18s elapsed, ETA 10s"), line
    report.main(["write", "--protocol", str(protocol_files)])
    page = (tmp_path / "results" / "tiny" / "RESULTS.md").read_text()
    assert "Running (`python tools/report.py status --protocol tiny`): simcse seed 1." in page
    assert "Missing (run them with `python tools/report.py run`, or the lines of `commands`): sscl seed 1, simcse " \
           "seed 2, sscl seed 2." in page
    capsys.readouterr()
    before = sorted(p for p in (tmp_path / "results").rglob("*"))
    report.main(["status"])
    assert capsys.readouterr().out.startswith("status reports a protocol's jobs: python tools/report.py status "
                                              "--protocol NAME (jobs were submitted for: tiny)")
    assert sorted(p for p in (tmp_path / "results").rglob("*")) == before


def test_a_misspelt_flag_or_a_wrong_field_is_one_line_before_anything_runs(protocol_files, tmp_path, capsys):
    """Every run's command line read by its own script's parser before anything runs or is queued (here, or on a
    cluster: tests/test_slurm.py): --args "--max_step 10" names --max_steps; a script that is not the suite's,
    flags as a string and an unknown paper are refused when the protocol is read. Skipping the parse fails it."""
    import report
    protocol = json.loads(protocol_files.read_text())

    def refused(needle, *argv, **row):
        protocol_files.write_text(json.dumps({**protocol, "rows": [{**protocol["rows"][0], **row}]}))
        with pytest.raises(SystemExit) as stop:
            report.main(["run", "--protocol", str(protocol_files), *argv])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "results" / "tiny").exists() and not (tmp_path / "runs").exists()
    refused("row 'simcse' seed 1: simcse.py: error: unrecognized arguments: --max_step 10; did you mean "
            "--max_steps?", "--args", "--max_step 10")
    refused("row 'simcse' seed 1: simcse.py: error: unrecognized arguments: --max_step 10; did you mean "
            "--max_steps?", "--args", "--max_step 10", "--executor", "local")
    refused("simcse_pp.py is not a script of this suite", script="simcse_pp.py")
    refused("its flags a list of strings, e.g. [\"--m\", \"0.9\"], not '--m 0.9'", flags="--m 0.9")
    refused("paper 'simcse++' is none of the page's", paper="simcse++")


def test_a_local_job_has_ended_only_when_every_task_has(tmp_path):
    """A two-task local job whose second task has written its outcome (submitit's <job>_1_result.pkl) while the
    first still keeps the run's results is running: taking it as ended there made `run --wait` call the run failed
    (test_one_run_across_two_tasks_trains_as_one_process, 1 time in 3). It has ended once both outcomes are
    written, or once its controller (here this test's process, then one that has exited) is gone."""
    import cluster
    log = tmp_path / "job" / f"{os.getpid()}_0_log.out"
    log.parent.mkdir()
    note = {"job": str(os.getpid()), "executor": "local", "log": str(log), "tasks": 2}
    assert cluster.local_alive(note)
    (log.parent / f"{os.getpid()}_1_result.pkl").touch()
    assert cluster.local_alive(note)
    (log.parent / f"{os.getpid()}_0_result.pkl").touch()
    assert not cluster.local_alive(note)
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert not cluster.local_alive({**note, "job": str(gone.pid)})


def test_slurm_time_limits_in_every_documented_form(tmp_path, monkeypatch):
    """slurm.minutes reads each form of Slurm's time limits (minutes, minutes:seconds, hours:minutes:seconds,
    days-hours, days-hours:minutes, days-hours:minutes:seconds), seconds rounded up; UNLIMITED and INFINITE (sinfo's
    infinite) are no limit. Its caller, check_request, against an sinfo that prints one partition's limit (a fake:
    no Slurm here): --timeout_min beyond 2-12 (3600 minutes, read as 2892 before) is one line, within it or under
    an infinite limit nothing."""
    import plumbing
    import slurm
    for limit, want in (("90", 90), ("90:30", 91), ("90:00", 90), ("2:30:00", 150), ("2:30:01", 151),
                        ("2-12", 3600), ("2-12:30", 3630), ("2-12:30:01", 3631), ("0-0:0:1", 1),
                        ("UNLIMITED", None), ("INFINITE", None), ("infinite", None)):
        assert slurm.minutes(limit) == want, limit
    fake_slurm(tmp_path, monkeypatch)
    for limit, timeout, refused in (("2-12", 3600, False), ("2-12", 3601, True), ("infinite", 10 ** 6, False)):
        (tmp_path / "bin" / "sinfo").write_text(f"#!/bin/sh\necho 'debug*|2|{limit}|(null)'\n")
        if refused:
            with pytest.raises(plumbing.UsageError, match=r"time limit is 2-12 \(3600 min\)"):
                slurm.check_request(None, None, 0, 1, timeout)
        else:
            slurm.check_request(None, None, 0, 1, timeout)


def test_two_run_commands_at_once_one_submits_and_the_other_names_the_holder(protocol_files, tmp_path, monkeypatch,
                                                                             capsys):
    """While another process holds the protocol's jobs folder (plumbing/lock.py's lock, as a second `run` holds it
    from asking what is queued to submitting), `run --executor local` is one line naming that process and its host,
    exit 2, and submits nothing; once the holder has ended, `run` submits the four runs. Submitting is faked (it
    records what it is given, nothing runs): without the lock the refused command would reach it."""
    import cluster
    import report
    submitted = []
    monkeypatch.setattr(cluster, "submit", lambda todo, *args, **kwargs: submitted.append(todo) or [])
    jobs = tmp_path / "results" / "tiny" / "jobs"
    jobs.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); from plumbing "
                               f"import lock; lock.hold({str(jobs)!r}, 'now'); print('held', flush=True); "
                               "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(SystemExit) as stop:
            report.main(["run", "--protocol", str(protocol_files), "--executor", "local"])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"is in use by process {holder.pid} on {socket.gethostname()}" in err and "report.py run" in err, err
        assert submitted == []
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    report.main(["run", "--protocol", str(protocol_files), "--executor", "local"])
    assert [len(todo) for todo in submitted] == [4] and not (jobs / ".lock").exists()


def test_local_slurm_leaves_a_machines_own_slurm_conf_as_it_found_it(tmp_path):
    """tools/local_slurm.sh's link of Slurm's default slurm.conf to its own, in a folder standing for /etc/slurm
    (SUITE_SLURM_CLIENT_CONF; its start and stop call the same step, here alone: no Slurm, no root): made where the
    machine has none, and removed by stop; a site's own file, its link elsewhere (even a dangling one) and a link
    to ours it made itself are left as they were by start and stop. Replacing a site's link, or removing a link
    start did not make, fails it."""
    conf = tmp_path / "etc" / "slurm" / "slurm.conf"
    conf.parent.mkdir(parents=True)
    ours = tmp_path / "suite" / "etc" / "slurm.conf"
    env = {**os.environ, "SUITE_SLURM_DIR": str(ours.parents[1]), "SUITE_SLURM_CLIENT_CONF": str(conf)}

    def script(action):
        subprocess.run(["bash", str(ROOT / "tools" / "local_slurm.sh"), action], env=env, check=True,
                       capture_output=True)

    def seen():
        return ("link", os.readlink(conf)) if conf.is_symlink() else ("file", conf.read_text())
    script("link_conf")
    assert seen() == ("link", str(ours))
    script("unlink_conf")
    assert not conf.exists() and not conf.is_symlink()
    for site in ("a file", "/site/slurm.conf", str(ours)):
        conf.write_text("ClusterName=site\n") if site == "a file" else conf.symlink_to(site)
        before = seen()
        script("link_conf")
        assert seen() == before, site
        script("unlink_conf")
        assert seen() == before, site
        conf.unlink()
