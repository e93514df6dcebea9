"""What every method file shares: the training flags, SimCSE's poolers and MLP head, the encoder,
the embeddings, mixed precision, the optimiser, GradCache's backward (each loss is its file's own).
It imports nothing of the suite, so a copy works on its own. Each method file runs its own loop;
data.py the data, eval_sts.py the dev gate's STS metric, plumbing/ what a first reading skips."""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

# avg_first_last averages the first transformer layer and the last (SimCSE's code); the SimCSE++,
# SSCL and miCSE forks average the embedding output and the last instead: avg_embeddings_last.
POOLERS = ("cls", "cls_before_pooler", "avg", "avg_top2", "avg_first_last", "avg_embeddings_last")
# (flag, type, default, help): unsupervised SimCSE, BERT-base (Table A.1); a method's presets come
# on top, the user's flags win. --pooler, --precision, the run's flags: plumbing/options.py.
FLAGS = [
    ("model_name_or_path", str, "bert-base-uncased", "HF model id or local directory"),
    ("train_file", str, None, "corpus (default: HF wiki1m_for_simcse.txt)"),
    ("fraction", float, 1.0, "train on a round(fraction * n) subset (miCSE's with --seed 48-52)"),
    ("seed", int, 42, "seed for the subset, shuffling, dropout and init"),
    ("batch_size", int, 64, "sentences per step, over all processes (Table A.1)"),
    ("lr", float, 3e-5, "peak learning rate (Table A.1)"),
    ("max_seq_length", int, 32, "truncate training sentences to this many tokens"),
    ("epochs", int, 1, "passes over the training examples"),
    ("max_steps", int, None, "stop after this many steps (overrides --epochs)"),
    ("warmup_steps", int, 0, "linear warm-up steps before the linear decay"),
    ("max_grad_norm", float, 1.0, "gradient clipping (the HF Trainer's); 0 disables"),
    ("temp", float, 0.05, "InfoNCE temperature tau"),
    ("dropout", float, None, "the encoder's dropout rate (SimCSE Table 3; default: the model's)"),
    ("eval_steps", int, 125, "evaluate STS-B dev every this many steps"),
    ("senteval_dir", str, None, "SentEval data folder (default: HF senteval.tar)"),
]


# -------------------------------------------------------------------------------------------- model
def pool(hidden_states, attention_mask, pooler: str, pooler_output=None) -> torch.Tensor:
    """SimCSE's poolers over the hidden states (embeddings, layer 1, ..., L); means in fp32."""
    if pooler == "cls":
        if pooler_output is None:
            raise ValueError("this model has no pooler layer; use cls_before_pooler")
        return pooler_output
    if pooler == "cls_before_pooler":
        return hidden_states[-1][:, 0]
    layer = {"avg": lambda: hidden_states[-1],
             "avg_top2": lambda: (hidden_states[-2] + hidden_states[-1]) / 2.0,
             "avg_first_last": lambda: (hidden_states[1] + hidden_states[-1]) / 2.0,
             "avg_embeddings_last": lambda: (hidden_states[0] + hidden_states[-1]) / 2.0}[pooler]()
    mask = attention_mask.unsqueeze(-1).float()
    return (layer.float() * mask).sum(1) / mask.sum(1)


class MLPHead(nn.Sequential):
    """SimCSE's training head on [CLS]: Linear(D, D) + Tanh, initialised as BERT's layers."""
    def __init__(self, config):
        super().__init__(nn.Linear(config.hidden_size, config.hidden_size), nn.Tanh())
        nn.init.normal_(self[0].weight, std=getattr(config, "initializer_range", 0.02))
        nn.init.zeros_(self[0].bias)


