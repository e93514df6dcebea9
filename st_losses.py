"""The five objectives as sentence-transformers losses, trained by ContrastiveTrainer as the method
files train them: each loss calls its method file's own block (<method>_step; its two halves for
GradCache), imported, never copied, so that the two cannot drift. A loss keeps its block's state in
public (loss.head, loss.generator, loss.queue, loss.momentum_encoder: None where the method has
none); ContrastiveTrainer does for it what the trainer does for the model. docs/using.md says what
each adds and what differs from the method file's loop; the README has an example."""
from __future__ import annotations

import functools
import inspect
import types
from pathlib import Path

import torch
import transformers

try:
    import sentence_transformers as st
    from sentence_transformers.sentence_transformer import modules as st_modules
except ImportError:
    raise ImportError("st_losses needs sentence-transformers: pip install sentence-transformers "
                      "accelerate") from None

import common
import data
import micse
import simcse
import simcsepp
import sscl
import whitenedcse
from plumbing import backbones, distributed, files

STATE_FILE = "contrastive_loss.pt"  # in checkpoint-N/: the head, momentum encoder, queue, generator


class BlockEncoder:
    """What a block is handed as `encoder`: the SentenceTransformer's own forward (the trainer's
    model: DDP, autocast) returning the transformers output the block reads (hidden states,
    attention maps); with the model's train and eval (SimCSE++'s dropout-off pass)."""

    def __init__(self, loss):
        self.loss = loss
        self.training, self.train = loss.model.training, loss.model.train

    def eval(self):
        self.loss.model.train(False)

    def __call__(self, attention_mask, output_hidden_states=False, output_attentions=False,
                 **inputs):
        loss, backbone = self.loss, self.loss.backbone
        asked = dict(output_hidden_states=output_hidden_states, output_attentions=output_attentions)
        outputs = []

        def forward(*args, attention_mask=None, **kwargs):  # the Transformer module calls .forward
            if loss.prebuilt_mask:  # the 4-D mask: no host check of the 2-D one (same outputs)
                attention_mask = common.attention_mask_4d(attention_mask,
                                                          backbone.config._attn_implementation)
            outputs.append(type(backbone).forward(backbone, *args, attention_mask=attention_mask,
                                                  **kwargs, **asked))
            return outputs[-1]
        backbone.forward = forward  # for this call alone
        try:
            loss.model(dict(inputs, attention_mask=attention_mask))
        finally:
            del backbone.forward
        return outputs[-1]


