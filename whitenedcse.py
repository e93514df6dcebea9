"""WhitenedCSE: Whitening-based Contrastive Learning of Sentence Embeddings (Zhuo et al., ACL 2023).

The training head whitens the [CLS] features in groups of channels after a random shuffle of the
channels (shuffled group whitening, SGW, Section 3). Another shuffle whitens the same sentence
another way, a feature-wise perturbation (Eq. 11), so several shuffled views serve as several
positives (Eq. 7).

Headline (Table 1, BERT-base, 7-task STS average): 78.78 (+2.53 over SimCSE's 76.25).

    python whitenedcse.py                  # groups of 2 channels (384 for BERT-base), 3 views
    python whitenedcse.py --no_shuffle     # Table 4: the same grouping for every view
    python whitenedcse.py --no_whitening   # Table 6: the positives differ by dropout alone
    python whitenedcse.py --num_pos 2      # Table 6: SGW alone, 2 views (anchor and one positive)
    torchrun --nproc_per_node 2 whitenedcse.py   # each process whitens its own rows

The released code does not run on today's PyTorch (docs/fidelity.md); this file is written from the
paper and that code, "Code over paper" marking a line that follows the code (docs/methods.md).
"""
import functools

import common
import data
import plumbing
from plumbing import distributed, graph, hub, options
from plumbing.run import Run

# The recipe, read first: WhitenedCSE on BERT-base (Section 4.1), trained by AdamW without weight
# decay, its lr decayed linearly. Its values are the defaults of the flags it names (num_groups None
# means d / 2); PRESETS' rows replace some, and shared flags are in common.FLAGS and options.py.
RECIPE = dict(batch_size=64, lr=3e-5, temp=0.05, max_seq_length=32, epochs=1, warmup_steps=0,
              eval_steps=125, num_pos=3)
# The paper's settings (flags win): --num_groups, Section 4.1: "384" for BERT-base and -large, "256"
# for RoBERTa; 384 does not divide BERT-large's 1024: groups of 2 channels (512). Else hidden / 2.
PRESETS = {
    "bert-large": ({"num_groups": 512}, "WhitenedCSE Section 4.1 read as groups of 2 channels"),
    "roberta-base": ({"num_groups": 256}, "WhitenedCSE Section 4.1, RoBERTa"),
    "roberta-large": ({"num_groups": 256}, "WhitenedCSE Section 4.1, RoBERTa"),
}


def parse_args(argv=None):
    parser = options.parser(__doc__, method="whitenedcse", recipe=RECIPE)
    g = parser.add_argument_group("WhitenedCSE (Section 4.1 defaults)")
    g.add_argument("--num_groups", type=int, default=None,
                   help="SGW groups (default: the backbone's, else groups of 2 channels, "
                        "hidden_size / 2: BERT-base's 384, Table 4's best)")
    g.add_argument("--num_pos", type=int,
                   help="m, the views of a sentence, the anchor included (the paper's 'number "
                        "of positives': 3, Section 4.1, Table 5; 2: SimCSE's pair, Table 6)")
    g.add_argument("--no_shuffle", action="store_true",
                   help="identity permutation for every view (Table 4 ablation)")
    g.add_argument("--no_whitening", action="store_true",
                   help="no SGW: the m views differ by dropout alone (Table 6 ablation)")
    g.add_argument("--global_whitening", action="store_true",
                   help="under torchrun: whiten with the global batch's statistics, not each "
                        "process's own rows as the released code does")
    args = options.parse(parser, argv, PRESETS)
    if args.pooler != "cls" or not args.mlp_only_train:  # it was silently ignored
        parser.error("WhitenedCSE trains [CLS] through its whitening head and evaluates [CLS] "
                     "before it (Section 4.1): --pooler and --no-mlp_only_train do not apply")
    plumbing.check_range(args, "num_pos", lambda v: v >= 2, "at least 2 views")
    plumbing.check_range(args, "num_groups", lambda v: v >= 1, "a positive number of groups")
    return args


