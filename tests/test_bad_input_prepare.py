"""Regression tests of issue 16 (hostile input), data side: every example of the issue, each at the
mechanism that now refuses it -- tar headers, lying audio headers, manifest numbers, shards that shrink
under a mapping, loader states for other data, the output-directory lock, bounded tokenizer memory."""

from __future__ import annotations

import argparse
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from headrace.dataio.usererror import CommandError
from headrace.dataio.stream.decode import SampleDecodeError, decode_sample
from headrace.dataio.config import DecodeConfig
from headrace.dataio.shards.audioheader import probe
from headrace.dataio.shards.tarscan import MAX_MEMBERS, TarFormatError, decode_check, scan_buffer
from tests.hostile import NAME, SIZE, base256, fix_checksum, flac_bytes, lying_flac, make_tar, pax_tar, set_field
from tests.test_energon_interop import make_samples, run_verb, write_shards


def _scan(data: bytes):
    return scan_buffer(data, "s.tar", path="s.tar")


# --- 1. tar headers ------------------------------------------------------------------------------

TWO = make_tar([("a.txt", b"x" * 700), ("b.txt", b"y" * 10)])


@pytest.mark.parametrize("size_field, message", [
    (base256(-1), "size is negative"),  # GNU base-256 negative: used to stop advancing and loop forever
    (base256(-(1 << 40)), "size is negative"),
    (b"-0000001\0", "not an octal number"),  # negative octal text: used to be a misleading checksum error
    (b"12x45\0", "not an octal number"),  # garbage text: used to be a bare ValueError naming no shard
    (b"99999\0", "not an octal number"),
    (base256(1 << 60), "truncated tar"),
])
def test_bad_size_fields_are_format_errors_at_the_header(size_field, message):
    bad = set_field(TWO, 0, SIZE, size_field)
    with pytest.raises(TarFormatError, match=message) as e:
        _scan(bad)
    assert e.value.path == "s.tar" and e.value.offset == 0
    assert str(e.value).startswith("s.tar: byte 0: ")


@pytest.mark.parametrize("records, message", [
    ({"size": "-5"}, "PAX size '-5'"),  # used to hang `dataio index` with memory growing
    ({"size": "garbage"}, "PAX size 'garbage'"),
    ({"size": str(1 << 50)}, "truncated tar"),
])
def test_pax_size_is_validated(records, message):
    with pytest.raises(TarFormatError, match=message) as e:
        _scan(pax_tar(records))
    assert "member 'k.txt'" in str(e.value)


def test_malformed_pax_records_end_instead_of_looping():
    data = bytearray(pax_tar({"comment": "abc"}))
    start = 512  # the PAX payload follows its header: "15 comment=abc\n"; its length becomes "00"
    assert data[start:start + 2] == b"15"
    data[start:start + 2] = b"00"  # a zero length never advanced the old record loop
    with pytest.raises(TarFormatError, match="malformed PAX header record"):
        _scan(bytes(data))


def test_non_utf8_member_name_names_the_byte():
    data = set_field(TWO, 1024 + 512, NAME, b"b\xff\xfe.txt")  # second member's header
    with pytest.raises(TarFormatError, match=r"member name b'b\\xff\\xfe.txt' is not UTF-8") as e:
        _scan(data)
    assert e.value.offset == 1024 + 512


def test_70000_extensions_in_one_sample_is_a_format_error():
    data = bytearray(tarfile.TarInfo("key.e").tobuf(tarfile.USTAR_FORMAT) * (MAX_MEMBERS + 5) + bytes(1024))
    for i in range(MAX_MEMBERS + 5):  # empty members key.e0, key.e1, ...: one header each
        name = f"key.e{i}".encode()
        data[i * 512 : i * 512 + len(name)] = name
        fix_checksum(data, i * 512)
    with pytest.raises(TarFormatError, match=f"sample 'key' has more than {MAX_MEMBERS} members"):
        _scan(bytes(data))


