#!/usr/bin/env bash
# One command for whoever has a GPU for fifteen minutes: versions and device first, then every part below,
# each time-boxed (`timeout`) so a failure or a hang in one still reports the others, into ONE report file
# (format: BENCHMARKS.md, "GPU check"). It uses the machine's own Python and torch (no venv, no downloads):
# a missing package (webdataset, lhotse, soundfile, ...) is reported and the parts needing it are skipped.
#
#   bash tools/gpu_check.sh                          # all parts -> runs/gpu_check/report.md
#   bash tools/gpu_check.sh --report R.md --parts versions,kernels,moe
#   bash tools/gpu_check.sh --plan                   # versions for real; every other part listed, not run
#   bash tools/gpu_check.sh --dry-run                # on a CPU, before any device call: see below
#   bash tools/gpu_check.sh --budget 540             # a part starts only if its box fits in what is left
#
# Parts, in run order, the headline figures first (default box in s; GPU_CHECK_TIMEOUT_<PART>=S overrides):
# versions (60), shards (60: the demo text shards, built only if demo/shards/text is absent), train_headrace
# (180) / train_torchtitan (240: tools.bench_torchtitan, the same Llama shape, batch and rows in torchtitan,
# and the ratio line) / train_plain (120: tools.bench_train on configs/llama_1b.yaml, one source each, so a
# source bench_train lacks is a failed part, not a failed run), train_float8 (180: the recipe with
# quantize.linear.float8 tensorwise) / train_float8_rowwise (180) / train_offload (180:
# distributed.offload_policy=cpu), float8_loss (300: 200 steps bf16 and float8, the last losses within 2%),
# train_eager (120: the trainer without the recipe's compile and with
# resharding after forward), gpu_tests (240: pytest -m gpu, one line per test), kernels (120:
# tools.bench_kernels all), moe (45: tools.bench_moe experts), lora (150: tools.bench_lora, LoRA then full
# fine-tuning of one 1.2B Llama in bf16, step time and peak memory each), train_webdataset (120), smoke (150: the
# floor-torch smoke subset -- imports, the loader, CP attention both modes + CP/FSDP2 training on gloo, PP
# schedules, the dependency checks -- under the machine's torch), speech_recipe (300: tools/speech_recipe.sh --size
# gpu, bf16 + FSDP2, 3 minutes of training over its three stages, on demo/corpus_asr_gpu: 300 espeak-ng
# utterances, ~20 MB, built where espeak-ng is and carried, since the GPU machine may lack it; prints the summary
# line). --dry-run proves the script on a CPU machine: it adds (unless --parts names the parts) speech_corpus (builds demo/corpus_asr_gpu
# with espeak-ng if absent) and carry (tools.gpu_carry: downloads the wheels the GPU image lacks into .whl and checks
# the carry is closed and fits the 64 MiB one device call takes), runs versions and shards for real, collects the
# pytest parts, and runs every other part under tools/gpu_dry_run (torch told a CUDA device exists) up to its first
# CUDA call, where the part stops and reports the caller's file:line; a part whose set-up breaks before that fails
# here. Every box expiring: ~24 min, more than one
# device call allows, so --budget S (seconds from the start) skips, and reports, each part whose box no longer
# fits. PYTHON picks the interpreter (default python3). Exit status: 0 when every part that ran passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
REPORT=runs/gpu_check/report.md
PARTS="versions shards train_headrace train_torchtitan train_plain train_float8 train_float8_rowwise train_offload"
PARTS+=" float8_loss train_eager gpu_tests kernels moe lora train_webdataset smoke speech_recipe"
DRY=0  # 1: --dry-run; 2: --plan
PARTS_GIVEN=0
BUDGET=0  # seconds; 0: no limit
while [ $# -gt 0 ]; do
    case $1 in
        --report) REPORT=$2; shift 2 ;;
        --parts) PARTS=${2//,/ }; PARTS_GIVEN=1; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        --plan) DRY=2; shift ;;
        --budget) BUDGET=$2; shift 2 ;;
        -h|--help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
