"""Host-device syncs of a training step, counted: --count_host_syncs N (tests, bench.py).

On a GPU the host queues kernels and runs ahead of the device; an op that reads a device value on the host
(`.item()`, `bool(t)`, `nonzero`, a boolean index, `torch.linalg.eigh`'s error check, a copy to the CPU) makes it
wait until the device has caught up, so the next kernels start late. The same ops run on a CPU, where there is
nothing to wait for, so a TorchDispatchMode that records them finds on CPU every sync a GPU run would make in
the code a step runs (transformers' included). It counts only ops on tensors of the training device: on a GPU a
CPU tensor's `.item()` is no sync. On CUDA the window also sets `torch.cuda.set_sync_debug_mode` (`CUDA_DEBUG`:
"warn" counts torch's own warnings, which catch syncs inside kernels; tests set "error").

The window is a training step of this process: from the batch the loader hands over (the loader works on host
tensors) to `Run.record` (plumbing/run.py); log steps and dev gates come after it. Steps 2..N+1 are counted
(step 1 allocates and warms up); results.json's "host_syncs" has the count of each, and the ops.
"""
from __future__ import annotations

import collections
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# What each op reads on the host, and why it must wait for the device.
SYNC_OPS = {
    "aten._local_scalar_dense": "item(), bool(), int(), float() of a tensor: the value itself",
    "aten.nonzero": "its output's size depends on the values",
    "aten.masked_select": "its output's size depends on the mask",
    "aten._unique2": "its output's size depends on the values",
    "aten.unique_dim": "its output's size depends on the values",
    "aten.unique_consecutive": "its output's size depends on the values",
    "aten.bincount": "its output's size depends on the largest value",
    "aten.equal": "returns a Python bool",
    "aten._linalg_check_errors": "reads LAPACK's / cuSOLVER's info on the host",
    "aten._linalg_eigh": "torch.linalg.eigh reads cuSOLVER's info (convergence) on the host inside its kernel",
}
BOOLEAN_INDEX_OPS = {"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"}
CUDA_DEBUG = "warn"  # torch.cuda.set_sync_debug_mode inside the window, on CUDA ("error" in tests/test_cuda.py)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def sync_op(func, args, kwargs, device_type: str) -> str | None:
    """The name of the sync `func(*args, **kwargs)` makes on a `device_type` device, or None."""
    name = f"{func.namespace}.{func.overloadpacket.__name__}"
    inputs = list(_tensors(args)) + list(_tensors(kwargs))
    if not any(t.device.type == device_type for t in inputs):
        return None
    if name in SYNC_OPS:
        return name
    if name in BOOLEAN_INDEX_OPS and any(t.dtype == torch.bool for t in _tensors(args[1:2])):
        return f"{name} (boolean index)"
    if name == "aten.repeat_interleave" and kwargs.get("output_size") is None and \
            isinstance(args[0], torch.Tensor) and args[0].dtype != torch.bool and len(args) < 2:
        return f"{name} (repeats from a tensor)"
    if name in ("aten._to_copy", "aten.copy_") and device_type != "cpu":  # device -> host copies
        source = args[1] if name == "aten.copy_" else args[0]
        target = args[0].device if name == "aten.copy_" else kwargs.get("device")
        if source.device.type == device_type and target is not None and torch.device(target).type == "cpu":
            return f"{name} (to the CPU)"
    return None


class HostSyncCounter(TorchDispatchMode):
    """Records every op that reads a `device_type` value on the host, by name (`ops`)."""

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type, self.ops = device_type, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = sync_op(func, args, kwargs, self.device_type)
        if name is not None:
            self.ops[name] += 1
        return func(*args, **kwargs)


class StepWindow:
    """Counts the syncs of steps 2..`steps`+1 of this process (see the module's docstring)."""

    def __init__(self, steps: int | None, device: torch.device):
        self.steps, self.device = steps or 0, device
        self.seen, self.counter, self.caught, self.ops = 0, None, None, collections.Counter()
        self.per_step, self.cuda_warnings = [], []

    def begin(self) -> None:
        """A step's batch has arrived."""
        self.seen += 1
        if not 2 <= self.seen <= self.steps + 1:
            return
        self.counter = HostSyncCounter(self.device.type).__enter__()
        if self.device.type == "cuda":
            self.caught = warnings.catch_warnings(record=True)
            self.warnings = self.caught.__enter__()
            warnings.simplefilter("always")
            self.debug_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(CUDA_DEBUG)

    def end(self) -> None:
        """The step is queued (Run.record)."""
        if self.counter is None:
            return
        if self.caught is not None:
            torch.cuda.set_sync_debug_mode(self.debug_mode)
            self.caught.__exit__(None, None, None)
            # torch's own warning (c10's warn_or_error_on_sync), not any warning that mentions synchronising
            self.cuda_warnings.append(sum("called a synchronizing CUDA operation" in str(w.message)
                                          for w in self.warnings))
            self.caught = None
        self.counter.__exit__(None, None, None)
        self.ops.update(self.counter.ops)
        self.per_step.append(sum(self.counter.ops.values()))
        self.counter = None

    def record(self) -> dict | None:
        """results.json's "host_syncs": the counted steps, each one's syncs, and the ops that made them."""
        if not self.steps:
            return None
        record = {"steps": list(range(2, 2 + len(self.per_step))), "per_step": self.per_step,
                  "ops": dict(self.ops), "device": self.device.type}
        if self.device.type == "cuda":  # torch's own count (set_sync_debug_mode "warn")
            record["cuda_sync_warnings_per_step"] = self.cuda_warnings
        return record


WINDOW = StepWindow(None, torch.device("cpu"))  # set by Run (plumbing/run.py)


def begin_step() -> None:
    WINDOW.begin()


def end_step() -> None:
    WINDOW.end()
