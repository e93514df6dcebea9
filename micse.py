"""miCSE: Mutual Information Contrastive Learning for Low-shot Sentence Embeddings (Klein & Nabi,
ACL 2023).

SimCSE plus two parts: an attention mutual-information regulariser (AMI) that makes the attention
patterns of the two dropout views agree (Eq. 4, Algorithm 1), and a momentum encoder whose
embeddings of past batches are kept in a queue as extra negatives (Section 3.1, Eq. 2). Its point is
sample efficiency: `--fraction` trains on a deterministic subset of the corpus with the authors'
per-fraction settings.

Headline (Table 2, BERT-base, 7-task STS average): 76.40 with 1% of the data (SimCSE needs all of it
for 76.15); 78.13 with 100%.

    python micse.py --fraction 0.01 --seed 3  # few-shot, settings from FEW_SHOT_SETTINGS
    python micse.py                           # 100%: batch 50, lr 3e-5, 250 warm-up steps
    python micse.py --queue_size 0            # AMI + SimCSE, the variant the authors released

Backbones: no per-backbone settings in the paper or the released README; AMI's layers follow the
depth (see Choices), e.g. 19:23 for 24-layer encoders.

Follows the authors' released code where the paper differs (marked in ami_loss): MI keeps Eq. 4's
log, attention tiles are formed by layer parity, and the loss is scaled by the squared fraction of
valid attention entries in the tiles it keeps (models.py takes the mask after dropping the tiles
with fewer than 150 valid entries).
Few-shot data: without --train_file, a fraction the authors released (0.000064, 0.0001, 0.0005,
0.001, 0.005, 0.01, 0.1) with --seed 48-52 downloads their subset
wiki_subset_1M_<P>percent_seed<S>.txt from sap-ai-research/datasets-for-micse (Table 2's files); any
other fraction or seed subsamples wiki1m.
Released code: gradient clipping at 1.0, the last incomplete batch kept (0.01% of wiki1m at batch 64
is 2 steps an epoch) and fp32 evaluation come from the HF Trainer it uses.
Choices: AMI's layer range defaults to the paper's 7:11 (0-based, end excluded) for 12-layer
encoders and to the same offsets from the top, (L-5):(L-1), for an L-layer one (all layers, an even
count, below 6 layers); after each optimiser step the momentum encoder takes its EMA update, then
encodes the batch into the queue, so those keys are negatives from the next step on; AMI's samples
come from a generator seeded by --seed, drawn for every tile: AMI computes all tiles with fixed
shapes and weights the ones the authors' code keeps, so that it never waits for the device; the
momentum encoder runs SDPA attention (it needs no attention weights) and AMI gets its layers'
attention maps in fp32.
"""
from __future__ import annotations

import copy
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

import common
import distributed
import eval_sts
import plumbing
import resume

ATTN_IMPLEMENTATION = "eager"  # transformers 5's default SDPA returns no attention weights

# Per-fraction settings: the training commands in the README of the authors' released miCSE code
# (SAP-samples) and, for 100%, the paper's Section 3.1. Flags the user gives override them.
FEW_SHOT_SETTINGS = {
    1.0: dict(batch_size=50, lr=3e-5, epochs=1, warmup_steps=250, ami_lambda=2.5e-3,
              eval_steps=125),
    0.1: dict(batch_size=64, lr=1e-5, epochs=10, ami_lambda=5e-4, eval_steps=500),
    0.01: dict(batch_size=64, lr=1e-5, epochs=50, ami_lambda=1e-4, eval_steps=500),
    0.001: dict(batch_size=64, lr=1e-5, epochs=500, ami_lambda=1e-3, eval_steps=500),
    0.0001: dict(batch_size=64, lr=1e-5, epochs=2500, ami_lambda=1e-3, eval_steps=250),
}