class ContrastiveLoss(torch.nn.Module, transformers.TrainerCallback):
    """What the five share: the model set up as the method's (pooling, truncation, attention), the
    batch of the columns, the block called with the loss's keywords and the trainer's, and the
    trainer's events (ContrastiveTrainer adds the loss as a callback: miCSE's after the step)."""
    pooler = "cls_before_pooler"  # what the method evaluates: common.eval_pooler of its recipe
    pad_to_max_length, attn_implementation, columns = False, None, 1
    method, keywords = None, ()  # the method file; what of its block's arguments the loss holds

    def __init__(self, model, max_seq_length: int = 32, micro_batch_size: int | None = None):
        super().__init__()
        name = type(self).__name__
        if not isinstance(model, st.SentenceTransformer) or \
                not isinstance(model[0], st_modules.Transformer):
            raise TypeError(f"{name} takes a SentenceTransformer, a Transformer module first")
        self.model, self.max_seq_length = model, max_seq_length
        self.micro_batch_size = micro_batch_size
        self.head = self.generator = self.queue = self.momentum_encoder = None
        self.trainer, self.last_batch = None, None  # ContrastiveTrainer's; the step's batch
        self.pad_token_id = model.tokenizer.pad_token_id or 0  # (self.model: DDP's, in training)
        backbone = self.__dict__["backbone"] = model[0].auto_model  # (not registered twice)
        wanted = self.attn_implementation
        if wanted and backbone.config._attn_implementation != wanted:
            backbone.set_attn_implementation(wanted)
            print(f"{name}: the model's attention set to {wanted} (AMI reads its maps)")
        if getattr(backbone, "pooler", None) is not None:  # in no loss: frozen, as the suite's
            backbone.pooler.requires_grad_(False)
        # the pooling the method evaluates; after it Normalize alone (which no cosine sees)
        at = next((i for i, m in enumerate(model) if isinstance(m, st_modules.Pooling)), None)
        after = [m for m in list(model)[(at or 0) + 1:] if not isinstance(m, st_modules.Normalize)]
        if at is None or after:
            raise ValueError(f"{name} trains Transformer, Pooling (and Normalize); "
                             f"this model has {[type(m).__name__ for m in model]}")
        mode, old = files.pooling_mode(self.pooler), model[at].pooling_mode
        if old != mode:
            model[at] = st_modules.Pooling(model[at].embedding_dimension, pooling_mode=mode)
            print(f"{name}: the model's {old} pooling switched to {mode}: the method evaluates "
                  f"{self.pooler}")
        padded = ", every batch padded to it (micse.py's)" if self.pad_to_max_length else ""
        print(f"{name}: training sentences truncated to max_seq_length={max_seq_length} tokens "
              f"(the recipe's){padded}")
        difference, _ = backbones.mask_probe(backbone, backbones.probe_batch(model.tokenizer, 8),
                                             lambda mask: common.attention_mask_4d(
                                                 mask, backbone.config._attn_implementation))
        self.prebuilt_mask = difference == 0.0  # where the 4-D mask gives the model's own outputs

    def block(self, part: str, *args, **options):
        """The method file's <method>_<part> (step, views, objective) given, by name, each of the
        loss's `keywords` that it takes (test_st_losses holds every one taken, none renamed)."""
        function = getattr(self.method, f"{self.method.__name__}_{part}")
        taken = inspect.signature(function).parameters
        return function(*args, **{k: getattr(self, k) for k in self.keywords if k in taken},
                        **options)

    def step(self, encoder, batch, **options):
        return self.block("step", encoder, batch, **options)

    def forward(self, features: list, labels=None) -> torch.Tensor:
        if self.trainer is None:
            raise RuntimeError(f"{type(self).__name__} trains with st_losses.ContrastiveTrainer: a "
                               "plain SentenceTransformerTrainer leaves its head unclipped")
        return self.step(BlockEncoder(self), self.batch_of(features), **self.options())

    def batch_of(self, features: list) -> dict:
        """The columns' tokens as one batch (NLI's: anchors, then positives, then negatives), kept
        as the step's (last_batch: AMI's mask, miCSE's momentum update)."""
        keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in features[0]]
        width = max(self.max_seq_length * self.pad_to_max_length,
                    *(f["input_ids"].shape[1] for f in features))
        self.columns, fill = len(features), {"input_ids": self.pad_token_id}
        self.last_batch = {k: torch.cat([torch.nn.functional.pad(f[k], (0, width - f[k].shape[1]),
                                                                 value=fill.get(k, 0))
                                         for f in features]) for k in keys}
        return self.last_batch

    def options(self) -> dict:
        """The block's keywords from the trainer: autocast's dtype (the encoder's passes alone) and
        torchrun's gather (every process's rows: the global batch's negatives)."""
        args = self.trainer.args
        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        rows = len(self.last_batch["input_ids"]) // self.columns * world
        gather = None if world == 1 else functools.partial(distributed.gather, rows=rows)
        return dict(dtype=dtype, gather=gather)


