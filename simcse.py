"""SimCSE: Simple Contrastive Learning of Sentence Embeddings (Gao, Yao & Chen, EMNLP 2021).

Unsupervised, a sentence is its own positive: its two views differ only by their dropout masks, and
the other sentences of the batch are the negatives (InfoNCE, Eq. 4). Supervised, the NLI
entailments are the positives and the contradictions extra hard negatives (Eq. 5, weighted as in
Eq. 8).

Headline (Table 5, BERT-base, 7-task STS average): 76.25 unsupervised; supervised 81.57.

    python simcse.py                                   # BERT-base on wiki1m, Table A.1's settings
    python simcse.py --supervised                      # NLI triplets: batch 512, lr 5e-5, 3 epochs
    torchrun --nproc_per_node 4 simcse.py --supervised # the authors' 4 x 128: the batch stays 512
    python simcse.py --dropout 0.05                    # Table 3's dropout rates
    python simcse.py --supervised --no_hard_negatives  # Table 4: the entailment pairs alone
    python simcse.py --supervised --do_mlm             # Table D.2: + 0.1 x the MLM loss
    python simcse.py --fraction 0.01 --seed 48         # miCSE Table 2's SimCSE row, the authors' 1%

Offline, add --model_name_or_path DIR --train_file FILE --senteval_dir DIR. "Code over paper" marks
a line that follows the released code (princeton-nlp/SimCSE) over the paper; see docs/methods.md.
"""
import functools
from typing import NamedTuple

import transformers

import common
import data
import plumbing
from plumbing import backbones, distributed, graph, hub, options
from plumbing.run import Run

# The recipe, read first: unsupervised SimCSE on BERT-base (Table A.1), trained by AdamW without
# weight decay, its lr decayed linearly. Its values are the defaults of the flags it names; PRESETS'
# rows replace some, and shared flags (--seed, ...) come from common.FLAGS and plumbing/options.py.
# Code over paper: STS-B dev every 125 steps, as run_unsup_example.sh (Appendix A says every 250)
RECIPE = dict(batch_size=64, lr=3e-5, temp=0.05, max_seq_length=32, epochs=1, warmup_steps=0,
              eval_steps=125, pooler="cls", mlp_only_train=True, hard_negative_weight=0.0,
              mlm_weight=0.1, mlm_probability=0.15)
# The paper's other settings, one row a condition (preset_rows picks the rows; your flags win).
PRESETS = {
    "supervised": ({"batch_size": 512, "lr": 5e-5, "epochs": 3, "eval_steps": 250,
                    "mlp_only_train": False}, "supervised SimCSE (Table A.1, Appendix A)"),
    "bert-large": ({"lr": 1e-5}, "Table A.1, BERT-large"),
    "roberta-base": ({"batch_size": 512, "lr": 1e-5}, "Table A.1, RoBERTa-base"),
    "roberta-large": ({"batch_size": 512, "lr": 3e-5}, "Table A.1, RoBERTa-large"),
    "supervised bert-large": ({"lr": 1e-5}, "Table A.1, supervised bert-large"),
    "supervised roberta-large": ({"lr": 1e-5}, "Table A.1, supervised roberta-large"),
    # Few-shot (miCSE Table 2's SimCSE rows): SimCSE's own batch and lr, as miCSE Section 4 says.
    # SimCSE gives no few-shot schedule, so the epochs and dev steps are miCSE's (its README's).
    **{f"fraction {fraction:g}": ({"epochs": epochs, "eval_steps": eval_steps}, f"miCSE's few-shot "
                                  f"schedule for fraction {fraction:g} (SimCSE's batch and lr)")
       for fraction, epochs, eval_steps in ((0.1, 10, 500), (0.01, 50, 500), (0.001, 500, 500),
                                            (0.0001, 2500, 250))},
}
FEW_SHOT_FRACTIONS = (0.1, 0.01, 0.001, 0.0001)  # the "fraction" rows above


