"""--cuda_graph (plumbing/graph.py) on CPU: what a CPU can show of it. The optimizer made capturable with its
learning rate a tensor steps exactly as the eager one, fp16's skipped step included; what a graph cannot capture is
refused in one line before any work; without the flag the step is called as it is (tests/test_behaviour.py: the
same losses bit for bit). The capture and replay themselves: tests/test_cuda.py."""
import types
from pathlib import Path

import pytest
import torch

import common
import simcse
from conftest import cli_in_process, smoke_args
from plumbing import graph, hub, options


def simcse_steps(tiny_model, switch_at=None, steps=20, overflow_at=6, device="cpu", keep=None):
    """SimCSE's step on a tiny BERT (two dropout views, [CLS] through the MLP head, InfoNCE), fused AdamW with the
    linear schedule and warm-up, fp16's GradScaler (an overflow injected at `overflow_at`: the step is skipped on
    the device and the scale halved), clipping at 1; graph.capturable() switched on before step `switch_at` as
    StepGraph switches it before its capture. (weights, the learning rates the schedule set, the scale)."""
    torch.manual_seed(0)
    backbone = hub.load_pretrained(str(tiny_model))[1].to(device).train()
    head = common.MLPHead(backbone.config).to(device)
    params = [p for m in (backbone, head) for p in m.parameters() if p.requires_grad]
    args = types.SimpleNamespace(lr=3e-3, warmup_steps=4)
    optimizer, scheduler = common.make_optimizer(params, args, steps)
    scaler = torch.amp.GradScaler(device, enabled=True, init_scale=2.0 ** 10)
    batch = {"input_ids": torch.randint(5, backbone.config.vocab_size, (8, 12)),
             "attention_mask": torch.ones(8, 12, dtype=torch.long)}
    batch = {k: v.to(device) for k, v in batch.items()}
    rates = []
    for step in range(1, steps + 1):
        if step == switch_at:
            graph.capturable(optimizer, torch.device(device))
            if keep is not None:  # the tensor a graph would capture, and its optimizer
                keep.update(lr=optimizer.param_groups[0]["lr"], optimizer=optimizer)
        optimizer.zero_grad(set_to_none=True)
        views = common.repeat_views(batch, 2)
        hidden = backbone(**views).last_hidden_state
        loss = simcse.info_nce(*head(hidden[:, 0]).chunk(2), 0.05)
        if step == overflow_at:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        rates.append(float(scheduler.get_last_lr()[0]))
    return [p.detach().cpu() for p in params], rates, scaler.get_scale()


def test_the_capturable_optimizer_with_its_lr_a_tensor_steps_exactly_as_the_eager_one(tiny_model, device="cpu"):
    """(tests/test_cuda.py runs it on CUDA, where the fused kernel reads lr as float32.)"""
    eager_weights, eager_rates, eager_scale = simcse_steps(tiny_model, device=device)
    kept = {}
    weights, rates, scale = simcse_steps(tiny_model, switch_at=graph.WARMUP + 1, device=device, keep=kept)
    # the schedule wrote into the tensor the graph reads (a new tensor in its place would be read by no replay)
    assert kept["lr"] is kept["optimizer"].param_groups[0]["lr"] and float(kept["lr"]) == rates[-1]
    assert eager_scale == scale == 2.0 ** 9  # the overflow's step was skipped once
    # the schedule's rates, rounded to the tensor's dtype (float32 on CUDA)
    assert rates == pytest.approx(eager_rates, rel=2 ** -24, abs=0) and eager_rates[-1] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(eager_weights, weights))
    # and the comparison can fail: another learning rate from step 10 on moves the weights
    moved, _, _ = simcse_steps(tiny_model, overflow_at=9, device=device)
    assert not all(torch.equal(a, b) for a, b in zip(eager_weights, moved))


def test_without_the_flag_the_step_is_called_as_it_is():
    calls = []
    step = graph.StepGraph(lambda batch: calls.append(batch) or "out", optimizer=None, enabled=False)
    assert step({"x": 1}) == "out" and calls == [{"x": 1}]


