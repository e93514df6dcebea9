"""WhitenedCSE: Whitening-based Contrastive Learning of Sentence Embeddings (Zhuo et al., ACL 2023).

The training head whitens the [CLS] features in groups of channels after a random shuffle of the
channels (shuffled group whitening, SGW, Section 3); a different shuffle gives a different whitening
of the same sentence, a feature-wise perturbation (Eq. 11), so several shuffled views serve as
several positives (Eq. 7).

Headline (Table 1, BERT-base, 7-task STS average): 78.78, +2.53 over SimCSE's 76.25.

    python whitenedcse.py                  # 384 groups (of 2 channels for BERT-base), 3 positives
    python whitenedcse.py --no_shuffle     # Table 4: a fixed identity permutation
    python whitenedcse.py --no_whitening   # Table 6: m positives from dropout alone, no SGW
    python whitenedcse.py --num_pos 2      # Table 6: SGW with a single positive
    python whitenedcse.py --num_pos 2 --num_groups 128  # the authors' released code: 128 groups
    torchrun --nproc_per_node 2 whitenedcse.py          # each process whitens its own rows

Backbone presets (--num_groups), read from the model's config; flags the user gives win: 384 for
BERT-base (Section 4.1, Table 4's best: groups of 2 channels), 512 for BERT-large (Section 4.1 says
384, which does not divide 1024 channels: read as groups of 2 channels), 256 for RoBERTa-base and
RoBERTa-large (Section 4.1); any other encoder: groups of 2 channels (hidden_size / 2).

The released code calls the removed torch.symeig and does not parse; this file is written from the
paper and that code. Where they differ: the released code whitens contiguous thirds of the
interleaved batch, one permutation per third (so a sentence's views mostly share a permutation),
with 128 groups, 128 sentences per GPU on 2 GPUs and lr 1e-5, and its README evaluates --pooler cls
while its dev gate uses [CLS] before the head; this file follows the paper's per-view shuffles.
Under torchrun it follows the released code: shuffled_group_whitening.py whitens each GPU's own rows
(the head runs before the gather), so each process whitens with its own batch statistics and the
whitened views are gathered for the loss; --global_whitening gathers the [CLS] features first and
whitens with the global batch's (one process: the same either way).
Gradient clipping at 1.0, the last incomplete batch kept (a batch no wider than a group is skipped:
its covariance is singular) and fp32 evaluation come from the HF Trainer.
Choices: each view is one dropout pass of the batch (all m in one forward pass) with its own fresh
permutation drawn on the device from a generator seeded by --seed; the whole whitening runs in fp32
whatever --precision the encoder uses; eigenvalues are floored at 1e-12 before the inverse square
root so rounding cannot produce a NaN; evaluation takes [CLS] before the head (SGW is
training-only). Table 6's "multi-positive from dropout only" (--no_whitening) keeps the head's
Linear and Tanh and the m dropout views, without SGW (Section 5: "we replace the whitening method
with ordinary dropout technique").
"""
from __future__ import annotations

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


# Section 4.1: "384" groups for BERT-base and -large, "256" for RoBERTa-base and -large. 384 does
# not divide BERT-large's 1024 channels; read as groups of 2 channels, as 384 is for BERT-base: 512.
BACKBONE_SETTINGS = {
    "bert-large": ({"num_groups": 512}, "WhitenedCSE Section 4.1 read as groups of 2 channels"),
    "roberta-base": ({"num_groups": 256}, "WhitenedCSE Section 4.1, RoBERTa"),
    "roberta-large": ({"num_groups": 256}, "WhitenedCSE Section 4.1, RoBERTa"),
}