# --- the objective: copy this block; it needs only torch ---
import torch  # the block's one dependency: it runs pasted alone
import torch.nn.functional as F


def cos_sim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """All-pairs cosine similarity, (N, D) x (M, D) -> (N, M)."""
    return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T


def shuffled_group_whitening(x: torch.Tensor, num_groups: int, perm: torch.Tensor,
                             eps: float = 0.0) -> torch.Tensor:
    """Shuffled group whitening, SGW (Section 3.2, Eq. 6: H = shuffle^-1(GW(shuffle(Z)))): the
    channels x[:, perm] in `num_groups` consecutive groups (Eq. 5), each centred over the batch and
    times the ZCA (zero-phase component analysis) matrix of its covariance C = X^T X / N (+ eps I),
    W = U diag(lambda^-1/2) U^T (Eq. 3), then put back in their order. W comes from the detached
    covariance, as the authors' code has it: gradients flow through X only. In float64 (fp32 out,
    even under autocast), because a real encoder's nearly constant channels (variance 1e-10 beside
    0.04) make fp32's rounding of their covariance decide their gain (19x off, losses of 18).
    Apple's MPS has no float64: there, run the whitening on the CPU."""
    n, d = x.shape
    if d % num_groups:
        raise ValueError(f"{d} channels cannot be split into {num_groups} equal groups")
    width = d // num_groups
    if width > n - 1 and eps <= 0:
        raise ValueError(f"groups of {width} channels need a batch of more than {width} (got {n}): "
                         "the covariance is singular; use more groups, a larger batch or eps > 0")
    with torch.autocast(device_type=x.device.type, enabled=False):  # a few kB: float64 is cheap
        groups = x.double()[:, perm].reshape(n, num_groups, width).transpose(0, 1)  # Eq. 5, 6
        centred = groups - groups.mean(dim=1, keepdim=True)
        c = centred.detach()
        identity = torch.eye(width, dtype=c.dtype, device=c.device)
        covariance = c.transpose(1, 2) @ c / n + eps * identity
        if width == 2:  # BERT's and the default groups: Eq. 3 in closed form, no host sync
            whitening = inverse_sqrt_2x2(covariance)
        else:  # RoBERTa's 3 or 4: Eq. 3 as written; eigh checks on the host: a sync (eager)
            eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
            inverse_sqrt = torch.diag_embed(eigenvalues.clamp_min(1e-12).rsqrt())
            whitening = eigenvectors @ inverse_sqrt @ eigenvectors.transpose(1, 2)
        whitened = centred @ whitening
    whitened = whitened if x.dtype == torch.float64 else whitened.float()  # fp32 out
    return whitened.transpose(0, 1).reshape(n, d)[:, torch.argsort(perm)]  # Eq. 6: unshuffled


def multi_positive_info_nce(views, temp: float = 0.05) -> torch.Tensor:
    """Multi-positive InfoNCE (Eq. 7 with lambda_m = 1): the sum over p = 2..m of CE(s(z_1, z_p)),
    s = cos / temp (temp: the temperature), z_1 the anchor (the m views' first): a sum over the
    m - 1 positives, so at m = 3 about twice SimCSE's loss."""
    # Code over paper: m counts the anchor (released num_pos 3: z1, z2, z3, two CE terms), as the
    # paper's "positives 2" is SimCSE's pair (Table 6); Eq. 7 sums p = 1..m beside its anchor h_i
    if len(views) < 2 or any(z.dim() != 2 or z.shape != views[0].shape for z in views):
        raise ValueError(f"views: m >= 2 (N, D) views of the same N sentences, got "
                         f"{[tuple(z.shape) for z in views]}")
    anchor = views[0]
    labels = torch.arange(len(anchor), device=anchor.device)
    return sum(F.cross_entropy(cos_sim(anchor, z) / temp, labels) for z in views[1:])


