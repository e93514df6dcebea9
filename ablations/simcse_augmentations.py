"""SimCSE Tables 1 and 2 (Gao, Yao & Chen, EMNLP 2021): dropout against discrete augmentations and
next-sentence objectives as the positive, with one encoder or two.

Each training sentence x_i is paired with a positive x_i+ built before training, and the pairs train
with SimCSE's InfoNCE and in-batch negatives (Eq. 1). With --positive dropout, x_i+ = x_i and the
two views differ by dropout alone: unsupervised SimCSE (82.5 on STS-B dev, the tables' reference).

Table 1 (STS-B dev, one encoder):  crop 10/20/30% 77.8/71.4/63.6; word deletion 10/20/30%
75.9/72.2/68.2; delete one word 75.9 (w/o dropout 74.2); synonym replacement 77.4; MLM 15% 62.2.
Table 2 (STS-B dev, one encoder / two): next sentence 67.1/68.9; next 3 sentences 67.4/68.8;
delete one word 75.9/73.1; unsupervised SimCSE 82.5/80.7.

    python ablations/simcse_augmentations.py --positive crop --rate 0.1
    python ablations/simcse_augmentations.py --positive word_deletion --rate 0.2
    python ablations/simcse_augmentations.py --positive delete_one_word --dropout 0   # w/o dropout
    python ablations/simcse_augmentations.py --positive synonym --synonyms synonyms.tsv
    python ablations/simcse_augmentations.py --positive mlm --rate 0.15
    python ablations/simcse_augmentations.py --positive next_sentence --two_encoders  # Table 2
    python ablations/simcse_augmentations.py --positive next_3_sentences

The settings are unsupervised SimCSE's (simcse.py's flags and backbone presets: batch 64, lr 3e-5,
one epoch, a dev gate every 125 steps, [CLS] with the MLP at training only).
Choices (the paper gives only the table captions): x_i is the anchor as it is and x_i+ = g(x_i),
drawn once per sentence from a generator seeded by --seed (one epoch sees each sentence once);
words are whitespace tokens; crop keeps a random contiguous span of round((1 - k) n) words; word
deletion removes round(k n) distinct words; at least one word always stays; synonym replacement
changes one random word that has synonyms (the paper used nlpaug's WordNet augmenter: with nltk and
its wordnet data installed the synonyms are WordNet lemmas, otherwise they come from --synonyms, a
file of lines "word<TAB>synonym<TAB>synonym..."); MLM k% masks k% of the word pieces and replaces
each with --mlm_model's highest-scoring other word piece. Next sentence pairs each line of
--train_file with the next one (next 3: one of the next three, uniformly): wiki1m_for_simcse.txt
keeps Wikipedia's sentence order within an article, so a line's neighbour is its next sentence
except at an article's end; under --fraction the neighbours are those of the kept lines. Two
encoders (Table 2's (f_theta1, f_theta2)) are two copies of the pretrained model, each with its own
MLP head; the anchor's encoder is the one evaluated and saved. This script runs on one process, and
without --resume.
"""
from __future__ import annotations

import copy
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's modules

import datasets  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import common  # noqa: E402
import data  # noqa: E402
import plumbing  # noqa: E402
import simcse  # noqa: E402
from plumbing import distributed, hub, options  # noqa: E402
from plumbing.run import Run  # noqa: E402

POSITIVES = ("dropout", "crop", "word_deletion", "delete_one_word", "synonym", "mlm",
             "next_sentence", "next_3_sentences")


def parse_args(argv=None):
    parser = options.parser(__doc__, method="simcse_augmentations")
    g = parser.add_argument_group("SimCSE Tables 1 and 2")
    g.add_argument("--positive", choices=POSITIVES, default="dropout",
                   help="how x_i+ is made from x_i (dropout: x_i+ = x_i, unsupervised SimCSE)")
    g.add_argument("--rate", type=float, default=None,
                   help="k for crop / word_deletion / mlm (Table 1: 0.1, 0.2, 0.3; MLM 0.15)")
    g.add_argument("--two_encoders", action="store_true",
                   help="Table 2: x_i and x_i+ through two independent encoders")
    g.add_argument("--synonyms", default=None,
                   help="synonym file for --positive synonym (word<TAB>synonym...); default: "
                        "WordNet through nltk when installed")
    g.add_argument("--mlm_model", default="bert-base-uncased",
                   help="the masked LM that replaces words for --positive mlm (Table 1: BERT-base)")
    args = options.parse(parser, argv, simcse.PRESETS)  # SimCSE's per-backbone rows
    if args.positive in ("crop", "word_deletion", "mlm") and args.rate is None:
        parser.error(f"--positive {args.positive} needs --rate k (Table 1: 0.1, 0.2, 0.3; "
                     "MLM: 0.15)")
    plumbing.check_range(args, "rate", lambda v: 0 < v < 1, "0 < k < 1")
    if args.pooler != "cls":
        parser.error("this study trains [CLS] with the MLP (--pooler cls), unsupervised SimCSE's")
    options.refuse_method_only_flags(args)  # --resume, --compile, ...: one line, not ignored
    return args


