"""A method's objective lifts into a student's own loop: each method file holds it in one block between two marker
lines, and that block, copied as it stands into a fresh module, nothing imported for it (it imports torch and
torch.nn.functional as F itself), runs and gives what the suite's own functions give, bit for bit. A block that reached
outside itself (a helper or an import left out of it, `common`, a module global, a flag) would fail to run there."""
import importlib
import re
import sys
import types

import pytest
import torch

import micse
import simcse
import simcsepp
import sscl
import whitenedcse

START = "# --- the objective: copy this block; it needs only torch ---"
END = "# --- end of the objective ---"
LIFTABLE = {  # the loss: the method file whose block holds it
    "info_nce": simcse, "positive_only_loss": simcse, "masked_lm_loss": simcse,
    "off_dropout_info_nce": simcsepp, "view_negatives_info_nce": simcsepp, "dcl_loss": simcsepp,
    "sscl_loss": sscl, "shuffled_group_whitening": whitenedcse, "multi_positive_info_nce": whitenedcse,
    "micse_loss": micse,
}


def block(module: types.ModuleType) -> str:
    """The method file's objective: the lines between its two markers, as a reader copies them."""
    source = open(module.__file__).read()
    assert source.count(START) == 1 and source.count(END) == 1, module.__name__
    return source[source.index(START):source.index(END) + len(END)]


def lifted(module: types.ModuleType) -> types.ModuleType:
    """A module made of the block alone, executed as pasted: nothing imported for it but what it imports."""
    lifted_module = types.ModuleType(f"lifted_{module.__name__}")
    before = set(sys.modules)
    exec(compile(block(module), f"<the objective of {module.__name__}.py>", "exec"), lifted_module.__dict__)
    suite = {"common", "data", "plumbing", "simcse", "simcsepp", "sscl", "whitenedcse", "micse"}
    assert not suite & {k for k, v in lifted_module.__dict__.items() if isinstance(v, types.ModuleType)}
    assert set(sys.modules) == before  # it imported nothing new
    return lifted_module


def inputs(name: str):
    g = torch.Generator().manual_seed(0)
    z = [torch.randn(8, 16, generator=g) for _ in range(4)]
    if name == "info_nce":
        return (z[0], z[1], 0.05, torch.cat([z[2], z[3]]), 1.5), {}
    if name in ("positive_only_loss", "dcl_loss", "view_negatives_info_nce"):
        return (z[0], z[1]), {}
    if name == "masked_lm_loss":
        labels = torch.randint(0, 30, (4, 7), generator=g).masked_fill(torch.rand(4, 7, generator=g) < 0.7, -100)
        return (torch.randn(4, 7, 30, generator=g), labels), {}
    if name == "off_dropout_info_nce":
        return (z[0], z[1], z[2], 0.05, 0.9), {}
    if name == "sscl_loss":
        return (z[0], z[1], [(z[2], z[3]), (z[3],)]), {}
    if name == "shuffled_group_whitening":
        return (torch.randn(32, 16, generator=g), 4, torch.randperm(16, generator=g)), {}
    if name == "multi_positive_info_nce":
        return (z[:3], 0.1), {}
    attention = [torch.softmax(torch.randn(8, 4, 2, 6, 6, generator=g), -1) for _ in range(2)]
    own = torch.zeros(8, 5, dtype=torch.bool)
    own[2, 3] = True
    return (z[0], z[1], *attention, torch.randn(5, 16, generator=g), 0.05, 0.5, 20, own), {}


@pytest.mark.parametrize("name", list(LIFTABLE))
def test_a_methods_objective_block_runs_on_torch_alone_and_gives_the_suites_value(name):
    args, kwargs = inputs(name)
    module = LIFTABLE[name]

    def drawn():  # AMI's samples: the same draws, each side from a generator of the same seed
        return {"generator": torch.Generator().manual_seed(1)} if name == "micse_loss" else {}
    ours = getattr(module, name)(*args, **kwargs, **drawn())
    theirs = getattr(lifted(module), name)(*args, **kwargs, **drawn())
    assert torch.equal(ours, theirs), name