def preset_rows(flags, backbone: str) -> list:
    """The PRESETS rows a run takes, in order; a later row's settings win over an earlier's."""
    if flags.supervised:
        return ["supervised", f"supervised {backbone}"]
    if flags.fraction > 0.1:  # all of wiki1m, or a share too large for a few-shot row
        return [backbone]
    return [f"fraction {options.nearest(FEW_SHOT_FRACTIONS, flags.fraction):g}", backbone]


def parse_args(argv=None):
    parser = options.parser(__doc__, method="simcse", recipe=RECIPE)
    g = parser.add_argument_group("SimCSE")
    g.add_argument("--supervised", action="store_true",
                   help="train on NLI triplets (sent0, sent1, hard_neg; nli_for_simcse.csv): batch "
                        "512, lr 5e-5, 3 epochs, dev every 250 steps, the MLP kept at evaluation")
    g.add_argument("--fixed_dropout_mask", action="store_true",
                   help="Table 3's 'Fixed 0.1': both views share one mask (one view used twice)")
    g.add_argument("--no_hard_negatives", action="store_true",
                   help="with --supervised: the (sent0, sent1) pairs alone, in-batch negatives "
                        "only (Table 4's entailment pairs; as a CSV without hard_neg trains)")
    g.add_argument("--hard_negative_weight", type=float,
                   help="log alpha of Eq. 8, added to an anchor's own hard negative's logit (the "
                        "released code's flag): Table 7's alpha 0.5, 1, 2 are -0.693, 0, 0.693")
    g.add_argument("--neutral_hard_negatives", action="store_true",
                   help="with --supervised: a CSV's neutral column as a second hard negative "
                        "(Table 7's 'Contra. + Neutral'; nli_for_simcse.csv has none)")
    g.add_argument("--do_mlm", action="store_true",
                   help="+ the MLM loss of masked copies of the inputs (Appendix A, Table D.2)")
    g.add_argument("--mlm_weight", type=float,
                   help="lambda of the MLM term (Table D.2: 0.01, 0.1, 1; released default 0.1)")
    g.add_argument("--mlm_probability", type=float,
                   help="share of tokens masked for the MLM term (BERT's 15%%)")
    g.add_argument("--num_layers", type=int, default=None,
                   help="keep only the encoder's first k layers (SSCL Table 1: SimCSE (10))")
    g.add_argument("--no_negatives", action="store_true",
                   help="unsupervised: the positive pairs alone, no in-batch negatives (miCSE "
                        "Table 4's 'SimCSE w/o negatives'; positive_only_loss)")
    known, _ = parser.parse_known_args(argv)
    plumbing.check_range(known, "fraction", lambda v: 0 < v <= 1, "0 < fraction <= 1")
    if known.supervised and known.fixed_dropout_mask:
        parser.error("--fixed_dropout_mask is unsupervised SimCSE's (Table 3)")
    if known.no_negatives and known.supervised:
        parser.error("--no_negatives is unsupervised SimCSE's (miCSE Table 4)")
    if known.no_hard_negatives and not known.supervised:
        parser.error("--no_hard_negatives goes with --supervised (Table 4)")
    if known.neutral_hard_negatives and (known.no_hard_negatives or not known.supervised):
        parser.error("--neutral_hard_negatives goes with --supervised and hard negatives (Table 7)")
    plumbing.check_range(known, "mlm_probability", lambda v: 0 < v < 1, "0 < p < 1")
    plumbing.check_range(known, "num_layers", lambda v: v >= 1, "at least 1 layer")
    return options.parse(parser, argv, PRESETS, preset_rows)


# --- the objective: copy this block; it needs only torch ---
import torch  # the block's one dependency: it runs pasted alone
import torch.nn.functional as F


def cos_sim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """All-pairs cosine similarity, (N, D) x (M, D) -> (N, M)."""
    return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T