def cuda_graph_args(**given):
    args = dict(method="simcse", compile=False, micro_batch_size=None, gradient_checkpointing=False,
                pad_to_max_length=False, cuda_graph=True, resume=False, auto_resume=False, output_dir="unused")
    return types.SimpleNamespace(**dict(args, **given))


@pytest.mark.parametrize("given, needle", [
    ({"micro_batch_size": 4}, "--cuda_graph with --micro_batch_size: GradCache reads and sets the RNG's state"),
    ({"gradient_checkpointing": True}, "--cuda_graph with --gradient_checkpointing: the recomputation reads"),
])
def test_what_a_graph_cannot_capture_is_refused_in_one_line_and_left_eager_by_default(given, needle):
    with pytest.raises(options.plumbing.UsageError, match="^" + needle + ".*; leave --cuda_graph out to run eagerly$"):
        options.check_cuda_graph(cuda_graph_args(**given), torch.device("cuda"))
    args = cuda_graph_args(cuda_graph=None, **given)  # the default: eager, the batches as they were
    options.check_cuda_graph(args, torch.device("cuda"))
    assert args.cuda_graph is False and args.pad_to_max_length is False


def test_compile_runs_eagerly_by_default_and_inside_the_graph_where_both_are_given():
    args = cuda_graph_args(cuda_graph=None, compile=True)
    options.check_cuda_graph(args, torch.device("cuda"))
    assert args.cuda_graph is False and args.pad_to_max_length is False
    args = cuda_graph_args(cuda_graph=True, compile=True)  # the compiled step captured (docs/gpu.md)
    options.check_cuda_graph(args, torch.device("cuda"))
    assert args.cuda_graph is True and args.pad_to_max_length is True


def test_by_default_the_rows_captured_on_a_gpu_take_the_graph_on_cuda_alone(monkeypatch):
    """Every method file's step has been captured and replayed on a GPU (docs/gpu.md): each takes the graph by
    default on CUDA (miCSE too: its AMI reads up to the batch's longest row, tests/test_micse.py), none on CPU or with
    --no_cuda_graph."""
    assert options.AUTO_GRAPHED == ("simcse", "simcsepp", "sscl", "whitenedcse", "micse")
    for method in options.GRAPHED_METHODS:
        for device, want in (("cuda", True), ("cpu", False)):
            args = cuda_graph_args(method=method, cuda_graph=None)
            options.check_cuda_graph(args, torch.device(device))
            assert args.cuda_graph is want and args.pad_to_max_length is want, (method, device)
        args = cuda_graph_args(method=method, cuda_graph=False)  # --no_cuda_graph
        options.check_cuda_graph(args, torch.device("cuda"))
        assert args.cuda_graph is False and args.pad_to_max_length is False


def test_under_torchrun_the_graph_is_refused_and_alone_it_pads_every_batch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(options.plumbing.UsageError, match="--cuda_graph with torchrun: DDP's all-reduce hooks"):
        options.check_cuda_graph(cuda_graph_args(), torch.device("cuda"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = cuda_graph_args()
    options.check_cuda_graph(args, torch.device("cuda"))
    assert args.pad_to_max_length  # the one shape a graph replays


def test_a_resumed_run_keeps_what_it_started_with_and_a_changed_flag_is_one_line(tmp_path):
    """A run that started eagerly stays eager when resumed on a GPU (its batches padded as they were); one that
    started with the graph keeps it, and its padding; naming the other is refused in one line that says how the run
    started, not a flag the user never gave."""
    import json
    for started, given in ((False, True), (True, False)):
        (tmp_path / "started.json").write_text(json.dumps({"args": {"cuda_graph": started,
                                                                     "pad_to_max_length": started}}))
        args = cuda_graph_args(cuda_graph=None, resume=True, output_dir=str(tmp_path))
        options.check_cuda_graph(args, torch.device("cuda"))
        assert args.cuda_graph is started and args.pad_to_max_length is started
        with pytest.raises(options.plumbing.UsageError, match="^--auto_resume: the run in .* started (with --cuda_graph"
                           "|eagerly).*; resume it as it started: leave out --cuda_graph and --no_cuda_graph$"):
            options.check_cuda_graph(cuda_graph_args(cuda_graph=given, auto_resume=True, output_dir=str(tmp_path)),
                                     torch.device("cuda"))


def test_a_user_asking_for_the_graph_where_it_cannot_run_gets_one_line(tiny_model, corpus, senteval_dir, tmp_path):
    code, err = cli_in_process(simcse, *smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "run",
                                                   "--cuda_graph"))
    needle = "--cuda_graph with the device: a CUDA graph needs a CUDA GPU, not cpu"
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "run").exists()  # before any work