def parse_args(argv=None):
    parser = common.base_parser(__doc__, method="whitenedcse")
    g = parser.add_argument_group("WhitenedCSE (Section 4.1 defaults)")
    g.add_argument("--num_groups", type=int, default=None,
                   help="SGW groups (default: the backbone's setting, else groups of 2 channels, "
                        "hidden_size / 2: 384 for BERT-base, the paper's best in Table 4)")
    g.add_argument("--num_pos", type=int, default=3,
                   help="m, the number of whitened views (Table 5: 3)")
    g.add_argument("--no_shuffle", action="store_true",
                   help="identity permutation for every view (Table 4 ablation)")
    g.add_argument("--no_whitening", action="store_true",
                   help="no SGW: the m positives differ by dropout alone (Table 6 ablation)")
    g.add_argument("--global_whitening", action="store_true",
                   help="under torchrun: whiten with the statistics of the global batch (gathered "
                        "first) instead of each process's own rows, as the released code does")
    args = common.parse_with_presets(parser, argv, {}, "", BACKBONE_SETTINGS)
    plumbing.check_range(args, "num_pos", lambda v: v >= 2, "at least 2 views")
    plumbing.check_range(args, "num_groups", lambda v: v >= 1, "a positive number of groups")
    return args


def shuffled_group_whitening(x: torch.Tensor, num_groups: int, perm: torch.Tensor,
                             eps: float = 0.0) -> torch.Tensor:
    """Shuffled group whitening (Section 3.2; ZCA per group, W = U diag(lambda^-1/2) U^T).

    Channels are taken in the order x[:, perm], split into `num_groups` consecutive groups, each
    centred over the batch and multiplied by the ZCA matrix of its covariance X^T X / N (+ eps I);
    the channels are then put back in their original order. W is computed from the detached
    covariance, as the authors' code does, so gradients flow through X only. Everything runs in fp32
    (fp64 for fp64 input), also inside an autocast block.
    """
    n, d = x.shape
    if d % num_groups:
        raise ValueError(f"{d} channels cannot be split into {num_groups} equal groups")
    width = d // num_groups
    if width > n - 1 and eps <= 0:
        raise ValueError(f"groups of {width} channels need a batch of more than {width} (got {n}): "
                         "the covariance is singular; use more groups, a larger batch or eps > 0")
    # fp32 (or fp64) even inside an autocast block
    with torch.autocast(device_type=x.device.type, enabled=False):
        x = x if x.dtype == torch.float64 else x.float()
        groups = x[:, perm].reshape(n, num_groups, width).transpose(0, 1)  # (G, N, width)
        centred = groups - groups.mean(dim=1, keepdim=True)
        c = centred.detach()
        identity = torch.eye(width, dtype=x.dtype, device=x.device)
        covariance = c.transpose(1, 2) @ c / n + eps * identity
        # checks convergence on the host: one sync
        eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
        inverse_sqrt = torch.diag_embed(eigenvalues.clamp_min(1e-12).rsqrt())
        whitening = eigenvectors @ inverse_sqrt @ eigenvectors.transpose(1, 2)
        whitened = centred @ whitening
    return whitened.transpose(0, 1).reshape(n, d)[:, torch.argsort(perm)]


def multi_positive_info_nce(views, temp: float = 0.05) -> torch.Tensor:
    """Multi-positive InfoNCE (Eq. 7 with lambda_m = 1): sum over p = 2..m of CE(s(z_1, z_p)), s =
    cos / temp."""
    anchor = views[0]
    labels = torch.arange(len(anchor), device=anchor.device)
    return sum(F.cross_entropy(common.cos_sim(anchor, z) / temp, labels) for z in views[1:])


def group_width(args, hidden: int) -> int:
    """Channels per SGW group: --num_groups (no backbone setting: groups of 2 channels), checked to
    divide the hidden size."""
    args.num_groups = args.num_groups or hidden // 2
    if hidden % args.num_groups:
        raise plumbing.UsageError(f"--num_groups {args.num_groups} does not divide the hidden size "
                                  f"{hidden}; use groups of 2 channels: --num_groups {hidden // 2}")
    return hidden // args.num_groups


