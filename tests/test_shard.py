"""End-to-end tests of `dataio shard`: round trips read back with webdataset, determinism across
workers, splits, resume after kill -9, multi-node parts, and every bad-input case."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import webdataset as wds

from headrace.dataio.usererror import CommandError
from headrace.dataio.commands import shard as shard_cmd
from headrace.dataio.shards.index import load_index
from tests.helpers import child_env

REPO = Path(__file__).resolve().parents[1]
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def shard(*argv) -> int:
    """Run `dataio shard ARGV` in-process (the CLI's own parser and run)."""
    parser = argparse.ArgumentParser()
    shard_cmd.add_arguments(parser)
    return shard_cmd.run(parser.parse_args([str(a) for a in argv] + ["--quiet"]))


def sentence(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(n))


def tone(seconds: float, sr: int = 16000, seed: int = 0) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    rng = np.random.default_rng(seed)
    return (0.3 * np.sin(2 * np.pi * (200 + 50 * seed) * t) + 0.01 * rng.standard_normal(len(t))).astype(np.float32)


def write_text_corpus(d: Path, n: int, words: int = 20) -> Path:
    path = d / "docs.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"doc{i}", "text": sentence(i, words + i % 13), "url": f"u{i}"}) + "\n")
    return path


def write_audio_corpus(d: Path, n: int = 6) -> Path:
    """A NeMo manifest: FLAC and WAV files (relative paths), plus one offset segment."""
    (d / "wav").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        ext = "wav" if i % 3 == 2 else "flac"
        sf.write(d / "wav" / f"utt{i}.{ext}", tone(0.5 + 0.1 * i, seed=i), 16000, subtype="PCM_16")
        lines.append(
            {
                "audio_filepath": f"wav/utt{i}.{ext}",
                "duration": 0.5 + 0.1 * i,
                "text": sentence(i, 5),
                "speaker": f"spk{i % 2}",
            }
        )
    lines.append({"audio_filepath": "wav/utt0.flac", "offset": 0.1, "duration": 0.3, "text": "a segment"})
    path = d / "manifest.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def write_tokenizer(d: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [sentence(i, 30) for i in range(50)], trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"])
    )
    path = d / "tokenizer.json"
    tok.save(str(path))
    return path


def read_wds(out: Path) -> dict[str, dict]:
    """Every sample of every shard under ``out`` as webdataset yields it (raw bytes, no decoding)."""
    urls = sorted(str(p) for p in out.glob("*.tar"))
    samples = {}
    for s in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
        assert s["__key__"] not in samples
        samples[s["__key__"]] = {k: v for k, v in s.items() if not k.startswith("__")}
    return samples


def tree_digest(out: Path) -> dict[str, str]:
    """sha256 of every file under ``out`` (shards, idx, index, metadata)."""
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


# --- round trips ----------------------------------------------------------------------------------


def test_text_round_trip_with_tokenizer(tmp_path):
    src = write_text_corpus(tmp_path, 40)
    tok_path = write_tokenizer(tmp_path)
    out = tmp_path / "out"
    assert shard(src, "--output", out, "--tokenizer", tok_path, "--samples-per-shard", 16, "--checksum") == 0

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    records = [json.loads(line) for line in src.read_text().splitlines()]
    got = read_wds(out)
    assert sorted(got) == sorted(r["id"] for r in records)
    for r in records:
        s = got[r["id"]]
        assert set(s) == {"txt", "json", "npy"}
        assert s["txt"] == r["text"].encode()
        ids = np.load(io.BytesIO(s["npy"]), allow_pickle=False)
        assert ids.dtype == np.uint16
        assert ids.tolist() == tok.encode(r["text"], add_special_tokens=False).ids
        assert json.loads(s["json"])["url"] == r["url"]
    index = load_index(out)
    assert [sh.name for sh in index.shards] == ["train-000000.tar", "train-000001.tar", "train-000002.tar"]
    assert index.samples["tokens"].sum() == sum(
        len(tok.encode(r["text"], add_special_tokens=False).ids) for r in records
    )
    # index offsets point at the payloads, found at write time
    first = index.sample_members(0)
    offset, size = first["txt"]
    with open(out / index.shards[0].name, "rb") as f:
        f.seek(offset)
        assert f.read(size) == got[index.key(0)]["txt"]
    assert (out / "train-000000.tar.idx").exists() and (out / ".nv-meta" / ".info.json").exists()
    assert index.shards[1].sha256 == hashlib.sha256((out / "train-000001.tar").read_bytes()).hexdigest()


