"""SimCSE: Simple Contrastive Learning of Sentence Embeddings (Gao, Yao & Chen, EMNLP 2021).

Unsupervised: a sentence is its own positive, the two views differing only by dropout masks; the other
sentences of the batch are the negatives (InfoNCE, Eq. 4). Supervised (--supervised): NLI entailment
hypotheses are the positives and contradiction hypotheses extra hard negatives (Eq. 5, weighted as Eq. 8).

Headline (Table 5, BERT-base, 7-task STS average): unsupervised 76.25, supervised 81.57.

    python simcse.py                    # unsupervised, BERT-base, wiki1m, Table A.1 settings
    python simcse.py --supervised       # nli_for_simcse.csv, batch 512, lr 5e-5, 3 epochs, MLP kept at eval

Offline: add --model_name_or_path DIR --train_file FILE --senteval_dir DIR.
Choices: the loss is common.info_nce (every method's baseline term lives there); see common.py's docstring
for the shared choices (dropped last batch, step-0 evaluation).
"""
from __future__ import annotations

import sys

import common

# Table A.1 and Appendix A (supervised BERT-base): applied unless the user set the flag.
SUPERVISED_DEFAULTS = {"batch_size": 512, "lr": 5e-5, "epochs": 3, "eval_steps": 250, "mlp_only_train": False}


def parse_args(argv=None):
    parser = common.base_parser(__doc__, method="simcse")
    g = parser.add_argument_group("SimCSE")
    g.add_argument("--supervised", action="store_true",
                   help="train on NLI triplets (sent0, sent1, hard_neg); default file nli_for_simcse.csv; sets "
                        "batch 512, lr 5e-5, 3 epochs, dev every 250 steps, MLP kept at evaluation unless given")
    g.add_argument("--hard_negative_weight", type=float, default=0.0,
                   help="Eq. 8: added to the logit of each anchor's own hard negative (alpha = e^weight)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.supervised:
        given = common.explicit_flags(parser, argv)
        for name, value in SUPERVISED_DEFAULTS.items():
            if name not in given:
                setattr(args, name, value)
    return args


def setup(args, backbone):
    """The encoder with SimCSE's MLP head, and the per-step loss."""
    model = common.SentenceEncoder(backbone, pooler=args.pooler, eval_pooler=common.eval_pooler(args))

    def compute_loss(batch):
        if batch["num_columns"] == 3:  # supervised: anchor, entailment, contradiction, one pass each
            outputs, mask = model.forward_views(batch, num_views=1)
            anchor, positive, hard_negative = model.embed(outputs.hidden_states, mask).chunk(3)
            return common.info_nce(anchor, positive, args.temp, hard_negative, args.hard_negative_weight)
        outputs, mask = model.forward_views(batch, num_views=2)
        z1, z2 = model.embed(outputs.hidden_states, mask).chunk(2)
        return common.info_nce(z1, z2, args.temp)

    return model, compute_loss


def main(argv=None):
    args = parse_args(argv)
    if args.supervised:
        common.run(args, setup, load_examples=common.load_triplets, default_train_file="nli_for_simcse.csv")
    else:
        common.run(args, setup)


if __name__ == "__main__":
    common.cli(main)
