"""micse.py: AMI against an explicit reference, the queue, EMA, the few-shot settings, eager attentions."""
import json
import math

import numpy as np
import pytest
import torch

import common
import simcse
import eval_sts
import micse
import plumbing
from plumbing import hub
from conftest import SHARED, in_process_scores, needs_shared, offline_cli, run_script, smoke_args


def random_attention(n=3, layers=4, heads=2, length=4, seed=0, padded_keys=None):
    """Softmax attention (N, L, H, n, n); keys beyond `padded_keys[i]` get exactly 0, as a padding mask gives."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, layers, heads, length, length, generator=g, dtype=torch.float64)
    if padded_keys is not None:
        for i, valid in enumerate(padded_keys):
            scores[i, ..., valid:] = -math.inf
    return scores.softmax(-1)


def reference_ami(attn1, attn2, min_layer, max_layer):
    """Algorithm 1 / the released code, tile by tile with numpy, using every valid entry."""
    n, _, heads = attn1.shape[:3]
    mis, valid_total, total = [], 0, 0
    for i in range(n):
        for h in range(heads):
            for parity in (0, 1):
                layers = range(min_layer + parity, max_layer, 2)
                a = np.concatenate([attn1[i, l, h].numpy().ravel() for l in layers])
                b = np.concatenate([attn2[i, l, h].numpy().ravel() for l in layers])
                keep = (a > 0) & (b > 0)
                valid_total, total = valid_total + keep.sum(), total + keep.size
                la, lb = np.log(a[keep]), np.log(b[keep])
                la, lb = la - la.mean(), lb - lb.mean()
                rho = la @ lb / (np.linalg.norm(la) * np.linalg.norm(lb))
                mis.append(-0.5 * math.log(1 - min(rho ** 2, 1 - 1e-6)))
    return -np.mean(mis) * ((valid_total / total) ** 2 + 1e-6)


@pytest.mark.parametrize("min_layer, max_layer", [(0, 4), (1, 3), (2, 4)])
def test_ami_matches_reference_without_padding(min_layer, max_layer):
    attn1, attn2 = random_attention(seed=1), random_attention(seed=2)
    got = micse.ami_loss(attn1[:, min_layer:max_layer], attn2[:, min_layer:max_layer], num_samples=10_000)
    assert got.item() == pytest.approx(reference_ami(attn1, attn2, min_layer, max_layer), rel=1e-9)


def test_ami_leaves_out_probabilities_too_small_for_their_logs_gradient_under_fp16s_scale():
    """A real encoder's first layers give subnormal attention probabilities (MiniLM's layer 0: down to 2.8e-45); the
    log's gradient 1/p of those overflows fp32, and under fp16's GradScaler (65536 x lambda 2.5e-3) dL/dattn was inf
    (the scaler then skips the step; inf - inf reaches softmax's backward as NaN). Entries below 1e-30 are left out as
    dropout's zeros are: the gradient is finite. Fails where every entry above 0 counts (the released code's rule)."""
    g = torch.Generator().manual_seed(0)
    for seed in range(3):  # e^-100 and below: subnormal probabilities (and exact zeros)
        attn = (torch.randn(8, 2, 2, 6, 6, generator=g) * 40).softmax(-1).requires_grad_()
        assert ((attn > 0) & (attn < 1e-38)).any()
        loss = micse.ami_loss(attn[:4], attn[4:], 20, torch.Generator().manual_seed(seed))
        (loss * 2.5e-3 * 65536).backward()
        assert torch.isfinite(attn.grad).all() and attn.grad.abs().max() > 0 and torch.isfinite(loss), seed


@needs_shared
def test_ami_on_minilms_first_layer_has_a_finite_gradient_under_fp16s_scale():
    """The same on a real encoder's maps: MiniLM, --ami_min_layer 0 (layers 0 and 1), two dropout views of 16 wiki1m
    sentences, 5 seeds; the loss scaled as fp16's GradScaler first scales it. Fails on the released code's > 0."""
    tokenizer, model = hub.load_pretrained(str(SHARED / "models" / "all-MiniLM-L6-v2"), micse.ATTN_IMPLEMENTATION)
    sentences = (SHARED / "data" / "wiki1m_head.txt").read_text().splitlines()[:16]
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=32, return_tensors="pt")
    model.train()
    smallest = 1.0
    for seed in range(5):
        torch.manual_seed(seed)
        outputs = model(**{k: v.repeat(2, 1) for k, v in batch.items()}, output_attentions=True)
        attn = torch.stack(outputs.attentions[0:2], 1).float()
        attn.retain_grad()
        smallest = min(smallest, attn[attn > 0].min().item())
        loss = micse.ami_loss(*attn.chunk(2), 150, torch.Generator().manual_seed(seed))
        (loss * 2.5e-3 * 65536).backward()
        assert torch.isfinite(attn.grad).all(), seed
    assert smallest < 1e-38  # the subnormal probabilities are there


def test_ami_uses_only_valid_entries_with_padding():
    # The same padding in every sample: each tile keeps 2 layers x 4 queries x 3 keys = 24 of its 32 entries,
    # the reference drops the zeros and scales by (24/32)^2.
    a1, a2 = random_attention(seed=5, padded_keys=[3, 3, 3]), random_attention(seed=6, padded_keys=[3, 3, 3])
    got = micse.ami_loss(a1[:, 0:4], a2[:, 0:4], num_samples=10_000)
    assert got.item() == pytest.approx(reference_ami(a1, a2, 0, 4), rel=1e-9)
    # Padding that differs per sample, with sampling: still finite.
    attn1 = random_attention(seed=3, padded_keys=[4, 2, 3])
    attn2 = random_attention(seed=4, padded_keys=[4, 2, 3])
    loss = micse.ami_loss(attn1[:, 0:4], attn2[:, 0:4], num_samples=16, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(loss)


def test_ami_drops_tiles_with_too_few_entries():
    attn1 = random_attention(seed=7, padded_keys=[4, 1, 4])
    attn2 = random_attention(seed=8, padded_keys=[4, 1, 4])
    # num_samples = 32 = a full tile: sample 1's tiles (8 valid entries) are dropped, the others are used whole,
    # and the scale is the valid share of the kept tiles (1 here), as the released models.py computes it after
    # the drop (the share of all tiles would be (2 * 32 + 8) / (3 * 32))
    got = micse.ami_loss(attn1[:, 0:4], attn2[:, 0:4], num_samples=32)
    assert got.item() == pytest.approx(reference_ami(attn1[[0, 2]], attn2[[0, 2]], 0, 4), rel=1e-9)


def released_ami(attn1, attn2, min_layer, max_layer, num_samples, keys):
    """The released models.py's AMI, loop by loop: tiles per sample, head and layer parity; if no tile has
    `num_samples` valid entries, every tile gives as many as the poorest, else the others are dropped; the scale is
    the valid share of the kept tiles' entries. `keys` (tiles x entries) pick the sample: a tile's valid entries
    with the largest keys (the released code draws them with torch.multinomial instead)."""
    n, _, heads = attn1.shape[:3]
    tiles = []
    for i in range(n):
        for h in range(heads):
            for parity in (0, 1):
                layers = range(min_layer + parity, max_layer, 2)
                tiles.append((np.concatenate([attn1[i, l, h].numpy().ravel() for l in layers]),
                              np.concatenate([attn2[i, l, h].numpy().ravel() for l in layers])))
    valid = [(a > 0) & (b > 0) for a, b in tiles]
    counts = [v.sum() for v in valid]
    if max(counts) < num_samples:
        kept, k = list(range(len(tiles))), min(counts)
    else:
        kept, k = [t for t in range(len(tiles)) if counts[t] >= num_samples], num_samples
    mis = []
    for t in kept:
        entries = sorted(np.flatnonzero(valid[t]), key=lambda e: -keys[t][e])[:k]
        la, lb = np.log(tiles[t][0][entries]), np.log(tiles[t][1][entries])
        la, lb = la - la.mean(), lb - lb.mean()
        # a one-key row attends with probability 1 (log 0) everywhere: no variance, cosine 0 (the released
        # nn.CosineSimilarity's eps)
        rho = la @ lb / max(np.linalg.norm(la) * np.linalg.norm(lb), 1e-12)
        mis.append(-0.5 * math.log(1 - min(rho ** 2, 1 - 1e-6)))
    share = sum(counts[t] for t in kept) / (len(kept) * len(tiles[0][0]))
    return -np.mean(mis) * (share ** 2 + 1e-6)


@pytest.mark.parametrize("num_samples", [20, 200])
def test_ami_samples_and_scales_as_the_released_code(num_samples):
    """Sampling on, with tiles of 2 layers x 6 x 6 = 72 entries and padding that leaves some short of 20: the kept
    tiles, their samples (the same random keys) and the scale of the kept tiles equal the loop; with 200, no tile
    has enough and every tile gives the poorest tile's count."""
    attn1 = random_attention(n=4, length=6, seed=21, padded_keys=[6, 2, 5, 1])
    attn2 = random_attention(n=4, length=6, seed=22, padded_keys=[6, 2, 5, 1])
    keys = torch.rand((4 * 2 * 2, 72), generator=torch.Generator().manual_seed(3)).numpy()
    got = micse.ami_loss(attn1[:, 0:4], attn2[:, 0:4], num_samples, torch.Generator().manual_seed(3))
    assert got.item() == pytest.approx(released_ami(attn1, attn2, 0, 4, num_samples, keys), rel=1e-9)


