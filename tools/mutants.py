"""Plausible one-line bugs planted in the suite's core, one at a time, each against the tests that should catch it:
a test suite that lets one pass has a hole. Each mutant is applied to a copy of the checkout (git's tracked and
untracked files, never this one), the tests named beside it run there, and the table says which mutants a test
caught. docs/tests.md lists the verdicts of the last run.

    python tools/mutants.py                  # every mutant (about 15 minutes on 2 cores)
    python tools/mutants.py --only sscl-tie  # some of them, by name
    python tools/mutants.py --list

A mutant whose text is not found (the code moved) is reported as such, never as caught.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGS = "tests/test_flags.py"
AMI_PADDING = ("tests/test_micse.py::test_ami_of_a_batch_padded_wider_scores_its_sentences_alone_whatever_its_"
               "padding_holds")
PASTED = "tests/test_lifting.py::test_a_pasted_step_fed_a_transformers_model_gives_the_suites_loss_bit_for_bit"
SLURM_STOPS = "tests/test_slurm.py::test_every_way_slurm_stops_a_job"
SLURM_STATES = "tests/test_slurm.py::test_status_asks_squeue_and_sacct_and_says_lost_where_neither_knows"
SLURM_MISTAKES = "tests/test_slurm.py::test_mistakes_are_one_line_before_anything_is_queued"
PIN = "tests/test_behaviour.py::test_a_scripts_numbers_are_the_recorded_ones"
PIN_RULE = ("tests/test_behaviour.py::test_the_rule_is_bit_for_bit_where_the_probe_is_and_a_1_percent_change_fails_"
            "anywhere")
BARLOW = "ablations/simcsepp_noise_barlow.py"
ANOTHER_CPU = "SUITE_BEHAVIOUR_ANOTHER_CPU=1"  # a test list's NAME=value entries are the tests' environment
CLUSTER = "tests/test_cluster.py::test_"
ST_LOSSES = "tests/test_st_losses.py::"

# name: (file, the line's text, its mutation, the tests that should catch it)
MUTANTS = {
    # the four that passed every test before tests/test_flags.py, and the DCL sign
    "simcse-hard-negative-weight": ("simcse.py", "args.temp, columns, args.hard_negative_weight,",
                                    "args.temp, columns, 0.0,", [FLAGS]),
    "simcsepp-dcl-only-temp": ("simcsepp.py", "dcl_temp=args.dcl_temp,", "dcl_temp=args.temp,", [FLAGS]),
    "whitenedcse-groups": ("whitenedcse.py", "head = WhitenedHead(hidden, args.num_groups,",
                           "head = WhitenedHead(hidden, hidden // 2,", [FLAGS]),
    "sscl-tie": ("sscl.py", "if run.dev_gate(step) > run.best_dev", "if run.dev_gate(step) >= run.best_dev", [FLAGS]),
    "simcsepp-dcl-sign": ("simcsepp.py", "        loss = loss + dcl\n", "        loss = loss - dcl\n", [FLAGS]),
    # the losses
    "info-nce-no-temperature": ("simcse.py", "logits = cos_sim(z1, z2) / temp", "logits = cos_sim(z1, z2)",
                                ["tests/test_common.py"]),
    "sscl-plain-term-dropped": ("sscl.py", "return (F.cross_entropy(logits, labels) + F.cross_entropy(in_batch, "
                                "labels)) / 2", "return F.cross_entropy(logits, labels)", ["tests/test_sscl.py"]),
    "multi-positive-anchor": ("whitenedcse.py", "anchor = views[0]", "anchor = views[1]",
                              ["tests/test_whitenedcse.py"]),
    "dcl-unbiased-variance": ("simcsepp.py", "z.var(0, unbiased=False)", "z.var(0)", ["tests/test_simcsepp.py"]),
    "moco-own-keys-kept": ("micse.py", "logits = logits.masked_fill(F.pad(own_keys, (len(z2), 0)), -torch.inf)",
                           "logits = logits", ["tests/test_micse.py"]),
    "ami-log-dropped": ("micse.py", "mutual_information = -0.5 * torch.log(1 - (rho ** 2).clamp(max=1 - 1e-6))",
                        "mutual_information = 0.5 * (rho ** 2)", ["tests/test_micse.py"]),
    # the poolers, the queue, the EMA, the schedule, the gather, resume, the dev gate, Spearman
    "avg-pooler-counts-padding": ("common.py", "mask = attention_mask.unsqueeze(-1).float()",
                                  "mask = torch.ones_like(attention_mask).unsqueeze(-1).float()",
                                  ["tests/test_common.py"]),
    "queue-position-frozen": ("micse.py", "self.position.copy_((self.position + len(ids)) % self.size)",
                              "self.position.copy_(self.position)", ["tests/test_micse.py"]),
    "ema-wrong-weight": ("micse.py", "list(source.parameters()), 1.0 - momentum)",
                         "list(source.parameters()), momentum)", ["tests/test_micse.py"]),
    "micse-ami-lambda": ("micse.py", "ami_lambda=args.ami_lambda,", "ami_lambda=2.5e-3,", [FLAGS]),
    "gather-local-rows": ("plumbing/distributed.py", "return torch.cat([part[:n] for part, n in zip(parts, counts)])",
                          "return t", ["tests/test_distributed.py::test_two_processes_train_like_one[simcse]"]),
    "warmup-ignored": ("common.py", "get_linear_schedule_with_warmup(optimizer, args.warmup_steps,",
                       "get_linear_schedule_with_warmup(optimizer, 0,", ["tests/test_common.py"]),
    "spearman-is-pearson": ("eval_sts.py", "    from scipy.stats import spearmanr\n",
                            "    from scipy.stats import pearsonr as spearmanr\n", ["tests/test_eval_sts.py"]),
    "resume-skips-rng": ("plumbing/resume.py", "torch.set_rng_state(", "(lambda state: None)(",
                         ["tests/test_resume.py"]),
    # the CUDA graph's plumbing, on CPU (tests/test_graph.py's faked capture and replay)
    "graph-batch-not-copied": ("plumbing/graph.py", "            buffer.copy_(batch[k], non_blocking=True)",
                               "            pass", ["tests/test_graph.py"]),
    "graph-no-wait-stream": ("plumbing/graph.py", "        side.wait_stream(torch.cuda.current_stream())\n",
                             "", ["tests/test_graph.py"]),
    "graph-grads-left-for-capture": ("plumbing/graph.py", "        self.optimizer.zero_grad(set_to_none=True)  # the "
                                     "graph's backward", "        pass  # the graph's backward",
                                     ["tests/test_graph.py"]),
    # miCSE under the graph's padding (#74, #81): AMI's share and its rows from the mask, not the maps' width
    "ami-share-of-padded-width": ("micse.py", "valid.shape[1] if inside is None else inside.sum()))",
                                  "valid.shape[1]))", [AMI_PADDING]),
    "objective-reads-the-padding": ("micse.py", "filled = attention_mask.bool().any(0)",
                                    "filled = torch.ones_like(attention_mask[0], dtype=torch.bool)", [AMI_PADDING]),
    # #81: the pasted block feeds as the suite does, and refuses what is wrongly shaped
    "block-step-wrong-layer": ("sscl.py", "layers = (last - 1, last - 2) if layers is None else layers",
                               "layers = (last - 1, last - 1) if layers is None else layers", [f"{PASTED}[sscl]"]),
    "shape-check-removed": ("micse.py", "    if z1.dim() != 2 or z1.shape != z2.shape or attn1.shape[:1] != "
                            "z1.shape[:1]:", "    if False:",
                            ["tests/test_lifting.py::test_a_block_refuses_what_is_wrongly_shaped_in_one_clear_line"]),
    # #79: real encoders' numerics (near-dead channels, subnormal attention)
    "whitening-cancelling-low": ("whitenedcse.py", "    low = (a * c - b * b) / high.clamp_min(torch.finfo(high.dtype)"
                                 ".tiny)", "    low = (a + c) / 2 - half_gap  # (", ["tests/test_whitenedcse.py"]),
    "whitening-in-fp32": ("whitenedcse.py", "groups = x.double()[:, perm]", "groups = x.float()[:, perm]",
                          ["tests/test_whitenedcse.py"]),
    "ami-subnormal-valid": ("micse.py", "valid = (tiles1 > 1e-30) & (tiles2 > 1e-30)",
                            "valid = (tiles1 > 0) & (tiles2 > 0)", ["tests/test_micse.py"]),
    # #80: the behaviour pin on any CPU: matched by its arithmetic, a 1% change seen where it rounds apart
    "pin-matched-by-name": ("tests/test_behaviour.py", ' and record["machine"].get("probe") == list(here["probe"])',
                            "", [PIN_RULE]),
    "fit-declines-the-graph": ("plumbing/memory.py", "    if args.gradient_checkpointing and args.micro_batch_size:",
                               '    if getattr(args, "cuda_graph", False) or (args.gradient_checkpointing and '
                               'args.micro_batch_size):',
                               ["tests/test_ecosystem.py::test_fit_memory_fits_the_graph_a_gpu_runs_by_default"]),
    "resume-skips-graph-refusals": ("plumbing/options.py", "        if args.cuda_graph and what is not None and not "
                                    "given:", "        if False:", ["tests/test_graph.py"]),
    "graph-short-batch-through-full": ("plumbing/graph.py", "shape = (tuple((k, tuple(v.shape)) for k, v in "
                                       "batch.items()), same)", "shape = (tuple(batch), ())",
                                       ["tests/test_graph.py"]),
    "tensorboard-held-assumed": ("plumbing/tracking.py", "collections.defaultdict(lambda: -1, tensorboard_held("
                                 "folder, resume_at))", "collections.defaultdict(lambda: resume_at - 1)",
                                 ["tests/test_faults.py::test_the_slurm_recipe_survives_a_sigterm_at_any_moment"]),
    # the cluster path, against a real Slurm (tests/test_slurm.py: skipped where tools/local_slurm.sh's is not up)
    "slurm-sigterm-is-failure": ("tools/cluster.py", "            if self.terminated and code != 0:  # Slurm",
                                 "            if False:  # Slurm", [SLURM_STOPS]),
    "slurm-starts-not-counted": ("tools/cluster.py", 'starts=was.get("starts", 0) + 1,', "starts=1,", [SLURM_STOPS]),
    "slurm-array-raw-id": ("tools/cluster.py", '{"job": str(job.job_id), "executor"',
                           '{"job": str(job.job_id).split("_")[0], "executor"', [SLURM_STOPS]),
    "slurm-lost-is-queued": ("tools/cluster.py", "            elif state in PENDING:",
                             "            elif state in PENDING or state is None:", [SLURM_STATES]),
    "slurm-request-unchecked": ("tools/cluster.py", "        slurm.check_request(partition, account, gpus_per_job, "
                                "nodes, timeout_min)", "        pass", [SLURM_MISTAKES]),
    "commands-not-parsed": ("tools/protocols.py", '                importlib.import_module(Path(script).stem).'
                            'parse_args(run["argv"][1:])', "                pass",
                            ["tests/test_cluster.py::test_a_misspelt_flag_or_a_wrong_field_is_one_line_before_anything_"
                             "runs"]),
    "stop-never-agreed": ("plumbing/distributed.py", "        agreed = self.answer() if self.answer else False",
                          "        agreed = False", [SLURM_STOPS]),
    "dev-gate-in-train-mode": ("plumbing/run.py", "            m.eval()\n        measures = dev_set(encode)",
                               "            m.train()\n        measures = dev_set(encode)",
                               ["tests/test_eval_sts.py", "tests/test_simcse.py"]),
    # #80: the stop on every process, the trackers
    "stop-not-shared": ("plumbing/distributed.py", "        self.signum = int(largest_next(own or 0)()) or self.signum",
                        "        self.signum = own", ["tests/test_distributed.py::test_a_signal_to_any_process_stops_"
                                                      "every_process_and_the_resumes_end_as_the_straight_run"]),
    "trackers-sent-before-save": ("plumbing/tracking.py", "            self.waiting.append((step, values, "
                                  "int(time.time() * 1000)))", "            self.waiting.append((step, values, "
                                  "int(time.time() * 1000)))\n            self.release()",
                                  ["tests/test_ecosystem.py::test_each_step_is_tracked_once_across_a_kill_between_"
                                   "saves"]),
    # #80: the cluster's edges
    "slurm-conf-link-unmarked": ("tools/local_slurm.sh", 'if [ -e "$BASE/made-client-conf" ] && [ "$(readlink',
                                 'if [ "$(readlink', [f"{CLUSTER}local_slurm_leaves_a_machines_own_slurm_conf_as_it_"
                                                      "found_it"]),
    "slurm-days-hours-as-minutes": ("tools/slurm.py", "    if days is not None:  # after days-", "    if False:  #",
                                    [f"{CLUSTER}slurm_time_limits_in_every_documented_form"]),
    "protocol-unlocked": ("tools/cluster.py", "        lock.hold(folder, provenance.now())", "        provenance.now()",
                          [f"{CLUSTER}two_run_commands_at_once_one_submits_and_the_other_names_the_holder"]),
    "local-job-ends-at-first-task": ("tools/cluster.py", 'if all((folder / f"{note.get(',
                                     'if any((folder / f"{note.get(',
                                     [f"{CLUSTER}a_local_job_has_ended_only_when_every_task_has"]),
    # #88: what ContrastiveTrainer does for a loss's own state (st_losses.py)
    "st-head-not-clipped": ("st_losses.py", "return self.accelerator.clip_grad_norm_(self.contrastive.parameters(),",
                            "return self.accelerator.clip_grad_norm_(model.parameters(),",
                            [f"{ST_LOSSES}test_three_steps_of_contrastive_trainer_equal_the_method_files_block_loop_"
                             "bit_for_bit[simcse]"]),
    "st-ema-before-the-step": ("st_losses.py", "    def on_optimizer_step(self, args, state, control, **kwargs):",
                               "    def on_pre_optimizer_step(self, args, state, control, **kwargs):",
                               [f"{ST_LOSSES}test_three_steps_of_contrastive_trainer_equal_the_method_files_block_"
                                "loop_bit_for_bit[micse]"]),
    "st-queue-not-checkpointed": ("st_losses.py", '            loss.queue.load_state_dict(state["queue"])',
                                  "            pass", [f"{ST_LOSSES}test_resume_from_checkpoint_at_step_2_of_4_"
                                                      "equals_the_straight_run_bit_for_bit[micse]"]),
}


# #89: every temperature and loss weight +1% and -1% where the run passes it (pin-NAME-1pct-up, -down), each against
# the behaviour pin's case that must see it on any CPU: name: (file, the line's text, the value in it, the pin's case)
for _name, (_file, _text, _value, _case) in {
        "simcse-temp": ("simcse.py", "head, args.temp, columns,", "args.temp", "simcse"),
        "simcse-hard-negative-weight": ("simcse.py", "columns, args.hard_negative_weight,", "args.hard_negative_weight",
                                        "simcse-hard-negative"),
        "simcsepp-temp": ("simcsepp.py", "dict(temp=args.temp, m=args.m,", "args.temp", "simcsepp"),
        "simcsepp-m": ("simcsepp.py", " m=args.m,", "args.m", "simcsepp"),
        "simcsepp-dcl-weight": ("simcsepp.py", "dcl_weight=args.dcl_weight,", "args.dcl_weight", "simcsepp"),
        "simcsepp-dcl-temp": ("simcsepp.py", "dcl_temp=args.dcl_temp,", "args.dcl_temp", "simcsepp-dcl"),
        "sscl-temp": ("sscl.py", "head, args.temp, **view_options", "args.temp", "sscl"),
        "whitenedcse-temp": ("whitenedcse.py", "generator=generator, temp=args.temp,", "args.temp", "whitenedcse"),
        "micse-temp": ("micse.py", "dict(temp=args.temp, ami_lambda", "args.temp", "micse"),
        "micse-ami-lambda": ("micse.py", "ami_lambda=args.ami_lambda,", "args.ami_lambda", "micse"),
        "micse-momentum": ("micse.py", "head, args.momentum,", "args.momentum", "micse-momentum"),
        "augmentations-temp": ("ablations/simcse_augmentations.py", "info_nce(z1, z2, args.temp)", "args.temp",
                               "augmentations"),
        "barlow-temp": (BARLOW, "info_nce(z1, z2, args.temp) + args.barlow_weight", "args.temp", "noise-barlow"),
        "barlow-weight": (BARLOW, "+ args.barlow_weight *", "args.barlow_weight", "noise-barlow"),
        "barlow-lambda": (BARLOW, "z2, args.barlow_lambda, padding)", "args.barlow_lambda", "noise-barlow"),
        "whitening-temp": ("ablations/whitenedcse_whitening.py", "(views, args.temp)", "args.temp", "whitening-eps"),
}.items():
    for _way, _factor in (("up", 1.01), ("down", 0.99)):
        MUTANTS[f"pin-{_name}-1pct-{_way}"] = (_file, _text, _text.replace(_value, f"{_value} * {_factor}"),
                                               [ANOTHER_CPU, f"{PIN}[{_case}]"])


def checkout_copy(workdir: Path) -> Path:
    """The files git knows of (tracked, and untracked but not ignored), copied into `workdir`."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    copy = workdir / ROOT.name
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    if (ROOT.parent / "shared").is_dir():  # the tests look for ../shared beside the checkout
        (workdir / "shared").symlink_to(ROOT.parent / "shared")
    return copy


