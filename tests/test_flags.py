"""Every flag that reaches a loss, pinned through a real run of its script: the loss the run records at each of its
two steps equals the loss recomputed here, in float64 loops (the losses' own tests' references), from the embeddings
the run fed its loss and from the flags' values as the command gave them. A method file that passes a flag's default
(or another flag) where the flag belongs, flips a term's sign or drops a weight records another loss.

The flags take values unlike their defaults and unlike each other (a temperature of 0.1, a DCL temperature of 2), so
that a mix-up changes the loss by 1e-2 or more. The tolerance is fp32's: the run computes each cosine of D = 32
dimensions in fp32 (an error below D u, u = 6e-8, worst case), divides it by the temperature, and a cross-entropy's
change is at most twice its logits' largest change, so the recorded loss is within 2 D u / temp (8e-5 at temp 0.05;
DCL's correlations are sums over the N = 8 rows, below that) of the float64 one: ATOL = 1e-4. The model is the tiny
BERT with weights of std 0.2 and 4 layers, whose sentences' embeddings spread (test_memory.py's well-conditioned one):
the default init's [CLS] embeddings coincide to 3e-6 and would make every loss nearly log N whatever the flags.

The dev gate's comparison (a strictly better score saves best/) is pinned the same way in every method file and
ablation script: a run whose learning rate moves no weight ties at every gate, and best/ stays the first gate's.
"""
import copy
import importlib
import json

import numpy as np
import pytest
import torch

import common
from conftest import smoke_args, write_nli, write_tiny_model
from test_common import loop_info_nce
from test_micse import loop_moco
from test_simcsepp import loop_dcl, loop_off_dropout
from test_sscl import loop_sscl
from test_whitenedcse import loop_multi_positive, numpy_group_whitening

ATOL = 1e-4  # 2 D u / temp, the module's docstring


@pytest.fixture(scope="module")
def spread_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("spread"), num_layers=4, initializer_range=0.2)


class Calls:
    """The training passes' calls of the functions given (their arguments and result, detached copies), grouped by
    step: a step ends where the run records its loss. Calls without autograd (the dev gate's encodings, the momentum
    encoder's keys) are not the loss's inputs and are left out."""

    def __init__(self, monkeypatch, targets):
        from plumbing import run
        self.steps, self.current = [], []
        for owner, name in targets:
            monkeypatch.setattr(owner, name, self.spy(name, getattr(owner, name)))
        record = run.Run.record

        def recording(run_self, loss, grad_norm, terms=None):
            self.steps.append(self.current)
            self.current = []
            record(run_self, loss, grad_norm, terms)
        monkeypatch.setattr(run.Run, "record", recording)

    def spy(self, name, function):
        def spied(*args, **kwargs):
            result = function(*args, **kwargs)
            if torch.is_grad_enabled():
                self.current.append((name, detached(args), detached(kwargs), detached(result)))
            return result
        return spied

    def of(self, step, name):
        return [(args, kwargs, result) for called, args, kwargs, result in self.steps[step] if called == name]


def detached(value):
    if isinstance(value, torch.nn.Module):  # its weights as they were at the call (the step changes them)
        return copy.deepcopy(value)
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(detached(v) for v in value)
    if isinstance(value, dict):
        return {k: detached(v) for k, v in value.items()}
    return value


def recorded_losses(script, flags, model, corpus, senteval_dir, tmp_path, data=None):
    """Two steps of `script` with `flags`: the losses it recorded (results.json)."""
    out = tmp_path / "run"
    importlib.import_module(script).main([str(a) for a in smoke_args(
        model, data or corpus, senteval_dir, out, "--max_steps", 2, "--eval_steps", 2, "--no_test_eval",
        "--no_align_uniform", *flags)])
    losses = json.loads((out / "results.json").read_text())["train_loss"]
    assert len(losses) == 2
    return losses


def test_supervised_simcse_weights_each_anchors_own_hard_negative(spread_model, corpus, senteval_dir, tmp_path,
                                                                   monkeypatch):
    """Eq. 8's --hard_negative_weight and --temp reach info_nce: passing 0 (or the default temperature) instead
    records another loss."""
    import simcse
    calls = Calls(monkeypatch, [(simcse, "simcse_views")])
    weight, temp = 1.5, 0.1
    losses = recorded_losses("simcse", ["--supervised", "--hard_negative_weight", weight, "--temp", temp],
                             spread_model, corpus, senteval_dir, tmp_path, write_nli(tmp_path / "nli.csv", 24))
    for step, loss in enumerate(losses):
        (_, _, (anchors, positives, hard)), = calls.of(step, "simcse_views")  # one pass of the three
        assert loss == pytest.approx(loop_info_nce(anchors, positives, temp, hard, weight), abs=ATOL)
        assert abs(loop_info_nce(anchors, positives, temp, hard, 0.0) - loss) > 100 * ATOL  # the weight matters
    assert simcse.main  # the script ran in this process


