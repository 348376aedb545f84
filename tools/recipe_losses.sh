#!/usr/bin/env bash
# The trainer's losses on the debug recipes, for an exact before/after comparison of a refactor:
#   tools/recipe_losses.sh OUT [DATA]   (then: diff OLD/*.losses OUT/*.losses)
# Builds a tiny demo corpus under DATA (default /tmp/recipe_losses_data; kept between runs, so two runs read
# the same shards), then trains debug_llama, debug_qwen3_moe (ep_size=2), speech_demo (on debug_llama's
# export), speech_ctc, debug_lora and debug_llama with float8 linears (torchao's emulated matmul, CPU) for 4 steps on 2 CPU processes, validating every 2 steps, and writes OUT/<recipe>.losses: each
# step's loss and each validation record, as Python reprs (exact floats). To run another checkout's code
# with this venv, put a folder laid out as headrace/{training,dataio,kernels,config} first on PYTHONPATH.
set -euo pipefail
OUT=$(realpath -m "$1"); D=$(realpath -m "${2:-/tmp/recipe_losses_data}")
cd "$(dirname "$0")/.."
PY=.venv/bin/python; TR=.venv/bin/torchrun
export OMP_NUM_THREADS=1
mkdir -p "$OUT"
if [ ! -d "$D/shards/speech" ]; then
  $PY -m tools.demo_corpus --out "$D/corpus" --docs 400 --utterances 60 --speech synthetic --vocab-size 1024 >/dev/null
  .venv/bin/dataio shard "$D/corpus/text.jsonl" --output "$D/shards/text" --tokenizer "$D/corpus/tokenizer.json" \
      --samples-per-shard 200 --split train=0.9,val=0.1 --workers 1 >/dev/null
  .venv/bin/dataio shard "$D/corpus/audio_manifest.jsonl" --output "$D/shards/speech" \
      --tokenizer "$D/corpus/tokenizer.json" --samples-per-shard 30 --split train=0.8,val=0.2 --workers 1 >/dev/null
fi
run() {
  local name=$1 kind=$2; shift 2
  rm -rf "$OUT/run_$name"
  $TR --standalone --nproc-per-node 2 -m headrace.training "$@" "trainer.output_dir=$OUT/run_$name" \
      logging.console=false checkpoint.interval=2 trainer.max_steps=4 trainer.eval_every=2 \
      "data.datasets=[{path: $D/shards/$kind, split: train}]" "data.val={datasets: [{path: $D/shards/$kind, split: val}]}" \
      > "$OUT/$name.log" 2>&1 || { tail -20 "$OUT/$name.log"; exit 1; }
  $PY -c "import json, sys; rs = [json.loads(l) for l in open(sys.argv[1])]
[print(r['step'], repr(r['loss'])) for r in rs if 'loss' in r]
[print('val', r) for r in rs if 'val_loss' in r]" "$OUT/run_$name/metrics.jsonl" > "$OUT/$name.losses"
  echo "$name: $(grep -vc val "$OUT/$name.losses") steps -> $OUT/$name.losses"
}
run debug_llama text --config configs/debug_llama.yaml model.config.vocab_size=1024 "model.tokenizer=$D/corpus/tokenizer.json"
run debug_qwen3_moe text --config configs/debug_qwen3_moe.yaml model.config.vocab_size=1024 distributed.ep_size=2 \
    checkpoint.export_hf=false
run speech_demo speech --config configs/speech_demo.yaml "model.pretrained_path=$OUT/run_debug_llama/hf" \
    "model.tokenizer=$D/corpus/tokenizer.json" trainer.log_every=1
run speech_ctc speech --config configs/speech_ctc.yaml data.num_workers=0 trainer.log_every=1 \
    'model.speech.encoder.config={hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2, intermediate_size: 64, subsampling_factor: 4, subsampling_conv_channels: 16, conv_kernel_size: 3}' \
    data.bucketing.max_duration=20.0
run debug_lora text --config configs/debug_lora.yaml model.config.vocab_size=1024 "model.tokenizer=$D/corpus/tokenizer.json"
run debug_llama_float8 text --config configs/debug_llama.yaml model.config.vocab_size=1024 trainer.precision=fp32 \
    "model.tokenizer=$D/corpus/tokenizer.json" 'quantize.linear.float8={emulate: true}' checkpoint.export_hf=false
