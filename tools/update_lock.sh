#!/usr/bin/env bash
# Refresh constraints.txt, the lock: resolve pyproject.toml's ranges afresh (newest releases inside them) in a
# scratch venv, run the whole test suite there, and only if it passes rewrite constraints.txt with that
# venv's exact set (`python -m tools.lockfile write`). Commit the new file with the run's result.
#
#   bash tools/update_lock.sh            # ~15 min of install + ~12 min of tests on 2 cores
#   bash tools/update_lock.sh -x -k foo  # extra arguments go to pytest (a partial run for trying a range)
#
# To move a range's top (e.g. a new transformers), edit pyproject.toml first, then run this. The scratch
# venv, .venv-lock (ignored), is made anew each run and left after it, so a failure can be inspected.
# HEADRACE_TORCH picks the torch to resolve with (default: the tested top, the CPU wheel on this disk).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-lock
rm -rf "$venv"
HEADRACE_VENV=$venv HEADRACE_LOCK=none bash tools/setup.sh
OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q --timeout=600 -n 2 --dist loadfile "$@"  # as tools/test.sh
"$venv/bin/python" -m tools.lockfile write constraints.txt
echo "constraints.txt rewritten from $venv (transformers $(sed -n 's/^transformers==//p' constraints.txt)," \
     "torch $(sed -n 's/^torch==//p' constraints.txt)); review with git diff constraints.txt"