class FakeCuda:
    """torch.cuda's streams and graphs as StepGraph calls them, on CPU, keeping their contract. A capture runs the
    step once to record it, then puts back every tensor it changed and the RNG (a real capture runs no kernel); it
    checks the step starts without gradients (a real graph's backward makes them in its own pool). A replay runs the
    recorded step again on the tensors it was captured on, writing its outputs into the captured outputs' memory (as
    a real replay, it reads the input buffers as they are now: a batch not copied into them is the old batch). The
    streams log what waits on what."""

    def __init__(self, monkeypatch, fail=None, tensors=()):
        import contextlib
        self.replays, self.registered, self.log, self.tensors, self.pools = 0, [], [], list(tensors), []
        fake = self

        class Graph:
            def register_generator_state(self, generator):
                fake.registered.append(generator)

            def pool(self):
                return ("pool of", id(self))

            def replay(self):  # the step rerun on this graph's own buffers, into its own outputs
                fake.replays += 1
                _, buffers, captured = self.step.graphs[self.shape]
                outputs = self.step.train_step(buffers, *self.shape[1])
                into, values = [], []  # each tensor of the outputs (loss, grad_norm, {term: ...})
                graph.each(captured, into.append)
                graph.each(outputs, values.append)
                for buffer, value in zip(into, values, strict=True):
                    buffer.copy_(value.detach())

        class Stream:
            def __init__(self, name):
                self.name = name

            def wait_stream(self, other):
                fake.log.append(f"{self.name} waits for {other.name}")

        @contextlib.contextmanager
        def on(stream):
            fake.log.append(f"on {stream.name}")
            yield
            fake.log.append("off")

        @contextlib.contextmanager
        def capture(graph, pool, capture_error_mode):
            assert capture_error_mode == "thread_local" and not torch.is_autocast_cache_enabled()
            fake.pools.append(pool)
            assert all(p.grad is None for group in fake.step.optimizer.param_groups for p in group["params"])
            saved = [t.detach().clone() for t in fake.state()]
            rng = torch.get_rng_state(), [g.get_state() for g in fake.registered]
            yield
            for t, before in zip(fake.state(), saved):  # a capture records; it runs nothing
                t.detach().copy_(before)
            torch.set_rng_state(rng[0])
            for g, state in zip(fake.registered, rng[1]):
                g.set_state(state)
            if fail:
                raise fail if isinstance(fail, BaseException) else RuntimeError(fail)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "Stream", lambda *a: Stream("side"))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream("current"))
        monkeypatch.setattr(torch.cuda, "stream", on)
        monkeypatch.setattr(torch.cuda, "graph", capture)
        real_capture = graph.StepGraph._capture

        def capturing(step, shape, batch, *same):
            fake.step = step
            captured = real_capture(step, shape, batch, *same)
            if captured:  # which step and shape a replay reruns
                step.graphs[shape][0].step, step.graphs[shape][0].shape = step, shape
            return captured
        monkeypatch.setattr(graph.StepGraph, "_capture", capturing)

    def state(self):
        """What a step changes: the parameters, the optimizer's state, and the tensors given (a queue)."""
        optimizer = self.step.optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return params + [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)] + \
            self.tensors


