"""Bad input on the preparation side, each example of issues 16 and 25 at the mechanism that now refuses it,
through the real entry point (the ``dataio`` CLI in-process, or the library call it makes): tar headers, lying
audio headers, manifest numbers and malformed input files, non-regular files (FIFOs), the output-directory lock,
bounded tokenizer memory, ``dataio verify`` decoding every audio frame, disk full, and the CLI's journeys (one-line
errors, broken pipe, hints). The loader side is test_bad_input_loader.py."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile

from headrace.dataio import build_loader
from headrace.dataio.cli import main as dataio_main
from headrace.dataio.config import DecodeConfig
from headrace.dataio.shards.audioheader import probe
from headrace.dataio.shards.tarscan import MAX_MEMBERS, TarFormatError, scan_buffer
from headrace.dataio.verify import decode_check
from headrace.dataio.stream.reading.decode import decode_sample
from headrace.dataio.usererror import SampleDecodeError
from headrace.dataio.usererror import CommandError
from tests import loader_util
from tests.helpers import child_env
from tests.hostile import NAME, SIZE, base256, fix_checksum, flac_bytes, lying_flac, make_tar, pax_tar, set_field
from tests.test_energon_interop import make_samples, run_verb, write_shards


def _scan(data: bytes):
    return scan_buffer(data, "s.tar", path="s.tar")


# --- 1. tar headers ------------------------------------------------------------------------------

TWO = make_tar([("a.txt", b"x" * 700), ("b.txt", b"y" * 10)])


@pytest.mark.parametrize(
    "size_field, message",
    [
        (base256(-1), "size is negative"),  # GNU base-256 negative: used to stop advancing and loop forever
        (base256(-(1 << 40)), "size is negative"),
        (b"-0000001\0", "not an octal number"),  # negative octal text: used to be a misleading checksum error
        (b"12x45\0", "not an octal number"),  # garbage text: used to be a bare ValueError naming no shard
        (b"99999\0", "not an octal number"),
        (base256(1 << 60), "truncated tar"),
    ],
)
def test_bad_size_fields_are_format_errors_at_the_header(size_field, message):
    bad = set_field(TWO, 0, SIZE, size_field)
    with pytest.raises(TarFormatError, match=message) as e:
        _scan(bad)
    assert e.value.path == "s.tar" and e.value.offset == 0
    assert str(e.value).startswith("s.tar: byte 0: ")


@pytest.mark.parametrize(
    "records, message",
    [
        ({"size": "-5"}, "PAX size '-5'"),  # used to hang `dataio index` with memory growing
        ({"size": "garbage"}, "PAX size 'garbage'"),
        ({"size": str(1 << 50)}, "truncated tar"),
    ],
)
def test_pax_size_is_validated(records, message):
    with pytest.raises(TarFormatError, match=message) as e:
        _scan(pax_tar(records))
    assert "member 'k.txt'" in str(e.value)


def test_malformed_pax_records_end_instead_of_looping():
    data = bytearray(pax_tar({"comment": "abc"}))
    start = 512  # the PAX payload follows its header: "15 comment=abc\n"; its length becomes "00"
    assert data[start : start + 2] == b"15"
    data[start : start + 2] = b"00"  # a zero length never advanced the old record loop
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

    def no_memory(self, *args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(soundfile.SoundFile, "read", no_memory)
    with pytest.raises(
        SampleDecodeError,
        match=r"key 'k', member 'flac': ValueError: cannot allocate the 0\.0 GiB its header "
        r"declares \(1600 frames x 1 channels\)",
    ):
        decode_sample({"flac": flac_bytes()}, DecodeConfig(), key="k")


def test_max_duration_is_the_same_check():
    with pytest.raises(SampleDecodeError, match="over decode.max_duration=0.05"):
        decode_sample({"flac": flac_bytes(1600)}, DecodeConfig(max_duration=0.05), key="k")


def _shard_cmd(*argv) -> int:
    from headrace.dataio.commands import shard as shard_cmd

    parser = argparse.ArgumentParser()
    shard_cmd.add_arguments(parser)
    return shard_cmd.run(parser.parse_args([str(a) for a in argv] + ["--quiet"]))


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


@pytest.mark.parametrize(
    "duration, message",
    [
        (0, "'duration' must be positive for a segment"),  # used to write a 0-byte audio member
        (float("inf"), "'duration' must be a finite non-negative number, got inf"),  # used to be an OverflowError
        (float("nan"), "'duration' must be a finite non-negative number, got nan"),  # "cannot convert float NaN"
    ],
)
def test_manifest_segment_numbers_are_checked_at_planning(tmp_path, duration, message):
    manifest = _manifest(
        tmp_path,
        [{"audio_filepath": "a.flac", "duration": duration, "offset": 0.01, "text": "x"}],
        {"a.flac": flac_bytes()},
    )
    with pytest.raises(CommandError, match=rf"m\.jsonl:1: field {message}"):
        _shard_cmd(manifest, "--output", tmp_path / "out")


# --- 5. concurrency: the output-directory lock, temps of a killed index ------------------------------


def _hold_lock(root, node):
    """A separate process holding the lock of ``root`` (POSIX locks never conflict within one process)."""
    import subprocess
    import sys

    code = (
        "import sys, time; from pathlib import Path; from headrace.dataio.shards.outdir import lock_output; "
        f"f = lock_output(Path({str(root)!r}), node={node!r}, command='test'); print('locked', flush=True); "
        "sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
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
    stale = [
        meta / ".index.sqlite.tmp-4242",
        meta / "parts" / ".shard-000000.tar.npz.tmp-4242",
        tmp_path / "shard-000001.tar.idx.tmp-host-4242",
        meta / "headrace.tmp-4242" / "samples.npy",
        meta / "headrace.old-4242" / "keys.npy",
    ]
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
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[1],
    )
    tokens, growth_mb = map(int, out.stdout.split())
    assert tokens > 800_000 and growth_mb < 250, (tokens, growth_mb, out.stderr[-2000:])


def test_manifest_audio_path_must_be_a_string(tmp_path):
    """Found by tests/fuzz.py: a number as audio_filepath was a TypeError from os.path."""
    manifest = _manifest(tmp_path, [{"audio_filepath": 7, "duration": 1, "text": "x"}], {})
    with pytest.raises(CommandError, match=r"m\.jsonl:1: field 'audio_filepath' must be a non-empty string, got 7"):
        _shard_cmd(manifest, "--output", tmp_path / "out")


# --- the CLI in-process, and the input files of issue 25 ------------------------------------------------


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


def test_fifo_in_a_manifest_is_refused_not_waited_on(tmp_path, capsys):
    """Used to hang `dataio shard` forever (with --skip-errors too): the FIFO was opened for its header."""
    os.mkfifo(tmp_path / "pipe.flac")
    records = [
        {"audio_filepath": "pipe.flac", "duration": 0.1, "text": "x"},
        {"audio_filepath": "a.flac", "duration": 0.1, "text": "y"},
    ]
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


@pytest.mark.parametrize(
    "line, reason",
    [
        ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),  # RecursionError
        ('{"text": "a \\ud800 b"}', "lone surrogate"),  # UnicodeEncodeError when written
    ],
)
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


@pytest.mark.parametrize(
    "data, reason",
    [
        (
            gzip.compress("".join(json.dumps({"text": str(i * 7919)}) + "\n" for i in range(5000)).encode())[:3000],
            "broken gzip stream (EOFError",
        ),
        (b"not gzip at all\n", "broken gzip stream (BadGzipFile"),
    ],
)
def test_truncated_or_fake_gzip_names_the_file(tmp_path, capsys, data, reason):
    path = tmp_path / "docs.jsonl.gz"
    path.write_bytes(data)
    code, err = _cli(capsys, "shard", path, "--output", tmp_path / "out", "--quiet")
    _one_line_error(code, err, "docs.jsonl.gz:", reason)


def test_huge_duration_with_an_offset_is_a_bad_record(tmp_path, capsys):
    """duration 1e308 with an offset used to be an OverflowError traceback."""
    manifest = _manifest(
        tmp_path,
        [{"audio_filepath": "a.flac", "duration": 1e308, "offset": 0.5, "text": "x"}],
        {"a.flac": flac_bytes()},
    )
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
    batch = next(
        iter(
            build_loader(
                {
                    "datasets": [{"path": str(tmp_path / "out")}],
                    "batch_size": 1,
                    "num_workers": 0,
                    "epochs": 1,
                    "decode": {"sample_rate": None},
                }
            )
        )
    )
    assert batch["flac"].shape[-1] == 1600


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


def test_inspect_json_into_a_closed_pipe_is_quiet(tmp_path):
    """`dataio inspect DIR --json | head` used to end in a BrokenPipeError traceback."""
    import subprocess
    import sys
    from pathlib import Path

    loader_util.make_text_dataset(tmp_path, [30, 30])
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "headrace.dataio", "inspect", str(tmp_path), "--json"],
        cwd=repo,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env(),
    )
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
    bench(
        tmp_path,
        {"datasets": [{"path": str(tmp_path / "d")}], "batch_size": 8},
        "--compare",
        "",
        "--num-workers",
        "0,1",
        "--batches",
        "2",
        "--repeats",
        "2",
    )
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dataio bench: [")]
    # headrace and headrace-full (its full batch layout) x 2 worker counts x 2 repeats
    assert [line.split("]")[0] for line in lines] == [f"dataio bench: [{i}/8" for i in range(1, 9)]
    assert all("headrace" in line and "samples" in line for line in lines)


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