def test_audio_manifest_round_trip(tmp_path):
    manifest = write_audio_corpus(tmp_path)
    out = tmp_path / "out"
    assert shard(manifest, "--output", out, "--shard-size", "20KB") == 0
    got = read_wds(out)
    assert len(got) == 7
    for i in range(6):
        ext = "wav" if i % 3 == 2 else "flac"
        s = got[f"wav/utt{i}"]
        assert s[ext] == (tmp_path / "wav" / f"utt{i}.{ext}").read_bytes()  # kept as given
        meta = json.loads(s["json"])
        assert meta["text"] == sentence(i, 5) and meta["speaker"] == f"spk{i % 2}"
        assert meta["sample_rate"] == 16000 and meta["duration"] == pytest.approx(0.5 + 0.1 * i)
        assert meta["source"] == str(manifest) and meta["line"] == i + 1
    segment = got["wav/utt0_100"]
    audio, sr = sf.read(io.BytesIO(segment["flac"]), dtype="int16")
    source, _ = sf.read(tmp_path / "wav" / "utt0.flac", dtype="int16")
    np.testing.assert_array_equal(audio, source[1600 : 1600 + 4800])  # cut at shard time, lossless
    assert json.loads(segment["json"])["source_offset"] == 0.1
    index = load_index(out)
    assert len(index.shards) > 1
    assert np.nansum(index.samples["duration"]) == pytest.approx(sum(0.5 + 0.1 * i for i in range(6)) + 0.3, abs=1e-3)


def test_audio_format_flac_reencodes_wav(tmp_path):
    manifest = write_audio_corpus(tmp_path, n=3)
    out = tmp_path / "out"
    shard(manifest, "--output", out, "--audio-format", "flac")
    got = read_wds(out)
    s = got["wav/utt2"]
    assert "wav" not in s
    decoded, _ = sf.read(io.BytesIO(s["flac"]), dtype="int16")
    original, _ = sf.read(tmp_path / "wav" / "utt2.wav", dtype="int16")
    np.testing.assert_array_equal(decoded, original)


def test_lhotse_cuts_round_trip(tmp_path):
    from lhotse import CutSet, MonoCut, Recording, SupervisionSegment

    cuts = []
    for i in range(4):
        path = tmp_path / f"rec{i}.flac"
        sf.write(path, tone(1.0, seed=i), 16000)
        rec = Recording.from_file(path, recording_id=f"rec{i}")
        sup = SupervisionSegment(id=f"sup{i}", recording_id=rec.id, start=0, duration=rec.duration, text=sentence(i, 4))
        cuts.append(
            MonoCut(id=f"cut-{i}", start=0, duration=rec.duration, channel=0, recording=rec, supervisions=[sup])
        )
    # a cut that is a window of a recording: decoded and re-encoded at shard time
    rec0 = cuts[0].recording
    cuts.append(
        MonoCut(
            id="cut-window",
            start=0.25,
            duration=0.5,
            channel=0,
            recording=rec0,
            supervisions=[SupervisionSegment(id="w", recording_id=rec0.id, start=0, duration=0.5, text="window")],
        )
    )
    manifest = tmp_path / "cuts.jsonl.gz"
    CutSet.from_cuts(cuts).to_file(manifest)

    out = tmp_path / "out"
    assert shard(manifest, "--output", out) == 0
    got = read_wds(out)
    assert sorted(got) == sorted(c.id for c in cuts)
    for i in range(4):
        assert got[f"cut-{i}"]["flac"] == (tmp_path / f"rec{i}.flac").read_bytes()
        assert json.loads(got[f"cut-{i}"]["json"])["text"] == sentence(i, 4)
    window, sr = sf.read(io.BytesIO(got["cut-window"]["flac"]), dtype="float32")
    np.testing.assert_allclose(window, cuts[-1].load_audio()[0], atol=1 / 32768)


