"""An energon-prepared directory (no headrace index) streams through the loader from its index.sqlite."""

import sys
from pathlib import Path

from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator

from dataio import build_loader
from dataio.index import INDEX_DIR

sys.path.insert(0, str(Path(__file__).parent))
from loader_util import make_text_dataset  # noqa: E402


def test_energon_prepared_directory(tmp_path):
    keys = make_text_dataset(tmp_path, [5, 3])
    for p in (tmp_path / INDEX_DIR).iterdir():  # leave only what `energon prepare` writes
        p.unlink()
    (tmp_path / INDEX_DIR).rmdir()
    WebdatasetPreparator.prepare_dataset(tmp_path, ["doc-000000.tar", "doc-000001.tar"],
                                         split_parts_ratio=[("train", 1.0)], workers=1)
    batches = list(build_loader({"datasets": [{"path": str(tmp_path)}], "batch_size": 8, "epochs": 1,
                                 "shuffle": False, "num_workers": 0}))
    assert batches[0]["__key__"] == keys
    assert [j["n"] for j in batches[0]["json"]] == list(range(8))
    assert batches[0]["__lengths__"]["tokens.npy"].sum() == batches[0]["tokens.npy"].numel()
