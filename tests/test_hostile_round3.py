"""Regression tests of issue 25 (reliability round 3), data side: every example through the real entry
point (the ``dataio`` CLI in-process, or ``build_loader``): non-regular inputs, shards rewritten in place,
loader states past the end / of mixed runs / with huge integers, mixed codecs, odd ``.npy`` token members,
malformed input files, disk full, and the CLI's journeys (broken pipe, hints, progress)."""

from __future__ import annotations

import copy
import gzip
import io
import json
import os
import shutil

import numpy as np
import pytest
import soundfile
import webdataset as wds

from tests import loader_util
from headrace.dataio import build_loader
from headrace.dataio.cli import main as dataio_main
from headrace.dataio.loader_state import StateError
from headrace.dataio.stream.decode import SampleDecodeError
from tests.hostile import flac_bytes, lying_flac
from tests.helpers import child_env


def _cli(capsys, *argv) -> tuple[int, str]:
    """``dataio ARGV`` in-process: (exit status, stderr)."""
    code = dataio_main([str(a) for a in argv])
    return code, capsys.readouterr().err


def _manifest(tmp_path, records: list[dict], audio: dict[str, bytes] | None = None, name: str = "m.jsonl"):
    for file, data in (audio or {}).items():
        (tmp_path / file).write_bytes(data)
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("dataio "), err
    for needle in needles:
        assert needle in err, err


# --- hangs: non-regular files -------------------------------------------------------------------------

