"""SimCSE++: Improving Contrastive Learning for Sentence Embeddings from Two Perspectives (Xu et
al., EMNLP 2023).

Two changes to SimCSE's loss. Off-dropout sampling: the negatives come from a third pass of the
batch with every dropout off, since dropout noise helps the positives but hurts the negatives
(Section 3, Eq. 3). Dimension-wise contrastive learning (DCL): each embedding dimension should be
more like itself across the two views than like the other dimensions (Section 4.3, Eq. 5).

Headline (Table 3, BERT-base, 7-task STS average): SimCSE 76.25 -> SimCSE++ 78.05 (off-dropout
alone 77.13, DCL alone 77.40).

    python simcsepp.py                                  # m 0.9, DCL weight 0.1, DCL temperature 5
    python simcsepp.py --no_off_dropout --m 1           # Table 3's "+DCL": SimCSE + DCL
    python simcsepp.py --dcl_weight 0                   # Table 3's "+Off-Info"
    python simcsepp.py --dcl_only                       # Table 4's "+DCL(wiki)": DCL alone
    python simcsepp.py --no_off_dropout --m 1 --dcl_temp 10  # the released models_vicreg.py's DCL

A "Code over paper" comment marks each line that follows the authors' released code over the
paper; docs/methods.md says what the released scripts run and how this file settles what the paper
leaves open.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
import data
import plumbing
from plumbing import distributed, graph, hub, options
from plumbing.run import Run

# The paper's settings (flags the user gives win); base models: common.FLAGS' (Section 5.1)
PRESETS = {
    "bert-large": ({"lr": 8e-6}, "SimCSE++ Section 5.1, large models"),
    "roberta-large": ({"lr": 8e-6}, "SimCSE++ Section 5.1, large models"),
    # Table 4's row: BERT first-last avg. + DCL(wiki, tau_DCL = 0.05), first-last as the code has it
    "dcl_only": ({"pooler": "avg_embeddings_last", "dcl_temp": 0.05}, "SimCSE++ Table 4"),
}


def parse_args(argv=None):
    parser = options.parser(__doc__, method="simcsepp")
    g = parser.add_argument_group("SimCSE++ (Section 5.1 defaults)")
    g.add_argument("--m", type=float, default=0.9,
                   help="weight m on the positive logit (Table 5 best: 0.9)")
    g.add_argument("--dcl_weight", type=float, default=0.1,
                   help="lambda, weight of the DCL loss (Table 5: 0.1)")
    g.add_argument("--dcl_temp", type=float, default=5.0,
                   help="DCL temperature (Table 5's best: 5; the released models_vicreg.py: 10)")
    g.add_argument("--no_off_dropout", action="store_true",
                   help="negatives from the dropout views s(z1_i, z2_j), no third pass; m still "
                        "scales the positive: Table 3's '+DCL' row is --no_off_dropout --m 1")
    g.add_argument("--dcl_only", action="store_true",
                   help="Table 4: DCL alone as the objective (no InfoNCE); sets --pooler "
                        "avg_embeddings_last (the released first-last average) and --dcl_temp "
                        "0.05 unless given")
    args = options.parse(parser, argv, PRESETS, lambda known, backbone: (
        ["dcl_only"] if known.dcl_only else []) + [backbone])
    if args.pooler == "avg_first_last":  # the released code's first-last average: hidden_states[0]
        args.pooler = "avg_embeddings_last"
    plumbing.check_range(args, "m", lambda v: v > 0, "a positive weight")
    plumbing.check_range(args, "dcl_weight", lambda v: v >= 0, ">= 0 (0 disables DCL)")
    plumbing.check_range(args, "dcl_temp", lambda v: v > 0, "a positive temperature")
    return args


# --- the objective: copy this block; it needs only torch ---
def cos_sim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """All-pairs cosine similarity, (N, D) x (M, D) -> (N, M)."""
    return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T


def off_dropout_info_nce(z1, z2, z_dropout_off, temp: float = 0.05, m: float = 0.9) -> torch.Tensor:
    """Off-dropout InfoNCE (Eq. 3 as the authors implemented it).

    loss_i = -m s(z1_i, z2_i) + log(e^{m s(z1_i, z2_i)} + sum_{j != i} e^{s(z0_i, z0_j)}), s = cos /
    temp, where z0 = `z_dropout_off` is the batch encoded with dropout off.
    """
    return m_positive_cross_entropy(cos_sim(z1, z2) / temp,
                                    cos_sim(z_dropout_off, z_dropout_off) / temp, m)


def view_negatives_info_nce(z1, z2, temp: float = 0.05, m: float = 0.9) -> torch.Tensor:
    """The ablation without the dropout-off pass (--no_off_dropout; with m = 1 Table 3's "+DCL"):
    the negatives are the dropout views', s(z1_i, z2_j), and m still scales the positive; with
    m = 1 this is SimCSE's InfoNCE exactly."""
    cross = cos_sim(z1, z2) / temp
    return m_positive_cross_entropy(cross, cross, m)


def m_positive_cross_entropy(cross, negatives, m: float) -> torch.Tensor:
    """Row i's cross-entropy for target i over the logits m cross_ii (its positive) and negatives_ij
    (j != i)."""
    diagonal = torch.eye(len(cross), dtype=torch.bool, device=cross.device)
    # Code over paper: m scales the positive logit; Eq. 3 puts m on the sum of the negatives.
    logits = torch.where(diagonal, m * cross, negatives)
    return F.cross_entropy(logits, torch.arange(len(cross), device=cross.device))


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
# --- end of the objective ---


@contextlib.contextmanager
def dropout_off(module: nn.Module):
    """Every dropout of `module` off for one pass, then each one's mode and rate restored.

    eval() alone is not enough in transformers 5: BERT applies attention dropout under the attention
    module's own training flag with rate `dropout.p`, so the rates are zeroed as well (ModernBERT's
    attention keeps its own rate: common.dropout_slots).
    """
    saved = [(m, slot, m.training, getattr(m, slot)) for m, slot in common.dropout_slots(module)]
    for m, slot, _, _ in saved:
        if isinstance(m, nn.Dropout):
            m.eval()
        setattr(m, slot, 0.0)
    # --gradient_checkpointing: this pass keeps its activations (recomputed, dropout would be on)
    checkpointed = [m for m in module.modules() if getattr(m, "gradient_checkpointing", 0) is True]
    for m in checkpointed:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m, slot, training, rate in saved:
            m.train(training)
            setattr(m, slot, rate)
        for m in checkpointed:
            m.gradient_checkpointing = True


def embeddings(batch, ddp_model, backbone, head, args, part=None) -> tuple:
    """(z1, z2, z_dropout_off) of `part`'s sentences (None: all) in fp32: two dropout views in one
    pass, then one with every dropout off for the negatives (--no_off_dropout, --dcl_only: none)."""
    inputs = data.part_of(batch, part)
    views = common.repeat_views(inputs, 2)  # one pass over the batch repeated
    with common.autocast(inputs["input_ids"].device, args.precision):  # the encoder only
        outputs = ddp_model(**views, output_hidden_states=True)
    z = common.embed(outputs.hidden_states, views["attention_mask"], args.pooler, head)
    if args.no_off_dropout or args.dcl_only:
        return z.chunk(2)
    with dropout_off(backbone), common.autocast(inputs["input_ids"].device, args.precision):
        outputs_off = ddp_model(**inputs, output_hidden_states=True)
    mask = inputs["attention_mask"]
    return (*z.chunk(2), common.embed(outputs_off.hidden_states, mask, args.pooler, head))


def simcsepp_loss(z1, z2, z_dropout_off=None, *, global_rows: int, args,
                  terms=None) -> torch.Tensor:
    """Off-dropout InfoNCE + dcl_weight x DCL over the global batch (`global_rows` rows gathered
    from the processes); Table 4's DCL alone; Table 3's view negatives. A dict given as `terms`
    gets the two terms ("info_nce", "dcl"), detached, for the log."""
    z1, z2 = distributed.gather(z1, global_rows), distributed.gather(z2, global_rows)
    # DCL's statistics: the global batch's (released under torchrun: C / local batch; fidelity.md)
    if args.dcl_only:  # Table 4: DCL alone
        return dcl_loss(z1, z2, args.dcl_temp)
    if args.no_off_dropout:
        loss = view_negatives_info_nce(z1, z2, args.temp, args.m)
    else:
        loss = off_dropout_info_nce(z1, z2, distributed.gather(z_dropout_off, global_rows),
                                    args.temp, args.m)
    if args.dcl_weight > 0:
        dcl = args.dcl_weight * dcl_loss(z1, z2, args.dcl_temp)
        if terms is not None:
            terms.update(info_nce=loss.detach(), dcl=dcl.detach())
        loss = loss + dcl
    return loss


def train_step(ddp_model, backbone, head, params, optimizer, scaler, args, batch: dict,
               global_rows: int):
    """One optimizer step on this process's rows of the global batch: the views' passes, the loss,
    backward, unscale and clip, the optimizer step; (loss, gradient norm, {term: value})."""
    optimizer.zero_grad(set_to_none=True)  # before the passes: the old gradients freed
    terms = {}  # the loss's two terms, logged beside it
    if not args.micro_batch_size:  # the paper's step: the views' pass, the loss, backward
        z1, z2, *z_dropout_off = embeddings(batch, ddp_model, backbone, head, args)
        loss = simcsepp_loss(z1, z2, *z_dropout_off, global_rows=global_rows, args=args,
                             terms=terms)
        scaler.scale(loss).backward()  # through both views' pass and the dropout-off one
    else:  # GradCache: the same loss and gradients, K sentences at once
        loss = common.grad_cache(
            functools.partial(embeddings, batch, ddp_model, backbone, head, args),
            functools.partial(simcsepp_loss, global_rows=global_rows, args=args, terms=terms),
            len(batch["input_ids"]), args.micro_batch_size, scaler.scale, ddp_model)
    scaler.unscale_(optimizer)  # fp16: clip the true gradients
    # the norm before clipping, for the record (--max_grad_norm 0: measured, not clipped)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm or math.inf)
    scaler.step(optimizer)  # fp16: a step whose gradients overflowed is skipped
    scaler.update()
    return loss, grad_norm, terms


def main(argv=None):
    args = parse_args(argv)
    run = Run(args)  # every flag checked, the seeds set, the device (and torchrun's process group)
    device = run.device

    # The data
    with distributed.main_process_first():  # downloads and datasets' cache: process 0 first
        tokenizer, backbone = hub.load_pretrained(args.model_name_or_path)
        # the encoder checked (one line if it cannot work): the mask it takes, what it switches on
        prebuilt_mask, switched_on = run.check_encoder(backbone, tokenizer)  # dropout to turn off
        vars(args).update(switched_on)  # the model's --dropout, --fit_memory's memory flags
        examples, train_file, subset = data.training_examples(args)
        corpus = data.TokenizedCorpus(examples, tokenizer, args.max_seq_length,
                                      data.pad_multiple(args))  # to its longest row, or alike
    loader = data.make_loader(corpus, args, device)
    total_steps = args.max_steps if args.max_steps is not None else args.epochs * len(loader)

    # Encoder and head: the MLP on [CLS] ("cls"), evaluated before it unless --no-mlp_only_train
    # The model
    backbone.to(device).train()
    common.set_dropout(backbone, args.dropout)  # --dropout (SimCSE Table 3); None: the model's own
    head = common.MLPHead(backbone.config).to(device) if args.pooler == "cls" else None
    # what trains, one module: the backbone (its forward) and the heads, for DDP
    model = common.BackboneWithHeads(backbone, head, prebuilt_mask=prebuilt_mask)
    params = [p for p in model.parameters() if p.requires_grad]
    ddp_model = distributed.data_parallel(model, args.compile)  # DDP under torchrun; --compile
    # The optimiser
    optimizer, scheduler = common.make_optimizer(params, args, total_steps)
    scaler = common.grad_scaler(device, args.precision)  # fp16's loss scaling, else a pass-through
    eval_pooler = common.eval_pooler(args)
    eval_encoder = common.Encoder(model, head, tokenizer, eval_pooler, device)

    # The loop
    run.start(loader, total_steps, eval_encoder, [backbone, head], train_file, subset,
              backbone=backbone, head=head, optimizer=optimizer, scheduler=scheduler,
              scaler=scaler)  # what last/ saves
    batches = data.batches(loader)  # epoch after epoch
    # the step, replayed from a CUDA graph with --cuda_graph (plumbing/graph.py), else called
    train = graph.StepGraph(functools.partial(train_step, ddp_model, backbone, head, params,
                                              optimizer, scaler, args), optimizer, args.cuda_graph)
    for step in run.steps():  # 0: the initial model; --resume: after last/'s; a signal ends it
        if step > 0:
            global_rows, batch = next(batches)  # the global batch's rows, which each gather takes
            loss, grad_norm, terms = train({k: v.to(device, non_blocking=True)
                                            for k, v in batch.items()}, global_rows)
            scheduler.step()  # outside the step (and its graph): the next step's lr
            run.record(loss, grad_norm, terms)  # kept on the device until a log: no host sync
        if step % args.eval_steps == 0 or step == total_steps:  # STS-B dev (eval mode, then back)
            if run.dev_gate(step) > run.best_dev or run.best_step is None:  # the first one saves
                run.save_best(step, backbone, head, tokenizer, eval_pooler)  # best/ and its score

    # The end: best/ reloaded as eval_sts.py loads it, evaluated by process 0 (the 7 STS test tasks,
    # alignment/uniformity, --eval_transfer) and written with the run's record to results.json.
    run.write(run.evaluate_best(eval_pooler))


if __name__ == "__main__":
    plumbing.cli(main)
