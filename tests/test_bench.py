"""bench.py: the warm-up steps are not timed, the table prints, a bad --compare_with is one line."""
import types

import pytest

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