def test_fifo_in_a_manifest_is_refused_not_waited_on(tmp_path, capsys):
    """Used to hang `dataio shard` forever (with --skip-errors too): the FIFO was opened for its header."""
    os.mkfifo(tmp_path / "pipe.flac")
    records = [{"audio_filepath": "pipe.flac", "duration": 0.1, "text": "x"},
               {"audio_filepath": "a.flac", "duration": 0.1, "text": "y"}]
    manifest = _manifest(tmp_path, records, {"a.flac": flac_bytes()})
    code, err = _cli(capsys, "shard", manifest, "--output", tmp_path / "out", "--quiet")
    _one_line_error(code, err, "m.jsonl:1", "pipe.flac", "not a regular file")
    code, err = _cli(capsys, "shard", manifest, "--output", tmp_path / "out", "--quiet", "--skip-errors", "1")
    assert code == 0, err
    skipped = [json.loads(line) for line in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    assert len(skipped) == 1 and "not a regular file" in skipped[0]["reason"]


def test_fifo_as_an_input_file_is_refused(tmp_path, capsys):
    os.mkfifo(tmp_path / "docs.jsonl")
    code, err = _cli(capsys, "shard", tmp_path / "docs.jsonl", "--output", tmp_path / "out", "--quiet")
    _one_line_error(code, err, "docs.jsonl", "not a regular file")


def test_fifo_in_a_shards_place_is_an_error_not_a_hang(tmp_path, capsys):
    """The loader, `dataio verify` and the tar scan open shards without blocking and refuse non-files."""
    from headrace.dataio.shards.tarscan import TarFormatError, open_tar

    loader_util.make_text_dataset(tmp_path, [10, 10])
    shard = tmp_path / "doc-000001.tar"
    shard.unlink()
    os.mkfifo(shard)
    cfg = {"datasets": [{"path": str(tmp_path)}], "batch_size": 4, "epochs": 1, "num_workers": 0, "shuffle": False}
    with pytest.raises(SampleDecodeError, match=r"doc-000001\.tar'?: not a regular file"):
        list(build_loader(cfg))
    with pytest.raises(TarFormatError, match="not a regular file"):
        open_tar(shard)
    code, err = _cli(capsys, "verify", tmp_path, "--quiet", "--workers", "1")
    assert code == 1 and "doc-000001.tar" in err


# --- silent wrong data: a shard rewritten in place ---------------------------------------------------

def _rewrite_in_place(tmp_path, sizes: list[int], shard: str = "doc-000000.tar") -> None:
    """Overwrite ``shard`` in place (same inode, same size) with a shard of other keys and tokens."""
    loader_util.make_text_dataset(tmp_path / "other", sizes, prefix="dod", seed=1)
    new = (tmp_path / "other" / shard.replace("doc", "dod")).read_bytes()
    path = tmp_path / "d" / shard
    assert len(new) == path.stat().st_size
    with open(path, "r+b") as f:
        f.write(new)


@pytest.mark.parametrize("workers, packed", [(0, False), (2, False), (2, True)])
def test_shard_rewritten_in_place_at_the_same_size_is_an_error(tmp_path, workers, packed):
    """Used to serve the new bytes under the old keys (100 of 800 samples wrong): the token fast path
    checked each block once per loader. Now every read compares the file's (inode, mtime) with the
    version first mapped, in every worker."""
    sizes = [3000, 100] if packed else [400, 400]  # packing reads 256 samples a chunk, workers 2 chunks ahead
    loader_util.make_text_dataset(tmp_path / "d", sizes, seed=0)
    cfg = {"datasets": [{"path": str(tmp_path / "d")}], "batch_size": 8, "epochs": 1, "num_workers": workers,
           "shuffle": False, "max_bad_samples": 0, "prefetch": 1}
    if packed:
        cfg.update(seq_len=64, packing="greedy")
    loader = build_loader(cfg)
    it = iter(loader)
    next(it)
    _rewrite_in_place(tmp_path, sizes)
    with pytest.raises(SampleDecodeError, match=r"doc-000000\.tar'?: shard changed since"):
        for batch in it:
            keys = batch.get("__key__", [])
            assert not any(k.startswith("dod") for k in keys), "new bytes served under the old index"


def test_shard_rewritten_before_a_worker_maps_it_is_an_error(tmp_path):
    """A worker that maps the shard only after the rewrite must not read the new version under checks
    the main process made on the old one: the first version's stamp is shared with the workers."""
    loader_util.make_text_dataset(tmp_path / "d", [400, 400], seed=0)
    cfg = {"datasets": [{"path": str(tmp_path / "d")}], "batch_size": 8, "epochs": 1, "num_workers": 0,
           "shuffle": False, "max_bad_samples": 0}
    loader = build_loader(cfg)
    source = loader.stream.sources[0]
    source.array(0)  # the main process maps shard 0: its stamp is now the loader's
    os.utime(tmp_path / "d" / "doc-000000.tar", ns=(1, 1))  # another version (mtime) before anyone reads on
    source.open_shards._pid = -1  # as a freshly forked worker: the parent's maps forgotten
    with pytest.raises(SampleDecodeError, match="shard changed since the loader first read it"):
        list(loader)


# --- loader states -----------------------------------------------------------------------------------

def _state_cfg(root, **kw):
    return {"datasets": [{"path": str(root)}], "batch_size": 2, "epochs": 1, "num_workers": 0, "shuffle": False,
            **kw}


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.update(consumed=50), r"'consumed' 50 .*reaches position 50, past the end of this data's 20"),
    (lambda s: s["layout"].update(start=50), r"'consumed' 0 \(with 'layout' start 50\) reaches position 50, past"),
    (lambda s: s.update(consumed=10**30), r"'consumed' must be a non-negative integer below 2\*\*62"),
    (lambda s: s.update(seed=2**64), r"'seed' must be a non-negative integer below 2\*\*62"),
    (lambda s: s["layout"].update(start=10**30), r"'layout' must be a mapping"),
    (lambda s: s.update(reseeds=[[1, [10**30]]]), r"'reseeds' must be a list of \[seed, "),  # was accepted
    (lambda s: s.update(reseeds="zz"), r"'reseeds' must be a list of \[seed, "),  # was a bare ValueError
])
def test_loader_state_past_the_end_or_huge_is_refused_naming_the_field(tmp_path, edit, message):
    """Used to be accepted and yield 0 samples (past the end), or OverflowError (huge integers)."""
    loader_util.make_text_dataset(tmp_path, [10, 10])
    state = build_loader(_state_cfg(tmp_path)).state_dict()
    edit(state)
    with pytest.raises(StateError, match=rf"loader state 0: {message}"):
        build_loader(_state_cfg(tmp_path)).load_state_dict(state)


