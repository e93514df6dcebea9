"""st_losses.py against the real sentence-transformers trainer: each loss, trained a few steps by ContrastiveTrainer,
equals its method file's own block loop (<method>_step, backward, clipping, AdamW, the schedule, miCSE's momentum
update) on the same batches and RNG states, bit for bit on CPU in fp32; a checkpoint resumes bit for bit; what the
trainer cannot do right is refused in one line."""
import copy
import random
import types

import pytest
import torch

st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is a test requirement")
pytest.importorskip("accelerate", reason="accelerate is a test requirement (the transformers Trainer's)")
import datasets  # noqa: E402

import common  # noqa: E402
import micse  # noqa: E402
import simcse  # noqa: E402
import simcsepp  # noqa: E402
import sscl  # noqa: E402
import st_losses  # noqa: E402
import whitenedcse  # noqa: E402
from conftest import SHARED, needs_shared, random_sentence, write_tiny_model  # noqa: E402

BATCH, LR = 16, 3e-5
CASES = {  # case: (the loss, its keywords, the columns of the dataset)
    "simcse": (st_losses.SimCSELoss, {}, 1), "simcse-supervised": (st_losses.SimCSELoss, {"supervised": True}, 3),
    "simcsepp": (st_losses.SimCSEPlusPlusLoss, {}, 1), "sscl": (st_losses.SSCLLoss, {}, 1),
    "whitenedcse": (st_losses.WhitenedCSELoss, {"num_groups": 16}, 1),
    "micse": (st_losses.MiCSELoss, {"queue_size": 24}, 1),
}


@pytest.fixture(scope="module")
def tiny_st(tmp_path_factory):
    """A tiny random BERT of 4 layers (SSCL's L-1 and L-2, AMI's layers: all four) as a plain transformers folder:
    SentenceTransformer(dir) gives it mean pooling, which each loss switches to its method's."""
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny_st"), num_layers=4))


@pytest.mark.parametrize("loss_class, method", [(st_losses.SimCSELoss, simcse), (st_losses.SimCSEPlusPlusLoss,
                                                                                  simcsepp),
                                                 (st_losses.SSCLLoss, sscl), (st_losses.WhitenedCSELoss, whitenedcse),
                                                 (st_losses.MiCSELoss, micse)])
def test_each_keyword_is_the_method_files_flag_with_its_recipes_default(loss_class, method):
    """A loss's keywords are its method file's flags (as its parser names them) and default to its RECIPE, and its
    pooling is the evaluation pooler of that recipe (common.eval_pooler); what the loss hands its block by name
    (loss.keywords) the block's step takes, but the two its step derives (SSCL's per_layer, AMI's mask), which its
    objective takes: a recipe, a flag or a block's argument renamed in the method file and not here fails it."""
    import inspect
    flags = vars(method.parse_args([]))
    keywords = {k: p.default for k, p in inspect.signature(loss_class).parameters.items() if k != "model"}
    assert set(keywords) <= set(flags), set(keywords) - set(flags)
    step, objective = (inspect.signature(getattr(method, f"{method.__name__}_{part}")).parameters
                       for part in ("step", "objective"))
    derived = {"per_layer", "attention_mask"}
    assert set(loss_class.keywords) - derived <= set(step) and set(loss_class.keywords) & derived <= set(objective)
    assert {k: v for k, v in keywords.items() if k in method.RECIPE} == \
        {k: method.RECIPE[k] for k in keywords if k in method.RECIPE}
    recipe = types.SimpleNamespace(pooler=method.RECIPE.get("pooler", "cls"),
                                   mlp_only_train=method.RECIPE.get("mlp_only_train", True))
    assert loss_class.pooler == common.eval_pooler(recipe)


def dataset(columns: int, rows: int = 4 * BATCH, seed: int = 0):
    rng = random.Random(seed)
    names = ["anchor", "positive", "negative"][:columns] if columns > 1 else ["text"]
    return datasets.Dataset.from_dict({n: [random_sentence(rng) for _ in range(rows)] for n in names})


