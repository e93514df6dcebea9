"""bench.py: the warm-up steps are not timed, the table prints, a bad --compare_with is one line."""
import types

import pytest
import torch

import bench
import plumbing


def test_timed_steps_exclude_the_warm_up(tiny_model, corpus, senteval_dir, tmp_path):
    args = types.SimpleNamespace(model_name_or_path=str(tiny_model), train_file=str(corpus),
                                 senteval_dir=str(senteval_dir), supervised_file=None, batch_size=8, warmup=2, steps=3,
                                 max_seq_length=16, seed=0, device="cpu")
    results = bench.bench_method("simcse", args, [], tmp_path)
    curve = {row["step"]: row["train_time_s"] for row in results["trajectory"]}
    assert sorted(curve) == [0, 2, 4, 5]  # logs every --warmup steps, dev gates at 0 and 5
    assert results["timed_steps_per_second"] == pytest.approx(3 / (curve[5] - curve[2]))
    assert results["steps"] == 5 and results["args"]["logging_steps"] == 2
    assert results["host_syncs"]["steps"] == [2] and results["host_syncs"]["per_step"] == [0]  # warm-up step 2


def test_compare_with_a_folder_that_is_no_checkout_is_one_line(tmp_path, corpus):
    with pytest.raises(plumbing.UsageError, match="--compare_with .* no simcse.py there"):
        bench.main(["--model_name_or_path", "m", "--train_file", str(corpus), "--compare_with", str(tmp_path)])


def table_rows(out: str, header: str) -> list[list[str]]:
    """The cells of a printed markdown table's rows, the table found by its header's first cell."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("| "):
            break
        rows.append([cell.strip() for cell in line.strip()[1:-1].split("|")])
    return rows


@pytest.fixture(scope="module")
def thousand_sentences(tmp_path_factory):
    """1,000 sentences: miCSE's 1% of them (10) holds a batch of 8."""
    import random
    from conftest import random_sentence
    rng = random.Random(3)
    path = tmp_path_factory.mktemp("corpus") / "sentences.txt"
    path.write_text("\n".join(random_sentence(rng) for _ in range(1000)) + "\n")
    return path


def test_compare_steps_times_each_way_of_the_same_step_on_cpu(tiny_model, thousand_sentences, senteval_dir, capsys):
    """--compare_steps end to end on CPU: simcse.py's step and the bare eager step are timed; the suite's graph path
    and the bare graph say they need CUDA, sentence-transformers' trainer runs where it is
    installed (with accelerate) and says it is not otherwise; the table's examples/s and ratios are its steps/s'."""
    import importlib.util
    rows = ["suite", "suite-graph", "bare", "bare-graph", "sentence-transformers", "contrastive-trainer"]
    found = bench.main(["--compare_steps", "--model_name_or_path", str(tiny_model), "--train_file",
                        str(thousand_sentences), "--senteval_dir", str(senteval_dir), "--device", "cpu",
                        "--batch_size", "8", "--max_seq_length", "16", "--steps", "2", "--warmup", "1", "--rows", *rows])
    assert list(found) == rows and found["suite"] > 0 and found["bare"] > 0
    assert found["suite-graph"].startswith("needs CUDA") and found["bare-graph"].startswith("needs CUDA")
    if all(importlib.util.find_spec(name) for name in ("sentence_transformers", "accelerate")):
        assert found["sentence-transformers"] > 0 and found["contrastive-trainer"] > 0
    else:
        assert found["sentence-transformers"].startswith("not installed here: ")
    table = table_rows(capsys.readouterr().out, "the same SimCSE step")
    assert [row[0] for row in table] == [bench.COMPARE_ROWS[r] for r in rows]
    for row, name in zip(table, rows):
        rate = found[name]
        if isinstance(rate, str):
            assert row[1:] == [rate, "", "", ""]
        else:  # steps/s, examples/s at batch 8, no MFU on a CPU, simcse.py's steps/s over this row's
            assert row[1:] == [f"{rate:.2f}", f"{8 * rate:.0f}", "", f"{found['suite'] / rate:.2f}"]


