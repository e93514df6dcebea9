"""The GPU memory each paper recipe needs, known before the run, without a GPU and without a download: the peak of
a training step (split into weights, gradients, optimiser state and activations), of a dev gate and of the final
evaluation, each recipe at its paper settings (batch, --max_seq_length, the precision of its released scripts), and
for each GPU size it does not fit, the setting that trains the same objective in less memory.

    python tools/bench.py --memory                                     # every recipe on the four backbones
    python tools/bench.py --memory --recipes simcse-sup --backbones roberta-large --gpus 24
    python tools/bench.py --memory --recipes micse --model_name_or_path DIR --batch_size 128   # your model
    python tools/bench.py --memory --recipes simcse-sup --precision bf16 --gradient_checkpointing

Every flag not listed below goes to each row's method file, which takes it as a run of it would, over the row's
presets: --batch_size, --max_seq_length, --precision (default: the released scripts'), --fraction (it picks miCSE's
and SimCSE's few-shot presets), and the memory flags --gradient_checkpointing and --micro_batch_size K. A flag the
method does not have is its one-line error. The row micse-fewshot is miCSE's preset for 1% of wiki1m (--fraction 0.01:
batch 64, fp32 as its README's commands).

The columns (GiB a process): weights (the model, its heads, the best model's copy, miCSE's momentum encoder),
gradients (those alive at the step's peak: 0.00 where the peak comes before the backward makes any, as the gradients
are set to None before the passes), optimizer (AdamW's moments), activations (the rest of the step's peak), step (their
sum), dev gate, final eval, then each GPU size. The estimates come from plumbing/memory.py (one step traced on fake
tensors: what it follows of a GPU, and what it cannot know). A run on a GPU checks its own before it trains
(Run.start).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's modules

import plumbing  # noqa: E402
import protocols  # noqa: E402
from plumbing import hub, memory  # noqa: E402

# name: (method file, flags): the six rows of the paper protocol (protocols.py's), and miCSE at Table 2's 1%
RECIPES = {**{row["name"]: (Path(row["script"]).stem, row["flags"]) for row in protocols.BUILT_IN["paper"]["rows"]},
           "micse-fewshot": ("micse", ["--fraction", "0.01"])}  # its preset: batch 64
# name: (its Hub id, its published config), so that nothing is downloaded; the large models share one shape
LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
ROBERTA = dict(model_type="roberta", vocab_size=50265, max_position_embeddings=514, type_vocab_size=1,
               layer_norm_eps=1e-5, pad_token_id=1)
BACKBONES = {"bert-base": ("bert-base-uncased", dict(model_type="bert")),
             "bert-large": ("bert-large-uncased", dict(model_type="bert", **LARGE)),
             "roberta-base": ("roberta-base", ROBERTA),
             "roberta-large": ("roberta-large", {**ROBERTA, **LARGE})}
GPUS = (16, 24, 40, 80)  # GiB


def config_of(name: str):
    import transformers
    settings = dict(BACKBONES[name][1])
    return transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)


def recipe_args(recipe: str, model: str, extra: list[str]):
    """The method's arguments at its paper settings for `model` (its presets, the released precision)."""
    script, flags = RECIPES[recipe]
    precision = protocols.RELEASED_PRECISION[script][0]
    return importlib.import_module(script).parse_args(["--model_name_or_path", model, *flags, "--precision",
                                                      precision, *extra])


def cells(found: dict, args, config, world: int, gpus) -> list[str]:
    """Each GPU's cell: "fits", or the setting that fits and its peak, or "no"."""
    row = []
    for size in gpus:
        capacity = memory.usable(size * 2**30)
        if memory.peak(found) <= capacity:
            row.append("fits")
            continue
        setting, fitted = memory.first_fit(args, config, capacity, world, found)
        row.append(f"`{memory.describe(setting)}` ({memory.peak(fitted) / 2**30:.1f})" if setting else "no")
    return row


def table(recipes, backbones, gpus, world: int = 1, model: str | None = None, extra=()) -> list[str]:
    """The markdown table: its header, then a row for each recipe on each backbone (or `model`), printed as each is
    traced. Every row's arguments are parsed first, so that a bad flag is one line before any tracing."""
    header = ["recipe", "backbone", "batch", "precision", "weights", "gradients", "optimizer", "activations",
              "step", "dev gate", "final eval"] + [f"{g:g} GB" for g in gpus]
    targets = [(model, None)] if model else [(BACKBONES[b][0], b) for b in backbones]
    rows = []
    for recipe in recipes:
        for name_or_path, backbone in targets:
            config = config_of(backbone) if backbone else hub.local_config(name_or_path)
            if config is None:
                raise plumbing.UsageError(f"--model_name_or_path {name_or_path}: no config.json there (give a local "
                                          "model folder, or --backbones)")
            rows.append((recipe, name_or_path, backbone, config, recipe_args(recipe, name_or_path, list(extra))))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    print(f"GiB a process; a GPU's cell: fits, or the setting that fits and its peak (usable: the size less "
          f"{memory.CONTEXT / 2**30:.1f} GiB of CUDA context and {memory.FRAGMENTATION:.0%} for the allocator)")
    print("\n".join(lines), flush=True)
    for recipe, name_or_path, backbone, config, args in rows:
        found = memory.estimate(args, config, world)
        row = [recipe, backbone or Path(name_or_path).name, str(args.batch_size), args.precision,
               *[f"{found[k] / 2**30:.2f}" for k in ("weights", "gradients", "optimizer", "activations",
                                                       "step", "dev_gate", "final_eval")],
               *cells(found, args, config, world, gpus)]
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    return lines


def main(argv=None) -> None:
    parser = plumbing.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--backbones", nargs="+", default=list(BACKBONES), choices=list(BACKBONES))
    parser.add_argument("--model_name_or_path", default=None,
                        help="a local model folder instead of --backbones (its config.json is read)")
    parser.add_argument("--gpus", nargs="+", type=float, default=list(GPUS), help="GPU sizes in GiB")
    parser.add_argument("--processes", type=int, default=1, help="torchrun's processes: each holds batch / N rows")
    args, extra = parser.parse_known_args(argv)  # anything else goes to the method, e.g. --batch_size 128
    flags = [s for action in parser._actions for s in action.option_strings]
    if any(f.startswith(e) for e in extra if e.startswith("--") for f in flags):  # --backbone: this tool's own
        parser.error(parser.unrecognized(extra))
    plumbing.check_range(args, "processes", lambda v: v >= 1, "a positive integer")
    table(args.recipes, args.backbones, args.gpus, args.processes, args.model_name_or_path, extra)


if __name__ == "__main__":
    plumbing.cli(main)