class WhitenedHead(nn.Module):
    """The training head: SGW -> Linear(D, D) -> Tanh (Section 4.1)."""

    def __init__(self, hidden_size: int, num_groups: int, init_std: float = 0.02):
        super().__init__()
        self.num_groups = num_groups
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.normal_(self.linear.weight, std=init_std)
        nn.init.zeros_(self.linear.bias)

    def forward(self, cls: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
        """perm None: no whitening (Table 6's dropout-only positives)."""
        if perm is not None:
            cls = shuffled_group_whitening(cls, self.num_groups, perm)
        return torch.tanh(self.linear(cls))


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
    hidden = backbone.config.hidden_size
    width = group_width(args, hidden)
    # a covariance over each process's rows (the released code), or the global batch's
    processes = 1 if args.global_whitening else distributed.world_size()
    if args.batch_size // processes <= width:
        raise plumbing.UsageError(f"groups of {width} channels need --batch_size above "
                                  f"{width * processes}" + (f" ({width} a process)" if processes > 1
                                                            else ""))
    # fewer rows: a singular covariance
    loader = common.make_loader(corpus, args, device, min_rows=(width + 1) * processes)
    total_steps = args.max_steps if args.max_steps is not None else args.epochs * len(loader)

    # Encoder and head: SGW -> Linear -> Tanh on [CLS], training only; evaluation reads [CLS].
    backbone.to(device).train()
    common.set_dropout(backbone, args.dropout)  # --dropout (SimCSE Table 3); None: the checkpoint's
    head = WhitenedHead(hidden, args.num_groups, backbone.config.initializer_range).to(device)
    model = common.Encoder(backbone, head)  # what trains, one module (for DDP)
    params = [p for p in model.parameters() if p.requires_grad]
    # DistributedDataParallel under torchrun; --compile: the training passes only
    forward = distributed.data_parallel(model, args.compile)
    eval_pooler = "cls_before_pooler"
    # the channel shuffles, the same on every process
    generator = torch.Generator(device).manual_seed(args.seed)
    encode = eval_sts.pooled_encode(backbone, tokenizer, eval_pooler, device)
    optimizer, scheduler = common.make_optimizer(params, args, total_steps)
    # loss scaling for fp16; a pass-through otherwise
    scaler = common.grad_scaler(device, args.precision)
    summary = common.run_summary(args, len(corpus), train_file, subset, len(loader), total_steps,
                                 device)

    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    stop = distributed.StopSignal()
    # what last/ saves for --resume, with the RNG streams, the data position and the record so far
    run_state = {"backbone": backbone, "head": head, "optimizer": optimizer,
                 "scheduler": scheduler, "scaler": scaler, "shuffle_generator": generator}
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
            # the encoder only: whitening and loss are fp32
            with common.autocast(device, args.precision):
                # m dropout views in one pass
                outputs = forward(**common.repeat_views(batch, args.num_pos))
            cls_views = outputs.last_hidden_state[:, 0].float().chunk(args.num_pos)  # [CLS]
            if args.global_whitening:  # each covariance over the global batch
                cls_views = [distributed.gather(c) for c in cls_views]
            # Eq. 11: a fresh shuffle per view and step (the identity with --no_shuffle)
            perms = [torch.arange(hidden, device=device) if args.no_shuffle else
                     torch.randperm(hidden, generator=generator, device=device) for _ in cls_views]
            if args.no_whitening:  # Table 6: the positives differ by dropout alone
                perms = [None] * len(cls_views)
            views = [head(cls, perm) for cls, perm in zip(cls_views, perms)]
            # Code over paper: the released code whitens each GPU's own rows, then gathers
            if not args.global_whitening:
                views = [distributed.gather(v) for v in views]
            loss = multi_positive_info_nce(views, args.temp)
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
                point.update(common.dev_measures([backbone, head], encode, senteval_dir),
                             gate=dev_step)
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