def padded_wider(attn, width, seed):
    """(N, K, H, n, n) attention as the CUDA graph's padding to `width` gives it: the batch's n x n entries as they
    are, the padded keys 0 (masked), the padded queries' rows not 0 (a padding token attends to the real ones)."""
    n = attn.shape[-1]
    wider = torch.zeros(*attn.shape[:3], width, width, dtype=attn.dtype)
    wider[..., :n, :n] = attn
    junk = torch.rand(*attn.shape[:3], width - n, n, generator=torch.Generator().manual_seed(seed), dtype=attn.dtype)
    wider[..., n:, :n] = junk / junk.sum(-1, keepdim=True)
    return wider


def test_ami_samples_a_uniform_subset_of_the_valid_entries_as_the_papers_randperm_draw():
    """ami_sample's draw (the k valid entries of largest random keys, fixed shapes for a CUDA graph) is the paper's
    draw in distribution: a uniform k-subset of a tile's valid entries, as tile[valid][randperm(count)[:k]] gives.
    3 of a tile's 6 valid entries (of 10), 4,000 draws: each of the 20 subsets within 5 standard deviations of 1/20,
    and no invalid entry ever drawn. Catches keys that favour some entries (invalid ones filled with a key above
    the valid ones', a sort that keeps the lowest keys, a draw with replacement)."""
    tile = torch.tensor([[0.1, 0.0, 0.2, 0.3, 0.0, 0.1, 0.0, 0.2, 0.05, 0.0]])
    valid = (tile > 1e-30).squeeze(0).nonzero().squeeze(1).tolist()
    g, counts, draws = torch.Generator().manual_seed(0), {}, 4000
    for _ in range(draws):
        sample = micse.ami_sample(tile, tile, 3, g)
        chosen = tuple(sorted(sample.index[0][sample.sampled[0]].tolist()))
        assert len(chosen) == 3 and set(chosen) <= set(valid)
        counts[chosen] = counts.get(chosen, 0) + 1
    assert len(counts) == math.comb(len(valid), 3)  # every subset drawn
    p = 1 / math.comb(len(valid), 3)
    spread = 5 * math.sqrt(draws * p * (1 - p))
    assert all(abs(count - draws * p) <= spread for count in counts.values()), counts