declare -A BOX=([versions]=60 [smoke]=150 [gpu_tests]=240 [shards]=60 [train_headrace]=180 [train_webdataset]=120
                [train_plain]=120 [train_eager]=120 [kernels]=120 [moe]=45 [train_torchtitan]=240
                [train_float8]=180 [train_float8_rowwise]=180 [train_offload]=180 [float8_loss]=300
                [lora]=150 [speech_recipe]=300)
# parts a CPU runs for real in a dry run; the pytest parts only collect there
declare -A RUNS_ON_CPU=([versions]=1 [shards]=1 [speech_corpus]=1 [carry]=1 [gpu_tests]=1 [smoke]=1)
BOX+=([speech_corpus]=300 [carry]=120)
COLLECT=()  # what the pytest parts add: a dry run collects (and fails on a collection error)
GPU_TESTS_MODE=(--continue-on-collection-errors)
if [ "$DRY" = 1 ]; then
    [ "$PARTS_GIVEN" = 1 ] || PARTS="speech_corpus carry $PARTS"
    COLLECT=(--collect-only)
    GPU_TESTS_MODE=(--collect-only)
fi
START=$(date +%s)
for p in $PARTS; do
    [ -n "${BOX[$p]:-}" ] || { echo "gpu_check: unknown part '$p' (parts: ${!BOX[*]})" >&2; exit 2; }
done
mkdir -p "$(dirname "$REPORT")"
LOGS=$(mktemp -d)
BODY=$LOGS/body.md
SUMMARY=()
FAILED=0
# The floor-torch smoke subset (kept short: it runs inside the lease).
SMOKE=(tests/test_dependencies.py tests/test_packaging.py::test_imports_are_cheap tests/test_loader.py
       tests/test_cp_attention.py tests/test_pipeline.py)

missing() {  # the listed modules this Python cannot import
    "$PY" - "$@" <<'PY'
import importlib.util, sys
def absent(m):
    try:
        return importlib.util.find_spec(m) is None
    except ImportError:  # a parent package is absent
        return True
print(" ".join(m for m in sys.argv[1:] if absent(m)))
PY
}

# part NAME "NEEDED MODULES" [--if-absent PATH] -- COMMAND...: run COMMAND time-boxed, report its status,
# wall time and the tail of its output.
part() {
    local name=$1 needs=$2; shift 2
    local unless=""
    if [ "$1" = --if-absent ]; then unless=$2; shift 2; fi
    shift  # --
    case " $PARTS " in *" $name "*) ;; *) return ;; esac
    local var="GPU_CHECK_TIMEOUT_${name^^}" status secs=0 log=$LOGS/$name.log
    local box=${!var:-${BOX[$name]}}
    local absent; absent=$(missing $needs)
    local left=$((BUDGET - ($(date +%s) - START)))
    if [ -n "$unless" ] && [ -e "$unless" ]; then
        status="skipped: $unless exists"
    elif [ "$BUDGET" -gt 0 ] && [ "$left" -lt "$box" ]; then
        status="skipped: budget (${left}s left of ${BUDGET}s, box ${box}s)"
    elif [ -n "$absent" ]; then
        status="skipped: needs $absent (not installed here; carry its wheel: BENCHMARKS.md, GPU check)"
    elif [ "$DRY" = 2 ] && [ "$name" != versions ]; then
        status="planned"
    elif [ "$DRY" = 1 ] && [ -z "${RUNS_ON_CPU[$name]:-}" ]; then
        # up to the first CUDA call (tools/gpu_dry_run/sitecustomize.py stops the part's process group there)
        echo "gpu_check: $name (dry-run, box ${box}s): $*" >&2
        local marker=$LOGS/$name.cuda t0; t0=$(date +%s)
        { timeout --kill-after=10 "$box" env PYTHONPATH="$PWD/tools/gpu_dry_run${PYTHONPATH:+:$PYTHONPATH}" \
            GPU_DRY_MARKER="$marker" "$@" >"$log" 2>&1; } 2>/dev/null  # not bash's "Killed" line: the stop is planned
        local rc=$?
        secs=$(($(date +%s) - t0))
        if [ -s "$marker" ]; then
            status="dry-run: set-up ok, first CUDA call at $(head -n 1 "$marker" | sed "s#^$PWD/##")"
        elif [ "$rc" = 0 ]; then
            status="dry-run: ok, ran to the end without a CUDA call"
        elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
            status="dry-run: timed out after ${box}s before any CUDA call"; FAILED=1
        else
            status="dry-run: failed before any CUDA call (exit $rc)"; FAILED=1
        fi
    else
        echo "gpu_check: $name (box ${box}s): $*" >&2
        local t0; t0=$(date +%s.%N)
        timeout --kill-after=10 "$box" "$@" >"$log" 2>&1
        local rc=$?
        secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.0f", b - a}')
        case $rc in
            0) status=ok ;;
            124|137) status="timed out after ${box}s"; FAILED=1 ;;
            *) status="failed (exit $rc)"; FAILED=1 ;;
        esac
    fi
    {
        printf '## %s\n\n$ %s\n\nstatus: %s; wall %s s; box %s s\n\n' "$name" "$*" "$status" "$secs" "$box"
        if [ -s "$log" ]; then printf '```\n'; tail -n 60 "$log"; printf '```\n'; fi
        printf '\n'
    } >>"$BODY"
    SUMMARY+=("| $name | $status | $secs |")
    [ "$name" = versions ] && [ -s "$log" ] && cat "$log"
}