def info_nce(z1, z2, temp: float = 0.05, z3=None,
             hard_negative_weight: float = 0.0) -> torch.Tensor:
    """SimCSE InfoNCE with in-batch negatives at temperature `temp` (Eq. 1, 4); with hard negatives
    `z3` Eq. 5, Eq. 8's alpha as the authors apply it: `hard_negative_weight` is log alpha (0: alpha
    1), added to the logit of anchor i's own, row i of each set of N rows in `z3` (Table 7's
    contradictions, then neutrals). Inputs in fp32 (after autocast)."""
    if z1.dim() != 2 or z1.shape != z2.shape:
        raise ValueError(f"z1 and z2 are two (N, D) views of the same N sentences, got "
                         f"{tuple(z1.shape)} and {tuple(z2.shape)}")
    logits = cos_sim(z1, z2) / temp
    if z3 is not None:
        if z3.dim() != 2 or z3.shape[1] != z1.shape[1] or len(z3) % len(z1):
            raise ValueError(f"z3: sets of N = {len(z1)} hard negatives of width "
                             f"{z1.shape[1]}, got {tuple(z3.shape)}")
        hard = cos_sim(z1, z3) / temp
        own = torch.eye(len(z1), device=hard.device, dtype=hard.dtype)
        hard = hard + hard_negative_weight * own.repeat(1, len(z3) // len(z1))
        logits = torch.cat([logits, hard], dim=1)
    return F.cross_entropy(logits, torch.arange(len(z1), device=z1.device))


def masked_lm_loss(prediction_scores, labels, num_masked=None) -> torch.Tensor:
    """l_mlm of Appendix A's auxiliary objective l + lambda * l_mlm, unweighted (mlm_loss weighs
    it): mean cross-entropy of the vocabulary scores (..., V) at the masked positions; label -100
    marks a position that is not scored. Nothing masked gives 0 (the released code's mean: NaN).
    `num_masked`: the whole batch's count, when these are some of its rows (--micro_batch_size)."""
    total = F.cross_entropy(prediction_scores.reshape(-1, prediction_scores.shape[-1]).float(),
                            labels.reshape(-1), ignore_index=-100, reduction="sum")
    count = (labels != -100).sum() if num_masked is None else num_masked
    return total / count.clamp_min(1)  # a tensor: no host sync (Python waiting for the GPU)


def simcse_views(encoder, batch: dict, head=None, columns: int = 1, *, pool=None, dtype=None,
                 fixed_dropout_mask: bool = False) -> tuple:
    """What SimCSE contrasts, in fp32: (z1, z2), two dropout views of N sentences (each sentence
    twice in one pass of `encoder`, in train mode; Table 3's "fixed 0.1": once, used twice), or
    (anchors, positives, *hard negatives) of N NLI examples of `columns` sentences (`batch` laid
    out so, each sentence once). z: the last layer's [CLS] through `head` (SimCSE's MLP; None:
    [CLS]), or pool(hidden_states, attention_mask). `dtype`: autocast's for the encoder alone."""
    views = batch if columns > 1 else {k: v.repeat(1 if fixed_dropout_mask else 2, 1)
                                       for k, v in batch.items()}
    device = views["input_ids"].device
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):  # the encoder only
        hidden_states = encoder(**views, output_hidden_states=True).hidden_states
    if pool is not None:
        z = pool(hidden_states, views["attention_mask"])
    else:  # [CLS], out of autocast: fp32
        cls = hidden_states[-1][:, 0].float()
        z = cls if head is None else head(cls)
    if columns > 1:
        return z.chunk(columns)
    return (z, z) if fixed_dropout_mask else z.chunk(2)


def simcse_objective(z1, z2, *hard, temp: float = 0.05, hard_negative_weight: float = 0.0,
                     positives_only: bool = False, gather=None) -> torch.Tensor:
    """InfoNCE of the views (Eq. 4) or of the NLI columns with hard negatives (Eq. 5).
    positives_only drops the negatives (miCSE Table 4); gather (torchrun) makes the global batch."""
    if gather is not None:
        z1, z2, hard = gather(z1), gather(z2), [gather(h) for h in hard]
    if positives_only:
        return positive_only_loss(z1, z2, temp)
    return info_nce(z1, z2, temp, torch.cat(hard) if hard else None, hard_negative_weight)