def test_parquet_text_and_audio_round_trip(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"text": [sentence(i, 8) for i in range(10)], "score": list(range(10))}),
        tmp_path / "text.parquet",
        row_group_size=4,
    )
    blobs = []
    for i in range(5):
        buf = io.BytesIO()
        sf.write(buf, tone(0.3, seed=i), 16000, format="FLAC")
        blobs.append(buf.getvalue())
    pq.write_table(
        pa.table(
            {
                "id": [f"a{i}" for i in range(5)],
                "audio": [{"bytes": b, "path": None} for b in blobs],
                "text": [sentence(i, 3) for i in range(5)],
            }
        ),
        tmp_path / "audio.parquet",
    )
    out = tmp_path / "out"
    assert shard(tmp_path / "text.parquet", tmp_path / "audio.parquet", "--output", out) == 0
    got = read_wds(out)
    assert len(got) == 15
    for i in range(10):
        s = got[f"text-{i + 1:09d}"]
        assert s["txt"] == sentence(i, 8).encode() and json.loads(s["json"])["score"] == i
    for i in range(5):
        assert got[f"a{i}"]["flac"] == blobs[i]  # bytes kept, extension sniffed from the magic
        assert json.loads(got[f"a{i}"]["json"])["text"] == sentence(i, 3)


def test_plain_txt_one_document_per_line(tmp_path):
    src = tmp_path / "book.txt"
    src.write_text("first line\n\nsecond line\nthird\n")
    out = tmp_path / "out"
    shard(src, "--output", out)
    got = read_wds(out)
    assert {k: v["txt"] for k, v in got.items()} == {
        "book-000000001": b"first line",
        "book-000000003": b"second line",
        "book-000000004": b"third",
    }


# --- determinism, splits, resume -------------------------------------------------------------------


def test_workers_do_not_change_the_bytes(tmp_path):
    src = write_text_corpus(tmp_path, 120)
    tok = write_tokenizer(tmp_path)
    shard(src, "--output", tmp_path / "w1", "--tokenizer", tok, "--shard-size", "4KB", "--workers", 1)
    shard(src, "--output", tmp_path / "w2", "--tokenizer", tok, "--shard-size", "4KB", "--workers", 2)
    one, two = tree_digest(tmp_path / "w1"), tree_digest(tmp_path / "w2")
    assert len([k for k in one if k.endswith(".tar")]) > 3
    assert one == two


def test_splits_are_deterministic_and_disjoint(tmp_path):
    src = write_text_corpus(tmp_path, 300)
    shard(src, "--output", tmp_path / "a", "--split", "train=0.8,val=0.2", "--samples-per-shard", 50)
    shard(src, "--output", tmp_path / "b", "--split", "train=0.8,val=0.2", "--samples-per-shard", 70, "--workers", 2)
    index_a, index_b = load_index(tmp_path / "a"), load_index(tmp_path / "b")
    keys = {}
    for index in (index_a, index_b):
        per_split = {s: {index.key(i) for i in index.split_indices(s)} for s in ("train", "val")}
        assert per_split["train"].isdisjoint(per_split["val"])
        assert len(per_split["train"]) + len(per_split["val"]) == 300
        assert 30 < len(per_split["val"]) < 90
        keys[id(index)] = per_split
    assert keys[id(index_a)] == keys[id(index_b)]  # split by key, not by shard layout
    assert sorted(p.name for p in (tmp_path / "a").glob("val-*.tar"))[0] == "val-000000.tar"


