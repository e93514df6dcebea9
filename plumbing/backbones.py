"""What the suite needs of an encoder, checked when it is loaded, before any training: the facts of each family a
method file would otherwise have to know (docs/backbones.md has the table).

- A bidirectional encoder: decoder-only models (GPT-2, Llama, ...) and encoder-decoder models (T5, BART, ...) are
  refused from their config, before their weights are read (`refuse_non_encoder`).
- The attention mask a training pass gives it: common.attention_mask_4d's prebuilt 4-D mask spares transformers' host
  check of a 2-D one, but only some models read a 4-D mask as their own (DeBERTa turns it into NaN, ModernBERT's local
  attention is built from the 2-D mask). `mask_probe` runs the model once on a padded probe batch with each mask (fp32,
  eval mode) and the run keeps the 4-D one only where the outputs are the same.
- Dropout for the views: a model whose every dropout rate is 0 (ALBERT v2, ModernBERT) would give two identical
  views; without --dropout it gets SimCSE's 0.1, and the run summary says so.
- What a method or flag needs: attention weights (miCSE), a list of the layers (--num_layers), one hidden state per
  layer (SSCL's negatives), an MLM head the released code has (--do_mlm).
"""
from __future__ import annotations

import torch
import torch.nn as nn

import common
from plumbing import UsageError

# --do_mlm's head (simcse.mlm_head): the released BertForCL's fresh BertLMPredictionHead, RobertaForCL's pretrained
# lm_head (XLM-RoBERTa's masked LM has the same one)
MLM_HEAD_FAMILIES = ("bert", "roberta", "xlm-roberta")
TOLERANCE = 1e-5  # the largest difference between the two masks' outputs that counts as the same


def refuse_non_encoder(config, name: str, flag: str = "--model_name_or_path") -> None:
    """One line for a model that is not a bidirectional encoder, read from its config."""
    from transformers.models.auto import modeling_auto
    kind = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        raise UsageError(f"{flag} {name} is an encoder-decoder model ({kind}): these methods train a bidirectional "
                         "encoder alone; use one (BERT, RoBERTa, DeBERTa, ModernBERT, ...)")
    decoder_only = kind in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and \
        kind not in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    if decoder_only or getattr(config, "is_decoder", False):
        raise UsageError(f"{flag} {name} is a decoder-only model ({kind}): each token sees only those before it, so "
                         "its first token is no sentence embedding; use a bidirectional encoder (BERT, RoBERTa, "
                         "DeBERTa, ModernBERT, ...)")


def layer_list(backbone) -> nn.ModuleList | None:
    """The ModuleList of the encoder's layers (BERT's encoder.layer, DistilBERT's transformer.layer, ModernBERT's
    layers), or None where there is none of num_hidden_layers modules (ALBERT shares one layer across its depth)."""
    depth = backbone.config.num_hidden_layers
    found = [m for name, m in backbone.named_modules() if isinstance(m, nn.ModuleList) and len(m) == depth]
    return found[0] if len(found) == 1 else None


def probe_batch(tokenizer, length: int) -> dict:
    """Two rows: one of `length` tokens and one of a few, padded to `length`."""
    words = "the quick brown fox jumps over the lazy dog " * length
    batch = tokenizer([words, "the dog"], padding="max_length", truncation=True, max_length=length, return_tensors="pt")
    return {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}


@torch.no_grad()
def mask_probe(backbone, batch: dict, prebuilt_mask, attentions: bool = False) -> tuple[float, object]:
    """The largest difference, over the real tokens of every hidden state, between the model's outputs with the 2-D
    mask and with `prebuilt_mask(batch["attention_mask"])` (NaN counts as infinite), and the 2-D pass's outputs
    (with the attention weights if `attentions`); fp32, eval mode (no dropout: no random draw)."""
    was_training = backbone.training
    backbone.eval()
    try:
        own = backbone(**batch, output_hidden_states=True, output_attentions=attentions)
        inputs = dict(batch, attention_mask=prebuilt_mask(batch["attention_mask"]))
        prebuilt = backbone(**inputs, output_hidden_states=True)
    finally:
        backbone.train(was_training)
    real = batch["attention_mask"].bool()
    difference = max((a[real] - b[real]).abs().nan_to_num(torch.inf).max().item()
                     for a, b in zip(own.hidden_states, prebuilt.hidden_states))
    return difference, own


