"""miCSE: Mutual Information Contrastive Learning for Low-shot Sentence Embeddings (Klein & Nabi,
ACL 2023).

SimCSE plus an attention mutual-information regulariser (AMI) that makes the two dropout views'
attention agree (Eq. 4, Algorithm 1), and a momentum encoder whose keys of past batches wait in a
queue as negatives (Eq. 2). Few-shot: --fraction trains on a subset with the authors' settings.

Headline (Table 2, BERT-base, 7-task STS average): 78.13 on all of wiki1m; at 1% of it 76.40
(SimCSE: 76.15 on all).

    python micse.py --fraction 0.01 --seed 48  # few-shot on the authors' 1% subset (Table 2)
    python micse.py                           # all of wiki1m: batch 50, lr 3e-5, 250 warm-up steps
    python micse.py --queue_size 0            # AMI + SimCSE, the variant the authors released

"Code over paper" marks a line that follows the authors' released code (which made the published
numbers) over the paper; docs/methods.md says how this file settles what the paper leaves open.
"""
import functools

import common
import data
import plumbing
from plumbing import distributed, graph, hub, options
from plumbing.run import Run

ATTN_IMPLEMENTATION = "eager"  # transformers 5's default SDPA returns no attention weights

# The recipe, read first: miCSE on all of wiki1m with BERT-base (Section 3.1, with its queue and
# momentum encoder), trained by AdamW without weight decay, its lr warmed up then decayed linearly.
# Its values are flag defaults (PRESETS' rows replace some); common.FLAGS holds the shared flags.
RECIPE = dict(batch_size=50, lr=3e-5, temp=0.05, max_seq_length=32, epochs=1, warmup_steps=250,
              eval_steps=125, pooler="cls", mlp_only_train=True, ami_lambda=2.5e-3, ami_samples=150,
              queue_size=384, momentum=0.995, momentum_dropout=0.3)
# The paper's settings per fraction of wiki1m (the nearest row to --fraction; flags the user gives
# win): the training commands of the authors' README (SAP-samples) and, for 100%, the recipe's.
PRESETS = {
    1.0: ({k: RECIPE[k] for k in ("batch_size", "lr", "epochs", "warmup_steps", "ami_lambda",
                                  "eval_steps")}, "miCSE's settings for fraction 1 (Section 3.1)"),
    **{fraction: (dict(batch_size=64, lr=1e-5, epochs=epochs, warmup_steps=0, ami_lambda=ami_lambda,
                       eval_steps=eval_steps), f"miCSE's settings for fraction {fraction:g} (the "
                  "authors' README)")
       for fraction, epochs, ami_lambda, eval_steps in ((0.1, 10, 5e-4, 500), (0.01, 50, 1e-4, 500),
           (0.001, 500, 1e-3, 500), (0.0001, 2500, 1e-3, 250))},
}


