"""SSCL: Alleviating Over-smoothing for Unsupervised Sentence Representation (Chen et al., ACL
2023).

Adjacent layers of a pretrained encoder give nearly the same sentence representations (inter-layer
over-smoothing, measured by SetSim, Eq. 2). SSCL takes the encoder's own intermediate-layer
representations of the batch as extra negatives for the last layer's (Eq. 4), a plug-in to any
contrastive objective.

Headline (Table 2, BERT-base, 7-task STS average): 77.90 for SSCL-SimCSE (SimCSE: 76.25).

    python sscl.py                         # layers L-1 and L-2 as negatives (Figure 3b's best)
    python sscl.py --neg_layer_index 10    # one chosen layer (Figure 3a)
    python sscl.py --pooler cls --report_oversmoothing   # SetSim before and after (Figure 1)
    python sscl.py --no_dropout_positive   # Table 2's SSCL-BERT: layer negatives, no augmentation
    python sscl.py --output_dim 256        # Table 5: a linear projection to 256 dimensions

"Code over paper" marks a line that follows the authors' released code (which made the published
numbers) over the paper; docs/methods.md says how this file settles what the paper leaves open.
"""
import functools

import common
import data
import plumbing
from plumbing import distributed, graph, hub, options, progress
from plumbing.run import Run

# The recipe, read first: SSCL-SimCSE on BERT-base (Section 4.2, the released scripts), trained by
# AdamW without weight decay, its lr decayed linearly. Its values are the defaults of the flags it
# names (PRESETS' rows replace some); shared flags are in common.FLAGS and plumbing/options.py.
RECIPE = dict(batch_size=64, lr=3e-5, temp=0.05, max_seq_length=32, epochs=1, warmup_steps=0,
              eval_steps=125, pooler="avg", mlp_only_train=True, neg_layers=2,
              layer_negatives="both")
# The paper's other settings (your flags win): the released average pooler, BERT-large's lr (4.2).
PRESETS = {
    "released": ({"pooler": "avg"}, "SSCL's released scripts"),
    "bert-large": ({"lr": 1e-5}, "SSCL Section 4.2, BERT-large"),
}


def parse_args(argv=None):
    parser = options.parser(__doc__, method="sscl", recipe=RECIPE)
    g = parser.add_argument_group("SSCL")
    g.add_argument("--neg_layers", type=int,
                   help="k: negatives from layers L-1, ..., L-k (progressive SSCL, Figure 3b: 2)")
    g.add_argument("--neg_layer_index", type=int, default=None,
                   help="this one hidden-state layer (1..L-1) as the negatives (Figure 3a)")
    g.add_argument("--layer_negatives", choices=["both", "anchor"],
                   help="both: a negative layer of both views, 2N a layer (the released code); "
                        "anchor: the anchor's view's, N (the paper's 'N pairs to 2N', Table 7)")
    g.add_argument("--no_dropout_positive", action="store_true",
                   help="SSCL-BERT (Table 2): no dropout positive; a sentence is its own positive")
    g.add_argument("--output_dim", type=int, default=None, help="Table 5: every representation "
                   "linearly projected to this many dimensions, also at evaluation (128, 256)")
    g.add_argument("--report_oversmoothing", action="store_true",
                   help="SetSim (Eq. 2) of adjacent layers on STS-B test before and after training")
    args = options.parse(parser, argv, PRESETS, lambda known, backbone: ["released", backbone])
    if args.pooler not in ("cls", "avg"):
        parser.error("SSCL trains with --pooler cls or avg (Section 4.2)")
    plumbing.check_range(args, "neg_layers", lambda v: v >= 0, "a non-negative number of layers")
    plumbing.check_range(args, "output_dim", lambda v: v >= 1, "a positive dimension")
    if args.output_dim and args.pooler == "cls" and args.mlp_only_train:  # train on what evaluates
        parser.error("--output_dim with --pooler cls trains the projection on the MLP head's "
                     "output, which --mlp_only_train drops at evaluation: add --no-mlp_only_train")
    return args


# --- the objective: copy this block; it needs only torch ---
import torch  # the block's one dependency: it runs pasted alone
import torch.nn.functional as F


def cos_sim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """All-pairs cosine similarity, (N, D) x (M, D) -> (N, M)."""
    return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T