def test_ami_of_a_batch_padded_wider_scores_its_sentences_alone_whatever_its_padding_holds():
    """miCSE pads every batch to --max_seq_length (12 here: a CUDA graph's one shape, and eagerly too, so that both draw
    AMI's sample in one layout), the released code to the batch's longest sentence. Given the attention mask, AMI
    scores the positions some sentence fills, for every longest sentence from 1 to 12: with every entry taken, the
    released code's value on the maps cut to the longest sentence; sampled, the same loss and gradient bit for bit
    whatever the padded positions' rows hold (a padding query attends to the real keys). Fails where the objective
    reads its rows from the maps' width instead of the mask (the padded rows count), or the valid share is read from
    the padded width."""
    width = 12
    for longest in range(1, width + 1):
        lengths = [longest] + [min(longest, max(2, n)) for n in (longest - 3, longest // 2)]  # the first the longest
        cut1 = random_attention(length=longest, seed=30 + longest, padded_keys=lengths)
        cut2 = random_attention(length=longest, seed=60 + longest, padded_keys=lengths)
        mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()  # (N, 12), as the tokenizer pads
        values, grads = [], []
        for junk in (1, 5):  # two paddings: the padded queries' rows hold other values
            a1 = padded_wider(cut1, width, junk)[:, 0:4].clone().requires_grad_(True)
            loss = micse.ami_loss(a1, padded_wider(cut2, width, junk + 1)[:, 0:4], 20,
                                  torch.Generator().manual_seed(longest), mask)
            loss.backward()
            values.append(loss)
            grads.append(a1.grad)
        assert torch.equal(values[0], values[1]) and torch.equal(grads[0], grads[1]), longest
        assert float(values[0].detach()) < 0 or longest == 1  # a term that says something (one entry a row: none)
        full1, full2 = (random_attention(length=longest, seed=seed + longest) for seed in (90, 120))
        full_mask = (torch.arange(width) < longest).long().expand(len(full1), -1)
        every = micse.ami_loss(padded_wider(full1, width, 3)[:, 0:4], padded_wider(full2, width, 4)[:, 0:4],
                               10_000, None, full_mask)
        assert longest == 1 or float(every) == pytest.approx(reference_ami(full1, full2, 0, 4), rel=1e-9), longest
        if 1 < longest < width:  # without the mask the padded rows count: another value
            unmasked = micse.ami_loss(padded_wider(cut1, width, 1)[:, 0:4], padded_wider(cut2, width, 2)[:, 0:4], 20,
                                      torch.Generator().manual_seed(longest))
            assert not torch.equal(unmasked, values[0]), longest


def test_identical_views_give_large_finite_mi():
    attn = random_attention(seed=9)
    loss = micse.ami_loss(attn[:, 0:4], attn.clone()[:, 0:4], num_samples=10_000)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(0.5 * math.log(1e-6) * (1 + 1e-6), rel=1e-6)


def test_independent_views_give_mi_near_zero():
    attn1 = random_attention(n=8, heads=4, length=16, seed=10)
    attn2 = random_attention(n=8, heads=4, length=16, seed=11)
    loss = micse.ami_loss(attn1[:, 0:4], attn2[:, 0:4], num_samples=150, generator=torch.Generator().manual_seed(0))
    assert -0.02 < loss.item() <= 0.0


def test_same_generator_seed_same_value():
    attn1, attn2 = random_attention(length=16, seed=12), random_attention(length=16, seed=13)
    values = [micse.ami_loss(attn1[:, 0:4], attn2[:, 0:4], 50, torch.Generator().manual_seed(s)).item() for s in (1, 1, 2)]
    assert values[0] == values[1] and values[0] != values[2]


def test_ami_gradient_reaches_attention():
    attn1 = random_attention(seed=14).requires_grad_(True)
    micse.ami_loss(attn1[:, 0:4], random_attention(seed=15)[:, 0:4], 10_000).backward()
    assert attn1.grad is not None and attn1.grad.abs().sum() > 0


def test_odd_layer_range_is_an_error():
    with pytest.raises(ValueError, match="even"):
        micse.ami_loss(random_attention()[:, 0:3], random_attention()[:, 0:3])


def loop_moco(z1, z2, queue, temp, own=None):
    def cos(a, b):
        return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
    total = 0.0
    for i in range(len(z1)):
        logits = [cos(z1[i], z2[j]) / temp for j in range(len(z2))] + \
            [cos(z1[i], q) / temp for k, q in enumerate(queue) if own is None or not own[i][k]]
        total += -logits[i] + math.log(sum(math.exp(l) for l in logits))
    return total / len(z1)


def test_moco_info_nce_matches_loop_and_empty_queue_is_info_nce():
    g = torch.Generator().manual_seed(0)
    z1, z2, queue = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g), torch.randn(7, 4, generator=g)
    assert micse.moco_info_nce(z1, z2, queue, 0.05).item() == pytest.approx(
        loop_moco(z1.double().numpy(), z2.double().numpy(), queue.double().numpy(), 0.05), rel=1e-5)
    assert torch.equal(micse.moco_info_nce(z1, z2, torch.empty(0, 4), 0.05), simcse.info_nce(z1, z2, 0.05))
    own = torch.rand(5, 7, generator=g) < 0.3  # an anchor's own sentence among the queued keys: left out
    assert own.any() and micse.moco_info_nce(z1, z2, queue, 0.05, own).item() == pytest.approx(
        loop_moco(z1.double().numpy(), z2.double().numpy(), queue.double().numpy(), 0.05, own.tolist()), rel=1e-5)
    assert torch.equal(micse.moco_info_nce(z1, z2, queue, 0.05, torch.zeros(5, 7, dtype=torch.bool)),
                       micse.moco_info_nce(z1, z2, queue, 0.05))


def test_the_queue_never_gives_an_anchor_its_own_sentence(tiny_model, senteval_dir, tmp_path, monkeypatch):
    """24 sentences, batch 8, a queue of 16: from the second epoch on, anchors meet their own earlier keys. The
    mask the loop passes is what the batches' rows say (an independent record: the collated rows, placed in the
    ring's slots in turn): a slot left out where it holds the anchor's own sentence or no key yet."""
    import data
    corpus = tmp_path / "small.txt"
    corpus.write_text("\n".join(f"sentence number {i} of the park" for i in range(24)) + "\n")
    batches, calls = [], []
    collate, loss = data.TokenizedCorpus.collate, micse.moco_info_nce
    monkeypatch.setattr(data.TokenizedCorpus, "collate", lambda self, rows: batches.append(list(rows))
                        or collate(self, rows))
    monkeypatch.setattr(micse, "moco_info_nce", lambda *a: calls.append(a[4].clone()) or loss(*a))
    micse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "o", "--max_steps", 6,
                                           "--eval_steps", 6, "--queue_size", 16, "--no_test_eval")])
    slots = [None] * 16  # the sentence each slot holds
    for step, (rows, left_out) in enumerate(zip(batches, calls)):
        assert left_out.tolist() == [[q is None or row == q for q in slots] for row in rows]
        for i, row in enumerate(rows):
            slots[(8 * step + i) % 16] = row
    assert sum(m[:, :8].sum().item() for m in calls[2:]) > 0  # an own key met