def test_unsupervised_simcse_takes_its_temperature_and_two_views(spread_model, corpus, senteval_dir, tmp_path,
                                                                 monkeypatch):
    """--temp, the two dropout views of one pass (rows 0..N-1 and N..2N-1), and --no_negatives' positive pairs
    alone (miCSE Table 4: the mean of -s(z1_i, z2_i))."""
    import simcse
    calls = Calls(monkeypatch, [(simcse, "simcse_views")])
    losses = recorded_losses("simcse", ["--temp", 0.1], spread_model, corpus, senteval_dir, tmp_path)
    for step, loss in enumerate(losses):
        (_, _, (z1, z2)), = calls.of(step, "simcse_views")
        assert loss == pytest.approx(loop_info_nce(z1, z2, 0.1), abs=ATOL)
    calls = Calls(monkeypatch, [(simcse, "simcse_views")])
    losses = recorded_losses("simcse", ["--no_negatives", "--temp", 0.1], spread_model, corpus, senteval_dir,
                             tmp_path / "positives")
    for step, loss in enumerate(losses):
        (_, _, z), = calls.of(step, "simcse_views")
        z1, z2 = (v.double().numpy() for v in z)
        cosines = (z1 * z2).sum(1) / (np.linalg.norm(z1, axis=1) * np.linalg.norm(z2, axis=1))
        assert loss == pytest.approx(-cosines.mean() / 0.1, abs=ATOL)


@pytest.mark.parametrize("flags", [[], ["--dcl_only"], ["--no_off_dropout"]], ids=["off-dropout+dcl", "dcl-only",
                                                                                   "view-negatives"])
def test_simcsepp_terms_take_their_own_weights_and_temperatures(flags, spread_model, corpus, senteval_dir, tmp_path,
                                                                monkeypatch):
    """SimCSE++'s objective: the off-dropout InfoNCE at --temp with --m on the positive, plus --dcl_weight times DCL at
    --dcl_temp (its sign included); --dcl_only: DCL alone at --dcl_temp (not --temp); --no_off_dropout: the views'
    negatives, m still on the positive."""
    import simcsepp
    temp, m, dcl_weight, dcl_temp = 0.1, 0.7, 0.3, 2.0
    calls = Calls(monkeypatch, [(simcsepp, "simcsepp_views")])
    losses = recorded_losses("simcsepp", ["--temp", temp, "--m", m, "--dcl_weight", dcl_weight, "--dcl_temp",
                                          dcl_temp, "--pooler", "cls", *flags],
                             spread_model, corpus, senteval_dir, tmp_path)
    for step, loss in enumerate(losses):
        (_, _, (z1, z2, *dropout_off)), = calls.of(step, "simcsepp_views")
        if flags == ["--dcl_only"]:
            assert not dropout_off  # no dropout-off pass
            expected = loop_dcl(z1, z2, dcl_temp)
        elif flags == ["--no_off_dropout"]:
            assert not dropout_off
            expected = view_negatives_loop(z1, z2, temp, m) + dcl_weight * loop_dcl(z1, z2, dcl_temp)
        else:
            z_dropout_off, = dropout_off
            expected = loop_off_dropout(z1, z2, z_dropout_off, temp, m) + dcl_weight * loop_dcl(z1, z2, dcl_temp)
        assert loss == pytest.approx(expected, abs=ATOL)


def view_negatives_loop(z1, z2, temp, m):
    """--no_off_dropout's loss written out: row i's CE over m s(z1_i, z2_i) and s(z1_i, z2_j), j != i."""
    import math
    a, b = z1.double().numpy(), z2.double().numpy()
    s = (a / np.linalg.norm(a, axis=1, keepdims=True)) @ (b / np.linalg.norm(b, axis=1, keepdims=True)).T / temp
    total = 0.0
    for i in range(len(a)):
        logits = [m * s[i, j] if j == i else s[i, j] for j in range(len(b))]
        total += -logits[i] + math.log(sum(math.exp(x) for x in logits))
    return total / len(a)


def test_sscl_takes_its_layers_and_temperature(spread_model, corpus, senteval_dir, tmp_path, monkeypatch):
    """--neg_layers 2 of a 4-layer encoder: hidden_states 3 and 2 (L-1, L-2) given to the block's sscl_views (which
    pools them like z: tests/test_sscl.py), both views' (the released code's), at --temp; --neg_layer_index 1: that
    layer alone; --layer_negatives anchor: the anchor view's only."""
    import sscl
    for flags, layers, per_layer in ((["--neg_layers", 2], [3, 2], 2), (["--neg_layer_index", 1], [1], 2),
                                     (["--neg_layers", 1, "--layer_negatives", "anchor"], [3], 1)):
        calls = Calls(monkeypatch, [(sscl, "sscl_views")])
        losses = recorded_losses("sscl", ["--temp", 0.1, *flags], spread_model, corpus, senteval_dir,
                                 tmp_path / "-".join(map(str, flags)))
        for step, loss in enumerate(losses):
            (args, kwargs, (z1, z2, *negatives)), = calls.of(step, "sscl_views")
            assert list(args[2]) == layers and len(negatives) == per_layer * len(layers), flags
            grouped = [tuple(negatives[i:i + per_layer]) for i in range(0, len(negatives), per_layer)]
            assert loss == pytest.approx(loop_sscl(z1, z2, grouped, 0.1), abs=ATOL), flags