def parse_args(argv=None):
    parser = options.parser(__doc__, method="micse", recipe=RECIPE)
    g = parser.add_argument_group("miCSE")
    g.add_argument("--ami_lambda", type=float, help="AMI's weight (per fraction)")
    g.add_argument("--ami_min_layer", type=int, default=None,
                   help="AMI's first attention layer, 0-based (default 7 of 12 layers: L-5)")
    g.add_argument("--ami_max_layer", type=int, default=None,
                   help="the end (excluded) of AMI's layers (default 11 of 12: L-1), an even count")
    g.add_argument("--ami_samples", type=int, help="entries sampled a tile (3.1)")
    g.add_argument("--queue_size", type=int, help="queued negatives (0: no queue)")
    g.add_argument("--no_negatives", action="store_true", help="Table 4 / Figure 9: the positive "
                   "pairs alone with AMI, no negatives (with --queue_size 0)")
    g.add_argument("--momentum", type=float, help="the momentum encoder's EMA")
    g.add_argument("--momentum_dropout", type=float, help="its dropout rate")
    known, _ = parser.parse_known_args(argv)
    plumbing.check_range(known, "fraction", lambda v: 0 < v <= 1, "0 < fraction <= 1")
    args = options.parse(parser, argv, PRESETS, lambda known, backbone: [
        options.nearest(PRESETS, known.fraction)])  # the nearest row (the summary says so)
    for name, accepted in (("ami_lambda", ">= 0"), ("queue_size", ">= 0 (0 disables the queue)")):
        plumbing.check_range(args, name, lambda v: v >= 0, accepted)
    plumbing.check_range(args, "ami_samples", lambda v: v >= 2, "at least 2 entries per tile")
    plumbing.check_range(args, "momentum", lambda v: 0 <= v <= 1, "0 <= momentum <= 1")
    plumbing.check_range(args, "momentum_dropout", lambda v: 0 <= v < 1, "0 <= rate < 1")
    if args.no_negatives and args.queue_size:
        parser.error("--no_negatives keeps no negatives to queue: add --queue_size 0")
    # Every batch --max_seq_length wide, eager as in a CUDA graph: micse_step's docstring says why.
    args.pad_to_max_length = True
    return args


# --- the objective: copy this block; it needs only torch ---
import copy  # (the standard library's)
from typing import NamedTuple

import torch  # the block's one dependency: it runs pasted alone
import torch.nn.functional as F


def cos_sim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """All-pairs cosine similarity, (N, D) x (M, D) -> (N, M)."""
    return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T


def positive_only_loss(z1, z2, temp: float = 0.05) -> torch.Tensor:
    """InfoNCE's positive term alone, -cos(z1_i, z2_i) / temp (miCSE Table 4's "w/o negatives"; no
    formula is given: Eq. 1 without its denominator)."""
    return -(F.cosine_similarity(z1, z2, dim=-1) / temp).mean()