class GrowingQueue:
    """The queue as it was before the ring buffer (and as Eq. 2 reads): the newest `size` keys, the oldest first."""

    def __init__(self, size, dim):
        self.size, self.tensor, self.ids = size, torch.empty(0, dim), torch.empty(0, dtype=torch.long)

    def push(self, keys, ids):
        self.tensor, self.ids = torch.cat([self.tensor, keys])[-self.size:], torch.cat([self.ids, ids])[-self.size:]


def test_the_ring_buffer_trains_what_the_growing_queue_trains_through_the_fill_and_the_wrap_around():
    """Ten pushes of 8 keys into 20 slots (filling, full, wrapping around at an offset, and a push of more keys than
    slots), sentence ids that repeat: at every step the queue holds the growing queue's keys (the oldest at
    `position`), and InfoNCE over it, with the own keys and the empty slots left out, equals the growing queue's loss
    and gradients. The same logits in another order: the log-sum-exp's sum of N + Q terms rounds differently, 2 (N +
    Q) u of the loss at most (u = 6e-8), and so do the gradients, which are its softmax's weights."""
    g = torch.Generator().manual_seed(0)
    ring, growing = micse.EmbeddingQueue(20, 6), GrowingQueue(20, 6)
    for step, n in enumerate([8] * 9 + [25]):
        z1, z2 = (torch.randn(8, 6, generator=g, requires_grad=True) for _ in range(2))
        ids = torch.randint(0, 30, (8,), generator=g)
        losses, grads = [], []
        for queue, left_out in ((ring, (ring.ids == ids[:, None]) | ~ring.filled),
                                (growing, growing.ids == ids[:, None])):
            loss = micse.moco_info_nce(z1, z2, queue.tensor, 0.05, left_out)
            losses.append(loss)
            grads.append(torch.autograd.grad(loss, [z1, z2]))
        bound = 2 * (8 + 20) * 2.0 ** -24
        assert abs(losses[0] - losses[1]) <= bound * abs(losses[1]), step
        for a, b in zip(*grads):
            assert torch.allclose(a, b, rtol=0, atol=bound * b.abs().max()), step
        keys, key_ids = torch.randn(n, 6, generator=g), torch.randint(0, 30, (n,), generator=g)
        storage = ring.tensor.data_ptr()
        ring.push(keys, key_ids)
        growing.push(keys, key_ids)
        assert ring.tensor.data_ptr() == storage  # written in place: a CUDA graph's replay writes the same storage
        order = (torch.arange(20) + int(ring.position)) % 20 if ring.filled.all() else torch.arange(int(ring.filled.sum()))
        assert torch.equal(ring.tensor[order], growing.tensor) and torch.equal(ring.ids[order], growing.ids), step
    assert ring.filled.all() and int(ring.position) == (8 * 9 + 20) % 20


