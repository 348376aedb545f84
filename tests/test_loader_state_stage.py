"""A loader state is loaded only by a loader with the same batching stage (issue 34 item 8): a packed state (its
packer holding the rest of split documents) given to a plain loader used to be accepted and those pieces lost; a
plain state given to a packer was read as an empty one. Through ``build_loader`` and ``load_state_dict``."""

from __future__ import annotations

import pytest

from tests.loader_util import make_text_dataset

from headrace.dataio import build_loader
from headrace.dataio.loader_state import StateError

STAGES = {"plain": {}, "packed": {"seq_len": 16, "packing": "best_fit", "packing_buffer": 4}}


@pytest.mark.parametrize("saved,loading", [("packed", "plain"), ("plain", "packed")])
def test_a_state_of_another_batching_stage_is_refused(tmp_path, saved, loading):
    make_text_dataset(tmp_path / "d", [30])
    data = {"datasets": [{"path": str(tmp_path / "d")}], "batch_size": 2, "num_workers": 0}
    loader = build_loader({**data, **STAGES[saved]}, 0, 1)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    with pytest.raises(StateError, match="saved by a loader with .* this one has "):
        build_loader({**data, **STAGES[loading]}, 0, 1).load_state_dict(state)
    build_loader({**data, **STAGES[saved]}, 0, 1).load_state_dict(state)  # its own kind still loads