def linear_step():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, fused=True)
    seen = []

    def train_step(batch, scale=1.0):
        seen.append(len(batch["x"]))
        optimizer.zero_grad(set_to_none=True)
        loss = layer(batch["x"]).pow(2).mean() * scale
        loss.backward()
        optimizer.step()
        return loss, loss.detach() * 2
    return train_step, optimizer, seen


def eager_losses(sizes, scale=1.0):
    train_step, _, _ = linear_step()
    torch.manual_seed(1)
    return [train_step({"x": torch.randn(n, 4)}, scale)[0].detach() for n in sizes]


def test_each_shape_is_captured_after_its_own_warm_up_and_replayed_from_its_own_graph(monkeypatch):
    """Expected: WARMUP eager steps (a short batch among them) each on a side stream that waits for the current one
    and is waited for; then a graph for each shape of batch, captured the first time the shape comes after the warm-up
    (a shape the warm-up did not see runs one eager step first), the second in the first's memory pool, with the
    optimizer made capturable (its lr a tensor), the MLM generator registered, no gradient left; each later batch
    copied into its shape's buffers and its graph replayed. Every step's loss is the eager loop's; what a step returns
    holds no autograd graph and is a copy of the graph's outputs. Fails where the batch is not copied into the buffers
    (the losses of a stale batch), where a short batch is replayed through the full batch's graph (or the full one
    through the short one's), where a stream does not wait, where gradients are left for the capture."""
    graph.release()  # what earlier tests in this process left
    cuda = FakeCuda(monkeypatch)
    train_step, optimizer, seen = linear_step()
    generator = torch.Generator()
    step = graph.StepGraph(train_step, optimizer, enabled=True, generators=[None, generator])
    # warm-up x3 (a short one among them), short (captured), full (captured), full, short, full, 5 (new: eager), 5
    sizes = [8, 8, 3, 3, 8, 8, 3, 8, 5, 5, 3, 8]
    torch.manual_seed(1)
    outputs = [step({"x": torch.randn(n, 4)}) for n in sizes]
    assert [float(out[0]) for out in outputs] == [float(loss) for loss in eager_losses(sizes)]
    assert cuda.replays == 8 and len(step.graphs) == 3 and cuda.registered == [generator] * 3
    first_pool = next(iter(step.graphs.values()))[0].pool()
    assert cuda.pools == [None, first_pool, first_pool]  # one memory pool for the graphs
    assert cuda.log[:5] == ["side waits for current", "on side", "off", "current waits for side",
                            "side waits for current"] and cuda.log.count("current waits for side") == graph.WARMUP + 1
    assert optimizer.param_groups[0]["capturable"] and torch.is_tensor(optimizer.param_groups[0]["lr"])
    assert all(t.grad_fn is None for out in outputs for t in out)
    assert outputs[5][0] is not step.graphs[(((("x", (8, 4)),)), ())][2][0]  # a replay's outputs are copies
    assert graph.release() == 3 and step.graphs == {}


def test_a_corpus_whose_every_other_batch_is_short_replays_both_from_graphs(monkeypatch):
    """An epoch of a batch of 8 and one of 3, over and over (a few-shot corpus): after the warm-up every step is a
    replay, none eager, and the losses are the eager loop's bit for bit. Fails where a short batch runs eagerly
    after a note (replays short of the steps) or is replayed through the full batch's graph."""
    cuda = FakeCuda(monkeypatch)
    train_step, optimizer, _ = linear_step()
    step = graph.StepGraph(train_step, optimizer, enabled=True)
    sizes = [8, 3] * 8
    torch.manual_seed(1)
    losses = [float(step({"x": torch.randn(n, 4)})[0]) for n in sizes]
    assert losses == [float(loss) for loss in eager_losses(sizes)]
    assert cuda.replays == len(sizes) - graph.WARMUP and len(step.graphs) == 2


