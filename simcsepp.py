"""SimCSE++: Improving Contrastive Learning for Sentence Embeddings from Two Perspectives (Xu et
al., EMNLP 2023).

Two changes to SimCSE's loss. Off-dropout sampling: the negatives come from a third pass of the
batch with every dropout off, since dropout noise helps the positives but hurts the negatives
(Section 3, Eq. 3). Dimension-wise contrastive learning (DCL): each embedding dimension should be
more like itself across the two views than like the other dimensions (Section 4.3, Eq. 5).

Headline (Table 3, BERT-base, 7-task STS average): 78.05 (SimCSE: 76.25; off-dropout alone
77.13, DCL alone 77.40).

    python simcsepp.py                                  # m 0.9, DCL weight 0.1, DCL temperature 5
    python simcsepp.py --no_off_dropout --m 1           # Table 3's "+DCL": SimCSE + DCL
    python simcsepp.py --dcl_weight 0                   # Table 3's "+Off-Info"
    python simcsepp.py --dcl_only                       # Table 4's "+DCL(wiki)": DCL alone
    python simcsepp.py --no_off_dropout --m 1 --dcl_temp 10  # the released models_vicreg.py's DCL

"Code over paper" marks a line that follows the authors' released code (which made the published
numbers) over the paper; docs/methods.md says how this file settles what the paper leaves open.
"""
import functools

import common
import data
import plumbing
from plumbing import distributed, graph, hub, options
from plumbing.run import Run

# The recipe, read first: SimCSE++ on BERT-base (Section 5.1, Table 5), trained by AdamW without
# weight decay, its lr decayed linearly. Its values are the defaults of the flags it names; PRESETS'
# rows replace some, and shared flags (--seed, ...) come from common.FLAGS and plumbing/options.py.
RECIPE = dict(batch_size=64, lr=3e-5, temp=0.05, max_seq_length=32, epochs=1, warmup_steps=0,
              eval_steps=125, pooler="cls", mlp_only_train=True, m=0.9, dcl_weight=0.1,
              dcl_temp=5.0)
# The paper's other settings (flags the user gives win): large models, and Table 4's row
PRESETS = {
    "bert-large": ({"lr": 8e-6}, "SimCSE++ Section 5.1, large models"),
    "roberta-large": ({"lr": 8e-6}, "SimCSE++ Section 5.1, large models"),
    "dcl_only": ({"pooler": "avg_embeddings_last", "dcl_temp": 0.05}, "SimCSE++ Table 4"),
}


def parse_args(argv=None):
    parser = options.parser(__doc__, method="simcsepp", recipe=RECIPE)
    g = parser.add_argument_group("SimCSE++ (Section 5.1 defaults)")
    g.add_argument("--m", type=float, help="weight m on the positive logit (Table 5 best: 0.9)")
    g.add_argument("--dcl_weight", type=float, help="lambda, weight of the DCL loss (Table 5: 0.1)")
    g.add_argument("--dcl_temp", type=float,
                   help="DCL temperature (Table 5's best: 5; the released models_vicreg.py: 10)")
    g.add_argument("--no_off_dropout", action="store_true",
                   help="negatives from the dropout views s(z1_i, z2_j), no third pass; m still "
                        "scales the positive: Table 3's '+DCL' row is --no_off_dropout --m 1")
    g.add_argument("--dcl_only", action="store_true", help="Table 4: DCL alone as the objective "
                   "(no InfoNCE); sets --pooler avg_embeddings_last (the released first-last "
                   "average) and --dcl_temp 0.05 unless given")
    args = options.parse(parser, argv, PRESETS, lambda known, backbone: (
        ["dcl_only"] if known.dcl_only else []) + [backbone])
    if args.pooler == "avg_first_last":  # the released code's first-last average: hidden_states[0]
        args.pooler = "avg_embeddings_last"
    plumbing.check_range(args, "m", lambda v: v > 0, "a positive weight")
    plumbing.check_range(args, "dcl_weight", lambda v: v >= 0, ">= 0 (0 disables DCL)")
    plumbing.check_range(args, "dcl_temp", lambda v: v > 0, "a positive temperature")
    return args


# --- the objective: copy this block; it needs only torch ---
import torch  # the block's one dependency: it runs pasted alone
import torch.nn.functional as F


def cos_sim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """All-pairs cosine similarity, (N, D) x (M, D) -> (N, M)."""
    return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T


def off_dropout_info_nce(z1, z2, z_dropout_off, temp: float = 0.05, m: float = 0.9) -> torch.Tensor:
    """Off-dropout InfoNCE (Eq. 3 as the authors implemented it): loss_i = -m s(z1_i, z2_i) +
    log(e^{m s(z1_i, z2_i)} + sum_{j != i} e^{s(z0_i, z0_j)}), s = cos / temp (the temperature),
    where z0 = `z_dropout_off` is the batch encoded with dropout off."""
    if z1.dim() != 2 or not z1.shape == z2.shape == z_dropout_off.shape:
        raise ValueError(f"z1, z2 and z_dropout_off are three (N, D) encodings of the same N "
                         f"sentences, got {[tuple(z.shape) for z in (z1, z2, z_dropout_off)]}")
    return m_positive_cross_entropy(cos_sim(z1, z2) / temp,
                                    cos_sim(z_dropout_off, z_dropout_off) / temp, m)


