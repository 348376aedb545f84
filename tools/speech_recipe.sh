#!/usr/bin/env bash
# The speech recipe's one command (docs/speech-recipe.md; tools/speech_recipe.py says what each stage does):
#   bash tools/speech_recipe.sh --manifest M.jsonl --out DIR [--text T.jsonl] [--minutes N]
# Ends with one JSON line, also in DIR/summary.json: wer, listening_ratio, ctc_wer, val_utterances, train_minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
exec "$PYTHON" -m tools.speech_recipe "$@"