class BackboneWithHeads(nn.Module):
    """What a step trains, one module, so that DDP averages every gradient: the backbone and its
    heads; its forward is the backbone's alone. BERT's pooler is in no loss (SimCSE trains its own
    head): frozen. `prebuilt_mask`: pass the 4-D mask, where it gives the model's own outputs."""

    def __init__(self, backbone, *heads, prebuilt_mask: bool = True):
        super().__init__()
        self.backbone, self.heads = backbone, nn.ModuleList(h for h in heads if h is not None)
        self.prebuilt_mask = prebuilt_mask
        if getattr(backbone, "pooler", None) is not None:
            backbone.pooler.requires_grad_(False)

    def forward(self, attention_mask, **inputs):
        if self.prebuilt_mask:
            attention_mask = attention_mask_4d(attention_mask,
                                               self.backbone.config._attn_implementation)
        return self.backbone(attention_mask=attention_mask, **inputs)


def attention_mask_4d(attention_mask, attn_implementation: str):
    """The mask transformers would build, prebuilt: a 2-D one it checks on the host (masking_utils:
    padding_mask.all(), a sync each pass), a 4-D one it takes as given (same outputs, tested)."""
    mask = attention_mask[:, None, None, :].bool()
    if attn_implementation == "sdpa":
        return mask
    if attn_implementation == "eager":
        return torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    return attention_mask  # flash attention unpads with the 2-D mask


def dropout_slots(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """Where an encoder keeps its dropout rates: each nn.Dropout's `p`, and the float rate some
    attention modules pass to their kernel (ModernBERT's `attention_dropout`)."""
    return [(m, "p") if isinstance(m, nn.Dropout) else (m, "attention_dropout")
            for m in module.modules() if isinstance(m, nn.Dropout)
            or isinstance(getattr(m, "attention_dropout", None), float)]


def set_dropout(module: nn.Module, p: float | None) -> None:
    """--dropout: every dropout rate of the encoder and the config's (a checkpoint says what it
    used: BERT's names, DistilBERT's and ModernBERT's)."""
    if p is None:
        return
    for m, slot in dropout_slots(module):
        setattr(m, slot, p)
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout",
                 "attention_dropout", "embedding_dropout", "mlp_dropout"):
        if hasattr(getattr(module, "config", None), name):
            setattr(module.config, name, p)


def repeat_views(batch: dict, num_views: int) -> dict:
    """The batch stacked `num_views` times: one forward pass, a dropout mask for each copy."""
    return {k: v.repeat(num_views, 1) for k, v in batch.items()}


def embed(hidden_states, attention_mask, pooler: str, head=None) -> torch.Tensor:
    """The training embedding z, after the autocast block, so in fp32: the pooled sentence; for
    "cls" the last [CLS] through the head."""
    if pooler == "cls":
        return head(hidden_states[-1][:, 0].float())
    return pool(hidden_states, attention_mask, pooler).float()


def block_pool(pooler: str, head=None, blocks_own: str = "cls"):
    """A method block's `pool` for --pooler: None for the block's own (the paper's: [CLS] through
    the head, SSCL's the average), else pool(hidden_states, attention_mask) -> fp32 (embed's)."""
    return None if pooler == blocks_own else functools.partial(embed, pooler=pooler, head=head)


def eval_pooler(args) -> str:
    """SimCSE: with --mlp_only_train the [CLS] pooler is evaluated before the MLP."""
    return "cls_before_pooler" if args.pooler == "cls" and args.mlp_only_train else args.pooler


