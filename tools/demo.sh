#!/usr/bin/env bash
# The README's first command, for a fresh machine with Python 3.11 and the package registries:
# venv + install, build the embedded demo corpus (real text, espeak-ng speech, a BPE tokenizer),
# shard it with `dataio shard`, summarise with `dataio inspect`, re-read with `dataio verify`
# and train the demo model on the text shards. Data goes under demo/, the run under runs/demo.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }

step "virtualenv + install (tools/setup.sh)"
bash tools/setup.sh

# Real speech needs espeak-ng; install it when we can, else the corpus builder falls back to a
# labelled synthetic signal. Never fatal: the rest of the demo runs either way.
if ! command -v espeak-ng >/dev/null && command -v apt-get >/dev/null; then
    SUDO=""
    [ "$(id -u)" = 0 ] || { sudo -n true 2>/dev/null && SUDO="sudo -n"; } || SUDO=none
    if [ "$SUDO" != none ]; then
        step "apt-get install espeak-ng (for synthesized speech)"
        { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq espeak-ng; } \
            >/dev/null 2>&1 || echo "espeak-ng could not be installed; the demo audio will be a synthetic signal"
    fi
fi

PY=.venv/bin/python
DATAIO=.venv/bin/dataio

step "build the demo corpus -> demo/corpus"
"$PY" -m tools.demo_corpus --out demo/corpus

# The corpus is rebuilt each run, so start the shards from scratch too.
rm -rf demo/shards

step "dataio shard: text JSONL + tokenizer -> demo/shards/text"
"$DATAIO" shard demo/corpus/text.jsonl --output demo/shards/text --tokenizer demo/corpus/tokenizer.json \
    --samples-per-shard 500 --split train=0.98,val=0.02 --workers 2

step "dataio shard: NeMo audio manifest -> demo/shards/audio"
"$DATAIO" shard demo/corpus/audio_manifest.jsonl --output demo/shards/audio --samples-per-shard 50 --workers 2

for kind in text audio; do
    step "dataio inspect demo/shards/$kind"
    "$DATAIO" inspect "demo/shards/$kind"
    step "dataio verify demo/shards/$kind"
    "$DATAIO" verify "demo/shards/$kind"
done

# ---- training (issue 5, trainer) ------------------------------------------------------------------
step "train the demo model: 2 CPU processes, FSDP2, packed rows, 40 steps -> runs/demo (metrics, checkpoints, hf/)"
rm -rf runs/demo
OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 -m headrace.training --config configs/demo.yaml
"$PY" - <<'PY'
import json
records = [r for r in map(json.loads, open("runs/demo/metrics.jsonl")) if "loss" in r]  # training steps (not val)
first, last = records[0]["loss"], records[-1]["loss"]
print(f"loss {first:.3f} -> {last:.3f} over {records[-1]['step']} steps")
assert last < first, "the demo loss did not fall"
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("runs/demo/hf")
tok = AutoTokenizer.from_pretrained("runs/demo/hf")
print(f"runs/demo/hf loads: {type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters, "
      f"tokenizer vocab {tok.vocab_size}")
PY
