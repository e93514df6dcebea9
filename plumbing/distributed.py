"""Several processes (torchrun): the process group, rank helpers, DistributedDataParallel, a gather with gradients.

Plain `python script.py` never initialises a process group, and then every helper here is the identity.
Under `torchrun --nproc_per_node N` each process holds batch / N rows; the method files gather what their loss
needs over the global batch (visible lines in each loop), and PyTorch's DistributedDataParallel averages the
gradients with its bucketed all-reduce, overlapped with the backward pass. Every process computes the same
global-batch loss on the gathered tensors: all_gather's backward sums the N identical gradients into each
process's own rows and DDP's average divides by N, so the update is exactly the one-process update on the
global batch.
"""
from __future__ import annotations

import contextlib
import os
import signal
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import plumbing
from plumbing import progress


_RANK, _WORLD, _HOST_GROUP = 0, 1, None  # kept after shutdown(): a process still knows who it was


def init(device: torch.device) -> torch.device:
    """Under torchrun (RANK set): join the process group (NCCL on CUDA, gloo on CPU); this process's device.

    A second gloo group carries the host-side values (the stop flag, the dev score) and the barriers, so that they
    never wait for the GPU."""
    global _RANK, _WORLD, _HOST_GROUP
    if "RANK" not in os.environ or dist.is_initialized():
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0":
        dist.init_process_group(backend)
    else:  # torchrun --max_restarts: the agent's store outlives the failed attempt, whose addresses the new
        # processes would read and try (a refused connection or a hang): this attempt's keys get a prefix of their own
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=not agent_store and rank == 0)
        dist.init_process_group(backend, store=dist.PrefixStore(f"restart{restart}", store), rank=rank,
                                world_size=world)
    _RANK, _WORLD = dist.get_rank(), dist.get_world_size()
    _HOST_GROUP = dist.new_group(backend="gloo") if device.type == "cuda" else None
    return device


def world_size() -> int:
    return _WORLD


def rank() -> int:
    return _RANK


def gather(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The rows of every process in rank order, gradients flowing back to each own rows. `rows`: how many rows the
    global batch has (data.batches gives it with each batch); process r holds rows n r / N to n (r + 1) / N of it
    (data.BatchSampler), so every process knows every count without asking (they may differ by one). It keeps no state:
    torch.distributed says whether a process group runs and its size, so it works in any torchrun loop."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return t
    world, here = dist.get_world_size(), dist.get_rank()
    counts = [rows * (r + 1) // world - rows * r // world for r in range(world)]
    if len(t) != counts[here]:
        raise RuntimeError(f"gather: {len(t)} rows here, a global batch of {rows} gives this process {counts[here]}")
    padded = F.pad(t, (0, 0) * (t.dim() - 1) + (0, max(counts) - len(t)))
    with warnings.catch_warnings():  # torch 2.13 points to a private module instead; this public one still works
        warnings.simplefilter("ignore", FutureWarning)
        parts = dist_nn.all_gather(padded)
    return torch.cat([part[:n] for part, n in zip(parts, counts)])


def data_parallel(model: torch.nn.Module, compile: bool = False):
    """What a loop calls to run the encoder. Under torchrun: DistributedDataParallel(model), whose bucketed
    all-reduce of every gradient overlaps the backward pass (one process: the model itself); with --compile,
    torch.compile of that (DDP first, as PyTorch advises: its DDPOptimizer splits the graph at the buckets).

    Several passes a step (SimCSE++'s dropout-off pass, --do_mlm's masked pass) all go through it before the one
    backward; every parameter that requires a gradient gets one in every step (common.BackboneWithHeads freezes the
    unused pooler), so DDP needs no search for unused parameters, and its default (dynamic) graph mode holds whatever
    the passes are. The buffers (position ids) never change and are the same on every process: not broadcast at each
    forward (torch 2.13's forward_sync_buffers, which replaces broadcast_buffers; DDP still broadcasts them once, when
    it is made). No gradient accumulation: no no_sync."""
    if world_size() > 1:
        device = next(model.parameters()).device
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                        forward_sync_buffers=False)
    return torch.compile(model) if compile else model


def largest_next(value: float):
    """The largest of the processes' `value`s, without waiting: the exchange starts now (on the host, gloo: it must
    not wait for the GPU) and the returned function reads the answer, the same on every process; read a step later,
    it has long arrived."""
    t = torch.tensor([value], dtype=torch.float64)
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_HOST_GROUP, async_op=True)

    def answer() -> float:
        work.wait()
        return t.item()
    return answer


def broadcast_float(value: float) -> float:
    """Process 0's `value` on every process."""
    if world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.broadcast(t, 0, group=_HOST_GROUP)
    return float(t.item())


def smallest(value: float) -> float:
    """The smallest of the processes' `value`s, on every process (--fit_memory: the GPU with least room decides)."""
    return -largest_next(-value)() if world_size() > 1 else value


class StopRequested(Exception):
    """A signal arrived after training: the final evaluation stops where it is."""