class SimCSELoss(ContrastiveLoss):
    """SimCSE (Gao et al., 2021): a column of sentences, [CLS] through the MLP head, evaluated
    before it; supervised: (anchor, positive, negative) columns, the head kept (a Dense module)."""
    method, keywords = simcse, ("head", "temp", "columns", "hard_negative_weight")

    def __init__(self, model, temp: float = 0.05, supervised: bool = False,
                 hard_negative_weight: float = 0.0, max_seq_length: int = 32,
                 micro_batch_size: int | None = None):
        self.pooler = "cls" if supervised else "cls_before_pooler"
        super().__init__(model, max_seq_length, micro_batch_size)
        self.temp, self.hard_negative_weight = temp, hard_negative_weight
        self.head = common.MLPHead(self.backbone.config).to(model.device)
        if supervised:  # the head's Linear shared with a Dense after the pooling, saved with it
            dense = st_modules.Dense(self.head[0].in_features, self.head[0].out_features)
            dense.linear = self.head[0]
            model.append(dense)


class SimCSEPlusPlusLoss(ContrastiveLoss):
    """SimCSE++ (Xu et al., 2023): off-dropout negatives (a third pass, dropout off) + DCL; [CLS]
    through the MLP head, evaluated before it."""
    method, keywords = simcsepp, ("head", "temp", "m", "dcl_weight", "dcl_temp")

    def __init__(self, model, temp: float = 0.05, m: float = 0.9, dcl_weight: float = 0.1,
                 dcl_temp: float = 5.0, max_seq_length: int = 32,
                 micro_batch_size: int | None = None):
        super().__init__(model, max_seq_length, micro_batch_size)
        self.temp, self.m, self.dcl_weight, self.dcl_temp = temp, m, dcl_weight, dcl_temp
        self.head = common.MLPHead(self.backbone.config).to(model.device)


class SSCLLoss(ContrastiveLoss):
    """SSCL (Chen et al., 2023): intermediate layers' negatives; the average pooler, no head."""
    pooler, method, keywords = "avg", sscl, ("layers", "temp", "both_views", "per_layer")

    def __init__(self, model, temp: float = 0.05, neg_layers: int = 2,
                 neg_layer_index: int | None = None, layer_negatives: str = "both",
                 max_seq_length: int = 32, micro_batch_size: int | None = None):
        super().__init__(model, max_seq_length, micro_batch_size)
        self.temp, self.both_views = temp, layer_negatives == "both"
        self.per_layer = 1 + self.both_views  # the objective's negatives per layer
        self.layers = sscl.negative_layers(self.backbone.config.num_hidden_layers, neg_layers,
                                           neg_layer_index)


class WhitenedCSELoss(ContrastiveLoss):
    """WhitenedCSE (Zhuo et al., 2023): num_pos views' [CLS] whitened in shuffled groups in the head
    (trained, dropped at evaluation); the shuffles from loss.generator, seeded as --seed's."""
    method, keywords = whitenedcse, ("head", "generator", "num_pos", "temp")

    def __init__(self, model, temp: float = 0.05, num_groups: int | None = None, num_pos: int = 3,
                 seed: int = 42, max_seq_length: int = 32, micro_batch_size: int | None = None):
        super().__init__(model, max_seq_length, micro_batch_size)
        self.temp, self.num_pos, config = temp, num_pos, self.backbone.config
        self.head = whitenedcse.WhitenedHead(config.hidden_size, num_groups,
                                             config.initializer_range).to(model.device)
        self.seed, self.generator = seed, torch.Generator(model.device).manual_seed(seed)


