#!/usr/bin/env bash
# Create .venv (if needed) and install headrace with its dev, bench, dali, fp8 and wandb extras, every package at
# the version constraints.txt pins: the exact set the tests ran with (DALI's CPU pipeline runs without a
# GPU, so its tests run for real; ~260 MB of wheels). tools/update_lock.sh re-resolves and rewrites the file.
# torch goes first, at the locked version: with no torch installed, a range that admits a newer release
# makes pip take a CUDA build of several GB; `pip install torch==2.13.0` takes the CPU wheel on this disk.
# A stamp in the venv records the pyproject.toml + constraints.txt it was installed from: re-runs skip pip.
#
# HEADRACE_VENV: the venv (default .venv). HEADRACE_LOCK=none: resolve fresh within pyproject.toml's
# ranges instead of installing the lock (tools/update_lock.sh does this in a scratch venv).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HEADRACE_VENV:-.venv}
LOCK=constraints.txt
[ "${HEADRACE_LOCK:-}" = none ] && LOCK=
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV" || { echo "setup: '$PY -m venv' failed (on Debian/Ubuntu: apt-get install python3.11-venv)" >&2; exit 1; }
fi
pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check ${LOCK:+-c "$LOCK"} "$@"; }
if [ -n "$LOCK" ]; then
    torch=$(sed -n 's/^torch==//p' "$LOCK")
    [ -n "$torch" ] || { echo "setup: $LOCK pins no torch (regenerate it: bash tools/update_lock.sh)" >&2; exit 1; }
    stamp=$VENV/.headrace-installed
    want=$(cat pyproject.toml "$LOCK" | sha256sum | cut -d' ' -f1)
    # headrace and the locked torch are in the venv (cheap: metadata only, no imports)
    if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && "$VENV/bin/python" -I -c "from importlib.metadata import version as v
v('headrace'); assert v('torch').split('+')[0] == '$torch'" 2>/dev/null; then
        exit 0
    fi
else
    torch=${HEADRACE_TORCH:-2.13.0}  # the tested top of pyproject's torch range
fi
pip_install "torch==$torch"
pip_install -e '.[dev,bench,dali,fp8,wandb]'
# boto3 (and moto, the S3 server of tests/test_loader_s3.py, which needs it) at the botocore that s3fs's
# aiobotocore accepts: boto3 shares botocore's version numbers; a newer boto3 pulls a botocore that
# aiobotocore refuses, and an unpinned resolve backtracks through boto3 releases for minutes.
botocore=$("$VENV/bin/python" -c "from importlib.metadata import version; print(version('botocore'))")
pip_install "boto3==$botocore" "botocore==$botocore" 'moto[server]' requests filelock
# litdata, a peer loader in `dataio bench`: --no-deps, because its declared dependencies (torchvision)
# pull another torch; then the light dependency it imports (it touches no torch). Last, and without pip's
# conflict report: its undeclared-on-purpose torchvision would print an ERROR line on every later install.
pip_install --no-deps --no-warn-conflicts litdata lightning-utilities
if [ -n "$LOCK" ]; then
    "$VENV/bin/python" -m tools.lockfile check "$LOCK"
    echo "$want" > "$stamp"
fi
