"""What a run needs of a GPU's memory, known before the run and without a GPU: one training step of its recipe, a dev
gate and the final evaluation, traced on fake tensors built from the model's config (PyTorch's FakeTensorMode:
shapes and dtypes, no data, no download), their peaks counted storage by storage (`PeakTracker`).

The trace follows what a GPU runs where that changes memory:
- CUDA autocast's dtypes, op by op (`CudaAutocast`): a CPU's autocast keeps softmax, layer norm and sums in half
  precision, CUDA's computes them in fp32; the fp16/bf16 copy of each weight is cached for the forward pass as
  CUDA's autocast caches it;
- the attention kernel: a GPU's SDPA runs memory-efficient or flash attention, which keeps no attention matrix
  (`FusedAttention` stands in for it: the output and the log-sum-exp saved, as those kernels save them), while
  eager attention keeps its probabilities: miCSE's, and that of a family without SDPA in transformers (DeBERTa-v2,
  MPNet), which a run of it gets too;
- the order of a step: the gradients set to None before the passes, all passes' graphs alive until the backward
  (or, with --micro_batch_size, one part's: common.grad_cache), AdamW's two moments, the best model's copy
  (checkpoint.BestCopy) and miCSE's momentum encoder beside them.

What it cannot know: the CUDA caching allocator's rounding and fragmentation (`reserved` exceeds `allocated`, by
10-30% in a long run), cuBLAS/cuDNN workspaces (tens of MB), the CUDA context (about 0.5 GB, outside PyTorch's
count), and another process on the GPU. A batch is counted at --max_seq_length tokens a row (a batch is padded to its
longest row, which reaches the limit in most of wiki1m's batches); the evaluations at the longest sentences of
SentEval's files.
"""
from __future__ import annotations

import contextlib
import copy
import weakref
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

import common
import data
from plumbing import UsageError, backbones

# Tokens (bert-base-uncased's WordPiece) of the longest sentence the dev gate encodes (STS-B dev) and the final
# evaluation does (STS13 test), in batches of eval_sts.encode_unique's 128, longest first
DEV_GATE_TOKENS, FINAL_EVAL_TOKENS, EVAL_BATCH = 53, 93, 128

# CUDA autocast's op lists (PyTorch's "Automatic Mixed Precision" page), by the Python name an encoder calls
LOWER = {"linear", "matmul", "mm", "bmm", "baddbmm", "addmm", "addbmm", "addmv", "__matmul__", "conv1d",
         "conv2d", "einsum", "prelu", "scaled_dot_product_attention"}
FP32 = {"softmax", "log_softmax", "softmin", "layer_norm", "group_norm", "rms_norm", "cross_entropy", "nll_loss",
        "exp", "expm1", "log", "log1p", "log2", "log10", "pow", "__pow__", "__rpow__", "sum", "prod", "cumsum",
        "cumprod", "norm", "normalize", "cosine_similarity", "rsqrt", "reciprocal", "mse_loss", "l1_loss",
        "kl_div", "softplus", "acos", "asin", "cosh", "sinh", "tan", "erfinv", "dist", "cdist", "pdist",
        "binary_cross_entropy_with_logits", "renorm"}
PROMOTE = {"cat", "stack", "addcdiv", "addcmul", "index_put", "scatter_add", "where"}


def _tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


class FusedAttention(torch.autograd.Function):
    """What memory-efficient and flash attention keep: the output, and per query row its log-sum-exp (fp32), beside
    the inputs; no n x n matrix. The values are not computed (the trace needs shapes)."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        out = query.new_empty(*query.shape[:-1], value.shape[-1])
        lse = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), None, None, None, None


class SdpaTrace(TorchFunctionMode):
    """A pass traced as a GPU runs it: SDPA as the fused kernel a GPU picks (FusedAttention), the rest as it is (fp32:
    the evaluations, fp32 training); on `_ACTIVE` while on, for a checkpointed layer's recomputation."""

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.pop()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "scaled_dot_product_attention":
            return FusedAttention.apply(*args, *[kwargs.get(k) for k in ("attn_mask", "dropout_p", "is_causal",
                                                                            "scale")])
        return func(*args, **kwargs)


