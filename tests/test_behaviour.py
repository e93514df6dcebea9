"""The numbers a refactoring must not change: for a fixed seed, 4 steps on the tiny test model, each script's training
losses, gradient norms and STS-B dev scores, against tests/behaviour.json.

Recorded with `SUITE_RECORD_BEHAVIOUR=1 python -m pytest -q tests/test_behaviour.py` (only when a change means to
move the numbers, and said in its commit). On the machine that recorded them (its CPU, ISA level and torch version
are in the file) they must match bit for bit; elsewhere another CPU's kernels may round differently, so the losses
to 1e-4 and the dev scores to 0.02.
"""
import importlib
import json
import os
import platform
import sys

import pytest
import torch

from conftest import ROOT, smoke_args, write_nli

sys.path.insert(0, str(ROOT / "ablations"))
FILE = ROOT / "tests" / "behaviour.json"
CASES = {  # name: (script, flags)
    "simcse": ("simcse", []), "simcse-supervised": ("simcse", ["--supervised"]),
    "simcse-mlm": ("simcse", ["--do_mlm"]), "simcsepp": ("simcsepp", []), "sscl": ("sscl", ["--neg_layers", "1"]),
    "whitenedcse": ("whitenedcse", ["--num_groups", "16"]), "micse": ("micse", ["--queue_size", "16"]),
    "augmentations": ("simcse_augmentations", ["--positive", "word_deletion", "--rate", "0.2"]),
    "noise-barlow": ("simcsepp_noise_barlow", ["--barlow", "--barlow_padding", "10"]),
    "whitening": ("whitenedcse_whitening", ["--whitening", "zca"]),
}


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return {"cpu": cpu, "isa": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}


def numbers(name, tiny_model, corpus, senteval_dir, tmp_path) -> dict:
    script, flags = CASES[name]
    data = write_nli(tmp_path / "nli.csv") if "--supervised" in flags else corpus
    out = tmp_path / name
    importlib.import_module(script).main([str(a) for a in smoke_args(
        tiny_model, data, senteval_dir, out, "--no_test_eval", "--lr", "1e-3", *flags)])
    results = json.loads((out / "results.json").read_text())
    return {"train_loss": results["train_loss"], "grad_norm": results["grad_norm"],
            "stsb_dev": [row["stsb_dev"] for row in results["trajectory"] if row.get("gate")]}


@pytest.fixture(scope="module")
def recorded():
    if os.environ.get("SUITE_RECORD_BEHAVIOUR"):
        FILE.write_text(json.dumps({"machine": machine(), "cases": {}}, indent=1))
    return json.loads(FILE.read_text())


@pytest.mark.parametrize("name", list(CASES))
def test_a_scripts_numbers_are_the_recorded_ones(name, recorded, tiny_model, corpus, senteval_dir, tmp_path):
    got = numbers(name, tiny_model, corpus, senteval_dir, tmp_path)
    if os.environ.get("SUITE_RECORD_BEHAVIOUR"):
        recorded["cases"][name] = got
        FILE.write_text(json.dumps(recorded, indent=1) + "\n")
        return
    want = recorded["cases"][name]
    if recorded["machine"] == machine():
        assert got == want  # floats compared exactly
    else:
        for key in ("train_loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
        assert got["stsb_dev"] == pytest.approx(want["stsb_dev"], abs=0.02)  # Spearman x 100, two decimals