def test_index_command_reports_a_negative_size_as_one_line(tmp_path, capsys):
    samples = make_samples(n=4, seed=3)
    write_shards(tmp_path, samples, per_shard=2)
    path = tmp_path / "shard-000001.tar"
    path.write_bytes(set_field(path.read_bytes(), 0, SIZE, base256(-7)))
    assert run_verb("index", str(tmp_path), "--quiet", "--workers", "1") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "shard-000001.tar: byte 0: " in err and "size is negative" in err


# --- 2. audio headers ------------------------------------------------------------------------------

def test_lying_flac_is_refused_by_every_reader():
    bad = lying_flac((1 << 36) - 1)
    with pytest.raises(ValueError, match="more than any codec stores"):
        probe(bad)  # dataio shard (kept files), dataio index (durations)
    assert "more than any codec stores" in decode_check("flac", bad)  # dataio verify
    with pytest.raises(SampleDecodeError, match=r"key 'k', member 'flac': .*more than any codec"):
        decode_sample({"flac": bad}, DecodeConfig(), key="k", shard="s.tar")  # the loader: a counted bad sample
    assert probe(flac_bytes()) == (16000, 1600)  # an honest header passes


def test_memory_error_for_a_declared_size_is_the_samples_fault(monkeypatch):
    """A header within the byte ceiling can still declare more than fits in memory: that MemoryError
    is a counted bad sample naming the declared size (it used to be re-raised, naming nothing)."""
    import soundfile

    def no_memory(self, *args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(soundfile.SoundFile, "read", no_memory)
    with pytest.raises(SampleDecodeError, match=r"key 'k', member 'flac': ValueError: cannot allocate the 0\.0 GiB its header "
                                                r"declares \(1600 frames x 1 channels\)"):
        decode_sample({"flac": flac_bytes()}, DecodeConfig(), key="k")


def test_max_duration_is_the_same_check():
    with pytest.raises(SampleDecodeError, match="over decode.max_duration=0.05"):
        decode_sample({"flac": flac_bytes(1600)}, DecodeConfig(max_duration=0.05), key="k")


def _shard_cmd(*argv) -> int:
    from headrace.dataio.commands import shard as shard_cmd

    parser = argparse.ArgumentParser()
    shard_cmd.add_arguments(parser)
    return shard_cmd.run(parser.parse_args([str(a) for a in argv] + ["--quiet"]))


def _manifest(tmp_path, records: list[dict], audio: dict[str, bytes]):
    for name, data in audio.items():
        (tmp_path / name).write_bytes(data)
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_shard_refuses_a_lying_flac_and_skips_it_under_budget(tmp_path):
    records = [{"audio_filepath": f"u{i}.flac", "duration": 0.1, "text": "hi"} for i in range(4)]
    audio = {f"u{i}.flac": flac_bytes() for i in range(4)}
    audio["u2.flac"] = lying_flac((1 << 36) - 1)
    manifest = _manifest(tmp_path, records, audio)
    with pytest.raises(CommandError, match=r"m\.jsonl:3: .*u2\.flac: header claims"):
        _shard_cmd(manifest, "--output", tmp_path / "out")
    assert _shard_cmd(manifest, "--output", tmp_path / "out", "--skip-errors", "1") == 0
    from headrace.dataio.shards.index import load_index

    index = load_index(tmp_path / "out")
    assert len(index) == 3 and float(np.nansum(index.samples["duration"])) == pytest.approx(0.3)


@pytest.mark.parametrize("duration, message", [
    (0, "'duration' must be positive for a segment"),  # used to write a 0-byte audio member
    (float("inf"), "'duration' must be a finite non-negative number, got inf"),  # used to be an OverflowError
    (float("nan"), "'duration' must be a finite non-negative number, got nan"),  # "cannot convert float NaN"
])
def test_manifest_segment_numbers_are_checked_at_planning(tmp_path, duration, message):
    manifest = _manifest(tmp_path, [{"audio_filepath": "a.flac", "duration": duration, "offset": 0.01, "text": "x"}],
                         {"a.flac": flac_bytes()})
    with pytest.raises(CommandError, match=rf"m\.jsonl:1: field {message}"):
        _shard_cmd(manifest, "--output", tmp_path / "out")


# --- 5. concurrency: the output-directory lock, temps of a killed index ------------------------------

def _hold_lock(root, node):
    """A separate process holding the lock of ``root`` (POSIX locks never conflict within one process)."""
    import subprocess
    import sys

    code = ("import sys, time; from pathlib import Path; from headrace.dataio.shards.outdir import lock_output; "
            f"f = lock_output(Path({str(root)!r}), node={node!r}, command='test'); print('locked', flush=True); "
            "sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_writer_is_refused_up_front_and_a_dead_holder_leaves_no_lock(tmp_path):
    from headrace.dataio.shards.outdir import OutputLocked, lock_output

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5)))
    out = tmp_path / "out"
    holder = _hold_lock(out, 0)  # a running `dataio shard` for node 0
    try:
        with pytest.raises(OutputLocked, match="is being written by another `dataio shard` or `dataio index`"):
            _shard_cmd(src, "--output", out)
        assert not list(out.glob("*.tar"))  # refused before anything was written
        with pytest.raises(OutputLocked, match="being written by another"):
            run_verb_raising("index", out)
        lock_output(out, node=1, command="dataio shard").close()  # node 1 of the same job may write beside it
    finally:
        holder.kill()  # kill -9: the kernel drops the lock
        holder.wait()
    assert _shard_cmd(src, "--output", out) == 0