def test_a_block_missing_a_helper_fails_to_lift(monkeypatch):
    """The check can fail: simcsepp's block without m_positive_cross_entropy (moved out of it, as a refactoring
    might) runs into a NameError, where the suite's own function still works."""
    source = block(simcsepp)
    helper = source[source.index("def m_positive_cross_entropy("):source.index("def dcl_loss(")]
    monkeypatch.setattr(sys.modules[__name__], "block", lambda module: source.replace(helper, ""))
    args, kwargs = inputs("off_dropout_info_nce")
    with pytest.raises(NameError, match="m_positive_cross_entropy"):
        lifted(simcsepp).off_dropout_info_nce(*args, **kwargs)


def test_a_block_without_its_imports_fails_to_lift(monkeypatch):
    """Pasted alone, a block has only its own imports: simcse's without its `import torch.nn.functional as F` runs
    into a NameError (as it did when pasted before the block imported F itself)."""
    source = block(simcse)
    monkeypatch.setattr(sys.modules[__name__], "block",
                        lambda module: source.replace("import torch.nn.functional as F\n", ""))
    args, kwargs = inputs("info_nce")
    with pytest.raises(NameError, match="'F'"):
        lifted(simcse).info_nce(*args, **kwargs)


def test_gather_asks_torch_distributed_not_the_suites_state(monkeypatch):
    """A student's torchrun loop starts its process group with torch.distributed.init_process_group and never calls
    plumbing.distributed.init: gather still returns every process's rows, as torch.distributed says (here a group of
    2 faked, whose all_gather hands back this process's rows and the other's). A gather that read the suite's own
    module state (the world size init() keeps) would return this process's rows alone."""
    from plumbing import distributed
    assert distributed.world_size() == 1  # init() never ran in this process
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(distributed.dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(distributed.dist_nn, "all_gather", lambda t: (t + 100, t))
    rows = torch.arange(6.0).view(3, 2)  # process 1's rows of a global batch of 5: 2, 3 and 4
    assert torch.equal(distributed.gather(rows, 5), torch.cat([rows[:2] + 100, rows]))


STEPS = {  # case: (the script, its flags, the block's step)
    "simcse": ("simcse", [], "simcse_step"), "simcse-supervised": ("simcse", ["--supervised"], "simcse_step"),
    "simcsepp": ("simcsepp", [], "simcsepp_step"), "sscl": ("sscl", [], "sscl_step"),
    "whitenedcse": ("whitenedcse", ["--num_groups", "16"], "whitenedcse_step"),
    "micse": ("micse", ["--queue_size", "16"], "micse_step"),
}


def as_a_student_calls_it(case: str, block, encoder, batch: dict, args: tuple, kwargs: dict):
    """The pasted block's step as a student's loop calls it: the plain transformers model (not the suite's wrapper),
    the batch's tokens (not the suite's sentence ids), its own head and queue, the recipe's defaults for the rest."""
    model, tokens = encoder.backbone, {k: v for k, v in batch.items() if k != "example_ids"}
    if case == "simcsepp":
        return block.simcsepp_step(model, tokens, args[0])
    if case.startswith("simcse"):
        return block.simcse_step(model, tokens, args[0], columns=3 if case == "simcse-supervised" else 1)
    if case == "sscl":
        return block.sscl_step(model, tokens)  # the average pooler, layers L-1 and L-2: the defaults
    if case == "whitenedcse":
        suite_head = kwargs["head"]
        with torch.random.fork_rng(devices=[]):  # made beforehand: its init's draws are not the step's
            head = block.WhitenedHead(suite_head.linear.in_features, suite_head.num_groups)
        head.load_state_dict(suite_head.state_dict())
        return block.whitenedcse_step(model, tokens, head, kwargs["generator"])
    queue = block.EmbeddingQueue(16, model.config.hidden_size)  # empty at the first step, as the suite's
    return block.micse_step(model, tokens, args[0], queue, args[2])


@pytest.mark.parametrize("case", list(STEPS))
def test_a_pasted_step_fed_a_transformers_model_gives_the_suites_loss_bit_for_bit(case, tiny_model, corpus,
                                                                                senteval_dir, tmp_path, monkeypatch):
    """Each method's objective block, pasted alone (its own `import torch` and `import torch.nn.functional as F`): its
    <method>_step, called as a student calls it (the plain transformers model, the batch's tokens, a head, the
    recipe's defaults), gives the loss the suite's own run computed at its first step, bit for bit: the same dropout
    masks (the RNG state the suite's step began with), shuffles and AMI draws (their generators' state). The suite's
    train_step calls the same function, so this fails where the suite feeds its loss other than the block says (a
    layer, a pooler, the views' order, a default that is not the recipe's)."""
    from conftest import smoke_args, write_nli, write_tiny_model
    script, flags, step_name = STEPS[case]
    module = importlib.import_module(script)
    block_module, real, seen = lifted(module), getattr(module, step_name), []

    def spy(encoder, batch, *args, **kwargs):
        if seen:
            return real(encoder, batch, *args, **kwargs)
        generators = [g for g in (*args, *kwargs.values()) if isinstance(g, torch.Generator)]
        before = torch.get_rng_state(), [g.get_state() for g in generators]
        loss = real(encoder, batch, *args, **kwargs)
        after = torch.get_rng_state(), [g.get_state() for g in generators]
        torch.set_rng_state(before[0])
        for g, s in zip(generators, before[1]):
            g.set_state(s)
        seen.append((loss.detach(), as_a_student_calls_it(case, block_module, encoder, batch, args, kwargs).detach()))
        torch.set_rng_state(after[0])
        for g, s in zip(generators, after[1]):
            g.set_state(s)
        return loss
    monkeypatch.setattr(module, step_name, spy)
    data = write_nli(tmp_path / "nli.csv") if "--supervised" in flags else corpus
    layers = {"sscl": 3, "micse": 6}.get(case)  # the defaults' layers: SSCL's L-1 and L-2, AMI's L-5 to L-1
    model = write_tiny_model(tmp_path / "deeper", num_layers=layers) if layers else tiny_model
    module.main([str(a) for a in smoke_args(model, data, senteval_dir, tmp_path / "run", "--max_steps", 1,
                                            "--no_test_eval", "--no_align_uniform", *flags)])
    suite_loss, student_loss = seen[0]
    assert torch.equal(suite_loss, student_loss), (case, suite_loss, student_loss)


def wrong_inputs():
    """(block's module, function, args, what the message says): each a mistake a student's loop can make."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(16, 8, generator=g)
    maps = torch.softmax(torch.randn(16, 4, 2, 6, 6, generator=g), -1)
    return {
        "z2 of other sentences": (simcse, "info_nce", (z, z[:8]), "same N sentences"),
        "hard negatives of another width": (simcse, "info_nce", (z, z, 0.05, torch.randn(16, 4)), "width 8"),
        "a dropout-off batch of other rows": (simcsepp, "off_dropout_info_nce", (z, z, z[:4]), "same N"),
        "DCL's views of two widths": (simcsepp, "dcl_loss", (z, z[:, :4]), "same N sentences"),
        "SSCL's layer negatives of another width": (sscl, "sscl_loss", (z, z, [(z[:, :4],)]), "(M, 8)"),
        "WhitenedCSE's views of two shapes": (whitenedcse, "multi_positive_info_nce", ([z, z[:8]],), "same N"),
        "maps stacked on dim 0": (micse, "micse_loss", (z, z, maps.transpose(0, 1), maps.transpose(0, 1),
                                                        torch.randn(5, 8)), "stack maps on dim 1"),
        "bf16 maps": (micse, "ami_loss", (maps.bfloat16(), maps.bfloat16()), "fp32"),
        "maps of two shapes": (micse, "ami_loss", (maps, maps[:8]), "of the same batch"),
        "a mask of another width": (micse, "ami_loss", (maps, maps, 20, None, torch.ones(16, 7)), "(N, n)"),
        "a queue of another width": (micse, "moco_info_nce", (z, z, torch.randn(5, 4)), "(Q, 8)"),
    }


@pytest.mark.parametrize("mistake", list(wrong_inputs()))
def test_a_block_refuses_what_is_wrongly_shaped_in_one_clear_line(mistake):
    """What a pasted block is given is checked where it costs no host sync (shapes and dtypes): a wrongly shaped or
    typed input is one ValueError saying what was expected, never a number (maps stacked along dim 0 ran and gave
    one, as did bf16 maps and a z2 of the wrong batch)."""
    module, name, args, says = wrong_inputs()[mistake]
    with pytest.raises(ValueError, match=re.escape(says)):
        getattr(lifted(module), name)(*args)


def test_an_encoder_without_attention_maps_is_told_to_load_eager(tiny_model):
    """transformers' default SDPA computes no attention maps: output_attentions=True gives none, and the stack of none
    failed after only a warning. micse_views says to load the model with attn_implementation="eager"."""
    from transformers import AutoModel, AutoTokenizer
    tokenizer, model = AutoTokenizer.from_pretrained(tiny_model), AutoModel.from_pretrained(tiny_model)
    batch = dict(tokenizer(["a man runs", "the dog eats"], padding=True, return_tensors="pt"))
    with pytest.raises(ValueError, match='attn_implementation="eager"'):
        lifted(micse).micse_views(model.train(), batch)


def test_an_objectives_signature_names_only_what_the_paper_names():
    """The objectives take embeddings, attention maps and their mask, the queue, the weights: not the CUDA graph's
    padding (`longest`, `layout` were ami_loss's and micse_loss's), which the caller that pads handles."""
    import inspect
    for module, name in ((micse, "ami_loss"), (micse, "micse_loss"), (micse, "moco_info_nce"),
                         (simcse, "info_nce"), (sscl, "sscl_loss"), (whitenedcse, "shuffled_group_whitening")):
        names = set(inspect.signature(getattr(lifted(module), name)).parameters)
        assert not names & {"longest", "layout", "pad", "width", "args"}, (name, names)


def test_the_readmes_pasted_step_runs_as_it_stands(tiny_model):
    """The README's paste example (its Python block calling simcse_step), run as it stands beside the lifted block, a
    transformers model and its tokenizer: a finite loss, and a step that moves the head (a renamed argument or a
    step that returned no loss fails here, not in a reader's copy)."""
    from transformers import AutoModel, AutoTokenizer
    from conftest import ROOT
    readme = (ROOT / "README.md").read_text()
    example = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "simcse_step(" in b)
    namespace = dict(vars(lifted(simcse)), torch=torch, model=AutoModel.from_pretrained(tiny_model),
                     tokenizer=AutoTokenizer.from_pretrained(tiny_model),
                     sentences=["a man runs in the park", "the dog eats food", "a red car", "sun and moon"])
    namespace["d"] = namespace["model"].config.hidden_size
    exec(compile(example, "<README's example>", "exec"), namespace)
    assert torch.isfinite(namespace["loss"]) and namespace["head"][0].weight.grad is None  # zeroed after the step
    assert namespace["optimizer"].state  # AdamW stepped


def test_the_pasted_micse_block_updates_the_momentum_encoder_and_queue_and_reads_a_filled_queue_as_the_suite(
        tiny_model, corpus, senteval_dir, tmp_path, monkeypatch):
    """miCSE's loop beyond its first step, from the pasted block: after each step, micse_momentum_update with the
    recipe's defaults (the EMA, then the batch's keys queued) leaves the momentum encoder's weights and the queue's keys
    as the suite's own update left them, bit for bit; at step 2 micse_step on the queue that holds step 1's keys gives the suite's loss. Fails where
    the block's update or its reading of a filled queue (left_out) drifts from what the suite runs."""
    import copy
    from conftest import smoke_args
    block, seen = lifted(micse), {}
    real_step, real_update = micse.micse_step, micse.micse_momentum_update

    def as_student_queue(queue):
        mine = block.EmbeddingQueue(queue.size, queue.tensor.shape[1])
        mine.load_state_dict({k: v for k, v in queue.state_dict().items() if k != "ids"})
        return mine

    def update(momentum_model, encoder, batch, queue, head, momentum, **kwargs):
        rng, theirs, mine = torch.get_rng_state(), copy.deepcopy(momentum_model), as_student_queue(queue)
        real_update(momentum_model, encoder, batch, queue, head, momentum, **kwargs)
        after = torch.get_rng_state()
        torch.set_rng_state(rng)
        block.micse_momentum_update(theirs, encoder, {k: v for k, v in batch.items() if k != "example_ids"}, mine,
                                    head)  # the recipe's momentum, 0.995: the default
        torch.set_rng_state(after)
        seen.setdefault("updates", []).append((  # as they are now (the next step updates them again)
            [p.detach().clone() for p in momentum_model.parameters()], list(theirs.parameters()),
            queue.tensor.clone(), queue.filled.clone(), mine))

    def step(encoder, batch, head, queue, generator, **kwargs):
        rng, state = torch.get_rng_state(), generator.get_state()
        loss = real_step(encoder, batch, head, queue, generator, **kwargs)
        if bool(queue.filled.any()):  # step 2
            after = torch.get_rng_state(), generator.get_state()
            torch.set_rng_state(rng)
            generator.set_state(state)
            tokens = {k: v for k, v in batch.items() if k != "example_ids"}
            seen["step 2"] = (loss.detach(), block.micse_step(encoder.backbone, tokens, head, as_student_queue(queue),
                                                              generator).detach())
            torch.set_rng_state(after[0])
            generator.set_state(after[1])
        return loss
    monkeypatch.setattr(micse, "micse_momentum_update", update)
    monkeypatch.setattr(micse, "micse_step", step)
    micse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "run", "--max_steps", 2,
                                           "--queue_size", 16, "--no_test_eval", "--no_align_uniform")])
    assert len(seen["updates"]) == 2  # (step 1's learning rate is warm-up's 0: step 2's update moves the weights)
    for suite_weights, block_weights, suite_keys, suite_filled, block_queue in seen["updates"]:
        assert len(suite_weights) == len(block_weights) and all(map(torch.equal, suite_weights, block_weights))
        assert torch.equal(suite_keys, block_queue.tensor) and torch.equal(suite_filled, block_queue.filled)
    assert [int(update[3].sum()) for update in seen["updates"]] == [8, 16]  # each step's batch of 8 queued
    assert torch.equal(*seen["step 2"]), seen["step 2"]