def trainer(model, loss, out, steps=3, columns=1, **arguments):
    args = st.SentenceTransformerTrainingArguments(**{
        "output_dir": str(out), "per_device_train_batch_size": BATCH, "max_steps": steps, "learning_rate": LR,
        "save_strategy": "no", "report_to": "none", "use_cpu": True, "disable_tqdm": True, "logging_steps": 1,
        "seed": 42, **arguments})
    return st_losses.ContrastiveTrainer(model=model, args=args, train_dataset=dataset(columns), loss=loss)


def recorded(loss):
    """What each step's block was given, kept: the batch and the RNG states it started from (the trainer's)."""
    steps, real = [], loss.step

    def spy(encoder, batch, **options):
        generator = None if loss.generator is None else loss.generator.get_state()
        steps.append(({k: v.clone() for k, v in batch.items()}, torch.get_rng_state(), generator))
        out = real(encoder, batch, **options)
        steps[-1] += (out.detach().clone(),)
        return out
    loss.step = spy
    return steps


def block_loop(case, start, steps, dtype=None):
    """The method file's own block in a student's loop from the same start: the transformers model, the head, the
    queue and momentum encoder of the block, AdamW and the schedule of common.py, clipping at 1.0."""
    backbone, head = copy.deepcopy(start.backbone).train(), copy.deepcopy(start.head)
    generator = None if start.generator is None else torch.Generator().manual_seed(42)
    queue = momentum = None
    if case == "micse":
        queue, momentum = micse.EmbeddingQueue(24, backbone.config.hidden_size), micse.momentum_copy(backbone)
    params = [p for p in backbone.parameters() if p.requires_grad] + list(head.parameters() if head else [])
    optimizer, scheduler = common.make_optimizer(params, types.SimpleNamespace(lr=LR, warmup_steps=0), len(steps))
    losses = []
    for batch, rng, generator_state, _ in steps:
        torch.set_rng_state(rng)
        if case == "simcse" or case == "simcse-supervised":
            loss = simcse.simcse_step(backbone, batch, head, columns=3 if "supervised" in case else 1, dtype=dtype)
        elif case == "simcsepp":
            loss = simcsepp.simcsepp_step(backbone, batch, head, dtype=dtype)
        elif case == "sscl":
            loss = sscl.sscl_step(backbone, batch, dtype=dtype)
        elif case == "whitenedcse":
            loss = whitenedcse.whitenedcse_step(backbone, batch, head, generator, dtype=dtype)
        else:
            loss = micse.micse_step(backbone, batch, head, queue, generator, dtype=dtype)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if momentum is not None:
            micse.micse_momentum_update(momentum, backbone, batch, queue, head, dtype=dtype)
        losses.append(loss.detach())
    return types.SimpleNamespace(backbone=backbone, head=head, queue=queue, momentum_encoder=momentum, losses=losses)


def assert_same_state(ours, theirs):
    for name in ("backbone", "head", "momentum_encoder"):
        a, b = getattr(ours, name), getattr(theirs, name)
        if a is not None or b is not None:
            for (key, x), y in zip(a.state_dict().items(), b.state_dict().values()):
                assert torch.equal(x, y), (name, key)
    if ours.queue is not None:
        for key, value in ours.queue.state_dict().items():
            assert torch.equal(value, theirs.queue.state_dict()[key]), ("queue", key)