def run_verb_raising(verb: str, *argv):
    import importlib

    module = importlib.import_module(f"headrace.dataio.commands.{verb}")
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return module.run(parser.parse_args([str(a) for a in argv] + ["--quiet", "--workers", "1"]))


def test_index_removes_every_temp_a_killed_run_left(tmp_path):
    write_shards(tmp_path, make_samples(n=4, seed=5), per_shard=2)
    assert run_verb("index", str(tmp_path), "--quiet", "--workers", "1") == 0
    meta = tmp_path / ".nv-meta"
    stale = [meta / ".index.sqlite.tmp-4242", meta / "parts" / ".shard-000000.tar.npz.tmp-4242",
             tmp_path / "shard-000001.tar.idx.tmp-host-4242", meta / "headrace.tmp-4242" / "samples.npy",
             meta / "headrace.old-4242" / "keys.npy"]
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"left by kill -9")
    assert run_verb("index", str(tmp_path), "--quiet", "--workers", "1") == 0
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name or ".old-" in p.name]


# --- 8. the dataio CLI: input errors are one line, bugs keep their traceback --------------------------

def test_cli_output_errors_are_one_line(tmp_path, capsys, monkeypatch):
    from headrace.dataio.cli import main

    src = tmp_path / "docs.jsonl"
    src.write_text(json.dumps({"text": "x"}) + "\n")
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["shard", str(src), "--output", str(afile), "--quiet"]) == 2
    assert capsys.readouterr().err == f"dataio shard: error: --output {afile} is a file, not a directory\n"
    assert main(["shard", str(src), "--output", str(afile / "sub"), "--quiet"]) == 2
    assert capsys.readouterr().err == f"dataio shard: error: {afile / 'sub'}: Not a directory\n"

    def read_only(self, *a, **k):  # what a read-only directory answers (tests run as root, which bypasses it)
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert main(["shard", str(src), "--output", str(tmp_path / "ro"), "--quiet"]) == 2
    assert capsys.readouterr().err == f"dataio shard: error: {tmp_path / 'ro'}: Permission denied\n"
    with pytest.raises(PermissionError):
        main(["--debug", "shard", str(src), "--output", str(tmp_path / "ro"), "--quiet"])


def test_cli_bug_keeps_its_traceback(tmp_path, monkeypatch):
    from headrace.dataio.cli import main
    from headrace.dataio.commands import inspect as inspect_cmd

    def bug(args):
        raise KeyError("a bug")

    monkeypatch.setattr(inspect_cmd, "run", bug)
    with pytest.raises(KeyError):
        main(["inspect", str(tmp_path)])