def parse_args(argv=None):
    parser = common.base_parser(__doc__, method="micse")
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
    nearest = common.nearest_fraction(FEW_SHOT_SETTINGS, known.fraction)
    source = f"miCSE's settings for fraction {nearest:g} " + \
        ("(Section 3.1)" if nearest == 1.0 else "(the authors' README)")
    if nearest != known.fraction:
        source += f", the nearest to --fraction {known.fraction:g} in FEW_SHOT_SETTINGS"
    # flags the user gives win
    args = common.parse_with_presets(parser, argv, FEW_SHOT_SETTINGS[nearest], source)
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
    it.

    `attn1`, `attn2`: attention probabilities of the two dropout views, (N, L, H, n, n). Layers
    min_layer:max_layer are kept; for each sample, head and layer parity a tile holds those layers'
    n x n entries. Entries valid in both views (> 0: padding and dropped entries are 0) are sampled,
    the same indices for both views, `num_samples` a tile; tiles with fewer valid entries are
    dropped, unless no tile has that many: then every tile gives as many as the poorest has. The
    logs are centred and their cosine rho gives MI = -1/2 log(1 - rho^2). Returns -mean(MI) *
    (valid fraction^2 + 1e-6), the fraction taken over the tiles kept.
    """
    kept = max_layer - min_layer
    if kept < 2 or kept % 2:
        raise ValueError(f"AMI needs an even number (>= 2) of layers, got {min_layer}:{max_layer}")
    n_batch, _, heads = attn1.shape[:3]

    def tiles(attn):  # (N, K, H, n, n) -> (N * H * 2, K/2 * n * n): per sample, head, layer parity
        per_parity = [attn[:, min_layer + parity:max_layer:2].transpose(1, 2)
                      .reshape(n_batch, heads, -1) for parity in (0, 1)]
        return torch.stack(per_parity, dim=2).reshape(n_batch * heads * 2, -1)

    tiles1, tiles2 = tiles(attn1), tiles(attn2)
    valid = (tiles1 > 0) & (tiles2 > 0)
    counts = valid.sum(dim=1)
    # The authors' tile selection, with every shape fixed so that nothing waits for the device:
    # each tile is computed and `used` says which count; k samples a tile.
    enough = counts >= num_samples
    some_enough = enough.any()
    used = enough | ~some_enough
    k = torch.where(some_enough, num_samples, counts.min())
    # Code over paper: the released code scales by the valid share of the tiles it keeps
    valid_fraction = (counts * used).sum().to(tiles1.dtype) / (used.sum() * valid.shape[1])
    width = min(num_samples, tiles1.shape[1])
    # Uniform sampling without replacement: the k valid entries with the largest random keys (topk
    # sorts them, so a tile's first k columns are its sample).
    device = generator.device if generator is not None else tiles1.device
    keys = torch.rand(valid.shape, generator=generator, device=device).to(tiles1.device)
    index = keys.masked_fill(~valid, -1.0).topk(width, dim=1).indices
    sampled = (torch.arange(width, device=k.device) < k) & valid.gather(1, index)

    def centred_logs(t):  # log-normal -> normal; log 1 = 0 off the sample
        logs = torch.where(sampled, t.gather(1, index), 1.0).log()
        mean = logs.sum(dim=1, keepdim=True) / k.clamp_min(1)
        return torch.where(sampled, logs - mean, 0.0)
    log1, log2 = centred_logs(tiles1), centred_logs(tiles2)
    rho = (log1 * log2).sum(1) / (log1.norm(dim=1) * log2.norm(dim=1)).clamp_min(1e-12)
    # Code over paper: Algorithm 1 drops Eq. 4's log; the released code keeps it (and scales).
    mutual_information = -0.5 * torch.log(1 - (rho ** 2).clamp(max=1 - 1e-6))
    mean_mi = torch.where(used, mutual_information, 0.0).sum() / used.sum()
    loss = -mean_mi * (valid_fraction ** 2 + 1e-6)
    return torch.where(k >= 2, loss, 0.0)  # fewer than 2 samples carry no correlation


def moco_info_nce(z1, z2, queue, temp: float = 0.05) -> torch.Tensor:
    """InfoNCE with in-batch and queued negatives (Eq. 2): CE over [s(z1, z2) | s(z1, queue)],
    target i."""
    logits = torch.cat([common.cos_sim(z1, z2), common.cos_sim(z1, queue)], dim=1) / temp
    return F.cross_entropy(logits, torch.arange(len(z1), device=z1.device))


@torch.no_grad()
def ema_update(target: torch.nn.Module, source: torch.nn.Module, momentum: float) -> None:
    """target <- momentum * target + (1 - momentum) * source, all parameters in one foreach kernel
    (a lerp)."""
    torch._foreach_lerp_(list(target.parameters()), list(source.parameters()), 1.0 - momentum)


class EmbeddingQueue:
    """A bounded FIFO of embeddings: the newest `size` rows are kept."""

    def __init__(self, size: int, dim: int, device=None):
        self.size = size
        self.tensor = torch.empty(0, dim, device=device)

    def push(self, embeddings: torch.Tensor) -> None:
        if self.size:
            self.tensor = torch.cat([self.tensor, embeddings.detach().float()])[-self.size:]

    def state_dict(self) -> dict:  # --resume
        return {"tensor": self.tensor}

    def load_state_dict(self, state: dict) -> None:
        self.tensor = state["tensor"].to(self.tensor.device)


def default_ami_layers(num_layers: int) -> tuple[int, int]:
    if num_layers >= 6:
        return num_layers - 5, num_layers - 1
    return 0, num_layers - num_layers % 2


def main(argv=None):
    args = parse_args(argv)
    common.check_args(args)  # every flag, the device, --precision and --output_dir, before any work
    transformers.set_seed(args.seed)
    device = distributed.init(plumbing.resolve_device(args.device))

    # downloads, senteval.tar and datasets' cache: process 0 first
    with distributed.main_process_first():
        # miCSE's own subset where they released one
        examples, train_file, subset = common.training_examples(args)
        # every SentEval file read once now: a bad one stops the run before training
        senteval_dir = eval_sts.resolve_senteval_dir(args.senteval_dir, check=eval_sts.TASKS)
        tokenizer, backbone = plumbing.load_pretrained(args.model_name_or_path, ATTN_IMPLEMENTATION)
        pad_multiple = 8 if args.compile else 1  # --compile: few shapes to compile
        corpus = common.TokenizedCorpus(examples, tokenizer, args.max_seq_length, pad_multiple)
    num_layers = backbone.config.num_hidden_layers
    default_min, default_max = default_ami_layers(num_layers)
    args.ami_min_layer = default_min if args.ami_min_layer is None else args.ami_min_layer
    args.ami_max_layer = default_max if args.ami_max_layer is None else args.ami_max_layer
    ami_min, ami_max = args.ami_min_layer, args.ami_max_layer
    if not 0 <= ami_min < ami_max <= num_layers or (ami_max - ami_min) % 2:
        raise plumbing.UsageError(f"--ami_min_layer/--ami_max_layer {ami_min}:{ami_max} must be an "
                                  f"even number of layers within the model's {num_layers}")
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
    generator = torch.Generator(device=device).manual_seed(args.seed)  # AMI's samples
    # The momentum encoder: an EMA copy of the encoder (dropout 0.3, no gradients) sharing the
    # online head. It needs no attention weights, so it runs SDPA attention.
    momentum_backbone = copy.deepcopy(backbone).requires_grad_(False) if args.queue_size else None
    if momentum_backbone is not None:
        momentum_backbone.set_attn_implementation("sdpa")
        common.set_dropout(momentum_backbone, args.momentum_dropout)
        momentum_forward = common.Encoder(momentum_backbone)  # the same 4-D mask, outside DDP
    queue = EmbeddingQueue(args.queue_size, backbone.config.hidden_size, device)
    summary = common.run_summary(args, len(corpus), train_file, subset, len(loader), total_steps,
                                 device)

    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    stop = distributed.StopSignal()
    # what last/ saves for --resume, with the RNG streams, the data position and the record so far
    run_state = {"backbone": backbone, "head": head, "optimizer": optimizer,
                 "scheduler": scheduler, "scaler": scaler, "ami_generator": generator,
                 "momentum_backbone": momentum_backbone, "queue": queue}
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
            # the encoder only: embeddings and losses are fp32
            with common.autocast(device, args.precision):
                outputs = forward(**views, output_hidden_states=True, output_attentions=True)
            if not outputs.attentions or outputs.attentions[0] is None:
                raise RuntimeError("no attention weights: load the encoder with "
                                   "attn_implementation='eager'")
            z = common.embed(outputs.hidden_states, views["attention_mask"], args.pooler, head)
            z1, z2 = z.chunk(2)
            z1, z2 = distributed.gather(z1), distributed.gather(z2)
            # --no_negatives (Table 4): the positive pairs alone, no in-batch or queued negatives
            loss = common.positive_only_loss(z1, z2, args.temp) if args.no_negatives else \
                moco_info_nce(z1, z2, queue.tensor, args.temp)
            # AMI's layers only, stacked (N, K, H, n, n), in fp32; per sample, so it stays local.
            attentions = torch.stack(outputs.attentions[ami_min:ami_max], 1).float()
            attn1, attn2 = attentions.chunk(2)
            loss = loss + args.ami_lambda * ami_loss(attn1, attn2, 0, ami_max - ami_min,
                                                     args.ami_samples, generator)
            optimizer.zero_grad(set_to_none=True)
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
                        outputs_momentum = momentum_forward(**batch, output_hidden_states=True)
                    hidden_states = outputs_momentum.hidden_states
                    keys = common.embed(hidden_states, batch["attention_mask"], args.pooler, head)
                queue.push(distributed.gather(keys))  # the same queue on every process
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
