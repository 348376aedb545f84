#!/usr/bin/env bash
# Create .venv (if needed) and install headrace with its dev and dali extras (DALI's CPU pipeline
# runs without a GPU, so its tests run for real; ~260 MB of wheels). torch is pinned to the CPU wheel
# this machine carries; installing it first keeps pip from resolving a CUDA build.
# A stamp in .venv records the pyproject.toml it was installed from, so re-runs skip pip (~30 s).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv || { echo "setup: '$PY -m venv' failed (on Debian/Ubuntu: apt-get install python3.11-venv)" >&2; exit 1; }
fi
stamp=.venv/.headrace-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
installed() {  # headrace and the pinned torch are in the venv (cheap: metadata only, no imports)
    .venv/bin/python -I -c "from importlib.metadata import version as v; v('headrace'); assert v('torch').startswith('2.13.0')" 2>/dev/null
}
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && installed; then
    exit 0
fi
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev,dali,wandb]'
# litdata, a peer loader in `dataio bench`: --no-deps, because its declared dependencies (torchvision)
# pull another torch; then the light dependencies it imports (none of them touches torch).
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps litdata==0.2.76 lightning-utilities==0.15.3
# boto3 (and moto, the S3 server of tests/test_loader_s3.py, which needs it) pinned to the botocore that
# s3fs's aiobotocore accepts: boto3 shares botocore's version numbers; a newer boto3 pulls a botocore that
# aiobotocore refuses, and an unpinned resolve backtracks through boto3 releases for minutes.
botocore=$(.venv/bin/python -c "from importlib.metadata import version; print(version('botocore'))")
.venv/bin/python -m pip install -q --disable-pip-version-check "boto3==$botocore" "botocore==$botocore" 'moto[server]' requests filelock
echo "$want" > "$stamp"