class StopSignal:
    """Ctrl-C or SIGTERM asks the loop to stop at the end of the current step (a second one to the same process stops
    it at once); under torchrun every process stops at that step, and `settle` gives each the same stop (`signum`),
    whichever got the signal. Inside `final_evaluation(results)` a signal stops the evaluation at once and is recorded
    in `results`. While the run finishes (best/'s last write, results.json, the trackers) a signal lets it finish first,
    and so does every SIGTERM (torchrun sends one to each process when one exits). `exit_if_stopped()`: 130 / 143."""

    def __init__(self):
        self.signum, self.phase, self.answer, self.signalled = None, "training", None, False
        for s in STOP_SIGNALS:
            signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        if self.signalled and (signum == signal.SIGINT or self.phase in ("training", "final evaluation")):
            raise KeyboardInterrupt  # a second signal to this process, as Python's own Ctrl-C
        self.signalled, self.signum = True, self.signum or signum  # a stop agreed already stays the stop
        name = signal.Signals(signum).name
        if self.phase == "training":
            print(f"signal {name}: stopping at the end of this step", flush=True)
        elif self.phase == "final evaluation":
            print(f"signal {name} during the final evaluation: stopping it; results.json records what "
                  "was done", flush=True)
            raise StopRequested(name)
        else:
            print(f"signal {name} while {self.phase}: finishing that first", flush=True)

    @contextlib.contextmanager
    def final_evaluation(self, results: dict):
        self.phase = "final evaluation"
        try:
            yield
        except StopRequested as stopped:
            results.update(interrupted=True, interrupted_during="final evaluation", stop={"by": str(stopped)})
        finally:
            self.phase = "writing results.json"

    def requested(self) -> bool:
        """Whether the run stops after this step (asked once a step). One process: at once. Several: each step every
        process sends its signal's number (0: none) and reads the answer of the step before, which has arrived
        meanwhile (largest_next: no wait for the GPU), so that all stop at the same step, the one after the signal's."""
        if world_size() == 1:
            return self.signum is not None
        agreed = self.answer() if self.answer else False
        self.answer = largest_next(self.signum or 0)
        return bool(agreed)

    def settle(self) -> None:
        """The training's end, after best/'s last write: one more exchange, waited for, gives every process the same
        stop, the largest signal any got (in the last step too); a process stopped by another's signal says so."""
        if world_size() == 1:
            return
        if self.answer:
            self.answer()  # the last step's, in flight
        own, self.answer = self.signum, None
        self.signum = int(largest_next(own or 0)()) or self.signum  # (one that came meanwhile is kept)
        if self.signum and not own:
            print(f"signal {signal.Signals(self.signum).name} to another process: this one stops with it", flush=True)

    def exit_if_stopped(self) -> None:
        if self.signum is not None:
            raise SystemExit(128 + self.signum)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stop_signals_held():
    """Ctrl-C and SIGTERM held back (blocked: delivered when this ends, not lost) while DataLoader workers start: a
    worker is born with them blocked and ignores them (ignore_stop_signals), so that a signal to the whole process
    group (SLURM, docker stop, kill -- -PGID) stops the main process at a step boundary, which then shuts its workers
    down itself, instead of killing the workers under it."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def ignore_stop_signals(worker_id: int) -> None:
    """A DataLoader worker's worker_init_fn: Ctrl-C and SIGTERM ignored (the main process stops the run)."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def log(message: str) -> None:
    if rank() == 0:
        progress.write(message)  # above the progress bars


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier(group=_HOST_GROUP)  # a host-side rendezvous: nothing to wait for on the GPU


@contextlib.contextmanager
def main_process_first():
    """Process 0 runs the block first (downloads, unpacking senteval.tar, datasets' tokenisation cache), then the
    others, which find its results. If process 0 fails, the others run the block and fail the same way."""
    if rank() != 0:
        barrier()
    try:
        yield
    finally:
        if rank() == 0:
            barrier()


_ENDED_GROUPS = []  # the process groups shutdown() tore down, held until the run's models are freed (release_groups)


def shutdown() -> None:
    """The processes part once training is over: the process group is torn down, so process 0's final evaluation
    (longer than NCCL's 10-minute timeout for BERT-base transfer) holds nobody in a barrier. rank() still answers.

    The groups are held here until `release_groups`: DDP's Reducer holds the default group, and were it the last
    holder, freeing the model would destroy the group in C++ with the GIL held while gloo's worker thread, still
    freeing the barrier's tensors, waits for the GIL (a deadlock at exit, seen under load)."""
    if dist.is_initialized():
        barrier()
        _ENDED_GROUPS.extend(group for group in (dist.group.WORLD, _HOST_GROUP) if group is not None)
        plumbing.after_main(release_groups)
        dist.destroy_process_group()


def release_groups() -> None:
    """After the run (plumbing.cli calls it once main() has returned): its models freed, the groups held by
    shutdown() are the last holders, and their Python destructor lets go of the GIL while gloo's threads finish."""
    if _ENDED_GROUPS:
        import gc
        gc.collect()  # a model held in a reference cycle
        _ENDED_GROUPS.clear()