# --- 3. shards that shrink under a running loader ------------------------------------------------------

def _loader_cfg(root, **kw):
    return {"datasets": [{"path": str(root)}], "batch_size": 4, "epochs": 1, "num_workers": 0, "shuffle": False,
            "max_bad_samples": 0, **kw}


@pytest.mark.parametrize("workers", [0, 2])
def test_shard_truncated_under_the_loader_is_its_error_not_sigbus(tmp_path, workers):
    """Used to die of SIGBUS with no message (num_workers 0) or report "workers are out of shared memory"."""
    import itertools
    import os

    from tests import loader_util
    from headrace.dataio import build_loader

    # shard 0 long enough (500 batches) that workers reading a task of several batches ahead are still in it
    loader_util.make_text_dataset(tmp_path, [2000, 40])
    loader = build_loader(_loader_cfg(tmp_path, num_workers=workers, prefetch=1))
    it = iter(loader)
    next(it)
    os.truncate(tmp_path / "doc-000000.tar", 4096)  # the shard being read (mapped in this process or a worker)
    # a worker may not have mapped it yet: then the open-time size check names it
    shrank = r"shard shrank to 4096 bytes while mapped" + ("" if workers == 0 else r"|truncated shard: 4096 bytes")
    with pytest.raises(SampleDecodeError, match=rf"doc-000000\.tar'?: ({shrank})"):
        list(itertools.islice(it, 600))


# --- 4. loader states: fingerprint of the data's identity, every field checked ---------------------------

def test_state_of_a_dataset_rebuilt_in_place_with_the_same_count_is_refused(tmp_path):
    from tests import loader_util
    from headrace.dataio import build_loader
    from headrace.dataio.loader_state import StateError

    loader_util.make_text_dataset(tmp_path / "d", [10, 10], seed=0)
    loader = build_loader(_loader_cfg(tmp_path / "d"))
    next(iter(loader))
    state = loader.state_dict()
    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(tmp_path / "d", copy)  # the same data elsewhere: still this state's data
    build_loader(_loader_cfg(copy)).load_state_dict(state)
    loader_util.make_text_dataset(tmp_path / "d", [10, 10], seed=1)  # rebuilt in place: 20 other samples
    with pytest.raises(StateError, match="comes from other data"):
        build_loader(_loader_cfg(tmp_path / "d")).load_state_dict(state)


@pytest.mark.parametrize("field, value, message", [
    ("consumed", -50, "'consumed' must be a non-negative integer, got -50"),  # was numpy's message
    ("consumed", "12", "'consumed' must be a non-negative integer, got '12'"),
    ("bad_samples", 1.5, "'bad_samples' must be a non-negative integer"),
    ("dp_size", 0, "'dp_size' must be an integer above dp_rank 0, got 0"),
    ("layout", None, "'layout' must be a mapping"),
    ("seed", -1, "'seed' must be a non-negative integer, got -1"),  # found by the fuzzer: numpy's message
    ("bad_samples", 1, "already counts 1 bad samples, over max_bad_samples=0"),  # fuzzer: "see the warnings"
    ("layout", {"start": 0, "dp_size": 1, "skips": [{"start": 0, "dp_size": 2, "consumed": [1]}]},
     "'layout' must be a mapping of start"),
])
def test_hand_edited_loader_state_names_the_field(tmp_path, field, value, message):
    from tests import loader_util
    from headrace.dataio import build_loader
    from headrace.dataio.loader_state import StateError

    loader_util.make_text_dataset(tmp_path, [8])
    state = build_loader(_loader_cfg(tmp_path)).state_dict()
    state[field] = value
    with pytest.raises(StateError, match=rf"loader state 0: {message}"):
        build_loader(_loader_cfg(tmp_path)).load_state_dict(state)


# --- 6. tokenizing a huge document: bounded memory, the same ids ------------------------------------