def view_negatives_info_nce(z1, z2, temp: float = 0.05, m: float = 0.9) -> torch.Tensor:
    """Without the dropout-off pass (--no_off_dropout, an ablation), the negatives are s(z1_i, z2_j)
    and m still scales the positive; m = 1 gives SimCSE's InfoNCE (Table 3's "+DCL" row)."""
    cross = cos_sim(z1, z2) / temp
    return m_positive_cross_entropy(cross, cross, m)


def m_positive_cross_entropy(cross, negatives, m: float) -> torch.Tensor:
    """Row i's cross-entropy, target i, over m cross_ii (its positive) and negatives_ij (j != i)."""
    diagonal = torch.eye(len(cross), dtype=torch.bool, device=cross.device)
    # Code over paper: m scales the positive logit; Eq. 3 puts m on the sum of the negatives.
    logits = torch.where(diagonal, m * cross, negatives)
    return F.cross_entropy(logits, torch.arange(len(cross), device=cross.device))


def dcl_loss(z1, z2, temp: float = 5.0) -> torch.Tensor:
    """Dimension-wise contrastive learning (Eq. 5 as the authors implemented it): standardise each
    dimension over the batch (BatchNorm1d without affine, training mode), C = z1~^T z2~ / (N temp)
    (D x D); loss = mean over c of [-C_cc + log sum_d e^{C_cd}]."""
    if z1.dim() != 2 or z1.shape != z2.shape:
        raise ValueError(f"z1 and z2 are two (N, D) views of the same N sentences, got "
                         f"{tuple(z1.shape)} and {tuple(z2.shape)}")

    def standardise(z):
        return (z - z.mean(0)) / torch.sqrt(z.var(0, unbiased=False) + 1e-5)
    # Code over paper: mean over dimensions and C divided by N; Eq. 5 sums over c and has no 1/N.
    correlation = standardise(z1).T @ standardise(z2) / (len(z1) * temp)
    return F.cross_entropy(correlation, torch.arange(correlation.shape[0], device=z1.device))


def simcsepp_views(encoder, batch: dict, head=None, *, pool=None, dtype=None,
                   off_dropout: bool = True) -> tuple:
    """(z1, z2, z_dropout_off) in fp32: two dropout views of N sentences in one pass of `encoder`
    (in train mode, each sentence twice), then the batch again with every dropout off (Eq. 3's
    negatives: eval mode, gradients kept, as the authors' code); off_dropout False: (z1, z2). z:
    [CLS] through `head` (None: [CLS]) or pool(hidden_states, attention_mask), autocast to dtype."""
    device = batch["input_ids"].device

    def encoded(inputs):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):  # encoder only
            hidden_states = encoder(**inputs, output_hidden_states=True).hidden_states
        if pool is not None:
            return pool(hidden_states, inputs["attention_mask"])
        cls = hidden_states[-1][:, 0].float()  # out of autocast: fp32
        return cls if head is None else head(cls)

    z1, z2 = encoded({k: v.repeat(2, 1) for k, v in batch.items()}).chunk(2)  # one pass
    if not off_dropout:
        return z1, z2
    training = encoder.training
    encoder.eval()  # every dropout off, transformers' attention dropout too
    try:
        return z1, z2, encoded(batch)
    finally:
        encoder.train(training)


def simcsepp_objective(z1, z2, z_dropout_off=None, *, temp: float = 0.05, m: float = 0.9,
                       dcl_weight: float = 0.1, dcl_temp: float = 5.0, dcl_only: bool = False,
                       gather=None, terms=None) -> torch.Tensor:
    """Off-dropout InfoNCE (Eq. 3) + dcl_weight x DCL (Eq. 5); z_dropout_off None: the views'
    negatives (view_negatives_info_nce); dcl_only: DCL alone (Table 4). Under torchrun, gather
    builds the global batch (for DCL and negatives); a `terms` dict gets both terms, detached."""
    if gather is not None:
        z1, z2 = gather(z1), gather(z2)
    if dcl_only:  # Table 4: DCL alone
        return dcl_loss(z1, z2, dcl_temp)
    if z_dropout_off is None:
        loss = view_negatives_info_nce(z1, z2, temp, m)
    else:
        z_dropout_off = z_dropout_off if gather is None else gather(z_dropout_off)
        loss = off_dropout_info_nce(z1, z2, z_dropout_off, temp, m)
    if dcl_weight > 0:
        dcl = dcl_weight * dcl_loss(z1, z2, dcl_temp)
        if terms is not None:
            terms.update(info_nce=loss.detach(), dcl=dcl.detach())
        loss = loss + dcl
    return loss