def simcse_step(encoder, batch: dict, head=None, temp: float = 0.05, columns: int = 1,
                hard_negative_weight: float = 0.0, *, pool=None, dtype=None, gather=None,
                fixed_dropout_mask: bool = False, positives_only: bool = False) -> torch.Tensor:
    """One step's SimCSE loss, to back-propagate: a transformers encoder (AutoModel, in train mode)
    and its tokenizer's output for a list of sentences. A whole step, as a program:

        from transformers import AutoModel, AutoTokenizer
        path = "bert-base-uncased"  # the encoder: a Hub id or a local folder
        tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path)
        d = model.config.hidden_size
        head = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh())  # SimCSE's MLP
        optimizer = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=3e-5)
        sentences = ["A man plays a guitar.", "A woman slices an onion.", "Two dogs run."]
        batch = tokenizer(sentences, padding=True, truncation=True, max_length=32,
                          return_tensors="pt")
        loss = simcse_step(model.train(), batch, head)
        loss.backward(); optimizer.step(); optimizer.zero_grad()

    The defaults are the recipe's (RECIPE); supervised, columns 3 (anchor, entailment,
    contradiction; 2: no hard negatives). The arguments: simcse_views's and simcse_objective's."""
    z1, z2, *hard = simcse_views(encoder, batch, head, columns, pool=pool, dtype=dtype,
                                 fixed_dropout_mask=fixed_dropout_mask)
    return simcse_objective(z1, z2, *hard, temp=temp, hard_negative_weight=hard_negative_weight,
                            positives_only=positives_only, gather=gather)


def positive_only_loss(z1, z2, temp: float = 0.05) -> torch.Tensor:
    """miCSE Table 4's baseline (--no_negatives), after SimCSE's own path: InfoNCE's positive term
    alone, -cos(z1_i, z2_i) / temp (Eq. 1 without its denominator; miCSE gives no formula)."""
    return -(F.cosine_similarity(z1, z2, dim=-1) / temp).mean()
# --- end of the objective ---


def keep_first_layers(backbone, k: int) -> None:
    """The encoder's first k transformer layers only (SSCL Table 1's shallower SimCSE)."""
    layers = backbones.layer_list(backbone)  # BERT's encoder.layer, DistilBERT's, ModernBERT's
    if k > len(layers):
        raise plumbing.UsageError(f"--num_layers {k}: the encoder has only {len(layers)} layers")
    del layers[k:]
    backbone.config.num_hidden_layers = k
    if isinstance(getattr(backbone.config, "layer_types", None), list):  # ModernBERT's
        backbone.config.layer_types = backbone.config.layer_types[:k]


def mlm_head(backbone, name_or_path: str) -> torch.nn.Module:
    """The released code's MLM head: RoBERTa's (XLM-R's) pretrained lm_head; for BERT a fresh
    BertLMPredictionHead (cls.predictions does not load into BertForCL's), initialised as under
    transformers 4.2: weights normal(0, initializer_range), biases zero, the decoder's bias tied to
    the zero `bias` (transformers 5's uniform init and untied decoder bias left `bias` unused)."""
    if backbone.config.model_type in ("roberta", "xlm-roberta"):
        masked_lm_class = transformers.AutoModelForMaskedLM
        return hub.load_pretrained(name_or_path, auto_class=masked_lm_class)[1].lm_head
    from transformers.models.bert.modeling_bert import BertLMPredictionHead
    head = BertLMPredictionHead(backbone.config)
    for linear in (head.transform.dense, head.decoder):
        torch.nn.init.normal_(linear.weight, std=backbone.config.initializer_range)
    torch.nn.init.zeros_(head.transform.dense.bias)
    head.decoder.bias = head.bias  # zeros; one parameter, as in transformers 4.2
    return head