def test_queue_size_zero_is_no_queue_and_a_growing_queues_state_loads():
    """--queue_size 0 (the released variant): no slot, InfoNCE over the batch alone. A last/ of the growing queue
    (its keys, the oldest first) loads into the ring in age order."""
    disabled = micse.EmbeddingQueue(size=0, dim=2)
    disabled.push(torch.ones(3, 2), torch.arange(3))
    assert disabled.tensor.shape == (0, 2) and disabled.filled.shape == (0,)
    ring = micse.EmbeddingQueue(size=5, dim=2)
    ring.load_state_dict({"tensor": torch.arange(8.0).view(4, 2), "ids": torch.tensor([7, 8, 9, 10])})
    assert ring.filled.tolist() == [True] * 4 + [False] and int(ring.position) == 4
    assert ring.ids[:4].tolist() == [7, 8, 9, 10] and torch.equal(ring.tensor[:4], torch.arange(8.0).view(4, 2))
    again = micse.EmbeddingQueue(size=5, dim=2)
    again.load_state_dict(ring.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ring.state_dict().values()))


def test_ema_update_arithmetic():
    target, source = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    before_t, before_s = target.weight.detach().clone(), source.weight.detach().clone()
    micse.ema_update(target, source, 0.9)
    assert torch.allclose(target.weight, 0.9 * before_t + 0.1 * before_s, atol=1e-7, rtol=0)
    assert torch.equal(source.weight, before_s)