# The augmentations g(x) of Table 1: word lists in, word lists out; `rng` is a random.Random.
def crop(words: list[str], rate: float, rng: random.Random) -> list[str]:
    """Crop k%: a random contiguous span of round((1 - k) n) words (at least one)."""
    keep = max(1, round(len(words) * (1 - rate)))
    start = rng.randrange(len(words) - keep + 1)
    return words[start:start + keep]


def word_deletion(words: list[str], rate: float, rng: random.Random) -> list[str]:
    """Word deletion k%: round(k n) distinct random words removed (one word always stays)."""
    count = min(round(len(words) * rate), len(words) - 1)
    dropped = set(rng.sample(range(len(words)), count))
    return [w for i, w in enumerate(words) if i not in dropped]


def delete_one_word(words: list[str], rng: random.Random) -> list[str]:
    """Delete one word: one random word removed (a one-word sentence stays)."""
    if len(words) < 2:
        return list(words)
    dropped = rng.randrange(len(words))
    return words[:dropped] + words[dropped + 1:]


def synonym_replacement(words: list[str], synonyms: dict, rng: random.Random) -> list[str]:
    """One random word that has synonyms (looked up lower-cased) replaced by one of them."""
    candidates = [i for i, w in enumerate(words) if synonyms.get(w.lower())]
    if not candidates:
        return list(words)
    i = rng.choice(candidates)
    return words[:i] + [rng.choice(synonyms[words[i].lower()])] + words[i + 1:]


def next_sentence_pairs(sentences: list[str], window: int, rng: random.Random):
    """(x_i, x_j) with j one of the next `window` lines, uniformly (Table 2; window 1: the next)."""
    return [(s, sentences[i + rng.randint(1, min(window, len(sentences) - 1 - i))])
            for i, s in enumerate(sentences[:-1])]


@torch.no_grad()
def mlm_replace(sentences, tokenizer, model, rate: float, generator: torch.Generator, device,
                max_length: int = 32, batch_size: int = 64) -> list[str]:
    """MLM k%: each word piece masked with probability k; the masked LM's highest-scoring word piece
    other than the original (and other than a special token) takes its place."""
    special = torch.tensor(tokenizer.all_special_ids)
    out = []
    for i in range(0, len(sentences), batch_size):
        batch = tokenizer(sentences[i:i + batch_size], truncation=True, max_length=max_length,
                          padding=True, return_tensors="pt")
        ids = batch["input_ids"]
        chosen = torch.rand(ids.shape, generator=generator) < rate
        chosen &= ~torch.isin(ids, special)
        masked = ids.masked_fill(chosen, tokenizer.mask_token_id)
        inputs = {k: v.to(device) for k, v in batch.items()}
        inputs["input_ids"] = masked.to(device)
        logits = model(**inputs).logits.float().cpu()
        logits.scatter_(-1, ids.unsqueeze(-1), -math.inf)  # never the original piece
        logits[..., special] = -math.inf
        replaced = torch.where(chosen, logits.argmax(-1), ids)
        out += tokenizer.batch_decode(replaced, skip_special_tokens=True)
    return out


def load_synonyms(path: str | None, vocabulary) -> dict:
    """{word: [synonyms]} from --synonyms, else from WordNet (nltk) for the corpus's words."""
    if path:
        table = {}
        for number, line in enumerate(plumbing.read_lines(path, "--synonyms"), start=1):
            word, *others = line.rstrip("\n").split("\t")
            if others:
                table[word.lower()] = [o for o in others if o]
        return table
    try:
        from nltk.corpus import wordnet
        wordnet.synsets("test")
    except (ImportError, LookupError):
        raise plumbing.UsageError("--positive synonym needs WordNet (pip install nltk, then "
                                  "nltk.download('wordnet')) or a synonym file: --synonyms FILE")
    table = {}
    for word in vocabulary:
        lemmas = {lemma.name().replace("_", " ") for synset in wordnet.synsets(word)
                  for lemma in synset.lemmas()} - {word}
        if lemmas:
            table[word] = sorted(lemmas)
    return table