def test_loader_states_of_mixed_dp_sizes_are_refused(tmp_path):
    """Rank 0 of a dp_size-2 run beside rank 1 of a dp_size-3 run used to be accepted (a mix of both)."""
    loader_util.make_text_dataset(tmp_path, [10, 10])
    cfg = _state_cfg(tmp_path)
    a, b = build_loader(cfg, 0, 2).state_dict(), build_loader(cfg, 1, 3).state_dict()
    with pytest.raises(StateError, match=r"loader state 1: 'dp_size' 3 differs from loader state 0's 2"):
        build_loader(cfg, 0, 2).load_state_dict([a, b])
    with pytest.raises(StateError, match=r"loader state 1: 'dp_rank' 0 appears twice"):
        build_loader(cfg, 0, 1).load_state_dict([a, copy.deepcopy(a)])


def test_packing_and_bucketing_sub_states_name_their_field(tmp_path):
    loader_util.make_text_dataset(tmp_path, [10, 10])
    cfg = _state_cfg(tmp_path, seq_len=16, packing="greedy")
    loader = build_loader(cfg)
    next(iter(loader))
    state = loader.state_dict()
    for value in (10**30, 5000):  # IndexError / OverflowError deep in the read before
        bad = copy.deepcopy(state)
        bad["packing"]["open"][0][0][0] = value
        with pytest.raises(StateError, match=rf"packing state: document {value} is not a sample of this data"):
            build_loader(cfg).load_state_dict(bad)
    bad = copy.deepcopy(state)
    bad["packed_batches"] = 10**30
    with pytest.raises(StateError, match="'packed_batches' must be a non-negative integer below 2"):
        build_loader(cfg).load_state_dict(bad)

    audio = tmp_path / "audio"
    _mixed_codec_dataset(audio)
    bucketed = {"datasets": [{"path": str(audio)}], "batch_size": 2, "epochs": 1, "num_workers": 0,
                "bucketing": {"max_duration": 1.0, "num_buckets": 2}}
    state = build_loader(bucketed).state_dict()
    for field, value in (("step", -3), ("epoch", 10**30), ("history", [[10**30, 5]])):  # IndexError, 0 samples
        bad = copy.deepcopy(state)
        bad["bucketing"][field] = value
        with pytest.raises(StateError, match="'bucketing' must be a mapping of epoch"):
            build_loader(bucketed).load_state_dict(bad)
    bad = copy.deepcopy(state)
    bad["bucketing"]["step"] = 1000
    loader = build_loader(bucketed)
    loader.load_state_dict(bad)
    with pytest.raises(StateError, match="bucketing 'step' 1000 is past the"):
        list(loader)


# --- mixed codecs ------------------------------------------------------------------------------------

def _wav_bytes(frames: int, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, np.sin(np.arange(frames) / 5.0).astype(np.float32) * 0.2, rate, format="WAV",
                    subtype="PCM_16")
    return out.getvalue()


def _mixed_codec_dataset(root, n: int = 8) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(root / "d-000000.tar")) as w:
        for i in range(n):
            audio = {"flac": flac_bytes(1600 + 10 * i)} if i % 2 else {"wav": _wav_bytes(1600 + 10 * i)}
            w.write({"__key__": f"k{i}", **audio, "json": json.dumps({"text": f"t{i}"}).encode()})
    loader_util.index_dir(root)


@pytest.mark.parametrize("workers", [0, 2])
def test_mixed_flac_and_wav_members_are_served(tmp_path, workers):
    """Used to die of AttributeError ('NoneType' ... 'sample_rate') in collate; with bucketing KeyError 'flac'."""
    _mixed_codec_dataset(tmp_path)
    cfg = {"datasets": [{"path": str(tmp_path)}], "batch_size": 4, "epochs": 1, "num_workers": workers,
           "shuffle": False, "decode": {"sample_rate": None}}
    batches = list(build_loader(cfg))
    frames = {}
    for b in batches:
        for ext in ("flac", "wav"):
            for key, wave, rate in zip(b["__key__"], b[ext], b["__sample_rate__"][ext]):
                if wave is not None:
                    frames[key] = (ext, wave.shape[0], rate)
    assert frames == {f"k{i}": ("flac" if i % 2 else "wav", 1600 + 10 * i, 16000) for i in range(8)}
    bucketed = {**cfg, "bucketing": {"max_duration": 1.0, "num_buckets": 2}}
    lengths = sorted(n for b in build_loader(bucketed) for n in b["audio_lens"].tolist())
    assert lengths == sorted(1600 + 10 * i for i in range(8))


