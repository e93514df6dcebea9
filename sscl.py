"""SSCL: Alleviating Over-smoothing for Unsupervised Sentence Representation (Chen et al., ACL
2023).

Adjacent layers of a pretrained encoder give nearly identical sentence representations (inter-layer
over-smoothing, measured by SetSim, Eq. 2). SSCL uses the encoder's own intermediate-layer
representations of the batch as extra negatives for the last layer's (Eq. 4), a plug-in to any
contrastive objective.

Headline (Table 2, BERT-base, 7-task STS average): SimCSE 76.25 -> SSCL-SimCSE 77.90.

    python sscl.py                         # progressive SSCL, layers L-1 and L-2 (Figure 3b's best)
    python sscl.py --neg_layer_index 10    # one chosen layer (Figure 3a)
    python sscl.py --pooler cls --report_oversmoothing
    python sscl.py --layer_negatives anchor  # the paper's N (not 2N) layer negatives (Table 7 text)
    python sscl.py --no_dropout_positive   # Table 2's SSCL-BERT: layer negatives, no augmentation
    python sscl.py --output_dim 256        # Table 5: a linear projection to 256 dimensions

Backbone presets, read from the model's config; flags the user gives win: lr 3e-5 for BERT-base
and 1e-5 for BERT-large, batch 64 (Section 4.2); other backbones take BERT-base's settings.

Released code over paper: --pooler avg by default (run_unsup_example.sh --pooler_type avg, test.sh
--pooler avg; the paper does not say); the loss averages Eq. 4 with SimCSE's plain term (marked in
sscl_loss). Gradient clipping at 1.0, the last incomplete batch kept and fp32 evaluation come from
the HF Trainer it uses.
Choices: intermediate-layer negatives keep their gradients (they are part of the same forward pass,
not a detached memory); SetSim is reported for every pair of adjacent transformer layers (1-2, ...,
(L-1)-L), on the layer's sentence representation before the MLP ([CLS] or masked mean), averaged
over the distinct STS-B test sentences (analyze.py's SetSim; `analyze.py setsim` measures any
checkpoint the same way). SSCL-BERT (--no_dropout_positive; Section 4.3: "we don't add any
augmentation methods to construct positives") is read as one pass of the batch serving as both
views, so each positive is the sentence itself (cosine 1) and only the in-batch and layer negatives
move the encoder; dropout stays at the checkpoint's rate (--dropout 0 removes it too).
--output_dim d (Table 5: "the same simple linear projection head") puts one Linear(D, d) after the
pooler (and after the MLP with --pooler cls), on the last layer and the negative layers alike, kept
at evaluation: best/ holds it as projection.safetensors, which eval_sts.py applies (the
sentence-transformers files are then left out, as they cannot hold it).
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

import analyze
import common
import distributed
import eval_sts
import plumbing
import resume


# Section 4.2: lr 3e-5 for BERT-base (the shared default) and 1e-5 for BERT-large, batch 64
BACKBONE_SETTINGS = {"bert-large": ({"lr": 1e-5}, "SSCL Section 4.2, BERT-large")}


def parse_args(argv=None):
    parser = common.base_parser(__doc__, method="sscl")
    g = parser.add_argument_group("SSCL")
    g.add_argument("--neg_layers", type=int, default=2,
                   help="k: negatives from layers L-1, ..., L-k below the last (progressive SSCL, "
                        "Figure 3b: 2)")
    g.add_argument("--neg_layer_index", type=int, default=None,
                   help="use this one hidden-state layer (1..L-1) as the negatives instead "
                        "(Figure 3a)")
    g.add_argument("--layer_negatives", choices=["both", "anchor"], default="both",
                   help="both: each negative layer of both dropout views, 2N negatives a layer "
                        "(the released code); anchor: of the anchor's view only, N a layer (the "
                        "paper's 'from N pairs to 2N pairs', Table 7)")
    g.add_argument("--no_dropout_positive", action="store_true",
                   help="SSCL-BERT (Table 2): one pass, no dropout positive pair; each sentence is "
                        "its own positive and the layer negatives do the work")
    g.add_argument("--output_dim", type=int, default=None,
                   help="Table 5: project every representation to this many dimensions with a "
                        "linear layer, kept at evaluation (128, 256)")
    g.add_argument("--report_oversmoothing", action="store_true",
                   help="write SetSim (Eq. 2) of adjacent layers on STS-B test, before and after "
                        "training")
    # the released scripts train and evaluate with the average pooler
    args = common.parse_with_presets(parser, argv, {"pooler": "avg"}, "SSCL's released scripts",
                                     BACKBONE_SETTINGS)
    if args.pooler not in ("cls", "avg"):
        parser.error("SSCL trains with --pooler cls or avg (Section 4.2)")
    plumbing.check_range(args, "neg_layers", lambda v: v >= 0, "a non-negative number of layers")
    plumbing.check_range(args, "output_dim", lambda v: v >= 1, "a positive dimension")
    return args


def sscl_loss(z1, z2, layer_negatives, temp: float = 0.05) -> torch.Tensor:
    """SSCL's contrastive loss with intermediate-layer negatives (Eq. 4).

    logits = [s(z1, z2) | s(z1, n1_l) | s(z1, n2_l) for each layer l], s = cos / temp, target i for
    row i; `layer_negatives` is a list of tuples, one a layer: that layer's representations of the
    two dropout views (n1, n2), or of the anchor's view only (n1,).
    """
    in_batch = common.cos_sim(z1, z2) / temp
    negatives = [common.cos_sim(z1, n) / temp for pair in layer_negatives for n in pair]
    logits = torch.cat([in_batch] + negatives, dim=1)
    labels = torch.arange(len(z1), device=z1.device)
    # Code over paper: the authors average this with SimCSE's plain loss; Eq. 4 has only the first.
    return (F.cross_entropy(logits, labels) + F.cross_entropy(in_batch, labels)) / 2


def negative_layers(num_layers: int, k: int, index: int | None = None) -> list[int]:
    """hidden_states indices of the negative layers: [index], or L-1, ..., L-k (hidden_states[L] is
    the last)."""
    if index is not None:
        if not 1 <= index < num_layers:
            raise plumbing.UsageError(f"--neg_layer_index must be in 1..{num_layers - 1}, "
                                      f"got {index}")
        return [index]
    if not 0 <= k < num_layers:
        raise plumbing.UsageError(f"--neg_layers must be in 0..{num_layers - 1}, got {k}")
    return [num_layers - i for i in range(1, k + 1)]


def layer_representations(hidden_states, attention_mask, layers, pooler: str, head=None,
                          num_views: int = 2):
    """Each negative layer's sentence representations, pooled like z, split into the dropout
    views."""
    # hidden_states[:l + 1] ends at layer l: embed pools (for [CLS], applies the MLP to) layer l
    return [tuple(common.embed(hidden_states[:layer + 1], attention_mask, pooler, head)
                  .chunk(num_views)) for layer in layers]


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
    eval_pooler = common.eval_pooler(args)
    encode = common.model_encode(backbone, head, tokenizer, eval_pooler, device)
    projection = None
    if args.output_dim:  # Table 5: a linear projection after the pooler, at evaluation too
        projection = torch.nn.Linear(backbone.config.hidden_size, args.output_dim).to(device)
        encode = eval_sts.project(encode, projection)
    model = common.Encoder(backbone, head, projection)  # what trains, one module (for DDP)
    params = [p for p in model.parameters() if p.requires_grad]
    # DistributedDataParallel under torchrun; --compile: the training passes only
    forward = distributed.data_parallel(model, args.compile)
    optimizer, scheduler = common.make_optimizer(params, args, total_steps)
    # loss scaling for fp16; a pass-through otherwise
    scaler = common.grad_scaler(device, args.precision)
    neg_layers = negative_layers(backbone.config.num_hidden_layers, args.neg_layers,
                                 args.neg_layer_index)
    setsim = None
    if args.report_oversmoothing and distributed.rank() == 0:
        setsim = {"before": analyze.oversmoothing(backbone, tokenizer, args.pooler, senteval_dir,
                                                  device, "SetSim before")}
    summary = common.run_summary(args, len(corpus), train_file, subset, len(loader), total_steps,
                                 device)

    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    stop = distributed.StopSignal()
    # what last/ saves for --resume, with the RNG streams, the data position and the record so far
    run_state = {"backbone": backbone, "head": head, "optimizer": optimizer,
                 "scheduler": scheduler, "scaler": scaler, "projection": projection}
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
            # one pass over the batch repeated: two dropout views (SSCL-BERT: one view, used twice)
            num_views = 1 if args.no_dropout_positive else 2
            views = common.repeat_views(batch, num_views)
            # the encoder only: embeddings and loss are fp32
            with common.autocast(device, args.precision):
                outputs = forward(**views, output_hidden_states=True)
            mask = views["attention_mask"]
            z = common.embed(outputs.hidden_states, mask, args.pooler, head)
            # The negatives come from the same pass: intermediate layers of both views.
            reps = layer_representations(outputs.hidden_states, mask, neg_layers, args.pooler, head,
                                         num_views)
            if projection is not None:  # Table 5: every representation projected to d dimensions
                z = projection(z)
                reps = [tuple(projection(n) for n in layer) for layer in reps]
            z1, z2 = (z, z) if args.no_dropout_positive else z.chunk(2)
            # Code over paper: both views' layers (2N a layer); the paper adds N (--layer_negatives)
            views_used = 2 if args.layer_negatives == "both" else 1
            layer_negatives = [tuple(distributed.gather(n) for n in layer[:views_used])
                               for layer in reps]
            z1, z2 = distributed.gather(z1), distributed.gather(z2)
            loss = sscl_loss(z1, z2, layer_negatives, args.temp)
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
                    common.save_checkpoint(backbone, head, tokenizer, eval_pooler, args.output_dir,
                                           projection)
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
    # the other processes exit here: process 0's evaluations hold nobody in a barrier
    distributed.shutdown()
    if setsim is not None and stop.signum is None:
        best = plumbing.load_pretrained(str(Path(args.output_dir) / "best"))[1].to(device)
        setsim["after"] = analyze.oversmoothing(best, tokenizer, args.pooler, senteval_dir, device,
                                                "SetSim after")
    # The end, on process 0: the run's record, best/ reloaded as eval_sts.py loads it and evaluated
    # on the STS test tasks (and alignment/uniformity, --eval_transfer), then results.json.
    if distributed.rank() == 0:
        out = Path(args.output_dir)
        results = common.run_record(
            args, eval_pooler, device, stop, history, train_time, summary=summary, setsim=setsim,
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
