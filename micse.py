"""miCSE: Mutual Information Contrastive Learning for Low-shot Sentence Embeddings (Klein & Nabi,
ACL 2023).

SimCSE plus two parts: an attention mutual-information regulariser (AMI) that makes the attention
patterns of the two dropout views agree (Eq. 4, Algorithm 1), and a momentum encoder whose
embeddings of past batches wait in a queue as extra negatives (Section 3.1, Eq. 2). Its point is
sample efficiency: --fraction trains on a subset of the corpus with the authors' settings for it.

Headline (Table 2, BERT-base, 7-task STS average): 76.40 with 1% of the data (SimCSE needs all of
it for 76.15); 78.13 with all of it.

    python micse.py --fraction 0.01 --seed 48  # few-shot on the authors' 1% subset (Table 2)
    python micse.py                           # all of wiki1m: batch 50, lr 3e-5, 250 warm-up steps
    python micse.py --queue_size 0            # AMI + SimCSE, the variant the authors released

A "Code over paper" comment marks each line that follows the authors' released code over the
paper; docs/methods.md says how this file settles what the paper leaves open (AMI's layers for
other depths, the queue, the sampling).
"""
from __future__ import annotations

import copy
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

import common
import data
import plumbing
from plumbing import distributed, hub, options
from plumbing.run import Run

ATTN_IMPLEMENTATION = "eager"  # transformers 5's default SDPA returns no attention weights

# The paper's settings per fraction of wiki1m (the nearest row to --fraction; flags the user gives
# win): the training commands of the authors' README (SAP-samples) and, for 100%, Section 3.1.
PRESETS = {
    1.0: (dict(batch_size=50, lr=3e-5, epochs=1, warmup_steps=250, ami_lambda=2.5e-3,
               eval_steps=125), "miCSE's settings for fraction 1 (Section 3.1)"),
    0.1: (dict(batch_size=64, lr=1e-5, epochs=10, ami_lambda=5e-4, eval_steps=500),
          "miCSE's settings for fraction 0.1 (the authors' README)"),
    0.01: (dict(batch_size=64, lr=1e-5, epochs=50, ami_lambda=1e-4, eval_steps=500),
           "miCSE's settings for fraction 0.01 (the authors' README)"),
    0.001: (dict(batch_size=64, lr=1e-5, epochs=500, ami_lambda=1e-3, eval_steps=500),
            "miCSE's settings for fraction 0.001 (the authors' README)"),
    0.0001: (dict(batch_size=64, lr=1e-5, epochs=2500, ami_lambda=1e-3, eval_steps=250),
             "miCSE's settings for fraction 0.0001 (the authors' README)"),
}


def parse_args(argv=None):
    parser = options.parser(__doc__, method="micse")
    g = parser.add_argument_group("miCSE")
    g.add_argument("--ami_lambda", type=float, default=2.5e-3,
                   help="weight of the AMI loss (set per fraction)")
    g.add_argument("--ami_min_layer", type=int, default=None,
                   help="first attention layer of AMI, 0-based (default 7 for 12 layers, L-5 "
                        "otherwise)")
    g.add_argument("--ami_max_layer", type=int, default=None,
                   help="end (excluded) of AMI's layers (default 11 for 12 layers, L-1 "
                        "otherwise); the range must hold an even number of layers")
    g.add_argument("--ami_samples", type=int, default=150,
                   help="attention entries sampled per tile (Section 3.1)")
    g.add_argument("--queue_size", type=int, default=384,
                   help="momentum-encoder queue of negatives; 0 disables it")
    g.add_argument("--no_negatives", action="store_true",
                   help="Table 4 / Figure 9: the positive pairs alone with AMI, no negatives "
                        "(common.positive_only_loss); needs --queue_size 0")
    g.add_argument("--momentum", type=float, default=0.995,
                   help="EMA momentum of the momentum encoder")
    g.add_argument("--momentum_dropout", type=float, default=0.3,
                   help="dropout rate of the momentum encoder")
    known, _ = parser.parse_known_args(argv)
    plumbing.check_range(known, "fraction", lambda v: 0 < v <= 1, "0 < fraction <= 1")
    nearest = options.nearest(PRESETS, known.fraction)
    note = "" if nearest == known.fraction else \
        f", the nearest to --fraction {known.fraction:g} in PRESETS"
    args = options.parse(parser, argv, PRESETS, lambda known, backbone: [nearest], note)
    if args.pooler == "avg_first_last":  # the released code's first-last average: hidden_states[0]
        args.pooler = "avg_embeddings_last"
    for name, accepted in (("ami_lambda", ">= 0"), ("queue_size", ">= 0 (0 disables the queue)")):
        plumbing.check_range(args, name, lambda v: v >= 0, accepted)
    plumbing.check_range(args, "ami_samples", lambda v: v >= 2, "at least 2 entries per tile")
    plumbing.check_range(args, "momentum", lambda v: 0 <= v <= 1, "0 <= momentum <= 1")
    plumbing.check_range(args, "momentum_dropout", lambda v: 0 <= v < 1, "0 <= rate < 1")
    if args.no_negatives and args.queue_size:
        parser.error("--no_negatives keeps no negatives to queue: add --queue_size 0")
    return args