@pytest.mark.parametrize("case", list(CASES))
def test_three_steps_of_contrastive_trainer_equal_the_method_files_block_loop_bit_for_bit(case, tiny_st, tmp_path):
    """Each loss through the real ContrastiveTrainer (its collator, optimizer, schedule, clipping and callbacks), 3
    steps, against its method file's block in a plain loop on the same batches and RNG states: the losses, the
    encoder's weights, the head, and miCSE's queue and momentum encoder, bit for bit. Fails where the trainer leaves
    the head out of the clipping, runs miCSE's EMA before the optimizer step (or not at all), pools, pads or feeds
    the block other than the block says, or steps its schedule otherwise."""
    loss_class, keywords, columns = CASES[case]
    model = st.SentenceTransformer(tiny_st, device="cpu")
    loss = loss_class(model, **keywords)
    start = copy.deepcopy(types.SimpleNamespace(backbone=loss.backbone, head=loss.head, generator=loss.generator))
    steps = recorded(loss)
    run = trainer(model, loss, tmp_path, columns=columns)
    run.train()
    reference = block_loop(case, start, steps)
    assert [s[-1] for s in steps] == reference.losses
    assert_same_state(loss, reference)
    the_saved_model_encodes_as_eval_sts_reads_it(run, tmp_path / "out")


def the_saved_model_encodes_as_eval_sts_reads_it(run, out):
    """The trainer's output_dir gives the same embeddings through SentenceTransformer(out) as through eval_sts.py's
    loader with the pooler the run recorded (the method's: [CLS] before the MLP, supervised SimCSE's MLP, SSCL's
    average), so the same STS scores (cosines: MiniLM's saved Normalize stays). Fails where the saved pooling or head
    is not the method's evaluation."""
    import eval_sts
    run.save_model(str(out))
    sentences = [random_sentence(random.Random(i)) for i in range(6)]
    encode = eval_sts.load_encode(str(out), eval_sts.checkpoint_pooler(str(out), None), torch.device("cpu"))
    ours = torch.as_tensor(st.SentenceTransformer(str(out), device="cpu").encode(sentences))
    normalised = torch.nn.functional.normalize  # (MiniLM's Normalize module: no cosine moves)
    torch.testing.assert_close(normalised(ours, dim=-1), normalised(torch.as_tensor(encode(sentences)), dim=-1),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["simcse", "whitenedcse", "micse"])
def test_micro_batch_size_trains_the_whole_batchs_objective(case, well_conditioned, tmp_path):
    """micro_batch_size=8 of a batch of 16 (GradCache through the block's two halves, as the suite's
    --micro_batch_size), dropout off (a pass of 8 rows draws other masks than one of 16, as in the suite's test):
    two steps' losses (miCSE's second with its queue) and the gradient norms the trainer logs are the whole batch's,
    to fp32's rounding of sums in another order. Fails where a micro-batch is its own contrastive problem (8
    negatives, not 16), or the head's gradient (WhitenedCSE's, in the objective) is dropped or counted twice."""
    loss_class, keywords, _ = CASES[case]
    runs = []
    for micro in (None, 8):
        torch.manual_seed(0)
        model = st.SentenceTransformer(well_conditioned, device="cpu")
        loss = loss_class(model, **keywords, micro_batch_size=micro,
                          **({"momentum_dropout": 0.0} if case == "micse" else {}))
        run = trainer(model, loss, tmp_path / str(micro), steps=2)
        run.train()
        runs.append([v for h in run.state.log_history if "loss" in h for v in (h["loss"], h["grad_norm"])])
    assert runs[1] == pytest.approx(runs[0], rel=1e-5)


@pytest.fixture(scope="module")
def well_conditioned(tmp_path_factory):
    """The tiny BERT of weights of std 0.2 and no dropout (tests/test_memory.py's): its sentences' embeddings spread,
    so that the contrastive gradients are no differences of nearly equal vectors (fp32's rounding would decide)."""
    return str(write_tiny_model(tmp_path_factory.mktemp("well_conditioned_st"), num_layers=4, dropout=0.0,
                                initializer_range=0.2))


