"""Issue 34 item 20: ``python -m headrace.training.estimate_batch`` with a data directory that does not exist (or no
``data.bucketing``: any config error) is one line, exit 2 (was a FileNotFoundError traceback); a hand-edited
packing sub-state in a loader state is the loader's ``StateError`` (was AttributeError / IndexError / TypeError)."""

from __future__ import annotations

import pytest

from tests.loader_util import make_text_dataset
from tests.test_speech import _estimator_job

from headrace.dataio import build_loader
from headrace.dataio.loader_state import StateError
from headrace.training.estimate_batch import main as estimate_batch


@pytest.mark.parametrize(
    "overrides,said",
    [
        (
            ["data.bucketing.bucket_duration_bins=null", "data.datasets=[{path: /nonexistent/speech}]"],
            "error: data.datasets[0].path: /nonexistent/speech does not exist",
        ),
        (
            ["data.bucketing=null"],
            "error: model.kind: salm trains on bucketed audio",
        ),  # a config error: was a traceback
    ],
)
def test_estimate_batch_input_errors_are_one_line(tmp_path, capsys, overrides, said):
    job = _estimator_job(tmp_path)
    capsys.readouterr()
    assert estimate_batch(["--config", job, "--budget-gib", "0.002", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith(said) and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "edit",
    [
        lambda p: [],
        lambda p: {**p, "ready": [[1]]},
        lambda p: {**p, "ready": [[[1, 0]]]},
        lambda p: {**p, "open": "x"},
        lambda p: {**p, "buffer": [[1, 2]]},
        lambda p: {**p, "totals": []},
    ],
)
def test_hand_edited_packing_state_is_a_state_error(tmp_path, edit):
    make_text_dataset(tmp_path / "d", [30])
    data = {
        "datasets": [{"path": str(tmp_path / "d")}],
        "batch_size": 2,
        "num_workers": 0,
        "seq_len": 16,
        "packing": "best_fit",
        "packing_buffer": 4,
    }
    loader = build_loader(data, 0, 1)
    next(iter(loader))
    state = loader.state_dict()
    state["packing"] = edit(state["packing"])
    with pytest.raises(StateError, match="loader state"):
        build_loader(data, 0, 1).load_state_dict(state)
