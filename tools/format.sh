#!/usr/bin/env bash
# Format the whole tree with ruff (settings: pyproject.toml [tool.ruff.format]), then lint it.
#
# Run once by whoever merges, after every branch that edits Python files is in (a tree-wide reformat on a
# branch would conflict with all the others), and commit the result on its own ("ruff format: the whole
# tree, no other change"). From then on tests/test_lint.py's `ruff format --check` keeps it formatted.
# Formatting changes layout only (ruff checks that the AST is unchanged); the lint must still pass after.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m ruff format .
"$PY" -m ruff check .