# the corpus the speech_recipe part trains on: built where espeak-ng is, carried to the GPU machine
part speech_corpus "tokenizers soundfile" --if-absent demo/corpus_asr_gpu -- "$PY" -m tools.demo_corpus \
    --out demo/corpus_asr_gpu --docs 3000 --utterances 300 --vocab-size 512
DRY_SITE=runs/gpu_check/dry-site  # a dry run's copy of the carried packages this Python lacks (torchtitan's stack)
part carry "packaging" -- "$PY" -m tools.gpu_carry --out .whl $([ "$DRY" = 1 ] && echo "--install-here $DRY_SITE")
[ "$DRY" = 1 ] && [ -d "$DRY_SITE" ] && export PYTHONPATH="$PWD/$DRY_SITE${PYTHONPATH:+:$PYTHONPATH}"
part versions "" -- "$PY" - <<'PY'
import platform, shutil, subprocess
print(f"python {platform.python_version()} ({platform.machine()})")
try:
    import torch
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()})")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"device {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, {p.total_memory / 2**30:.1f} GiB, "
              f"{p.multi_processor_count} SMs, capability {p.major}.{p.minor}")
    else:
        print("device: no CUDA device visible to torch")
except ImportError as e:
    print(f"torch: MISSING ({e})")
if shutil.which("nvidia-smi"):
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20)
    print("nvidia-smi:", out.stdout.strip() or out.stderr.strip())
else:
    print("nvidia-smi: not found")
# presence and version from the metadata (importing each would cost more than the box on a loaded CPU)
from importlib.metadata import PackageNotFoundError, version
for module, dist in (("transformers",) * 2, ("tokenizers",) * 2, ("safetensors",) * 2, ("numpy",) * 2,
                     ("yaml", "pyyaml"), ("rich",) * 2, ("braceexpand",) * 2, ("fsspec",) * 2, ("pyarrow",) * 2,
                     ("lhotse",) * 2, ("soundfile",) * 2, ("soxr",) * 2, ("tensorboard",) * 2, ("webdataset",) * 2,
                     ("megatron.energon", "megatron-energon"), ("litdata",) * 2, ("psutil",) * 2,
                     ("matplotlib",) * 2, ("flash_attn", "flash-attn"), ("nvidia.dali", "nvidia-dali-cuda130"),
                     ("pytest",) * 2, ("pytest_timeout", "pytest-timeout"), ("torchao",) * 2, ("torchtitan",) * 2,
                     ("datasets",) * 2):
    try:
        print(f"{module} {version(dist)}")
    except PackageNotFoundError:
        print(f"{module} MISSING")
PY

part shards "tokenizers soundfile" --if-absent demo/shards/text -- env PY="$PY" bash -c \
    '"$PY" -m tools.demo_corpus --out demo/corpus --speech synthetic && "$PY" -m headrace.dataio shard demo/corpus/text.jsonl \
     --output demo/shards/text --tokenizer demo/corpus/tokenizer.json --samples-per-shard 500 \
     --split train=0.98,val=0.02 --workers 4'