class WhitenedHead(torch.nn.Module):
    """The training head on [CLS] (Section 4.1): shuffled group whitening, then Linear(D, D) and
    Tanh; dropped at evaluation, which reads [CLS]. num_groups None: groups of 2 channels, D / 2."""
    def __init__(self, hidden_size: int, num_groups: int | None = None, init_std: float = 0.02):
        super().__init__()
        self.num_groups = num_groups or hidden_size // 2
        self.linear = torch.nn.Linear(hidden_size, hidden_size)
        torch.nn.init.normal_(self.linear.weight, std=init_std)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, cls: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
        """perm None: no whitening (Table 6's dropout-only positives)."""
        if perm is not None:
            cls = shuffled_group_whitening(cls, self.num_groups, perm)
        return torch.tanh(self.linear(cls))


def whitenedcse_views(encoder, batch: dict, num_pos: int = 3, *, dtype=None) -> tuple:
    """The [CLS] features of `num_pos` dropout views of N sentences, in fp32: one pass of `encoder`
    (in train mode) over the batch repeated num_pos times, autocast to `dtype` if one is given."""
    views = {k: v.repeat(num_pos, 1) for k, v in batch.items()}
    device = batch["input_ids"].device
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):  # the encoder only
        outputs = encoder(**views)
    return outputs.last_hidden_state[:, 0].float().chunk(num_pos)


def whitenedcse_objective(*cls, head: WhitenedHead, generator=None, temp: float = 0.05,
                          shuffle: bool = True, whiten: bool = True, gather=None,
                          global_whitening: bool = False) -> torch.Tensor:
    """Each view shuffled (a fresh channel permutation per view and step, Eq. 11, from `generator`),
    whitened in groups and through the head; the multi-positive InfoNCE of the views (Eq. 7).
    shuffle False: Table 4's one grouping; whiten False: Table 6's dropout-only positives. gather:
    torchrun's; each process whitens its own rows (the released code's) unless global_whitening."""
    if global_whitening and gather is not None:  # each covariance over the global batch
        cls = [gather(c) for c in cls]
    hidden, device = cls[0].shape[1], cls[0].device
    perms = [torch.randperm(hidden, generator=generator, device=device) if shuffle else
             torch.arange(hidden, device=device) for _ in cls]
    views = [head(c, perm if whiten else None) for c, perm in zip(cls, perms)]
    if gather is not None and not global_whitening:  # Code over paper: whitened, then gathered
        views = [gather(v) for v in views]
    return multi_positive_info_nce(views, temp)


def whitenedcse_step(encoder, batch: dict, head: WhitenedHead, generator=None, num_pos: int = 3,
                     temp: float = 0.05, *, dtype=None, gather=None, shuffle: bool = True,
                     whiten: bool = True, global_whitening: bool = False) -> torch.Tensor:
    """One step's WhitenedCSE loss, to back-propagate: a transformers encoder (AutoModel, in train
    mode) and its tokenizer's output for a list of sentences. A whole step, as a program:

        from transformers import AutoModel, AutoTokenizer
        path = "bert-base-uncased"  # the encoder: a Hub id or a local folder
        tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path)
        head = WhitenedHead(model.config.hidden_size)  # groups of 2 channels, then the MLP
        optimizer = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=3e-5)
        sentences = ["A man plays a guitar.", "A woman slices an onion.", "Two dogs run."]
        batch = tokenizer(sentences, padding=True, truncation=True, max_length=32,
                          return_tensors="pt")
        loss = whitenedcse_step(model.train(), batch, head)
        loss.backward(); optimizer.step(); optimizer.zero_grad()

    The defaults are the recipe's (RECIPE: 3 views, groups of 2 channels), and a batch has more rows
    than a group has channels. The arguments: whitenedcse_views's and whitenedcse_objective's."""
    cls = whitenedcse_views(encoder, batch, num_pos, dtype=dtype)
    return whitenedcse_objective(*cls, head=head, generator=generator, temp=temp, shuffle=shuffle,
                                 whiten=whiten, gather=gather, global_whitening=global_whitening)


