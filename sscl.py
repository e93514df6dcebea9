"""SSCL: Alleviating Over-smoothing for Unsupervised Sentence Representation (Chen et al., ACL 2023).

Adjacent layers of a pretrained encoder give nearly identical sentence representations (inter-layer
over-smoothing, measured by SetSim, Eq. 2). SSCL uses the encoder's own intermediate-layer representations of
the batch as extra negatives for the last layer's (Eq. 4), a plug-in to any contrastive objective.

Headline (Table 2, BERT-base, 7-task STS average): SimCSE 76.25 -> SSCL-SimCSE 77.90.

    python sscl.py                                   # progressive SSCL, layers L-1 and L-2 (Figure 3b's best)
    python sscl.py --neg_layer_index 10              # one chosen layer (Figure 3a)
    python sscl.py --pooler avg --report_oversmoothing

Choices: intermediate-layer negatives keep their gradients (they are part of the same forward pass, not a
detached memory); SetSim is reported for every pair of adjacent transformer layers (1-2, ..., (L-1)-L), on the
layer's sentence representation before the MLP ([CLS] or masked mean), averaged over the distinct STS-B test
sentences.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import common


def parse_args(argv=None):
    parser = common.base_parser(__doc__, method="sscl")
    g = parser.add_argument_group("SSCL")
    g.add_argument("--neg_layers", type=int, default=2,
                   help="k: negatives from layers L-1, ..., L-k below the last (progressive SSCL, Figure 3b: 2)")
    g.add_argument("--neg_layer_index", type=int, default=None,
                   help="use this one hidden-state layer (1..L-1) as the negatives instead (Figure 3a)")
    g.add_argument("--report_oversmoothing", action="store_true",
                   help="write SetSim (Eq. 2) of adjacent layers on STS-B test, before and after training")
    args = parser.parse_args(argv)
    if args.pooler not in ("cls", "avg"):
        parser.error("SSCL trains with --pooler cls or avg (Section 4.2)")
    return args


def sscl_loss(z1, z2, layer_negatives, temp: float = 0.05) -> torch.Tensor:
    """SSCL's contrastive loss with intermediate-layer negatives (Eq. 4).

    logits = [s(z1, z2) | s(z1, n1_l) | s(z1, n2_l) for each layer l], s = cos / temp, target i for row i;
    `layer_negatives` is a list of (n1, n2): one layer's representations of the two dropout views.
    """
    in_batch = common.cos_sim(z1, z2) / temp
    logits = torch.cat([in_batch] + [common.cos_sim(z1, n) / temp for pair in layer_negatives for n in pair], dim=1)
    labels = torch.arange(len(z1), device=z1.device)
    # Code over paper: the authors average this with SimCSE's plain loss; Eq. 4 shows only the first term.
    return (F.cross_entropy(logits, labels) + F.cross_entropy(in_batch, labels)) / 2


def negative_layers(num_layers: int, k: int, index: int | None = None) -> list[int]:
    """hidden_states indices of the negative layers: [index], or L-1, ..., L-k (hidden_states[L] is the last)."""
    if index is not None:
        if not 1 <= index < num_layers:
            raise common.CLIError(f"--neg_layer_index must be in 1..{num_layers - 1}, got {index}")
        return [index]
    if not 0 <= k < num_layers:
        raise common.CLIError(f"--neg_layers must be in 0..{num_layers - 1}, got {k}")
    return [num_layers - i for i in range(1, k + 1)]


def layer_representations(model, hidden_states, attention_mask, layers, num_views=2):
    """Each negative layer's sentence representations, pooled like z, split into the dropout views."""
    # hidden_states[:l + 1] ends at layer l, so model.embed pools (and for [CLS], applies the MLP to) layer l.
    return [tuple(model.embed(hidden_states[:layer + 1], attention_mask).chunk(num_views)) for layer in layers]


def set_sim(hidden_states, attention_mask, pooler: str) -> torch.Tensor:
    """SetSim (Eq. 2) of each sentence for adjacent layers (1,2), ..., (L-1,L): shape (L-1, N)."""
    pooler = "cls_before_pooler" if pooler == "cls" else pooler
    reps = [common.pool(hidden_states[:layer + 1], attention_mask, pooler) for layer in range(1, len(hidden_states))]
    return torch.stack([F.cosine_similarity(a.float(), b.float(), dim=-1) for a, b in zip(reps, reps[1:])])


def oversmoothing_report(pooler: str):
    """analyze() hook for common.run: mean SetSim over the distinct STS-B test sentences, per adjacent pair."""
    import eval_sts

    @torch.no_grad()
    def analyze(backbone, tokenizer, senteval_dir, device):
        sentences = sorted({s for pair in eval_sts.load_pairs(senteval_dir, "STSBenchmark", "test") for s in pair[:2]})
        was_training = backbone.training
        backbone.eval()
        total = 0.0
        for i in range(0, len(sentences), 128):
            batch = tokenizer(sentences[i:i + 128], padding=True, truncation=True, return_tensors="pt").to(device)
            hidden_states = backbone(**batch, output_hidden_states=True).hidden_states
            total = total + set_sim(hidden_states, batch["attention_mask"], pooler).sum(dim=1)
        backbone.train(was_training)
        means = (total / len(sentences)).tolist()
        return {"setsim": {f"{layer}-{layer + 1}": round(v, 4) for layer, v in enumerate(means, start=1)}}
    return analyze


def setup(args, backbone):
    """SimCSE's encoder; the negatives come from the same forward pass's hidden states (no extra passes)."""
    model = common.SentenceEncoder(backbone, pooler=args.pooler, eval_pooler=common.eval_pooler(args))
    layers = negative_layers(backbone.config.num_hidden_layers, args.neg_layers, args.neg_layer_index)

    def compute_loss(batch):
        outputs, mask = model.forward_views(batch, num_views=2)
        z1, z2 = model.embed(outputs.hidden_states, mask).chunk(2)
        negatives = layer_representations(model, outputs.hidden_states, mask, layers)
        return sscl_loss(z1, z2, negatives, args.temp)

    return model, compute_loss


def main(argv=None):
    args = parse_args(argv)
    common.run(args, setup, analyze=oversmoothing_report(args.pooler) if args.report_oversmoothing else None)


if __name__ == "__main__":
    common.cli(main)
