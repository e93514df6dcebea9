"""Options: the parser of every script (common.py's training flags, then the run's own here), the papers' presets
merged under the flags the user gives, what the model is, and every option checked before any work."""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch

import plumbing
from plumbing import backbones, distributed, hub, resume, tracking


def add_run_flags(parser) -> None:
    """The flags of a run, not of a method: output, resume, logging, evaluation, devices."""
    g = parser.add_argument_group("the run")
    g.add_argument("--output_dir", default=None, help="best checkpoint (best/) + results.json (default runs/<method>)")
    g.add_argument("--overwrite_output_dir", action="store_true", help="allow an --output_dir that holds a run")
    g.add_argument("--resume", action="store_true",
                   help="continue the interrupted run in --output_dir from its last/ (the same "
                        "arguments), to exactly the result of an uninterrupted run")
    g.add_argument("--auto_resume", action="store_true",
                   help="the same command starts the run or, when --output_dir holds its last/, resumes "
                        "it (a requeued SLURM job, torchrun --max_restarts); a run stopped before its "
                        "first save starts again")
    g.add_argument("--save_steps", type=int, default=None,
                   help="also save last/ every this many steps (see --save_minutes; always on Ctrl-C / SIGTERM)")
    g.add_argument("--save_minutes", type=float, default=10.0,
                   help="save last/ (and write best/) at the first dev gate after this many minutes of training since "
                        "the last save; 0: at every dev gate. A SIGKILL loses what came after the last save")
    g.add_argument("--keep_last", action="store_true", help="keep last/ when the run completes (the weights, twice "
                                                            "their size of optimiser state, the RNG streams)")
    g.add_argument("--logging_steps", type=int, default=None,
                   help="log loss and steps/s every this many steps (default: at the dev steps); "
                        "each log reads the losses from the device: one host sync")
    g.add_argument("--align_uniform_steps", type=int, default=None,
                   help="also encode STS-B dev every this many steps between the dev gates, for the trajectory's "
                        "l_align / l_uniform (SimCSE Figure 2: 10); each costs a dev encoding")
    g.add_argument("--report_to", nargs="+", default=["none"], choices=["none", *tracking.TRACKERS],
                   help="trackers of the loss, lr, gradient norm, STS-B dev, l_align / l_uniform and the test "
                        "scores: tensorboard (<output_dir>/tb), wandb, mlflow, or several; each an optional "
                        "install (plumbing/tracking.py)")
    g.add_argument("--hub_model_id", default=None, help="the Hub id the model will have (user/name): the card's "
                                                        "usage and the upload command name it")
    g.add_argument("--base_model", default=None, help="the Hub id of a local --model_name_or_path, for the card")
    g.add_argument("--license", default=None, help="the model's license for the card (default: the base model's "
                                                   "where the suite knows it)")
    g.add_argument("--log_model", action="store_true", help="at the end, best/ and results.json as a W&B artifact "
                                                           "(type model) and as MLflow artifacts of the run")
    g.add_argument("--run_name", default=None, help="the tracked run's name (default: the method and the "
                                                    "output folder's name; $WANDB_NAME wins for W&B)")
    g.add_argument("--run_tags", nargs="+", default=None, help="the tracked run's tags (W&B, MLflow)")
    g.add_argument("--run_group", default=None, help="the tracked run's group (W&B; an MLflow tag), e.g. a "
                                                     "protocol's name")
    g.add_argument("--no_test_eval", action="store_true", help="skip the final STS test evaluation")
    g.add_argument("--no_align_uniform", action="store_true",
                   help="skip the final l_align / l_uniform of the pretrained model and of best/ (two "
                        "encodings of STS-B dev; the dev gates' own are in the trajectory)")
    g.add_argument("--eval_transfer", nargs="?", const="test", choices=["test", "fasttest"], default=None,
                   help="also evaluate the best checkpoint on SentEval's 7 transfer tasks (eval_transfer.py)")
    g.add_argument("--device", default=None, help="cuda, cuda:N, cpu (default: cuda if available)")
    g.add_argument("--num_workers", type=int, default=0, help="DataLoader worker processes")
    g.add_argument("--fp32", dest="precision", action="store_const", const="fp32", help="alias of --precision fp32")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the encoder for the training passes (batches padded to a "
                        "multiple of 8, so that few shapes compile); with --cuda_graph, the compiled "
                        "step captured in the graph")
    g.add_argument("--pad_to_max_length", action="store_true",
                   help="pad every batch to --max_seq_length (the released train.py's flag): one "
                        "shape for every step, as a CUDA graph needs; the losses of padding to the "
                        "longest row (dropout draws other masks for another shape), more compute")
    g.add_argument("--cuda_graph", action="store_const", const=True, default=None,
                   help="replay each training step from one CUDA graph (plumbing/graph.py; every "
                        "batch padded to --max_seq_length): a launch-bound step on a big GPU several "
                        "times faster. Default: on, on one CUDA GPU for the rows captured on one "
                        "(docs/gpu.md), unless --compile or a memory flag")
    g.add_argument("--no_cuda_graph", dest="cuda_graph", action="store_const", const=False,
                   help="run each training step eagerly, each batch padded to its longest row (miCSE's to "
                        "--max_seq_length: AMI draws its sample in one layout)")
    g.add_argument("--deterministic", action="store_true",
                   help="deterministic algorithms on CUDA (torch.use_deterministic_algorithms, "
                        "CUBLAS_WORKSPACE_CONFIG): a resumed GPU run is then bit-identical; slower")
    g.add_argument("--gradient_checkpointing", action="store_true",
                   help="recompute each encoder layer's activations in the backward pass (dropout replayed): the same "
                        "losses and gradients in less memory, about 1/3 more compute (docs/engineering.md#memory)")
    g.add_argument("--micro_batch_size", type=int, default=None, metavar="K",
                   help="encode each process's batch K examples at a time (GradCache): the loss and gradients of the "
                        "whole batch, its negatives included, with K examples' activations; an extra forward pass")
    g.add_argument("--fit_memory", action="store_true",
                   help="on a GPU, where this command's estimated peak exceeds the free memory, switch on the "
                        "first exact setting that fits (--gradient_checkpointing, then --micro_batch_size K, "
                        "the largest K): the same objective; said in one line, kept in results.json")
    g.add_argument("--count_host_syncs", type=int, default=None, metavar="N",
                   help="count the host-device syncs of training steps 2..N+1 into results.json "
                        "(plumbing/syncs.py; slow while it counts: for tests and bench.py)")


