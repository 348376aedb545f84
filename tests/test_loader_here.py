"""One process makes small token batches a task at a time (``RankBatches.here``): the loader's batches are
still exactly ``BatchMaker``'s one by one, and a resume inside a task continues at the next batch."""

from __future__ import annotations

import numpy as np
import torch

from headrace.dataio.loader import build_loader
from headrace.dataio.stream.reading.batches import BatchMaker
from headrace.dataio.stream.reading.collate import plain_memory

from tests.test_gather import assert_same, token_tars


def test_one_process_tasks_are_make_batch_one_by_one_and_resume_inside_a_task(tmp_path):
    rng = np.random.default_rng(2)
    token_tars(tmp_path / "a", [rng.integers(1, 40, 45).tolist(), rng.integers(1, 40, 38).tolist()])
    cfg = {
        "datasets": [{"path": str(tmp_path / "a")}],
        "batch_size": 4,
        "epochs": 1,
        "shuffle": True,
        "shuffle_window": 16,
        "num_workers": 0,
    }
    loader = build_loader(cfg, dp_rank=0, dp_size=1)
    stream = loader.stream
    maker = BatchMaker(
        reader=stream.reader(),
        blend=stream.blend,
        seed=stream.seeds,
        layout=stream.layout,
        dp_rank=0,
        first_local=0,
        batch_size=4,
    )
    batches = list(loader)
    assert len(batches) == 21 and len(batches[-1]["__key__"]) == 3  # 83 samples: a short last batch
    storage = {b["tokens.npy"].untyped_storage().data_ptr() for b in batches}
    assert len(storage) == 1  # one task: every batch a view of its one tensor
    for b, batch in enumerate(batches):
        expected = maker(b, plain_memory)
        expected.pop("__bad__")
        expected.pop("__end__")
        assert_same(batch, expected)
    # tasks of 64 batches here (256 samples): a resume after 5 batches starts inside the first task
    first = build_loader(cfg, dp_rank=0, dp_size=1)
    it = iter(first)
    for _ in range(5):
        next(it)
    resumed = build_loader(cfg, dp_rank=0, dp_size=1)
    resumed.load_state_dict(first.state_dict())
    rest = list(resumed)
    assert len(rest) == 16
    for x, y in zip(rest, batches[5:], strict=True):
        assert_same(x, y)


def test_recycled_memory_reuses_only_dropped_batches(tmp_path, monkeypatch):
    """With every tensor recycled (threshold 0): a consumer that keeps batches gets them intact; one that
    drops each batch gets the next in the same memory, with the right contents."""
    from headrace.dataio.stream import rank
    from headrace.dataio.stream.reading import workers

    monkeypatch.setattr(workers, "RECYCLE_BYTES", 0)
    monkeypatch.setattr(rank, "TASK_SAMPLES_HERE", 1)  # one batch at a time: each its own allocation
    rng = np.random.default_rng(3)
    token_tars(tmp_path / "a", [rng.integers(1, 40, 60).tolist()])
    cfg = {"datasets": [{"path": str(tmp_path / "a")}], "batch_size": 64, "epochs": 1, "num_workers": 0}
    stream = build_loader(cfg, dp_rank=0, dp_size=1).stream
    maker = BatchMaker(
        reader=stream.reader(),
        blend=stream.blend,
        seed=stream.seeds,
        layout=stream.layout,
        dp_rank=0,
        first_local=0,
        batch_size=8,
    )
    cfg["batch_size"] = 8  # 8 batches, every one kept
    kept = list(build_loader(cfg, dp_rank=0, dp_size=1))
    assert len({b["tokens.npy"].untyped_storage().data_ptr() for b in kept}) == 8  # none reused while held
    for b, batch in enumerate(kept):
        expected = maker(b, plain_memory)
        assert torch.equal(batch["tokens.npy"], expected["tokens.npy"]), b
    cfg["batch_size"] = 4
    maker4 = BatchMaker(
        reader=stream.reader(),
        blend=stream.blend,
        seed=stream.seeds,
        layout=stream.layout,
        dp_rank=0,
        first_local=0,
        batch_size=4,
    )
    pointers = set()
    for b, batch in enumerate(build_loader(cfg, dp_rank=0, dp_size=1)):
        tokens = batch["tokens.npy"]
        assert torch.equal(tokens, maker4(b, plain_memory)["tokens.npy"]), b
        pointers.add(tokens.untyped_storage().data_ptr())
        del batch, tokens
    assert len(pointers) < 15  # 15 batches, dropped as they came: buffers were reused