def check(backbone, tokenizer, args, prebuilt_mask, attentions: bool = False, layers: bool = False,
          mlm_head: bool = False) -> tuple[bool, list[str]]:
    """Whether training passes may give `backbone` the prebuilt mask, and the notes for the run summary; refused in
    one line (UsageError) where the method cannot work on it (hub.load_pretrained has already refused a model that
    is not a bidirectional encoder). `args.dropout` is set where the model has none."""
    config, name = backbone.config, args.model_name_or_path
    kind, notes = config.model_type, []
    if tokenizer.pad_token_id is None:
        raise UsageError(f"--model_name_or_path {name}: its tokenizer has no padding token, which batches of "
                         "sentences of different lengths need")
    if mlm_head and kind not in MLM_HEAD_FAMILIES:
        raise UsageError(f"--do_mlm: the released code has an MLM head for {', '.join(MLM_HEAD_FAMILIES)}, not for "
                         f"{name} ({kind}); drop --do_mlm")
    if layers and layer_list(backbone) is None:
        raise UsageError(f"--num_layers: {name} ({kind}) keeps no list of its {config.num_hidden_layers} layers "
                         "(ALBERT shares one layer's weights across its depth); drop --num_layers")
    length = min(args.max_seq_length, getattr(config, "max_position_embeddings", 512) - 2)
    difference, own = mask_probe(backbone, probe_batch(tokenizer, length), prebuilt_mask, attentions)
    if not all(torch.isfinite(h).all() for h in own.hidden_states):
        raise UsageError(f"--model_name_or_path {name}: its outputs are not finite on a probe batch in fp32 (damaged "
                         "weights?)")
    if len(own.hidden_states) != config.num_hidden_layers + 1:
        raise UsageError(f"--model_name_or_path {name} ({kind}) returns {len(own.hidden_states)} hidden states for "
                         f"{config.num_hidden_layers} layers: the poolers and SSCL's layers need one a layer")
    if attentions and (not own.attentions or own.attentions[0] is None):
        raise UsageError(f"miCSE needs attention weights and {name} ({kind}, attention "
                         f"{config._attn_implementation}) returns none; use a model with eager attention")
    use_prebuilt = difference <= TOLERANCE
    attention = f"{config._attn_implementation} attention, "
    notes.append(attention + ("a prebuilt 4-D mask (no host check)" if use_prebuilt else
                              f"its own 2-D mask: a prebuilt 4-D one changes its outputs by {difference:.1e}, so "
                              "transformers checks the 2-D one on the host, a sync a pass"))
    if args.dropout is None and not any(getattr(m, slot) > 0 for m, slot in common.dropout_slots(backbone)):
        args.dropout = 0.1
        notes.append("no dropout in this model, and the views need it: --dropout 0.1 (SimCSE's; --dropout 0 keeps "
                     "none)")
    return use_prebuilt, notes


def checkpoint_layers(backbone, name: str, **kwargs) -> None:
    """--gradient_checkpointing: transformers' own, with PyTorch's non-reentrant torch.utils.checkpoint, which keeps
    each layer's RNG state so that the recomputation in the backward pass draws the same dropout masks (`kwargs`:
    more of its arguments, plumbing/memory.py's context_fn). A family without it (ALBERT, MPNet) is one line."""
    if not getattr(backbone, "supports_gradient_checkpointing", False):
        raise UsageError(f"--gradient_checkpointing: {name} ({backbone.config.model_type}) has no gradient "
                         "checkpointing in transformers; use --micro_batch_size to save memory")
    enable_checkpointing(backbone, use_reentrant=False, **kwargs)


def enable_checkpointing(backbone, **kwargs) -> None:
    """transformers' checkpointing of each layer, with these torch.utils.checkpoint arguments."""
    backbone.config.use_cache = False  # an encoder caches nothing; transformers warns otherwise
    if hasattr(backbone, "activation_checkpointing_enable"):  # its name since transformers 5.x
        backbone.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