def test_few_shot_settings_and_overrides(capsys):
    args = micse.parse_args(["--fraction", "0.01", "--seed", "3"])
    assert (args.batch_size, args.lr, args.epochs, args.ami_lambda, args.eval_steps) == (64, 1e-5, 50, 1e-4, 500)
    assert args.seed == 3 and args.queue_size == 384
    args = micse.parse_args([])
    assert (args.batch_size, args.lr, args.warmup_steps, args.ami_lambda, args.eval_steps) == (50, 3e-5, 250, 2.5e-3, 125)
    assert args.presets["applied"]["warmup_steps"] == 250 and "Section 3.1" in args.presets["source"]
    args = micse.parse_args(["--fraction", "0.01", "--lr", "2e-5", "--epochs", "3"])
    assert (args.lr, args.epochs, args.ami_lambda) == (2e-5, 3, 1e-4)
    assert args.presets["applied"] == {"batch_size": 64, "warmup_steps": 0, "ami_lambda": 1e-4, "eval_steps": 500}
    assert args.presets["overridden"] == {"lr": 2e-5, "epochs": 3}
    assert "fraction 0.01 (the authors' README)" in args.presets["source"]
    args = micse.parse_args(["--fraction", "0.02"])
    assert args.epochs == 50 and "nearest to --fraction 0.02" in args.presets["source"]
    with pytest.raises(plumbing.UsageError, match="--fraction"):
        micse.parse_args(["--fraction", "1.5"])


def test_ami_scores_the_layers_it_is_given():
    """ami_loss takes the stack of the layers it scores (the loop stacks layers min:max), with no layer indices whose
    defaults would assume all 12: a stack of other layers is another value, a copy of the same layers the same."""
    g = torch.Generator().manual_seed(0)
    attn1, attn2 = (torch.softmax(torch.randn(3, 12, 4, 9, 9, generator=g), -1) for _ in range(2))
    kept = micse.ami_loss(attn1[:, 7:11], attn2[:, 7:11], 20, torch.Generator().manual_seed(1))
    copied = micse.ami_loss(attn1[:, 7:11].clone(), attn2[:, 7:11].clone(), 20, torch.Generator().manual_seed(1))
    assert torch.equal(kept, copied) and kept != micse.ami_loss(attn1[:, 6:10], attn2[:, 6:10], 20,
                                                                torch.Generator().manual_seed(1))