class CudaAutocast(SdpaTrace):
    """CUDA's autocast on any device's tensors: the ops of LOWER get their floating-point inputs in `dtype`, those
    of FP32 in fp32, those of PROMOTE the widest; a weight's cast is cached until the context ends. Above autograd,
    as autocast is, so that the backward pass saves what a GPU's saves."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype, self.cache = dtype, {}

    def cast(self, value, dtype):
        if isinstance(value, (list, tuple)):
            return type(value)(self.cast(v, dtype) for v in value)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dtype == dtype:
            return value
        if value.is_leaf and value.requires_grad:  # a weight: cast once a pass
            key = (id(value), dtype)
            if key not in self.cache:
                self.cache[key] = value.to(dtype)
            return self.cache[key]
        return value.to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in LOWER:
            args, kwargs = self.cast(args, self.dtype), {k: self.cast(v, self.dtype) for k, v in kwargs.items()}
        elif name in FP32:
            args, kwargs = self.cast(args, torch.float32), {k: self.cast(v, torch.float32) for k, v in kwargs.items()}
        elif name in PROMOTE:
            floats = [t.dtype for t in _tensors(args) if t.is_floating_point()]
            if len(set(floats)) > 1:
                widest = torch.float32 if torch.float32 in floats else floats[0]
                args = self.cast(args, widest)
        return super().__torch_function__(func, types, args, kwargs)


_ACTIVE = []  # the passes' modes now on: a checkpointed layer's recomputation runs under the one of its pass


def recompute_as_traced():
    """torch.utils.checkpoint's context_fn: the recomputation of a layer in the backward pass under the mode its
    forward pass ran under (as torch.utils.checkpoint restores a real autocast's state)."""
    mode = _ACTIVE[-1] if _ACTIVE else None
    again = contextlib.nullcontext() if mode is None else \
        CudaAutocast(mode.dtype) if isinstance(mode, CudaAutocast) else SdpaTrace()
    return contextlib.nullcontext(), again


def autocast_of(precision: str):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return CudaAutocast(dtype) if dtype is not None else SdpaTrace()


def nbytes(*things) -> int:
    """Bytes of the modules' parameters and buffers, or of tensors."""
    return sum(t.numel() * t.element_size() for thing in things for t in (
        thing.state_dict().values() if isinstance(thing, torch.nn.Module) else [thing]) if t is not None)


# --------------------------------------------------------------------------------------------------- the step
def build(config, attention: str):
    """The encoder of `config` with fake weights (AutoModel.from_config: no download). `attention`: "eager" (miCSE's
    online encoder: attention weights), or "sdpa", which the family gets where it has SDPA and its eager attention
    otherwise (DeBERTa-v2, MPNet): transformers' default, what hub.load_pretrained gives a run."""
    import transformers
    from torch._subclasses.fake_tensor import FakeTensor
    from transformers.initialization import no_init_weights
    config = copy.deepcopy(config)
    config._attn_implementation = "eager" if attention == "eager" else None  # None: transformers' default
    fake = isinstance(torch.empty(()), FakeTensor)  # under estimate's FakeTensorMode: weights without values
    with no_init_weights() if fake else contextlib.nullcontext():  # ModernBERT's initialiser reads one on the host
        return transformers.AutoModel.from_config(config)


def passes(args) -> dict:
    """What one step of args.method encodes, per process: {"views": copies of the batch in one pass with gradients,
    "columns": NLI's columns (supervised SimCSE), "off": SimCSE++'s dropout-off pass, "mlm": --do_mlm's masked
    pass, "attentions": miCSE's eager attention and AMI's maps, "momentum": miCSE's momentum pass (no gradients)}."""
    method = args.method
    found = {"views": 2, "columns": 1, "off": False, "mlm": bool(getattr(args, "do_mlm", False)),
             "attentions": False, "momentum": False}
    if method == "simcse" and getattr(args, "supervised", False):
        columns = 2 if getattr(args, "no_hard_negatives", False) else 3
        found.update(views=1, columns=columns + bool(getattr(args, "neutral_hard_negatives", False)))
    elif method == "simcse" and getattr(args, "fixed_dropout_mask", False):
        found["views"] = 1
    elif method == "simcsepp":
        found["off"] = not (getattr(args, "no_off_dropout", False) or getattr(args, "dcl_only", False))
    elif method == "sscl" and getattr(args, "no_dropout_positive", False):
        found["views"] = 1
    elif method == "whitenedcse":
        found["views"] = args.num_pos
    elif method == "micse":
        found.update(attentions=True, momentum=bool(args.queue_size))
    return found


def _mlm_head(config):
    import transformers
    if config.model_type in ("roberta", "xlm-roberta"):
        from transformers.models.roberta.modeling_roberta import RobertaLMHead
        return RobertaLMHead(config)
    return transformers.models.bert.modeling_bert.BertLMPredictionHead(config)


def ami_layers(args, num_layers: int) -> tuple[int, int]:
    """miCSE's AMI layers: the run's, else its default (micse.ami_layers)."""
    if getattr(args, "ami_min_layer", None) is not None and getattr(args, "ami_max_layer", None) is not None:
        return args.ami_min_layer, args.ami_max_layer
    return (num_layers - 5, num_layers - 1) if num_layers >= 6 else (0, num_layers - num_layers % 2)


@contextlib.contextmanager
def stored_activations(module):
    """SimCSE++'s dropout-off pass keeps its activations under --gradient_checkpointing (simcsepp_views: eval mode)."""
    checkpointed = [m for m in module.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in checkpointed:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in checkpointed:
            m.gradient_checkpointing = True


def training_step(args, layout: dict, model, head, lm_head, momentum_model, optimizer, batch: dict):
    """One step of the method as its file runs it, memory-wise: the gradients set to None, the passes of `layout`
    under CUDA's autocast (all of them alive until the backward, or one part at a time through common.grad_cache),
    a loss over the embeddings (and AMI's maps), the backward, AdamW's step, miCSE's momentum pass."""
    blocks = layout["columns"] if layout["columns"] > 1 else layout["views"]
    examples = len(batch["input_ids"]) // layout["columns"]
    ami = ami_layers(args, model.backbone.config.num_hidden_layers)

    def encode_part(part):
        inputs = data.part_of(batch, part, layout["columns"])
        views = common.repeat_views(inputs, layout["views"]) if layout["views"] > 1 else inputs
        with autocast_of(args.precision):
            outputs = model(**views, output_hidden_states=True, output_attentions=layout["attentions"])
        z = common.embed(outputs.hidden_states, views["attention_mask"], args.pooler, head)
        reps = list(z.chunk(blocks))
        if layout["attentions"]:  # AMI's layers, stacked, in fp32
            reps += list(torch.stack(outputs.attentions[ami[0]:ami[1]], 1).float().chunk(2))
        if layout["off"]:
            with stored_activations(model), autocast_of(args.precision):
                outputs_off = model(**inputs, output_hidden_states=True)
            reps.append(common.embed(outputs_off.hidden_states, inputs["attention_mask"], args.pooler, head))
        return reps

    def loss_of(*reps):  # InfoNCE over the embeddings; AMI's maps read
        z = [r for r in reps if r.dim() == 2]
        a, b = z[0], z[1] if len(z) > 1 else z[0]  # InfoNCE's cost (simcse.info_nce)
        loss = F.cross_entropy(F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T / 0.05,
                               torch.arange(len(a), device=a.device))
        return loss + sum(r.float().square().mean() for r in reps if r.dim() > 2)

    def mlm_term(part):  # the masked copies of the encoded rows through the encoder and the MLM head
        masked = data.part_of(common.repeat_views(batch, blocks) if layout["columns"] == 1 else batch, part, blocks)
        with autocast_of(args.precision):
            scores = lm_head(model(**masked).last_hidden_state)
        return F.cross_entropy(scores.reshape(-1, scores.shape[-1]).float(), masked["input_ids"].reshape(-1))

    def step():
        optimizer.zero_grad(set_to_none=True)
        row_term = mlm_term if lm_head is not None else None
        if getattr(args, "micro_batch_size", None):
            common.grad_cache(encode_part, loss_of, examples, args.micro_batch_size, lambda loss: loss, model, row_term)
        else:
            loss = loss_of(*encode_part(None))
            if row_term is not None:
                loss = loss + row_term(None)
            loss.backward()
        optimizer.step()
        if momentum_model is not None:  # after the step: the momentum encoder's keys, no gradients
            with torch.no_grad(), autocast_of(args.precision):
                momentum_model(**batch, output_hidden_states=True)
    return step


def evaluation_activations(config, tokens: int) -> int:
    """Bytes above the weights of an evaluation batch (EVAL_BATCH sentences of `tokens`): fp32, eval mode, no
    gradients, every hidden state kept for the pooler (common.Encoder), SDPA's fused kernel."""
    model = common.BackboneWithHeads(build(config, "sdpa")).eval()
    tokens = min(tokens, config.max_position_embeddings - 2)  # cut at the model's length (RoBERTa's 514 - 2)
    tracker = PeakTracker()
    with tracker, torch.no_grad(), SdpaTrace():
        tracker.track(*model.state_dict().values())
        ids = torch.zeros(EVAL_BATCH, tokens, dtype=torch.long)
        outputs = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
        common.pool(outputs.hidden_states, torch.ones_like(ids), "avg")
    return tracker.peak - nbytes(model)


class PeakTracker(TorchDispatchMode):
    """The bytes of the tensor storages alive, op by op, and their peak (a GPU's max_memory_allocated, without its
    allocator's rounding): every op's outputs counted until their storage is freed, `track` for those made before.
    At the peak, the bytes of the gradients then (`grads_at_peak`) of `params`."""

    def __init__(self, params=()):
        super().__init__()
        self.sizes, self.now, self.peak, self.grads_at_peak, self.params = WeakIdKeyDictionary(), 0, 0, 0, params

    def track(self, *tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage not in self.sizes:
                    self.sizes[storage] = storage.nbytes()
                    self.now += storage.nbytes()
                    weakref.finalize(storage, self._free, storage.nbytes())
        if self.now > self.peak:
            self.peak = self.now
            self.grads_at_peak = sum(p.grad.untyped_storage().nbytes() for p in self.params if p.grad is not None)

    def _free(self, size: int) -> None:
        self.now -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(*_tensors(out if isinstance(out, (list, tuple)) else [out]))
        return out


def recipe(args, config, world_size: int = 1) -> SimpleNamespace:
    """One process's training objects for a step of `args` (the method's flags, batch_size over world_size processes,
    max_seq_length, precision, pooler, --micro_batch_size, --gradient_checkpointing), built in the mode that is on
    (FakeTensorMode for `estimate`; real tensors for a measurement): `step()`, `model`, `trainable`, `optimizer`,
    `momentum` (miCSE's momentum encoder, or None), and the bytes of the best model's copy and the queue (`copies`)."""
    layout = passes(args)
    rows, width = args.batch_size // world_size, args.max_seq_length
    backbone = build(config, "eager" if layout["attentions"] else "sdpa").train()
    common.set_dropout(backbone, getattr(args, "dropout", None))
    if getattr(args, "gradient_checkpointing", False):  # a family without it is the run's own line
        backbones.checkpoint_layers(backbone, getattr(args, "model_name_or_path", "this model"),
                                    context_fn=recompute_as_traced)
    head = common.MLPHead(config) if args.pooler == "cls" or args.method == "whitenedcse" else None
    lm_head = _mlm_head(config) if layout["mlm"] else None
    model = common.BackboneWithHeads(backbone, head, lm_head)
    momentum = common.BackboneWithHeads(build(config, "sdpa").requires_grad_(False)) if layout["momentum"] else None
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, fused=True)
    queue = getattr(args, "queue_size", 0) * config.hidden_size * 4 if momentum is not None else 0
    ids = torch.zeros(rows * layout["columns"], width, dtype=torch.long)
    step = training_step(args, layout, model, head, lm_head, momentum, optimizer,
                         {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return SimpleNamespace(step=step, model=model, trainable=trainable, optimizer=optimizer, momentum=momentum,
                           copies=nbytes(backbone, head) + queue, best_copy=nbytes(backbone, head))


def persistent(run: SimpleNamespace) -> list:
    """The tensors a step starts with: the model's, the momentum encoder's, AdamW's moments."""
    found = [*run.model.state_dict().values(), *[t for state in run.optimizer.state.values() for t in state.values()]]
    return found + (list(run.momentum.state_dict().values()) if run.momentum is not None else [])


def measured_step(args, config) -> int:
    """The peak above its starting state of the second step of `recipe` on real CPU tensors, from the allocator's
    own events (torch.profiler's memory events, in time order): what `estimate` traces, counted independently."""
    from torch.profiler import ProfilerActivity, profile
    run = recipe(args, config)
    run.step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run.step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    now = top = 0
    for _, size in events:
        now += size
        top = max(top, now)
    return top


class NoEstimate(UsageError):
    """A model the trace cannot follow (an op that needs the tensors' values, or one fake tensors lack): one line."""


def no_estimate(err: Exception, args, config) -> UsageError:
    """The one line for an estimate that failed with `err`: what no trace on fake tensors can know, named."""
    from torch._subclasses import fake_tensor
    if isinstance(err, UsageError):  # already one line (NoEstimate, a flag the model cannot take)
        return err
    op = getattr(err, "func", None)
    if isinstance(err, (fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException)):
        why = f"its step reads a tensor's value on the host ({op}), and the trace has shapes, no values"
    elif isinstance(err, fake_tensor.UnsupportedOperatorException):
        why = f"its step runs {op}, which the trace's fake tensors do not implement"
    else:
        why = f"{type(err).__name__}: {(str(err).strip().splitlines() or ['?'])[0][:160]}"
    name = getattr(args, "model_name_or_path", "this model")
    return NoEstimate(f"no memory estimate is possible for {name} ({config.model_type}): {why}")


def estimate(args, config, world_size: int = 1, evaluations: bool = True) -> dict:
    """Bytes of one process at its peaks: the training step's, split into "weights" (the model and its heads, the best
    model's copy, miCSE's momentum encoder and queue), "gradients" (those alive at the peak), "optimizer" (AdamW's
    moments) and "activations" (the rest of the peak: activations, their gradients, temporaries), with "step" their sum;
    the dev gate's ("dev_gate": the training state, all its gradients included, and an fp32 evaluation batch) and the
    final evaluation's ("final_eval": the trained model, best/ and the pretrained model loaded beside it; the gradients,
    AdamW's moments and the copy freed). A model the trace cannot follow is one line (NoEstimate)."""
    try:
        return _estimate(args, config, world_size, evaluations)
    except Exception as err:
        raise no_estimate(err, args, config) from err


def _estimate(args, config, world_size: int, evaluations: bool) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        run = recipe(args, config, world_size)
        run.step()  # the first step makes AdamW's moments: the second is every later one
        start = persistent(run)
        tracker = PeakTracker(run.trainable)
        with tracker:
            tracker.track(*start)
            run.step()
        trained = nbytes(run.model) + (nbytes(run.momentum) if run.momentum is not None else 0)
        optimizer = nbytes(*[t for state in run.optimizer.state.values() for t in state.values()])
        found = {"weights": trained + run.copies, "gradients": tracker.grads_at_peak, "optimizer": optimizer,
                 "activations": tracker.peak - trained - optimizer - tracker.grads_at_peak}
        found["step"] = sum(found.values())
        if not evaluations:
            return found
        dev_batch = evaluation_activations(config, DEV_GATE_TOKENS)
        found["dev_gate"] = found["weights"] + nbytes(*run.trainable) + optimizer + dev_batch
        found["final_eval"] = trained + run.copies + max(evaluation_activations(config, FINAL_EVAL_TOKENS),
                                                         run.best_copy + dev_batch)
    return found


# ------------------------------------------------------------------------------------------ what fits a GPU
CONTEXT = 0.5 * 2**30  # the CUDA context and its kernels: outside PyTorch's count
FRAGMENTATION = 0.10  # the caching allocator's rounding and fragmentation: a share of what it holds


def usable(capacity: int) -> int:
    """Of a GPU's `capacity` bytes, what a run may count on: less the CUDA context and 10% for the allocator."""
    return int((capacity - CONTEXT) * (1 - FRAGMENTATION))


def peak(found: dict) -> int:
    return max(found["step"], found["dev_gate"], found["final_eval"])


def settings(batch_per_process: int, checkpointing: bool = True):
    """The settings that train the same objective in less memory, the cheapest first: recomputed layers, then
    GradCache's parts from half the batch down to 8 examples, then both ({flag: value}); GradCache's alone where the
    family has no gradient checkpointing (`checkpointing` False: ALBERT, MPNet)."""
    sizes = [batch_per_process >> i for i in range(1, batch_per_process.bit_length()) if batch_per_process >> i >= 8]
    if not checkpointing:
        return [{"micro_batch_size": k} for k in sizes]
    return ([{"gradient_checkpointing": True}] + [{"micro_batch_size": k} for k in sizes]
            + [{"gradient_checkpointing": True, "micro_batch_size": k} for k in sizes])


def checkpointing(config) -> bool:
    """Whether transformers has gradient checkpointing for the family of `config` (backbones.checkpoint_layers)."""
    import transformers
    return transformers.MODEL_MAPPING[type(config)].supports_gradient_checkpointing


def describe(setting: dict) -> str:
    return " ".join(f"--{k}" if v is True else f"--{k} {v}" for k, v in setting.items())


def first_fit(args, config, capacity: int, world_size: int = 1, found: dict | None = None):
    """(the first of `settings` whose peak fits `capacity` bytes, its estimate), or (None, None); `found`: the
    estimate of args as they are (its evaluations' peaks do not change with the settings)."""
    found = found or estimate(args, config, world_size)
    if max(found["dev_gate"], found["final_eval"]) > capacity:  # no setting changes the evaluations: none is traced
        return None, None
    for setting in settings(args.batch_size // world_size, checkpointing(config)):
        trial = copy.copy(args)
        vars(trial).update(setting)
        step = estimate(trial, config, world_size, evaluations=False)
        if max(step["step"], found["dev_gate"], found["final_eval"]) <= capacity:
            return setting, {**found, **step}
    return None, None


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def device_free(device) -> int | None:
    """Bytes this process may still use on `device` (free, and what it holds already); None off a GPU."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_allocated(device)


def fit(args, config, device, world_size: int = 1, saved_args: dict | None = None,
        smallest=lambda free: free) -> tuple[str | None, dict]:
    """--fit_memory, before the model goes to the GPU: where this exact command's estimated peak exceeds the GPU's
    free memory, the first setting of `settings` that fits (--gradient_checkpointing, then --micro_batch_size K from
    the largest K), switched on in `args`: the same objective. A resumed run (`saved_args`, its started.json's) keeps
    the setting its start chose, with or without the flag. `smallest`: the least free memory of torchrun's
    processes, so that all choose alike. (one line or None, the record for results.json)."""
    if saved_args is not None:  # resumed: the start's choice, whatever this GPU has free
        chosen = {k: saved_args[k] for k in ("gradient_checkpointing", "micro_batch_size") if saved_args.get(k)}
        vars(args).update(chosen)
        return None, {"chose": describe(chosen) if chosen else None, "at": "the run's start"}
    free = device_free(device)
    if free is None:
        why = f"no GPU free-memory figure on {device.type}"
        return f"memory: --fit_memory: {why}, nothing to fit; going on as given", {"chose": None, "why": why}
    free = int(smallest(free))
    found = estimate(args, config, world_size)
    record = {"free_gib": round(free / 2**30, 2), "usable_gib": round(usable(free) / 2**30, 2),
              "estimated_gib": round(peak(found) / 2**30, 2), "chose": None}
    if peak(found) <= usable(free):
        return None, record
    short = f"memory: --fit_memory: this run needs about {gib(peak(found))} and the GPU has {gib(usable(free))} usable"
    if args.gradient_checkpointing and args.micro_batch_size:
        return f"{short}, and it runs both memory flags already: going on", record
    setting, fitted = first_fit(args, config, usable(free), world_size, found)
    if setting is None:
        return (f"{short}; no setting of --gradient_checkpointing and --micro_batch_size fits: going on (a smaller "
                "--batch_size or --max_seq_length, or more GPUs, would)"), record
    graph_off = ", and the CUDA graph off (it takes neither memory flag)" if getattr(args, "cuda_graph", False) else ""
    vars(args).update(setting)
    record.update(chose=describe(setting), fitted_gib=round(peak(fitted) / 2**30, 2))
    if graph_off:  # the graph's padding to --max_seq_length stays: the estimate's
        args.cuda_graph = record["cuda_graph"] = False
    return (f"memory: --fit_memory switched on {describe(setting)}{graph_off}: the same objective in about "
            f"{gib(peak(fitted))} instead of {gib(peak(found))}, of the {gib(usable(free))} this GPU has usable"), \
        record


def check_device(args, config, device, world_size: int = 1) -> str | None:
    """Before training on a GPU: one line when the estimated peak exceeds what the GPU has free, naming the setting
    that fits; None when it fits or off a GPU. The run goes on either way: the estimate leaves out what it cannot
    know (the allocator's fragmentation, other processes), and an out-of-memory error, if it comes, is one line.
    A model the trace cannot follow is one line saying why, and the run goes on."""
    free = device_free(device)
    if free is None:
        return None
    try:
        found = estimate(args, config, world_size)
        if peak(found) <= usable(free):
            return None
        setting, fitted = (None, None) if getattr(args, "micro_batch_size", None) and getattr(
            args, "gradient_checkpointing", False) else first_fit(args, config, usable(free), world_size, found)
    except Exception as err:  # the run does not depend on the estimate
        return f"memory: {no_estimate(err, args, config)}; going on"
    advice = f"{describe(setting)} fits (about {gib(peak(fitted))}), the same objective" if setting else \
        "no setting of --gradient_checkpointing and --micro_batch_size fits: a smaller --batch_size or " \
        "--max_seq_length, or more GPUs (torchrun)"
    return (f"memory: this run needs about {gib(peak(found))} at its peak (plumbing/memory.py's estimate: step "
            f"{gib(found['step'])}, dev gate {gib(found['dev_gate'])}, final evaluation {gib(found['final_eval'])}) "
            f"and the GPU has {gib(free)} free; {advice}. Going on: an out-of-memory error, if it comes, ends the "
            "run in one line")