def test_a_replay_reads_the_same_values_it_was_captured_with_or_runs_eagerly(monkeypatch):
    """What a graph fixes at its capture besides the batch's shape (the global batch's row count) must be the same
    for a replay; a batch that comes with another runs eagerly."""
    cuda = FakeCuda(monkeypatch)
    train_step, optimizer, _ = linear_step()
    step = graph.StepGraph(train_step, optimizer, enabled=True)
    torch.manual_seed(1)
    for scale in (1.0, 1.0, 1.0, 1.0, 1.0, 2.0):
        step({"x": torch.randn(8, 4)}, scale)
    assert cuda.replays == 2  # the capture's and the next; the batch with 2.0 eagerly


def test_a_step_that_cannot_be_captured_goes_on_eagerly_after_one_line(monkeypatch, capsys):
    """An encoder whose forward reads or copies a host value (DeBERTa-v2 and MPNet on an H200): the capture fails, one line says so, and
    the run goes on eagerly with the losses of the eager loop (the capture ran nothing)."""
    FakeCuda(monkeypatch, fail="operation not permitted when stream is capturing\nmore detail")
    train_step, optimizer, _ = linear_step()
    step = graph.StepGraph(train_step, optimizer, enabled=True)
    torch.manual_seed(1)
    losses = [step({"x": torch.randn(8, 4)})[0] for _ in range(graph.WARMUP + 3)]
    assert [float(x) for x in losses] == [float(x) for x in eager_losses([8] * (graph.WARMUP + 3))]
    out = capsys.readouterr().out
    assert out.count("note: --cuda_graph: this step cannot be captured in a CUDA graph (operation not permitted when "
                     "stream is capturing); the run goes on eagerly") == 1
    assert not step.enabled and step.graphs == {} and torch.is_autocast_cache_enabled()


