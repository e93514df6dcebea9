"""SimCSE++: Improving Contrastive Learning for Sentence Embeddings from Two Perspectives (Xu et
al., EMNLP 2023).

Two changes to SimCSE's loss: (1) off-dropout sampling: the negatives come from a third pass of the
batch with every dropout switched off, since dropout noise helps positives but hurts negatives
(Section 3, Eq. 3); (2) dimension-wise contrastive learning (DCL): each embedding dimension should
be more similar to itself across the two views than to the other dimensions (Section 4.3, Eq. 5).

Headline (Table 3, BERT-base, 7-task STS average): SimCSE 76.25 -> SimCSE++ 78.05 (off-dropout alone
77.13, DCL alone 77.40).

    python simcsepp.py                                  # m 0.9, DCL weight 0.1, DCL temperature 5
    python simcsepp.py --no_off_dropout                 # Table 3 "+DCL" row
    python simcsepp.py --dcl_weight 0                   # Table 3 "+Off-Info" row
    python simcsepp.py --dcl_only                       # Table 4 "+DCL(wiki)": DCL alone
    python simcsepp.py --no_off_dropout --m 1 --dcl_temp 10  # models_vicreg.py's DCL SimCSE

Backbone presets, read from the model's config; flags the user gives win: lr 3e-5 for base
models and 8e-6 for BERT-large and RoBERTa-large, batch 64 (Section 5.1).

Follows the authors' code where it differs from the paper's equations (marked in the loss
functions): m scales the positive logit, and DCL averages over dimensions with the correlation
divided by the batch size.
Released-code notes (Jiahao004/SimCSE-plus-plus at its head): m = 0.9 as in Section 5.1 and
run_re.sh (off-dropout InfoNCE alone). No runnable script trains DCL: run_re_vicreg.sh (the README's
"SimCSE++") passes --pos_ratio 1 and no --sampling_strategy, whose default "None" is plain InfoNCE,
and models_re_vicreg.py's DCL call is commented out, so it trains plain SimCSE; run_vicreg.sh (the
README's "DCL SimCSE") calls train_vicreg.py, which is not in the repository; models_vicreg.py
hard-codes DCL at temperature 10 (with the batch norm) and weight 0.1 beside plain InfoNCE
(`--no_off_dropout --m 1 --dcl_temp 10` here); the module-level dcl_loss(temp=0.05) of
models_re_vicreg.py has no batch norm and is never called. So Tables 3-5's DCL numbers have no
runnable source: --dcl_temp defaults to 5, Table 5's best and train_re_vicreg.py's sw_temp default
("5 if SW with DE"), and --dcl_only's tau 0.05 is Table 4's label. Gradient clipping at 1.0, the
last incomplete batch kept and fp32 evaluation come from the HF Trainer the code uses.
Choices: with --no_off_dropout, m still scales the positive logit (so --m 1 gives SimCSE's InfoNCE
exactly); the dropout-off pass keeps its gradients; --dcl_only (Table 4's "BERT first-last avg.
+DCL(wiki, tau_DCL = 0.05)") trains on DCL alone over the two dropout views, first-last average
pooling and tau_DCL 0.05 (the row's label), no third pass; see simcse.py for the shared choices.
"""
from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

import common
import distributed
import eval_sts
import plumbing
import resume


# Section 5.1: large models train at lr 8e-6 (base: 3e-5, the shared default), batch 64
BACKBONE_SETTINGS = {kind: ({"lr": 8e-6}, "SimCSE++ Section 5.1, large models")
                     for kind in ("bert-large", "roberta-large")}