def test_recipe_minutes_from_a_measured_fraction_on_cpu(tiny_model, thousand_sentences, senteval_dir, tmp_path,
                                                        capsys):
    """--recipe_minutes end to end on CPU, two of the six rows (the NLI file; miCSE's 1%) at batch 8: each whole
    recipe's steps and dev gates at that batch, and its minutes from the measured step, gate and final evaluation.
    A row that fails (SSCL's default --neg_layers 2 on a 2-layer encoder) is its one line, and the next row runs."""
    from conftest import write_nli
    found = bench.main(["--recipe_minutes", "--model_name_or_path", str(tiny_model), "--train_file",
                        str(thousand_sentences), "--supervised_file", str(write_nli(tmp_path / "nli.csv", 24)),
                        "--senteval_dir", str(senteval_dir), "--device", "cpu", "--recipes", "simcse-sup", "sscl",
                        "micse-fewshot", "--recipe_steps", "2", "--gate_every", "1", "--method_args",
                        "simcse:--batch_size=8", "micse:--batch_size=8"])
    # 3 epochs of the 275,601 NLI triplets (a last batch of 1 is skipped), a gate every 250 steps, step 0 and the last;
    # 50 epochs of 1% of wiki1m (10,000 sentences), a gate every 500
    assert found.pop("sscl").startswith("failed: UsageError: sscl.py: --neg_layers must be in 0..1")
    assert [(r["batch"], r["steps"], r["gates"]) for r in found.values()] == [(8, 3 * 34_450, 415), (8, 62_500, 126)]
    for row in found.values():
        assert row["step_s"] > 0 and row["gate_s"] > 0 and row["final_s"] > 0 and row["precision"] == "fp32"
        minutes = row["minutes"]
        assert minutes["gates"] == pytest.approx(row["gates"] * row["gate_s"] / 60)
        assert minutes["final evaluation"] == pytest.approx(row["final_s"] / 60)
        assert minutes["steps"] >= (row["steps"] - 1) * row["step_s"] / 60  # the first step as run, the rest
    table = table_rows(capsys.readouterr().out, "recipe")
    assert [(row[0], row[2], row[3]) for row in table] == [("simcse-sup", "103,350", "415"), ("sscl", "", ""),
                                                           ("micse-fewshot", "62,500", "126")]
    assert table[1][1].startswith("failed: UsageError")


def test_the_six_recipes_are_the_papers_schedules(tiny_model):
    """What the recipe minutes multiply: each row's batch, steps and dev-gate interval from its method's presets on
    the papers' data (wiki1m's 10^6 sentences at 64; NLI's 275,601 triplets at 512 for 3 epochs; miCSE's 1%, 10,000
    sentences, 157 batches for 50 epochs)."""
    import memory
    schedules = {name: bench.recipe_schedule(*memory.RECIPES[name], str(tiny_model), []) for name in bench.RECIPE_NAMES}
    assert schedules == {"simcse": (64, 15_625, 125), "simcse-sup": (512, 3 * 539, 250), "simcsepp": (64, 15_625, 125),
                         "sscl": (64, 15_625, 125), "whitenedcse": (64, 15_625, 125), "micse-fewshot": (64, 7_850, 500)}


