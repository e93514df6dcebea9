"""--cuda_graph (plumbing/graph.py) on CPU: what a CPU can show of it. The optimizer made capturable with its
learning rate a tensor steps exactly as the eager one, fp16's skipped step included; what a graph cannot capture is
refused in one line before any work; without the flag the step is called as it is (tests/test_behaviour.py: the
same losses bit for bit). The capture and replay themselves: tests/test_cuda.py."""
import types

import pytest
import torch

import common
import simcse
import whitenedcse
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
        loss = common.info_nce(*head(hidden[:, 0]).chunk(2), 0.05)
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
                pad_to_max_length=False, cuda_graph=True)
    return types.SimpleNamespace(**dict(args, **given))


@pytest.mark.parametrize("given, needle", [
    ({"method": "whitenedcse"}, "--cuda_graph with the method: whitenedcse.py: its eigh reads a convergence flag"),
    ({"method": "micse"}, "--cuda_graph with the method: micse.py: its momentum queue grows and is replaced"),
    ({"method": "sscl"}, "--cuda_graph with the method: sscl.py: its step has not been captured on a GPU yet"),
    ({"compile": True}, "--cuda_graph with --compile: give one of them"),
    ({"micro_batch_size": 4}, "--cuda_graph with --micro_batch_size: GradCache reads and sets the RNG's state"),
    ({"gradient_checkpointing": True}, "--cuda_graph with --gradient_checkpointing: the recomputation reads"),
])
def test_what_a_graph_cannot_capture_is_refused_in_one_line(given, needle):
    with pytest.raises(options.plumbing.UsageError, match="^" + needle + ".*; leave --cuda_graph out to run eagerly$"):
        options.check_cuda_graph(cuda_graph_args(**given), torch.device("cuda"))


def test_under_torchrun_the_graph_is_refused_and_alone_it_pads_every_batch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(options.plumbing.UsageError, match="--cuda_graph with torchrun: DDP's all-reduce hooks"):
        options.check_cuda_graph(cuda_graph_args(), torch.device("cuda"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = cuda_graph_args()
    options.check_cuda_graph(args, torch.device("cuda"))
    assert args.pad_to_max_length  # the one shape a graph replays


@pytest.mark.parametrize("module, needle", [
    (simcse, "--cuda_graph with the device: a CUDA graph needs a CUDA GPU, not cpu"),
    (whitenedcse, "--cuda_graph with the method: whitenedcse.py: its eigh reads a convergence flag on the host"),
])
def test_a_user_asking_for_the_graph_where_it_cannot_run_gets_one_line(module, needle, tiny_model, corpus,
                                                                        senteval_dir, tmp_path):
    code, err = cli_in_process(module, *smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "run",
                                                   "--cuda_graph"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "run").exists()  # before any work


class FakeCuda:
    """torch.cuda's streams and graphs as StepGraph calls them, on CPU: a capture runs the step once (a real one
    records it without running it), a replay is counted."""

    def __init__(self, monkeypatch, fail=None):
        import contextlib
        self.replays, self.registered = 0, []
        fake = self

        class Graph:
            def register_generator_state(self, generator):
                fake.registered.append(generator)

            def replay(self):
                fake.replays += 1

        class Stream:
            def wait_stream(self, other):
                pass

        @contextlib.contextmanager
        def capture(graph, capture_error_mode):
            assert capture_error_mode == "thread_local" and not torch.is_autocast_cache_enabled()
            yield
            if fail:
                raise fail if isinstance(fail, BaseException) else RuntimeError(fail)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "Stream", lambda *a: Stream())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "graph", capture)


def linear_step():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, fused=True)
    seen = []

    def train_step(batch):
        seen.append(len(batch["x"]))
        optimizer.zero_grad(set_to_none=True)
        loss = layer(batch["x"]).pow(2).mean()
        loss.backward()
        optimizer.step()
        return loss, loss.detach() * 2
    return train_step, optimizer, seen


def test_the_step_is_captured_on_a_full_batch_after_the_warm_up_and_short_batches_run_eagerly(monkeypatch):
    """Expected: WARMUP eager steps (a short batch among them), the capture on the next full batch (the optimizer
    made capturable, its lr a tensor, the MLM generator registered), a replay for it and every later full batch, an
    epoch's short batch eagerly; what a step returns holds no autograd graph."""
    cuda = FakeCuda(monkeypatch)
    train_step, optimizer, seen = linear_step()
    generator = torch.Generator()
    step = graph.StepGraph(train_step, optimizer, enabled=True, generators=[None, generator])
    sizes = [8, 8, 3, 3, 8, 8, 3, 8]  # warm-up, warm-up, warm-up (short), short, capture, replay, short, replay
    outputs = [step({"x": torch.randn(n, 4)}) for n in sizes]
    assert seen == [8, 8, 3, 3, 8, 3] and cuda.replays == 3 and cuda.registered == [generator]
    assert optimizer.param_groups[0]["capturable"] and torch.is_tensor(optimizer.param_groups[0]["lr"])
    assert all(t.grad_fn is None for out in outputs[:3] + outputs[4:6] + outputs[7:] for t in out)
    assert outputs[5][0] is not step.static_outputs[0]  # a replay's outputs are copies of the graph's


def test_a_step_that_cannot_be_captured_stops_the_run_in_one_line(monkeypatch):
    FakeCuda(monkeypatch, fail="operation not permitted when stream is capturing\nmore detail")
    train_step, optimizer, _ = linear_step()
    step = graph.StepGraph(train_step, optimizer, enabled=True)
    for _ in range(graph.WARMUP):
        step({"x": torch.randn(8, 4)})
    with pytest.raises(options.plumbing.UsageError, match=r"^--cuda_graph: this step cannot be captured in a CUDA "
                       r"graph \(operation not permitted when stream is capturing\); to run it eagerly, run the same command "
                       r"without --cuda_graph, with --pad_to_max_length --auto_resume$"):
        step({"x": torch.randn(8, 4)})
    assert torch.is_autocast_cache_enabled()  # autocast's cache as it was


def test_running_out_of_memory_in_the_capture_is_the_runs_own_out_of_memory_stop(monkeypatch):
    FakeCuda(monkeypatch, fail=torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    train_step, optimizer, _ = linear_step()
    step = graph.StepGraph(train_step, optimizer, enabled=True)
    for _ in range(graph.WARMUP):
        step({"x": torch.randn(8, 4)})
    with pytest.raises(torch.OutOfMemoryError):  # plumbing.cli's out-of-memory line, with what the run kept
        step({"x": torch.randn(8, 4)})