def test_momentum_encoder_copy_runs_sdpa_and_the_online_encoder_keeps_its_attentions(tiny_model):
    import copy
    _, backbone = hub.load_pretrained(str(tiny_model), micse.ATTN_IMPLEMENTATION)
    momentum = copy.deepcopy(backbone)
    momentum.set_attn_implementation("sdpa")  # as micse.main does
    assert momentum.config._attn_implementation == "sdpa" and backbone.config._attn_implementation == "eager"
    ids = torch.tensor([[2, 7, 8, 9, 3]])
    assert backbone(input_ids=ids, output_attentions=True).attentions[0] is not None
    backbone.eval(), momentum.eval()
    torch.testing.assert_close(momentum(input_ids=ids).last_hidden_state, backbone(input_ids=ids).last_hidden_state,
                               atol=1e-5, rtol=1e-5)


def test_momentum_copy_of_an_eval_mode_model_is_in_train_mode_with_its_dropout_acting(tiny_model):
    """A model loaded for sentence-transformers (or one a student put in eval mode) is in eval mode: momentum_copy
    returns its copy in train mode, so its keys get miCSE's dropout of 0.3 (two passes differ). Fails where the copy
    keeps its source's mode: every dropout's training flag False, p = 0.3 never acting."""
    _, backbone = hub.load_pretrained(str(tiny_model), micse.ATTN_IMPLEMENTATION)
    momentum = micse.momentum_copy(backbone.eval())
    dropouts = [m for m in momentum.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.training and m.p == 0.3 for m in dropouts) and momentum.training
    assert not backbone.training  # its source's mode stays
    ids = torch.tensor([[2, 7, 8, 9, 3]])
    assert not torch.equal(momentum(input_ids=ids).last_hidden_state, momentum(input_ids=ids).last_hidden_state)


def test_momentum_copy_sets_every_dropout_rate_modernberts_float_attention_rate_too(tmp_path):
    """ModernBERT's attention passes a float rate to its kernel, with no nn.Dropout: momentum_copy sets it beside
    every nn.Dropout's p, so the copy alone gives the momentum encoder miCSE's 0.3 (micse.py's main sets nothing
    after it, st_losses' MiCSELoss calls only it). Fails where the copy sets the nn.Dropout modules alone: the
    attention keeps the checkpoint's 0.0."""
    from families import write_model
    _, backbone = hub.load_pretrained(str(write_model(tmp_path / "modernbert", "modernbert")),
                                      micse.ATTN_IMPLEMENTATION)
    slots = common.dropout_slots(micse.momentum_copy(backbone, 0.3))
    assert "attention_dropout" in {slot for _, slot in slots}
    assert [getattr(module, slot) for module, slot in slots] == [0.3] * len(slots)
    assert {getattr(module, slot) for module, slot in common.dropout_slots(backbone)} == {0.0}  # the source's stay


def test_default_ami_layers():
    assert micse.ami_layers(12) == (7, 11) and micse.ami_layers(12, 0, 4) == (0, 4)
    assert micse.ami_layers(6) == (1, 5)
    assert micse.ami_layers(2) == (0, 2) and micse.ami_layers(3) == (0, 2)
    for first, end in ((1, 4), (4, 2), (10, 14)):
        with pytest.raises(plumbing.UsageError, match="--ami_min_layer/--ami_max_layer"):
            micse.ami_layers(12, first, end)


def test_eager_attention_returns_weights_and_sdpa_does_not(tiny_model):
    tokenizer, backbone = hub.load_pretrained(str(tiny_model), micse.ATTN_IMPLEMENTATION)
    batch = dict(tokenizer(["a man runs", "the dog eats food", "a red car", "sun and moon"], padding=True,
                           return_tensors="pt"))
    outputs = backbone(**common.repeat_views(batch, 2), output_attentions=True)
    assert len(outputs.attentions) == 2 and outputs.attentions[0].shape == (8, 4, 6, 6)
    assert torch.allclose(outputs.attentions[0].sum(-1), torch.ones(8, 4, 6))
    _, sdpa_backbone = hub.load_pretrained(str(tiny_model))
    if sdpa_backbone.config._attn_implementation != "eager":  # transformers 5's default: no weights
        attentions = sdpa_backbone(**batch, output_attentions=True).attentions
        assert not attentions or attentions[0] is None