def parser(doc: str, method: str, recipe: dict | None = None) -> plumbing.Parser:
    """A method's parser: common.FLAGS, the pooler and the precision, then the run's flags, every default the
    method's `recipe` gives (its RECIPE; else unsupervised SimCSE's); the method adds its own group, whose flags
    without a default take theirs from `recipe` too (argparse's set_defaults)."""
    import common
    p = plumbing.Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("shared arguments (defaults: the method file's RECIPE)")
    for name, kind, default, text in common.FLAGS:
        g.add_argument(f"--{name}", type=kind, default=default, help=text)
    g.add_argument("--pooler", default="cls", choices=common.POOLERS,
                   help="training pooler; cls = [CLS] + the MLP head")
    g.add_argument("--mlp_only_train", action=argparse.BooleanOptionalAction, default=True,
                   help="with --pooler cls, evaluate [CLS] before the MLP (unsupervised SimCSE)")
    g.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                   help="the encoder's forward pass: auto = bf16 on a CUDA GPU that has it, else "
                        "fp16 with a GradScaler, fp32 on CPU (where bf16 and fp16 are for testing "
                        "their paths); losses are always fp32")
    add_run_flags(p)
    p.set_defaults(method=method, presets=None, backbone=None, backbone_config=None, **(recipe or {}))
    return p


# --------------------------------------------------------------------------------------------------------- presets
def parse(parser, argv, table: dict, choose=None):
    """parser.parse_args(argv) with the presets of `table` ({key: (settings, source)}) as the defaults: the rows
    `choose(known_args, backbone)` names, in order, later rows over earlier (default: the backbone's row); the
    flags the user gives win. args.presets records the sources (a fraction's row other than --fraction's: the
    nearest; NO_PRESETS where no row applies), the values that applied and those the user's flags replaced (the run
    summary, results.json); args.backbone what the model is."""
    known, _ = parser.parse_known_args(argv)
    kind, config = backbone(known.model_name_or_path)
    parser.set_defaults(backbone=kind, backbone_config=config)
    keys = [key for key in (choose(known, kind) if choose else [kind]) if key in table]
    presets = {name: value for key in keys for name, value in table[key][0].items()}
    parser.set_defaults(**presets)
    args = parser.parse_args(argv)
    given = {k: getattr(args, k) for k in presets}
    note = "".join(f", the nearest to --fraction {known.fraction:g} in PRESETS" for key in keys
                   if isinstance(key, float) and key != known.fraction)
    args.presets = {"source": "; ".join(table[key][1] for key in keys) + note if presets else NO_PRESETS,
                    "applied": {k: v for k, v in given.items() if v == presets[k]},
                    "overridden": {k: v for k, v in given.items() if v != presets[k]}}
    return args