class MiCSELoss(ContrastiveLoss):
    """miCSE (Klein & Nabi, 2023): SimCSE + AMI of the views' attention (eager) + a momentum
    encoder's keys queued (its EMA and queue after each optimizer step: on_optimizer_step)."""
    pad_to_max_length, attn_implementation, method = True, "eager", micse
    keywords = ("head", "queue", "generator", "temp", "ami_lambda", "ami_samples", "layers",
                "attention_mask")

    def __init__(self, model, temp: float = 0.05, ami_lambda: float = 2.5e-3,
                 ami_samples: int = 150, ami_min_layer: int | None = None,
                 ami_max_layer: int | None = None, queue_size: int = 384, momentum: float = 0.995,
                 momentum_dropout: float = 0.3, seed: int = 42, max_seq_length: int = 32,
                 micro_batch_size: int | None = None):
        super().__init__(model, max_seq_length, micro_batch_size)
        self.temp, self.ami_lambda, self.ami_samples = temp, ami_lambda, ami_samples
        config, device, self.momentum = self.backbone.config, model.device, momentum
        self.layers = micse.ami_layers(config.num_hidden_layers, ami_min_layer, ami_max_layer)
        self.head = common.MLPHead(config).to(device)
        self.seed, self.generator = seed, torch.Generator(device).manual_seed(seed)
        if queue_size:  # the block's momentum encoder (train mode) and queue
            self.queue = micse.EmbeddingQueue(queue_size, config.hidden_size, device)
            self.momentum_encoder = micse.momentum_copy(self.backbone, momentum_dropout)

    @property
    def attention_mask(self):  # the objective's (AMI's): the step's batch's
        return None if self.last_batch is None else self.last_batch["attention_mask"]

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.queue is not None and self.last_batch is not None:  # its prebuilt mask: no sync
            momentum = common.BackboneWithHeads(self.momentum_encoder,
                                                prebuilt_mask=self.prebuilt_mask)
            micse.micse_momentum_update(momentum, self.backbone, self.last_batch, self.queue,
                                        self.head, self.momentum, **self.options())


