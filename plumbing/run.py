"""A training run's bookkeeping, written once and called in one line from each method file's loop.

    run = Run(args)                    # every flag checked, the seeds, the device and process group
    run.start(loader, total_steps, encode, modules, train_file, subset, **state)   # summary, --resume
    for step in run.steps():           # logging, trajectory, last/ and the stop signal between steps
        ... the method's training step ...
        run.record(loss, grad_norm)    # kept on the device until a log step: no host sync
        if <a dev gate>:
            if run.dev_gate(step) > run.best_dev:   # STS-B dev (an undefined one: -inf)
                run.save_best(step, backbone, head, tokenizer, eval_pooler)    # best/
    run.write(run.evaluate_best(eval_pooler))   # best/ reloaded and evaluated; results.json

What it keeps: each step's loss and gradient norm (read from the device at log steps only, one host sync; the first
NaN or inf stops the run naming its step), the trajectory (a row at each log, dev and --align_uniform_steps step:
step, training time, lr, and where STS-B dev was encoded its score, l_align and l_uniform), TensorBoard scalars
(--report_to), the training time without the dev gates and logs (read where the device has finished its queue, so a
GPU's real speed), the progress bar, last/ for --resume (at a dev gate after --save_minutes, every --save_steps and
when a signal stops the run), and the record that becomes results.json. What stops a run (a signal, a divergence, a
write that fails) leaves the last complete state and one line: best/ from its copy, results.json with the record up
to the stop, and, where the training can go on, last/. The output folder's states, its lock and its checks:
plumbing/outdir.py and plumbing/lock.py; best/ and its copy: plumbing/checkpoint.py.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import resource
import signal
import time
from pathlib import Path

import torch
import transformers

import common
import data
import eval_sts
import plumbing
from plumbing import (backbones, checkpoint, distributed, files, graph, hub, lock, memory, options, outdir,
                      progress, provenance, resume, syncs, tracking)


FP16_SKIP_LIMIT = 25  # fp16: this many skipped steps in a row stop the run (the scale has fallen 2^25-fold)


class Stopped(plumbing.UsageError):
    """The run stopped itself: `by` "divergence" (a NaN or inf loss in fp32 or bf16) or "fp16 overflow"."""

    def __init__(self, message: str, by: str, step: int):
        super().__init__(message)
        self.by, self.step = by, step


class History:
    """What the loop measures: each step's loss and gradient norm (`add`: kept on the device until `read`, one host
    sync at a log step), the trajectory (`record`: a row at each log, dev and --align_uniform_steps step), and their
    scalars in the trackers of --report_to (plumbing/tracking.py). `saved`: resume.new_run() or the record of the
    run being resumed."""

    def __init__(self, saved: dict, trackers=None, fp16: bool = False):
        self.losses, self.grad_norms = list(saved["losses"]), list(saved["grad_norms"])
        self.terms = {name: list(values) for name, values in saved.get("terms", {}).items()}  # the loss's terms
        self.trajectory, self.resumptions = list(saved["trajectory"]), list(saved["resumptions"])
        self.skipped = list(saved.get("skipped", []))  # fp16: steps whose update the GradScaler skipped
        self.pending, self.trackers, self.fp16 = [], trackers, fp16
        if trackers is not None:  # a resumed run: its record so far, where a tracker lacks it
            trackers.log_record(self.losses, self.grad_norms, self.terms, self.trajectory)

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor, terms: dict | None = None) -> None:
        self.term_names = list(terms or {})  # the same each step
        values = [loss.detach(), grad_norm, *(terms or {}).values()]
        self.pending.append(torch.stack([value.float() for value in values]))

    def read(self) -> None:
        """The pending steps' values as floats: one host sync. The first NaN or inf loss stops the run with its
        step; under fp16 a step whose loss or gradients are not finite is one the GradScaler skipped (`skipped`), and
        the run stops when the FP16_SKIP_LIMIT latest steps were all skipped."""
        if not self.pending:
            return
        values = torch.stack(self.pending).tolist()
        self.pending.clear()
        for step, (loss, grad_norm, *parts) in enumerate(values, start=len(self.losses) + 1):
            if self.fp16 and not (math.isfinite(loss) and math.isfinite(grad_norm)):
                self.skipped.append(step)
            elif not math.isfinite(loss):
                raise Stopped(f"the loss became {loss} at step {step}: the run diverged (a lower --lr may help)",
                              "divergence", step)
            self.losses.append(loss)
            self.grad_norms.append(grad_norm)
            terms = dict(zip(self.term_names, parts))
            for name, value in terms.items():  # None before a term was recorded (an older last/)
                self.terms.setdefault(name, [None] * (step - 1)).append(value)
            self.scalars(step, {"train/loss": loss, "train/grad_norm": grad_norm,
                                **{f"train/{name}": value for name, value in terms.items()}})
        last = len(self.losses)
        if self.fp16 and last >= FP16_SKIP_LIMIT and self.skipped[-FP16_SKIP_LIMIT:] == list(
                range(last - FP16_SKIP_LIMIT + 1, last + 1)):
            raise Stopped(f"the {FP16_SKIP_LIMIT} steps up to step {last} were all skipped: their loss or gradients "
                          "were not finite under fp16, whatever the GradScaler's scale; fp16's range is the likely "
                          "cause (try --precision bf16), else divergence (a lower --lr)", "fp16 overflow", last)

    def record(self, point: dict) -> None:
        """A trajectory row: {"step", "train_time_s", "lr"} and, where STS-B dev was encoded, {"stsb_dev", "align",
        "uniform", "gate"}."""
        self.trajectory.append(point)
        if self.trackers is not None:
            self.trackers.log_record([], [], {}, [point])

    def scalars(self, step: int, values: dict) -> None:
        if self.trackers is not None:
            self.trackers.scalars(step, values)


class Run:
    def __init__(self, args, resumable: bool = True):
        """Every flag against its meaning, the device and the output folder (writable, not in use by another run,
        holding what the command asks for), before any work; --count_host_syncs and --deterministic set up; the
        seeds; under torchrun the process group. `resumable`: writes last/."""
        device = options.check_args(args)
        if os.environ.get("RANK", "0") == "0":  # process 0 holds the folder's lock for the run's processes
            lock.check_free(args.output_dir)
        self.folder_state = outdir.check(args)  # --auto_resume: start, resume, or finish the final evaluation
        syncs.WINDOW = syncs.StepWindow(args.count_host_syncs, device)
        if args.deterministic:
            options.deterministic_algorithms()
        transformers.set_seed(args.seed)
        self.args, self.resumable, self.started = args, resumable, provenance.now()
        self.device = distributed.init(device)
        self.best_dev, self.best_step, self.gate_step = -math.inf, None, None
        self.encoder_notes, self.fitted = [], None  # check_encoder's (--fit_memory's record)
        self.graphs_captured = 0  # CUDA graphs of the step (--cuda_graph's record)

    def check_encoder(self, backbone, tokenizer, attentions: bool = False, layers: bool = False,
                      mlm_head: bool = False) -> tuple[bool, dict]:
        """What the method needs of the loaded encoder, before any training (plumbing/backbones.py): one line where it
        cannot work (attention weights, a layer list, an MLM head). (Whether a training pass may give it the prebuilt
        4-D mask (common.BackboneWithHeads's prebuilt_mask), the settings it switches on), the settings for main() to
        assign: --dropout 0.1 for a model without dropout, --fit_memory's choice (a resumed run's: its start's). The
        backbone's layers are made to checkpoint where --gradient_checkpointing is on or switched on. The run summary
        says what was switched on."""
        args = copy.copy(self.args)  # the checks set their choices on a copy: main() assigns them
        prebuilt, self.encoder_notes = backbones.check(
            backbone, tokenizer, args, lambda mask: common.attention_mask_4d(
                mask, backbone.config._attn_implementation), attentions, layers, mlm_head)
        saved = (resume.started_args(args.output_dir) if args.resume else None) or {}
        if args.fit_memory or saved.get("fit_memory"):  # before the flags take effect
            note, self.fitted = memory.fit(args, backbone.config, self.device, distributed.world_size(),
                                           saved if args.resume else None, distributed.smallest)
            if note:
                distributed.log(note)
        if args.gradient_checkpointing:  # recomputed in the backward pass, dropout replayed
            backbones.checkpoint_layers(backbone, args.model_name_or_path)
        return prebuilt, {k: v for k, v in vars(args).items() if getattr(self.args, k) != v}

    def start(self, loader, total_steps: int, encode, modules, train_file, subset, **state) -> None:
        """Before the first step: SentEval's files read (process 0 first: senteval.tar), the run's summary, the
        output folder, the stop signal, and `state` (what last/ saves: the models, optimiser, schedule, scaler,
        generators) restored from last/ under --resume, the RNG streams last of all."""
        args = self.args
        with distributed.main_process_first():  # every SentEval file read once: a bad one stops the run now
            self.senteval_dir = eval_sts.resolve_senteval_dir(args.senteval_dir, check=eval_sts.TASKS,
                                                            offline=hub.LOCAL_FLAGS)
            if args.eval_transfer:  # the transfer tasks' files too, before training
                import eval_transfer
                for task in eval_transfer.TASKS:
                    eval_transfer.load_task(self.senteval_dir, task)
        self.dev_set = eval_sts.DevGate(self.senteval_dir, encode)  # STS-B dev tokenised once
        self.loader, self.total_steps, self.encode = loader, total_steps, encode
        self.modules = [m for m in modules if m is not None]  # switched to eval mode at the dev gates
        self.state, self.scheduler = state, state["scheduler"]
        self.data = {"train_file": train_file, "micse_subset": subset, "num_train_examples": len(loader.dataset)}
        self.summary = summary(args, self.data, len(loader), total_steps, self.device, self.encoder_notes)
        self.provenance = provenance.collect(self.device, args.precision, distributed.world_size(), self.started)
        self._take_folder(state)
        try:
            self._restore(loader, total_steps, state)
        except BaseException:  # a refused run (its arguments against last/'s, say) leaves no .lock behind
            lock.release(args.output_dir)
            raise

    def _restore(self, loader, total_steps: int, state: dict) -> None:
        """start's second half, in the folder it holds: the memory check, the stop signal, and the record and `state`
        of the run being resumed (or a new run's)."""
        args = self.args
        evaluating = self.folder_state == "evaluating"  # the training ended: the final evaluation alone
        measured = (self.fitted or {}).get("free_gib") is not None  # --fit_memory has weighed this GPU already
        if state.get("backbone") is not None and not evaluating and not measured:  # its peak against its free memory
            note = memory.check_device(args, state["backbone"].config, self.device, distributed.world_size())
            if note:  # too little free memory, or no estimate for this model (one line either way)
                distributed.log(note)
        self.stop = distributed.StopSignal()
        saved = resume.restore(args, state, loader, self.device, evaluating) if args.resume else resume.new_run()
        if evaluating and saved["next_step"] != total_steps + 1:
            raise plumbing.UsageError(f"--resume: the run in {args.output_dir} trained {saved['next_step'] - 1} "
                                      f"steps, this command plans {total_steps}: its data or schedule (--train_file's "
                                      "lines, --fraction, --epochs, --max_steps) differ; resume it with its own")
        # the evaluation alone: the record keeps where the training ran (device, processes, peak memory, summary) and
        # holds this process's own beside it (_results)
        self.trained = saved.get("trained") if evaluating else None
        self.evaluation_alone = {"device": str(self.device), "world_size": distributed.world_size(),
                                 "device_name": self.provenance["device_name"]} if evaluating else None
        if args.resume:  # each part's commit and start
            self.provenance = provenance.resumed(saved.get("provenance"), self.provenance, saved["next_step"] - 1)
        if evaluating:  # the training's device and processes, as the model card names them
            self.provenance.update({k: v for k, v in (saved.get("provenance") or {}).items()
                                    if k in ("device_name", "processes")})
        # the trackers first: one that cannot start stops the run before the folder says a run started
        trackers = tracking.Trackers(args, distributed.rank() == 0, saved["next_step"] if args.resume else None,
                                     saved.get("tracking"), {"args": vars(args), "provenance": self.provenance})
        if not args.resume and distributed.rank() == 0:  # which run this folder holds (--auto_resume reads it)
            files.write_json(Path(args.output_dir) / resume.STARTED, {"args": vars(args)})
        self.best_dev, self.best_step, self.train_time = saved["best_dev"], saved["best_step"], saved["train_time"]
        self.next_step, self.saved_at = saved["next_step"], self.train_time  # the training time at the last save
        self.last_step = self.next_step - 1  # the last step done
        self.best_copy = None  # the best model so far, on the training device, until best/ is written (flush_best)
        self.best_pending = False  # a best_copy newer than best/
        self.best_written = saved["best_step"] if args.resume else None  # the step of the model best/ holds
        plumbing.on_out_of_memory(self.out_of_memory)  # what plumbing.cli calls if the device runs out of memory
        self.current_step, self.in_step, self.final_results = self.last_step, False, None  # (out_of_memory's)
        # of best/, for its model card and results.json; a resumed run's are its record's (or best/'s, for a last/ of
        # an earlier version) until it finds a new best
        self.eval_pooler = (saved.get("eval_pooler") or files.recorded_pooler(Path(args.output_dir) / "best")) \
            if args.resume else None
        self.projection = False
        self.checkpoint_time = saved.get("checkpoint_time") or {
            "best_copies": 0, "best_copy_s": 0.0, "best_writes": 0, "best_write_s": 0.0, "last_writes": 0,
            "last_write_s": 0.0}
        self.history = History(saved, trackers, fp16=args.precision == "fp16")
        self.bar = progress.Progress(total_steps, "training", "step", distributed.rank() == 0, leave=True,
                                     initial=len(self.history.losses))

    def _take_folder(self, state: dict) -> None:
        """The output folder made and locked by process 0, its state checked again under the lock (another process
        may have written it since the check), --overwrite_output_dir's old run cleared, and room for the saves."""
        args, out = self.args, Path(self.args.output_dir)
        with files.failed_write(out):
            out.mkdir(parents=True, exist_ok=True)
        if distributed.rank() != 0:
            return
        self.lock = lock.hold(out, self.started)
        try:
            if outdir.state(out)[0] != self.folder_state:
                raise plumbing.UsageError(f"--output_dir {out} changed while this run started (another process "
                                          "wrote it); run the command again")
            if args.overwrite_output_dir:
                outdir.clear(out)
            checkpoint.recover(out)  # best/ of the last complete save, if a kill came between its two renames
            modules = [m for m in state.values() if isinstance(m, torch.nn.Module)]
            trained = memory.nbytes(*[p for m in modules for p in m.parameters() if p.requires_grad])
            best = memory.nbytes(state.get("backbone"), state.get("head"), state.get("projection"))
            outdir.check_room(out, best, memory.nbytes(*modules) + 2 * trained)  # AdamW: two moments
        except BaseException:  # a refused run leaves no .lock behind
            lock.release(out)
            raise

    def steps(self):
        """The steps from 0 (only the initial model's dev gate) or where --resume continues, to the last; between
        two, the log, the trajectory, last/ and the stop signal. A signal ends it after the step it came in."""
        self.clock = time.perf_counter()
        for step in range(self.next_step, self.total_steps + 1):
            self.current_step, self.in_step = step, True  # until record(): its training part (out_of_memory's)
            yield step
            self.last_step = step
            if self._after(step):
                break
        self.bar.close()

    def record(self, loss: torch.Tensor, grad_norm: torch.Tensor, terms: dict | None = None) -> None:
        """A step's loss and gradient norm (and `terms`: {name: the loss's weighted term}, e.g. miCSE's "ami"), kept
        on the device until the next log step; the step is queued."""
        self.history.add(loss, grad_norm, terms)
        self.in_step = False
        syncs.end_step()  # --count_host_syncs' window closes
        self.bar.update()  # a clock read

    def dev_gate(self, step: int) -> float:
        """STS-B dev at a dev gate (dev_measures: eval mode, fp32, one encoding, with l_align / l_uniform),
        after the steps so far are done (their time is the training time): the score (-inf where undefined)."""
        self._read()
        self.measures, self.gate_step = dev_measures(self.modules, self.encode, self.dev_set), step
        return self.measures["stsb_dev"]

    def save_best(self, step: int, backbone, head, tokenizer, eval_pooler: str, projection=None) -> None:
        """The model of this dev gate is the best so far: its score and step kept, and a copy of it (BestCopy, into
        buffers allocated at the first improvement); best/ is written from it when last/ is saved, when the run
        stops and at the end (flush_best), so that a run whose dev score keeps improving writes it once."""
        self.best_dev, self.best_step = self.measures["stsb_dev"], step
        self.eval_pooler, self.projection = eval_pooler, projection is not None
        if distributed.rank() == 0:
            start = time.perf_counter()
            if self.best_copy is None:
                self.best_copy = checkpoint.BestCopy(backbone, head, tokenizer, eval_pooler, projection)
            else:
                self.best_copy.update(backbone, head, projection)
            self.checkpoint_time["best_copies"] += 1
            self.checkpoint_time["best_copy_s"] += time.perf_counter() - start
        self.best_pending = True

    def flush_best(self) -> None:
        """best/ written from the device copy, if a newer one is there (every process takes part: a barrier)."""
        if not self.best_pending:
            return
        start = time.perf_counter()
        if self.best_copy is not None:  # process 0
            self.best_copy.write(self.args.output_dir, self.card())
        distributed.barrier()
        self.best_pending, self.best_written = False, self.best_step
        self.checkpoint_time["best_writes"] += 1
        self.checkpoint_time["best_write_s"] += time.perf_counter() - start

    def card(self, test: dict | None = None, untested: str | None = None) -> str:
        """best/README.md: the model card (plumbing/provenance.py), with the STS test scores once they exist, or why a
        run that ended has none (`untested`)."""
        sentence_transformers = not self.projection and files.pooling_mode(self.eval_pooler) is not None
        return provenance.model_card(self.args, self.eval_pooler, self.provenance,
                                     {"step": self.best_step, "stsb_dev": self.best_dev, "test": test},
                                     sentence_transformers, untested)

    def _rewrite_card(self, test: dict | None = None, untested: str | None = None) -> None:
        """best/README.md once the run has ended (process 0): its test scores, or why it has none."""
        best = Path(self.args.output_dir) / "best"
        if best.is_dir():  # a resumed run too, with or without a new best
            self.projection = self.projection or (best / files.PROJECTION_FILE).is_file()
            files.write_text(best / "README.md", self.card(test, untested))

    def sentences(self, task: str, split: str = "test") -> list[str]:
        """The distinct sentences of a SentEval task's split, sorted (SSCL's SetSim reads STS-B test's)."""
        return sorted({s for pair in eval_sts.load_pairs(self.senteval_dir, task, split) for s in pair[:2]})

    # --------------------------------------------------------------------------------------------- between steps
    def _read(self) -> None:
        """The steps' losses and gradient norms read from the device (History.read: one host sync), and the training
        time up to here. A run that stops itself (a divergence, fp16's overflow) keeps what it had: best/ from its
        copy, results.json with the record up to the stop and its reason; then the one line, exit status 2."""
        try:
            self.history.read()
        except Stopped as stopped:
            self.flush_best()
            if distributed.rank() == 0:
                self._record_stop(stopped.by, stopped.step, str(stopped))
                distributed.log(f"stopped: best/ holds step {self.best_step}'s model (STS-B dev "
                                f"{self.best_dev:.2f}); {Path(self.args.output_dir) / 'results.json'} records the run "
                                "up to the stop")
            raise
        if self.clock is not None:  # the device has finished every step up to here
            self.train_time += time.perf_counter() - self.clock
            self.clock = None

    def _after(self, step: int) -> bool:
        """After a step: at a log step the log line and a trajectory row; last/ at a dev gate, every --save_steps and
        when a signal stops the run. Whether the run stops here."""
        args = self.args
        gate = self.gate_step == step
        align_step = bool(args.align_uniform_steps) and step % args.align_uniform_steps == 0
        every_save = bool(args.save_steps) and step > 0 and step % args.save_steps == 0
        log_step = gate or align_step or every_save or step % args.logging_steps == 0
        stopping = self.stop.requested()  # several processes: all at the same step, the one after a signal's
        if not (log_step or stopping):
            return False
        self._read()
        message = progress_line(step, self.total_steps, self.history.losses, self.train_time)
        if self.history.skipped:  # fp16
            message += f"  skipped {len(self.history.skipped)} (fp16 overflow; the GradScaler lowers its scale)"
        # lr: what the scheduler set for the next step (as the HF Trainer logs it; --cuda_graph: a device tensor)
        point = {"step": step, "train_time_s": round(self.train_time, 3), "lr": float(self.scheduler.get_last_lr()[0])}
        if gate:
            point.update(self.measures, gate=True)
            message += f"  STS-B dev {self.measures['stsb_dev']:.2f}  best {self.best_dev:.2f} " \
                       f"(step {self.best_step})"
        elif align_step:  # STS-B dev encoded between the gates, for the trajectory's l_align / l_uniform
            point.update(dev_measures(self.modules, self.encode, self.dev_set), gate=False)
        self.history.record(point)
        # last/ at a dev gate once --save_minutes of training have passed since the last save (the processes agree)
        due = gate and self.train_time - self.saved_at >= 60 * args.save_minutes
        due = distributed.broadcast_float(float(due)) > 0 if gate else False
        kept = args.keep_last and step == self.total_steps  # --keep_last: the final state
        if stopping or (self.resumable and (due or every_save or kept)):
            self.flush_best()  # best/ and last/'s record agree
        if self.resumable and (due or stopping or every_save or kept):  # written whole or not at all
            start = time.perf_counter()
            loop = {"best_dev": self.best_dev, "best_step": self.best_step, "train_time": self.train_time,
                    "checkpoint_time": self.checkpoint_time, "provenance": self.provenance,
                    "total_steps": self.total_steps, "eval_pooler": self.eval_pooler,
                    "tracking": self.history.trackers.ids}
            resume.save(args, step, self.state, self.loader, self.history, loop)
            self.saved_at = self.train_time
            self.checkpoint_time["last_writes"] += 1
            self.checkpoint_time["last_write_s"] += time.perf_counter() - start
        if not self.resumable or due or stopping or every_save or kept:  # W&B and MLflow: what no resume trains again
            self.history.trackers.release()
        distributed.log(message)
        losses = self.history.losses  # read at log steps only: the last one's step named
        self.bar.set_postfix(loss=f"{losses[-1]:.4g} (step {len(losses)})" if losses else None, best_dev=self.best_dev)
        self.clock = time.perf_counter()  # the dev gate and the log are not training time
        self.bar.unpause()  # nor in the bar's speed and ETA
        return stopping

    # ------------------------------------------------------------------------------------------------ the end
    def evaluate_best(self, eval_pooler: str, **extra) -> dict | None:
        """The end of a run. best/ written from its copy; the processes part (the others exit: process 0's long final
        evaluation holds nobody in a barrier); on process 0 the run's record, written to results.json before the final
        evaluation when the training ran to its end (so that a stop or a kill in that evaluation loses nothing:
        --auto_resume runs the evaluation alone), then best/ reloaded as eval_sts.py loads it and evaluated: the 7 STS
        test tasks (SimCSE's Table 5 protocol), l_align / l_uniform of it and of the pretrained model, --eval_transfer.
        A signal stops it, and results.json records that. None on the other processes."""
        self.stop.phase = "writing best/"  # a signal now lets best/ be written whole, then stops the run
        self.flush_best()
        self.stop.settle()  # every process the same stop, whichever got the signal
        self._free_training_memory()
        self.best_copy = None
        distributed.shutdown()
        if distributed.rank() != 0:
            return None
        args, out = self.args, Path(self.args.output_dir)
        self.eval_pooler = self.eval_pooler or eval_pooler
        results = self.final_results = self._results(eval_pooler, **extra)  # out_of_memory keeps what it holds
        if self.last_step < self.total_steps:  # a signal stopped the training: last/ holds it
            return results
        if self.best_step is None:  # every dev gate's score undefined: no model was kept
            distributed.log("no best/: every dev gate's STS-B dev was undefined (null); nothing to evaluate")
            return results
        # the training ended: if anything stops the evaluation, results.json says it is what remains
        results.update(interrupted=True, interrupted_during="final evaluation")
        self._write_results(results)
        self.history.trackers.release()  # the training's record stands now
        with self.stop.final_evaluation(results):  # a signal now stops it; results.json records that
            if self.stop.signum is None:  # else it came while best/ was written
                wanted = not (args.no_test_eval and args.no_align_uniform) or args.eval_transfer
                if wanted:
                    distributed.log(f"best STS-B dev {self.best_dev:.2f} at step {self.best_step}; evaluating it")
                    encode = eval_sts.load_encode(str(out / "best"), eval_pooler, self.device)
                if not args.no_test_eval:
                    results["test"] = eval_sts.evaluate(encode, self.senteval_dir, mode="test")
                    eval_sts.print_table(results["test"])
                if not args.no_align_uniform:  # the pretrained encoder under the evaluation pooler (not a fresh head)
                    initial = eval_sts.load_encode(args.model_name_or_path, "cls_before_pooler" if eval_pooler == "cls"
                                                   else eval_pooler, self.device)
                    results["align_uniform"] = {
                        "initial": eval_sts.align_uniform(initial, self.senteval_dir,
                                                          desc="initial model: alignment/uniformity"),
                        "best": eval_sts.align_uniform(encode, self.senteval_dir)}
                if args.eval_transfer:  # what is done so far first: an error in this long evaluation loses nothing
                    self._write_results(results)
                    import eval_transfer
                    results["transfer"] = eval_transfer.evaluate(encode, self.senteval_dir, mode=args.eval_transfer,
                                                                 device=self.device)
                    eval_sts.print_table(results["transfer"])
                results["interrupted"] = False
                del results["interrupted_during"]
        return results

    def _free_training_memory(self) -> None:
        """What only training needs, freed before the final evaluation loads best/ and the pretrained model beside the
        trained one (then the best model's copy goes too: on a GPU, four times the weights in all; plumbing/memory.py
        counts the evaluation's peak so), or before best/ is written after an out-of-memory stop: the gradients,
        AdamW's moments and the CUDA graph's memory pool."""
        self.graphs_captured += graph.release()
        for thing in self.state.values():
            if isinstance(thing, torch.optim.Optimizer):
                thing.zero_grad(set_to_none=True)
                thing.state.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def out_of_memory(self, reason: str) -> str:
        """The device ran out of memory (plumbing.cli calls this once main() has unwound and the failed pass's tensors
        are freed). Kept as when the run stops itself: the training state freed, best/ written from its copy where
        memory now allows (no barrier: the other processes may be gone), results.json with the record up to the stop
        and "stop": {"by": "out of memory", "step", "reason"} (process 0). The one line's rest: where, what was kept,
        how the run goes on (--auto_resume first)."""
        plumbing.on_out_of_memory(None)
        out = Path(self.args.output_dir)
        evaluation = self.stop.phase != "training" and self.last_step >= self.total_steps and not self.best_pending
        step = self.last_step if evaluation else self.current_step
        where = f"in step {step}" if self.in_step and not evaluation else f"after step {step}"
        self._free_training_memory()
        unwritten = ""
        if self.best_pending and self.best_copy is not None:  # process 0
            try:
                self.best_copy.write(out, self.card())
                self.best_pending, self.best_written = False, self.best_step
            except (torch.OutOfMemoryError, plumbing.UsageError) as err:
                unwritten = f" (step {self.best_step}'s, better, could not be written: {str(err).splitlines()[0]})"
        self.best_copy = None
        if distributed.rank() == 0:
            with contextlib.suppress(Exception):  # the steps the device still holds (a NaN among them: up to it)
                self.history.read()
            self._record_stop("out of memory", step, reason, self.final_results if evaluation else None)
        if evaluation:
            return f"in the final evaluation ({reason}): best/ and results.json hold the training; " \
                   f"{outdir.next_step(True)}, without the training's memory"
        best = f"best/ holds step {self.best_written}'s model{unwritten}" if self.best_written is not None else \
            f"no best/ yet{unwritten}"
        last = resume.folder(out) is not None
        kept = f"{best}, last/ the run {resume.how_far(out)}" if last else best
        return f"{where} ({reason}): {kept}, results.json the record up to the stop; to " \
               f"{'continue it' if last else 'start it again'} in less memory, run the same command with " \
               "--auto_resume --gradient_checkpointing (the same objective; --micro_batch_size K too, in a new run: " \
               "python tools/bench.py --memory says what each needs)"

    def _record_stop(self, by: str, step: int, reason: str, results: dict | None = None) -> None:
        """A run that stopped itself or ran out of memory, recorded (process 0): results.json with the record up to
        the stop (`results`: what the final evaluation had) and "stop": {"by", "step", "reason"}, best/'s card saying
        why it has no test scores, and the folder's lock given back: the run has ended."""
        evaluation = results is not None
        results = results if evaluation else self._results(self.eval_pooler or "cls_before_pooler")
        results.update(interrupted=True, interrupted_during="final evaluation" if evaluation else "training",
                       stop={"by": by, "step": step, "reason": reason})
        self._write_results(results)
        if not evaluation:
            self._rewrite_card(untested=f"the run stopped itself at step {step} ({by})" if by in outdir.SELF_STOPS
                               else f"the run stopped at step {step} ({by})")
        # its tracked runs marked stopped; the steps since last/ sent unless a resume trains them again (out of memory)
        self.history.trackers.finish(results, release=evaluation or by in outdir.SELF_STOPS)
        lock.release(self.args.output_dir)

    def write(self, results: dict | None) -> None:
        """results.json (process 0) with its provenance's end time, best/'s model card with the test scores, the
        numbers in context, last/ deleted (a completed run needs it no more, unless --keep_last); where a signal
        stopped the run, how it goes on (--auto_resume), then exit 130 / 143."""
        self.stop.phase = "writing results.json"
        if results is not None:
            out = Path(self.args.output_dir)
            results["provenance"]["ended"] = provenance.now()
            if "evaluation_alone" in results:  # its peak, the evaluation done
                results["evaluation_alone"].update(peak_memory(self.device))
            if self.history.trackers.names:  # complete once they have finished (else --auto_resume finishes them)
                results["tracking_unfinished"] = self.history.trackers.names
            self._write_results(results)
            if results.get("test") or not results["interrupted"]:
                self._rewrite_card(results.get("test"), None if results.get("test") else "the run was given "
                                   "--no_test_eval")
            resume.drop(self.args, results)
            self.history.trackers.finish(results)  # the test scores, the tracked runs closed
            if results.pop("tracking_unfinished", None):
                self._write_results(results)
            distributed.log(in_context(results))
            distributed.log(f"wrote {out / 'results.json'} (best checkpoint: {out / 'best'})")
            if getattr(self.args, "hub_model_id", None) and not results["interrupted"]:
                distributed.log(f"to share it: hf upload {self.args.hub_model_id} {out / 'best'} .")
            if results["interrupted"] and self.resumable:  # a signal stopped it: how it goes on, last
                evaluation = results.get("interrupted_during") == "final evaluation"
                where = "during the final evaluation" if evaluation else \
                    f"after step {self.last_step} of {self.total_steps} (last/ holds it)"
                distributed.log(f"stopped {where}: {outdir.next_step(evaluation)}")
        lock.release(self.args.output_dir)
        plumbing.on_out_of_memory(None)
        self.stop.exit_if_stopped()

    def _write_results(self, results: dict) -> None:
        files.write_json(Path(self.args.output_dir) / "results.json", results)

    def _results(self, eval_pooler: str, **extra) -> dict:
        """results.json before the final evaluation: the method, every argument, where and how it ran, what the
        loop measured, peak memory, and whether a signal stopped the training."""
        args, device, history = self.args, self.device, self.history
        results = {"method": args.method, "args": {k: v for k, v in vars(args).items() if k != "method"},
                   "device": str(device), "world_size": distributed.world_size(), "precision": args.precision,
                   "eval_pooler": eval_pooler, "summary": self.summary, **self.data, **extra,
                   "best_dev_stsb": self.best_dev, "best_step": self.best_step,
                   "steps": len(history.losses), "train_loss": history.losses, "grad_norm": history.grad_norms,
                   **({"train_terms": history.terms} if history.terms else {}),
                   "trajectory": history.trajectory, "resumptions": history.resumptions,
                   "skipped_steps": history.skipped,
                   "train_time_s": round(self.train_time, 2),
                   "checkpoint_time_s": {k: round(v, 3) if isinstance(v, float) else v
                                         for k, v in self.checkpoint_time.items()},
                   "steps_per_second": round(len(history.losses) / self.train_time, 3) if self.train_time else 0.0,
                   **peak_memory(device), "interrupted": self.stop.signum is not None,
                   "provenance": dict(self.provenance), "tracking": history.trackers.ids,
                   **({"fit_memory": self.fitted} if self.fitted else {}),
                   **({"cuda_graphs": self.graphs_captured} if getattr(args, "cuda_graph", False) else {})}
        if args.count_host_syncs:
            results["host_syncs"] = syncs.WINDOW.record()
        if self.stop.signum is not None:
            results["interrupted_during"] = "training"
            results["stop"] = {"by": signal.Signals(self.stop.signum).name, "step": self.last_step}
        if self.evaluation_alone is not None:  # an evaluation-only resume: the training's values stay the record's
            results["evaluation_alone"] = dict(self.evaluation_alone)  # its own peak: once it has run (write)
            for key in resume.TRAINING_RECORD:
                if key in (self.trained or {}):
                    results[key] = self.trained[key]
                else:
                    results.pop(key, None)
        return results


def peak_memory(device) -> dict:
    """This process's peak memory so far: CUDA's allocated (and reserved) bytes on a GPU, else the CPU's max RSS."""
    if device.type == "cuda":
        return {"peak_memory_mb": round(torch.cuda.max_memory_allocated(device) / 2**20, 1),
                "peak_memory_kind": "cuda_max_allocated",
                "peak_memory_reserved_mb": round(torch.cuda.max_memory_reserved(device) / 2**20, 1)}
    return {"peak_memory_mb": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) / 2**20, 1),
            "peak_memory_kind": "cpu_max_rss"}


def dev_measures(modules, encode, dev_set) -> dict:
    """The dev gate, on process 0 (every process gets the score): STS-B dev in eval mode and fp32, one encoding (the
    metric of eval_sts.py; `dev_set`: eval_sts.DevGate): {"stsb_dev": Spearman x 100, "align", "uniform"}. An undefined
    Spearman (scipy's NaN) is -inf: never above the best so far, not even the first gate's; results.json's null."""
    measures = {"stsb_dev": math.nan}
    if distributed.rank() == 0:
        for m in modules:
            m.eval()
        measures = dev_set(encode)
        if not math.isfinite(measures["stsb_dev"]):  # constant or NaN cosines have no Spearman
            distributed.log("note: the STS-B dev score is undefined (constant or NaN embeddings: a collapsed or "
                            "diverged model); recorded as null, this model is never the best")
            measures["stsb_dev"] = -math.inf
        for m in modules:
            m.train()
    measures["stsb_dev"] = distributed.broadcast_float(measures["stsb_dev"])
    return measures


def progress_line(step: int, total_steps: int, losses: list, train_time: float) -> str:
    """The log line: step, loss, training speed and the training time left at that speed (dev gates aside)."""
    if not losses:  # step 0: nothing trained yet
        return f"step {step}/{total_steps}"
    rate = step / max(train_time, 1e-9)
    left = f"  ETA {progress.duration((total_steps - step) / rate)}" if step < total_steps else ""
    return f"step {step}/{total_steps}  loss {losses[-1]:.4f}  {rate:.2f} steps/s{left}"


def summary(args, corpus: dict, steps_per_epoch: int, total_steps: int, device, encoder_notes=()) -> dict:
    """What this run is, printed before training and kept in results.json: the presets and their source, the data
    (and whether it is miCSE's released subset), the model and what its check found (the attention and its mask,
    dropout), device and precision, what changes a step's memory and time (--micro_batch_size,
    --gradient_checkpointing, --compile, --pad_to_max_length), the schedule, the output folder."""
    num, subset, train_file = corpus["num_train_examples"], corpus["micse_subset"], corpus["train_file"]
    if subset:
        text = f"miCSE's released subset {subset}: {num:,} examples (Table 2's data)"
    elif args.fraction < 1:
        text = f"{num:,} examples, a {args.fraction:g} subset of {train_file} drawn with --seed {args.seed}"
        released = data.micse_subset(args.fraction, args.seed)
        if released:  # a --train_file of another name
            text += f" (not the authors' subset: a local copy is read whole under its name, {released})"
        elif args.fraction in data.MICSE_SUBSETS:
            text += " (not the authors' subset: theirs are --seed 48-52)"
        elif not getattr(args, "supervised", False):  # miCSE released subsets of wiki1m, not of NLI
            text += " (not the authors' subset: theirs are --fraction " + \
                    ", ".join(f"{f:f}".rstrip("0") for f in data.MICSE_SUBSETS) + " with --seed 48-52)"
    else:
        text = f"{num:,} examples from {train_file}"
    chosen = args.presets or {"source": options.NO_PRESETS, "applied": {}, "overridden": {}}  # options.parse's
    presets = chosen["source"]
    if chosen["applied"]:
        presets += ": " + ", ".join(f"{k} {v}" for k, v in chosen["applied"].items())
    if chosen["overridden"]:
        presets += "; your flags replaced " + ", ".join(f"{k} (now {v})" for k, v in chosen["overridden"].items())
    k = args.micro_batch_size  # what changes the memory and the time of a step, beside the batch
    execution = [f"--micro_batch_size {k} (GradCache: the whole batch's loss, {k} examples encoded at a time)"] \
        if k else []
    execution += ["--gradient_checkpointing (each layer recomputed in the backward pass)"] \
        if args.gradient_checkpointing else []
    execution += ["--compile (torch.compile)"] if args.compile else []
    execution += ["--cuda_graph (the step replayed from one CUDA graph after 3 eager ones)"] \
        if getattr(args, "cuda_graph", False) else []
    execution += [f"--pad_to_max_length (every batch {args.max_seq_length} tokens wide: one shape)"] \
        if args.pad_to_max_length else []
    model = f"{args.backbone} ({args.backbone_config})" if args.backbone else \
        f"{args.backbone_config}: no preset for this backbone, the BERT-base settings"
    if getattr(args, "ami_min_layer", None) is not None:  # miCSE's layers, scaled to this encoder's depth
        model += f"; AMI on attention layers {args.ami_min_layer}:{args.ami_max_layer} (0-based, the end excluded)"
    result = {"presets": presets, "backbone": model, "data": text,
              "model": f"{args.model_name_or_path}, trained with pooler {args.pooler}, evaluated with "
                       f"{common.eval_pooler(args)}",
              **({"encoder": "; ".join(encoder_notes)} if encoder_notes else {}),
              "device": f"{device} x {distributed.world_size()}, precision {args.precision}",
              "execution": "; ".join(execution) or "the whole batch in one pass, eager, padded to its longest row "
                                                  "(no --micro_batch_size, --gradient_checkpointing, --compile or "
                                                  "--pad_to_max_length)",
              "schedule": f"{total_steps:,} steps ({steps_per_epoch:,} an epoch), batch {args.batch_size}, lr "
                          f"{args.lr:g}, STS-B dev every {args.eval_steps} steps; the ETA comes with the first log "
                          "line" + (f"; note: --warmup_steps {args.warmup_steps} is not below the run's "
                                    f"{total_steps:,} steps: its lr never leaves the warm-up (give --warmup_steps)"
                                    if getattr(args, "warmup_steps", 0) >= total_steps else ""),
              "output": args.output_dir}
    distributed.log("\n".join([args.method] + [f"  {key:<9} {value}" for key, value in result.items()]))
    return result


def in_context(results: dict) -> str:
    """The run's numbers beside their starting points: STS-B dev of the initial checkpoint and of the best, the
    STS test average, and l_align / l_uniform of the pretrained model and of the best checkpoint."""
    gates = [row for row in results["trajectory"] if row.get("gate")]
    lines = ["in context:"]
    if gates and gates[0]["step"] == 0:
        lines.append(f"  STS-B dev  initial {gates[0]['stsb_dev']:.2f} -> best {results['best_dev_stsb']:.2f} "
                     f"(step {results['best_step']})")
    else:
        lines.append(f"  STS-B dev  best {results['best_dev_stsb']:.2f} (step {results['best_step']})")
    if "test" in results:
        lines.append(f"  STS test   7-task average {results['test']['avg']:.2f}")
    if "align_uniform" in results:
        a, b = results["align_uniform"]["initial"], results["align_uniform"]["best"]
        lines.append(f"  align / uniform  initial {a['align']:.4f} / {a['uniform']:.4f} -> best "
                     f"{b['align']:.4f} / {b['uniform']:.4f} (lower is better)")
    if results.get("interrupted"):
        lines.append(f"  interrupted during the {results.get('interrupted_during', 'training')}")
    return "\n".join(lines)