# --- .npy token members ------------------------------------------------------------------------------

def _npy_dataset(root, odd: np.ndarray, n: int = 8, at: int = 3) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(root / "d-000000.tar")) as w:
        for i in range(n):
            tokens = odd if i == at else np.arange(1, 6, dtype=np.uint16)
            w.write({"__key__": f"k{i}", "tokens.npy": loader_util.npy_bytes(tokens)})
    loader_util.index_dir(root)


ODD_NPY = {
    "fortran": (np.asfortranarray(np.arange(6, dtype=np.uint16).reshape(2, 3)), "1-D integer array"),
    "2d": (np.arange(6, dtype=np.uint16).reshape(2, 3), "1-D integer array"),
    "float": (np.arange(3, dtype=np.float32), "token ids must be integers"),
    "negative": (np.array([1, -5, 3], dtype=np.int32), "negative token id -5"),
}


@pytest.mark.parametrize("name", sorted(ODD_NPY))
def test_odd_npy_token_members_are_counted_bad_samples_when_packing(tmp_path, name):
    """Used to be AttributeError ('list' ... 'clone') or a torch promotion error, uncounted, unnamed."""
    array, message = ODD_NPY[name]
    _npy_dataset(tmp_path, array)
    cfg = {"datasets": [{"path": str(tmp_path)}], "batch_size": 4, "epochs": 1, "num_workers": 0, "shuffle": False,
           "seq_len": 16, "packing": "greedy", "max_bad_samples": 0}
    with pytest.raises(SampleDecodeError, match=rf"d-000000\.tar', key 'k3', member 'tokens\.npy': .*{message}"):
        list(build_loader(cfg))
    batches = list(build_loader({**cfg, "max_bad_samples": 1}))
    assert sum(b["num_docs"] for b in batches) == 7  # the other seven documents, packed


def test_int32_token_members_among_uint16_collate_as_int64(tmp_path):
    """int32 among uint16 used to be torch's "Promotion for uint16 ... not supported"; the ids are kept."""
    _npy_dataset(tmp_path, np.array([70000, 2, 3], dtype=np.int32))
    plain = {"datasets": [{"path": str(tmp_path)}], "batch_size": 4, "epochs": 1, "num_workers": 0, "shuffle": False}
    first = next(iter(build_loader(plain)))
    assert first["tokens.npy"].dtype.is_signed and first["tokens.npy"].tolist()[15:18] == [70000, 2, 3]
    packed = list(build_loader({**plain, "seq_len": 16, "packing": "greedy"}))
    assert any(70000 in b["input_ids"].flatten().tolist() for b in packed)


# --- input files -------------------------------------------------------------------------------------

@pytest.mark.parametrize("line, reason", [
    ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),  # RecursionError
    ('{"text": "a \\ud800 b"}', "lone surrogate"),  # UnicodeEncodeError when written
])
def test_bad_json_lines_are_bad_records(tmp_path, capsys, line, reason):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    code, err = _cli(capsys, "shard", path, "--output", tmp_path / "out", "--quiet")
    _one_line_error(code, err, "docs.jsonl:2", reason)
    code, err = _cli(capsys, "shard", path, "--output", tmp_path / "out", "--quiet", "--skip-errors", "1")
    assert code == 0, err


def test_paired_surrogates_are_text(tmp_path, capsys):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "smile \\ud83d\\ude00"}\n')
    code, err = _cli(capsys, "shard", path, "--output", tmp_path / "out", "--quiet")
    assert code == 0, err


@pytest.mark.parametrize("data, reason", [
    (gzip.compress("".join(json.dumps({"text": str(i * 7919)}) + "\n" for i in range(5000)).encode())[:3000],
     "broken gzip stream (EOFError"),
    (b"not gzip at all\n", "broken gzip stream (BadGzipFile"),
])
def test_truncated_or_fake_gzip_names_the_file(tmp_path, capsys, data, reason):
    path = tmp_path / "docs.jsonl.gz"
    path.write_bytes(data)
    code, err = _cli(capsys, "shard", path, "--output", tmp_path / "out", "--quiet")
    _one_line_error(code, err, "docs.jsonl.gz:", reason)