def inverse_sqrt_2x2(covariance: torch.Tensor) -> torch.Tensor:
    """The whitening's Eq. 3 for groups of 2 channels, after the paper's path (eigh): C^-1/2 of
    each 2 x 2 covariance [[a, b], [b, c]] (G, 2, 2), the ZCA matrix eigh gives, written out: W =
    f(l1) u u^T + f(l2) w w^T, f(l) = max(l, 1e-12)^-1/2 (eigh's floor), l1 >= l2 the eigenvalues,
    u the eigenvector of l1, w its normal. l1 = (a + c) / 2 + |((a - c) / 2, b)| adds two positive
    numbers; l2 = det C / l1, not (a + c) / 2 - |...|, a difference that cancels (to 0 in fp32 for
    l2 = 4e-10 beside l1 = 0.036). Call it in float64, as the whitening does."""
    a, b, c = covariance[:, 0, 0], covariance[:, 0, 1], covariance[:, 1, 1]
    half_gap = torch.hypot((a - c) / 2, b)
    high = (a + c) / 2 + half_gap
    low = (a * c - b * b) / high.clamp_min(torch.finfo(high.dtype).tiny)  # 0 / tiny for a 0 group
    # u ~ (high - c, b) or (b, high - a), whichever has no cancellation; (1, 0) where l1 = l2
    u = torch.where((a >= c)[:, None], torch.stack([(a - c) / 2 + half_gap, b], -1),
                    torch.stack([b, (c - a) / 2 + half_gap], -1))
    u = u / u.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(u.dtype).tiny)  # no underflow
    u = torch.where((half_gap > 0)[:, None], u / u.norm(dim=-1, keepdim=True).clamp_min(1e-30),
                    torch.stack([torch.ones_like(b), torch.zeros_like(b)], -1))  # no host copy
    w = torch.stack([-u[:, 1], u[:, 0]], -1)
    return sum(f.clamp_min(1e-12).rsqrt()[:, None, None] * v[:, :, None] * v[:, None, :]
               for f, v in ((high, u), (low, w)))
# --- end of the objective ---


def group_width(hidden: int, num_groups: int) -> int:
    """Channels per SGW group, `num_groups` checked to divide the hidden size."""
    if hidden % num_groups:
        raise plumbing.UsageError(f"--num_groups {num_groups} does not divide the hidden size "
                                  f"{hidden}; use groups of 2 channels: --num_groups {hidden // 2}")
    return hidden // num_groups


def train_step(ddp_model, head, generator, params, optimizer, scaler, args, batch: dict,
               global_rows: int):
    """One optimizer step on this process's rows of the global batch; (loss, gradient norm)."""
    optimizer.zero_grad(set_to_none=True)  # before the passes: the old gradients freed
    loss_options = dict(head=head, generator=generator, temp=args.temp, shuffle=not args.no_shuffle,
                        whiten=not args.no_whitening, global_whitening=args.global_whitening,
                        gather=functools.partial(distributed.gather, rows=global_rows))
    dtype = common.amp_dtype(args.precision)  # autocast's, for the encoder's pass
    if not args.micro_batch_size:  # the paper's step: whitenedcse_step, then backward
        loss = whitenedcse_step(ddp_model, batch, num_pos=args.num_pos, dtype=dtype, **loss_options)
        scaler.scale(loss).backward()  # through the whitening (not its covariance)
    else:  # GradCache: the same loss and gradients, K sentences at once (views, then objective)
        loss = common.grad_cache(
            lambda part: whitenedcse_views(ddp_model, data.part_of(batch, part), args.num_pos,
                                           dtype=dtype),
            functools.partial(whitenedcse_objective, **loss_options),
            len(batch["input_ids"]), args.micro_batch_size, scaler.scale, ddp_model)
    scaler.unscale_(optimizer)  # fp16: clip the true gradients
    grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm or float("inf"))
    scaler.step(optimizer)  # fp16: a step whose gradients overflowed is skipped
    scaler.update()
    return loss, grad_norm