@pytest.mark.parametrize("case", ["micse", "whitenedcse"])
def test_resume_from_checkpoint_at_step_2_of_4_equals_the_straight_run_bit_for_bit(case, tiny_st, tmp_path):
    """checkpoint-2/ holds the loss's state (STATE_FILE: the head, miCSE's queue and momentum encoder, the generator
    of AMI's draws or WhitenedCSE's shuffles) beside the trainer's: a new model and loss resumed from it give steps
    3 and 4 of the straight run, the losses and every state bit for bit. Fails where a checkpoint leaves out the
    queue, the head (the trainer would put Adam's moments on a fresh head), or a generator's state."""
    loss_class, keywords, _ = CASES[case]

    def run(out, resume=None):
        torch.manual_seed(0)  # the head's initialisation alike (the resumed one's is overwritten)
        model = st.SentenceTransformer(tiny_st, device="cpu")
        loss = loss_class(model, **keywords)
        steps = recorded(loss)
        trainer(model, loss, out, steps=4, save_strategy="steps", save_steps=2).train(
            resume_from_checkpoint=resume)
        return loss, [s[-1] for s in steps]
    straight, straight_losses = run(tmp_path / "straight")
    resumed, resumed_losses = run(tmp_path / "resumed", str(tmp_path / "straight" / "checkpoint-2"))
    assert resumed_losses == straight_losses[2:]
    assert_same_state(resumed, straight)
    assert torch.equal(resumed.generator.get_state(), straight.generator.get_state())


def test_a_plain_trainer_and_gradient_accumulation_are_refused_in_one_line(tiny_st, tmp_path):
    """A plain SentenceTransformerTrainer given one of these losses would train without the head in its clipping,
    its state in checkpoints or miCSE's EMA: the loss refuses, naming ContrastiveTrainer. gradient_accumulation_steps
    > 1 would give each micro-batch fewer negatives: refused, naming the loss's micro_batch_size=. MatryoshkaLoss and
    AdaptiveLayerLoss change the model's sentence_embedding, which these losses never read: refused too."""
    model = st.SentenceTransformer(tiny_st, device="cpu")
    loss = st_losses.SimCSELoss(model)
    args = st.SentenceTransformerTrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none",
                                                   use_cpu=True, per_device_train_batch_size=BATCH)
    plain = st.SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset(1), loss=loss)
    with pytest.raises(RuntimeError, match="ContrastiveTrainer") as refused:
        plain.train()
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match=r"micro_batch_size=") as refused:
        trainer(model, loss, tmp_path, gradient_accumulation_steps=2)
    assert "\n" not in str(refused.value) and "gradient_accumulation_steps=2" in str(refused.value)
    from sentence_transformers.sentence_transformer import losses
    for wrapped in (losses.MatryoshkaLoss(model, loss, [32, 16]), losses.AdaptiveLayerLoss(model, loss)):
        with pytest.raises(ValueError, match=f"{type(wrapped).__name__} around SimCSELoss") as refused:
            trainer(model, wrapped, tmp_path)  # tried: an IndexError, a KeyError inside the trainer's step
        assert "\n" not in str(refused.value)


def test_without_sentence_transformers_the_import_is_one_line_naming_the_pip_command(monkeypatch):
    """The method files keep no sentence-transformers import (test_setup); st_losses.py, imported without it, says in
    one line what to install, not a traceback into sentence-transformers' absence."""
    import importlib.util
    monkeypatch.setitem(__import__("sys").modules, "sentence_transformers", None)  # as if not installed
    spec = importlib.util.spec_from_file_location("st_losses_without", st_losses.__file__)
    with pytest.raises(ImportError, match="pip install sentence-transformers") as refused:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert "\n" not in str(refused.value) and refused.value.__cause__ is None