@pytest.mark.parametrize("module", [simcse, simcsepp, sscl, whitenedcse, micse], ids=lambda m: m.__name__)
def test_each_step_docstrings_sketch_runs_as_a_whole_program(module, tiny_model, tmp_path):
    """Each `<method>_step` docstring's sketch, as written, beside its pasted block (torch alone imported): its
    model read from its one named path (set here to the tiny model), every other name defined in the sketch, one
    step taken. Catches a sketch that used a name it never defined (`head`, `generator`, `d` in miCSE's) or cut a
    call short (the tokenizer's arguments), and one that no longer matches its step's signature."""
    import inspect
    import textwrap
    doc = inspect.cleandoc(getattr(module, f"{module.__name__}_step").__doc__)
    sketch = textwrap.dedent(doc.split("as a program:\n\n", 1)[1].split("\n\n", 1)[0])
    assert sketch.startswith("from transformers import") and sketch.count('path = "bert-base-uncased"') == 1
    if module is sscl:  # its recipe's negatives, layers L-1 and L-2, are intermediate: 3 layers at least
        from conftest import write_tiny_model
        tiny_model = write_tiny_model(tmp_path / "three_layers", num_layers=3)
    sketch = sketch.replace('path = "bert-base-uncased"', f"path = {str(tiny_model)!r}")
    namespace = dict(vars(lifted(module)))  # the block and `torch`, `F`: nothing else
    torch.manual_seed(0)
    exec(compile(sketch, f"<{module.__name__}_step's sketch>", "exec"), namespace)
    assert torch.isfinite(namespace["loss"]) and namespace["optimizer"].state  # a loss, and AdamW stepped
    if module is micse:  # the momentum update after the step queued the batch's keys
        assert int(namespace["queue"].filled.sum()) == 3 and namespace["momentum_model"].training