def try_mutant(name: str, workdir: Path) -> tuple[str, float]:
    """(verdict, seconds): "caught" where a named test fails, "MISSED" where all pass, "not found" where the line
    is gone."""
    file, old, new, tests = MUTANTS[name]
    copy = checkout_copy(workdir / name)
    path = copy / file
    text = path.read_text()
    if text.count(old) != 1:
        return f"not found ({text.count(old)} matches in {file})", 0.0
    path.write_text(text.replace(old, new))
    env = dict(os.environ, **dict(t.split("=", 1) for t in tests if "=" in t))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           *(t for t in tests if "=" not in t)], cwd=copy, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if proc.returncode == 0:
        return "MISSED", seconds
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in proc.stdout.splitlines()
              if line.startswith(("FAILED ", "ERROR "))]
    return (f"caught by {failed[0]}" if failed else f"pytest exit {proc.returncode}"), seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(MUTANTS), help="these mutants")
    parser.add_argument("--list", action="store_true", help="name, file and the tests of each mutant")
    args = parser.parse_args(argv)
    names = args.only or list(MUTANTS)
    if args.list:
        for name in names:
            print(f"{name:<30} {MUTANTS[name][0]:<26} {' '.join(MUTANTS[name][3])}")
        return 0
    missed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            verdict, seconds = try_mutant(name, Path(tmp))
            missed += not verdict.startswith("caught")
            print(f"{name:<30} {verdict} ({seconds:.0f} s)", flush=True)
    print(f"{len(names) - missed} of {len(names)} caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