def parse_args(argv=None):
    parser = common.base_parser(__doc__, method="simcsepp")
    g = parser.add_argument_group("SimCSE++ (Section 5.1 defaults)")
    g.add_argument("--m", type=float, default=0.9,
                   help="weight m on the positive logit (Table 5 best: 0.9)")
    g.add_argument("--dcl_weight", type=float, default=0.1,
                   help="lambda, weight of the DCL loss (Table 5: 0.1)")
    g.add_argument("--dcl_temp", type=float, default=5.0,
                   help="DCL temperature (Table 5's best: 5; the released models_vicreg.py: 10)")
    g.add_argument("--no_off_dropout", action="store_true",
                   help="negatives from the dropout views s(z1_i, z2_j), no third pass "
                        "(Table 3 '+DCL' row)")
    g.add_argument("--dcl_only", action="store_true",
                   help="Table 4: DCL alone as the objective (no InfoNCE); sets --pooler "
                        "avg_first_last and --dcl_temp 0.05 unless given")
    known, _ = parser.parse_known_args(argv)
    presets, source = {}, ""
    if known.dcl_only:  # Table 4's row: BERT first-last avg. + DCL(wiki, tau_DCL = 0.05)
        presets, source = {"pooler": "avg_first_last", "dcl_temp": 0.05}, "SimCSE++ Table 4"
    args = common.parse_with_presets(parser, argv, presets, source, BACKBONE_SETTINGS)
    plumbing.check_range(args, "m", lambda v: v > 0, "a positive weight")
    plumbing.check_range(args, "dcl_weight", lambda v: v >= 0, ">= 0 (0 disables DCL)")
    plumbing.check_range(args, "dcl_temp", lambda v: v > 0, "a positive temperature")
    return args


def off_dropout_info_nce(z1, z2, z_dropout_off, temp: float = 0.05, m: float = 0.9) -> torch.Tensor:
    """Off-dropout InfoNCE (Eq. 3 as the authors implemented it).

    loss_i = -m s(z1_i, z2_i) + log(e^{m s(z1_i, z2_i)} + sum_{j != i} e^{s(z0_i, z0_j)}), s = cos /
    temp, where z0 = `z_dropout_off` is the batch encoded with dropout off. `z_dropout_off=None`
    takes the negatives from the dropout views instead, s(z1_i, z2_j) (the ablation); with m = 1
    that is SimCSE's InfoNCE.
    """
    cross = common.cos_sim(z1, z2) / temp
    if z_dropout_off is None:
        negatives = cross
    else:
        negatives = common.cos_sim(z_dropout_off, z_dropout_off) / temp
    diagonal = torch.eye(len(z1), dtype=torch.bool, device=z1.device)
    # Code over paper: m scales the positive logit; Eq. 3 puts m on the sum of the negatives.
    logits = torch.where(diagonal, m * cross, negatives)
    return F.cross_entropy(logits, torch.arange(len(z1), device=z1.device))


def dcl_loss(z1, z2, temp: float = 5.0) -> torch.Tensor:
    """Dimension-wise contrastive learning (Eq. 5 as the authors implemented it).

    Standardise each dimension over the batch (BatchNorm1d without affine, training mode), C = z1~^T
    z2~ / (N temp) (D x D); loss = mean over c of [-C_cc + log sum_d e^{C_cd}].
    """
    def standardise(z):
        return (z - z.mean(0)) / torch.sqrt(z.var(0, unbiased=False) + 1e-5)
    # Code over paper: mean over dimensions and C divided by N; Eq. 5 sums over c and has no 1/N.
    correlation = standardise(z1).T @ standardise(z2) / (len(z1) * temp)
    return F.cross_entropy(correlation, torch.arange(correlation.shape[0], device=z1.device))


@contextlib.contextmanager
def dropout_off(module: nn.Module):
    """Every nn.Dropout of `module` off for one pass, then each one's mode and rate restored.

    eval() alone is not enough in transformers 5: BERT applies attention dropout under the attention
    module's own training flag with rate `dropout.p`, so the rate is zeroed as well.
    """
    saved = [(m, m.training, m.p) for m in module.modules() if isinstance(m, nn.Dropout)]
    for m, _, _ in saved:
        m.eval()
        m.p = 0.0
    try:
        yield
    finally:
        for m, training, p in saved:
            m.train(training)
            m.p = p