def ami_loss(attn1, attn2, min_layer: int = 7, max_layer: int = 11, num_samples: int = 150,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Attention mutual information (Eq. 4, Algorithm 1) as the authors' code computes it; minimise
    it. `attn1`, `attn2`: the attention probabilities of the two dropout views, (N, L, H, n, n).

    1. Tiles: for each sample, head and layer parity, the n x n entries of layers
       min_layer:max_layer of that parity (attention_tiles).
    2. The same entries of both views are sampled, `num_samples` a tile, among those valid in both
       (> 0: padding and dropped entries are 0); tiles with fewer are left out, unless none has
       that many: then every tile gives as many as the poorest (ami_sample).
    3. Log-normal to normal: the sampled entries' logs, centred.
    4. Their cosine rho per tile gives MI = -1/2 log(1 - rho^2).
    5. The loss: -mean(MI) over the tiles kept, times (their valid share^2 + 1e-6).
    """
    if max_layer - min_layer < 2 or (max_layer - min_layer) % 2:
        raise ValueError(f"AMI needs an even number (>= 2) of layers, got {min_layer}:{max_layer}")
    tiles1 = attention_tiles(attn1, min_layer, max_layer)  # 1.
    tiles2 = attention_tiles(attn2, min_layer, max_layer)
    sample = ami_sample(tiles1, tiles2, num_samples, generator)  # 2.
    log1, log2 = centred_logs(tiles1, sample), centred_logs(tiles2, sample)  # 3.
    rho = (log1 * log2).sum(1) / (log1.norm(dim=1) * log2.norm(dim=1)).clamp_min(1e-12)  # 4.
    # Code over paper: Algorithm 1 drops Eq. 4's log; the released code keeps it (and scales).
    # Released code: rho = +-1 takes log(0), a NaN it replaces by 100; clamped here (fidelity.md)
    mutual_information = -0.5 * torch.log(1 - (rho ** 2).clamp(max=1 - 1e-6))
    mean_mi = torch.where(sample.used, mutual_information, 0.0).sum() / sample.used.sum()  # 5.
    loss = -mean_mi * (sample.valid_fraction ** 2 + 1e-6)
    return torch.where(sample.k >= 2, loss, 0.0)  # fewer than 2 samples carry no correlation


def attention_tiles(attn, min_layer: int, max_layer: int) -> torch.Tensor:
    """(N, L, H, n, n) -> (N * H * 2, K/2 * n * n): a tile per sample, head and layer parity, of
    the K layers min_layer:max_layer."""
    n_batch, _, heads = attn.shape[:3]
    per_parity = [attn[:, min_layer + parity:max_layer:2].transpose(1, 2)
                  .reshape(n_batch, heads, -1) for parity in (0, 1)]
    return torch.stack(per_parity, dim=2).reshape(n_batch * heads * 2, -1)


class AMISample(NamedTuple):
    index: torch.Tensor  # (tiles, width): entries in the order drawn; the first k are the sample
    sampled: torch.Tensor  # (tiles, width): which of them are (the first k, where valid)
    k: torch.Tensor  # entries a tile: num_samples, else (no tile has that many) the poorest count
    used: torch.Tensor  # (tiles,): the tiles the released code keeps
    valid_fraction: torch.Tensor  # the valid share of the kept tiles' entries (the loss's scale)


def ami_sample(tiles1, tiles2, num_samples: int, generator=None) -> AMISample:
    """Which entries AMI reads, every shape fixed so that nothing waits for the device: each tile is
    sampled and `used` says which tiles count (the released code drops the others); uniform
    sampling without replacement as the k valid entries with the largest random keys (topk sorts
    them, so a tile's first k columns are its sample)."""
    valid = (tiles1 > 0) & (tiles2 > 0)
    counts = valid.sum(dim=1)
    enough = counts >= num_samples
    some_enough = enough.any()
    used = enough | ~some_enough
    k = torch.where(some_enough, num_samples, counts.min())
    # Code over paper: the released code scales by the valid share of the tiles it keeps
    valid_fraction = (counts * used).sum().to(tiles1.dtype) / (used.sum() * valid.shape[1])
    width = min(num_samples, tiles1.shape[1])
    device = generator.device if generator is not None else tiles1.device
    keys = torch.rand(valid.shape, generator=generator, device=device).to(tiles1.device)
    index = keys.masked_fill(~valid, -1.0).topk(width, dim=1).indices
    sampled = (torch.arange(width, device=k.device) < k) & valid.gather(1, index)
    return AMISample(index, sampled, k, used, valid_fraction)


def centred_logs(tiles, sample: AMISample) -> torch.Tensor:
    """The logs of each tile's sampled entries minus their mean (log-normal -> normal); 0 off the
    sample (log 1)."""
    logs = torch.where(sample.sampled, tiles.gather(1, sample.index), 1.0).log()
    mean = logs.sum(dim=1, keepdim=True) / sample.k.clamp_min(1)
    return torch.where(sample.sampled, logs - mean, 0.0)


def moco_info_nce(z1, z2, queue, temp: float = 0.05, own_keys=None) -> torch.Tensor:
    """InfoNCE with in-batch and queued negatives (Eq. 2): CE over [s(z1, z2) | s(z1, queue)],
    target i. `own_keys` (N, Q), True where a queued key is anchor i's own sentence from an earlier
    step: left out, since a sentence is no negative of itself (a small subset repeats within the
    queue; the paper is silent, the released code has no queue)."""
    logits = torch.cat([common.cos_sim(z1, z2), common.cos_sim(z1, queue)], dim=1) / temp
    if own_keys is not None:  # none in the in-batch block
        logits = logits.masked_fill(F.pad(own_keys, (len(z2), 0)), -torch.inf)
    return F.cross_entropy(logits, torch.arange(len(z1), device=z1.device))


@torch.no_grad()
def ema_update(target: torch.nn.Module, source: torch.nn.Module, momentum: float) -> None:
    """target <- momentum * target + (1 - momentum) * source, all parameters in one foreach kernel
    (a lerp)."""
    torch._foreach_lerp_(list(target.parameters()), list(source.parameters()), 1.0 - momentum)


class EmbeddingQueue:
    """A bounded FIFO of embeddings and the ids of their sentences: the newest `size` rows."""

    def __init__(self, size: int, dim: int, device=None):
        self.size = size
        self.tensor = torch.empty(0, dim, device=device)
        self.ids = torch.empty(0, dtype=torch.long, device=device)

    def push(self, embeddings: torch.Tensor, ids: torch.Tensor) -> None:
        if self.size:
            self.tensor = torch.cat([self.tensor, embeddings.detach().float()])[-self.size:]
            self.ids = torch.cat([self.ids, ids])[-self.size:]

    def state_dict(self) -> dict:  # --resume
        return {"tensor": self.tensor, "ids": self.ids}

    def load_state_dict(self, state: dict) -> None:
        self.tensor = state["tensor"].to(self.tensor.device)
        self.ids = state.get("ids", torch.full((len(self.tensor),), -1)).to(self.ids.device)


def default_ami_layers(num_layers: int) -> tuple[int, int]:
    if num_layers >= 6:
        return num_layers - 5, num_layers - 1
    return 0, num_layers - num_layers % 2


def main(argv=None):
    args = parse_args(argv)
    run = Run(args)  # every flag checked, the seeds, the device (and torchrun's process group)
    device = run.device

    with distributed.main_process_first():  # downloads and datasets' cache: process 0 first
        tokenizer, backbone = hub.load_pretrained(args.model_name_or_path, ATTN_IMPLEMENTATION)
        # what this run needs of the encoder, else one line before any work; the mask it takes
        prebuilt_mask = run.check_encoder(backbone, tokenizer, attentions=True)
        examples, train_file, subset = data.training_examples(args)  # the authors' subset if any
        # the batches' width: all alike (a CUDA graph's), few (to compile), or each its longest row
        pad_multiple = args.max_seq_length if args.pad_to_max_length else 8 if args.compile else 1
        corpus = data.TokenizedCorpus(examples, tokenizer, args.max_seq_length, pad_multiple,
                                      example_ids=True)  # which sentence each row is: the queue's
    num_layers = backbone.config.num_hidden_layers
    default_min, default_max = default_ami_layers(num_layers)
    args.ami_min_layer = default_min if args.ami_min_layer is None else args.ami_min_layer
    args.ami_max_layer = default_max if args.ami_max_layer is None else args.ami_max_layer
    ami_min, ami_max = args.ami_min_layer, args.ami_max_layer
    if not 0 <= ami_min < ami_max <= num_layers or (ami_max - ami_min) % 2:
        raise plumbing.UsageError(f"--ami_min_layer/--ami_max_layer {ami_min}:{ami_max} must be an "
                                  f"even number of layers within the model's {num_layers}")
    loader = data.make_loader(corpus, args, device)
    total_steps = args.max_steps if args.max_steps is not None else args.epochs * len(loader)

    # Encoder and head: the MLP on [CLS] (SimCSE's "cls" pooler); evaluated before it unless
    # --no-mlp_only_train.
    backbone.to(device).train()
    common.set_dropout(backbone, args.dropout)  # --dropout (SimCSE Table 3); None: the model's own
    head = common.MLPHead(backbone.config).to(device) if args.pooler == "cls" else None
    # what trains, one module: the backbone (its forward) and the heads, for DDP
    model = common.BackboneWithHeads(backbone, head, prebuilt_mask=prebuilt_mask)
    params = [p for p in model.parameters() if p.requires_grad]
    ddp_model = distributed.data_parallel(model, args.compile)  # DDP under torchrun; --compile
    optimizer, scheduler = common.make_optimizer(params, args, total_steps)
    scaler = common.grad_scaler(device, args.precision)  # fp16's loss scaling, else a pass-through
    generator = torch.Generator(device=device).manual_seed(args.seed)  # AMI's samples
    # The momentum encoder: an EMA copy of the encoder (dropout 0.3, no gradients) sharing the
    # online head. It needs no attention weights, so it runs SDPA attention.
    momentum_backbone = copy.deepcopy(backbone).requires_grad_(False) if args.queue_size else None
    if momentum_backbone is not None:
        if momentum_backbone._supports_sdpa:  # DeBERTa and MPNet have eager attention only
            momentum_backbone.set_attn_implementation("sdpa")
        common.set_dropout(momentum_backbone, args.momentum_dropout)
        momentum_model = common.BackboneWithHeads(momentum_backbone,  # no DDP: no gradients
                                                  prebuilt_mask=prebuilt_mask)
    queue = EmbeddingQueue(args.queue_size, backbone.config.hidden_size, device)
    eval_pooler = common.eval_pooler(args)
    encode = common.Encoder(model, head, tokenizer, eval_pooler, device)

    run.start(loader, total_steps, encode, [backbone, head], train_file, subset, backbone=backbone,
              head=head, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
              ami_generator=generator, momentum_backbone=momentum_backbone,
              queue=queue)  # what last/ saves
    batches = data.batches(loader)  # epoch after epoch
    for step in run.steps():  # step 0 only evaluates the initial model
        if step > 0:
            rows, batch = next(batches)  # rows: the global batch's, which each gather takes
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            sentence_ids = distributed.gather(batch.pop("example_ids"), rows)  # the queue's ids

            def encode_part(part):  # two dropout views of some sentences (None: all), one pass
                views = common.repeat_views(data.part_of(batch, part), 2)  # the batch repeated
                with common.autocast(device, args.precision):  # the encoder only: the rest is fp32
                    outputs = ddp_model(**views, output_hidden_states=True, output_attentions=True)
                z = common.embed(outputs.hidden_states, views["attention_mask"], args.pooler, head)
                # AMI's layers only, stacked (N, K, H, n, n), in fp32
                attentions = torch.stack(outputs.attentions[ami_min:ami_max], 1).float()
                return (*z.chunk(2), *attentions.chunk(2))

            def micse_loss(z1, z2, attn1, attn2):
                z1, z2 = distributed.gather(z1, rows), distributed.gather(z2, rows)
                # --no_negatives (Table 4): the positive pairs alone, no in-batch or queued ones;
                # a sentence seen in an earlier step is no negative of itself: its own keys left out
                own_keys = queue.ids == sentence_ids[:, None]
                loss = common.positive_only_loss(z1, z2, args.temp) if args.no_negatives else \
                    moco_info_nce(z1, z2, queue.tensor, args.temp, own_keys)
                # AMI per sample, on this process's rows
                return loss + args.ami_lambda * ami_loss(attn1, attn2, 0, ami_max - ami_min,
                                                         args.ami_samples, generator)
            optimizer.zero_grad(set_to_none=True)  # before the passes: the old gradients freed
            if args.micro_batch_size:  # GradCache: the same loss and gradients, K sentences at once
                loss = common.grad_cache(encode_part, micse_loss, len(batch["input_ids"]),
                                         args.micro_batch_size, scaler.scale, ddp_model)
            else:
                loss = micse_loss(*encode_part(None))
                scaler.scale(loss).backward()
            scaler.unscale_(optimizer)  # fp16: clip the true gradients
            # the norm before clipping, for the record (--max_grad_norm 0: measured, not clipped)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm or math.inf)
            scaler.step(optimizer)  # fp16: a step whose gradients overflowed is skipped
            scaler.update()
            scheduler.step()
            # after the step: EMA update, then this batch's keys into the queue
            if momentum_backbone is not None:
                ema_update(momentum_backbone, backbone, args.momentum)
                with torch.no_grad():
                    with common.autocast(device, args.precision):
                        outputs_momentum = momentum_model(**batch, output_hidden_states=True)
                    keys = common.embed(outputs_momentum.hidden_states, batch["attention_mask"],
                                        args.pooler, head)
                queue.push(distributed.gather(keys, rows), sentence_ids)  # alike on every process
            run.record(loss, grad_norm)  # kept on the device until a log step: no host sync
        if step % args.eval_steps == 0 or step == total_steps:  # the STS-B dev gate
            if run.dev_gate(step) > run.best_dev or run.best_step is None:  # the first one saves
                run.save_best(step, backbone, head, tokenizer, eval_pooler)  # best/ and its score

    # The end: best/ reloaded as eval_sts.py loads it, evaluated by process 0 (the 7 STS test tasks,
    # alignment/uniformity, --eval_transfer) and written with the run's record to results.json.
    run.write(run.evaluate_best(eval_pooler))


if __name__ == "__main__":
    plumbing.cli(main)