def test_huge_duration_with_an_offset_is_a_bad_record(tmp_path, capsys):
    """duration 1e308 with an offset used to be an OverflowError traceback."""
    manifest = _manifest(tmp_path, [{"audio_filepath": "a.flac", "duration": 1e308, "offset": 0.5, "text": "x"}],
                         {"a.flac": flac_bytes()})
    code, err = _cli(capsys, "shard", manifest, "--output", tmp_path / "out", "--quiet")
    _one_line_error(code, err, "m.jsonl:1", "'duration' must be at most 1e+07 seconds")


def test_negative_skip_errors_is_refused(tmp_path, capsys):
    """--skip-errors -1 used to be an IndexError once a sample was skipped."""
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "a"}\n{"nope": 1}\n')
    code, err = _cli(capsys, "shard", path, "--output", tmp_path / "out", "--quiet", "--skip-errors", "-1")
    _one_line_error(code, err, "--skip-errors must be >= 0, got -1")


def test_junk_parquet_names_the_file(tmp_path, capsys):
    path = tmp_path / "rows.parquet"
    path.write_bytes(b"PAR1 this is not parquet PAR1")
    code, err = _cli(capsys, "shard", path, "--output", tmp_path / "out", "--quiet")
    _one_line_error(code, err, "rows.parquet: not a readable Parquet file")


def test_flac_of_unknown_length_is_accepted_everywhere(tmp_path, capsys):
    """total_samples 0 (the format's "unknown") used to be refused as "claims 9223372036854775807 frames"."""
    unknown = lying_flac(0, frames=1600)
    manifest = _manifest(tmp_path, [{"audio_filepath": "u.flac", "duration": 0.1, "text": "x"}], {"u.flac": unknown})
    code, err = _cli(capsys, "shard", manifest, "--output", tmp_path / "out", "--quiet")
    assert code == 0, err
    from headrace.dataio.shards.index import load_index

    assert float(load_index(tmp_path / "out").samples["duration"][0]) == pytest.approx(0.1)
    code, err = _cli(capsys, "verify", tmp_path / "out", "--quiet")
    assert code == 0, err
    batch = next(iter(build_loader({"datasets": [{"path": str(tmp_path / "out")}], "batch_size": 1,
                                    "num_workers": 0, "epochs": 1, "decode": {"sample_rate": None}})))
    assert batch["flac"].shape[-1] == 1600


# --- checks that never ran: `dataio verify` decodes every audio frame ---------------------------------