class ContrastiveTrainer(st.SentenceTransformerTrainer):
    """A SentenceTransformerTrainer that does for a contrastive loss's own parameters and state what
    it does for the model: the head clipped with the encoder and averaged under DDP, miCSE's EMA and
    queue after each optimizer step (the loss is a callback), the state in each checkpoint-N/ and
    back on resume; with the loss's micro_batch_size=, GradCache's step (common.grad_cache)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        found = [m for loss in (self.loss.values() if isinstance(self.loss, dict) else [self.loss])
                 for m in loss.modules() if isinstance(m, ContrastiveLoss)]
        if len(found) != 1:
            names = ", ".join(c.__name__ for c in ContrastiveLoss.__subclasses__())
            raise ValueError(f"ContrastiveTrainer trains one of {names}; got {len(found)}")
        self.contrastive = loss = found[0]
        if loss is not self.loss:  # MatryoshkaLoss, AdaptiveLayerLoss: tried, they fail obscurely
            raise ValueError(f"{type(self.loss).__name__} around {type(loss).__name__}: it changes "
                             "the model's sentence_embedding, which these losses do not read (they "
                             "pool the hidden states as their blocks do): train it alone")
        if self.args.gradient_accumulation_steps > 1:
            steps = self.args.gradient_accumulation_steps
            raise ValueError(f"gradient_accumulation_steps={steps}: a "
                             "contrastive loss is no sum over micro-batches (each sees fewer "
                             f"negatives); use {type(loss).__name__}(model, micro_batch_size=K) "
                             "instead, the whole batch's objective exactly (GradCache)")
        loss.trainer, device = self, self.model.device  # the generator and queue go there too
        if loss.generator is not None and loss.generator.device != device:
            loss.generator = torch.Generator(device).manual_seed(loss.seed)
        for name, value in (loss.queue.state_dict() if loss.queue is not None else {}).items():
            setattr(loss.queue, name, value.to(device))
        self.data_collator.max_length = loss.max_seq_length  # the recipe's, in training alone
        # the trainer's NaN/inf filter reads the loss on the host each step: done on the device
        self.nan_inf_filter = self.args.logging_nan_inf_filter
        self.args.logging_nan_inf_filter = False
        self.add_callback(loss)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.contrastive.micro_batch_size:
            loss = self.grad_cache_step(model, inputs)
        else:
            loss = super().training_step(model, inputs, num_items_in_batch)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            in_model = {id(p) for p in model.parameters()}  # DDP averages those; the head here
            grads = [p.grad for p in self.contrastive.parameters()
                     if p.grad is not None and id(p) not in in_model]
            for grad in grads:
                torch.distributed.all_reduce(grad)
            torch._foreach_div_(grads, torch.distributed.get_world_size())
        if self.nan_inf_filter:  # a NaN or inf step counts as the mean so far (the trainer's)
            mean = self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
            loss = torch.where(loss.isfinite(), loss, mean)
        return loss

    def grad_cache_step(self, model, inputs):
        """micro_batch_size=K: common.grad_cache over the block's halves (views, objective), as the
        suite's --micro_batch_size: the whole batch's loss and gradients, K examples at a time."""
        loss_fn = self.contrastive
        model.train()
        inputs = self._prepare_inputs(inputs)
        inputs.pop("dataset_name", None)
        if model is self.model_wrapped and loss_fn.model is not model:
            self.override_model_in_loss(loss_fn, model)
        batch = loss_fn.batch_of(self.collect_features(inputs)[0])
        options, encoder, scaler = loss_fn.options(), BlockEncoder(loss_fn), self.accelerator.scaler
        sync = {"no_sync": model.no_sync} if hasattr(model, "no_sync") else {}  # DDP's
        trained = types.SimpleNamespace(parameters=loss_fn.parameters, **sync)  # head's too
        return common.grad_cache(
            lambda part: loss_fn.block("views", encoder, data.part_of(batch, part, loss_fn.columns),
                                       dtype=options["dtype"]),
            functools.partial(loss_fn.block, "objective", gather=options["gather"]),
            len(batch["input_ids"]) // loss_fn.columns, loss_fn.micro_batch_size,
            scaler.scale if scaler is not None else (lambda t: t), trained)

    def _clip_grad_norm(self, model):  # the head with the encoder, one norm, as the suite clips
        return self.accelerator.clip_grad_norm_(self.contrastive.parameters(),
                                                self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):  # unclipped (max_grad_norm=0): the head's too
        if grad_norm is None:
            grad_norm = self.accelerator.clip_grad_norm_(self.contrastive.parameters(),
                                                         float("inf"))
        return super()._get_grad_norm(model, grad_norm)

    def _save(self, output_dir=None, state_dict=None) -> None:
        """The model (sentence-transformers' files), what eval_sts.py reads beside it (the pooler,
        supervised SimCSE's MLP head) and the loss's state (STATE_FILE)."""
        super()._save(output_dir, state_dict)
        out, loss = Path(output_dir or self.args.output_dir), self.contrastive
        files.write_json(out / files.EVAL_POOLER_FILE, {"pooler": loss.pooler})
        if loss.pooler == "cls":
            files.save_linear(out, files.HEAD_FILE, loss.head[0])
        own = {k: v for k, v in loss.state_dict().items() if not k.startswith("model.")}
        torch.save({"modules": own, "generator": loss.generator and loss.generator.get_state(),
                    "queue": loss.queue and loss.queue.state_dict()}, out / STATE_FILE)

    def _load_from_checkpoint(self, checkpoint, *args, **kwargs) -> None:
        super()._load_from_checkpoint(checkpoint, *args, **kwargs)
        path, loss = Path(checkpoint) / STATE_FILE, self.contrastive
        if not path.is_file():
            raise FileNotFoundError(f"{checkpoint} holds no {STATE_FILE} (the loss's head, queue, "
                                    "generator): ContrastiveTrainer did not save it")
        state = torch.load(path, map_location=self.args.device, weights_only=True)
        loss.load_state_dict(state["modules"], strict=False)  # (the model: the trainer's files)
        if loss.generator is not None:
            loss.generator.set_state(state["generator"].cpu())
        if loss.queue is not None:
            loss.queue.load_state_dict(state["queue"])
