import os

import pytest

# Keep torch's intra-op threads from oversubscribing the 2-core CI machine when tests spawn processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def process_group():
    """A one-rank gloo process group in the test process (single-process trainer runs and references)."""
    import torch.distributed as dist

    from training.distributed.process_group import init_distributed

    saved = dict(os.environ)
    init_distributed("cpu")
    yield
    dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
