"""best/: the best checkpoint of a run, and the copy of it that the run keeps until best/ is written.

A dev gate that improves the score copies the model into `BestCopy`, on the training device (on a GPU at memory
speed: well under a millisecond for BERT-base, where writing best/ takes a second); `Run.flush_best` writes best/
from it when last/ is saved, when the run stops, and at the end. Its buffers are allocated at the first improvement
and copied into afterwards, so it costs one copy of the weights however often the score improves: 0.44 GB for
BERT-base, 1.3 GB for BERT-large, in the device's memory beside the training state. A kill between the two renames
of best/'s swap leaves the previous best/ in best.old/, which the next run in the folder puts back (`recover`).
"""
from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import torch

import common
from plumbing import distributed, files


class BestCopy:
    """A model to write to best/ later: its weights copied on their device, the training model left as it is."""

    def __init__(self, backbone, head, tokenizer, eval_pooler: str, projection=None):
        self.backbone, self.tokenizer, self.eval_pooler = backbone, tokenizer, eval_pooler
        self.state = {k: torch.empty_like(v) for k, v in backbone.state_dict().items()}
        self.head = copy.deepcopy(head) if head is not None else None
        self.projection = copy.deepcopy(projection) if projection is not None else None
        self.update(backbone, head, projection)

    @torch.no_grad()
    def update(self, backbone, head, projection=None) -> None:
        """The model as it is now, copied into the buffers allocated once (no second copy at any moment)."""
        for name, value in backbone.state_dict().items():
            self.state[name].copy_(value)
        for mine, theirs in ((self.head, head), (self.projection, projection)):
            if mine is not None:
                for kept, value in zip(mine.state_dict().values(), theirs.state_dict().values()):
                    kept.copy_(value)

    def write(self, out_dir, card: str | None = None) -> None:
        save(out_dir, self.backbone, self.head, self.tokenizer, self.eval_pooler, self.projection,
             state=self.state, barrier=False, card=card)


def recover(out_dir) -> None:
    """best.old/ put back as best/ where a kill came between the two renames of best/'s swap (files.swap_in): it is the
    best/ of the last complete save, the one last/'s record names (best/ is written just before last/), which a
    resumed run that finds no better model evaluates at its end. Process 0, under the folder's lock."""
    best, old = Path(out_dir) / "best", Path(out_dir) / "best.old"
    if old.is_dir() and not best.exists():
        old.rename(best)
        distributed.log(f"{old} put back as {best} (a kill came while best/ was replaced)")


def save(out_dir, backbone, head, tokenizer, eval_pooler: str, projection=None, state=None,
         barrier: bool = True, card: str | None = None) -> None:
    """<out_dir>/best (process 0): save_pretrained + tokenizer + sentence-transformers metadata, written beside it and
    swapped in only when complete; a write that fails (a full disk) is one line and leaves the previous best/ as it
    was. Evaluated with the "cls" pooler, the MLP head is saved beside it (files.HEAD_FILE, which `eval_sts.py
    --pooler cls` applies to the last [CLS] on any backbone) and, where the backbone has BERT's pooler, into its
    weights too (as SimCSE's simcse_to_huggingface.py does). A projection (nn.Linear after the pooler) is saved
    beside it, and eval_sts.load_encode applies it. The evaluation pooler is recorded (files.EVAL_POOLER_FILE), so
    that eval_sts.py evaluates the checkpoint as the run did."""
    if distributed.rank() == 0:
        target, tmp = Path(out_dir) / "best", Path(out_dir) / "best.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        state = dict(state if state is not None else backbone.state_dict())  # the model itself stays untouched
        if isinstance(head, common.MLPHead) and "pooler.dense.weight" in state:
            state.update({"pooler.dense.weight": head[0].weight, "pooler.dense.bias": head[0].bias})
        with files.failed_write(target, tmp, "the previous best/ is as it was"):
            backbone.save_pretrained(tmp, state_dict=state)
            tokenizer.save_pretrained(tmp)
            files.write_json(tmp / files.EVAL_POOLER_FILE, {"pooler": eval_pooler})  # eval_sts's default
            if card is not None:  # README.md, what the Hub and sentence-transformers show
                files.write_text(tmp / "README.md", card)
            if eval_pooler == "cls" and isinstance(head, common.MLPHead):
                files.save_linear(tmp, files.HEAD_FILE, head[0])
            if projection is not None:
                files.save_linear(tmp, files.PROJECTION_FILE, projection)
            else:  # sentence-transformers' modules do not hold the projection
                files.write_sentence_transformers_config(tmp, eval_pooler, backbone.config.hidden_size,
                                                         head if eval_pooler == "cls" else None)
        umask = os.umask(0)
        os.umask(umask)
        for path in tmp.rglob("*"):  # save_pretrained writes the weights through a 0600 temporary file
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
        files.swap_in(tmp, target)  # a kill leaves the previous best whole (best.old at worst)
    if barrier:
        distributed.barrier()
