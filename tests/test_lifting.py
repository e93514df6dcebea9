"""A method's objective lifts into a student's own loop: each method file holds it in one block between two marker
lines, and that block, copied as it stands into a fresh module that imports only torch (and torch.nn.functional as
F), runs and gives what the suite's own functions give, bit for bit. A block that reached outside itself (a helper
left out of it, `common`, a module global, a flag) would fail to run there."""
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
HEADER = "import torch\nimport torch.nn.functional as F\n"
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
    """A module made of the block alone, executed with only torch imported."""
    lifted_module = types.ModuleType(f"lifted_{module.__name__}")
    before = set(sys.modules)
    exec(compile(HEADER + block(module), f"<the objective of {module.__name__}.py>", "exec"), lifted_module.__dict__)
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