def test_a_step_makes_no_host_sync(tiny_st, tmp_path):
    """Steps 2 and 3 of ContrastiveTrainer's miCSE (the loss, backward, clipping, the optimizer, the schedule, the
    EMA and the queue), counted by plumbing/syncs.py's dispatch mode: none. The trainer's own NaN filter read each
    step's loss on the host (torch.isnan in a bool), and transformers' 2-D attention mask is checked on the host each
    pass: either fails it."""
    from plumbing import syncs
    model = st.SentenceTransformer(tiny_st, device="cpu")
    loss = st_losses.MiCSELoss(model, queue_size=24)
    counted = []

    class Window(__import__("transformers").TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step >= 1:
                self.counter = syncs.HostSyncCounter("cpu").__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if getattr(self, "counter", None) is not None:
                self.counter.__exit__(None, None, None)
                counted.append(dict(self.counter.ops))
                self.counter = None
    run = trainer(model, loss, tmp_path)
    run.add_callback(Window())
    run.train()
    assert counted == [{}, {}]


@pytest.mark.parametrize("case", ["simcse", "micse"])
def test_bf16_through_the_trainers_flag_is_the_blocks_autocast_of_the_encoder_alone(case, tiny_st, tmp_path):
    """bf16=True (the trainer's flag, accelerate's autocast on CPU) equals the block loop given dtype=torch.bfloat16:
    autocast around the encoder's passes only (miCSE's momentum pass too), the head, AMI and the loss in fp32, as
    the suite's GPU rules say, bit for bit. Fails where the loss or the head run under autocast (bf16 logits), or
    the momentum encoder's keys are encoded in fp32 where micse.py's are in bf16."""
    loss_class, keywords, columns = CASES[case]
    model = st.SentenceTransformer(tiny_st, device="cpu")
    loss = loss_class(model, **keywords)
    start = copy.deepcopy(types.SimpleNamespace(backbone=loss.backbone, head=loss.head, generator=loss.generator))
    steps = recorded(loss)
    trainer(model, loss, tmp_path, steps=2, bf16=True).train()
    reference = block_loop(case, start, steps, dtype=torch.bfloat16)
    assert [s[-1] for s in steps] == reference.losses and all(s[-1].dtype == torch.float32 for s in steps)
    assert_same_state(loss, reference)


@needs_shared
def test_micse_on_minilm_equals_its_block_loop_and_saves_what_eval_sts_reads(tmp_path, capsys):
    """The real encoder, offline: MiniLM as sentence-transformers loads it (eval mode, SDPA, mean pooling, Normalize,
    max_seq_length 256) trained 2 steps by MiCSELoss + ContrastiveTrainer equals micse.py's block loop on the same
    batches bit for bit (AMI over MiniLM's own attention maps, its layers 1:5, the queue, the momentum encoder in
    train mode); its pooling switched to [CLS], its attention to eager and its truncation to 32, each said in one
    printed line; the saved model encodes as eval_sts.py reads it."""
    model = st.SentenceTransformer(str(SHARED / "models" / "all-MiniLM-L6-v2"), device="cpu")
    assert not model[0].auto_model.training  # as loaded
    loss = st_losses.MiCSELoss(model, queue_size=24)
    said = capsys.readouterr().out.splitlines()
    assert [line for line in said if "mean pooling switched to cls" in line or "eager" in line
            or "max_seq_length=32" in line] == said and len(said) == 3
    assert loss.layers == (1, 5) and loss.momentum_encoder.training
    start = copy.deepcopy(types.SimpleNamespace(backbone=loss.backbone, head=loss.head, generator=loss.generator))
    steps = recorded(loss)
    run = trainer(model, loss, tmp_path, steps=2)
    run.train()
    assert max(batch["input_ids"].shape[1] for batch, *_ in steps) == 32  # padded to it, as micse.py pads
    reference = block_loop("micse", start, steps)
    assert [s[-1] for s in steps] == reference.losses
    assert_same_state(loss, reference)
    the_saved_model_encodes_as_eval_sts_reads_it(run, tmp_path / "out")


DRIVER = '''
import os, sys
sys.path[:0] = [{root!r}, {tests!r}]
import torch
import test_st_losses
for case in ("simcse", "micse"):
    state = test_st_losses.two_step_run(case, {model!r}, {out!r} + "/" + case, per_device=8)
    torch.save(state, {out!r} + f"/{{case}}_rank{{os.environ['RANK']}}.pt")
'''


def two_step_run(case, model_dir, out, per_device):
    """2 steps of SimCSELoss or MiCSELoss (its momentum encoder's dropout off) on `model_dir`: every parameter of
    the loss (the model's, the head's, the momentum encoder's) and miCSE's queue, by name, and each step's loss."""
    torch.manual_seed(0)
    model = st.SentenceTransformer(model_dir, device="cpu")
    loss = st_losses.MiCSELoss(model, queue_size=24, momentum_dropout=0.0) if case == "micse" else \
        st_losses.SimCSELoss(model)
    steps = recorded(loss)
    run = trainer(model, loss, out, steps=2)
    run.args.per_device_train_batch_size = per_device
    run.train()
    state = {k.replace("module.", ""): v.detach().clone() for k, v in loss.named_parameters()}
    state.update({f"queue.{k}": v.clone() for k, v in (loss.queue.state_dict() if loss.queue else {}).items()})
    return {"state": state, "losses": [s[-1] for s in steps]}


def test_two_processes_under_torchrun_train_like_one_on_the_global_batch(well_conditioned, tmp_path):
    """ContrastiveTrainer under torchrun (2 gloo processes, 8 rows each; accelerate's DDP) against one process of 16,
    in the conditions of test_distributed's two-processes-equal-one test (dropout off, a well-conditioned tiny BERT):
    the losses and every parameter, the head's and miCSE's queue and momentum encoder included, to 1e-5, and both
    processes alike bit for bit. Fails where the head's gradients are not averaged (the processes drift apart, step
    2's loss by 2e-4), or where a process's negatives, AMI maps or queued keys are its own rows alone (no gather)."""
    import os
    import subprocess
    import sys
    from conftest import ROOT
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(root=str(ROOT), tests=str(ROOT / "tests"), model=well_conditioned,
                                    out=str(tmp_path / "two")))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    launched = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               str(driver)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert launched.returncode == 0, launched.stderr[-3000:]
    for case in ("simcse", "micse"):
        one = two_step_run(case, well_conditioned, tmp_path / "one" / case, per_device=16)
        rank0, rank1 = (torch.load(tmp_path / "two" / f"{case}_rank{r}.pt") for r in (0, 1))
        assert one["state"].keys() == rank0["state"].keys() == rank1["state"].keys()
        assert [float(v) for v in rank0["losses"]] == pytest.approx([float(v) for v in one["losses"]], rel=1e-5)
        for name, value in one["state"].items():
            torch.testing.assert_close(rank0["state"][name], rank1["state"][name], atol=0, rtol=0)
            if value.is_floating_point():
                torch.testing.assert_close(rank0["state"][name], value, atol=1e-5, rtol=1e-5, msg=name)
            else:
                assert torch.equal(rank0["state"][name], value), name





@needs_shared
def test_the_readmes_sentence_transformers_example_runs_as_written_offline(tmp_path, monkeypatch):
    """The README's example (MiCSELoss with ContrastiveTrainer on the local MiniLM), run as it stands from a
    checkout beside ../shared, offline: it trains, and its output folder is what eval_sts.py and SentenceTransformer
    read (the recorded pooler, the loss's state). Fails where the README's code no longer runs, or saves elsewhere."""
    import re
    from conftest import ROOT
    block = next(b for b in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
                 if "ContrastiveTrainer" in b)
    (tmp_path / "checkout").mkdir()
    (tmp_path / "shared").symlink_to(SHARED)  # the README's ../shared paths, from the checkout's root
    monkeypatch.chdir(tmp_path / "checkout")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    exec(compile(block, "<README.md's example>", "exec"), {"__name__": "readme_example"})
    out = next((tmp_path / "checkout" / "runs").iterdir())
    assert (out / "eval_pooler.json").is_file() and (out / st_losses.STATE_FILE).is_file()
    assert (out / "modules.json").is_file()
