"""plumbing/hub.py: the hub's senteval.tar unpacked once, checkpoints loaded in fp32 whatever their dtype, a
folder that is not a model. (The one-line errors are tested with each script in test_reliability.py; the progress
display in test_progress.py.)"""
import numpy as np
import pytest

import eval_sts
import plumbing
from plumbing import hub


def test_senteval_tar_is_unpacked_once_and_found(tmp_path, senteval_dir, monkeypatch):
    """The default path: senteval.tar from the hub (mocked here) unpacked next to it, STS/ found inside."""
    import tarfile
    tar_path = tmp_path / "cache" / "senteval.tar"
    tar_path.parent.mkdir()
    with tarfile.open(tar_path, "w") as tar:
        tar.add(senteval_dir, arcname="downstream")
    requested = []
    monkeypatch.setattr(hub, "hub_file", lambda repo, name, flag, local, offline:
                        requested.append((repo, name, flag, local)) or str(tar_path))
    root = eval_sts.resolve_senteval_dir(None)
    assert root == tmp_path / "cache" / "senteval_unpacked" / "downstream"
    assert requested == [("princeton-nlp/datasets-for-simcse", "senteval.tar", "--senteval_dir", "folder")]
    assert eval_sts.load_pairs(root, "STS13") == eval_sts.load_pairs(senteval_dir, "STS13")
    tar_path.write_bytes(b"")  # a second call reuses the unpacked copy
    assert eval_sts.resolve_senteval_dir(None) == root
    # a user-given parent folder works too
    assert eval_sts.resolve_senteval_dir(str(tmp_path / "cache")) == root


def test_half_precision_checkpoint_loads_in_fp32(tiny_model, tmp_path):
    """transformers 5 keeps a checkpoint's dtype: a bf16 checkpoint must still evaluate and train in fp32."""
    import shutil
    import torch
    from transformers import AutoModel
    bf16 = tmp_path / "bf16"
    shutil.copytree(tiny_model, bf16)
    AutoModel.from_pretrained(tiny_model).to(torch.bfloat16).save_pretrained(bf16)
    assert next(AutoModel.from_pretrained(bf16).parameters()).dtype == torch.bfloat16  # the library's default
    _, backbone = hub.load_pretrained(str(bf16))
    assert {p.dtype for p in backbone.parameters()} == {torch.float32}
    embeddings = eval_sts.load_encode(str(bf16), "avg", torch.device("cpu"))(["a b c", "d e"])
    assert embeddings.dtype == np.float32



def test_a_folder_that_is_not_a_model_is_named_as_such(tmp_path):
    """A folder without config.json (a run's output folder, say) is one line saying so, not the tokenizer's
    'Couldn't instantiate the backend tokenizer from one of: )'."""
    (tmp_path / "runs").mkdir()
    with pytest.raises(plumbing.UsageError, match=r"--model_name_or_path .*runs is a folder but not a model \(it has no "
                                                  r"config.json\)"):
        hub.load_pretrained(str(tmp_path / "runs"))


def test_provenance_knows_a_checkout_its_changes_and_a_folder_that_is_not_one(tmp_path):
    """The suite's own checkout only (a copy inside another repository is not one); its changes are the code's,
    tracked or not, and not what the suite writes itself (results/, runs.csv)."""
    import subprocess
    from plumbing import provenance
    assert provenance.git_state(tmp_path) == "not a git checkout"
    git = ["git", "-C", str(tmp_path), "-c", "user.email=a@b", "-c", "user.name=a"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "results").mkdir()
    for name in ("f.py", "results/runs.csv"):
        (tmp_path / name).write_text("one")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    state = provenance.git_state(tmp_path)
    assert len(state["commit"]) == 40 and state["uncommitted_changes"] is False
    (tmp_path / "results" / "runs.csv").write_text("two")  # report.py write
    assert provenance.git_state(tmp_path)["uncommitted_changes"] is False
    (tmp_path / "mine.py").write_text("x = 1")  # untracked code
    state = provenance.git_state(tmp_path)
    assert state["uncommitted_changes"] is True and state["changed_code"] == ["mine.py"]
    (tmp_path / "mine.py").unlink()
    (tmp_path / "f.py").write_text("two")
    assert provenance.git_state(tmp_path)["changed_code"] == ["f.py"]
    (tmp_path / "suite").mkdir()  # a copy of the suite inside this repository: its commit says nothing of the suite
    (tmp_path / "suite" / "common.py").write_text("")
    assert provenance.git_state(tmp_path / "suite") == "not a git checkout"


def test_every_papers_bibtex_is_in_the_docs_and_the_suite_has_a_citation_file():
    from conftest import ROOT
    from plumbing import provenance
    methods = (ROOT / "docs" / "methods.md").read_text()
    for method, (title, bibtex) in provenance.PAPERS.items():
        assert bibtex in methods, method
    cff = (ROOT / "CITATION.cff").read_text()
    assert cff.startswith("cff-version: 1.2.0") and "title:" in cff and "message:" in cff


def test_cli_freezes_what_is_left_at_the_process_end_only():
    """plumbing.cli freezes the objects left when the process ends (atexit: the interpreter's last collections then
    skip them, 1.5-3 s after a run's last line with torch loaded), not when main() returns: a process that runs
    several mains (tests/test_distributed.py's driver) keeps its collections between them. Fails without the freeze,
    and with a freeze at main()'s return (the one that hung that driver's launch)."""
    import subprocess
    import sys
    from conftest import ROOT
    probe = ("import atexit, gc, plumbing\n"
             "atexit.register(lambda: print('at exit', gc.get_freeze_count() > 0))  # runs after cli's (LIFO)\n"
             "plumbing.cli(lambda: None)\n"
             "plumbing.cli(lambda: None)\n"
             "print('between mains', gc.get_freeze_count() > 0)\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["between mains False", "at exit True"], out
