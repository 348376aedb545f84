"""Input readers: detection, keys, scan-time and load-time errors naming file and line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf

from headrace.dataio.prepare.readers import (
    BadRecord,
    LhotseCutsInput,
    NemoManifestInput,
    ParquetInput,
    ReadOptions,
    SampleError,
    TextJsonlInput,
    TxtInput,
    make_key,
    open_input,
)


def scan(reader):
    items = list(reader.scan())
    return [i for i in items if not isinstance(i, BadRecord)], [i for i in items if isinstance(i, BadRecord)]


def test_make_key_is_webdataset_and_path_safe():
    assert make_key("a/b.c/d e") == "a/b%2Ec/d%20e"  # no dots: webdataset splits key and extension there
    assert make_key("/abs/../x") == "%2Fabs%2F%2E%2E%2Fx"  # never escapes the shard's directory
    assert make_key("abs/../x") == "abs/%2E%2E/x"
    with pytest.raises(ValueError, match="longer than"):
        make_key("k" * 300)


def test_open_input_detects_each_kind(tmp_path):
    opts = ReadOptions()
    (tmp_path / "t.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "n.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1, "text": "hi"}\n')
    (tmp_path / "c.jsonl").write_text('{"id": "c", "start": 0, "duration": 1, "channel": 0, "type": "MonoCut"}\n')
    (tmp_path / "p.txt").write_text("hi\n")
    assert isinstance(open_input(str(tmp_path / "t.jsonl"), opts), TextJsonlInput)
    assert isinstance(open_input(str(tmp_path / "n.jsonl"), opts), NemoManifestInput)
    assert isinstance(open_input(str(tmp_path / "c.jsonl"), opts), LhotseCutsInput)
    assert isinstance(open_input(str(tmp_path / "p.txt"), opts), TxtInput)
    assert isinstance(open_input(str(tmp_path / "n.jsonl"), ReadOptions(kind="text")), TextJsonlInput)
    with pytest.raises(ValueError, match="--kind audio, but this input has no audio"):
        open_input(str(tmp_path / "t.jsonl"), ReadOptions(kind="audio"))
    with pytest.raises(FileNotFoundError, match="input file not found"):
        open_input(str(tmp_path / "missing.jsonl"), opts)
    (tmp_path / "p.csv").write_text("x")
    with pytest.raises(ValueError, match="unsupported input type"):
        open_input(str(tmp_path / "p.csv"), opts)


def test_text_field_option_and_keys(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"body": "one", "lang": "en"}) + "\n\n" + json.dumps({"body": "two"}) + "\n")
    reader = open_input(str(path), ReadOptions(text_field="body"))
    entries, bad = scan(reader)
    assert not bad and [e.key for e in entries] == ["docs-000000001", "docs-000000003"]
    sample = reader.load(entries[0])
    assert sample.members["txt"] == b"one" and sample.text == "one"
    assert json.loads(sample.members["json"]) == {"source": str(path), "line": 1, "lang": "en"}


def test_nemo_scan_errors_and_load_errors_name_file_and_line(tmp_path):
    sf.write(tmp_path / "ok.wav", np.zeros(1600, np.int16), 16000)
    (tmp_path / "broken.flac").write_bytes(b"not audio at all" * 10)
    rows = [
        {"audio_filepath": "ok.wav", "duration": 0.1, "text": "fine"},
        {"audio_filepath": "gone.wav", "duration": 1, "text": "x"},
        {"audio_filepath": "ok.mp4", "duration": 1, "text": "x"},
        {"audio_filepath": "ok.wav", "duration": "long", "text": "x"},
        {"audio_filepath": "broken.flac", "duration": 1, "text": "x"},
        {"audio_filepath": "ok.wav", "offset": 5.0, "duration": 1, "text": "past the end"},
    ]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reader = open_input(str(path), ReadOptions())
    entries, bad = scan(reader)
    assert [(b.line, b.reason.split(":")[0]) for b in bad] == [
        (2, "audio file not found"),
        (3, "unsupported audio extension 'mp4' (expected one of flac, wav, opus, mp3, ogg)"),
        (4, "field 'duration' must be a finite non-negative number, got 'long'"),
    ]
    assert [e.line for e in entries] == [1, 5, 6]
    assert reader.load(entries[0]).duration == pytest.approx(0.1)
    with pytest.raises(SampleError, match=r"m\.jsonl:5: .*broken\.flac: unreadable audio"):
        reader.load(entries[1])
    with pytest.raises(SampleError, match=r"m\.jsonl:6: .*segment .* lies outside the audio"):
        reader.load(entries[2])


def test_parquet_audio_bytes_must_be_recognisable(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"audio": [b"\x00\x01garbage", b""], "text": ["a", "b"]}), tmp_path / "a.parquet")
    reader = open_input(str(tmp_path / "a.parquet"), ReadOptions())
    assert isinstance(reader, ParquetInput) and reader.kind == "audio"
    entries, bad = scan(reader)
    assert not entries
    assert [str(b).split(str(tmp_path))[-1] for b in bad] == [
        "/a.parquet:1: audio bytes in an unrecognised format",
        "/a.parquet:2: empty audio bytes in column 'audio'",
    ]
