import os
import tempfile

import pytest

# Keep torch's intra-op threads from oversubscribing the 2-core CI machine when tests spawn processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Checkpoints' seal key (headrace.training.checkpoint.seal): a private folder of this test session, inherited
# by the processes tests spawn, never the user's own ~/.config/headrace/seal-key.
os.environ.setdefault("HEADRACE_SEAL_KEY", os.path.join(tempfile.mkdtemp(prefix="headrace-seal-"), "seal-key"))


def _one_rank_group(device_type: str):
    import torch.distributed as dist

    from headrace.training.distributed.process_group import init_distributed

    saved = dict(os.environ)
    init_distributed(device_type)
    yield
    if dist.is_initialized():  # a CLI run inside the module may have closed it (its entry point's process_group_closed)
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def process_group():
    """A one-rank gloo process group in the test process (single-process trainer runs and references)."""
    yield from _one_rank_group("cpu")


@pytest.fixture
def cuda_process_group():
    """The one-rank group a CUDA run joins (NCCL for CUDA tensors, gloo for host ones): gloo would copy every
    collective's CUDA tensor to the host, a sync no GPU job has."""
    yield from _one_rank_group("cuda")


# Installed, the packages are headrace.*; pytest's `pythonpath = ["."]` also leaves the checkout's
# top folders importable under their bare names. A module imported under both would be two modules
# (two registries, two copies of module state): fail the run when any code module of ours is loaded
# under a bare name. A bare `kernels` is allowed only as Hugging Face's package, or as our folder's
# import-free __init__ that transformers' probe may load (find_spec("kernels") from the checkout root).
def pytest_sessionfinish(session, exitstatus):
    import sys

    from tools.package_dirs import RUNTIME_FOLDERS

    bare = sorted(
        m
        for m in sys.modules
        if m.split(".")[0] in set(RUNTIME_FOLDERS) - {"kernels"}
        or (m.startswith("kernels.") and "site-packages" not in str(getattr(sys.modules[m], "__file__", "")))
    )
    if bare:
        print(
            f"\nERROR: modules imported under their bare names besides headrace.*: {', '.join(bare)}", file=sys.stderr
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def one_rank(monkeypatch):
    """A trainer CLI run in this process as one rank: no launcher variables, no debug tracebacks."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HEADRACE_DEBUG"):
        monkeypatch.delenv(key, raising=False)