def simcsepp_step(encoder, batch: dict, head=None, temp: float = 0.05, m: float = 0.9,
                  dcl_weight: float = 0.1, dcl_temp: float = 5.0, *, pool=None, dtype=None,
                  gather=None, off_dropout: bool = True, dcl_only: bool = False,
                  terms=None) -> torch.Tensor:
    """One step's SimCSE++ loss, to back-propagate: a transformers encoder (AutoModel, in train
    mode) and its tokenizer's output for a list of sentences. A whole step, as a program:

        from transformers import AutoModel, AutoTokenizer
        path = "bert-base-uncased"  # the encoder: a Hub id or a local folder
        tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path)
        d = model.config.hidden_size
        head = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh())  # --pooler cls's
        optimizer = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=3e-5)
        sentences = ["A man plays a guitar.", "A woman slices an onion.", "Two dogs run."]
        batch = tokenizer(sentences, padding=True, truncation=True, max_length=32,
                          return_tensors="pt")
        loss = simcsepp_step(model.train(), batch, head)
        loss.backward(); optimizer.step(); optimizer.zero_grad()

    The defaults are the recipe's (RECIPE); Table 3's "+DCL": off_dropout False, m 1; "+Off-Info":
    dcl_weight 0; Table 4's "+DCL(wiki)": dcl_only, dcl_temp 0.05. The arguments: simcsepp_views's
    and simcsepp_objective's."""
    z = simcsepp_views(encoder, batch, head, pool=pool, dtype=dtype,
                       off_dropout=off_dropout and not dcl_only)
    return simcsepp_objective(*z, temp=temp, m=m, dcl_weight=dcl_weight, dcl_temp=dcl_temp,
                              dcl_only=dcl_only, gather=gather, terms=terms)
# --- end of the objective ---


def train_step(ddp_model, head, params, optimizer, scaler, args, batch: dict, global_rows: int):
    """One optimizer step on this process's rows of the batch; (loss, grad norm, {term: value})."""
    optimizer.zero_grad(set_to_none=True)  # before the passes: the old gradients freed
    terms = {}  # the loss's two terms, logged beside it
    view_options = dict(pool=common.block_pool(args.pooler), dtype=common.amp_dtype(args.precision))
    loss_options = dict(temp=args.temp, m=args.m, dcl_weight=args.dcl_weight,
                        dcl_temp=args.dcl_temp, dcl_only=args.dcl_only, terms=terms,
                        gather=functools.partial(distributed.gather, rows=global_rows))
    if not args.micro_batch_size:  # the paper's step: simcsepp_step, then backward
        loss = simcsepp_step(ddp_model, batch, head, **view_options, **loss_options,
                             off_dropout=not args.no_off_dropout)
        scaler.scale(loss).backward()  # through both views' pass and the dropout-off one
    else:  # GradCache: the same loss and gradients, K sentences at once (views, then objective)
        loss = common.grad_cache(
            lambda part: simcsepp_views(ddp_model, data.part_of(batch, part), head, **view_options,
                                        off_dropout=not (args.no_off_dropout or args.dcl_only)),
            functools.partial(simcsepp_objective, **loss_options),
            len(batch["input_ids"]), args.micro_batch_size, scaler.scale, ddp_model)
    scaler.unscale_(optimizer)  # fp16: clip the true gradients
    grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm or float("inf"))
    scaler.step(optimizer)  # fp16: a step whose gradients overflowed is skipped
    scaler.update()
    return loss, grad_norm, terms


def main(argv=None):
    args = parse_args(argv)
    run = Run(args)  # every flag checked, the seeds set, the device (and torchrun's process group)
    device = run.device

    # The data: a batch padded to --max_seq_length under a CUDA graph, else to its longest row
    with distributed.main_process_first():  # downloads and datasets' cache: process 0 first
        tokenizer, backbone = hub.load_pretrained(args.model_name_or_path)
        prebuilt_mask, switched_on = run.check_encoder(backbone, tokenizer)  # dropout to turn off
        vars(args).update(switched_on)  # the model's --dropout, --fit_memory's memory flags
        examples, train_file, subset = data.training_examples(args)
        corpus = data.TokenizedCorpus(examples, tokenizer, args.max_seq_length,
                                      data.pad_multiple(args))  # --compile: a multiple of 8
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
    eval_pooler = common.eval_pooler(args)
    eval_encoder = common.Encoder(model, head, tokenizer, eval_pooler, device)

    # The loop
    run.start(loader, total_steps, eval_encoder, [backbone, head], train_file, subset,
              backbone=backbone, head=head, optimizer=optimizer, scheduler=scheduler,
              scaler=scaler)  # what last/ saves
    batches = data.batches(loader)  # epoch after epoch
    one_step = functools.partial(train_step, ddp_model, head, params, optimizer, scaler, args)
    # On one CUDA GPU the step is by default replayed from a CUDA graph (--no_cuda_graph: eager).
    train = graph.StepGraph(one_step, optimizer, args.cuda_graph)
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
