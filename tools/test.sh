#!/usr/bin/env bash
# The whole test suite on a fresh machine: venv, install (CPU torch), pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest -q --timeout=600 "$@"  # a hung test fails, it never stalls CI