def test_whitenedcse_whitens_in_num_groups_and_contrasts_num_pos_views(spread_model, corpus, senteval_dir, tmp_path,
                                                                       monkeypatch):
    """--num_groups 4 of the 32 channels (groups of 8, not hidden // 2 groups of 2), --num_pos 3 views, --temp: each
    view's [CLS] shuffled, whitened per group (numpy), put back, through the head's Linear and tanh, then the
    multi-positive InfoNCE of the views against the first."""
    import whitenedcse
    calls = Calls(monkeypatch, [(whitenedcse.WhitenedHead, "forward")])
    losses = recorded_losses("whitenedcse", ["--num_groups", 4, "--num_pos", 3, "--temp", 0.1, "--batch_size", 16],
                             spread_model, corpus, senteval_dir, tmp_path)
    for step, loss in enumerate(losses):
        views = []
        for (head, cls, perm), _, _ in calls.of(step, "forward"):
            x = cls.double().numpy()[:, perm.numpy()]
            whitened = numpy_group_whitening(x, 4)[:, np.argsort(perm.numpy())]
            weight, bias = head.linear.weight.detach().double().numpy(), head.linear.bias.detach().double().numpy()
            views.append(torch.from_numpy(np.tanh(whitened @ weight.T + bias)))
        assert len(views) == 3
        assert loss == pytest.approx(loop_multi_positive(views, 0.1), abs=ATOL)


def test_micse_adds_lambda_ami_to_the_queued_info_nce(spread_model, corpus, senteval_dir, tmp_path, monkeypatch):
    """--ami_lambda times the AMI term plus InfoNCE over the batch and --queue_size's queue at --temp; the queue's 16
    slots are empty at step 1 (all left out) and hold step 1's 8 keys at step 2."""
    import micse
    calls = Calls(monkeypatch, [(micse, "ami_loss"), (micse, "moco_info_nce")])
    ami_lambda, temp = 0.5, 0.1
    losses = recorded_losses("micse", ["--ami_lambda", ami_lambda, "--queue_size", 16, "--temp", temp],
                             spread_model, corpus, senteval_dir, tmp_path)
    for step, loss in enumerate(losses):
        (_, _, ami), = calls.of(step, "ami_loss")
        (args, kwargs, _), = calls.of(step, "moco_info_nce")
        (z1, z2, queue), own_keys = args[:3], (args[4:] or [kwargs.get("own_keys")])[0]
        assert len(queue) == 16 and own_keys[:, 8 * step:].all() and not own_keys[:, :8 * step].any()
        own = None if own_keys is None else own_keys.numpy()
        expected = loop_moco(z1.double().numpy(), z2.double().numpy(), queue.double().numpy(), temp, own)
        assert abs(float(ami)) > 1e-3  # the term is there to weigh
        assert loss == pytest.approx(expected + ami_lambda * float(ami), abs=ATOL)


SCRIPTS = {"simcse": [], "simcsepp": [], "sscl": ["--neg_layers", 1], "whitenedcse": ["--num_groups", 16],
           "micse": ["--queue_size", 8], "simcse_augmentations": ["--positive", "word_deletion", "--rate", 0.2],
           "simcsepp_noise_barlow": ["--barlow", "--barlow_padding", 10], "whitenedcse_whitening": ["--whitening", "zca"]}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_a_tie_at_the_dev_gate_keeps_the_first_best(script, tiny_model, corpus, senteval_dir, tmp_path):
    """At lr 1e-30 AdamW moves no weight (each update is far below an fp32 ulp of the weights; its decay 1 - 1e-32
    rounds to 1), so every gate scores the untrained model's STS-B dev exactly: best/ must stay step 0's (a `>=`
    instead of `>` would move it to each tie)."""
    out = tmp_path / "run"
    importlib.import_module(script).main([str(a) for a in smoke_args(
        tiny_model, corpus, senteval_dir, out, "--max_steps", 2, "--eval_steps", 1, "--lr", 1e-30, "--no_test_eval",
        "--no_align_uniform", *SCRIPTS[script])])
    results = json.loads((out / "results.json").read_text())
    scores = [row["stsb_dev"] for row in results["trajectory"] if row.get("gate")]
    assert len(scores) == 3 and len(set(scores)) == 1, scores
    assert results["best_step"] == 0