def ami_loss(attn1, attn2, num_samples: int = 150, generator: torch.Generator | None = None,
             attention_mask=None) -> torch.Tensor:
    """Attention mutual information (Eq. 4, Algorithm 1) as the authors' code computes it, to
    minimise; `attn1`, `attn2`: the views' attention probabilities of the K (even) layers it scores,
    stacked (N, K, H, n, n), fp32. 1. Tiles: a sample's, head's, layer parity's n x n entries. 2.
    `num_samples` a tile among those valid in both views (> 1e-30; tiles with fewer left out, or
    the poorest's count). 3. Their logs, centred. 4. MI = -1/2 log(1 - rho^2), rho their cosine.
    5. -mean MI x (valid share^2 + 1e-6). `attention_mask` (N, n): only positions some sentence
    fills count, so a batch padded wider scores as padded to its longest (the released code's)."""
    if attn1.dim() != 5 or attn1.shape != attn2.shape:
        raise ValueError(f"attn1 and attn2: (N, K, H, n, n) attention maps of the same batch, got "
                         f"{tuple(attn1.shape)} and {tuple(attn2.shape)}")
    if attn1.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"AMI takes fp32 attention maps (their logs' gradients), got "
                         f"{attn1.dtype}: pass attn.float()")
    if attn1.shape[1] < 2 or attn1.shape[1] % 2:
        raise ValueError(f"AMI needs an even number (>= 2) of layers, got {attn1.shape[1]}")
    inside = None  # which entries are a sentence's: all, or the filled positions' (query, key)
    if attention_mask is not None:
        if attention_mask.shape != (attn1.shape[0], attn1.shape[-1]):
            raise ValueError(f"attention_mask: (N, n) = {(attn1.shape[0], attn1.shape[-1])} for "
                             f"these maps, got {tuple(attention_mask.shape)}")
        filled = attention_mask.bool().any(0)  # up to the batch's longest sentence
        inside = (filled[:, None] & filled).flatten().repeat(attn1.shape[1] // 2)
    tiles1, tiles2 = attention_tiles(attn1), attention_tiles(attn2)  # 1.
    sample = ami_sample(tiles1, tiles2, num_samples, generator, inside)  # 2.
    log1, log2 = centred_logs(tiles1, sample), centred_logs(tiles2, sample)  # 3.
    rho = (log1 * log2).sum(1) / (log1.norm(dim=1) * log2.norm(dim=1)).clamp_min(1e-12)  # 4.
    # Code over paper: Algorithm 1 drops Eq. 4's log; the released code keeps it (and scales).
    # Released code: rho = +-1 gives log(0) = -inf (MI +inf, kept); |rho| > 1 (rounding) the log of
    # a negative number, NaN, replaced by 100. Clamped here: MI <= -log(1e-6) / 2 (fidelity.md)
    mutual_information = -0.5 * torch.log(1 - (rho ** 2).clamp(max=1 - 1e-6))
    mean_mi = torch.where(sample.used, mutual_information, 0.0).sum() / sample.used.sum()  # 5.
    loss = -mean_mi * (sample.valid_fraction ** 2 + 1e-6)
    return torch.where(sample.k >= 2, loss, 0.0)  # fewer than 2 samples carry no correlation


def attention_tiles(attn) -> torch.Tensor:
    """(N, K, H, n, n) -> (N * H * 2, K/2 * n * n): a tile per sample, head and layer parity."""
    # Code over paper: Section 3.1 pools pairs of adjacent heads; the released einops pattern pools
    # each head's layers of one parity (layers 7, 9 and 8, 10 of BERT-base's 7:11) into a tile
    n_batch, _, heads = attn.shape[:3]
    per_parity = [attn[:, parity::2].transpose(1, 2).reshape(n_batch, heads, -1)
                  for parity in (0, 1)]
    return torch.stack(per_parity, dim=2).reshape(n_batch * heads * 2, -1)


class AMISample(NamedTuple):
    index: torch.Tensor  # (tiles, width): entries in the order drawn; the first k are the sample
    sampled: torch.Tensor  # (tiles, width): which of them are (the first k, where valid)
    k: torch.Tensor  # entries a tile: num_samples, else (no tile has that many) the poorest count
    used: torch.Tensor  # (tiles,): the tiles the released code keeps
    valid_fraction: torch.Tensor  # the valid share of the kept tiles' entries (the loss's scale)


def ami_sample(tiles1, tiles2, num_samples: int, generator=None, inside=None) -> AMISample:
    """Which entries AMI reads, every shape fixed (no host sync): `used`, the tiles that count (the
    released code drops the rest); sampled without replacement: the k valid entries of largest
    random keys, topk-sorted (a tile's first k columns); `inside`: the batch's entries, else all.
    The paper's draw, per tile: entries = tile[valid]; entries[torch.randperm(len(entries))[:k]],
    a uniform k-subset of the valid entries, as the keys' top k are (tests/test_micse.py)."""
    # Not the released code's > 0: log's gradient 1/p overflows fp32 for the subnormal probabilities
    # a real encoder's first layers give (MiniLM's layer 0: 2.8e-45); none above 1e-30 overflows
    valid = (tiles1 > 1e-30) & (tiles2 > 1e-30) & (True if inside is None else inside)
    counts = valid.sum(dim=1)
    enough = counts >= num_samples
    some_enough = enough.any()
    used = enough | ~some_enough  # Code over paper: the released code drops the poorer tiles
    k = torch.where(some_enough, num_samples, counts.min())
    # Code over paper: the released code scales by the valid share of the tiles it keeps
    valid_fraction = (counts * used).sum().to(tiles1.dtype) / (used.sum() * (
        valid.shape[1] if inside is None else inside.sum()))
    width = min(num_samples, tiles1.shape[1])
    device = generator.device if generator is not None else tiles1.device
    keys = torch.rand(valid.shape, generator=generator, device=device).to(tiles1.device)
    index = keys.masked_fill(~valid, -1.0).topk(width, dim=1).indices
    sampled = (torch.arange(width, device=k.device) < k) & valid.gather(1, index)
    return AMISample(index, sampled, k, used, valid_fraction)


def centred_logs(tiles, sample: AMISample) -> torch.Tensor:
    """The logs of each tile's sampled entries minus their mean (log-normal -> normal); 0 off it."""
    logs = torch.where(sample.sampled, tiles.gather(1, sample.index), 1.0).log()
    mean = logs.sum(dim=1, keepdim=True) / sample.k.clamp_min(1)
    return torch.where(sample.sampled, logs - mean, 0.0)


def moco_info_nce(z1, z2, queue, temp: float = 0.05, own_keys=None) -> torch.Tensor:
    """InfoNCE with in-batch and queued negatives (Eq. 2): CE over [s(z1, z2) | s(z1, queue)],
    target i (an empty queue: SimCSE's); `own_keys` (N, Q): True where anchor i leaves a key out."""
    if queue.dim() != 2 or queue.shape[1] != z1.shape[1]:
        raise ValueError(f"queue: (Q, {z1.shape[1]}) keys as wide as z1, got {tuple(queue.shape)}")
    logits = torch.cat([cos_sim(z1, z2), cos_sim(z1, queue)], dim=1) / temp
    if own_keys is not None:  # none among the in-batch negatives
        logits = logits.masked_fill(F.pad(own_keys, (len(z2), 0)), -torch.inf)
    # Code over paper: the released code's CE keeps the positive in the denominator (Eq. 2: j != i)
    return F.cross_entropy(logits, torch.arange(len(z1), device=z1.device))


def micse_loss(z1, z2, attn1, attn2, queue, temp=0.05, ami_lambda=2.5e-3, ami_samples=150,
               own_keys=None, generator=None, positives_only=False, terms=None,
               attention_mask=None) -> torch.Tensor:
    """miCSE's objective: InfoNCE at temperature `temp` over the batch and `queue`'s negatives (Eq.
    2) + ami_lambda x AMI of the views' attention (Eq. 4); `positives_only`: Table 4's pairs alone,
    with AMI. z1, z2 (N, D), maps (N, K, H, n, n) of the same N sentences, fp32; a dict given as
    `terms` gets the two terms ("info_nce", "ami") for a log. The recipe's values: RECIPE."""
    if z1.dim() != 2 or z1.shape != z2.shape or attn1.shape[:1] != z1.shape[:1]:
        shapes = ", ".join(str(tuple(t.shape)) for t in (z1, z2, attn1))
        raise ValueError(f"z1, z2 (N, D), attn1 (N, K, H, n, n) of N sentences, got {shapes} "
                         "(stack maps on dim 1)")
    contrastive = positive_only_loss(z1, z2, temp) if positives_only else \
        moco_info_nce(z1, z2, queue, temp, own_keys)
    ami = ami_lambda * ami_loss(attn1, attn2, ami_samples, generator, attention_mask)
    if terms is not None:
        terms.update(info_nce=contrastive.detach(), ami=ami.detach())
    return contrastive + ami


class EmbeddingQueue:
    """The newest `size` keys (the momentum encoder's embeddings of past batches: Eq. 2's queue)
    and their sentences' ids, a ring buffer written in place (a CUDA graph replays it); `filled`:
    the slots that hold a key (the others left out: Eq. 2's growing queue), `position`: the next.
    The paper's first-in, first-out queue holds the same keys, here rotated by `position`."""
    def __init__(self, size: int, dim: int, device=None):
        self.size, self.tensor = size, torch.zeros(size, dim, device=device)
        self.ids = torch.full((size,), -1, dtype=torch.long, device=device)
        self.filled = torch.zeros(size, dtype=torch.bool, device=device)
        self.position = torch.zeros((), dtype=torch.long, device=device)

    def push(self, embeddings: torch.Tensor, ids: torch.Tensor | None = None) -> None:
        if ids is None:  # no sentence ids: none is anyone's own
            ids = torch.full((len(embeddings),), -1, dtype=torch.long, device=self.ids.device)
        if self.size:  # more keys than slots: the newest
            embeddings, ids = embeddings[-self.size:].detach().float(), ids[-self.size:]
            slots = (self.position + torch.arange(len(ids), device=ids.device)) % self.size
            self.tensor.index_copy_(0, slots, embeddings)
            self.ids.index_copy_(0, slots, ids)
            self.filled.index_fill_(0, slots, True)
            self.position.copy_((self.position + len(ids)) % self.size)

    def state_dict(self) -> dict:  # a checkpoint's
        return dict(tensor=self.tensor, ids=self.ids, filled=self.filled, position=self.position)

    def load_state_dict(self, state: dict) -> None:
        if "filled" not in state:  # an older checkpoint's growing queue: its keys, the oldest first
            return self.push(state["tensor"].to(self.ids.device), state["ids"].to(self.ids.device))
        for name, value in state.items():
            getattr(self, name).copy_(value)

    def left_out(self, anchors: int, ids: torch.Tensor | None = None) -> torch.Tensor:
        """(anchors, size): what each anchor leaves out: empty slots and, given the anchors' ids,
        its own sentence queued earlier (this suite's choice: few-shot subsets repeat)."""
        empty = ~self.filled.expand(anchors, -1)
        return empty if ids is None else (self.ids == ids[:, None]) | empty


def encoded(encoder, inputs: dict, head=None, pool=None, dtype=None, **asked) -> tuple:
    """(outputs, z): `encoder` under autocast (`dtype`); z, fp32: [CLS] through `head`, or `pool`"""
    with torch.autocast(inputs["input_ids"].device.type, dtype=dtype, enabled=dtype is not None):
        outputs = encoder(**inputs, output_hidden_states=True, **asked)
    if pool is not None:
        return outputs, pool(outputs.hidden_states, inputs["attention_mask"])
    cls = outputs.hidden_states[-1][:, 0].float()  # out of autocast: fp32
    return outputs, cls if head is None else head(cls)


def default_ami_layers(count: int) -> tuple:
    """AMI's layers (first, end) of `count`: miCSE's 7:11 of 12, L-5:L-1 (under 6: all, even)."""
    # Code over paper: Section 3.1 names layers 8 to 12 (the last); the released 7:11 leaves it out
    return (count - 5, count - 1) if count >= 6 else (0, count // 2 * 2)


def micse_views(encoder, batch: dict, head=None, layers=None, *, pool=None, dtype=None) -> tuple:
    """(z1, z2, attn1, attn2) in fp32: two dropout views of N sentences in one pass (`encoded`),
    and the attention of AMI's `layers` (first, end: default_ami_layers), stacked (N, K, H, n, n)"""
    views = {k: v.repeat(2, 1) for k, v in batch.items() if k != "example_ids"}  # (the suite's ids)
    outputs, z = encoded(encoder, views, head, pool, dtype, output_attentions=True)
    if not outputs.attentions or outputs.attentions[0] is None:
        raise ValueError('the encoder gave no attention maps: load it with attn_implementation='
                         '"eager" (transformers\' default SDPA computes none)')
    first, end = layers or default_ami_layers(len(outputs.attentions))
    attentions = torch.stack(outputs.attentions[first:end], 1).float()
    return (*z.chunk(2), *attentions.chunk(2))


def micse_objective(z1, z2, attn1, attn2, *, queue=None, ids=None, attention_mask=None,
                    generator=None, temp: float = 0.05, ami_lambda: float = 2.5e-3,
                    ami_samples: int = 150, positives_only: bool = False, gather=None,
                    terms=None) -> torch.Tensor:
    """micse_loss with an EmbeddingQueue's keys (None: no queue, the released variant) and the
    sentences' `ids` (given, an anchor's own sentence queued earlier is no negative). `gather`:
    under torchrun, a function that gathers a tensor's rows from every process; None: one."""
    if gather is not None:
        z1, z2, attn1, attn2 = (gather(t) for t in (z1, z2, attn1, attn2))
        attention_mask, ids = (None if t is None else gather(t) for t in (attention_mask, ids))
    keys = queue.tensor if queue is not None else z1.new_zeros(0, z1.shape[1])
    left_out = None if queue is None else queue.left_out(len(z1), ids)
    return micse_loss(z1, z2, attn1, attn2, keys, temp, ami_lambda, ami_samples, left_out,
                      generator, positives_only, terms, attention_mask)


def micse_step(encoder, batch: dict, head=None, queue=None, generator=None, temp: float = 0.05,
               ami_lambda: float = 2.5e-3, ami_samples: int = 150, layers=None, *, pool=None,
               dtype=None, gather=None, positives_only: bool = False, terms=None) -> torch.Tensor:
    """One step's miCSE loss, to back-propagate, from a transformers encoder (AutoModel loaded with
    attn_implementation="eager", in train mode) and its tokenizer's output for some sentences. A
    whole step, as a program:

        from transformers import AutoModel, AutoTokenizer
        path = "bert-base-uncased"  # the encoder: a Hub id or a local folder
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path, attn_implementation="eager")  # attention maps
        d = model.config.hidden_size
        head = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh())  # SimCSE's MLP
        optimizer = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=1e-5)
        momentum_model, queue = momentum_copy(model), EmbeddingQueue(384, d)  # before the loop
        generator = torch.Generator().manual_seed(0)  # AMI's samples are drawn from it
        sentences = ["A man plays a guitar.", "A woman slices an onion.", "Two dogs run."]
        batch = tokenizer(sentences, padding="max_length", truncation=True, max_length=32,
                          return_tensors="pt")  # every batch 32 wide, as micse.py pads it
        loss = micse_step(model.train(), batch, head, queue, generator)
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        micse_momentum_update(momentum_model, model, batch, queue, head)  # after the step

    micse.py pads every batch to --max_seq_length because AMI draws its entries by random keys over
    the maps' whole width; padding=True would draw others (same objective, another run). Defaults
    are RECIPE's (PRESETS' few-shot rows take lr 1e-5, as above); the rest is as in micse_views."""
    z1, z2, attn1, attn2 = micse_views(encoder, batch, head, layers, pool=pool, dtype=dtype)
    return micse_objective(z1, z2, attn1, attn2, queue=queue, ids=batch.get("example_ids"),
                           attention_mask=batch["attention_mask"], generator=generator, temp=temp,
                           ami_lambda=ami_lambda, ami_samples=ami_samples,
                           positives_only=positives_only, gather=gather, terms=terms)


def momentum_copy(encoder, dropout: float = 0.3):
    """The momentum encoder: a copy of `encoder` in train mode whatever its mode (a loaded model's
    is eval), no gradients, every dropout rate at `dropout`: each nn.Dropout's, and the float rate
    that some attention modules pass to their kernel (ModernBERT's attention_dropout)."""
    momentum = copy.deepcopy(encoder).requires_grad_(False).train()
    for module in momentum.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = dropout
        elif isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = dropout
    return momentum


@torch.no_grad()
def ema_update(target: torch.nn.Module, source: torch.nn.Module, momentum: float) -> None:
    """target <- momentum * target + (1 - momentum) * source: every parameter in one lerp kernel."""
    torch._foreach_lerp_(list(target.parameters()), list(source.parameters()), 1.0 - momentum)


@torch.no_grad()
def micse_momentum_update(momentum_encoder, encoder, batch: dict, queue: EmbeddingQueue,
                          head=None, momentum: float = 0.995, *, pool=None, dtype=None,
                          gather=None) -> None:
    """After the optimizer's step: the momentum encoder's weights move towards the encoder's (an
    EMA), then its embeddings of the batch (its own dropout, pooled as z) join `queue`."""
    ema_update(momentum_encoder, encoder, momentum)
    inputs = {k: v for k, v in batch.items() if k != "example_ids"}
    keys, ids = encoded(momentum_encoder, inputs, head, pool, dtype)[1], batch.get("example_ids")
    if gather is not None:
        keys, ids = gather(keys), None if ids is None else gather(ids)
    queue.push(keys, ids)
# --- end of the objective ---


def ami_layers(num_layers: int, first: int | None = None, end: int | None = None) -> tuple:
    """--ami_min_layer/--ami_max_layer, checked; by default the block's default_ami_layers."""
    default = default_ami_layers(num_layers)
    first, end = default[0] if first is None else first, default[1] if end is None else end
    if not 0 <= first < end <= num_layers or (end - first) % 2:
        raise plumbing.UsageError(f"--ami_min_layer/--ami_max_layer {first}:{end} must be an even "
                                  f"number of layers within the model's {num_layers}")
    return first, end


def train_step(ddp_model, backbone, head, momentum_model, queue, generator, params, optimizer,
               scaler, args, batch: dict, global_rows: int):
    """One optimizer step, then the momentum EMA and the queue; (loss, grad norm, {term: value})."""
    terms = {}  # the loss's two terms, logged beside it
    view_options = dict(pool=common.block_pool(args.pooler), dtype=common.amp_dtype(args.precision))
    loss_options = dict(temp=args.temp, ami_lambda=args.ami_lambda, ami_samples=args.ami_samples,
                        positives_only=args.no_negatives, terms=terms,
                        gather=functools.partial(distributed.gather, rows=global_rows))
    layers = (args.ami_min_layer, args.ami_max_layer)  # the attention layers AMI scores
    optimizer.zero_grad(set_to_none=True)  # before the passes: the old gradients freed
    if not args.micro_batch_size:  # the paper's step: micse_step, then backward
        loss = micse_step(ddp_model, batch, head, queue, generator, layers=layers, **view_options,
                          **loss_options)
        scaler.scale(loss).backward()
    else:  # GradCache: the same loss and gradients, K sentences at once (views, then objective)
        loss = common.grad_cache(
            lambda part: micse_views(ddp_model, data.part_of(batch, part), head, layers,
                                     **view_options),
            functools.partial(micse_objective, queue=queue, ids=batch["example_ids"],
                              attention_mask=batch["attention_mask"], generator=generator,
                              **loss_options),
            len(batch["input_ids"]), args.micro_batch_size, scaler.scale, ddp_model)
    scaler.unscale_(optimizer)  # fp16: clip the true gradients
    grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm or float("inf"))
    scaler.step(optimizer)  # fp16: a step whose gradients overflowed is skipped
    scaler.update()
    if momentum_model is not None:  # after the step: the EMA, then this batch's keys queued
        micse_momentum_update(momentum_model, backbone, batch, queue, head, args.momentum,
                              **view_options, gather=loss_options["gather"])
    return loss, grad_norm, terms


def main(argv=None):
    args = parse_args(argv)
    if args.pooler == "avg_first_last":  # Code over paper: the released code's first-last average
        args.pooler = "avg_embeddings_last"  # is of hidden_states[0] (the embeddings) and the last
    run = Run(args)  # every flag checked, the seeds set, the device (and torchrun's process group)
    device = run.device

    # The data
    with distributed.main_process_first():  # downloads and datasets' cache: process 0 first
        tokenizer, backbone = hub.load_pretrained(args.model_name_or_path, ATTN_IMPLEMENTATION)
        prebuilt_mask, switched_on = run.check_encoder(backbone, tokenizer, attentions=True)
        vars(args).update(switched_on)  # the model's --dropout, --fit_memory's memory flags
        examples, train_file, subset = data.training_examples(args)  # the authors' subset if any
        corpus = data.TokenizedCorpus(examples, tokenizer, args.max_seq_length, data.pad_multiple(
            args), example_ids=True)  # every batch max_seq_length wide (parse_args); sentence ids
    args.ami_min_layer, args.ami_max_layer = ami_layers(  # the attention layers AMI scores
        backbone.config.num_hidden_layers, args.ami_min_layer, args.ami_max_layer)
    loader = data.make_loader(corpus, args, device)
    total_steps = args.max_steps if args.max_steps is not None else args.epochs * len(loader)

    # The model: the MLP on [CLS] ("cls"), evaluated before it unless --no-mlp_only_train.
    backbone.to(device).train()
    common.set_dropout(backbone, args.dropout)  # --dropout (SimCSE Table 3); None: the model's own
    head = common.MLPHead(backbone.config).to(device) if args.pooler == "cls" else None
    model = common.BackboneWithHeads(backbone, head, prebuilt_mask=prebuilt_mask)
    params = [p for p in model.parameters() if p.requires_grad]
    ddp_model = distributed.data_parallel(model, args.compile)  # DDP under torchrun; --compile
    # The optimiser
    optimizer, scheduler = common.make_optimizer(params, args, total_steps)
    scaler = common.grad_scaler(device, args.precision)  # fp16's loss scaling, else a pass-through
    generator = torch.Generator(device=device).manual_seed(args.seed)  # AMI's samples
    # The momentum encoder: an EMA copy (dropout 0.3, no gradients nor DDP, SDPA), the head shared;
    # with --queue_size 0 (the released variant) none and no queue: SimCSE's InfoNCE + AMI
    momentum_backbone, momentum_model = None, None
    if args.queue_size:
        momentum_backbone = momentum_copy(backbone, args.momentum_dropout)  # every dropout rate
        if momentum_backbone._supports_sdpa:  # DeBERTa and MPNet have eager attention only
            momentum_backbone.set_attn_implementation("sdpa")
        momentum_model = common.BackboneWithHeads(momentum_backbone, prebuilt_mask=prebuilt_mask)
    queue = EmbeddingQueue(args.queue_size, backbone.config.hidden_size, device)
    eval_pooler = common.eval_pooler(args)
    eval_encoder = common.Encoder(model, head, tokenizer, eval_pooler, device)

    # The loop
    run.start(loader, total_steps, eval_encoder, [backbone, head], train_file, subset,
              backbone=backbone, head=head, optimizer=optimizer, scheduler=scheduler,
              scaler=scaler, ami_generator=generator, momentum_backbone=momentum_backbone,
              queue=queue)  # what last/ saves
    batches = data.batches(loader)  # epoch after epoch
    one_step = functools.partial(train_step, ddp_model, backbone, head, momentum_model, queue,
                                 generator, params, optimizer, scaler, args)
    # On one CUDA GPU the step is by default replayed from a CUDA graph (--no_cuda_graph: eager).
    train = graph.StepGraph(one_step, optimizer, args.cuda_graph, generators=[generator])
    for step in run.steps():  # 0: the initial model; --resume: after last/'s; a signal ends it
        if step > 0:
            global_rows, batch = next(batches)  # global_rows: the batch's over all processes
            loss, grad_norm, terms = train({k: v.to(device, non_blocking=True)
                                            for k, v in batch.items()}, global_rows)
            scheduler.step()  # outside the step (and its graph): the next step's lr
            run.record(loss, grad_norm, terms)  # on the device till a log: no host sync
        if step % args.eval_steps == 0 or step == total_steps:  # the dev gate: STS-B dev
            if run.dev_gate(step) > run.best_dev:  # the first defined score saves
                run.save_best(step, backbone, head, tokenizer, eval_pooler)  # best/ and its score

    # The end: best/ evaluated as eval_sts.py evaluates it (7 STS tasks, ...), then results.json.
    run.write(run.evaluate_best(eval_pooler))


if __name__ == "__main__":
    plumbing.cli(main)