def _damaged(kind: str) -> bytes:
    good = bytearray(flac_bytes(48000))
    if kind == "truncated":
        return bytes(good[: len(good) // 2])  # header intact: says 48000 frames
    good[len(good) // 2] ^= 0xFF  # one flipped byte inside a frame
    return bytes(good)


@pytest.mark.parametrize("kind", ["truncated", "bit-flipped"])
def test_verify_decodes_every_flac_frame(tmp_path, capsys, kind):
    """A FLAC with a damaged frame used to pass verify (headers only) and fail in training
    ("flac decoder lost sync")."""
    from tests.test_energon_interop import make_samples, write_shards
    from headrace.dataio.shards.index import load_index

    samples = make_samples(n=6, seed=2)
    for s in samples:
        s["flac"] = flac_bytes(48000)
    samples[4]["flac"] = _damaged(kind)
    root = tmp_path / "ds"
    write_shards(root, samples, per_shard=3)
    code, err = _cli(capsys, "index", root, "--quiet", "--workers", "1")
    assert code == 0, err
    index = load_index(root)
    code, err = _cli(capsys, "verify", root, "--quiet", "--workers", "1")
    assert code == 1
    assert index.shards[1].name in err and repr(index.key(4)) in err and ".flac" in err
    assert "does not decode" in err


# --- the CLI's journeys ----------------------------------------------------------------------------------

def test_inspect_json_into_a_closed_pipe_is_quiet(tmp_path):
    """`dataio inspect DIR --json | head` used to end in a BrokenPipeError traceback."""
    import subprocess
    import sys
    from pathlib import Path

    loader_util.make_text_dataset(tmp_path, [30, 30])
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "headrace.dataio", "inspect", str(tmp_path), "--json"], cwd=repo,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env())
    proc.stdout.close()  # the reader is gone before the command writes (its imports take far longer)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("verb", ["inspect", "verify"])
def test_missing_directory_is_named_without_the_index_hint(tmp_path, capsys, verb):
    code, err = _cli(capsys, verb, tmp_path / "nope")
    _one_line_error(code, err, f"{tmp_path / 'nope'}: no such directory")
    assert "dataio index" not in err
    code, err = _cli(capsys, verb, tmp_path)  # exists, no index: the hint is the help
    _one_line_error(code, err, "run `dataio index")


def test_bench_prints_a_line_per_measured_config(tmp_path, capsys):
    from tests.test_bench import bench

    loader_util.make_text_dataset(tmp_path / "d", [20, 20])
    capsys.readouterr()
    bench(tmp_path, {"datasets": [{"path": str(tmp_path / "d")}], "batch_size": 8},
          "--compare", "", "--num-workers", "0,1", "--batches", "2", "--repeats", "2")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dataio bench: [")]
    assert [line.split("]")[0] for line in lines] == [f"dataio bench: [{i}/4" for i in range(1, 5)]
    assert all("headrace" in line and "samples" in line for line in lines)


# --- disk full ------------------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (mounting needs root: skipped elsewhere)."""
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def _fill(disk, leave_kib: int) -> None:
    """Fill ``disk`` until ``leave_kib`` KiB are left."""
    st = os.statvfs(disk)
    fill = st.f_bavail * st.f_frsize - leave_kib * 1024
    if fill > 0:
        with open(disk / "filler", "wb") as f:
            f.write(bytes(fill))


def test_disk_full_while_sharding_names_the_shard(small_disk, tmp_path, capsys):
    """Used to be a bare `OSError: [Errno 28] No space left on device` traceback."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"word {i} " * 20}) + "\n" for i in range(3000)))
    code, err = _cli(capsys, "shard", src, "--output", small_disk / "out", "--quiet")
    _one_line_error(code, err, str(small_disk / "out"), "No space left on device (writing the shard)")


def test_disk_full_while_indexing_names_the_file_and_what(small_disk, capsys):
    """sqlite's `OperationalError: database or disk is full` (and ENOSPC elsewhere) named nothing; now
    each point where `dataio index` runs out of space is one line naming the file and what it was."""
    source = small_disk.parent / "src"
    loader_util.make_text_dataset(source, [50])
    seen = set()
    for leave in (8, 16, 24, 32, 48, 64, 400):
        for p in small_disk.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        (small_disk / "d").mkdir()
        shutil.copy(source / "doc-000000.tar", small_disk / "d")
        _fill(small_disk, leave)
        code, err = _cli(capsys, "index", small_disk / "d", "--quiet", "--workers", "1")
        if leave == 400:
            assert code == 0, err  # room enough: the same run succeeds
            continue
        _one_line_error(code, err, str(small_disk / "d"), " (writing ")
        seen.add(err.split(" (writing ")[1])
    assert len(seen) >= 2, seen  # several writers reached, each naming itself


def test_sample_without_the_token_member_is_a_counted_bad_sample_when_packing(tmp_path):
    """Found by tests/fuzz.py ("mixed"): a sample without the dataset's .npy member was a KeyError (or
    'list' ... 'clone') inside the packer."""
    tmp_path.mkdir(exist_ok=True)
    with wds.TarWriter(str(tmp_path / "d-000000.tar")) as w:
        for i in range(6):
            member = {"flac": flac_bytes(800, 8000)} if i == 2 else {"tokens.npy": loader_util.npy_bytes(
                np.arange(1, 5, dtype=np.uint16))}
            w.write({"__key__": f"k{i}", **member})
    loader_util.index_dir(tmp_path)
    cfg = {"datasets": [{"path": str(tmp_path)}], "batch_size": 2, "epochs": 1, "num_workers": 0, "shuffle": False,
           "seq_len": 8, "packing": "greedy", "max_bad_samples": 0}
    with pytest.raises(SampleDecodeError, match=r"key 'k2', member 'tokens\.npy': no tokens\.npy member"):
        list(build_loader(cfg))
    assert sum(b["num_docs"] for b in build_loader({**cfg, "max_bad_samples": 1})) == 5
