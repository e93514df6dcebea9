#!/usr/bin/env bash
# Does this GPU set-up work, and how fast is it? On a CUDA machine, from the suite's folder:
#
#     tools/gpu_check.sh --prepare ../shared   # once, anywhere: .gpu_data/ with the data and a WordPiece tokenizer
#     tools/gpu_check.sh [OUT [STAGE ...]]     # on the GPU: every figure and log under OUT (default runs/gpu_check)
#     tools/gpu_check.sh --plan [STAGE ...]    # the stages and their time limits, without running anything
#
# The budget (docs/gpu.md): 15 minutes of device time a session, the machine's start (about a minute) included, and
# one call at most 10 minutes. Each stage has its own time limit in seconds (LIMIT below; an environment variable,
# e.g. GRAPH_S=200, changes it) and writes its file under OUT as it goes, so a stage cut short keeps what it had.
# With no STAGE the default stages run: one call of 535 s of limits, the CUDA graph of every method. Then, on the
# same warm machine, the second call `tools/gpu_check.sh OUT recipes_large` (300 s) if the session has the time.
# The other stages were measured once (docs/gpu.md) and run by name where a change needs them again.
#
# The stages, what each runs and the file it writes under OUT: docs/gpu.md#the-stages.
set -uo pipefail
cd "$(dirname "$0")/.."
declare -A LIMIT=([machine]=15 [compare]=170 [recipes_base]=200 [flags]=45 [recipes_large]=240 [test_cuda]=240
                  [bench]=170 [saves]=60 [graph]=180 [recipes_graph]=240 [families]=60 [gate]=40
                  [recipes_micse]=130 [runs_per_gpu]=260 [traces]=45 [fewshot]=120 [graph_compile]=150
                  [st_trainer]=90)
DEFAULT="machine graph recipes_graph families gate"
ORDER="machine graph recipes_graph families gate compare recipes_base flags recipes_large test_cuda bench saves
       recipes_micse runs_per_gpu traces fewshot graph_compile st_trainer"
for stage in $ORDER; do  # COMPARE_S=200 and the like
    override="${stage^^}_S"
    LIMIT[$stage]=${!override:-${LIMIT[$stage]}}
done