def test_resume_after_kill_9_is_byte_identical(tmp_path):
    src = write_text_corpus(tmp_path, 4000, words=40)
    tok = write_tokenizer(tmp_path)
    argv = [
        sys.executable,
        "-m",
        "headrace.dataio",
        "shard",
        str(src),
        "--tokenizer",
        str(tok),
        "--samples-per-shard",
        "60",
        "--workers",
        "2",
        "--quiet",
    ]
    env = child_env()
    subprocess.run(argv + ["--output", str(tmp_path / "clean")], cwd=REPO, env=env, check=True, capture_output=True)

    out = tmp_path / "crashed"
    proc = subprocess.Popen(
        argv + ["--output", str(out)],
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while len(list(out.glob(".nv-meta/parts/*.npz"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole node dies: parent and its workers
    proc.wait()
    finished, total = len(list(out.glob("*.tar"))), len(list((tmp_path / "clean").glob("*.tar")))
    assert 0 < finished < total, "the job should have been killed mid-run"
    assert not (out / ".nv-meta" / ".info.json").exists()  # an interrupted job never looks complete

    result = subprocess.run(
        argv + ["--output", str(out)], cwd=REPO, env=env, check=True, capture_output=True, text=True
    )
    assert "already complete" in result.stdout
    assert tree_digest(out) == tree_digest(tmp_path / "clean")
    assert not list(out.glob("*.tmp-*"))


def test_resume_removes_the_temp_files_of_unfinished_shards(tmp_path):
    """What a kill leaves for the shard being written (tar, index part, skip report temps) is cleaned up."""
    src = write_text_corpus(tmp_path, 30)
    out = tmp_path / "out"
    shard(src, "--output", out, "--samples-per-shard", 10)
    clean = tree_digest(out)
    (out / "train-000001.tar").unlink()
    (out / ".nv-meta" / "parts" / "train-000001.tar.npz").unlink()
    (out / ".nv-meta" / ".info.json").unlink()
    stale = [
        out / "train-000001.tar.tmp-host-1",
        out / ".nv-meta" / "parts" / ".train-000001.tar.npz.tmp-1",
        out / ".nv-meta" / "headrace-shard" / "skipped" / "train-000001.tar.jsonl.tmp-host-1",
    ]
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"partial")
    shard(src, "--output", out, "--samples-per-shard", 10)
    assert not any(p.exists() for p in stale)
    assert tree_digest(out) == clean


def test_rerun_of_a_complete_job_keeps_everything(tmp_path, capsys):
    src = write_text_corpus(tmp_path, 30)
    out = tmp_path / "out"
    shard(src, "--output", out, "--samples-per-shard", 10)
    before = tree_digest(out)
    shard(src, "--output", out, "--samples-per-shard", 10)
    assert "wrote 0 shards" in capsys.readouterr().out
    assert tree_digest(out) == before


def test_multi_node_parts_then_last_node_merges(tmp_path, monkeypatch):
    src = write_text_corpus(tmp_path, 90)
    shard(src, "--output", tmp_path / "single", "--samples-per-shard", 10)
    out = tmp_path / "multi"
    shard(src, "--output", out, "--samples-per-shard", 10, "--num-nodes", 3, "--node-rank", 1)
    assert sorted(p.name for p in out.glob("*.tar")) == ["train-000001.tar", "train-000004.tar", "train-000007.tar"]
    assert not (out / ".nv-meta" / ".info.json").exists()  # not last: parts only
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    shard(src, "--output", out, "--samples-per-shard", 10)  # rank from the SLURM array
    assert len(list(out.glob("*.tar"))) == 6
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    shard(src, "--output", out, "--samples-per-shard", 10)  # the last node merges every part
    assert tree_digest(out) == tree_digest(tmp_path / "single")


# --- bad input ------------------------------------------------------------------------------------


def bad_text_lines(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"text": "fine"}', '{"text": "also fine"', '{"text": "x"}'], r"bad\.jsonl:2: not valid JSON"),
        (['{"text": "fine"}', '{"body": "no text field"}'], r"bad\.jsonl:2: missing required field 'text'"),
        (['{"text": "fine"}', '{"text": "  "}'], r"bad\.jsonl:2: empty text"),
        (
            ['{"id": "a", "text": "one"}', '{"id": "b", "text": "two"}', '{"id": "a", "text": "three"}'],
            r"bad\.jsonl:3: duplicate key 'a' \(first at .*bad\.jsonl:1\)",
        ),
    ],
)
def test_bad_manifest_lines_fail_with_file_and_line(tmp_path, lines, message):
    out = tmp_path / "out"
    with pytest.raises(CommandError, match=message):
        shard(bad_text_lines(tmp_path, lines), "--output", out)
    assert not list(out.glob("*.tar")) and not (out / ".nv-meta" / ".info.json").exists()


def test_missing_audio_file(tmp_path):
    manifest = write_audio_corpus(tmp_path, n=3)
    (tmp_path / "wav" / "utt1.flac").unlink()
    with pytest.raises(CommandError, match=r"manifest\.jsonl:2: audio file not found: .*utt1\.flac"):
        shard(manifest, "--output", tmp_path / "out")


def test_missing_audio_field(tmp_path):
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"audio_filepath": "x.flac", "text": "no duration"}) + "\n")
    with pytest.raises(CommandError, match=r"m\.jsonl:1: missing required field 'duration'"):
        shard(manifest, "--output", tmp_path / "out")


def test_corrupt_audio_fails_then_skips_under_budget(tmp_path):
    manifest = write_audio_corpus(tmp_path, n=6)
    (tmp_path / "wav" / "utt3.flac").write_bytes(b"fLaC" + os.urandom(3000))
    out = tmp_path / "out"
    with pytest.raises(CommandError, match=r"manifest\.jsonl:4: .*utt3\.flac: unreadable audio"):
        shard(manifest, "--output", out, "--samples-per-shard", 2)
    assert not (out / ".nv-meta" / ".info.json").exists()
    assert not list(out.glob("*.tmp-*"))
    assert "train-000001.tar" not in {p.name for p in out.glob("*.tar")}  # the bad sample's shard is not there

    shard(manifest, "--output", out, "--samples-per-shard", 2, "--skip-errors", 1)  # resumes the same job
    skipped = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert [(s["line"], s["key"]) for s in skipped] == [(4, "wav/utt3")]
    assert "wav/utt3" not in read_wds(out) and len(read_wds(out)) == 6
    assert len(load_index(out)) == 6


