#!/usr/bin/env bash
# Record which torch paths the code uses exist in the floor torch (2.11: pyproject's lower bound, what the GPU
# images carry) into tools/torch_floor_api.txt, which tests/test_dependencies.py checks on every CI run
# without torch 2.11. Run it after code starts using a torch path the record lacks (that test
# names them). Needs torch 2.11 importable: PyPI has only its CUDA build for Linux, a 531 MB wheel plus
# 2.1 GB of CUDA libraries (2.6 GB of wheels, ~1 min to download here, ~5 GB installed; see BENCHMARKS.md),
# so it lives in a cached venv, .venv-torch-floor (ignored), installed once; it imports on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-torch-floor
floor=2.11.0
if ! "$venv/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$floor'" 2>/dev/null; then
    PY=${PYTHON:-python3.11}
    command -v "$PY" >/dev/null || PY=python3
    rm -rf "$venv"
    "$PY" -m venv "$venv"
    # tensorboard and numpy: torch modules the code uses import them (torch.utils.tensorboard)
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$floor" tensorboard numpy
fi
"$venv/bin/python" -m tools.torch_api record
git diff --stat tools/torch_floor_api.txt
