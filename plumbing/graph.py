"""--cuda_graph: the training step replayed from one CUDA graph.

At the papers' batch (64 x 32 tokens) a step on a big GPU waits for Python to launch about a thousand kernels; a
CUDA graph records them once and launches them all in one call (docs/gpu.md: a bare BERT-base step 3.2 x faster on
an H200). `StepGraph(train_step, optimizer, ...)` is called as train_step would be, with the step's batch (and
values that stay the same for a shape, such as the global batch's row count):

- The first WARMUP steps run eagerly on a side stream (PyTorch's recipe: the lazy state, the optimizer's moments and
  the GradScaler's scale, is made before the capture).
- Then the step is captured once for each shape of batch, in input buffers of that shape: the optimizer made
  capturable with its learning rate a device tensor (the schedule writes into it between replays: no host sync),
  autocast's weight cache off (a capture cannot keep it), dropout drawn from the graph-safe CUDA generator (and
  `generators`, e.g. the MLM masking's, registered with the graph). Each later batch of a shape is copied into its
  buffers and its graph replayed. Every batch is padded to --max_seq_length, so there are two shapes: the full batch
  and an epoch's short last one, whose graph is captured (after one eager warm-up step of its own) in the first
  graph's memory pool: the two never run at once, so they share their memory.
- What a replay returns lives in the graph's memory and is overwritten by the next replay: it is returned as copies.

What cannot be captured is refused before any work where --cuda_graph is given, and left eager by default
(options.check_cuda_graph): another device, torchrun's processes (DDP's all-reduce hooks), --micro_batch_size and
--gradient_checkpointing (they read and set the RNG's state on the host). A step that turns out not to be
capturable (an encoder whose forward copies a value from the host, as DeBERTa-v2's relative positions do;
WhitenedCSE's eigh for groups wider than 2) goes on eagerly after one line. `release()` frees the graphs' memory
(before the final evaluation)."""
from __future__ import annotations

import weakref

import torch

from plumbing import distributed

WARMUP = 3  # eager steps before the capture
_LIVE = weakref.WeakSet()  # the StepGraphs holding a graph: release() frees them


class StepGraph:
    def __init__(self, train_step, optimizer: torch.optim.Optimizer, enabled: bool = True, generators=()):
        """train_step(batch) -> a tensor or a tuple of tensors; enabled False: it is called as it is.
        generators: the torch.Generators on the GPU that the step draws from besides the default one (None: none)."""
        self.train_step, self.optimizer, self.enabled = train_step, optimizer, enabled
        self.generators, self.calls = [g for g in generators if g is not None], 0
        self.graphs, self.warmed, self.pool = {}, set(), None  # {shape: (graph, input buffers, outputs)}
        self.captured = 0  # graphs captured, for the run's record

    def __call__(self, batch: dict, *same):  # -> what train_step returns, detached
        if not self.enabled:
            return self.train_step(batch, *same)
        self.calls += 1
        shape = (tuple((k, tuple(v.shape)) for k, v in batch.items()), same)  # what a graph fixes
        if self.calls <= WARMUP or shape not in self.warmed:  # a new shape: one eager step first
            self.warmed.add(shape)
            return self._on_side_stream(batch, *same)
        if shape not in self.graphs and not self._capture(shape, batch, *same):
            return detached(self.train_step(batch, *same))  # not capturable: eagerly from now on
        cuda_graph, buffers, outputs = self.graphs[shape]
        for k, buffer in buffers.items():
            buffer.copy_(batch[k], non_blocking=True)
        cuda_graph.replay()
        return each(outputs, torch.Tensor.clone)

    def _on_side_stream(self, batch: dict, *same):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            outputs = detached(self.train_step(batch, *same))  # its autograd nodes not kept into the capture
        torch.cuda.current_stream().wait_stream(side)
        return outputs

    def _capture(self, shape, batch: dict, *same) -> bool:
        """The step captured on buffers of this batch's shape; False (and one line) where it cannot be: the run then
        goes on eagerly, with what the capture attempt left (no kernel of it ran) cleared by the eager step's
        zero_grad."""
        capturable(self.optimizer, next(iter(batch.values())).device)
        buffers = {k: v.clone() for k, v in batch.items()}
        self.optimizer.zero_grad(set_to_none=True)  # the graph's backward makes the gradients in its own pool
        cuda_graph = torch.cuda.CUDAGraph()
        for generator in self.generators:
            cuda_graph.register_generator_state(generator)
        cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        try:  # thread_local: the data loader's pinning thread may call CUDA meanwhile
            with torch.cuda.graph(cuda_graph, pool=self.pool, capture_error_mode="thread_local"):
                outputs = detached(self.train_step(buffers, *same))
        except torch.OutOfMemoryError:
            raise  # the run's own out-of-memory stop (plumbing.cli)
        except RuntimeError as error:  # e.g. an encoder whose forward reads or copies a host value
            reason = (str(error).splitlines() or [type(error).__name__])[0][:200]
            distributed.log(f"note: --cuda_graph: this step cannot be captured in a CUDA graph ({reason}); the run "
                            "goes on eagerly (its batches still padded to --max_seq_length)")
            self.enabled = False
            self.release()
            return False
        finally:
            torch.set_autocast_cache_enabled(cache)
        self.graphs[shape], self.pool = (cuda_graph, buffers, outputs), self.pool or cuda_graph.pool()
        self.captured += 1
        _LIVE.add(self)
        return True

    def release(self) -> None:
        """The graphs, their buffers and their memory pool given back."""
        self.graphs, self.pool = {}, None
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def release() -> int:
    """Every StepGraph's graphs and memory pool freed (the training has ended: the final evaluation needs the room);
    how many graphs were captured (the run's record says so)."""
    count = 0
    for step_graph in list(_LIVE):
        count += step_graph.captured
        step_graph.release()
        step_graph.enabled = False
        _LIVE.discard(step_graph)  # counted once
    return count


def capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """The optimizer as a graph replays it: capturable, its learning rate a tensor on the device that the schedule
    fills between replays (LambdaLR writes into a tensor lr: no host sync). The tensor's dtype is the one the fused
    kernel computes lr in (float32 on CUDA, float64 on CPU), so that the steps are the eager ones bit for bit."""
    dtype = torch.float64 if device.type == "cpu" else torch.float32
    for group in optimizer.param_groups:
        group["capturable"] = True
        group["lr"] = torch.as_tensor(group["lr"], dtype=dtype).to(device)


def detached(outputs):
    """A step's outputs without their autograd graph (which would keep the parameters' gradient nodes alive)."""
    return each(outputs, torch.Tensor.detach)


def each(outputs, function):
    """`function` of each tensor of a step's outputs: a tensor, or a tuple of tensors and {name: tensor} dicts."""
    if isinstance(outputs, torch.Tensor):
        return function(outputs)
    if isinstance(outputs, dict):
        return {name: function(t) for name, t in outputs.items()}
    return tuple(each(output, function) for output in outputs)
