"""Tiny random encoders of the transformers families the suite claims, built from their configs with the tests'
WordPiece vocabulary (conftest.WORDS), and two models that are not bidirectional encoders (GPT-2, T5)."""
from pathlib import Path

from conftest import WORDS

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = SPECIALS + WORDS
SIZE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
IDS = dict(pad_token_id=0, bos_token_id=2, eos_token_id=3)
# family -> (config class name, its arguments, whether its tokenizer gives token types)
FAMILIES = {
    "bert": ("BertConfig", dict(**SIZE, max_position_embeddings=64), True),
    "roberta": ("RobertaConfig", dict(**SIZE, **IDS, max_position_embeddings=66, type_vocab_size=1), False),
    "xlm-roberta": ("XLMRobertaConfig", dict(**SIZE, **IDS, max_position_embeddings=66, type_vocab_size=1), False),
    "distilbert": ("DistilBertConfig", dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64,
                                            pad_token_id=0), False),
    "electra": ("ElectraConfig", dict(**SIZE, embedding_size=32, max_position_embeddings=64), True),
    # DeBERTa-v3's attention: relative positions, no absolute ones
    "deberta-v2": ("DebertaV2Config", dict(**SIZE, max_position_embeddings=64, relative_attention=True,
                                           position_biased_input=False, pos_att_type=["p2c", "c2p"],
                                           position_buckets=16, norm_rel_ebd="layer_norm", share_att_key=True,
                                           type_vocab_size=0, pad_token_id=0), True),
    "mpnet": ("MPNetConfig", dict(**SIZE, **IDS, max_position_embeddings=66), False),
    # ModernBERT's sliding-window layers over 8 tokens (its 128 would cover the tests' short sentences); no dropout
    "modernbert": ("ModernBertConfig", dict(**SIZE, **IDS, cls_token_id=2, sep_token_id=3, max_position_embeddings=64,
                                            local_attention=8), False),
    # ALBERT v2's settings: one shared layer, no dropout
    "albert": ("AlbertConfig", dict(**SIZE, embedding_size=16, max_position_embeddings=64, **IDS), True),
}
NOT_ENCODERS = {
    "gpt2": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=2, eos_token_id=3)),
    "t5": ("T5Config", dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
                            pad_token_id=0, eos_token_id=3)),
}
POOLERLESS = {"distilbert", "electra", "deberta-v2", "modernbert"}


def write_model(path: Path, family: str) -> Path:
    """A random `family` model of 2 layers, 32 wide, saved with a WordPiece tokenizer at `path`."""
    import torch
    import transformers
    from transformers import AutoModel, BertTokenizerFast
    config_name, settings, token_types = {**FAMILIES, **{k: (*v, False) for k, v in NOT_ENCODERS.items()}}[family]
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    names = ["input_ids", "token_type_ids", "attention_mask"] if token_types else ["input_ids", "attention_mask"]
    BertTokenizerFast(vocab=str(path / "vocab.txt"), model_input_names=names).save_pretrained(path)
    config = getattr(transformers, config_name)(vocab_size=len(VOCAB), **settings)
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(path)
    return path