def mask_tokens(input_ids, special_ids, probability: float, mask_token_id: int, vocab_size: int,
                generator: torch.Generator, replace_prob: float = 0.8, random_prob: float = 0.1):
    """BERT's masking, drawn from `generator` as transformers' DataCollatorForLanguageModeling draws
    it (the same masks for a seed: tested), on the device: (masked ids, labels, -100 where nothing
    is scored). A token but the special ones is chosen with `probability`, then becomes [MASK] with
    `replace_prob`, a random token with `random_prob`, else stays."""
    shape, device = input_ids.shape, input_ids.device
    chance = torch.full(shape, probability, device=device)
    chance.masked_fill_(torch.isin(input_ids, special_ids), 0.0)
    chosen = torch.bernoulli(chance, generator=generator).bool()
    labels = input_ids.masked_fill(~chosen, -100)
    as_mask = torch.bernoulli(torch.full(shape, replace_prob, device=device),
                              generator=generator).bool() & chosen
    masked = input_ids.masked_fill(as_mask, mask_token_id)
    scaled = random_prob / (1 - replace_prob)  # of the chosen tokens not turned into [MASK]
    as_random = torch.bernoulli(torch.full(shape, scaled, device=device),
                                generator=generator).bool() & chosen & ~as_mask
    words = torch.randint(vocab_size, shape, dtype=torch.long, generator=generator, device=device)
    return torch.where(as_random, words, masked), labels


class MaskedLM(NamedTuple):
    """What --do_mlm's term needs (Appendix A); special_ids: the tokenizer's, never masked."""
    head: torch.nn.Module
    generator: torch.Generator
    special_ids: torch.Tensor
    mask_token_id: int
    vocab_size: int


def mlm_loss(masked: dict, ddp_model, lm_head, sections: int, args, part=None,
             terms=None) -> torch.Tensor:
    """The weighted MLM term lambda * l_mlm (args.mlm_weight x masked_lm_loss) of `part`'s rows:
    the mean over the batch's masked tokens, rows stacked in `sections` (NLI's columns or views).
    The head runs under autocast as in the released fp16 runs; the term is added to terms["mlm"]."""
    rows = data.part_of(masked, part, sections)
    inputs = {k: v for k, v in rows.items() if k != "labels"}
    with common.autocast(inputs["input_ids"].device, args.precision):
        prediction_scores = lm_head(ddp_model(**inputs).last_hidden_state)
    num_masked = (masked["labels"] != -100).sum()
    term = args.mlm_weight * masked_lm_loss(prediction_scores, rows["labels"], num_masked)
    if terms is not None:
        terms["mlm"] = terms.get("mlm", 0) + term.detach()
    return term


def train_step(ddp_model, head, params, optimizer, scaler, args, columns: int, mlm, batch: dict,
               global_rows: int):
    """One optimizer step on this process's rows of the global batch; (loss, gradient norm, {term:
    value}) on the device. `columns`: NLI's (1: sentences); `mlm`: --do_mlm's MaskedLM, or None."""
    view_options = dict(pool=common.block_pool(args.pooler), dtype=common.amp_dtype(args.precision),
                        fixed_dropout_mask=args.fixed_dropout_mask)
    gather = functools.partial(distributed.gather, rows=global_rows)  # one process: as it is
    if mlm is not None:  # Appendix A's MLM term reads masked copies of the views' rows.
        views = batch if args.supervised else common.repeat_views(batch,
                                                                   2 - args.fixed_dropout_mask)
        input_ids, labels = mask_tokens(views["input_ids"], mlm.special_ids, args.mlm_probability,
                                        mlm.mask_token_id, mlm.vocab_size, mlm.generator)
        masked = dict(views, input_ids=input_ids, labels=labels)
        sections = len(input_ids) // len(batch["input_ids"]) * columns  # NLI's columns or the views
    optimizer.zero_grad(set_to_none=True)  # before the passes: the old gradients freed
    terms = {}  # --do_mlm's term, logged beside the loss
    if not args.micro_batch_size:  # the paper's step: simcse_step, then backward
        loss = simcse_step(ddp_model, batch, head, args.temp, columns, args.hard_negative_weight,
                           **view_options, gather=gather, positives_only=args.no_negatives)
        if mlm is not None:
            loss = loss + mlm_loss(masked, ddp_model, mlm.head, sections, args, terms=terms)
        scaler.scale(loss).backward()
    else:  # GradCache: the same loss and gradients, K examples at once (views, then objective)
        loss = common.grad_cache(
            lambda part: simcse_views(ddp_model, data.part_of(batch, part, columns), head,
                                      columns, **view_options),
            functools.partial(simcse_objective, temp=args.temp, gather=gather,
                              hard_negative_weight=args.hard_negative_weight,
                              positives_only=args.no_negatives),
            len(batch["input_ids"]) // columns, args.micro_batch_size, scaler.scale, ddp_model,
            mlm and functools.partial(mlm_loss, masked, ddp_model, mlm.head, sections, args,
                                      terms=terms))
    scaler.unscale_(optimizer)  # fp16: clip the true gradients
    grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm or float("inf"))
    scaler.step(optimizer)  # fp16: a step whose gradients overflowed is skipped
    scaler.update()
    return loss, grad_norm, terms


