"""A loss lifts into a student's own loop: each loss's source, with the helpers it calls, copied into a fresh module
that imports only torch (common.X becomes X, as a copy of both reads), gives what the suite's own gives, bit for bit.
A loss that reached for the suite's state (a module global, a flag, a closure) would fail to run there."""
import inspect
import sys
import types

import pytest
import torch

import common
import micse
import simcse
import simcsepp
import sscl
import whitenedcse

HEADER = "from __future__ import annotations\nfrom typing import NamedTuple\nimport torch\nimport torch.nn.functional as F\n"
LIFTABLE = {  # name: (the loss, then the helpers it calls)
    "info_nce": [common.info_nce, common.cos_sim],
    "positive_only_loss": [common.positive_only_loss],
    "masked_lm_loss": [simcse.masked_lm_loss],
    "off_dropout_info_nce": [simcsepp.off_dropout_info_nce, simcsepp.m_positive_cross_entropy, common.cos_sim],
    "view_negatives_info_nce": [simcsepp.view_negatives_info_nce, simcsepp.m_positive_cross_entropy, common.cos_sim],
    "dcl_loss": [simcsepp.dcl_loss],
    "sscl_loss": [sscl.sscl_loss, common.cos_sim],
    "shuffled_group_whitening": [whitenedcse.shuffled_group_whitening],
    "multi_positive_info_nce": [whitenedcse.multi_positive_info_nce, common.cos_sim],
    "micse_loss": [micse.micse_loss, micse.moco_info_nce, micse.ami_loss, micse.attention_tiles, micse.AMISample,
                   micse.ami_sample, micse.centred_logs, common.positive_only_loss, common.cos_sim],
}


def lifted(name: str) -> types.ModuleType:
    """A module made of the sources alone, executed with only torch imported."""
    source = HEADER + "\n\n".join(inspect.getsource(obj).replace("common.", "") for obj in LIFTABLE[name])
    module = types.ModuleType(f"lifted_{name}")
    before = set(sys.modules)
    exec(compile(source, f"<lifted {name}>", "exec"), module.__dict__)
    suite = {"common", "data", "plumbing", "simcse", "simcsepp", "sscl", "whitenedcse", "micse"}
    assert not suite & {key for key, value in module.__dict__.items() if isinstance(value, types.ModuleType)}
    assert set(sys.modules) == before  # it imported nothing new
    return module


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
def test_a_loss_copied_with_its_helpers_runs_on_torch_alone_and_gives_the_suites_value(name):
    args, kwargs = inputs(name)
    copy = getattr(lifted(name), name)
    if name == "micse_loss":  # AMI's samples: the same draws from a generator of the same seed
        ours = LIFTABLE[name][0](*args, generator=torch.Generator().manual_seed(1), **kwargs)
        theirs = copy(*args, generator=torch.Generator().manual_seed(1), **kwargs)
    else:
        ours, theirs = LIFTABLE[name][0](*args, **kwargs), copy(*args, **kwargs)
    assert torch.equal(ours, theirs), name


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
