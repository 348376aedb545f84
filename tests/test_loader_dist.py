"""Real gloo process group: ranks take their DP coordinates from it and together cover the data once."""

import json

import pytest
import torch.multiprocessing as mp

from tests.dist.loader_ranks import main
from tests.helpers import free_port
from tests.loader_util import make_text_dataset


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gloo_ranks_disjoint_exact_coverage_and_elastic_resume(tmp_path):
    keys = make_text_dataset(tmp_path / "data", [7, 5, 3, 1, 6])
    expected = tmp_path / "expected.json"
    expected.write_text(json.dumps(keys))
    result = tmp_path / "result.json"
    world = 4
    mp.start_processes(
        main,
        args=(world, free_port(), str(tmp_path / "data"), str(expected), str(result)),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    checks = json.loads(result.read_text())
    assert checks == {
        "exactly_once": True,
        "equal_batches": True,
        "same_seed": True,
        "elastic_exactly_once": True,
        "elastic_equal_batches": True,
        "packed_equal_batches": True,
    }