train() {  # train PART SOURCE NEEDS [OVERRIDES...]: tools.bench_train on the 1B Llama, one source
    local name=$1 source=$2 needs=$3; shift 3
    part "$name" "$needs" -- "$PY" -m tools.bench_train --config configs/llama_1b.yaml --device cuda \
        --data demo/shards/text --sources "$source" --steps "${STEPS:-20}" --warmup "${WARMUP:-5}" \
        --out "runs/gpu_check/$name" --json-out "runs/gpu_check/$name.json" "$@"
}
train train_headrace headrace tokenizers
part train_torchtitan "torchtitan datasets tokenizers" -- "$PY" -m tools.bench_torchtitan --steps 20 --warmup 5 \
    --out runs/gpu_check/train_torchtitan --headrace runs/gpu_check/train_headrace.json
train train_plain plain "tokenizers webdataset"
FLOAT8='quantize.linear.float8={recipe_name: tensorwise}'
train train_float8 headrace "tokenizers torchao" "$FLOAT8"
train train_float8_rowwise headrace "tokenizers torchao" 'quantize.linear.float8={recipe_name: rowwise}'
train train_offload headrace tokenizers distributed.offload_policy=cpu
part float8_loss "torchao tokenizers" -- env PY="$PY" FLOAT8="$FLOAT8" bash -c \
    'for run in bf16 float8; do "$PY" -m tools.bench_train --config configs/llama_1b.yaml --device cuda \
         --data demo/shards/text --sources headrace --steps 200 --warmup 20 --out "runs/gpu_check/float8_loss_$run" \
         --json-out "runs/gpu_check/float8_loss_$run.json" $([ $run = float8 ] && echo "$FLOAT8") || exit 1
     done
     "$PY" -m tools.loss_gap runs/gpu_check/float8_loss_bf16.json runs/gpu_check/float8_loss_float8.json --max 0.02'
train train_eager headrace tokenizers distributed.compile=false distributed.reshard_after_forward=true
part gpu_tests "pytest pytest_timeout" -- \
    "$PY" -m pytest -v --tb=short -p no:cacheprovider --timeout=300 -m gpu "${GPU_TESTS_MODE[@]}" tests
part kernels "" -- "$PY" -m tools.bench_kernels all --device cuda --dtype bfloat16
part moe "" -- "$PY" -m tools.bench_moe experts --device cuda --dtype bf16 --tokens 16384 --hidden 2048 \
    --intermediate 768 --experts 64 --top-k 8
# one JSON line per mode (BENCHMARKS.md "LoRA against full fine-tuning"); full second, so its larger peak
# cannot be what the LoRA run's figure measured
part lora "" -- env PY="$PY" bash -c 'for mode in lora full; do "$PY" -m tools.bench_lora --mode $mode --device cuda \
    --hidden 2048 --layers 16 --seq-len 4096 --batch 2 --steps 12 --warmup 4 --precision bf16 || exit 1; done'
train train_webdataset webdataset "tokenizers webdataset"
part smoke "pytest pytest_timeout webdataset soundfile" -- \
    env OMP_NUM_THREADS=1 "$PY" -m pytest -q -p no:cacheprovider --timeout=300 "${COLLECT[@]}" "${SMOKE[@]}"
part speech_recipe "tokenizers soundfile webdataset" -- env PYTHON="$PY" bash tools/speech_recipe.sh \
    --manifest demo/corpus_asr_gpu/audio_manifest.jsonl --text demo/corpus_asr_gpu/text.jsonl \
    --out runs/gpu_check/speech_recipe --minutes 3 --size gpu --eval-every 50

{
    printf '# GPU check: %s\n\n' "$(date -u '+%Y-%m-%d %H:%M UTC')"
    printf 'commit %s%s; `bash tools/gpu_check.sh%s`\n\n' "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
        "$(git diff --quiet HEAD 2>/dev/null || echo ' (+ local changes)')" "$(case $DRY in 1) echo ' --dry-run' ;; 2) echo ' --plan' ;; esac)"
    printf '| part | status | wall s |\n| --- | --- | ---: |\n'
    printf '%s\n' "${SUMMARY[@]}"
    printf '\n'
    cat "$BODY"
} >"$REPORT"
rm -rf "$LOGS"
echo "gpu_check: report in $REPORT" >&2
exit "$FAILED"