NO_PRESETS = "none: the defaults in --help (BERT-base's)"  # no row of the table fits this model and these flags


def nearest(values, fraction: float) -> float:
    """The value nearest to `fraction` on a log scale (a per-fraction table's row)."""
    return min(values, key=lambda f: abs(math.log10(f) - math.log10(fraction)))


# What a model is, from its config (model_type, width, depth), not its name: a local copy of roberta-large is
# roberta-large. A hub id not downloaded yet is known by its published config.
BACKBONES = {("bert", 768, 12): "bert-base", ("bert", 1024, 24): "bert-large",
             ("roberta", 768, 12): "roberta-base", ("roberta", 1024, 24): "roberta-large"}
HUB_BACKBONES = {"bert-base-uncased": "bert-base", "bert-base-cased": "bert-base",
                 "bert-large-uncased": "bert-large", "bert-large-cased": "bert-large",
                 "roberta-base": "roberta-base", "roberta-large": "roberta-large"}


def backbone(name_or_path: str) -> tuple[str | None, str]:
    """(bert-base, bert-large, roberta-base, roberta-large or None, what its config says); a config that is not a
    bidirectional encoder's is refused here, before any work."""
    config = hub.local_config(name_or_path)
    if config is None:
        kind = HUB_BACKBONES.get(name_or_path.split("/")[-1])
        return kind, "not read yet" if kind is None else f"{kind} (the hub's config)"
    backbones.refuse_non_encoder(config, name_or_path)
    key = (config.model_type, config.hidden_size, config.num_hidden_layers)
    return BACKBONES.get(key), f"{key[0]}, {key[1]} wide, {key[2]} layers"


# ---------------------------------------------------------------------------------------------------------- checks
def refuse_method_only_flags(args) -> None:
    """The ablation scripts' run flags: one process, no last/, no --compile, the end without transfer tasks; a
    method file's flags given to them are one line, not ignored."""
    plumbing.refuse_flags(args, ("resume", "auto_resume", "save_steps", "keep_last", "compile", "eval_transfer",
                                 "align_uniform_steps", "gradient_checkpointing", "micro_batch_size",
                                 "pad_to_max_length", "cuda_graph", "fit_memory"),
                          "not in the ablation scripts (method files have them)")


def check_args(args) -> torch.device:
    """Every shared flag against its meaning, the device, the paths the run reads, and an output folder that can be
    written, before any work; the device. What the folder holds against what the command asks: outdir.check."""
    check = plumbing.check_range
    check(args, "fraction", lambda v: 0 < v <= 1, "0 < fraction <= 1")
    check(args, "seed", lambda v: 0 <= v < 2**32, "0 <= seed < 2^32")
    check(args, "batch_size", lambda v: v >= 2, "at least 2 (one sentence has no negatives)")
    check(args, "max_seq_length", lambda v: 2 <= v <= 512, "2..512 tokens")
    for name in ("lr", "temp", "epochs", "eval_steps", "logging_steps", "align_uniform_steps", "save_steps",
                 "count_host_syncs", "micro_batch_size"):
        check(args, name, lambda v: v > 0, "a positive number")
    for name in ("max_steps", "warmup_steps", "max_grad_norm", "num_workers", "save_minutes"):
        check(args, name, lambda v: v >= 0, "a non-negative number")
    check(args, "dropout", lambda v: 0 <= v < 1, "0 <= rate < 1")
    args.logging_steps = args.logging_steps or args.eval_steps
    tracking.check(args.report_to, getattr(args, "log_model", False))
    device = plumbing.resolve_device(args.device)
    args.precision = resolve_precision(args.precision, device)
    if args.count_host_syncs and args.compile:
        raise plumbing.UsageError("--count_host_syncs counts under a TorchDispatchMode, which --compile does not "
                                  "trace: give one of them")
    check_paths(args)
    args.output_dir = str(args.output_dir or Path("runs") / args.method)
    check_cuda_graph(args, device)
    plumbing.check_writable(args.output_dir, "--output_dir")  # permissions, a read-only file system, a full disk
    return device


GRAPHED_METHODS = ("simcse", "simcsepp", "sscl", "whitenedcse", "micse")  # whose step StepGraph captures
# --cuda_graph by default: each captured and replayed on a GPU (docs/gpu.md); miCSE's AMI scores the positions the
# attention mask fills, so the graph's padding to --max_seq_length leaves its objective as it is
AUTO_GRAPHED = GRAPHED_METHODS