def test_running_out_of_memory_in_the_capture_is_the_runs_own_out_of_memory_stop(monkeypatch):
    FakeCuda(monkeypatch, fail=torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    train_step, optimizer, _ = linear_step()
    step = graph.StepGraph(train_step, optimizer, enabled=True)
    for _ in range(graph.WARMUP):
        step({"x": torch.randn(8, 4)})
    with pytest.raises(torch.OutOfMemoryError):  # plumbing.cli's out-of-memory line, with what the run kept
        step({"x": torch.randn(8, 4)})


def test_release_frees_the_graphs_before_the_final_evaluation(monkeypatch):
    graph.release()  # what earlier tests in this process left
    FakeCuda(monkeypatch)
    train_step, optimizer, _ = linear_step()
    step = graph.StepGraph(train_step, optimizer, enabled=True)
    for _ in range(graph.WARMUP + 2):
        step({"x": torch.randn(8, 4)})
    assert len(step.graphs) == 1
    assert graph.release() == 1  # the run's record: how many graphs were captured
    assert step.graphs == {} and step.pool is None and not step.enabled


CASES = {"simcse": ("simcse", []), "simcse-sup-mlm": ("simcse", ["--supervised", "--do_mlm"]),
         "simcsepp": ("simcsepp", ["--dcl_weight", "0.1"]), "sscl": ("sscl", ["--neg_layers", "1"]),
         "whitenedcse": ("whitenedcse", ["--num_groups", "16"]), "micse": ("micse", ["--queue_size", "16"])}


def tensors_of(step_function) -> list:
    """What a method's step changes besides the optimizer: the tensors of the objects its partial holds (the
    models' parameters and buffers, fp16's scaler, miCSE's queue)."""
    found = []
    for thing in step_function.args:
        if isinstance(thing, torch.nn.Module):
            found += list(thing.parameters()) + list(thing.buffers())
        elif hasattr(thing, "__dict__") and not isinstance(thing, (torch.optim.Optimizer, types.SimpleNamespace)):
            found += [v for v in vars(thing).values() if torch.is_tensor(v)]
    return found


@pytest.mark.parametrize("case", list(CASES))
def test_each_methods_step_replayed_from_the_faked_graph_trains_what_it_trains_eagerly(case, tiny_model, corpus,
                                                                                        senteval_dir, tmp_path,
                                                                                        monkeypatch):
    """Every method file hands its flat step to StepGraph; with the graph faked on CPU (FakeCuda: the capture runs
    nothing, a replay reruns the recorded step on the captured buffers), 8 steps on a corpus of 12 examples (batches
    of 8 and 4 in turn, as a few-shot subset gives) train what the same run trains eagerly, padded alike: the same
    losses and gradient norms bit for bit, 5 replays from 2 graphs, which the record counts. A generator the step
    draws from that StepGraph does not register (WhitenedCSE's shuffles, AMI's samples, the MLM's masks) would be
    advanced by the capture and part the runs; so would a step whose fixed values (the global batch's rows) did not
    reach it, or a short batch replayed through the full batch's graph."""
    import importlib
    import json
    from conftest import write_nli
    script, flags = CASES[case]
    if "--supervised" in flags:
        data = write_nli(tmp_path / "nli.csv", 12)
    else:
        data = tmp_path / "twelve.txt"
        data.write_text("\n".join(Path(corpus).read_text().splitlines()[:12]) + "\n")
    real_check = options.check_cuda_graph
    monkeypatch.setattr(options, "check_cuda_graph", lambda args, device: real_check(args, torch.device("cuda")))
    cuda = FakeCuda(monkeypatch)
    capture = graph.StepGraph._capture

    def capturing(step, batch, *same):  # the step's own objects' tensors, put back after the capture
        cuda.tensors = tensors_of(step.train_step)
        return capture(step, batch, *same)
    monkeypatch.setattr(graph.StepGraph, "_capture", capturing)
    results = {}
    for mode in ("--no_cuda_graph", "--cuda_graph"):
        out = tmp_path / mode
        importlib.import_module(script).main([str(a) for a in smoke_args(
            tiny_model, data, senteval_dir, out, "--max_steps", 8, "--eval_steps", 8, "--no_test_eval",
            "--no_align_uniform", "--pad_to_max_length", "--max_seq_length", 16, *flags, mode)])
        results[mode] = json.loads((out / "results.json").read_text())
    eager, graphed = results["--no_cuda_graph"], results["--cuda_graph"]
    assert graphed["args"]["cuda_graph"] is True and eager["args"]["cuda_graph"] is False
    assert cuda.replays == 8 - graph.WARMUP  # steps 4 and 5 (each captured, then replayed) to 8
    assert graphed["cuda_graphs"] == 2 and "cuda_graphs" not in eager
    assert graphed["train_loss"] == eager["train_loss"] and graphed["grad_norm"] == eager["grad_norm"]
    assert graphed.get("train_terms") == eager.get("train_terms")  # miCSE's, SimCSE++'s and --do_mlm's: replayed too


@pytest.mark.parametrize("script", ["simcse", "micse"])
def test_a_graph_run_stopped_and_resumed_is_the_straight_graph_run_bit_for_bit(script, tiny_model, corpus,
                                                                                senteval_dir, tmp_path, monkeypatch):
    """The default path on one GPU (the graph, faked on CPU as above): 12 steps straight, and the same command stopped
    by SIGTERM after step 5 (last/ saved at the stop) then resumed: the same losses, gradient norms and best/ weights
    bit for bit, the resumed part warmed up, captured again and replayed (9 replays straight, 2 + 4 stopped and
    resumed). Fails where a resume replays a graph with stale
    state, or where the resumed run leaves the graph (its padding then changes)."""
    import json
    import test_resume
    real_check = options.check_cuda_graph
    monkeypatch.setattr(options, "check_cuda_graph", lambda args, device: real_check(args, torch.device("cuda")))
    cuda = FakeCuda(monkeypatch)
    capture = graph.StepGraph._capture

    def capturing(step, *given):
        cuda.tensors = tensors_of(step.train_step)
        return capture(step, *given)
    monkeypatch.setattr(graph.StepGraph, "_capture", capturing)
    flags = ["--max_steps", 12, "--eval_steps", 4, "--no_test_eval", "--no_align_uniform", "--max_seq_length", 16]
    flags += ["--queue_size", 16] if script == "micse" else []
    outs = {}
    for name in ("straight", "resumed"):
        out = tmp_path / name
        argv = [str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, *flags)]
        cuda.replays = 0
        if name == "straight":
            test_resume.run(script, argv, monkeypatch)
        else:
            test_resume.run(script, argv, monkeypatch, stop_at=5)
            test_resume.run(script, argv + ["--resume"], monkeypatch)
        assert cuda.replays == {"straight": 9, "resumed": 6}[name], (name, cuda.replays)
        outs[name] = test_resume.outcome(out)
    (straight, straight_weights), (resumed, resumed_weights) = outs["straight"], outs["resumed"]
    assert resumed["args"]["cuda_graph"] is True and resumed["resumptions"] == [5]
    assert resumed["train_loss"] == straight["train_loss"] and resumed["grad_norm"] == straight["grad_norm"]
    assert resumed.get("train_terms") == straight.get("train_terms")
    assert all(torch.equal(straight_weights[f][k], resumed_weights[f][k]) for f in straight_weights
               for k in straight_weights[f])


