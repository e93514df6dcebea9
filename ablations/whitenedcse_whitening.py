"""WhitenedCSE Table 3 (Zhuo et al., ACL 2023): full PCA or ZCA whitening with momentum statistics
against group whitening, as the whitening step of WhitenedCSE's training head.

Section 5 ("Whitening methods"): the batch's mean and covariance feed momentum estimates (Eq. 13,
mu_n = beta mu_{n-1} + (1 - beta) x_{n-1}, Sigma likewise), and the whole D-dimensional feature is
whitened with them, by PCA (W = Lambda^-1/2 U^T) or ZCA (W = U Lambda^-1/2 U^T, Eq. 12). The paper
finds full whitening hurts and group whitening helps; Table 3's cells are not in its text.

    python ablations/whitenedcse_whitening.py --whitening pca
    python ablations/whitenedcse_whitening.py --whitening zca
    python ablations/whitenedcse_whitening.py --whitening group            # no shuffle
    python ablations/whitenedcse_whitening.py --whitening shuffled_group   # WhitenedCSE itself

Everything else is whitenedcse.py's: the head (whitening -> Linear -> Tanh on [CLS]), m = 3
positives (--num_pos), the multi-positive InfoNCE, its backbone presets (--num_groups), [CLS]
before the head at evaluation.
Choices (the paper gives neither beta nor the first estimate): beta = 0.9 (--momentum, BatchNorm's
0.1 in the other direction); step n whitens with the estimate of steps before it (Eq. 13's n - 1),
and the first step with its own batch statistics; the statistics are detached (as in
shuffled_group_whitening), so gradients flow through x - mu only; the covariance gets eps = 1e-4
on its diagonal before the eigendecomposition (--whitening_eps; a 64-row batch's covariance of 768
channels is singular). Every view of a step is whitened with the same estimate, so the m positives
differ by dropout only under pca and zca. This script runs on one process, and without --resume.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's modules

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import common  # noqa: E402
import data  # noqa: E402
import plumbing  # noqa: E402
import whitenedcse  # noqa: E402
from plumbing import distributed, hub, options  # noqa: E402
from plumbing.run import Run  # noqa: E402


def parse_args(argv=None):
    parser = options.parser(__doc__, method="whitenedcse_whitening")
    g = parser.add_argument_group("WhitenedCSE Table 3")
    g.add_argument("--whitening", choices=["pca", "zca", "group", "shuffled_group"],
                   default="zca", help="the head's whitening (shuffled_group: WhitenedCSE)")
    g.add_argument("--momentum", type=float, default=0.9,
                   help="beta of Eq. 13's running mean and covariance (pca, zca)")
    g.add_argument("--whitening_eps", type=float, default=1e-4,
                   help="added to the covariance's diagonal before the eigendecomposition "
                        "(pca, zca)")
    g.add_argument("--num_groups", type=int, default=None,
                   help="groups for group / shuffled_group (default: whitenedcse.py's)")
    g.add_argument("--num_pos", type=int, default=3, help="m, positives (WhitenedCSE: 3)")
    args = options.parse(parser, argv, whitenedcse.PRESETS)
    plumbing.check_range(args, "momentum", lambda v: 0 <= v < 1, "0 <= beta < 1")
    plumbing.check_range(args, "whitening_eps", lambda v: v >= 0, ">= 0")
    plumbing.check_range(args, "num_pos", lambda v: v >= 2, "at least 2 views")
    options.refuse_method_only_flags(args)  # --resume, --compile, ...: one line, not ignored
    return args


def full_whitening(x, mean, covariance, kind: str = "zca", eps: float = 1e-4) -> torch.Tensor:
    """(x - mu) W^T with the eigendecomposition Sigma + eps I = U Lambda U^T: PCA W = Lambda^-1/2
    U^T, ZCA W = U Lambda^-1/2 U^T (Eq. 12). `mean` and `covariance` are constants (detached)."""
    identity = torch.eye(len(covariance), dtype=covariance.dtype, device=covariance.device)
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance + eps * identity)
    pca = eigenvectors * eigenvalues.clamp_min(1e-12).rsqrt()  # U Lambda^-1/2 = (PCA W)^T
    return (x - mean) @ (pca if kind == "pca" else pca @ eigenvectors.T)


def momentum_update(mean, covariance, x, beta: float):
    """Eq. 13: (beta mu + (1 - beta) x_bar, beta Sigma + (1 - beta) sigma) with the batch's mean
    x_bar and covariance sigma = (x - x_bar)^T (x - x_bar) / N, detached."""
    x = x.detach()
    batch_mean = x.mean(0)
    centred = x - batch_mean
    batch_covariance = centred.T @ centred / len(x)
    if mean is None:  # the first step: its own batch statistics
        return batch_mean, batch_covariance
    return (beta * mean + (1 - beta) * batch_mean,
            beta * covariance + (1 - beta) * batch_covariance)


class MomentumWhitenedHead(nn.Module):
    """Full PCA / ZCA whitening with running statistics -> Linear(D, D) -> Tanh."""

    def __init__(self, hidden_size: int, kind: str, beta: float, eps: float, init_std=0.02):
        super().__init__()
        self.kind, self.beta, self.eps = kind, beta, eps
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.normal_(self.linear.weight, std=init_std)
        nn.init.zeros_(self.linear.bias)
        self.mean, self.covariance = None, None

    def forward(self, views: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.mean is None:  # the first step whitens with its own statistics
            self.mean, self.covariance = momentum_update(None, None, views[0], self.beta)
        whitened = [full_whitening(v, self.mean, self.covariance, self.kind, self.eps)
                    for v in views]
        # the estimate for the next step (Eq. 13: step n uses the batches before it)
        self.mean, self.covariance = momentum_update(self.mean, self.covariance, views[0],
                                                     self.beta)
        return [torch.tanh(self.linear(w)) for w in whitened]


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
    hidden = backbone.config.hidden_size
    args.num_groups = args.num_groups or hidden // 2  # as whitenedcse.py: groups of 2 channels
    group_width = whitenedcse.group_width(hidden, args.num_groups)  # checked for every kind
    width = group_width if "group" in args.whitening else 1
    if width >= args.batch_size:
        raise plumbing.UsageError(f"groups of {width} channels need --batch_size above {width}")
    loader = data.make_loader(corpus, args, device, min_rows=width + 1)
    total_steps = args.max_steps if args.max_steps is not None else args.epochs * len(loader)

    backbone.to(device).train()
    common.set_dropout(backbone, args.dropout)
    init_std = backbone.config.initializer_range
    if args.whitening in ("pca", "zca"):  # Table 3: full whitening, momentum statistics
        head = MomentumWhitenedHead(hidden, args.whitening, args.momentum, args.whitening_eps,
                                    init_std).to(device)
    else:  # group whitening, shuffled (WhitenedCSE) or not
        head = whitenedcse.WhitenedHead(hidden, args.num_groups, init_std).to(device)
    params = list(backbone.parameters()) + list(head.parameters())
    model = common.BackboneWithHeads(backbone, prebuilt_mask=prebuilt_mask)  # 4-D mask where it may
    eval_pooler = "cls_before_pooler"
    generator = torch.Generator(device).manual_seed(args.seed)  # the channel shuffles
    encode = common.Encoder(backbone, None, tokenizer, eval_pooler, device)
    optimizer, scheduler = common.make_optimizer(params, args, total_steps)
    scaler = common.grad_scaler(device, args.precision)

    run.start(loader, total_steps, encode, [backbone, head], train_file, subset,
              optimizer=optimizer, scheduler=scheduler)
    batches = data.batches(loader)
    for step in run.steps():
        if step > 0:
            _, batch = next(batches)  # one process: no gather
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with common.autocast(device, args.precision):  # m dropout views in one pass
                outputs = model(**common.repeat_views(batch, args.num_pos))
            cls_views = outputs.last_hidden_state[:, 0].float().chunk(args.num_pos)
            if args.whitening in ("pca", "zca"):
                views = head(list(cls_views))
            else:
                perms = [torch.arange(hidden, device=device) if args.whitening == "group" else
                         torch.randperm(hidden, generator=generator, device=device)
                         for _ in cls_views]
                views = [head(cls, perm) for cls, perm in zip(cls_views, perms)]
            loss = whitenedcse.multi_positive_info_nce(views, args.temp)
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
                run.save_best(step, backbone, None, tokenizer, eval_pooler)

    run.write(run.evaluate_best(eval_pooler, table="WhitenedCSE Table 3"))


if __name__ == "__main__":
    plumbing.cli(main)
