"""Audio through the loader: ``decode.audio: dali`` (batched DALI CPU decoding in the loader or its
workers) serves the same keys and waveforms as ``soundfile``, and counts bad members alike (raw,
undecoded audio bytes: tests/test_loader_bucketing.py)."""

import io

import numpy as np
import pytest
import soundfile
import torch
import webdataset as wds

from headrace.dataio import build_loader
from headrace.dataio.usererror import SampleDecodeError

from tests.loader_util import index_dir
from tests.test_dali import EDGE  # the tolerance argument lives with it


def flac(rate: int, seconds: float, freq: float) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    buf = io.BytesIO()
    soundfile.write(buf, (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32), rate, format="FLAC", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module")
def audio(tmp_path_factory):
    """Two shards of 8/16/22.05 kHz FLAC with a transcript; utterance 5 is corrupt."""
    root = tmp_path_factory.mktemp("audio")
    rates = [8000, 16000, 22050]
    for shard in range(2):
        with wds.TarWriter(str(root / f"a-{shard:06d}.tar")) as w:
            for i in range(shard * 5, shard * 5 + 5):
                payload = b"fLaC" + bytes(200) if i == 5 else flac(rates[i % 3], 0.2 + 0.05 * i, 300.0 + 50 * i)
                w.write({"__key__": f"u{i:03d}", "flac": payload, "txt": f"utterance {i}"})
    index_dir(root)
    return root


def waveforms(root, audio_backend, *, workers=0, **kw):
    config = {
        "datasets": [{"path": str(root)}],
        "batch_size": 4,
        "epochs": 1,
        "shuffle": False,
        "num_workers": workers,
        "max_bad_samples": 1,
        "decode": {"audio": audio_backend},
        **kw,
    }
    loader = build_loader(config)
    out = {}
    for batch in loader:
        pieces = torch.split(batch["flac"], batch["__lengths__"]["flac"].tolist())
        assert batch["__sample_rate__"]["flac"] == [16000] * len(pieces)
        assert batch["txt"] == [f"utterance {int(k[1:])}" for k in batch["__key__"]]
        out.update(zip(batch["__key__"], pieces))
    assert loader.bad_samples == 1
    return out


def test_dali_matches_soundfile_through_the_loader(audio):
    pytest.importorskip("nvidia.dali")
    reference = waveforms(audio, "soundfile")
    assert sorted(reference) == [f"u{i:03d}" for i in range(10) if i != 5]
    for workers in (0, 2):
        decoded = waveforms(audio, "dali", workers=workers)
        assert list(decoded) == list(reference)
        for key, wave in decoded.items():
            assert wave.shape == reference[key].shape and wave.dtype == torch.float32
            diff = (wave - reference[key]).abs()
            assert diff[EDGE:-EDGE].max() < 1e-3 and diff.max() < 0.05, key


def test_bad_audio_past_the_budget_is_an_error_naming_it(audio):
    pytest.importorskip("nvidia.dali")
    with pytest.raises(SampleDecodeError, match=r"a-000001\.tar.*u005.*flac.*DALI"):
        waveforms(audio, "dali", max_bad_samples=0)
