#!/usr/bin/env bash
# The speech recipe's one command (docs/speech-recipe.md; tools/speech_recipe.py says what each stage does):
#   bash tools/speech_recipe.sh --manifest M.jsonl --out DIR [--text T.jsonl] [--minutes N]
# Ends with one JSON line, also in DIR/summary.json: wer, listening_ratio, ctc_wer, val_utterances, train_minutes.
set -euo pipefail
# runs in the caller's folder (relative --manifest / --text / --out are theirs); the checkout is found by path
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$([ -x "$REPO/.venv/bin/python" ] && echo "$REPO/.venv/bin/python" || echo python)}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
exec "$PYTHON" -m tools.speech_recipe "$@"