def sscl_loss(z1, z2, layer_negatives, temp: float = 0.05) -> torch.Tensor:
    """SSCL's contrastive loss with intermediate-layer negatives (Eq. 4). Row i's logits are
    [s(z1, z2) | s(z1, n1_l) | s(z1, n2_l) for each layer l], with s = cos / temp (temp: the
    temperature), and its target is i. `layer_negatives` holds one tuple per layer: that layer's
    representations of the two dropout views (n1, n2), or of the anchor's view only (n1,)."""
    if z1.dim() != 2 or z1.shape != z2.shape:
        raise ValueError(f"z1 and z2 are two (N, D) views of the same N sentences, got "
                         f"{tuple(z1.shape)} and {tuple(z2.shape)}")
    if any(n.dim() != 2 or n.shape[1] != z1.shape[1] for pair in layer_negatives for n in pair):
        raise ValueError(f"each layer's negatives are (M, {z1.shape[1]}): a tuple per layer, got "
                         f"{[[tuple(n.shape) for n in pair] for pair in layer_negatives]}")
    in_batch = cos_sim(z1, z2) / temp
    negatives = [cos_sim(z1, n) / temp for pair in layer_negatives for n in pair]
    logits = torch.cat([in_batch] + negatives, dim=1)
    labels = torch.arange(len(z1), device=z1.device)
    # Code over paper: the authors average this with SimCSE's plain loss; Eq. 4 has only the first.
    return (F.cross_entropy(logits, labels) + F.cross_entropy(in_batch, labels)) / 2


def sscl_views(encoder, batch: dict, layers=None, head=None, *, pool=None, dtype=None,
               projection=None, dropout_positive: bool = True, both_views: bool = True) -> tuple:
    """(z1, z2, *negatives) in fp32. z1, z2: the last layer's two dropout views of N sentences in
    one pass of `encoder` (in train mode; dropout_positive False, Table 2's SSCL-BERT: once, used
    twice). The negatives: each of `layers` (hidden_states' indices; None: L-1 and L-2) pooled
    like z from the same pass, gradients kept, of both views (2N a layer, the released code's) or
    of the anchor's (both_views False). z: the tokens' average (the released pooler), or pool(
    hidden_states, attention_mask); then `projection` (Table 5). Autocast to `dtype` if given."""
    num_views = 2 if dropout_positive else 1
    views = {k: v.repeat(num_views, 1) for k, v in batch.items()}
    device, mask = batch["input_ids"].device, views["attention_mask"]
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):  # the encoder only
        hidden_states = encoder(**views, output_hidden_states=True).hidden_states
    last = len(hidden_states) - 1  # hidden_states: the embeddings, then layers 1..L
    layers = (last - 1, last - 2) if layers is None else layers
    if not all(1 <= layer < last for layer in layers):
        raise ValueError(f"SSCL's negative layers are intermediate ones, 1..{last - 1} of this "
                         f"encoder's {last}: got {list(layers)}")

    def pooled(layer):  # that layer as if it were the last (hidden_states[:layer + 1]), like z
        if pool is not None:
            return pool(hidden_states[:layer + 1], mask)
        weights = mask.unsqueeze(-1).float()  # the average over each sentence's tokens, in fp32
        return (hidden_states[layer].float() * weights).sum(1) / weights.sum(1)

    z, negatives = pooled(last), [pooled(layer).chunk(num_views) for layer in layers]
    if projection is not None:  # Table 5: every representation projected
        z, negatives = projection(z), [tuple(projection(n) for n in views_of_layer)
                                       for views_of_layer in negatives]
    z1, z2 = z.chunk(2) if dropout_positive else (z, z)
    per_layer = 2 if dropout_positive and both_views else 1
    return (z1, z2, *(n for views_of_layer in negatives for n in views_of_layer[:per_layer]))


def sscl_objective(z1, z2, *negatives, temp: float = 0.05, per_layer: int = 2,
                   gather=None) -> torch.Tensor:
    """sscl_loss of sscl_views's outputs: the negatives grouped `per_layer` (2: both views', 1: the
    anchor's) into each layer's tuple. gather (torchrun) collects all rows, negatives too."""
    if gather is not None:  # global (the released code: each process's own; docs/fidelity.md)
        negatives, z1, z2 = [gather(n) for n in negatives], gather(z1), gather(z2)
    layer_negatives = [tuple(negatives[i:i + per_layer]) for i in range(0, len(negatives),
                                                                        per_layer)]
    return sscl_loss(z1, z2, layer_negatives, temp)