def test_a_resumed_graph_run_gets_a_fresh_commands_refusals_or_goes_on_eagerly_in_one_line(tmp_path, monkeypatch,
                                                                                           capsys):
    """A run started with the graph, resumed where a graph cannot run (no CUDA GPU, torchrun, a memory flag added,
    as the out-of-memory line advises): eagerly, its batches padded as they were, after one line; with --cuda_graph
    named too, refused as a fresh command is. Fails where a resume skips the refusals (then a traceback on a
    machine without CUDA)."""
    import json
    (tmp_path / "started.json").write_text(json.dumps({"args": {"cuda_graph": True, "pad_to_max_length": True}}))
    for device, given, env in ((torch.device("cpu"), {}, "1"), (torch.device("cuda"), {"gradient_checkpointing": True},
                                                                "1"),
                               (torch.device("cuda"), {"micro_batch_size": 4}, "1"), (torch.device("cuda"), {}, "2")):
        monkeypatch.setenv("WORLD_SIZE", env)
        args = cuda_graph_args(cuda_graph=None, resume=True, output_dir=str(tmp_path), **given)
        options.check_cuda_graph(args, device)
        assert args.cuda_graph is False and args.pad_to_max_length is True, (device, given, env)
        lines = capsys.readouterr().out.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("note: the run started with the CUDA graph; ") and \
            lines[0].endswith("it goes on eagerly, its batches padded to --max_seq_length as they were (the same "
                              "steps)"), lines
        with pytest.raises(options.plumbing.UsageError, match="^--cuda_graph with .*; leave --cuda_graph out to run "
                                                              "eagerly$"):
            options.check_cuda_graph(cuda_graph_args(cuda_graph=True, resume=True, output_dir=str(tmp_path),
                                                     **given), device)
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = cuda_graph_args(cuda_graph=None, resume=True, output_dir=str(tmp_path))  # where it can: the graph
    options.check_cuda_graph(args, torch.device("cuda"))
    assert args.cuda_graph is True and capsys.readouterr().out == ""
    # --fit_memory turned the graph off at the start and kept its padding: the resume keeps both (its last/ holds
    # the padding, which a resume that dropped it would refuse in one line)
    (tmp_path / "started.json").write_text(json.dumps({"args": {"cuda_graph": False, "pad_to_max_length": True}}))
    args = cuda_graph_args(cuda_graph=None, resume=True, output_dir=str(tmp_path))
    options.check_cuda_graph(args, torch.device("cuda"))
    assert args.cuda_graph is False and args.pad_to_max_length is True
