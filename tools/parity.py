"""The suite against the authors' released code, run side by side: one training step of each method in both, on the
same tiny random model, batch and dropout masks, loss and every parameter's gradient compared; the losses alone on
identical embeddings or attention maps; each repository's evaluation poolers against eval_sts.py's. With --model: each
method trained from a real checkpoint's weights for --steps, step by step (the released model given the suite's
weights at every step: loss and gradients compared) and free-running (each side its own AdamW: losses, gradient norms,
weights apart), then each side's STS-B dev through its repository's evaluation.py and eval_sts.py.

    python tools/parity.py --released DIR             # DIR holds the clones under their GitHub names (SimCSE,
                                                      # SimCSE-plus-plus, SSCL, WhitenedCSE, acl2023-micse); an
    python tools/parity.py --simcse PATH --micse PATH # absent one is skipped; or one flag a repository
    python tools/parity.py --released DIR --model ../shared/models/all-MiniLM-L6-v2 --steps 30 --json runs.json

No released code is copied into this repository: the tool reads it from the clones, and each adaptation it needs under
today's torch and transformers is applied at run time and printed, one line each. miCSE's code needs einops.

How the two sides meet:
- Weights: the released model class (BertForCL, RobertaForCL) is built (tiny, or with the checkpoint's encoder) and
  its weights copied into the suite's backbone and heads; gradients compared parameter by parameter, released names.
- Batch: the released code takes (sentences, views, tokens) and flattens it sentence-major (s0 v0, s0 v1, s1 v0, ...);
  the suite repeats the batch view-major (all v0, then all v1). Both get the same token ids.
- Dropout masks (MatchedDropout): torch.nn.functional.dropout is replaced, for the passes compared, by one whose mask
  for a row depends on (the step, the call's place in the encoder pass, the row's sentence and view), not on the place
  in the random stream. Attention is eager on both sides, so the attention-probability dropout goes through it too.
- Random draws: WhitenedCSE's permutations and miCSE's samples are drawn once and given to both sides.

Exit status 0 when every comparison (every step by step) is within --tolerance or is a documented deviation
(DEVIATIONS, with its reason), 1 otherwise. docs/fidelity.md holds dated outputs and what each deviation means.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import importlib.machinery
import importlib.util
import io
import math
import sys
import tempfile
import types
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the suite's modules

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402

import common  # noqa: E402
import eval_sts  # noqa: E402
import micse  # noqa: E402
import plumbing  # noqa: E402
import simcse  # noqa: E402
import simcsepp  # noqa: E402
import sscl  # noqa: E402
import whitenedcse  # noqa: E402
from plumbing import files  # noqa: E402

# repository key -> (its GitHub name, the file the tool loads, the first heading of its README): the forks share
# files (SimCSE++'s clone has simcse/models.py too), so a clone is known by its README's title
REPOSITORIES = {"simcse": ("princeton-nlp/SimCSE", "simcse/models.py", "SimCSE: Simple Contrastive Learning"),
                "simcsepp": ("Jiahao004/SimCSE-plus-plus", "simcse/models_re.py", "SimCSE++"),
                "sscl": ("nuochenpku/SSCL", "sscl/models.py", "Alleviating Over-smoothing for Unsupervised Sentence"),
                "whitenedcse": ("SupstarZh/WhitenedCSE", "whitenedcse/shuffled_group_whitening.py", "WhitenedCSE:"),
                "micse": ("SAP-samples/acl2023-micse", "model/models.py", "miCSE:")}
# Comparisons whose difference is documented (docs/fidelity.md): name -> why
DEVIATIONS = {
    "whitenedcse bert: step (released row layout)":
        "the released head whitens contiguous thirds of the sentence-major batch (each third mixes views), the "
        "suite each view; with the rows laid out per view the whitening is the same (the rows below)",
    "micse bert: loss alone, rho = 1 (identical views)":
        "the released code takes log(0) = NaN and replaces the AMI term by the constant 100; the suite clamps rho^2 "
        "at 1 - 1e-6 (a finite term); neither has a gradient there",
    **{f"{fork} eval: avg_first_last / eval_sts avg_first_last": "the forks average hidden_states[0] (the embedding "
       "output): eval_sts's avg_embeddings_last (next row)" for fork in ("sscl", "simcsepp", "micse")}}
ADAPTED: list[str] = []  # the adaptations applied, in order


# ------------------------------------------------------------------------------------------ the released code
def adapt(repository: str, why: str) -> None:
    line = f"adaptation [{repository}]: {why}"
    if line not in ADAPTED:
        ADAPTED.append(line)
        print(line)


def stub(name: str, **attributes) -> types.ModuleType:
    """A stand-in module for a dependency the comparison does not exercise (wandb's logging, SentEval)."""
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # a find_spec while it stands in (accelerate's)
    return module


def load_released(repository: str, clone: Path, relative: str, patches=(), stubs=None) -> types.ModuleType:
    """A module of a clone, executed from its source with `patches` (old text, new text, why) applied and `stubs` in
    sys.modules while it imports; registered under a private name."""
    path = clone / relative
    source = path.read_text()
    for old, new, why in patches:
        if old not in source:
            raise plumbing.UsageError(f"{path}: the text an adaptation replaces is not there ({old[:40]!r}); is "
                                      "this clone at another commit?")
        source = source.replace(old, new)
        adapt(repository, f"{relative}: {why}")
    name = f"released_{repository}_{relative.replace('/', '_').removesuffix('.py')}"
    module = types.ModuleType(name)
    module.__file__ = str(path)
    with standing_in(stubs or {}), mock.patch.object(sys, "path", [str(clone), *sys.path]):
        exec(compile(source, str(path), "exec"), module.__dict__)
    sys.modules[name] = module
    return module


@contextlib.contextmanager
def standing_in(stubs: dict):
    """`stubs` in sys.modules for the block, what was there before back after it (the modules the block imports
    stay: mock.patch.dict would drop them)."""
    saved = {key: sys.modules.get(key) for key in stubs}
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for key, value in saved.items():
            sys.modules.pop(key, None) if value is None else sys.modules.__setitem__(key, value)


def model_args(**overrides) -> types.SimpleNamespace:
    """The released ModelArguments a cl_forward reads (train.py's defaults), with `overrides`."""
    defaults = dict(pooler_type="cls", temp=0.05, hard_negative_weight=0.0, do_mlm=False, mlm_weight=0.1,
                    mlp_only_train=True, pos_ratio=1.0, hard_negative_layers=2, do_neg=True, style="miCSE",
                    min_layer=0, max_layer=2, diag_only=False)
    return types.SimpleNamespace(**defaults | overrides)


# -------------------------------------------------------------------------------------------- the tiny models
def tiny_config(kind: str, hidden: int = 32, layers: int = 3):
    common_settings = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                           intermediate_size=2 * hidden, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    if kind == "bert":
        config = transformers.BertConfig(vocab_size=60, max_position_embeddings=40, **common_settings)
    else:  # RoBERTa: padding id 1, positions after it
        config = transformers.RobertaConfig(vocab_size=60, max_position_embeddings=42, pad_token_id=1,
                                            bos_token_id=0, eos_token_id=2, type_vocab_size=1, **common_settings)
    config._attn_implementation = "eager"  # attention dropout through F.dropout, attention weights returned
    return config


def token_batch(kind: str, config, sentences: int, seed: int = 0) -> dict:
    """`sentences` rows of random token ids between [CLS]/<s> and [SEP]/</s>, of different lengths, padded."""
    g = torch.Generator().manual_seed(seed)
    first, last, pad = (101 % config.vocab_size, 102 % config.vocab_size, 0) if kind == "bert" else (0, 2, 1)
    lengths = torch.randint(4, 12, (sentences,), generator=g)
    ids = nn.utils.rnn.pad_sequence([torch.cat([torch.tensor([first]), torch.randint(
        5, config.vocab_size, (n - 2,), generator=g), torch.tensor([last])]) for n in lengths.tolist()], True, pad)
    batch = {"input_ids": ids, "attention_mask": (torch.arange(ids.shape[1]) < lengths[:, None]).long()}
    if kind == "bert":
        batch["token_type_ids"] = torch.zeros_like(ids)
    return batch


def released_inputs(columns: list[dict]) -> dict:
    """The released layout, (sentences, views or columns, tokens), from one batch a column."""
    return {key: torch.stack([c[key] for c in columns], dim=1) for key in columns[0]}


def suite_parts(released, kind: str, pooler_head: bool = True):
    """The suite's backbone (no pooler layer: BertForCL has none) and head with the released model's weights: the MLP
    head, WhitenedCSE's on the released 128 groups, or None; and the head's layer holding the released mlp.dense."""
    config = copy.deepcopy(released.config)
    backbone = (transformers.BertModel if kind == "bert" else transformers.RobertaModel)(config,
                                                                                          add_pooling_layer=False)
    backbone.load_state_dict(getattr(released, kind).state_dict())
    mlp, head, dense = getattr(released, "mlp", None), None, None
    if hasattr(mlp, "dbn"):  # WhitenedCSE's head: its whitening, its hard-coded 128 groups
        head = whitenedcse.WhitenedHead(config.hidden_size, 128)
        dense = head.linear
    elif pooler_head and hasattr(mlp, "dense"):
        head = common.MLPHead(config)
        dense = head[0]
    if dense is not None:
        dense.load_state_dict(mlp.dense.state_dict())
    return backbone.train(), head, dense


def suite_parameters(kind: str, backbone, dense=None) -> dict:
    """The suite's parameters under the released names: <kind>.<parameter>, and mlp.dense's (`dense`)."""
    return {f"{kind}.{n}": p for n, p in backbone.named_parameters()} | (
        {f"mlp.dense.{n}": p for n, p in dense.named_parameters()} if dense is not None else {})


def released_model(module, kind: str, config, **arguments):
    """The released BertForCL or RobertaForCL on `config`, from seed 1, with ModelArguments `arguments`."""
    torch.manual_seed(1)
    return (module.BertForCL if kind == "bert" else module.RobertaForCL)(config, model_args=model_args(**arguments))


# ----------------------------------------------------------------------------------------- matched dropout
class MatchedDropout:
    """Dropout whose mask for a row depends on (the call's place in the encoder pass, the row's key), so that two
    implementations laying out the same rows differently draw the same masks. `expect(keys, ...)`: the rows' keys of
    the next encoder passes, in order (None for a pass without dropout). A pass whose nn.Dropout modules are all in
    eval mode draws none (transformers 5 applies BERT's attention dropout under the attention module's flag: such a
    pass, the released SimCSE++ dropout-off pass, is then dropout-free as it was under transformers 4)."""

    def __init__(self, seed: int = 0):
        self.seed, self.passes, self.keys, self.call, self.off = seed, [], None, 0, False

    def expect(self, *passes) -> None:
        self.passes = list(passes)

    def start_pass(self, module, args, kwargs):
        self.keys = self.passes.pop(0) if self.passes else None
        self.call = 0
        self.off = not any(m.training for m in module.modules() if isinstance(m, nn.Dropout))

    def dropout(self, input, p=0.5, training=True, inplace=False):
        if not training or p == 0.0 or self.off:
            return input
        if self.keys is None or len(self.keys) != len(input):
            raise RuntimeError("a dropout call outside a pass whose rows are known")
        masks = []
        for key in self.keys:
            digest = hashlib.sha256(f"{self.seed}:{self.call}:{key}".encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            masks.append(torch.rand(input.shape[1:], generator=g) >= p)
        self.call += 1
        return input * torch.stack(masks).to(input.dtype) / (1 - p)

    @contextlib.contextmanager
    def on(self, *encoders):
        hooks = [e.register_forward_pre_hook(self.start_pass, with_kwargs=True) for e in encoders]
        try:
            with mock.patch.object(F, "dropout", self.dropout):
                yield self
        finally:
            for h in hooks:
                h.remove()


def sentence_major(sentences: int, views: int) -> list[int]:
    """Row keys (sentence * views + view) of the released layout: s0 v0, s0 v1, s1 v0, ..."""
    return list(range(sentences * views))


def view_major(sentences: int, views: int) -> list[int]:
    """Row keys of the suite's layout: all sentences of view 0, then of view 1, ..."""
    return [(r % sentences) * views + r // sentences for r in range(sentences * views)]


# ------------------------------------------------------------------------------------------------ comparing
def difference(a, b) -> tuple[float, float]:
    """(largest absolute difference, that over the largest magnitude); a missing gradient counts as zeros."""
    if a is None and b is None:
        return 0.0, 0.0
    a = torch.zeros_like(b) if a is None else a.detach().double()
    b = torch.zeros_like(a) if b is None else b.detach().double()
    absolute = (a - b).abs().max().item() if a.numel() else 0.0
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-30) if a.numel() else 1.0
    return absolute, absolute / scale


def row(name: str, loss_a, loss_b, grads_a=None, grads_b=None) -> dict:
    """One comparison: the loss, and the worst parameter (or input) gradient."""
    loss_abs, loss_rel = difference(torch.as_tensor(loss_a), torch.as_tensor(loss_b))
    worst = ("-", 0.0, 0.0)
    for key in sorted(set(grads_a or {}) | set(grads_b or {})):
        absolute, relative = difference((grads_a or {}).get(key), (grads_b or {}).get(key))
        if absolute > worst[1] or absolute != absolute:  # a NaN is the worst
            worst = (key, absolute, relative)
    return {"name": name, "loss_released": float(loss_a), "loss_suite": float(loss_b), "loss_abs": loss_abs,
            "loss_rel": loss_rel, "grad_worst": worst[0], "grad_abs": worst[1], "grad_rel": worst[2],
            "gradients": len(set(grads_a or {}) | set(grads_b or {}))}


def matched_step(encoder, loss, *passes, seed: int = 0) -> torch.Tensor:
    """`loss()` (forward passes through `encoder`, `passes` their rows' keys, and a loss) with matched dropout from
    `seed`; backward; the loss."""
    dropout = MatchedDropout(seed)
    with dropout.on(encoder):
        dropout.expect(*passes)
        value = loss()
    value.backward()
    return value.detach()


def released_step(model, inputs: dict, seed: int, *passes):
    """The released model's loss on `inputs` and its gradients, with matched dropout."""
    model.train()
    model.zero_grad(set_to_none=True)
    loss = matched_step(getattr(model, "bert", None) or model.roberta, lambda: model(**inputs).loss, *passes, seed=seed)
    return loss, {n: p.grad for n, p in model.named_parameters()}


def attention_maps(model, batch: dict, seed: int = 0):
    """The attention maps of the suite's two views in its coming step (matched dropout), for the shared draw of AMI's
    samples: (view 0's, view 1's)."""
    probe = MatchedDropout(seed)
    with torch.no_grad(), probe.on(model.backbone):
        probe.expect(view_major(len(batch["input_ids"]), 2))
        maps = model(**common.repeat_views(batch, 2), output_attentions=True).attentions
    return torch.stack(maps, 1).float().chunk(2)


def given_encoder(last, attentions=None) -> mock.Mock:
    """An encoder returning these outputs: the released cl_forward's loss on identical embeddings or attention maps."""
    return mock.Mock(side_effect=[transformers.modeling_outputs.BaseModelOutputWithPoolingAndCrossAttentions(
        last_hidden_state=last, attentions=attentions, pooler_output=None)])


# ---------------------------------------------------------------------------------------------- each method
N = 6  # sentences in the batch
POST_INIT = ("    cls.init_weights()", "    cls.post_init()",
             "cl_init's init_weights() -> post_init() (transformers 5 sets up a model's tied-weight map there)")


def released_module(repository: str, clone: Path, file: str | None = None) -> types.ModuleType:
    """The released model file of SimCSE, SimCSE++ (its `file`), SSCL or miCSE, adapted."""
    if repository != "micse":
        return load_released(repository, clone, file or f"{repository}/models.py", [POST_INIT])
    adapt("micse", "model/models.py: wandb's logging is a stand-in that records nothing")
    plumbing.check_installed(True, "einops", "miCSE's released code")
    patches = [(".cuda()", ".to(cls.device)", "tensor.cuda() (the NaN and no-sample branches) -> the model's device"),
               POST_INIT]
    return load_released("micse", clone, "model/models.py", patches, {"wandb": stub("wandb", log=lambda *a, **k: None)})


def one_step(label: str, module, kind: str, config, columns: list[dict], loss, draws=None, passes=(),
             pooler_head: bool = True, **arguments):
    """One training step of the released model (ModelArguments `arguments`, its random draws given by `draws(the
    suite's model)`) and of the suite's on its weights (`loss(model, head)`: its forward passes and loss), on the same
    batch (`columns`, one a view) and dropout masks (`passes`: those of passes after the first): the row, the released
    model, the suite's head."""
    released = released_model(module, kind, config, **arguments)
    backbone, head, dense = suite_parts(released, kind, pooler_head)
    model = common.BackboneWithHeads(backbone, head)
    with draws(model) if draws else contextlib.nullcontext():
        loss_r, grads_r = released_step(released, released_inputs(columns), 0, sentence_major(N, len(columns)), *passes)
    loss_s = matched_step(backbone, lambda: loss(model, head), view_major(N, len(columns)), *passes)
    grads_s = {n: p.grad for n, p in suite_parameters(kind, backbone, dense).items()}
    return row(label, loss_r, loss_s, grads_r, grads_s), released, head


def simcse_rows(clone: Path) -> list[dict]:
    module = released_module("simcse", clone)
    rows = []
    for kind in ("bert", "roberta"):
        config = tiny_config(kind)
        for label, pooler, supervised in (("unsupervised, cls", "cls", False), ("supervised, cls", "cls", True),
                                          ("unsupervised, avg_first_last", "avg_first_last", False)):
            columns = [token_batch(kind, config, N, seed) for seed in ((0, 1, 2) if supervised else (0, 0))]
            stacked = {k: torch.cat([c[k] for c in columns]) for k in columns[0]}

            def loss(model, head):
                out = model(**stacked, output_hidden_states=True)
                parts = common.embed(out.hidden_states, stacked["attention_mask"], pooler, head).chunk(len(columns))
                hard = torch.cat(parts[2:]) if supervised else None
                return simcse.info_nce(parts[0], parts[1], 0.05, hard, 0.5 * supervised)
            rows.append(one_step(f"simcse {kind}: step, {label}", module, kind, config, columns, loss,
                                 pooler_head=pooler == "cls", pooler_type=pooler,
                                 hard_negative_weight=0.5 * supervised)[0])
    return rows


def simcsepp_rows(clone: Path) -> list[dict]:
    """models_re.py: off-dropout InfoNCE (pos_ratio is m); models_vicreg.py: InfoNCE + 0.1 DCL at tau 10, the only
    DCL the repository runs (simcsepp.py --no_off_dropout --m 1 --dcl_temp 10), also with its first-last average."""
    rows = []
    for file, label, pooler in (("simcse/models_re.py", "off-dropout InfoNCE, m 0.9", "cls"),
                                ("simcse/models_vicreg.py", "InfoNCE + DCL tau 10", "cls"),
                                ("simcse/models_vicreg.py", "DCL, avg_first_last", "avg_first_last")):
        flags = dict(m=0.9, off=True, dcl=0.0) if file.endswith("_re.py") else dict(m=1.0, off=False, dcl=0.1)
        module = load_released("simcsepp", clone, file, [POST_INIT])
        suite_pooler = "avg_embeddings_last" if pooler == "avg_first_last" else pooler  # simcsepp.parse_args
        for kind in ("bert", "roberta"):
            config = tiny_config(kind)
            batch = token_batch(kind, config, N)

            def loss(model, head):  # the suite's own step, as train_step calls it
                return simcsepp.simcsepp_step(model, batch, head, 0.05, flags["m"], flags["dcl"], 10.0,
                                              pool=common.block_pool(suite_pooler, head), off_dropout=flags["off"])
            rows.append(one_step(f"simcsepp {kind}: step, {label} ({file.split('/')[-1]})", module, kind, config,
                                 [batch, batch], loss, passes=[None], pooler_head=pooler == "cls", pooler_type=pooler,
                                 pos_ratio=flags["m"])[0])
    return rows


def sscl_rows(clone: Path) -> list[dict]:
    module = released_module("sscl", clone)
    rows = []
    for kind in ("bert", "roberta"):
        for pooler in ("avg", "cls"):
            config = tiny_config(kind)
            batch = token_batch(kind, config, N)
            layers = sscl.negative_layers(config.num_hidden_layers, 2)

            def loss(model, head):  # the suite's own step, as train_step calls it
                return sscl.sscl_step(model, batch, layers, head, 0.05, pool=common.block_pool(pooler, head, "avg"))
            rows.append(one_step(f"sscl {kind}: step, {pooler}, layers L-1, L-2", module, kind, config, [batch, batch],
                                 loss, pooler_head=pooler == "cls", pooler_type=pooler, hard_negative_layers=2,
                                 do_neg=True)[0])
    return rows


def given_permutations(perms: list):
    """torch.randperm returns `perms`, one a call (the released head draws its shuffles from the global stream)."""
    queue = list(perms)
    return mock.patch.object(torch, "randperm", lambda *args, **kwargs: queue.pop(0).clone())


def whitenedcse_module(clone: Path, float64: bool = False) -> types.ModuleType:
    """The released models.py does not parse and imports two modules the repository lacks; its head's whitening calls
    torch.symeig, removed from PyTorch, on a float32 copy of the covariance. float64: the whitening in float64, as
    the suite's, and floored as the suite's (without, NaN on MiniLM's [CLS] features at the first step)."""
    sgw_patches = [("S, U = torch.symeig(covs.to(linalg_device), eigenvectors=True, upper=True)",
                    "S, U = torch.linalg.eigh(covs.to(linalg_device), UPLO='U')",
                    "torch.symeig (removed in PyTorch 2) -> torch.linalg.eigh on the same triangle"),
                   ("torch.tensor(covs, dtype=torch.float32, requires_grad=True)",
                    "torch.tensor(covs, dtype=covs.dtype, requires_grad=True)",
                    "the covariance's detached copy in its own dtype, not float32: the same in fp32, and the float64 "
                    "rerun of a step whitens in float64")]
    if float64:
        training = "        if self.training:\n"
        sgw_patches += [(training, training + "            dtype, x = x.dtype, x.double()\n",
                         "the training whitening in float64 (the suite's: in fp32 the covariance of a nearly constant "
                         "channel is rounding), its output in the features' dtype"),
                        ("return x \n", "return x.to(dtype)\n", "the whitened rows back in the features' dtype"),
                        ("S.rsqrt()", "S.clamp_min(1e-12).rsqrt()", "the suite's floor on an eigenvalue (a documented "
                         "deviation): without it the first step is NaN (a channel of MiniLM's [CLS] is constant, "
                         "std 5e-33: its eigenvalue is 0 or below, its gain inf or NaN)")]
    package = stub("whitenedcse", __path__=[])
    sgw = load_released("whitenedcse", clone, "whitenedcse/shuffled_group_whitening.py", sgw_patches)
    stubs = {"whitenedcse": package, "whitenedcse.shuffled_group_whitening": sgw,
             "whitenedcse.whiten_norm": stub("whitenedcse.whiten_norm"),
             "whitenedcse.whitening": stub("whitenedcse.whitening")}
    patches = [("ShuffledGroupWhitening(config.hidden_size, num_groups=128, config.num_pos)",
                "ShuffledGroupWhitening(config.hidden_size, 128, config.num_pos)",
                "a positional argument after a keyword one (a SyntaxError): num_groups=128 passed by position"),
               POST_INIT]
    adapt("whitenedcse", "whitenedcse/models.py: imports whiten_norm.py and whitening.py, which the repository lacks "
                         "(only their .pyc): empty stand-ins")
    return load_released("whitenedcse", clone, "whitenedcse/models.py", patches, stubs)


def whitenedcse_rows(clone: Path) -> list[dict]:
    """Adapted, the released code runs: the full step (its row layout whitens mixed views: a documented deviation),
    the head on rows laid out per view, and the loss alone."""
    module = whitenedcse_module(clone)
    config = tiny_config("bert", hidden=256, layers=2)  # the released head's 128 groups: 2 channels each
    config.num_pos = 3
    batch = token_batch("bert", config, N)
    perms = [torch.randperm(256, generator=torch.Generator().manual_seed(s)) for s in range(3)]

    def loss(model, head):
        out = model(**common.repeat_views(batch, 3))
        views = [head(cls, perm) for cls, perm in zip(out.last_hidden_state[:, 0].float().chunk(3), perms)]
        return whitenedcse.multi_positive_info_nce(views, 0.05)
    step, released, head = one_step("whitenedcse bert: step (released row layout)", module, "bert", config,
                                    [batch] * 3, loss, lambda model: given_permutations(perms), pooler_type="cls")
    # the head alone on [CLS] features laid out per view (all view 0, then 1, then 2): the released thirds are views
    features = torch.randn(N * 3, 256, generator=torch.Generator().manual_seed(4), dtype=torch.float32)
    x_r, x_s = features.clone().requires_grad_(True), features.clone().requires_grad_(True)
    released.zero_grad(set_to_none=True)
    head.zero_grad(set_to_none=True)  # both heads took gradients in the training steps above
    with given_permutations(perms):
        out_r = released.mlp(x_r)
    out_s = torch.cat([head(v, p) for v, p in zip(x_s.chunk(3), perms)])
    weights = torch.randn_like(out_r)
    (out_r * weights).sum().backward()
    (out_s * weights).sum().backward()
    per_view = row("whitenedcse: the head on rows laid out per view", (out_r * weights).sum(),
                   (out_s * weights).sum(), {"x": x_r.grad, "mlp.dense.weight": released.mlp.dense.weight.grad},
                   {"x": x_s.grad, "mlp.dense.weight": head.linear.weight.grad})
    # the loss alone on identical views (the head replaced by the identity)
    released.mlp = nn.Identity()
    z = torch.randn(N * 3, 4, 16, generator=torch.Generator().manual_seed(5), requires_grad=True)
    mask = torch.ones(N, 3, 4, dtype=torch.long)
    loss_r = module.cl_forward(released, given_encoder(z), input_ids=mask, attention_mask=mask).loss
    grad_r, = torch.autograd.grad(loss_r, z)
    loss_s = whitenedcse.multi_positive_info_nce(list(z[:, 0].view(N, 3, 16).unbind(1)), 0.05)
    grad_s, = torch.autograd.grad(loss_s, z)
    return [step, per_view, row("whitenedcse: loss alone, 3 positives", loss_r, loss_s, {"z": grad_r}, {"z": grad_s})]


def given_samples(attn1, attn2, layers: slice, num_samples: int, generator: torch.Generator):
    """(a patch, the rho edge) from one draw of the samples. The patch: torch.multinomial returns, for each tile the
    released code keeps, the entries the suite's ami_loss samples with `generator` (micse.ami_sample, from a copy of
    it: uniform without replacement, as multinomial over the 0/1 mask): one draw for both sides. Both codes form the
    tiles alike (the released einops pattern "(h i) (j m) k t z -> (h k m) i (j t z)" is micse.attention_tiles). The
    rho edge: whether miCSE's rho = +-1 edge acts on these maps, a sampled tile's rho^2 beyond 1 - 1e-6, where the
    suite clamps and the released code takes log(0) (or NaN, then 100)."""
    tiles1, tiles2 = (micse.attention_tiles(a[:, layers]) for a in (attn1, attn2))
    sample = micse.ami_sample(tiles1, tiles2, num_samples, copy.deepcopy(generator))
    log1, log2 = micse.centred_logs(tiles1, sample), micse.centred_logs(tiles2, sample)
    rho = (log1 * log2).sum(1) / (log1.norm(dim=1) * log2.norm(dim=1)).clamp_min(1e-12)  # micse.ami_loss's rho
    patch = mock.patch.object(torch, "multinomial", lambda weights, samples, *args, **kwargs:
                              sample.index[sample.used][:, :samples].clone())
    return patch, bool((rho[sample.used] ** 2 > 1 - 1e-6).any())


def micse_rows(clone: Path) -> list[dict]:
    module = released_module("micse", clone)
    rows, ami_lambda = [], 1e-2  # a weight large enough that the AMI term shows in the loss
    for kind in ("bert", "roberta"):
        config = tiny_config(kind, layers=4)
        config.task_alpha, config.task_lambda = 1.0, ami_lambda
        batch = token_batch(kind, config, N)
        generator = torch.Generator().manual_seed(7)

        def loss(model, head):
            views = common.repeat_views(batch, 2)
            out = model(**views, output_hidden_states=True, output_attentions=True)
            z1, z2 = common.embed(out.hidden_states, views["attention_mask"], "cls", head).chunk(2)
            a1, a2 = torch.stack(out.attentions, 1).float().chunk(2)
            return micse.moco_info_nce(z1, z2, torch.empty(0, z1.shape[1]), 0.05) + \
                ami_lambda * micse.ami_loss(a1, a2, 150, generator)
        rows.append(one_step(f"micse {kind}: step, InfoNCE + AMI (layers 0:4, no queue)", module, kind, config,
                             [batch, batch], loss, lambda m: given_samples(*attention_maps(m, batch), slice(0, 4), 150,
                                                                           generator)[0],
                             style="miCSE", max_layer=4)[0])
    # the loss alone on identical attention maps and embeddings; then both views' maps identical (rho = 1)
    released = module.BertForCL(tiny_config("bert", layers=4), model_args=model_args(
        style="miCSE", min_layer=0, max_layer=4, pooler_type="cls_before_pooler"))
    released.config.task_alpha, released.config.task_lambda = 1.0, ami_lambda
    g = torch.Generator().manual_seed(8)
    for label, same in (("loss alone", False), ("loss alone, rho = 1 (identical views)", True)):
        z = torch.randn(N * 2, 9, 16, generator=g, requires_grad=True)
        scores = torch.randn(N, 2, 4, 4, 9, 9, generator=g)
        scores[:, :, :, :, :, 7:] = -torch.inf  # two padding columns
        if same:
            scores[:, 1] = scores[:, 0]
        maps = scores.softmax(-1).reshape(N * 2, 4, 4, 9, 9).requires_grad_(True)  # sentence-major rows
        mask = torch.ones(N, 2, 9, dtype=torch.long)
        generator = torch.Generator().manual_seed(9)
        a1, a2 = maps.view(N, 2, 4, 4, 9, 9).unbind(1)
        with given_samples(a1.detach(), a2.detach(), slice(0, 4), 150, generator)[0]:
            loss_r = module.cl_forward(released, given_encoder(z, tuple(maps.unbind(1))),
                                       input_ids=mask, attention_mask=mask).loss
        grads_r = dict(zip(("z", "attentions"), torch.autograd.grad(loss_r, [z, maps], allow_unused=True)))
        loss_s = micse.moco_info_nce(*z[:, 0].view(N, 2, 16).unbind(1), torch.empty(0, 16), 0.05) + \
            ami_lambda * micse.ami_loss(a1, a2, 150, generator)
        grads_s = dict(zip(("z", "attentions"), torch.autograd.grad(loss_s, [z, maps], allow_unused=True)))
        rows.append(row(f"micse bert: {label}", loss_r, loss_s, grads_r, grads_s))
    return rows


# ----------------------------------------------------------------------------------------- evaluation poolers
SENTENCES = ["the cat sat on the mat", "a man is playing a guitar", "two dogs run in the park near the river",
             "she reads", "the old man and the sea"]
EVALUATION_PATCHES = [("tokenizer.batch_encode_plus(", "tokenizer(",
                       "tokenizer.batch_encode_plus (removed in transformers 5) -> tokenizer(...), the same encoding")]


def tiny_checkpoint(folder: Path) -> Path:
    """A random BERT with its pooler layer and a WordPiece tokenizer over SENTENCES' words, saved."""
    words = sorted({w for s in SENTENCES for w in s.split()})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    transformers.BertTokenizerFast(vocab=str(folder / "vocab.txt")).save_pretrained(folder)
    config = tiny_config("bert")
    config.vocab_size = len(words) + 5
    torch.manual_seed(2)
    transformers.BertModel(config).save_pretrained(folder)
    return folder


def evaluation_embeddings(repository: str, clone: Path, checkpoint: Path, pooler: str,
                          sentences=SENTENCES) -> np.ndarray:
    """The embeddings of SENTENCES by the repository's evaluation.py batcher with `pooler`, SentEval replaced by a
    stand-in that calls the batcher once."""
    captured = {}

    class Captured(Exception):
        """Raised by the stand-in SentEval once it has the batcher's embeddings."""

    class SE:
        def __init__(self, params, batcher, prepare):
            self.params, self.batcher = params, batcher

        def eval(self, task):
            captured["embeddings"] = np.concatenate([np.asarray(self.batcher(self.params, [
                s.split() for s in sentences[i:i + 128]])) for i in range(0, len(sentences), 128)])
            raise Captured

    engine = stub("senteval.engine", SE=SE)
    stubs = {"senteval": stub("senteval", engine=engine), "senteval.engine": engine,
             "wandb": stub("wandb", init=lambda *a, **k: types.SimpleNamespace(log=lambda *a, **k: None),
                           log=lambda *a, **k: None),
             **{name: stub(name, PrettyTable=object, Workbook=object) for name in ("prettytable", "xlrd", "openpyxl")
                if importlib.util.find_spec(name) is None}}
    adapt(repository, "evaluation.py: SentEval (and wandb, and prettytable/xlrd/openpyxl where not installed) are "
                      "stand-ins; the batcher's embeddings of a few sentences are read")
    source = (clone / "evaluation.py").read_text()
    module = load_released(repository, clone, "evaluation.py", [p for p in EVALUATION_PATCHES if p[0] in source], stubs)
    argv = ["evaluation.py", "--model_name_or_path", str(checkpoint), "--pooler", pooler, "--mode", "test",
            "--task_set", "sts"]
    with standing_in(stubs), mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.suppress(Captured):
        module.main()
    return captured["embeddings"]


def evaluation_rows(repository: str, clone: Path, checkpoint: Path) -> list[dict]:
    """Each pooler of the repository's evaluation.py against eval_sts.py's: the same name, and for the forks'
    avg_first_last also avg_embeddings_last (their hidden_states[0])."""
    rows, forked = [], repository in ("simcsepp", "sscl", "micse")  # forked before SimCSE's fix
    for pooler in ("cls", "cls_before_pooler", "avg", "avg_top2", "avg_first_last"):
        released = evaluation_embeddings(repository, clone, checkpoint, pooler)
        for suite_pooler in [pooler] + (["avg_embeddings_last"] if pooler == "avg_first_last" and forked else []):
            with contextlib.redirect_stdout(io.StringIO()):
                ours = eval_sts.load_encode(str(checkpoint), suite_pooler, torch.device("cpu"))(SENTENCES)
            rows.append(row(f"{repository} eval: {pooler} / eval_sts {suite_pooler}", 0.0, 0.0,
                            {"embeddings": torch.as_tensor(released)}, {"embeddings": torch.as_tensor(ours)}))
    return rows


# ------------------------------------------------------------------------------- training runs on a real encoder
# name -> (repository, its model file, lr, the released ModelArguments, corpus, views, dev pooler): the released
# scripts' settings (SimCSE's run_unsup/run_sup_example.sh, SimCSE++'s run_re.sh and run_vicreg.sh, SSCL's and
# WhitenedCSE's run_unsup_example.sh, miCSE's README at 10%: lr 1e-5, lambda 5e-4, its layers 7:11 of 12 being
# micse.default_ami_layers' L-5:L-1, 1:5 of MiniLM's 6); no weight decay, the linear schedule over the run, clipping
# at 1 (the HF Trainer's), batch and corpus the run's. SimCSE++: each file for the part it holds (models_re.py the
# off-dropout InfoNCE at m 0.9; models_vicreg.py InfoNCE + 0.1 DCL at its hard-coded tau 10); WhitenedCSE: its
# hard-coded 128 groups (of 3 channels on MiniLM), each third of the rows one view (per_view)
RUNS = {"simcse": ("simcse", None, 3e-5, dict(pooler_type="cls"), "wiki", 2, "cls_before_pooler"),
        "simcse supervised": ("simcse", None, 5e-5, dict(pooler_type="cls", mlp_only_train=False), "nli", 3, "cls"),
        "simcsepp off-dropout": ("simcsepp", "simcse/models_re.py", 3e-5, dict(pooler_type="cls", pos_ratio=0.9),
                                 "wiki", 2, "cls_before_pooler"),
        "simcsepp dcl": ("simcsepp", "simcse/models_vicreg.py", 3e-5, dict(pooler_type="cls"), "wiki", 2,
                         "cls_before_pooler"),
        "sscl": ("sscl", None, 3e-5, dict(pooler_type="avg", hard_negative_layers=2, do_neg=True), "wiki", 2, "avg"),
        "whitenedcse": ("whitenedcse", None, 1e-5, dict(pooler_type="cls"), "wiki", 3, "cls_before_pooler"),
        "micse": ("micse", None, 1e-5, dict(style="miCSE", pooler_type="cls", min_layer=1, max_layer=5), "wiki", 2,
                  "cls_before_pooler")}
ADAMW_2021 = "simcse, released side on the 2021 transformers.AdamW"  # a documented row: AdamW2021
RUNS[ADAMW_2021] = RUNS["simcse"]
MICSE_LAMBDA = 5e-4
KEY_BIAS = "attention.self.key.bias"  # zero gradient in exact arithmetic (softmax ignores a row's constant)
ROW_LAYOUT = "whitenedcse run: the released row layout, at the last step"
DEVIATIONS[ROW_LAYOUT] = DEVIATIONS["whitenedcse bert: step (released row layout)"]


class AdamW2021(torch.optim.Optimizer):
    """transformers.AdamW (transformers 4, gone in 5), which the released scripts' Trainer ran at eps 1e-8, from its
    update: Adam's m and v, then p -= lr sqrt(1 - beta2^t) / (1 - beta1^t) m / (sqrt(v) + eps), eps added before
    the bias correction (torch's AdamW: lr / (1 - beta1^t) m / (sqrt(v / (1 - beta2^t)) + eps))."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (beta1, beta2), lr = group["betas"], group["lr"]
            for p in (p for p in group["params"] if p.grad is not None):
                state = self.state[p]
                if not state:
                    state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["t"] += 1
                state["m"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                size = lr * (1 - beta2 ** state["t"]) ** 0.5 / (1 - beta1 ** state["t"])
                p.addcdiv_(state["m"], state["v"].sqrt().add_(group["eps"]), value=-size)
                p.mul_(1 - lr * group["weight_decay"])


def corpus_batches(corpus: str, steps: int, size: int) -> list[list[list[str]]]:
    """Each step's columns of sentences: wiki1m_head.txt's lines in order; NLI's (sent0, sent1, hard_neg) rows."""
    data = ROOT.parent / "shared" / "data"
    if corpus == "wiki":
        lines = [line.strip() for line in (data / "wiki1m_head.txt").read_text().splitlines() if line.strip()]
        return [[lines[t * size:(t + 1) * size]] for t in range(steps)]
    import csv
    with open(data / "nli_snli_devtest.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return [[[r[c] for r in rows[t * size:(t + 1) * size]] for c in ("sent0", "sent1", "hard_neg")]
            for t in range(steps)]


def suite_objective(name: str, model, head, batch: dict, generator, layers: int):
    """The suite's own step of `name` (its method file's block), as its train_step calls it."""
    if name in ("simcse", ADAMW_2021):
        return simcse.simcse_step(model, batch, head, 0.05)
    if name == "simcse supervised":
        return simcse.simcse_step(model, batch, head, 0.05, 3)
    if name.startswith("simcsepp"):  # m 0.9 and off-dropout, or m 1 and 0.1 DCL at tau 10
        dcl = name.endswith("dcl")
        return simcsepp.simcsepp_step(model, batch, head, 0.05, 1 if dcl else 0.9, 0.1 * dcl, 10.0, off_dropout=not dcl)
    if name == "sscl":
        return sscl.sscl_step(model, batch, sscl.negative_layers(layers, 2), None, 0.05)
    if name == "whitenedcse":
        return whitenedcse.whitenedcse_step(model, batch, head, generator, 3, 0.05)
    return micse.micse_step(model, batch, head, None, generator, 0.05, MICSE_LAMBDA, 150, (1, 5))


@contextlib.contextmanager
def per_view(whitening: nn.Module, views: int, perms: list):
    """The released whitening given its rows laid out per view (its thirds the views, as the suite whitens each view)
    and `perms` for its shuffles; its output put back in the released (sentence-major) order."""
    def order(rows):
        return torch.tensor(view_major(rows // views, views))
    handles = [whitening.register_forward_pre_hook(lambda m, args: (args[0][order(len(args[0]))],)),
               whitening.register_forward_hook(lambda m, args, out: out[torch.argsort(order(len(out)))])]
    try:
        with given_permutations(perms):
            yield
    finally:
        for handle in handles:
            handle.remove()


def largest_weight_difference(released, suite_named: dict) -> tuple[float, str, float]:
    """(the largest |w_released - w_suite|, its parameter, the largest outside the attention key biases)."""
    diffs = {n: (p.detach() - suite_named[n].detach()).abs().max().item() for n, p in released.named_parameters()
             if n in suite_named}
    worst = max(diffs, key=diffs.get)
    return diffs[worst], worst, max(v for n, v in diffs.items() if KEY_BIAS not in n)


def trajectory(name: str, clone: Path, model_dir: Path, steps: int, size: int = 16, free: bool = True,
               senteval_dir: Path | None = None, tolerance: float = 1e-5) -> dict:
    """`steps` steps of `name` from `model_dir`'s weights: the suite trains; at each step the released model is given
    its weights (step by step: loss and gradients compared; beyond `tolerance`, the released code once more in float64:
    its own fp32 error, the floor), and a second released model trains on its own (free-running: loss, gradient norm,
    weights compared); then each side's STS-B dev."""
    repository, file, lr, arguments, corpus, views, pooler = RUNS[name]
    module = whitenedcse_module(clone, True) if repository == "whitenedcse" else released_module(repository, clone,
                                                                                                file)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "eager"
    config.task_alpha, config.task_lambda, config.num_pos = 1.0, MICSE_LAMBDA, views
    synced = released_model(module, "bert", config, **arguments)
    pretrained = transformers.BertModel.from_pretrained(model_dir, attn_implementation="eager").state_dict()
    synced.bert.load_state_dict({k: v for k, v in pretrained.items() if not k.startswith("pooler.")})  # BertForCL: none
    backbone, head, dense = suite_parts(synced, "bert", arguments["pooler_type"] == "cls")
    model = common.BackboneWithHeads(backbone, head)
    suite_named = suite_parameters("bert", backbone, dense)
    optimizer, schedule = common.make_optimizer(list(suite_named.values()), types.SimpleNamespace(
        lr=lr, warmup_steps=0), steps)  # the suite's own: torch AdamW, fused
    released = copy.deepcopy(synced) if free else None
    if free:
        released_optimizer = (AdamW2021 if name == ADAMW_2021 else torch.optim.AdamW)(released.parameters(), lr=lr,
                                                                                      weight_decay=0.0)
        released_schedule = transformers.get_linear_schedule_with_warmup(released_optimizer, 0, steps)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    strict, running, deviations, edges = [], [], [], 0
    for t, texts in enumerate(corpus_batches(corpus, steps, size)):
        stacked = dict(tokenizer([s for column in texts for s in column], padding=True, truncation=True,
                                 max_length=32, return_tensors="pt"))
        columns = [{k: v[c * size:(c + 1) * size] for k, v in stacked.items()} for c in range(len(texts))]
        inputs = released_inputs(columns if corpus == "nli" else columns * views)
        batch = stacked if corpus == "nli" else columns[0]
        generator = torch.Generator().manual_seed(t)
        draws, drawn = (lambda released_model: contextlib.nullcontext()), copy.deepcopy(generator)
        if name == "micse":  # the attention maps both sides will see, for the shared draw of AMI's samples
            maps = attention_maps(model, batch, t)
            samples, edge = given_samples(*maps, slice(1, 5), 150, drawn)
            draws = lambda released_model: samples  # noqa: E731
            edges += edge
        if name == "whitenedcse":  # the suite's shuffles, as its generator draws them
            perms = [torch.randperm(config.hidden_size, generator=drawn) for _ in range(views)]
            draws = lambda released_model: per_view(released_model.mlp.dbn, views, perms)  # noqa: E731
        synced.bert.load_state_dict(backbone.state_dict())  # step by step: the suite's current weights
        if dense:
            synced.mlp.dense.load_state_dict(dense.state_dict())
        with draws(synced):
            loss_r, grads_r = released_step(synced, inputs, t, sentence_major(size, views))
        loss_s = matched_step(backbone, lambda: suite_objective(
            name, model, head, batch, generator, config.num_hidden_layers), view_major(size, views), seed=t)
        grads_s = {n: p.grad for n, p in suite_named.items()}
        strict.append(row(f"{name} step {t + 1}: step by step", loss_r, loss_s, grads_r, grads_s))
        if max(strict[-1]["loss_rel"], strict[-1]["grad_rel"]) > tolerance:
            exact_model = copy.deepcopy(synced).double()
            with draws(exact_model):
                exact = released_step(exact_model, inputs, t, sentence_major(size, views))
            worst = strict[-1]["grad_worst"]  # each side's distance to float64, on the loss and the worst gradient
            strict[-1]["floor"], strict[-1]["suite_error"] = (max(
                difference(loss, exact[0])[1], difference(grads.get(worst), exact[1].get(worst))[1]
                if worst != "-" else 0.0) for loss, grads in ((loss_r, grads_r), (loss_s, grads_s)))
        if name == "whitenedcse" and t == steps - 1:  # the documented deviation's size on the trained weights
            with given_permutations(perms):
                loss_l, grads_l = released_step(synced, inputs, t, sentence_major(size, views))
            deviations.append(row(ROW_LAYOUT, loss_l, loss_s, grads_l, grads_s))
        if free:
            with draws(released):
                loss_f, grads_f = released_step(released, inputs, t, sentence_major(size, views))
            running.append(row(f"{name} step {t + 1}: free-running", loss_f, loss_s, grads_f, grads_s))
            running[-1]["grad_norm_released"] = nn.utils.clip_grad_norm_(released.parameters(), 1.0).item()
            released_optimizer.step()
            released_schedule.step()
        norm = nn.utils.clip_grad_norm_(list(suite_named.values()), 1.0).item()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if free:
            weights, where, outside = largest_weight_difference(released, suite_named)
            r = running[-1]
            r.update(grad_norm_suite=norm, weight_abs=weights, weight_worst=where, weight_abs_outside=outside)
            print(f"{name} step {t + 1}: loss {r['loss_released']:.6f} / {r['loss_suite']:.6f} (rel. "
                  f"{r['loss_rel']:.1e}), grad norm {r['grad_norm_released']:.4f} / {norm:.4f}, largest weight diff. "
                  f"{weights:.1e} ({where}; {outside:.1e} outside the key biases); step by step: "
                  f"{strict[-1]['grad_rel']:.1e}")
    result = {"name": name, "steps": steps, "strict": strict, "free": running, "deviations": deviations,
              **({"rho_edge_steps": edges} if name == "micse" else {})}
    if free and senteval_dir is not None:
        result["dev"] = {side: dev_scores(repository, clone, tokenizer, config, bert, mlp, pooler, senteval_dir)
                         for side, bert, mlp in (("released", released.bert, dense and released.mlp.dense),
                                                 ("suite", backbone, dense))}
    return result


def dev_scores(repository, clone, tokenizer, config, bert, dense, pooler, senteval_dir) -> dict:
    """STS-B dev (Spearman x 100) of a trained encoder, saved (its MLP as the pooler layer, as the repositories'
    *_to_huggingface.py do), through the repository's evaluation.py with `pooler` and through eval_sts.py."""
    pairs = eval_sts.load_pairs(senteval_dir, "STSBenchmark", "dev")
    sentences = sorted({s for p in pairs for s in p[:2]})
    with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(io.StringIO()):
        saved = transformers.BertModel(config)
        saved.load_state_dict(bert.state_dict(), strict=False)
        if dense is not None:
            saved.pooler.dense.load_state_dict(dense.state_dict())
        saved.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        vectors = evaluation_embeddings(repository, clone, Path(folder), pooler, sentences)
        index = {s: i for i, s in enumerate(sentences)}
        ours = eval_sts.evaluate(eval_sts.load_encode(folder, pooler, torch.device("cpu")), senteval_dir,
                                 ["STSBenchmark"], "dev")
    return {"evaluation.py": eval_sts.spearman(pairs, lambda ss: vectors[[index[s] for s in ss]]),
            "eval_sts.py": ours["STSBenchmark"]}


METHODS = {"simcse": simcse_rows, "simcsepp": simcsepp_rows, "sscl": sscl_rows, "whitenedcse": whitenedcse_rows,
           "micse": micse_rows}


# ------------------------------------------------------------------------------------------------ the report
def status(result: dict, tolerance: float) -> str:
    """ok; rounding (beyond the tolerance, the suite within it of the released code run in float64, or no further
    from that than 4 x the released code's own fp32 error, its floor); documented; or DIFFERS. Two fp32 results are
    apart by both codes' rounding, so each side's distance to exact arithmetic is what is judged."""
    within = result["loss_rel"] <= tolerance and result["grad_rel"] <= tolerance
    if not within and result.get("suite_error", math.inf) <= max(tolerance, 4 * result.get("floor", 0)):
        return f"ok (rounding: from float64 the suite {result['suite_error']:.1e}, released {result['floor']:.1e})"
    if result["name"] in DEVIATIONS:
        return "documented" if not within else "ok (documented deviation gone?)"
    return "ok" if within else "DIFFERS"


def table(results: list[dict], tolerance: float) -> str:
    """The comparisons as a Markdown table (the worst gradient's name is in --json)."""
    rows = [f"| {r['name']} | {r['loss_released']:.6f} | {r['loss_rel']:.1e} | {r['gradients']} | "
            f"{r['grad_rel']:.1e} | {status(r, tolerance)} |" for r in results]
    return "\n".join(["| comparison | loss (released) | loss rel. diff. | gradients | worst rel. diff. | status |",
                      "|---|---|---|---|---|---|", *rows])


def clones(args) -> dict[str, Path]:
    """The clone of each repository asked for: --<key> PATH, else --released DIR/<GitHub name>; checked to hold the
    file the tool loads and to be that repository (its README's title), not another fork."""
    found = {}
    for key, (github, telling, title) in REPOSITORIES.items():
        path = getattr(args, key) or (Path(args.released) / github.split("/")[1] if args.released else None)
        if path is None or (args.only and key not in args.only):
            continue
        path = Path(path)
        how = f"git clone https://github.com/{github} {path}"
        if not path.exists():  # an absent clone: its rows skip, the others run
            print(f"skipped {key}: no clone at {path} ({how})")
            continue
        if not (path / telling).is_file():
            raise plumbing.UsageError(f"{path} is not a clone of {github} (it has no {telling}): {how}")
        try:  # its README's first Markdown heading, without its #s; absent or unreadable: none
            lines = (path / "README.md").read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        heading = next((line.lstrip("#").strip() for line in lines if line.startswith("#")), None)
        if heading is None or not heading.startswith(title):
            raise plumbing.UsageError(f"{path} is not a clone of {github}: its README's title is {heading!r}, "
                                      f"not {title!r}...: {how}")
        found[key] = path
    if not found:
        raise plumbing.UsageError("no released code found: --released DIR (holding the clones under their GitHub "
                                  "names) or --simcse PATH, ...")
    return found


def main(argv=None) -> int:
    parser = plumbing.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--released", default=None, help="a folder holding the five clones under their GitHub names")
    for key, (github, *_) in REPOSITORIES.items():
        parser.add_argument(f"--{key}", default=None, help=f"a clone of {github}")
    parser.add_argument("--only", nargs="+", choices=list(REPOSITORIES), default=None, help="these repositories")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest relative difference that agrees")
    parser.add_argument("--json", default=None, help="also write the comparisons to this JSON file")
    parser.add_argument("--model", default=None, help="a BERT checkpoint folder (../shared/models/all-MiniLM-L6-v2): "
                        "train both sides from its weights, step by step and free-running, not one step on tiny ones")
    parser.add_argument("--steps", type=int, default=30, help="with --model: the training steps of each method")
    parser.add_argument("--batch_size", type=int, default=16, help="with --model: sentences a step")
    parser.add_argument("--senteval_dir", default=str(ROOT.parent / "shared" / "data" / "senteval"),
                        help="with --model: STS-B dev at the end from this SentEval folder (absent: no dev scores)")
    args = parser.parse_args(argv)
    plumbing.check_json_path(args.json)
    if args.model and not (Path(args.model) / "config.json").is_file() or args.steps < 1:
        raise plumbing.UsageError(f"--model {args.model}: no config.json there" if args.steps >= 1 else
                                  f"--steps must be at least 1, got {args.steps}")
    found = clones(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels, the same rounding, from one run to the next
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's random streams stay as they were
            if not args.model:
                return report(comparisons(found), args.tolerance, args.json)
            senteval = Path(args.senteval_dir) if (Path(args.senteval_dir) / "STS").is_dir() else None
            runs = []
            for name, (repository, *_) in RUNS.items():
                if repository not in found:
                    print(f"skipped the {name} run: its clone is absent")
                    continue
                runs.append(trajectory(name, found[repository], Path(args.model), args.steps, args.batch_size,
                                       senteval_dir=senteval, tolerance=args.tolerance))
            return report([r for run in runs for r in run["strict"] + run["deviations"]], args.tolerance, args.json,
                          runs)
    finally:
        torch.set_num_threads(threads)


def comparisons(found: dict) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = tiny_checkpoint(Path(tmp) / "checkpoint")
        for key, path in found.items():
            results += METHODS[key](path) + evaluation_rows(key, path, checkpoint)
    return results


def runs_table(runs: list[dict], tolerance: float) -> str:
    """Each training run in a line: the step-by-step check's worst step, the free-running sides apart, the dev."""
    lines = ["| run | step by step: worst loss / gradient rel. diff. | free-running: worst loss rel. diff. | first "
             "step beyond the tolerance (its worst gradient) | final largest weight diff. (outside the key biases) | "
             "STS-B dev, released: evaluation.py / eval_sts.py | suite: evaluation.py / eval_sts.py |",
             "|---|---|---|---|---|---|---|"]
    for run in runs:
        strict, free, dev = run["strict"], run["free"], run.get("dev", {})
        first = next((r for r in free if max(r["loss_rel"], r["grad_rel"]) > tolerance), None)
        scores = [" / ".join(f"{v:.2f}" for v in dev[side].values()) if side in dev else "-"
                  for side in ("released", "suite")]
        edge = f", rho = 1 edge at {run['rho_edge_steps']} step(s)" if "rho_edge_steps" in run else ""
        lines.append(f"| {run['name']}, {run['steps']} steps{edge} | {max(r['loss_rel'] for r in strict):.1e} / "
                     f"{max(r['grad_rel'] for r in strict):.1e} | "
                     + (f"{max(r['loss_rel'] for r in free):.1e} | " if free else "- | ")
                     + (f"{first['name'].split(':')[0].split()[-1]} ({first['grad_worst']}) | " if first else "none | ")
                     + (f"{free[-1]['weight_abs']:.1e} ({free[-1]['weight_abs_outside']:.1e}) | " if free else "- | ")
                     + " | ".join(scores) + " |")
    return "\n".join(lines)


def report(results: list[dict], tolerance: float, json_path: str | None, runs: list | None = None) -> int:
    """The table (of `runs` where given), the documented deviations, --json; 1 when a comparison differs and is not
    documented."""
    print(f"\ntorch {torch.__version__}, transformers {transformers.__version__}, tolerance {tolerance:g} "
          "(relative to the largest magnitude)")
    print(table(results, tolerance) if runs is None else runs_table(runs, tolerance))
    failed = [r["name"] for r in results if status(r, tolerance) == "DIFFERS"]
    for name in (r["name"] for r in results if r["name"] in DEVIATIONS):
        print(f"documented: {name}: {DEVIATIONS[name]}")
    if json_path:
        files.write_json(Path(json_path), {"torch": torch.__version__, "transformers": transformers.__version__,
                                           "tolerance": tolerance, "adaptations": ADAPTED, "comparisons": results,
                                           **({"runs": runs} if runs is not None else {})})
    print(f"{len(results)} comparisons: {len(failed)} differ beyond the tolerance and are not documented"
          + (f" ({'; '.join(failed)})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    plumbing.cli(lambda: sys.exit(main()))
