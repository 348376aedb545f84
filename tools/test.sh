#!/usr/bin/env bash
# The whole test suite on a fresh machine: venv, install (CPU torch), pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export OMP_NUM_THREADS=1
# Two pytest workers (pytest-xdist), each taking whole test files (--dist loadfile: a module's fixtures are built
# once): most tests run in one single-threaded process, so a lone pytest leaves the second core idle.
# A hung test fails (--timeout), it never stalls CI.
exec .venv/bin/python -m pytest -q --timeout=600 -n 2 --dist loadfile "$@"
