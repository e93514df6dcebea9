"""SimCSE++ Tables 1 and 2 (Xu et al., EMNLP 2023): the two studies on unsupervised SimCSE that
motivate SimCSE++'s off-dropout negatives and its DCL objective.

Table 1, noise in the positive and in the negative pairs (7-task STS average; SimCSE 76.25): a
positive or negative pair's embeddings get Gaussian noise of variance 0.1 added (+Noise: Pos 75.25,
Neg 74.53), or are replaced by the mean of K = 10 dropout passes (-Noise: Pos 65.55, Neg 77.06).

Table 2, BarlowTwins added to SimCSE (7-task STS average): 64.05, and with 100 / 300 / 704
artificial N(0, 1) rows padded to the batch before the correlation matrix: 71.37 / 73.56 / 76.08.

    python ablations/simcsepp_noise_barlow.py --positive_noise add      # Table 1, Pos. +Noise
    python ablations/simcsepp_noise_barlow.py --negative_noise reduce   # Table 1, Neg. -Noise
    python ablations/simcsepp_noise_barlow.py --barlow                  # Table 2, BarlowTwins
    python ablations/simcsepp_noise_barlow.py --barlow --barlow_padding 704

The settings are unsupervised SimCSE's (simcse.py's flags and backbone presets: batch 64, lr 3e-5,
one epoch, a dev gate every 125 steps, [CLS] with the MLP at training only), as the paper's Section
3 builds on SimCSE.
Choices (the paper gives no code for these studies): the noisy or averaged embeddings keep their
gradients; a -Noise pair's two sides are each the mean of K passes of its own (2K extra dropout
passes in the same forward pass), and the untouched side of the study uses the two ordinary views;
BarlowTwins follows Zbontar et al. (2021): sum_c (1 - C_cc)^2 + lambda sum_{c != d} C_cd^2 (the
paper's Eq. 4 prints a minus before the first sum), C as the paper's Eq. 4 (per-dimension cosine
over the batch), lambda = 0.0051 (Zbontar et al.'s) and the term added to InfoNCE with weight 1;
the same M padding rows, drawn afresh each step, extend both views. This script runs on one
process, and without --resume.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's modules

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import common  # noqa: E402
import data  # noqa: E402
import plumbing  # noqa: E402
import simcse  # noqa: E402
from plumbing import distributed, hub, options  # noqa: E402
from plumbing.run import Run  # noqa: E402


def parse_args(argv=None):
    parser = options.parser(__doc__, method="simcsepp_noise_barlow")
    g = parser.add_argument_group("SimCSE++ Tables 1 and 2")
    g.add_argument("--positive_noise", choices=["none", "add", "reduce"], default="none",
                   help="Table 1 'Pos.': add Gaussian noise to the positive pair, or reduce it "
                        "(mean of K passes)")
    g.add_argument("--negative_noise", choices=["none", "add", "reduce"], default="none",
                   help="Table 1 'Neg.': the same for the negative pairs")
    g.add_argument("--noise_variance", type=float, default=0.1,
                   help="variance of the added Gaussian noise (Section 3.1: 0.1)")
    g.add_argument("--mean_passes", type=int, default=10,
                   help="K, dropout passes averaged to reduce the noise (Section 3.1: 10)")
    g.add_argument("--barlow", action="store_true",
                   help="Table 2: add the BarlowTwins objective to SimCSE's")
    g.add_argument("--barlow_padding", type=int, default=0,
                   help="M artificial N(0, 1) rows padded to the batch for BarlowTwins (Table 2: "
                        "0, 100, 300, 704)")
    g.add_argument("--barlow_lambda", type=float, default=0.0051,
                   help="weight of the off-diagonal terms (Zbontar et al. 2021)")
    g.add_argument("--barlow_weight", type=float, default=1.0,
                   help="weight of the BarlowTwins term beside InfoNCE")
    args = options.parse(parser, argv, simcse.PRESETS)  # SimCSE's per-backbone rows
    plumbing.check_range(args, "noise_variance", lambda v: v > 0, "a positive variance")
    plumbing.check_range(args, "mean_passes", lambda v: v >= 2, "at least 2 passes")
    plumbing.check_range(args, "barlow_padding", lambda v: v >= 0, "a non-negative row count")
    if args.barlow and (args.positive_noise != "none" or args.negative_noise != "none"):
        parser.error("--barlow is Table 2, the noise flags are Table 1: give one study")
    if args.pooler != "cls":
        parser.error("this study trains [CLS] with the MLP (--pooler cls), unsupervised SimCSE's")
    options.refuse_method_only_flags(args)  # --resume, --compile, ...: one line, not ignored
    return args


def noisy_info_nce(pos1, pos2, neg1, neg2, temp: float = 0.05) -> torch.Tensor:
    """InfoNCE (Eq. 2) with the positive pair and the negative pairs taken from different
    embeddings (Table 1's study): loss_i = -s(p1_i, p2_i) + log(e^{s(p1_i, p2_i)} + sum_{j != i}
    e^{s(n1_i, n2_j)}), s = cos / temp."""
    positives = F.cosine_similarity(pos1, pos2, dim=-1) / temp
    negatives = simcse.cos_sim(neg1, neg2) / temp
    logits = torch.where(torch.eye(len(pos1), dtype=torch.bool, device=pos1.device),
                         positives.unsqueeze(1).expand_as(negatives), negatives)
    return F.cross_entropy(logits, torch.arange(len(pos1), device=pos1.device))


def add_gaussian_noise(z, variance: float, generator: torch.Generator) -> torch.Tensor:
    """z^+ = z + g, g ~ N(0, variance) (Section 3.1, +Noise)."""
    noise = torch.randn(z.shape, generator=generator, device=generator.device)
    return z + math.sqrt(variance) * noise.to(z.device, z.dtype)


def barlow_twins_loss(z1, z2, off_diagonal_weight: float = 0.0051, padding=None) -> torch.Tensor:
    """BarlowTwins (Eq. 4, Zbontar et al.'s sign): sum_c (1 - C_cc)^2 + lambda sum_{c != d} C_cd^2,
    C_cd = sum_i z1_ic z2_id / (||z1_.c|| ||z2_.d||); `padding` (M x D) rows extend both views
    first (Table 2's artificial embeddings)."""
    if padding is not None:
        z1, z2 = torch.cat([z1, padding]), torch.cat([z2, padding])
    correlation = F.normalize(z1, dim=0).T @ F.normalize(z2, dim=0)
    on_diagonal = (1 - correlation.diagonal()).pow(2).sum()
    off_diagonal = correlation.pow(2).sum() - correlation.diagonal().pow(2).sum()
    return on_diagonal + off_diagonal_weight * off_diagonal


def main(argv=None):
    args = parse_args(argv)
    run = Run(args, resumable=False)  # every flag checked, the seeds, the device; no last/
    device = run.device
    if distributed.world_size() > 1:
        raise plumbing.UsageError("the ablation scripts run on one process (no torchrun)")

    examples, train_file, subset = data.training_examples(args)
    tokenizer, backbone = hub.load_pretrained(args.model_name_or_path)
    prebuilt_mask, switched_on = run.check_encoder(backbone, tokenizer)  # else one line; the mask
    vars(args).update(switched_on)  # the model's --dropout, --fit_memory's choice
    corpus = data.TokenizedCorpus(examples, tokenizer, args.max_seq_length)
    loader = data.make_loader(corpus, args, device)
    total_steps = args.max_steps if args.max_steps is not None else args.epochs * len(loader)

    backbone.to(device).train()
    common.set_dropout(backbone, args.dropout)
    head = common.MLPHead(backbone.config).to(device)
    params = list(backbone.parameters()) + list(head.parameters())
    model = common.BackboneWithHeads(backbone, prebuilt_mask=prebuilt_mask)  # 4-D mask where it may
    eval_pooler = common.eval_pooler(args)
    encode = common.Encoder(backbone, head, tokenizer, eval_pooler, device)
    optimizer, scheduler = common.make_optimizer(params, args, total_steps)
    scaler = common.grad_scaler(device, args.precision)
    generator = torch.Generator(device).manual_seed(args.seed)  # the Gaussian noise and padding
    # two ordinary dropout views, and K more per view where a pair's noise is reduced
    reduce = "reduce" in (args.positive_noise, args.negative_noise)
    num_views = 2 + 2 * args.mean_passes * reduce

    run.start(loader, total_steps, encode, [backbone, head], train_file, subset,
              optimizer=optimizer, scheduler=scheduler)
    batches = data.batches(loader)
    for step in run.steps():
        if step > 0:
            _, batch = next(batches)  # one process: no gather
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            views = common.repeat_views(batch, num_views)  # every dropout view in one pass
            with common.autocast(device, args.precision):
                outputs = model(**views)
            z = head(outputs.last_hidden_state[:, 0].float()).unflatten(0, (num_views, -1))
            z1, z2 = z[0], z[1]
            if args.barlow:  # Table 2: SimCSE + BarlowTwins on the padded batch
                padding = torch.randn(args.barlow_padding, z1.shape[1], generator=generator,
                                      device=device) if args.barlow_padding else None
                loss = simcse.info_nce(z1, z2, args.temp) + args.barlow_weight * \
                    barlow_twins_loss(z1, z2, args.barlow_lambda, padding)
            else:  # Table 1: noise added to, or averaged out of, the positive or negative pairs
                # Eq.: z^- = mean of K dropout passes, each side
                means = z[2:].unflatten(0, (2, args.mean_passes)).mean(1) if reduce else None
                pairs = {}
                for side, noise in (("pos", args.positive_noise), ("neg", args.negative_noise)):
                    if noise == "add":
                        pairs[side] = [add_gaussian_noise(v, args.noise_variance, generator)
                                       for v in (z1, z2)]
                    elif noise == "reduce":
                        pairs[side] = [means[0], means[1]]
                    else:
                        pairs[side] = [z1, z2]
                loss = noisy_info_nce(*pairs["pos"], *pairs["neg"], args.temp)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm or math.inf)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            run.record(loss, grad_norm)
        if step % args.eval_steps == 0 or step == total_steps:  # the STS-B dev gate
            if run.dev_gate(step) > run.best_dev:
                run.save_best(step, backbone, head, tokenizer, eval_pooler)

    run.write(run.evaluate_best(eval_pooler, table="SimCSE++ Tables 1-2"))


if __name__ == "__main__":
    plumbing.cli(main)