def main(argv=None):
    args = parse_args(argv)
    run = Run(args)  # every flag checked, the seeds set, the device (and torchrun's process group)
    device = run.device

    # The data: a batch padded to --max_seq_length under a CUDA graph, else to its longest row
    with distributed.main_process_first():  # downloads and datasets' cache: process 0 first
        tokenizer, backbone = hub.load_pretrained(args.model_name_or_path)
        prebuilt_mask, switched_on = run.check_encoder(backbone, tokenizer)  # its [CLS]
        vars(args).update(switched_on)  # the model's --dropout, --fit_memory's memory flags
        examples, train_file, subset = data.training_examples(args)
        corpus = data.TokenizedCorpus(examples, tokenizer, args.max_seq_length,
                                      data.pad_multiple(args))  # --compile: a multiple of 8
    hidden = backbone.config.hidden_size
    args.num_groups = args.num_groups or hidden // 2  # no backbone setting: groups of 2 channels
    width = group_width(hidden, args.num_groups)
    processes = 1 if args.global_whitening else distributed.world_size()
    if args.batch_size // processes <= width:  # rows <= a group's channels: a singular covariance
        raise plumbing.UsageError(f"groups of {width} channels need --batch_size above "
                                  f"{width * processes}{f' ({width} a process)' * (processes > 1)}")
    loader = data.make_loader(corpus, args, device, min_rows=(width + 1) * processes)  # likewise
    total_steps = args.max_steps if args.max_steps is not None else args.epochs * len(loader)

    # The model: SGW, Linear and Tanh on [CLS] for training; evaluation reads [CLS].
    backbone.to(device).train()
    common.set_dropout(backbone, args.dropout)  # --dropout (SimCSE Table 3); None: the model's own
    head = WhitenedHead(hidden, args.num_groups, backbone.config.initializer_range).to(device)
    model = common.BackboneWithHeads(backbone, head, prebuilt_mask=prebuilt_mask)
    params = [p for p in model.parameters() if p.requires_grad]
    ddp_model = distributed.data_parallel(model, args.compile)  # DDP under torchrun; --compile
    # The optimiser
    optimizer, scheduler = common.make_optimizer(params, args, total_steps)
    scaler = common.grad_scaler(device, args.precision)  # fp16's loss scaling, else a pass-through
    generator = torch.Generator(device).manual_seed(args.seed)  # the shuffles, alike everywhere
    # Code over paper: Section 4.1 evaluates the MLP's output; the released code, [CLS] before it
    eval_pooler = "cls_before_pooler"
    eval_encoder = common.Encoder(model, None, tokenizer, eval_pooler, device)

    # The loop
    run.start(loader, total_steps, eval_encoder, [backbone, head], train_file, subset,
              backbone=backbone, head=head, optimizer=optimizer, scheduler=scheduler,
              scaler=scaler, shuffle_generator=generator)  # what last/ saves
    batches = data.batches(loader)  # epoch after epoch
    one_step = functools.partial(train_step, ddp_model, head, generator, params, optimizer,
                                 scaler, args)
    # On one CUDA GPU the step is by default replayed from a CUDA graph (--no_cuda_graph: eager).
    train = graph.StepGraph(one_step, optimizer, args.cuda_graph, generators=[generator])
    for step in run.steps():  # 0: the initial model; --resume: after last/'s; a signal ends it
        if step > 0:
            global_rows, batch = next(batches)  # global_rows: the batch's over all processes
            loss, grad_norm = train({k: v.to(device, non_blocking=True) for k, v in batch.items()},
                                    global_rows)
            scheduler.step()  # outside the step (and its graph): the next step's lr
            run.record(loss, grad_norm)  # on the device till a log: no host sync
        if step % args.eval_steps == 0 or step == total_steps:  # the dev gate: STS-B dev
            if run.dev_gate(step) > run.best_dev:  # the first defined score saves
                run.save_best(step, backbone, head, tokenizer, eval_pooler)  # best/ and its score

    # The end: best/ evaluated as eval_sts.py evaluates it (7 STS tasks, ...), then results.json.
    run.write(run.evaluate_best(eval_pooler))


if __name__ == "__main__":
    plumbing.cli(main)
