#!/usr/bin/env bash
# Create .venv (if needed) and install headrace with its dev extra. torch is pinned to the CPU wheel
# this machine carries; installing it first keeps pip from resolving a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'