def test_an_encoder_without_attentions_is_refused_before_any_work_not_a_silent_zero(tiny_model, corpus,
                                                                                      senteval_dir, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setattr(micse, "ATTN_IMPLEMENTATION", "sdpa")  # transformers 5's SDPA returns no weights
    with pytest.raises(plumbing.UsageError, match="miCSE needs attention weights"):
        micse.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_smoke_run(tiny_model, corpus, senteval_dir, tmp_path):
    out = tmp_path / "m"
    proc = run_script("micse.py", *smoke_args(tiny_model, corpus, senteval_dir, out), "--fraction", "0.1",
                      "--seed", "3", "--queue_size", "16")
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["num_train_examples"] == 20 and results["args"]["ami_lambda"] == 5e-4
    assert results["args"]["ami_min_layer"] == 0 and results["args"]["ami_max_layer"] == 2
    assert results["micse_subset"] is None  # --train_file given: subsampled with the seed
    assert in_process_scores(eval_sts, "--model_name_or_path", out / "best", "--senteval_dir", senteval_dir,
                             "--pooler", "cls_before_pooler") == results["test"]


def test_released_subset_offline_names_the_file_and_the_flag(tiny_model, tmp_path, monkeypatch):
    """In this process (offline, an empty cache: conftest.offline_cli); the CLI's own subprocess test: the smoke
    run."""
    code, stderr = offline_cli(micse, monkeypatch, tmp_path / "hf", "--fraction", "0.01", "--seed", "48",
                               "--output_dir", tmp_path / "o", "--model_name_or_path", tiny_model)
    line = stderr.strip().splitlines()
    assert code == 2 and len(line) == 1, stderr
    assert "wiki_subset_1M_001.00percent_seed48.txt" in line[0] and "--train_file" in line[0]


def test_a_local_copy_of_the_authors_subset_is_read_whole_under_its_name(tmp_path):
    """docs/reproducing.md's offline route: --train_file keeping the released name, with the same
    --fraction and --seed, is their subset (not 1% of it); renamed or with another seed, it is subsampled."""
    import argparse
    import data
    name = "wiki_subset_1M_001.00percent_seed48.txt"
    lines = [f"sentence number {i}" for i in range(300)]
    (tmp_path / name).write_text("\n".join(lines) + "\n")
    (tmp_path / "renamed.txt").write_text("\n".join(lines) + "\n")
    args = argparse.Namespace(train_file=str(tmp_path / name), fraction=0.01, seed=48)
    examples, _, subset = data.training_examples(args)
    assert subset == name and examples["text"] == lines
    for train_file, seed in ((tmp_path / "renamed.txt", 48), (tmp_path / name, 3)):
        args = argparse.Namespace(train_file=str(train_file), fraction=0.01, seed=seed)
        examples, _, subset = data.training_examples(args)
        assert subset is None and len(examples) == 3 and set(examples["text"]) < set(lines)


def test_headline_command_offline_names_the_local_path_flags(tmp_path, monkeypatch):
    code, stderr = offline_cli(micse, monkeypatch, tmp_path / "hf", "--fraction", "0.01", "--seed", "3",
                               "--output_dir", tmp_path)
    line = stderr.strip().splitlines()
    assert code == 2 and len(line) == 1, stderr
    assert all(f in line[0] for f in ("--model_name_or_path", "--train_file", "--senteval_dir"))


def test_no_negatives_runs_positive_pairs_alone(tiny_model, corpus, senteval_dir, tmp_path):
    """miCSE Table 4's "w/o negatives" rows: both scripts train on the positive term alone; miCSE refuses a
    queue it would not use."""
    import simcse
    for script, extra in ((simcse, []), (micse, ["--queue_size", "0"])):
        out = tmp_path / script.__name__
        script.main([str(a) for a in smoke_args(tiny_model, corpus, senteval_dir, out, "--max_steps", 2,
                                                "--no_test_eval", "--no_negatives", *extra)])
        losses = json.loads((out / "results.json").read_text())["train_loss"]
        # -cos/temp >= -1/0.05 = -20 (miCSE adds its small AMI term): no negatives, where InfoNCE is >= 0
        assert all(-20.5 <= v < 0 for v in losses), losses
    with pytest.raises(SystemExit):
        micse.parse_args(["--no_negatives"])