def check_cuda_graph(args, device: torch.device) -> None:
    """--cuda_graph: on where given, off with --no_cuda_graph, by default on for the AUTO_GRAPHED methods on one CUDA
    GPU without --compile or a memory flag; a resumed run keeps what it started with (its padding too). Given, what a
    graph cannot capture is refused in one line before any work. On: every batch padded to --max_seq_length, the one
    shape a graph replays."""
    if not hasattr(args, "cuda_graph"):  # the ablation scripts
        return
    cannot = {"the device": device.type != "cuda" and f"a CUDA graph needs a CUDA GPU, not {device.type}",
              "torchrun": int(os.environ.get("WORLD_SIZE", "1")) > 1 and "DDP's all-reduce hooks are not captured: "
                                                                           "one process",
              "--micro_batch_size": args.micro_batch_size and "GradCache reads and sets the RNG's state on the host",
              "--gradient_checkpointing": args.gradient_checkpointing and "the recomputation reads the RNG's state "
                                                                          "on the host"}
    started = resume.started_args(args.output_dir) if args.resume or args.auto_resume else None
    if started is not None and "cuda_graph" in started:  # the run's own choice, and so its batches' padding
        if args.cuda_graph is not None and args.cuda_graph != bool(started["cuda_graph"]):
            how = "with --cuda_graph" if started["cuda_graph"] else "eagerly (without a CUDA graph)"
            raise plumbing.UsageError(f"--{'auto_' if args.auto_resume else ''}resume: the run in {args.output_dir} "
                                      f"started {how}; resume it as it started: leave out --cuda_graph and "
                                      "--no_cuda_graph")
        given, args.cuda_graph = args.cuda_graph, bool(started["cuda_graph"])  # and its padding (--fit_memory may
        args.pad_to_max_length = args.pad_to_max_length or args.cuda_graph or bool(  # have turned the graph off)
            started.get("pad_to_max_length"))
        what = next((what for what, why in cannot.items() if why), None)
        if args.cuda_graph and what is not None and not given:  # the same steps eagerly, padded as they were
            args.cuda_graph = False
            distributed.log(f"note: the run started with the CUDA graph; {what} here ({cannot[what]}): it goes on "
                            "eagerly, its batches padded to --max_seq_length as they were (the same steps)")
    if args.cuda_graph is None:  # the default (--compile: compiled eagerly, unless --cuda_graph is given too)
        args.cuda_graph = args.method in AUTO_GRAPHED and not any(cannot.values()) and not args.compile
    elif args.cuda_graph:  # given, or a resumed graph's: refused as a fresh command is
        for what, why in cannot.items():
            if why:
                raise plumbing.UsageError(f"--cuda_graph with {what}: {why}; leave --cuda_graph out to run "
                                          "eagerly")
    args.pad_to_max_length = args.pad_to_max_length or args.cuda_graph


def check_paths(args) -> None:
    """Every local path the run reads, before anything is loaded (a model takes seconds to load, a corpus minutes):
    --model_name_or_path where it is a local folder (its files), --train_file, --senteval_dir (its STS/ folder; each
    file is read when the run starts). A flag not given is a download from the Hub, later."""
    hub.check_local_model(args.model_name_or_path)
    if args.train_file is not None:
        plumbing.check_file(args.train_file, "--train_file")
    if args.senteval_dir is not None:
        hub.senteval_folder(args.senteval_dir)


def resolve_precision(precision: str, device: torch.device) -> str:
    """"auto": bf16 on a CUDA GPU that supports it, fp16 (with a GradScaler) on an older one, fp32 on CPU."""
    cuda = device.type == "cuda"
    bf16_ok = not cuda or torch.cuda.is_bf16_supported(including_emulation=False)
    if precision == "auto":
        return ("bf16" if bf16_ok else "fp16") if cuda else "fp32"
    if precision == "bf16" and not bf16_ok:
        raise plumbing.UsageError("--precision bf16: this GPU has no bf16; use --precision fp16 (or auto)")
    return precision  # bf16 and fp16 on a CPU: for testing their paths (torch runs both there, slowly)


def deterministic_algorithms() -> None:
    """--deterministic: every op's deterministic algorithm (PyTorch raises where there is none; SDPA then picks a
    deterministic kernel), cuBLAS's fixed workspace (read when cuBLAS starts: before any CUDA work) and no cuDNN
    autotuning."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