def make_pairs(args, sentences: list[str], device) -> tuple[list[str], list[str]]:
    """(anchors, positives): x_i and g(x_i) for every sentence, or next-sentence pairs."""
    rng = random.Random(args.seed)
    if args.positive in ("next_sentence", "next_3_sentences"):
        pairs = next_sentence_pairs(sentences, 1 if args.positive == "next_sentence" else 3, rng)
        return [a for a, _ in pairs], [p for _, p in pairs]
    if args.positive == "mlm":
        tokenizer, model = hub.load_pretrained(
            args.mlm_model, auto_class=transformers.AutoModelForMaskedLM, flag="--mlm_model")
        model.to(device).eval()
        generator = torch.Generator().manual_seed(args.seed)
        return sentences, mlm_replace(sentences, tokenizer, model, args.rate, generator, device,
                                      args.max_seq_length)
    synonyms = {}
    if args.positive == "synonym":
        synonyms = load_synonyms(args.synonyms, {w.lower() for s in sentences for w in s.split()})
    augment = {"dropout": lambda w: w,
               "crop": lambda w: crop(w, args.rate, rng),
               "word_deletion": lambda w: word_deletion(w, args.rate, rng),
               "delete_one_word": lambda w: delete_one_word(w, rng),
               "synonym": lambda w: synonym_replacement(w, synonyms, rng)}[args.positive]
    return sentences, [" ".join(augment(s.split())) for s in sentences]


def main(argv=None):
    args = parse_args(argv)
    run = Run(args, resumable=False)  # every flag checked, the seeds, the device; no last/
    device = run.device
    if distributed.world_size() > 1:
        raise plumbing.UsageError("the ablation scripts run on one process (no torchrun)")

    # Data: the pairs (x_i, x_i+), built once, laid out as (all anchors, all positives) per batch.
    examples, train_file, _ = data.training_examples(args)
    tokenizer, backbone = hub.load_pretrained(args.model_name_or_path)
    prebuilt_mask, switched_on = run.check_encoder(backbone, tokenizer)  # else one line; the mask
    vars(args).update(switched_on)  # the model's --dropout, --fit_memory's choice
    anchors, positives = make_pairs(args, list(examples["text"]), device)
    pairs = datasets.Dataset.from_dict({"sent0": anchors, "sent1": positives})
    corpus = data.TokenizedCorpus(pairs, tokenizer, args.max_seq_length)
    loader = data.make_loader(corpus, args, device)
    total_steps = args.max_steps if args.max_steps is not None else args.epochs * len(loader)

    # Encoders and heads: f_theta for both sides, or (Table 2) a second copy for the positives.
    backbone.to(device).train()
    common.set_dropout(backbone, args.dropout)  # --dropout 0: Table 1's "w/o dropout"
    head = common.MLPHead(backbone.config).to(device)
    positive_encoder, positive_head = backbone, head
    if args.two_encoders:
        positive_encoder, positive_head = copy.deepcopy(backbone), copy.deepcopy(head)
    params = list({id(p): p for m in (backbone, head, positive_encoder, positive_head)
                   for p in m.parameters()}.values())
    # the encoders' forward, with a prebuilt 4-D attention mask where the model takes it
    model = common.BackboneWithHeads(backbone, prebuilt_mask=prebuilt_mask)
    positive_model = common.BackboneWithHeads(positive_encoder, prebuilt_mask=prebuilt_mask)
    eval_pooler = common.eval_pooler(args)
    encode = common.Encoder(backbone, head, tokenizer, eval_pooler, device)
    optimizer, scheduler = common.make_optimizer(params, args, total_steps)
    scaler = common.grad_scaler(device, args.precision)

    run.start(loader, total_steps, encode, [backbone, head], train_file, None,
              optimizer=optimizer, scheduler=scheduler)
    batches = data.batches(loader)
    for step in run.steps():
        if step > 0:
            _, batch = next(batches)  # one process: no gather
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with common.autocast(device, args.precision):
                if args.two_encoders:  # x_i through f_theta1, x_i+ through f_theta2
                    half = len(batch["input_ids"]) // 2
                    outputs1 = model(**{k: v[:half] for k, v in batch.items()})
                    outputs2 = positive_model(**{k: v[half:] for k, v in batch.items()})
                    hidden1, hidden2 = outputs1.last_hidden_state, outputs2.last_hidden_state
                else:  # one pass: anchors and positives, each with its own dropout mask
                    hidden1, hidden2 = model(**batch).last_hidden_state.chunk(2)
            z1, z2 = head(hidden1[:, 0].float()), positive_head(hidden2[:, 0].float())
            loss = simcse.info_nce(z1, z2, args.temp)  # Eq. 1 with in-batch negatives
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm or math.inf)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            run.record(loss, grad_norm)
        if step % args.eval_steps == 0 or step == total_steps:  # the dev gate: the anchor's encoder
            if run.dev_gate(step) > run.best_dev:
                run.save_best(step, backbone, head, tokenizer, eval_pooler)

    run.write(run.evaluate_best(eval_pooler, table="SimCSE Tables 1-2",
                                example_pairs=[list(p) for p in zip(anchors[:3], positives[:3])]))


if __name__ == "__main__":
    plumbing.cli(main)