def test_mfu_has_a_peak_only_where_the_datasheet_gives_one(monkeypatch):
    cuda = torch.device("cuda")
    for name, precision, peak in (("NVIDIA H100 80GB HBM3", "bf16", 989.4e12), ("NVIDIA H100 PCIe", "fp16", 756e12),
                                  ("NVIDIA H200", "bf16", 989.4e12), ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
                                  ("NVIDIA H200 NVL", "bf16", None), ("NVIDIA L4", "bf16", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        assert bench.peak_flops(cuda, precision) == peak, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    # TF32 is torch's setting, served by the module's __getattr__: set through its setter and restored the same way
    # (monkeypatch's undo deletes the attribute, which pytest >= 9.2 does and the module refuses)
    matmul, was = torch.backends.cuda.matmul, torch.backends.cuda.matmul.allow_tf32
    try:
        matmul.allow_tf32 = False  # fp32 matmuls in fp32: no tensor cores
        assert bench.peak_flops(cuda, "fp32") is None and bench.peak_flops(torch.device("cpu"), "bf16") is None
        matmul.allow_tf32 = True
        assert bench.peak_flops(cuda, "fp32") == 156e12  # TF32
    finally:
        matmul.allow_tf32 = was
    assert torch.backends.cuda.matmul.allow_tf32 == was


def test_gpu_check_fits_the_device_budget():
    """tools/gpu_check.sh runs where a GPU is lent for 15 minutes of device time, one call at most 10 minutes, the
    machine's start (about a minute) included: its default stages fit one call, and with its planned second call
    (recipes_large) the session. The script parses (bash -n); an unknown stage is refused before any work."""
    import os
    import subprocess
    from conftest import ROOT
    script = str(ROOT / "tools" / "gpu_check.sh")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_S")}  # the limits' overrides

    def plan(*stages):
        out = subprocess.run(["bash", script, "--plan", *stages], capture_output=True, text=True, check=True,
                             env=env).stdout
        return dict((line.split()[0], int(line.split()[1])) for line in out.splitlines())
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    first, second = plan(), plan("recipes_large")
    assert list(first) == ["machine", "graph", "recipes_graph", "families", "gate", "total"]
    assert first["total"] == sum(v for k, v in first.items() if k != "total") <= 600 - 60
    assert 60 + first["total"] + second["total"] <= 15 * 60 - 60
    refused = subprocess.run(["bash", script, "--plan", "compare", "no_such_stage"], capture_output=True, text=True)
    assert refused.returncode == 2 and "no stage no_such_stage" in refused.stderr


def test_the_two_modes_refuse_a_bad_setting_in_one_line_before_any_run(tmp_path, corpus):
    with pytest.raises(plumbing.UsageError, match="--size bert-base takes the tokenizer of --model_name_or_path"):
        bench.main(["--compare_steps", "--size", "bert-base", "--model_name_or_path", str(tmp_path / "none"),
                    "--train_file", str(corpus), "--device", "cpu"])
    with pytest.raises(plumbing.UsageError, match="--recipe_steps .*more than --gate_every 5"):
        bench.main(["--recipe_minutes", "--model_name_or_path", "m", "--train_file", str(corpus), "--recipe_steps",
                    "5", "--gate_every", "5"])
    with pytest.raises(plumbing.UsageError, match="--warmup"):
        bench.main(["--compare_steps", "--model_name_or_path", "m", "--train_file", str(corpus), "--warmup", "0"])


def test_a_row_that_fails_or_exits_is_its_one_line_and_a_signal_still_ends_the_tool():
    """--compare_steps and --recipe_minutes measure row after row on a GPU lent for minutes: a row's error or its
    script's own exit (refused arguments, status 2) is that row's line; Ctrl-C's or SIGTERM's exit ends the tool; the
    out-of-memory hook a row's run registered is gone after it."""
    import plumbing

    def refused():
        plumbing.on_out_of_memory(lambda reason: "kept")
        raise SystemExit(2)

    def stopped():
        raise SystemExit(143)
    assert bench.one_row(refused) == "failed: the script exited with status 2"
    assert plumbing._keep_after_out_of_memory is None
    assert bench.one_row(lambda: 1 / 0).startswith("failed: ZeroDivisionError: division by zero")
    with pytest.raises(SystemExit):
        bench.one_row(stopped)


def test_the_gate_is_timed_against_a_bare_forward_of_its_batches(tiny_model, senteval_dir, capsys):
    """--gate_floor: the dev gate as a run runs it and its floor, the same model's forward over the same tokenised
    batches, in eval mode as the gate encodes (the gate leaves the model in training mode: a floor with dropout on
    would be slower than the gate it bounds)."""
    import transformers
    modes = []
    forward = transformers.BertModel.forward
    transformers.BertModel.forward = lambda self, *a, **k: modes.append(self.training) or forward(self, *a, **k)
    try:
        times = bench.main(["--gate_floor", "--model_name_or_path", str(tiny_model), "--senteval_dir",
                            str(senteval_dir), "--device", "cpu", "--steps", "1"])
    finally:
        transformers.BertModel.forward = forward
    assert set(times) == {"gate", "floor"} and all(t > 0 for t in times.values())
    assert "| gate / floor |" in capsys.readouterr().out
    assert modes and not any(modes)  # every forward, the gate's and the floor's, in eval mode
