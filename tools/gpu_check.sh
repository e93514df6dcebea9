#!/usr/bin/env bash
# Does this GPU set-up work, and how fast is it? On a CUDA machine, from the suite's folder:
#
#     tools/gpu_check.sh --prepare ../shared   # once, anywhere: .gpu_data/ with the data and a WordPiece tokenizer
#     tools/gpu_check.sh [OUT]                 # on the GPU: every figure and log under OUT (default runs/gpu_check)
#
# It runs tests/test_cuda.py; builds a BERT-base-sized encoder with random weights (BertConfig(), no download);
# times each method on it with tools/bench.py (batch 64 x 32 tokens, bf16: --precision auto on a GPU with bf16);
# measures --gradient_checkpointing and --micro_batch_size on supervised SimCSE's batch of 512 against the memory
# estimate; times the saves; and times --compile. Each stage has its own time limit and writes its file as it goes.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--prepare" ]; then
    shared=${2:?give the folder that holds data/ and models/}
    mkdir -p .gpu_data/senteval .gpu_data/tokenizer
    cp -r "$shared/data/senteval/STS" "$shared/data/senteval/SICK" .gpu_data/senteval/
    cp "$shared/data/wiki1m_head.txt" "$shared/data/nli_snli_devtest.csv" .gpu_data/
    for f in vocab.txt tokenizer.json tokenizer_config.json special_tokens_map.json; do
        cp "$shared/models/all-MiniLM-L6-v2/$f" .gpu_data/tokenizer/
    done
    grep -qx '/.gpu_data/' .git/info/exclude 2>/dev/null || echo /.gpu_data/ >> .git/info/exclude
    echo "prepared .gpu_data/ ($(du -sh .gpu_data | cut -f1)); carry it (and .whl/ where datasets is missing)"
    exit 0
fi
OUT=${1:-${OUT:-runs/gpu_check}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ] && ! python3 -c "import datasets" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
DATA=.gpu_data MODEL=.gpu_data/bert-base-random
say() { echo "== $* ($(date +%T))" | tee -a "$OUT/log.txt"; }

say "the machine"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory // 2**20, 'MiB')"
} > "$OUT/gpu.txt" 2>&1

say "a BERT-base-sized encoder with random weights"
python3 - <<'EOF' >> "$OUT/log.txt" 2>&1
import torch, transformers
torch.manual_seed(0)
tokenizer = transformers.AutoTokenizer.from_pretrained(".gpu_data/tokenizer")
transformers.BertModel(transformers.BertConfig()).save_pretrained(".gpu_data/bert-base-random")
tokenizer.save_pretrained(".gpu_data/bert-base-random")
EOF

say "tests/test_cuda.py"
timeout "${CUDA_TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py \
    > "$OUT/test_cuda.txt" 2>&1
echo "exit $?" >> "$OUT/test_cuda.txt"

say "each method, BERT-base-sized, batch 64 x 32, --precision auto"
timeout "${BENCH_S:-170}" python3 tools/bench.py --device cuda --model_name_or_path $MODEL \
    --train_file $DATA/wiki1m_head.txt --senteval_dir $DATA/senteval --supervised_file $DATA/nli_snli_devtest.csv \
    --methods simcse simcsepp sscl whitenedcse micse --batch_size 64 --max_seq_length 32 --steps 40 --warmup 5 \
    --skip_eval > "$OUT/bench.txt" 2>&1
echo "exit $?" >> "$OUT/bench.txt"

say "the memory flags on supervised SimCSE's batch of 512, bf16, against the estimate"
timeout "${FLAGS_S:-60}" python3 - <<'EOF' > "$OUT/flags.txt" 2>&1
import sys, time, types
sys.path.insert(0, ".")
import torch, transformers
from plumbing import memory
config = transformers.BertConfig()
for name, extra in (("neither", {}), ("--gradient_checkpointing", {"gradient_checkpointing": True}),
                    ("--micro_batch_size 128", {"micro_batch_size": 128}),
                    ("both", {"gradient_checkpointing": True, "micro_batch_size": 128})):
    args = types.SimpleNamespace(method="simcse", supervised=True, batch_size=512, max_seq_length=32,
                                 precision="bf16", pooler="cls", dropout=None, **extra)
    estimate = memory.estimate(args, config, evaluations=False)
    with torch.device("cuda"):
        run = memory.recipe(args, config)
    memory.autocast_of = lambda precision: torch.autocast("cuda", dtype=torch.bfloat16)  # CUDA's own
    run.step(); torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(5):
        run.step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / 5
    measured = torch.cuda.max_memory_allocated() + run.copies
    print(f"{name}: step {seconds * 1e3:.1f} ms, peak allocated {measured / 2**30:.2f} GiB (reserved "
          f"{torch.cuda.max_memory_reserved() / 2**30:.2f}), estimated {estimate['step'] / 2**30:.2f} GiB", flush=True)
    del run
    torch.cuda.empty_cache()
EOF

say "saving best/ and last/"
timeout "${SAVES_S:-60}" python3 tools/bench.py --save_cost --device cuda > "$OUT/saves.txt" 2>&1

say "--compile (inductor) against eager, SimCSE"
timeout "${COMPILE_S:-150}" python3 tools/bench.py --device cuda --model_name_or_path $MODEL \
    --train_file $DATA/wiki1m_head.txt --senteval_dir $DATA/senteval --methods simcse --batch_size 64 \
    --max_seq_length 32 --steps 40 --warmup 10 --skip_eval --method_args simcse:--compile > "$OUT/compile.txt" 2>&1
echo "exit $?" >> "$OUT/compile.txt"
say "done"