def test_long_texts_are_encoded_in_bounded_pieces_with_the_same_ids(tmp_path):
    from tokenizers import Tokenizer

    from headrace.dataio.prepare.tokenize import encode_texts, split_text
    from tests.test_shard import sentence, write_tokenizer

    tok = Tokenizer.from_file(str(write_tokenizer(tmp_path)))
    texts = [" ".join(sentence(i, 30) for i in range(40)), "short one", "x" * 300 + " tail", ""]
    calls = []
    real = tok.encode_batch

    class Spy:
        def encode_batch(self, pieces, add_special_tokens):
            calls.append(sum(map(len, pieces)))
            return real(pieces, add_special_tokens=add_special_tokens)

    got = encode_texts(Spy(), texts, np.dtype("<u2"), limit=200)
    assert max(calls) <= 200 and len(calls) > 10  # never more than `limit` characters per encode call
    for text, ids in zip(texts[:2], got):  # cut before spaces: exactly the ids of one whole encode
        assert ids.tolist() == tok.encode(text, add_special_tokens=False).ids
    assert "".join(split_text(texts[2], 200)) == texts[2]  # a 300-char word is cut hard, nothing lost
    assert got[3].tolist() == [] and got[0].dtype == np.dtype("<u2")


def test_one_huge_document_stays_under_a_memory_ceiling(tmp_path):
    """A 50 MB document used to peak at 6.5 GB RSS (~130 bytes a character). At 4 MB one whole encode
    would add ~500 MB; in ~1M-character pieces the peak grows by less than half of that (the 50 MB
    figures are tools/bench_tokenize_memory.py's)."""
    import subprocess
    import sys

    from tests.test_shard import write_tokenizer

    path = write_tokenizer(tmp_path)
    code = f"""
import resource, numpy as np
from tokenizers import Tokenizer
from headrace.dataio.prepare.tokenize import encode_texts
tok = Tokenizer.from_file({str(path)!r})
text = ("the quick brown fox jumps over a lazy dog " * 100_000)[:4_000_000]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ids = encode_texts(tok, [text], np.dtype("<u2"))[0]
print(len(ids), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[1])
    tokens, growth_mb = map(int, out.stdout.split())
    assert tokens > 800_000 and growth_mb < 250, (tokens, growth_mb, out.stderr[-2000:])


def test_manifest_audio_path_must_be_a_string(tmp_path):
    """Found by tests/fuzz.py: a number as audio_filepath was a TypeError from os.path."""
    manifest = _manifest(tmp_path, [{"audio_filepath": 7, "duration": 1, "text": "x"}], {})
    with pytest.raises(CommandError, match=r"m\.jsonl:1: field 'audio_filepath' must be a non-empty string, got 7"):
        _shard_cmd(manifest, "--output", tmp_path / "out")


def test_worker_killed_by_sigbus_is_the_shrunk_shards_error(tmp_path, monkeypatch):
    """A worker that dies of SIGBUS (the shard shrank between the size check and the copy) is reported
    as the shard's error, not as the signal: the main process stats the shards once a worker dies so."""
    import faulthandler
    import os
    import signal

    from tests import loader_util
    from headrace.dataio import build_loader
    from headrace.dataio.stream.batches import BatchMaker
    from headrace.dataio.stream.storage import ShardFormatError

    loader_util.make_text_dataset(tmp_path, [40, 40])
    made = BatchMaker.__call__

    def truncate_then_die(self, b, alloc):  # forked workers inherit the patch
        if b == 3:
            os.truncate(tmp_path / "doc-000001.tar", 4096)
            faulthandler.disable()  # pytest's handler, inherited by the fork, would print every module's name
            os.kill(os.getpid(), signal.SIGBUS)
        return made(self, b, alloc)

    monkeypatch.setattr(BatchMaker, "__call__", truncate_then_die)
    loader = build_loader(_loader_cfg(tmp_path, num_workers=2, prefetch=1))
    with pytest.raises(ShardFormatError, match=r"doc-000001\.tar.*truncated shard: 4096 bytes"):
        list(loader)