def sscl_step(encoder, batch: dict, layers=None, head=None, temp: float = 0.05, *, pool=None,
              dtype=None, gather=None, projection=None, dropout_positive: bool = True,
              both_views: bool = True) -> torch.Tensor:
    """One step's SSCL loss, to back-propagate: a transformers encoder (AutoModel, in train mode)
    and its tokenizer's output for a list of sentences. A whole step, as a program:

        from transformers import AutoModel, AutoTokenizer
        path = "bert-base-uncased"  # the encoder: a Hub id or a local folder
        tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5)
        sentences = ["A man plays a guitar.", "A woman slices an onion.", "Two dogs run."]
        batch = tokenizer(sentences, padding=True, truncation=True, max_length=32,
                          return_tensors="pt")
        loss = sscl_step(model.train(), batch)  # the average pooler: no head
        loss.backward(); optimizer.step(); optimizer.zero_grad()

    The defaults are the recipe's (RECIPE; layers L-1 and L-2 of both views, Figure 3b); Figure 3a:
    layers=(k,); Table 2's SSCL-BERT: dropout_positive False; Table 5: a projection nn.Linear(d,
    128 or 256), kept at evaluation; Table 7's "N pairs": both_views False. See sscl_views."""
    z1, z2, *negatives = sscl_views(encoder, batch, layers, head, pool=pool, dtype=dtype,
                                    projection=projection, dropout_positive=dropout_positive,
                                    both_views=both_views)
    per_layer = 2 if dropout_positive and both_views else 1
    return sscl_objective(z1, z2, *negatives, temp=temp, per_layer=per_layer, gather=gather)
# --- end of the objective ---


def negative_layers(num_layers: int, k: int, index: int | None = None) -> list[int]:
    """hidden_states indices of the negative layers: [index], or L-1, ..., L-k (L: the last)."""
    if index is not None:
        if not 1 <= index < num_layers:
            raise plumbing.UsageError(f"--neg_layer_index must be in 1..{num_layers - 1}: {index}")
        return [index]
    if not 0 <= k < num_layers:
        raise plumbing.UsageError(f"--neg_layers must be in 0..{num_layers - 1}, got {k}")
    return [num_layers - i for i in range(1, k + 1)]


def set_sim(hidden_states, attention_mask, pooler: str) -> torch.Tensor:
    """SetSim (Eq. 2) of each sentence for adjacent layers (1,2), ..., (L-1,L), shape (L-1, N): the
    cosine of the two layers' representations, [CLS] before any MLP or the masked mean."""
    pooler = "cls_before_pooler" if pooler == "cls" else pooler
    reps = [common.pool(hidden_states[:layer + 1], attention_mask, pooler)
            for layer in range(1, len(hidden_states))]
    return torch.stack([F.cosine_similarity(a.float(), b.float(), dim=-1)
                        for a, b in zip(reps, reps[1:])])


@torch.no_grad()
def oversmoothing(backbone, tokenizer, pooler: str, sentences, device, desc="SetSim") -> dict:
    """Mean SetSim over `sentences`, per adjacent layer pair {"1-2": ...} (Figure 1), eval mode."""
    was_training, total = backbone.training, 0.0
    backbone.eval()
    with progress.Progress(len(sentences), desc, unit="sentence") as bar:
        for i in range(0, len(sentences), 128):
            batch = tokenizer(sentences[i:i + 128], padding=True, truncation=True,
                              return_tensors="pt").to(device)
            hidden_states = backbone(**batch, output_hidden_states=True).hidden_states
            total = total + set_sim(hidden_states, batch["attention_mask"], pooler).sum(dim=1)
            bar.update(len(batch["input_ids"]))
    backbone.train(was_training)
    means = (total / len(sentences)).tolist()
    return {f"{layer}-{layer + 1}": round(v, 4) for layer, v in enumerate(means, start=1)}


def train_step(ddp_model, head, projection, neg_layers, params, optimizer, scaler, args,
               batch: dict, global_rows: int):
    """One optimizer step on this process's rows of the global batch; (loss, gradient norm)."""
    optimizer.zero_grad(set_to_none=True)  # before the passes: the old gradients freed
    view_options = dict(pool=common.block_pool(args.pooler, head, "avg"), projection=projection,
                        dtype=common.amp_dtype(args.precision), dropout_positive=not
                        args.no_dropout_positive, both_views=args.layer_negatives == "both")
    gather = functools.partial(distributed.gather, rows=global_rows)  # one process: as it is
    if not args.micro_batch_size:  # the paper's step: sscl_step, then backward
        loss = sscl_step(ddp_model, batch, neg_layers, head, args.temp, **view_options,
                         gather=gather)
        scaler.scale(loss).backward()  # into the last layer and the negatives' layers
    else:  # GradCache: the same loss and gradients, K sentences at once (views, then objective)
        per_layer = 2 if view_options["dropout_positive"] and view_options["both_views"] else 1
        loss = common.grad_cache(
            lambda part: sscl_views(ddp_model, data.part_of(batch, part), neg_layers, head,
                                    **view_options),
            functools.partial(sscl_objective, temp=args.temp, per_layer=per_layer, gather=gather),
            len(batch["input_ids"]), args.micro_batch_size, scaler.scale, ddp_model)
    scaler.unscale_(optimizer)  # fp16: clip the true gradients
    grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm or float("inf"))
    scaler.step(optimizer)  # fp16: a step whose gradients overflowed is skipped
    scaler.update()
    return loss, grad_norm