def main(argv=None):
    args = parse_args(argv)
    run = Run(args)  # every flag checked, the seeds set, the device (and torchrun's process group)
    device = run.device

    # The data: wiki1m sentences, or NLI triplets laid out (all anchors, all positives, all hard
    # negatives); a batch padded to --max_seq_length under a CUDA graph, else to its longest row.
    default_file = "nli_for_simcse.csv" if args.supervised else "wiki1m_for_simcse.txt"
    with distributed.main_process_first():  # downloads and datasets' cache: process 0 first
        tokenizer, backbone = hub.load_pretrained(args.model_name_or_path)
        prebuilt_mask, switched_on = run.check_encoder(
            backbone, tokenizer, layers=bool(args.num_layers), mlm_head=args.do_mlm)
        vars(args).update(switched_on)  # the model's --dropout, --fit_memory's memory flags
        examples, train_file, subset = data.training_examples(
            args, default_file, triplets=args.supervised, hard_negatives=not args.no_hard_negatives,
            neutral=args.neutral_hard_negatives)
        corpus = data.TokenizedCorpus(examples, tokenizer, args.max_seq_length,
                                      data.pad_multiple(args))  # --compile: a multiple of 8
    loader = data.make_loader(corpus, args, device)
    total_steps = args.max_steps if args.max_steps is not None else args.epochs * len(loader)

    # The model: the MLP on [CLS] ("cls"), evaluated before it unless --no-mlp_only_train.
    if args.num_layers:  # SSCL Table 1: SimCSE on a shallower encoder
        keep_first_layers(backbone, args.num_layers)
    backbone.to(device).train()
    common.set_dropout(backbone, args.dropout)  # --dropout (Table 3); None: the checkpoint's own
    head = common.MLPHead(backbone.config).to(device) if args.pooler == "cls" else None
    # --do_mlm (Appendix A) adds an MLM head that draws masks on the device from its own generator
    lm_head, mlm_generator, mlm = None, None, None
    if args.do_mlm:
        lm_head = mlm_head(backbone, args.model_name_or_path).to(device).train()
        mlm_generator = torch.Generator(device).manual_seed(args.seed + distributed.rank())
        special_ids = torch.tensor(tokenizer.all_special_ids, device=device)  # never masked
        mlm = MaskedLM(lm_head, mlm_generator, special_ids, tokenizer.mask_token_id, len(tokenizer))
    model = common.BackboneWithHeads(backbone, head, lm_head, prebuilt_mask=prebuilt_mask)
    params = [p for p in model.parameters() if p.requires_grad]
    ddp_model = distributed.data_parallel(model, args.compile)  # DDP under torchrun; --compile
    # The optimiser
    optimizer, scheduler = common.make_optimizer(params, args, total_steps)
    scaler = common.grad_scaler(device, args.precision)  # fp16's loss scaling, else a pass-through
    eval_pooler = common.eval_pooler(args)
    eval_encoder = common.Encoder(model, head, tokenizer, eval_pooler, device)

    # The loop
    run.start(loader, total_steps, eval_encoder, [backbone, head], train_file, subset,
              backbone=backbone, head=head, optimizer=optimizer, scheduler=scheduler,
              scaler=scaler, lm_head=lm_head, mlm_generator=mlm_generator)  # what last/ saves
    batches = data.batches(loader)  # epoch after epoch
    one_step = functools.partial(train_step, ddp_model, head, params, optimizer, scaler, args,
                                 corpus.num_columns, mlm)
    # On one CUDA GPU the step is by default replayed from a CUDA graph (--no_cuda_graph: eager).
    train = graph.StepGraph(one_step, optimizer, args.cuda_graph, generators=[mlm_generator])
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
