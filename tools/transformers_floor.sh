#!/usr/bin/env bash
# The transformers floor: the families, training and speech-LLM (SALM) tests under the lowest supported
# transformers (pyproject.toml's lower bound, 5.17: the GPU images' release). A cached venv,
# .venv-transformers-floor (ignored), is installed from the lock with transformers moved down and
# huggingface-hub left to its range (5.17 wants <2). The tested top is the lock's
# transformers, which tools/test.sh runs. Extra arguments go to pytest.
#   bash tools/transformers_floor.sh          # ~1.5 GB venv once; the tests take ~10 min on 2 cores
set -euo pipefail
cd "$(dirname "$0")/.."
floor=$(python3 -c 'import tomllib
from pathlib import Path
deps = tomllib.loads(Path("pyproject.toml").read_text())["project"]["dependencies"]
spec = next(d for d in deps if d.startswith("transformers"))
print(next(s.split(">=")[1] for s in spec.removeprefix("transformers").split(",") if s.startswith(">=")))')
floor=$(python3 -c "import sys; v = sys.argv[1].split('.'); print('.'.join(v + ['0'] * (3 - len(v))))" "$floor")
venv=.venv-transformers-floor
if ! "$venv/bin/python" -c "from importlib.metadata import version as v; assert v('transformers') == '$floor'; v('headrace')" \
        2>/dev/null; then
    HEADRACE_VENV=$venv bash tools/setup.sh
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -c <(grep -Ev '^(transformers|huggingface-hub)==' constraints.txt) \
        "transformers==$floor"
fi
echo "transformers floor: $("$venv/bin/python" -c 'import transformers, torch; print(transformers.__version__, "with torch", torch.__version__)')"
OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q --timeout=600 \
    tests/test_train_dist.py::test_families_match_single_process tests/test_speech.py tests/test_speech_dist.py \
    tests/test_train.py "$@"
