"""Duration bucketing through the loader: rank-synced batches, every utterance once, elastic resume."""

import io
import itertools
import json

import numpy as np
import torch
import pytest
import soundfile
import webdataset as wds

from headrace.dataio import build_loader

from tests.loader_util import index_dir, npy_bytes


@pytest.fixture(scope="module")
def audio(tmp_path_factory):
    root = tmp_path_factory.mktemp("audio")
    rng = np.random.default_rng(0)
    keys = []
    for shard in range(3):
        with wds.TarWriter(str(root / f"utt-{shard:06d}.tar")) as w:
            for i in range(9):
                n = len(keys)
                wave = (rng.standard_normal(int(rng.uniform(0.1, 1.0) * 8000)) * 0.1).astype(np.float32)
                buf = io.BytesIO()
                soundfile.write(buf, wave, 8000, format="FLAC")
                w.write(
                    {
                        "__key__": f"u{n:04d}",
                        "flac": buf.getvalue(),
                        "tokens.npy": npy_bytes(np.arange(n % 5 + 1, dtype=np.int32)),
                        "json": json.dumps({"text": f"utterance {n}"}).encode(),
                    }
                )
                keys.append(f"u{n:04d}")
    index_dir(root)
    return root, keys


def test_bucketed_epoch_covers_once_rank_synced_and_resumes_on_another_dp_size(audio):
    root, keys = audio
    cfg = {
        "datasets": [{"path": str(root)}],
        "epochs": 1,
        "num_workers": 0,
        "bucketing": {"max_duration": 2.0, "num_buckets": 3},
        "decode": {"sample_rate": 8000},
    }
    ranks = [list(build_loader(cfg, dp_rank=r, dp_size=2)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1])
    served = [k for rank in ranks for b in rank for k in b["__key__"]]
    assert sorted(served) == keys
    for b in ranks[0]:
        assert b["audio"].shape[0] * b["audio"].shape[1] <= 2.0 * 8000 or b["audio"].shape[0] == 1
        assert b["audio_lens"].max() == b["audio"].shape[1] and "tokens" in b
        assert b["text"] == [f"utterance {int(k[1:])}" for k in b["__key__"]]  # the transcript rides along

    heads, states = [], []
    for r in range(2):
        loader = build_loader({**cfg, "num_workers": 1}, dp_rank=r, dp_size=2)
        heads += [k for b in itertools.islice(loader, 2) for k in b["__key__"]]
        states.append(loader.state_dict())
    resumed = build_loader(cfg, dp_rank=0, dp_size=1)
    resumed.load_state_dict(states)
    rest = [k for b in resumed for k in b["__key__"]]
    assert sorted(heads + rest) == keys


def test_raw_audio_bytes_cross_workers_as_one_flat_tensor(audio):
    import soundfile as sf

    root, keys = audio
    (batch,) = build_loader(
        {
            "datasets": [{"path": str(root)}],
            "epochs": 1,
            "num_workers": 2,
            "batch_size": 27,
            "shuffle": False,
            "decode": {"audio": "raw"},
        }
    )
    lengths = batch["__lengths__"]["flac"]
    assert batch["__key__"] == keys and batch["flac"].dtype == torch.uint8
    first = bytes(batch["flac"][: lengths[0]].numpy())
    assert sf.info(io.BytesIO(first)).format == "FLAC"  # the encoded member, untouched