def main(argv=None):
    args = parse_args(argv)
    common.check_args(args)  # every flag, the device, --precision and --output_dir, before any work
    transformers.set_seed(args.seed)
    device = distributed.init(plumbing.resolve_device(args.device))

    # downloads, senteval.tar and datasets' cache: process 0 first
    with distributed.main_process_first():
        examples, train_file, subset = common.training_examples(args)
        # every SentEval file read once now: a bad one stops the run before training
        senteval_dir = eval_sts.resolve_senteval_dir(args.senteval_dir, check=eval_sts.TASKS)
        tokenizer, backbone = plumbing.load_pretrained(args.model_name_or_path)
        pad_multiple = 8 if args.compile else 1  # --compile: few shapes to compile
        corpus = common.TokenizedCorpus(examples, tokenizer, args.max_seq_length, pad_multiple)
    loader = common.make_loader(corpus, args, device)
    total_steps = args.max_steps if args.max_steps is not None else args.epochs * len(loader)

    # Encoder and head: the MLP on [CLS] (SimCSE's "cls" pooler); evaluated before it unless
    # --no-mlp_only_train.
    backbone.to(device).train()
    common.set_dropout(backbone, args.dropout)  # --dropout (SimCSE Table 3); None: the checkpoint's
    head = common.MLPHead(backbone.config).to(device) if args.pooler == "cls" else None
    model = common.Encoder(backbone, head)  # what trains, one module (for DDP)
    params = [p for p in model.parameters() if p.requires_grad]
    # DistributedDataParallel under torchrun; --compile: the training passes only
    forward = distributed.data_parallel(model, args.compile)
    eval_pooler = common.eval_pooler(args)
    encode = common.model_encode(backbone, head, tokenizer, eval_pooler, device)
    optimizer, scheduler = common.make_optimizer(params, args, total_steps)
    # loss scaling for fp16; a pass-through otherwise
    scaler = common.grad_scaler(device, args.precision)
    summary = common.run_summary(args, len(corpus), train_file, subset, len(loader), total_steps,
                                 device)

    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    stop = distributed.StopSignal()
    # what last/ saves for --resume, with the RNG streams, the data position and the record so far
    run_state = {"backbone": backbone, "head": head, "optimizer": optimizer,
                 "scheduler": scheduler, "scaler": scaler}
    # --resume: restored from last/ (the RNG streams last of all); otherwise a run from step 0
    saved = resume.restore(args, run_state, loader, device) if args.resume else resume.new_run()
    best_dev, best_step, train_time = saved["best_dev"], saved["best_step"], saved["train_time"]
    history = common.History(args, saved)  # losses, gradient norms, the trajectory; --report_to
    batches = common.batches(loader)  # epoch after epoch
    clock = time.perf_counter()
    bar = plumbing.Progress(total_steps, "training", "step", distributed.rank() == 0, leave=True,
                            initial=len(history.losses))
    # step 0 only evaluates the initial model
    for step in range(saved["next_step"], total_steps + 1):
        if step > 0:
            batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
            # one pass over the batch repeated: two dropout views
            views = common.repeat_views(batch, 2)
            # the encoder only: embeddings and loss are fp32
            with common.autocast(device, args.precision):
                outputs = forward(**views, output_hidden_states=True)
            z = common.embed(outputs.hidden_states, views["attention_mask"], args.pooler, head)
            z1, z2 = z.chunk(2)
            z1, z2, z_dropout_off = distributed.gather(z1), distributed.gather(z2), None
            # a third pass with every dropout off gives the negatives (with grads)
            if not (args.no_off_dropout or args.dcl_only):
                with dropout_off(backbone), common.autocast(device, args.precision):
                    outputs_off = forward(**batch, output_hidden_states=True)
                z_dropout_off = common.embed(outputs_off.hidden_states, batch["attention_mask"],
                                             args.pooler, head)
                z_dropout_off = distributed.gather(z_dropout_off)
            # DCL's per-dimension statistics are the global batch's (gathered)
            if args.dcl_only:  # Table 4: DCL alone
                loss = dcl_loss(z1, z2, args.dcl_temp)
            else:
                loss = off_dropout_info_nce(z1, z2, z_dropout_off, args.temp, args.m)
                if args.dcl_weight > 0:
                    loss = loss + args.dcl_weight * dcl_loss(z1, z2, args.dcl_temp)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)  # fp16: clip the true gradients
            # the norm before clipping, for the record (--max_grad_norm 0: measured, not clipped)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm or math.inf)
            scaler.step(optimizer)  # fp16: a step whose gradients overflowed is skipped
            scaler.update()
            scheduler.step()
            # stays on the device until the next log or dev step: no host sync
            history.add(loss, grad_norm)
            bar.update()  # a clock read, no host sync
        dev_step = step % args.eval_steps == 0 or step == total_steps
        # --align_uniform_steps: STS-B dev encoded between the gates too, for the trajectory
        align_uniform_step = bool(args.align_uniform_steps) and step % args.align_uniform_steps == 0
        every_save = bool(args.save_steps) and step % args.save_steps == 0
        log_step = dev_step or align_uniform_step or every_save or step % args.logging_steps == 0
        stopping = stop.requested(share=log_step)  # several processes agree at log steps only
        # last/ for --resume: at each dev gate, every --save_steps, and when a signal stops the run
        save_step = dev_step or stopping or every_save
        if save_step or log_step:
            # one host sync; the first NaN or inf loss stops the run with its step
            history.read()
            # the device has finished every step up to here
            train_time += time.perf_counter() - clock
            message = common.progress(step, total_steps, history.losses, train_time)
            # lr: what the scheduler set for the next step (as the HF Trainer logs it)
            point = {"step": step, "train_time_s": round(train_time, 3),
                     "lr": scheduler.get_last_lr()[0]}
            if dev_step or align_uniform_step:  # one encoding of STS-B dev: score, align, uniform
                modules = [backbone] + ([head] if head is not None else [])
                point.update(common.dev_measures(modules, encode, senteval_dir), gate=dev_step)
            if dev_step:  # the STS-B dev gate
                dev = point["stsb_dev"]
                if best_step is None or dev > best_dev:  # the first gate always saves: best/ exists
                    best_dev, best_step = dev, step
                    common.save_checkpoint(backbone, head, tokenizer, eval_pooler, args.output_dir)
                message += f"  STS-B dev {dev:.2f}  best {best_dev:.2f} (step {best_step})"
            history.record(point)  # results.json's trajectory; --report_to's scalars
            if save_step:  # written whole or not at all
                loop = {"best_dev": best_dev, "best_step": best_step, "train_time": train_time}
                resume.save(args, step, run_state, loader, history, loop)
            distributed.log(message)
            bar.set_postfix(loss=history.losses[-1] if history.losses else None, best_dev=best_dev)
            clock = time.perf_counter()  # the dev gate and the log are not training time
            bar.unpause()  # nor in the bar's speed and ETA
        if stopping:
            break

    bar.close()
    # the other processes exit here: process 0's final evaluation holds nobody in a barrier
    distributed.shutdown()
    # The end, on process 0: the run's record, best/ reloaded as eval_sts.py loads it and evaluated
    # on the STS test tasks (and alignment/uniformity, --eval_transfer), then results.json.
    if distributed.rank() == 0:
        out = Path(args.output_dir)
        results = common.run_record(
            args, eval_pooler, device, stop, history, train_time, summary=summary,
            train_file=train_file, micse_subset=subset, num_train_examples=len(corpus),
            best_dev_stsb=best_dev, best_step=best_step)
        with stop.final_evaluation(results):  # a signal now stops it; results.json records that
            if not results["interrupted"]:
                distributed.log(f"best STS-B dev {best_dev:.2f} at step {best_step}; evaluating it")
                encode = eval_sts.load_encode(str(out / "best"), eval_pooler, device)
                if not args.no_test_eval:
                    results["test"] = common.sts_test_scores(encode, senteval_dir)
                results["align_uniform"] = common.align_uniform(
                    encode, args, eval_pooler, senteval_dir, device)
                if args.eval_transfer:
                    results["transfer"] = common.transfer_scores(
                        encode, senteval_dir, args, device, results)
        plumbing.write_json(out / "results.json", results)
        resume.drop(args, results)  # a completed run needs no last/ (unless --keep_last)
        distributed.log(f"wrote {out / 'results.json'} (best checkpoint: {out / 'best'})")
    stop.exit_if_stopped()  # 130 after Ctrl-C, 143 after SIGTERM


if __name__ == "__main__":
    plumbing.cli(main)