class Encoder:
    """encode(list[str]) -> np.ndarray: `backbone` (or BackboneWithHeads: its prebuilt mask), the
    evaluation pooler ("cls" with a head: the trained head), then `projection` (SSCL Table 5); fp32,
    no grad, <= 512 tokens. Halves tokenize / on_device (kept on the device): the gate's."""
    def __init__(self, backbone, head, tokenizer, pooler: str, device, projection=None):
        self.backbone, self.head, self.tokenizer, self.pooler = backbone, head, tokenizer, pooler
        self.device, self.projection = device, projection
        self.max_length = min(getattr(tokenizer, "model_max_length", 512) or 512, 512)

    def tokenize(self, sentences):
        return self.tokenizer(sentences, padding=True, truncation=True, max_length=self.max_length,
                              return_tensors="pt").to(self.device)

    @torch.no_grad()
    def on_device(self, batch) -> torch.Tensor:
        outputs = self.backbone(**batch, output_hidden_states=True)
        if self.pooler == "cls" and self.head is not None:
            z = self.head(outputs.last_hidden_state[:, 0]).float()
        else:
            z = pool(outputs.hidden_states, batch["attention_mask"], self.pooler,
                     getattr(outputs, "pooler_output", None)).float()
        return z if self.projection is None else self.projection(z)

    def __call__(self, sentences):
        return self.on_device(self.tokenize(sentences)).cpu().numpy()


# ---------------------------------------------------------------------------------------- training
def amp_dtype(precision: str):
    """--precision's autocast dtype: torch.bfloat16, torch.float16, or None (fp32: no autocast)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def autocast(device: torch.device, precision: str):
    """Mixed precision for the encoder's forward pass only; fp32 is no autocast at all."""
    dtype = amp_dtype(precision)
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None)


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """fp16's loss scaling (the authors' --fp16 Trainer runs had it); a pass-through otherwise."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def make_optimizer(params, args, total_steps: int):
    """AdamW, no weight decay, linear schedule with warm-up (the authors' Trainer); fused on CUDA
    and CPU: step counts stay on the device (foreach reads them with .item()), no sync for fp16."""
    params = [p for p in params if p.requires_grad]
    fused = params[0].device.type in ("cuda", "cpu") or None
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, fused=fused)
    return optimizer, transformers.get_linear_schedule_with_warmup(optimizer, args.warmup_steps,
                                                                   total_steps)


def grad_cache(encode, loss_of, examples: int, size: int, scale, model, row_loss=None):
    """loss_of(*encode(all)) + row_loss(all) back-propagated with `size` examples' activations at a
    time, the loss and gradients the whole batch's (GradCache, Gao et al. 2021): 1. encode(part) of
    each part, no gradients, its RNG state kept; 2. loss_of on all parts, its gradients to them and
    its own parameters (WhitenedCSE's head); 3. each part encoded again, its dropout replayed, back-
    propagated with its rows of those gradients and row_loss(part) (the MLM term; fresh dropout,
    after all encodings'). scale: GradScaler.scale; model: DDP's no_sync but for the last part."""
    parts = [slice(start, min(start + size, examples)) for start in range(0, examples, size)]
    states, cached = [], []
    with torch.no_grad():
        for part in parts:
            states.append(_rng())
            cached.append(encode(part))
    stream = _rng()  # after every encoding: the RNG that row_loss's passes draw from, in turn
    reps = [torch.cat(p).requires_grad_() for p in zip(*cached)]
    loss = loss_of(*reps)
    own = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(scale(loss), reps + own, allow_unused=True)
    own_grads = [(p, g) for p, g in zip(own, grads[len(reps):]) if g is not None]
    total = loss.detach()
    for i, (part, state) in enumerate(zip(parts, states)):
        _rng(state)
        last = i == len(parts) - 1
        with contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
            pairs = [(out, g[part]) for out, g in zip(encode(part), grads) if g is not None]
            if row_loss is not None:  # fresh masks: not the next part's replayed ones
                _rng(stream)
                term = row_loss(part)
                stream, total = _rng(), total + term.detach()
                pairs.append((scale(term), None))
            if last and own_grads:  # in the backward DDP averages: d/dp of p . g is g
                pairs.append((sum((p * g).sum() for p, g in own_grads), None))
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    _rng(stream)  # where the whole batch's passes leave it
    return total


def _rng(state=None):  # the RNG streams dropout draws from: read, or set back to `state`
    cuda = torch.cuda.is_initialized()
    if state is None:
        return torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])