if [ "${1:-}" = "--prepare" ]; then
    shared=${2:?give the folder that holds data/ and models/}
    mkdir -p .gpu_data/senteval .gpu_data/tokenizer
    cp -r "$shared/data/senteval/STS" "$shared/data/senteval/SICK" .gpu_data/senteval/
    cp "$shared/data/wiki1m_head.txt" "$shared/data/nli_snli_devtest.csv" .gpu_data/
    for f in vocab.txt tokenizer.json tokenizer_config.json special_tokens_map.json; do
        cp "$shared/models/all-MiniLM-L6-v2/$f" .gpu_data/tokenizer/
    done
    exclude=$(git rev-parse --git-path info/exclude)  # a worktree's too
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.gpu_data/' "$exclude" 2>/dev/null || echo /.gpu_data/ >> "$exclude"
    # the comparison's sentence-transformers row: its trainer needs accelerate (and psutil); a GPU machine without
    # them installs these wheels below, and without them the row says so in one line
    mkdir -p .whl
    # datasets and the two dependencies the GPU machine lacks (../shared/gpu/wheels), else from the registry
    cp "$shared"/gpu/wheels/*.whl .whl/ 2>/dev/null \
        || python3 -m pip download -q --no-deps -d .whl datasets dill multiprocess \
        || echo "no wheels for datasets: the runs need it on the GPU machine"
    python3 -m pip download -q --no-deps -d .whl sentence-transformers accelerate psutil \
        || echo "no wheels for sentence-transformers/accelerate (no registry here?): that row will say it is missing"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
    echo "prepared .gpu_data/ ($(du -sh .gpu_data | cut -f1)) and .whl/ ($(du -sh .whl | cut -f1)); carry both"
    exit 0
fi
if [ "${1:-}" = "--plan" ]; then
    shift
    total=0
    for stage in ${*:-$DEFAULT}; do
        [ -n "${LIMIT[$stage]:-}" ] || { echo "no stage $stage; the stages: $ORDER" >&2; exit 2; }
        echo "$stage ${LIMIT[$stage]}"
        total=$((total + LIMIT[$stage]))
    done
    echo "total $total"
    exit 0
fi

OUT=${1:-${OUT:-runs/gpu_check}}
shift || true
STAGES=${*:-$DEFAULT}
for stage in $STAGES; do
    [ -n "${LIMIT[$stage]:-}" ] || { echo "no stage $stage; the stages: $ORDER" >&2; exit 2; }
done
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then  # what this machine lacks of the wheels carried in .whl/ (datasets needs all of them)
    wheels=""
    if ! python3 -c "import datasets" 2>/dev/null; then
        wheels=".whl/*.whl"
    else
        for pair in sentence_transformers:sentence_transformers accelerate:accelerate psutil:psutil; do
            python3 -c "import ${pair%%:*}" 2>/dev/null || wheels="$wheels $(ls .whl/${pair#*:}-*.whl 2>/dev/null)"
        done
    fi
    if [ -n "${wheels// /}" ]; then
        # shellcheck disable=SC2086
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $wheels
        export PYTHONPATH=/tmp/site
    fi
fi
DATA=.gpu_data
RUNS="--train_file $DATA/wiki1m_head.txt --senteval_dir $DATA/senteval --device cuda"
# the same SimCSE step timed each way of --rows (compare, graph_compile, st_trainer): BERT-base-sized, batch 64 x 32
COMPARE="tools/bench.py --compare_steps --size bert-base --model_name_or_path $DATA/tokenizer $RUNS --batch_size 64
         --max_seq_length 32 --steps 100 --warmup 10"
say() { echo "== $* ($(date +%T))" | tee -a "$OUT/log.txt"; }
limit() {  # STAGE COMMAND...: the command under the stage's limit; SIGKILL 10 s after SIGTERM, should it linger
    local stage=$1
    shift
    timeout -k 10 "${LIMIT[$stage]}" "$@"
}
into() {  # FILE STAGE COMMAND...: limit's, its output and then its exit status in OUT/FILE
    local file=$OUT/$1
    shift
    limit "$@" > "$file" 2>&1
    echo "exit $?" >> "$file"
}

stage_machine() {
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory // 2**20, 'MiB')"
    } > "$OUT/gpu.txt" 2>&1
}

stage_compare() { into compare_steps.txt compare python3 $COMPARE; }

recipes() {  # SIZE STEPS GATE_EVERY FILE STAGE [BENCH FLAGS...]
    local size=$1 steps=$2 every=$3 file=$4 stage=$5
    shift 5
    into "$file" "$stage" python3 tools/bench.py --recipe_minutes --size "$size" --model_name_or_path \
        $DATA/tokenizer $RUNS --supervised_file $DATA/nli_snli_devtest.csv --recipe_steps "$steps" \
        --gate_every "$every" "$@"
}
stage_st_trainer() {  # the sentence-transformers path's speed beside the suite's own step (#91)
    into st_trainer.txt st_trainer python3 $COMPARE --rows suite suite-graph contrastive-trainer
}

stage_recipes_base() { recipes bert-base 80 20 recipes_bert_base.txt recipes_base \
    --method_args simcse:--no_cuda_graph simcsepp:--no_cuda_graph sscl:--no_cuda_graph whitenedcse:--no_cuda_graph; }
both_ways() {  # STAGE SIZE STEPS GATE_EVERY PREFIX [BENCH FLAGS...]: the rows with the graph, then eagerly, each in
    for mode in cuda_graph no_cuda_graph; do  # half the stage's limit
        LIMIT[half]=$((LIMIT[$1] / 2))
        recipes "$2" "$3" "$4" "$5$mode.txt" half "${@:6}" \
            --method_args simcse:--$mode simcsepp:--$mode sscl:--$mode whitenedcse:--$mode micse:--$mode
    done
}
stage_recipes_large() { both_ways recipes_large bert-large 40 10 recipes_bert_large_; }
stage_recipes_micse() { both_ways recipes_micse bert-base 60 20 recipes_micse_ --recipes micse-fewshot; }

stage_runs_per_gpu() {  # K processes at once, as the local executor places K runs on one GPU
    local file="$OUT/runs_per_gpu.txt" tmp started k mps i pids left
    local steps=${RPG_STEPS:-500} every=${RPG_GATE:-125}  # long enough for the K runs' steps to overlap
    local stage_end=$((SECONDS + LIMIT[runs_per_gpu])) settings=(${RPG_SETTINGS:-1:off 4:off 4:on})  # K:MPS
    tmp=$(mktemp -d)
    echo "K copies of simcse.py's recipe at once (tools/bench.py --recipe_minutes --recipes simcse, $steps steps, a gate every $every)" > "$file"
    if [ -e "${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}/control" ]; then
        echo "an MPS daemon was already running: every setting below ran under it" >> "$file"
    fi
    for setting in "${settings[@]}"; do
        k=${setting%%:*} mps=${setting#*:}
        if [ "$mps" = on ]; then
            if ! command -v nvidia-cuda-mps-control >/dev/null; then
                echo "K=$k under MPS: nvidia-cuda-mps-control is not installed here" >> "$file"; continue
            fi
            nvidia-cuda-mps-control -d >> "$file" 2>&1 || { echo "K=$k under MPS: the daemon did not start" >> "$file"; continue; }
            trap 'echo quit | nvidia-cuda-mps-control' EXIT  # also where the call is cut short
        fi
        left=$((stage_end - SECONDS))
        [ "$left" -gt 20 ] || { echo "K=$k MPS $mps: not run (the stage's $((LIMIT[runs_per_gpu])) s spent)" >> "$file"; break; }
        started=$SECONDS pids=()
        for i in $(seq "$k"); do
            timeout -k 10 "$left" python3 tools/bench.py --recipe_minutes --recipes simcse \
                --size bert-base --model_name_or_path $DATA/tokenizer $RUNS --recipe_steps "$steps" --gate_every "$every" \
                > "$tmp/$i.txt" 2>&1 &
            pids+=($!)
        done
        for i in $(seq "$k"); do wait "${pids[$((i - 1))]}"; echo "copy $i exit $?" >> "$tmp/$i.txt"; done
        echo "K=$k MPS $mps: the $k together $((SECONDS - started)) s" >> "$file"
        for i in $(seq "$k"); do grep -h "^| simcse \|Error\|error:\|^copy .* exit [^0]" "$tmp/$i.txt" >> "$file"; done
        rm -f "$tmp"/*.txt
        if [ "$mps" = on ]; then echo quit | nvidia-cuda-mps-control; trap - EXIT; fi
    done
    rm -rf "$tmp"
}

stage_traces() {
    into traces.txt traces python3 - <<'EOF'
import sys, tempfile, traceback
from pathlib import Path
sys.path[:0] = [".", "tests"]
import torch
import common, families
from plumbing import hub
for family in ("mpnet", "deberta-v2"):  # as the suite calls them: through BackboneWithHeads, the 4-D mask prebuilt
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer, model = hub.load_pretrained(str(families.write_model(Path(tmp) / "m", family)))
        model = common.BackboneWithHeads(model.cuda().train())
        batch = {"input_ids": torch.randint(5, 40, (8, 16), device="cuda"),
                 "attention_mask": torch.ones(8, 16, dtype=torch.long, device="cuda")}
        def step():
            model.zero_grad(set_to_none=True)
            model(**batch).last_hidden_state.float().pow(2).mean().backward()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        print(f"== {family}", flush=True)
        try:
            with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="thread_local"):
                step()
            print("captured", flush=True)
        except Exception:
            traceback.print_exc(file=sys.stdout)
EOF
}

stage_fewshot() {  # the protocol's rows at its precision, each script's graph step, gates and final evaluation
    LIMIT[third]=$((LIMIT[fewshot] / 3))
    recipes bert-base 40 20 fewshot_simcse.txt third --recipes simcse --precision fp32
    recipes bert-base 40 20 fewshot_ami.txt third --recipes micse-fewshot --precision fp32 \
        --method_args micse:--queue_size=0
    recipes bert-base 40 20 fewshot_micse.txt third --recipes micse-fewshot --precision fp32
}

stage_graph_compile() {
    LIMIT[half]=$((LIMIT[graph_compile] / 2))
    into graph_compile.txt half python3 $COMPARE --rows suite-graph suite-graph-compile
    limit half python3 - >> "$OUT/graph_compile.txt" 2>&1 <<'EOF'
import contextlib, io, json, sys, tempfile
sys.path[:0] = [".", "tools"]
import torch
import bench, simcse
from types import SimpleNamespace
with tempfile.TemporaryDirectory() as tmp:
    model = bench.encoder_folder(SimpleNamespace(model_name_or_path=".gpu_data/tokenizer", size="bert-base"), tmp)
    losses = {}
    for name, flags in (("graph", ["--cuda_graph"]), ("graph+compile", ["--cuda_graph", "--compile"])):
        with contextlib.redirect_stdout(io.StringIO()):
            simcse.main(["--model_name_or_path", model, "--train_file", ".gpu_data/wiki1m_head.txt", "--senteval_dir",
                         ".gpu_data/senteval", "--device", "cuda", "--max_steps", "30", "--eval_steps", "30",
                         "--logging_steps", "1", "--dropout", "0", "--no_test_eval", "--no_align_uniform",
                         "--output_dir", f"{tmp}/{name}", *flags])
        losses[name] = json.loads(open(f"{tmp}/{name}/results.json").read())["train_loss"]
        torch._dynamo.reset()
    a, b = losses["graph"], losses["graph+compile"]
    rel = [abs(x - y) / abs(x) for x, y in zip(a, b)]
    print("losses, dropout 0, bf16 (graph | graph+compile):", [(round(x, 5), round(y, 5)) for x, y in zip(a, b)])
    print(f"relative difference: step 1 {rel[0]:.2e}, max {max(rel):.2e}, last {rel[-1]:.2e} (bf16's unit "
          f"roundoff 3.9e-3)")
EOF
    echo "exit $?" >> "$OUT/graph_compile.txt"
}

stage_flags() {
    limit flags python3 - <<'EOF' > "$OUT/flags.txt" 2>&1
import sys, time, types
sys.path.insert(0, ".")
import torch, transformers
from plumbing import memory
config = transformers.BertConfig()
traced_autocast = memory.autocast_of  # the estimate's: CUDA autocast's lists on fake tensors
for name, extra in (("neither", {}), ("--gradient_checkpointing", {"gradient_checkpointing": True}),
                    ("--micro_batch_size 128", {"micro_batch_size": 128}),
                    ("both", {"gradient_checkpointing": True, "micro_batch_size": 128})):
    args = types.SimpleNamespace(method="simcse", supervised=True, batch_size=512, max_seq_length=32,
                                 precision="bf16", pooler="cls", dropout=None, **extra)
    memory.autocast_of = traced_autocast  # (a real autocast here would change the estimate: it once did)
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
}

stage_test_cuda() {
    into test_cuda.txt test_cuda python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py
}

stage_bench() {
    python3 - <<'EOF' >> "$OUT/log.txt" 2>&1
import torch, transformers
torch.manual_seed(0)
tokenizer = transformers.AutoTokenizer.from_pretrained(".gpu_data/tokenizer")
transformers.BertModel(transformers.BertConfig()).save_pretrained(".gpu_data/bert-base-random")
tokenizer.save_pretrained(".gpu_data/bert-base-random")
EOF
    into bench.txt bench python3 tools/bench.py --model_name_or_path $DATA/bert-base-random $RUNS \
        --supervised_file $DATA/nli_snli_devtest.csv --methods simcse simcsepp sscl whitenedcse micse --batch_size 64 \
        --max_seq_length 32 --steps 40 --warmup 5 --skip_eval
}

stage_graph() {
    into graph_tests.txt graph python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py -k "graph or capturable"
}

stage_recipes_graph() { both_ways recipes_graph bert-base 60 20 recipes_; }

stage_families() {
    into families.txt families python3 - <<'EOF'
import contextlib, io, json, sys, tempfile
from pathlib import Path
sys.path[:0] = [".", "tests"]
import torch
import families, simcse
replays = []
replay = torch.cuda.CUDAGraph.replay
torch.cuda.CUDAGraph.replay = lambda self: replays.append(1) or replay(self)
print("| family | replays of 8 steps | the run's note |\n|---|---|---|", flush=True)
for family in families.FAMILIES:
    replays.clear()
    with tempfile.TemporaryDirectory() as tmp:
        model = families.write_model(Path(tmp) / "model", family)
        out, printed = Path(tmp) / "run", io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                simcse.main(["--model_name_or_path", str(model), "--train_file", ".gpu_data/wiki1m_head.txt",
                             "--senteval_dir", ".gpu_data/senteval", "--device", "cuda", "--max_steps", "8",
                             "--eval_steps", "8", "--batch_size", "16", "--no_test_eval", "--no_align_uniform",
                             "--output_dir", str(out)])
            graph = json.loads((out / "results.json").read_text())["args"]["cuda_graph"]
            lines = [line for line in printed.getvalue().splitlines() if "cuda_graph" in line]
            note = next((line for line in lines if line.startswith("note:")), lines[0] if lines else "")  # a fallback's
            print(f"| {family} | {len(replays)} (graph {graph}) | {note[:160]} |", flush=True)
        except BaseException as error:
            print(f"| {family} | failed | {type(error).__name__}: {str(error)[:160]} |", flush=True)
EOF
}

stage_gate() {
    into gate.txt gate python3 tools/bench.py --gate_floor --size bert-base --model_name_or_path $DATA/tokenizer \
        --senteval_dir $DATA/senteval --device cuda --steps 5
}

stage_saves() {
    limit saves python3 tools/bench.py --save_cost --device cuda > "$OUT/saves.txt" 2>&1
}

for stage in $STAGES; do
    say "$stage (at most ${LIMIT[$stage]} s)"
    "stage_$stage"
done
say "done"