def test_skip_budget_counts_planning_errors_and_fails_beyond_it(tmp_path):
    src = bad_text_lines(tmp_path, ['{"text": "a"}', "not json", '{"text": ""}', '{"text": "b"}'])
    with pytest.raises(CommandError, match=r"3: empty text .*2 bad samples exceed --skip-errors 1"):
        shard(src, "--output", tmp_path / "o1", "--skip-errors", 1)
    shard(src, "--output", tmp_path / "o2", "--skip-errors", 2)
    skipped = [json.loads(line) for line in (tmp_path / "o2" / "skipped.jsonl").read_text().splitlines()]
    assert [s["line"] for s in skipped] == [2, 3]
    assert len(load_index(tmp_path / "o2")) == 2


def test_output_dir_of_another_job_is_refused(tmp_path):
    src = write_text_corpus(tmp_path, 10)
    out = tmp_path / "out"
    shard(src, "--output", out)
    with pytest.raises(CommandError, match=r"holds shards of a different job \(its options differ"):
        shard(src, "--output", out, "--samples-per-shard", 3)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data-000000.tar").write_bytes(b"")
    with pytest.raises(CommandError, match=r"already holds shards not written by this"):
        shard(src, "--output", foreign)


def test_missing_tokenizer(tmp_path):
    src = write_text_corpus(tmp_path, 3)
    with pytest.raises(CommandError, match=r"tokenizer not found: .*nope\.json"):
        shard(src, "--output", tmp_path / "out", "--tokenizer", tmp_path / "nope.json")
    assert not (tmp_path / "out").exists()


def test_cli_exit_status_and_one_line_error(tmp_path):
    src = bad_text_lines(tmp_path, ['{"text": "fine"}', "{oops"])
    result = subprocess.run(
        [sys.executable, "-m", "headrace.dataio", "shard", str(src), "--output", str(tmp_path / "out")],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0
    assert "bad.jsonl:2: not valid JSON" in result.stderr


def planned_text_job(tmp_path, docs: int, per_shard: int):
    """(ShardJob, plan) of a text corpus of ``docs`` documents, ``per_shard`` samples per shard."""
    from headrace.dataio.prepare.plan import plan_job
    from headrace.dataio.prepare.readers import ReadOptions, open_input
    from headrace.dataio.prepare.writer import ShardJob

    src = write_text_corpus(tmp_path, docs)
    plan = plan_job(
        [open_input(str(src), ReadOptions())], splits=[("train", 1.0)], shard_bytes=None, samples_per_shard=per_shard
    )
    (tmp_path / "out").mkdir()
    return ShardJob(root=tmp_path / "out", inputs=[open_input(str(src), ReadOptions())]), plan


@pytest.mark.parametrize("workers", [1, 2])
def test_progress_counts_every_sample_in_chunks(tmp_path, monkeypatch, workers):
    """The bar advances per chunk of samples, also from forked workers, and ends at the total."""
    from headrace.dataio.prepare import writer as shard_write
    from headrace.dataio.prepare.job import write_shards

    monkeypatch.setattr(shard_write, "CHUNK", 7)
    job, plan = planned_text_job(tmp_path, 45, 20)
    steps: list[int] = []
    results = list(write_shards(job, plan.shards, workers, steps.append))
    assert sorted(r.samples for r in results) == [5, 20, 20]
    assert sum(steps) == 45
    if workers == 1:
        assert steps == [7, 7, 6] * 2 + [5]  # 20 = 7 + 7 + 6 per shard, then the last shard of 5


def test_a_writer_process_that_dies_is_an_error_not_a_hang(tmp_path, monkeypatch):
    """A forked writer killed mid-job (OOM killer, kill -9) fails the job within a second, naming it."""
    from headrace.dataio.prepare import job as shard_job

    job, plan = planned_text_job(tmp_path, 30, 10)
    monkeypatch.setattr(shard_job, "write_shard", lambda job, shard, progress=None: os._exit(3))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"shard writer process \d+ died \(exit code 3\)"):
        list(shard_job.write_shards(job, plan.shards, 2))
    assert time.monotonic() - start < 30