def main(argv=None):
    args = parse_args(argv)
    run = Run(args)  # every flag checked, the seeds set, the device (and torchrun's process group)
    device = run.device

    # The data: a batch padded to --max_seq_length under a CUDA graph, else to its longest row
    with distributed.main_process_first():  # downloads and datasets' cache: process 0 first
        tokenizer, backbone = hub.load_pretrained(args.model_name_or_path)
        prebuilt_mask, switched_on = run.check_encoder(backbone, tokenizer)  # a state a layer
        vars(args).update(switched_on)  # the model's --dropout, --fit_memory's memory flags
        examples, train_file, subset = data.training_examples(args)
        corpus = data.TokenizedCorpus(examples, tokenizer, args.max_seq_length,
                                      data.pad_multiple(args))  # --compile: a multiple of 8
    loader = data.make_loader(corpus, args, device)
    total_steps = args.max_steps if args.max_steps is not None else args.epochs * len(loader)

    # The model: the MLP on [CLS] with --pooler cls, and Table 5's projection (at evaluation too).
    backbone.to(device).train()
    common.set_dropout(backbone, args.dropout)  # --dropout (SimCSE Table 3); None: the model's own
    head = common.MLPHead(backbone.config).to(device) if args.pooler == "cls" else None
    eval_pooler = common.eval_pooler(args)
    projection = torch.nn.Linear(backbone.config.hidden_size, args.output_dim).to(device) \
        if args.output_dim else None
    model = common.BackboneWithHeads(backbone, head, projection, prebuilt_mask=prebuilt_mask)
    eval_encoder = common.Encoder(model, head, tokenizer, eval_pooler, device, projection)
    params = [p for p in model.parameters() if p.requires_grad]
    ddp_model = distributed.data_parallel(model, args.compile)  # DDP under torchrun; --compile
    # The optimiser
    optimizer, scheduler = common.make_optimizer(params, args, total_steps)
    scaler = common.grad_scaler(device, args.precision)  # fp16's loss scaling, else a pass-through
    neg_layers = negative_layers(backbone.config.num_hidden_layers, args.neg_layers,
                                 args.neg_layer_index)

    # The loop
    run.start(loader, total_steps, eval_encoder, [backbone, head], train_file, subset,
              backbone=backbone, head=head, optimizer=optimizer, scheduler=scheduler,
              scaler=scaler, projection=projection)  # what last/ saves
    batches = data.batches(loader)  # epoch after epoch
    one_step = functools.partial(train_step, ddp_model, head, projection, neg_layers, params,
                                 optimizer, scaler, args)
    # On one CUDA GPU the step is by default replayed from a CUDA graph (--no_cuda_graph: eager).
    train = graph.StepGraph(one_step, optimizer, args.cuda_graph)
    for step in run.steps():  # 0: the initial model; --resume: after last/'s; a signal ends it
        if step > 0:
            global_rows, batch = next(batches)  # global_rows: the batch's over all processes
            loss, grad_norm = train({k: v.to(device, non_blocking=True) for k, v in batch.items()},
                                    global_rows)
            scheduler.step()  # outside the step (and its graph): the next step's lr
            run.record(loss, grad_norm)  # on the device till a log: no host sync
        if step % args.eval_steps == 0 or step == total_steps:  # the dev gate: STS-B dev
            if run.dev_gate(step) > run.best_dev:  # the first defined score saves
                run.save_best(step, backbone, head, tokenizer, eval_pooler, projection)

    # The end: best/ evaluated as eval_sts.py evaluates it (its projection too), then results.json;
    # --report_oversmoothing adds SetSim before and after training (STS-B test).
    results = run.evaluate_best(eval_pooler)
    if args.report_oversmoothing and results is not None and not results["interrupted"]:
        sentences = run.sentences("STSBenchmark", "test")
        results["setsim"] = {when: oversmoothing(hub.load_pretrained(path)[1].to(device), tokenizer,
                                                 args.pooler, sentences, device, f"SetSim {when}")
                             for when, path in (("before", args.model_name_or_path),
                                                ("after", f"{args.output_dir}/best"))}
    run.write(results)


if __name__ == "__main__":
    plumbing.cli(main)
