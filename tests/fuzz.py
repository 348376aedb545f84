"""Fuzzing harness (issue 16): random mutations of every untrusted input, one property for all.

Targets: tar shards (header bytes, size fields, PAX records, names, truncation), ``.npy`` members,
FLAC/WAV headers, NeMo manifest lines, loader states and trainer configs; and (issue 25) shards
rewritten in place under a running loader, manifests naming non-regular files (FIFO, directory,
device), datasets mixing codecs and odd ``.npy`` token layouts, and ``dataio shard`` / ``dataio index``
on a nearly full disk (a 1 MiB tmpfs; the target is left out where mounting one is not allowed); and (issue 34) a
finished run's checkpoint directory mutated then resumed and evaluated, pretrained directories (config, weights,
a duplicate weights file, links out), Qwen2-Audio checkpoint directories through the converter (mutated files,
looping chat templates, links out), the SLURM launcher's overrides with shell-active text (run through the
per-node bash), and symbolic links at the names the trainer writes under output_dir; and (issue 46,
``tests/fuzz_issue46.py``) the checkpoint reader on resealed damage, the LoRA adapter loader, the index files under
``dataio verify`` / ``get``, and the speech recipe's manifest and ``--minutes``. The property is the same
for each: the code under test returns a correct result, or raises the input's own error type (a
format/sample/state/config error whose message names the place), never anything else -- and never
hangs (``CASE_SECONDS`` per case, enforced by SIGALRM) nor grows without bound (the whole run lives
under an ``RLIMIT_DATA`` ceiling, so a runaway allocation is a MemoryError and fails its case).

``tests/test_fuzz.py`` runs a fixed, derandomized seed set in CI (``FAST_EXAMPLES`` cases a target,
a few seconds). ``python -m tests.fuzz --long --minutes N`` runs fresh random cases until the time is
up, keeps going past failures, and prints how long it ran, how many cases and every distinct failure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz_issue46 import issue46_targets
from tests.hostile import flac_bytes, make_tar

CASE_SECONDS = 20  # generous: a loaded 2-core CI machine runs a normal case 10x slower than idle
RUN_CASE_SECONDS = 120  # a case that runs the trainer (and eval) end to end, on a machine shared by ~8 jobs
MEMORY_CEILING = 6 << 30  # RLIMIT_DATA of a fuzz process (torch and numpy included)
FAST_EXAMPLES = 60
# the targets that build a loader or run a command per case (~0.5-2 s each): fewer cases in CI
SLOW_EXAMPLES = {
    "inplace": 6,
    "nonregular": 8,
    "mixed": 8,
    "diskfull": 8,
    # issue 34: a trainer / eval / converter run per case
    "ckptdir": 2,
    "pretrained": 3,
    "speechckpt": 6,
    "links": 4,
    "launcher": 20,
    # issue 46: a checkpoint load / adapter load (one-rank group, in a child) or dataio verify + get per case
    "ckptreader": 6,
    "adapter": 6,
    "indexfiles": 15,
}


class Hang(Exception):
    pass


@contextmanager
def time_limit(seconds: int = CASE_SECONDS):
    def fire(signum, frame):
        raise Hang(f"case ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def limit_memory(ceiling: int = MEMORY_CEILING) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (min(ceiling, hard) if hard != resource.RLIM_INFINITY else ceiling, hard))


# --- mutations ---------------------------------------------------------------------------------------


@st.composite
def mutated(draw, base: bytes, *, hot: list[tuple[int, int]] | None = None):
    """``base`` with a few byte edits (biased to the ``hot`` ranges: headers), insertions, or a cut."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["byte", "field", "cut", "insert"]))
        if kind == "cut":
            del data[draw(st.integers(0, len(data))) :]
            continue
        if not data:
            break
        if hot and draw(st.booleans()):
            lo, hi = draw(st.sampled_from(hot))
            lo, hi = min(lo, len(data) - 1), min(hi, len(data))
        else:
            lo, hi = 0, len(data)
        at = draw(st.integers(lo, max(lo, hi - 1)))
        if kind == "byte":
            data[at] = draw(st.integers(0, 255))
        elif kind == "field":
            value = draw(st.binary(min_size=1, max_size=12))
            data[at : at + len(value)] = value
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=64))
    return bytes(data)


def _fix_checksums(data: bytes) -> bytes:
    """Recompute every 512-byte header's checksum, so mutations reach the fields behind it."""
    out = bytearray(data)
    for pos in range(0, len(out) - 511, 512):
        block = out[pos : pos + 512]
        if block[257:262] == b"ustar" or block[156:157] in (b"x", b"g", b"L", b"0"):
            block[148:156] = b" " * 8
            out[pos + 148 : pos + 156] = b"%06o\0 " % sum(block)
    return bytes(out)


def _tar_base() -> bytes:
    out = make_tar([("k1.txt", b"hello"), ("k1.json", b'{"a": 1}')], tarfile.PAX_FORMAT)
    info = tarfile.TarInfo("dir/" + "long" * 40 + ".tokens.npy")
    info.pax_headers = {"comment": "fuzz"}
    import io

    npy = io.BytesIO()
    np.save(npy, np.arange(7, dtype=np.uint16))
    info.size = len(npy.getvalue())
    extra = io.BytesIO()
    with tarfile.open(fileobj=extra, mode="w", format=tarfile.GNU_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(npy.getvalue()))
    return out[:-1024] + extra.getvalue()  # one archive: drop the first end-of-archive blocks


TAR = _tar_base()
TAR_HEADERS = [(p, p + 512) for p in range(0, len(TAR), 512)][:12]


def check_tar(data: bytes) -> None:
    from headrace.dataio.shards.tarscan import TarFormatError, scan_buffer

    try:
        part = scan_buffer(data, "f.tar", path="f.tar")
    except TarFormatError as e:
        assert str(e).startswith("f.tar: byte ") and 0 <= e.offset <= len(data), str(e)
        return
    members = part.members
    assert all(int(m["offset"]) + int(m["size"]) <= len(data) for m in members)
    assert (np.diff(part.samples["offset"].astype(np.int64)) > 0).all()


# --- npy / audio ------------------------------------------------------------------------------------


def _npy(array) -> bytes:
    import io

    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


NPY = _npy(np.arange(20, dtype=np.int32))
WAV = None  # built lazily (soundfile)


def check_member(ext: str, data: bytes) -> None:
    from headrace.dataio.stream.reading.decode import Audio, decode_sample
    from headrace.dataio.usererror import SampleDecodeError
    from headrace.dataio.config import DecodeConfig
    from headrace.dataio.verify import decode_check

    verdict = decode_check(ext, data)
    try:
        out = decode_sample({ext: data}, DecodeConfig(sample_rate=None), key="k", shard="s.tar")[ext]
    except SampleDecodeError as e:
        assert e.key == "k" and e.member == ext
        return
    if isinstance(out, Audio):
        from headrace.dataio.shards.audioheader import MAX_FRAMES_PER_BYTE

        assert out.waveform.shape[-1] <= len(data) * MAX_FRAMES_PER_BYTE
        assert verdict is None or "no samples" in verdict or "header" in verdict, verdict
    else:
        assert out.numel() * out.element_size() <= len(data)
        from headrace.dataio.stream.reading.decode import check_token_document

        try:  # a 1-D integer array is a document of token ids to the packing loader, and verify holds it to that
            if out.ndim == 1 and not (out.dtype.is_floating_point or out.dtype == torch_bool()):
                check_token_document(out)
        except ValueError:
            assert verdict is not None  # the packing loader refuses it: verify must too
            return
        assert verdict is None, verdict  # decodes in the loader <=> verify says OK


def torch_bool():
    import torch

    return torch.bool


def _wav() -> bytes:
    import io

    import soundfile as sf

    out = io.BytesIO()
    sf.write(out, np.zeros(800, np.int16), 8000, format="WAV", subtype="PCM_16")
    return out.getvalue()


# --- manifests --------------------------------------------------------------------------------------

JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=20)
)


def check_manifest(lines: list[dict], root: Path) -> None:
    from headrace.dataio.prepare.readers import BadRecord, ReadOptions, open_input
    from headrace.dataio.prepare.plan import PlanError, plan_job

    path = root / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    try:
        plan = plan_job(
            [open_input(str(path), ReadOptions(kind="audio"))],
            splits=[("train", 1.0)],
            shard_bytes=1 << 20,
            samples_per_shard=None,
            skip_errors=len(lines),
        )
    except PlanError as e:  # only beyond the budget, which is every line here
        raise AssertionError(f"plan failed within the budget: {e}") from None
    assert plan.samples + len(plan.bad) == len(lines)
    for b in plan.bad:
        assert isinstance(b, BadRecord) and b.path.endswith("m.jsonl") and 1 <= b.line <= len(lines)
    for shard in plan.shards:
        assert all(isinstance(e.est_bytes, int) and e.est_bytes >= 0 for e in shard.entries)


def manifest_line():
    return st.fixed_dictionaries(
        {
            "audio_filepath": st.sampled_from(["a.flac", "b.wav", "missing.flac", "x.mp4", 7]),
            "text": st.one_of(st.text(max_size=10), JSON_SCALARS),
        },
        optional={"duration": JSON_SCALARS, "offset": JSON_SCALARS},
    )


# --- loader states ----------------------------------------------------------------------------------

STATE_FIELDS = ["version", "fingerprint", "seed", "dp_rank", "dp_size", "consumed", "bad_samples", "layout", "reseeds"]
STATE_VALUES = st.one_of(
    JSON_SCALARS,
    st.lists(st.integers(-3, 5), max_size=3),
    st.fixed_dictionaries(
        {"start": st.integers(-5, 50), "dp_size": st.integers(-1, 3)},
        optional={
            "skips": st.lists(
                st.dictionaries(
                    st.sampled_from(["start", "dp_size", "consumed"]),
                    st.one_of(st.integers(-2, 4), st.lists(st.integers(-2, 4), max_size=3)),
                ),
                max_size=2,
            )
        },
    ),
)


def check_state(loader_factory, state: dict) -> None:
    from headrace.dataio.loader_state import StateError

    loader = loader_factory()
    try:
        loader.load_state_dict(state)
    except StateError:
        return
    batch = next(iter(loader), None)  # an accepted state must serve batches
    assert batch is None or len(batch["__key__"]) > 0


# --- trainer configs --------------------------------------------------------------------------------

CONFIG_KEYS = [
    "trainer.max_steps",
    "trainer.grad_accum",
    "trainer.log_every",
    "optim.lr",
    "optim.eps",
    "optim.betas",
    "optim.warmup_steps",
    "optim.decay_steps",
    "optim.min_lr_ratio",
    "optim.max_grad_norm",
    "checkpoint.interval",
    "checkpoint.keep_last",
    "distributed.tp_size",
    "distributed.dp_size",
    "distributed.cp_size",
    "distributed.strategy",
    "data.batch_size",
    "data.seq_len",
    "data.datasets",
    "model.config.model_type",
    "model.config",
    "trainer",
    "nope.key",
]
YAML_TEXT = st.one_of(
    st.sampled_from(
        [
            ".inf",
            "-.inf",
            ".nan",
            "-1",
            "0",
            "1e-3",
            "[1, 2",
            "{a: 1}",
            "null",
            "'x'",
            "[]",
            "[{path: p, weight: .inf}]",
            "- a\n- b",
            ":",
            "2",
            "ddp",
        ]
    ),
    st.text(max_size=12),
)


def check_config(overrides: list[str], base: dict) -> None:
    from headrace.config import ConfigError
    from headrace.training.config.load import load_job_config
    from headrace.training.config.validate import check_job
    from headrace.training.distributed.parallel_dims import ParallelDims

    try:
        cfg = load_job_config(None, overrides, base=base)
        check_job(cfg)
        ParallelDims.from_config(cfg.distributed, 2)
    except ConfigError as e:
        assert "\n" not in str(e).strip() or "YAML" in str(e), str(e)


# --- shards rewritten in place under a running loader -------------------------------------------------


def check_inplace(
    root: Path, reference: dict[str, list[int]], edits: list[tuple[int, int]], workers: int, packed: bool
) -> None:
    """A loader reads ``root`` (a copy of the reference data); after its first batch a shard gets
    ``edits`` (position fraction, byte value) in place, same size. Every token it serves must be the
    reference's for the key it names, or the read ends in a ``SampleDecodeError`` naming the shard."""
    import shutil

    from headrace.dataio import build_loader
    from headrace.dataio.usererror import SampleDecodeError

    data = root / "live"
    shutil.rmtree(data, ignore_errors=True)
    shutil.copytree(root / "reference", data)
    cfg = {
        "datasets": [{"path": str(data)}],
        "batch_size": 4,
        "epochs": 1,
        "num_workers": workers,
        "shuffle": False,
        "max_bad_samples": 0,
        "prefetch": 1,
    }
    if packed:
        cfg.update(seq_len=32, packing="greedy")
    loader = build_loader(cfg)
    it = iter(loader)
    try:
        batches = [next(it)]
        shard = data / "doc-000000.tar"
        size = shard.stat().st_size
        with open(shard, "r+b") as f:
            for where, value in edits:
                f.seek(int(where * (size - 1)))
                f.write(bytes([value]))
        batches += list(it)
    except SampleDecodeError as e:
        assert e.shard and e.shard.endswith(".tar"), str(e)
        return
    finally:
        del it
    if packed:
        return  # rows mix documents: what was served is checked by the unpacked cases' keys
    for batch in batches:
        tokens, lengths = batch["tokens.npy"], batch["__lengths__"].get("tokens.npy")
        docs = tokens.split(lengths.tolist()) if lengths is not None else list(tokens)
        for key, doc in zip(batch["__key__"], docs):
            assert doc.tolist() == reference[key], f"{key}: served other tokens than the index's"


# --- manifests naming files that are not regular ---------------------------------------------------------

NON_REGULAR = ["fifo", "directory", "/dev/zero", "/dev/null", "symlink-to-fifo", "regular"]


def check_nonregular(root: Path, kinds: list[str]) -> None:
    """``dataio shard`` over a manifest whose audio paths are ``kinds``: it ends (the case's alarm
    is the hang detector) with every non-regular one a bad record naming it, the rest written."""
    import os
    import shutil

    from headrace.dataio.prepare.job import PrepareError, ShardOptions, shard_corpus

    case = root / "nonregular"
    shutil.rmtree(case, ignore_errors=True)
    case.mkdir()
    records = []
    for i, kind in enumerate(kinds):
        name = case / f"a{i}.flac"
        if kind == "fifo":
            os.mkfifo(name)
        elif kind == "directory":
            name.mkdir()
        elif kind.startswith("/dev/"):
            name.symlink_to(kind)
        elif kind == "symlink-to-fifo":
            os.mkfifo(case / f"p{i}")
            name.symlink_to(case / f"p{i}")
        else:
            name.write_bytes(flac_bytes(800, 8000))
        records.append({"audio_filepath": name.name, "duration": 0.1, "text": "x"})
    manifest = case / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in records))
    bad = sum(k != "regular" for k in kinds)
    opts = ShardOptions(inputs=[str(manifest)], output=str(case / "out"), skip_errors=bad)
    try:
        report = shard_corpus(opts)
    except PrepareError as e:
        assert bad == len(kinds) and "no samples" in str(e), str(e)  # nothing regular: nothing to write
        return
    assert report.samples == len(kinds) - bad and report.skipped == bad


# --- datasets mixing codecs and .npy layouts -----------------------------------------------------------

MEMBER_KINDS = ["flac", "wav", "uint16", "int32", "int64", "fortran", "2d", "negative", "float", "empty"]


def _member(kind: str) -> tuple[str, bytes]:
    if kind in ("flac", "wav"):
        return kind, flac_bytes(800, 8000) if kind == "flac" else WAV
    arrays = {
        "uint16": np.arange(1, 6, dtype=np.uint16),
        "int32": np.array([1, 70000, 3], dtype=np.int32),
        "int64": np.arange(4, dtype=np.int64),
        "fortran": np.asfortranarray(np.ones((2, 3), np.uint16)),
        "2d": np.ones((2, 3), np.uint16),
        "negative": np.array([2, -1], dtype=np.int16),
        "float": np.ones(3, np.float32),
        "empty": np.zeros(0, np.uint16),
    }
    return "tokens.npy", _npy(arrays[kind])


def check_mixed(root: Path, kinds: list[str], packed: bool, workers: int) -> None:
    """A dataset of one sample per ``kinds`` entry, read whole: batches, or a ``SampleDecodeError`` naming
    the sample once over the budget -- never another exception type."""
    import shutil

    import webdataset as wds
    from tests.loader_util import index_dir

    from headrace.dataio import build_loader
    from headrace.dataio.usererror import SampleDecodeError

    data = root / "mixed"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir()
    with wds.TarWriter(str(data / "d-000000.tar")) as w:
        for i, kind in enumerate(kinds):
            ext, payload = _member(kind)
            w.write({"__key__": f"k{i}", ext: payload, "json": b'{"text": "t"}'})
    index_dir(data)
    cfg = {
        "datasets": [{"path": str(data)}],
        "batch_size": 2,
        "epochs": 1,
        "num_workers": workers,
        "shuffle": False,
        "max_bad_samples": len(kinds) // 2,
        "decode": {"sample_rate": None},
    }
    if packed:
        cfg.update(seq_len=8, packing="greedy")
    try:
        for batch in build_loader(cfg):
            assert isinstance(batch, dict)
    except SampleDecodeError as e:
        assert e.key is not None and e.shard is not None, str(e)
    except ValueError as e:  # refused at build: packing needs token members in every dataset
        assert packed and "needs token members" in str(e), str(e)


# --- a nearly full disk ----------------------------------------------------------------------------------


def small_disk(root: Path) -> Path | None:
    """A 1 MiB tmpfs under ``root`` (None where mounting is not allowed: not root, no tmpfs)."""
    import subprocess

    mount = root / "disk"
    mount.mkdir(exist_ok=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    return mount if ok.returncode == 0 else None


def check_disk_full(disk: Path, docs: Path, leave_kib: int, verb: str) -> None:
    """``dataio shard`` (or ``index``) with ``leave_kib`` KiB free: success, or exit 2 with one line
    naming a path on the disk -- never a traceback."""
    import contextlib
    import io
    import os
    import shutil

    from headrace.dataio.cli import main

    for p in disk.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    args = ["shard", str(docs), "--output", str(disk / "out"), "--quiet"]
    if verb == "index":
        (disk / "out").mkdir()
        shutil.copy(docs.parent / "ds" / "doc-000000.tar", disk / "out")
        args = ["index", str(disk / "out"), "--quiet", "--workers", "1"]
    st = os.statvfs(disk)
    fill = st.f_bavail * st.f_frsize - leave_kib * 1024
    if fill > 0:
        with open(disk / "filler", "wb") as f:
            f.write(bytes(fill))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(args)
    text = err.getvalue()
    assert code == 0 or (code == 2 and text.count("\n") == 1 and str(disk) in text), text


# --- issue 34: the directories and words a user hands the trainer, the converter and the launcher ---------


def in_child(fn):
    """``fn(case)`` in a forked child under ``RUN_CASE_SECONDS``: a case that runs the trainer leaves what it
    allocated, the process-group hooks torch installs and any thread behind when the child exits (in one process,
    hundreds of in-process runs grew past the memory ceiling). The child's traceback comes back through a pipe and
    fails the case here, where hypothesis shrinks it."""

    def run(case):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, then leave without running the parent's exit handlers
            os.close(read)
            code, text = 0, b""
            try:
                with time_limit(RUN_CASE_SECONDS):
                    fn(case)
            except BaseException as e:
                code, text = 1, "".join(traceback.format_exception(e))[-4000:].encode()
            os.write(write, text)
            os._exit(code)
        os.close(write)
        chunks = []
        while chunk := os.read(read, 1 << 16):
            chunks.append(chunk)
        os.close(read)
        _, status = os.waitpid(pid, 0)
        if status:
            raise AssertionError(b"".join(chunks).decode(errors="replace") or f"the case's child ended with {status}")

    return run


def _entry(main, argv: list[str]) -> tuple[int, str]:
    """``main(argv)`` of a CLI in this process: (exit code, what it printed to stderr)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def _one_line_or_ok(code: int, text: str) -> None:
    assert code == 0 or (code == 2 and text.strip().count("\n") == 0 and text.startswith("error")), (code, text[-3000:])


def _trainer_args(tmp: Path, out: Path, *extra: str, flags: tuple[str, ...] = ()) -> list[str]:
    from tests.helpers import REPO

    return [
        "--config",
        str(REPO / "configs" / "debug_llama.yaml"),
        *flags,
        "logging.console=false",
        "logging.tensorboard=false",
        "checkpoint.export_hf=false",
        "data.seq_len=64",
        "data.packing_buffer=8",
        f"trainer.output_dir={out}",
        f"data.datasets=[{{path: {tmp / 'ds'}}}]",
        *extra,
    ]


def _case_dir(tmp: Path, name: str) -> Path:
    import shutil

    case = tmp / "cases" / name
    shutil.rmtree(case, ignore_errors=True)
    case.mkdir(parents=True)
    return case


CKPT_FILES = ["trainer_state.json", ".metadata", "__0_0.distcp", "loader_state.json", "rng.json"]
DEEP_JSON = b"[" * 100_000 + b"]" * 100_000


def check_checkpoint_dir(tmp: Path, run: Path, edits: list[tuple[str, bytes | None]]) -> None:
    """A finished run's newest checkpoint with files mutated (``None``: deleted; ``DEEP_JSON``: nested past any
    recursion limit), then resumed by the trainer and validated by ``headrace.training.eval``: each ends with
    exit 0 (a fallback to the previous checkpoint, or the edit changed nothing that matters) or one line, exit 2."""
    import shutil

    from headrace.training.__main__ import main as train_main
    from headrace.training.eval import main as eval_main

    case = _case_dir(tmp, "ckpt")
    shutil.copytree(run, case / "out", symlinks=True)
    newest = max((case / "out" / "checkpoints").glob("step-*"))
    for name, data in edits:
        files = sorted(p for p in newest.iterdir() if p.name == name or p.name.endswith(name))
        for path in files[:1]:
            if data is None:
                path.unlink()
            else:
                path.write_bytes(data)
    _one_line_or_ok(*_entry(train_main, _trainer_args(tmp, case / "out", "trainer.max_steps=3")))
    val = f"data.val={{datasets: [{{path: {tmp / 'ds'}}}]}}"
    _one_line_or_ok(*_entry(eval_main, _trainer_args(tmp, case / "out", val, flags=("--checkpoint", str(newest)))))


def check_pretrained_dir(
    tmp: Path, base: Path, config_edit: bytes | None, weights_edit: bytes | None, extra_file: bool, link: str | None
) -> None:
    """A pretrained directory with its config.json / safetensors mutated, a second weights file, or a file linked
    from outside: the trainer trains from it (exit 0) or says one line (exit 2)."""
    import shutil

    from headrace.training.__main__ import main as train_main

    case = _case_dir(tmp, "pretrained")
    shutil.copytree(base, case / "p")
    if config_edit is not None:
        (case / "p" / "config.json").write_bytes(config_edit)
    if weights_edit is not None:
        (case / "p" / "model.safetensors").write_bytes(weights_edit)
    if extra_file:
        shutil.copy(base / "model.safetensors", case / "p" / "model-00002.safetensors")
    if link is not None:
        (case / "outside").write_bytes((base / link).read_bytes())
        (case / "p" / link).unlink()
        (case / "p" / link).symlink_to(case / "outside")
    _one_line_or_ok(
        *_entry(
            train_main,
            _trainer_args(
                tmp, case / "out", "trainer.max_steps=1", "model.config=null", f"model.pretrained_path={case / 'p'}"
            ),
        )
    )


SPEECH_FILES = ["config.json", "tokenizer_config.json", "tokenizer.json", "chat_template.jinja"]


def check_speech_checkpoint(tmp: Path, base: Path, edits: list[tuple[str, bytes]], link: str | None) -> None:
    """A Qwen2-Audio checkpoint directory with files mutated or linked from outside, converted: a SALM export
    (exit 0) or one line (exit 2), and then no partial output directory; a link's target never in the export."""
    import shutil

    from headrace.training.speech.checkpoints import main as convert_main

    case = _case_dir(tmp, "speech")
    shutil.copytree(base, case / "ckpt")
    for name, data in edits:
        (case / "ckpt" / name).write_bytes(data)
    if link is not None:
        (case / "secret").write_text("SECRET-FROM-OUTSIDE")
        (case / "ckpt" / link).unlink(missing_ok=True)
        (case / "ckpt" / link).symlink_to(case / "secret")
    code, text = _entry(convert_main, [str(case / "ckpt"), str(case / "out")])
    _one_line_or_ok(code, text)
    if code != 0:
        assert not (case / "out").exists() and not list(case.glob(".out.tmp-*")), sorted(p.name for p in case.iterdir())
    else:
        assert link is None and all(
            b"SECRET-FROM-OUTSIDE" not in p.read_bytes() for p in (case / "out").rglob("*") if p.is_file()
        )


def check_launcher(tmp: Path, job: Path, values: list[tuple[str, bool]]) -> None:
    """Overrides with shell-active text (raw, or as a YAML double-quoted string so that most reach the script),
    through ``launch --slurm --dry-run``: refused in one line (exit 2), or the per-node bash of the script hands
    the trainer exactly the words given, and runs nothing of theirs."""
    import shlex

    from headrace.training.launch import main as launch_main

    case = _case_dir(tmp, "launch")
    raw = [f"{case}/{v}" if i == 0 else v for i, (v, _) in enumerate(values)]
    texts = [json.dumps(r, ensure_ascii=False) if quoted else r for r, (_, quoted) in zip(raw, values)]
    overrides = [f"trainer.output_dir={t}" if i == 0 else f"model.config.note{i}={t}" for i, t in enumerate(texts)]
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = launch_main(["--config", str(job), "--slurm", "--dry-run", "--", *overrides])
        except SystemExit as e:
            code = e.code
    _one_line_or_ok(code, err.getvalue())
    if code != 0:
        return
    script = out.getvalue().partition("\nsbatch ")[0]
    srun = script[script.index("\nsrun ") + 1 :].rstrip("\n")  # the last command; a quoted word may span lines
    per_node = shlex.split(srun)[-1].replace("exec ", "exec printf '%s\\0' ", 1)
    env = {
        "PATH": "/usr/bin:/bin",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NUM_NODES": "1",
        "RDZV_HOST": "h",
        "SLURM_JOB_ID": "1",
        "DATA_SEED": "7",
    }
    proc = subprocess.run(["bash", "-c", per_node], env=env, cwd=case, capture_output=True, check=True, timeout=10)
    words = proc.stdout.decode("utf-8", "surrogateescape").split("\0")[:-1]
    assert words[words.index("--config") + 2 :] == [*overrides, "trainer.data_seed=7"], (words, overrides)
    assert sorted(p.name for p in case.iterdir()) == [], "the script created files"


OUTPUT_NAMES = [
    ".headrace-train.lock",
    "config.yaml",
    "metrics.jsonl",
    "summary.json",
    "checkpoints",
    "checkpoints/step-00000001",
    "checkpoints/.seal-key",
    "hf",
    "hf/config.json",
    "tensorboard",
    "profile",
]


def check_output_links(tmp: Path, links: list[tuple[str, bool]]) -> None:
    """Symbolic links (to a file, or to a folder, outside the run) at names the trainer writes under its
    output_dir: the job refuses in one line (exit 2) and nothing outside changes; without links it trains."""
    from headrace.training.__main__ import main as train_main

    case = _case_dir(tmp, "links")
    (case / "victim").write_text("precious")
    (case / "victim_dir").mkdir()
    out = case / "out"
    out.mkdir()
    made = 0
    for name, to_dir in links:
        path = out / name
        if os.path.lexists(path) or any(
            os.path.islink(p) or (p.exists() and not p.is_dir()) for p in path.parents if out in p.parents
        ):
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(case / ("victim_dir" if to_dir else "victim"))
        made += 1
    code, text = _entry(train_main, _trainer_args(tmp, out, "trainer.max_steps=1"))
    assert (case / "victim").read_text() == "precious" and not list((case / "victim_dir").iterdir())
    if made:
        assert code == 2 and "is a symbolic link" in text and text.strip().count("\n") == 0, (code, text[-2000:])
    else:
        assert code == 0, text[-2000:]


# --- the runner -------------------------------------------------------------------------------------


def targets(tmp: Path) -> dict:
    """name -> (hypothesis strategy of that target's mutations, the property checked on each case)."""
    global WAV
    WAV = WAV or _wav()
    flac = flac_bytes(800, 8000)
    for name, data in (("a.flac", flac), ("b.wav", WAV)):
        (tmp / name).write_bytes(data)
    from tests.loader_util import make_text_dataset

    from headrace.dataio import build_loader
    from tests.test_bad_input_config import job

    make_text_dataset(tmp / "ds", [6, 6])
    state_cfg = {"datasets": [{"path": str(tmp / "ds")}], "batch_size": 2, "num_workers": 0, "epochs": 1}
    good_state = build_loader(state_cfg).state_dict()
    config_base = job(tmp)

    import headrace.training.models.build  # noqa: F401  (heavy imports before the per-case clock starts)

    make_text_dataset(tmp / "inplace" / "reference", [40, 8], seed=3)
    from headrace.dataio.shards.index import load_index

    reference = {}
    ref_loader = build_loader(
        {
            "datasets": [{"path": str(tmp / "inplace" / "reference")}],
            "batch_size": 48,
            "epochs": 1,
            "num_workers": 0,
            "shuffle": False,
        }
    )
    for batch in ref_loader:
        docs = batch["tokens.npy"].split(batch["__lengths__"]["tokens.npy"].tolist())
        reference.update({k: d.tolist() for k, d in zip(batch["__key__"], docs)})
    assert len(reference) == len(load_index(tmp / "inplace" / "reference"))
    docs = tmp / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"word {i} " * 20}) + "\n" for i in range(2000)))
    disk = small_disk(tmp)

    def guarded(fn):
        def run(case):
            with time_limit():
                fn(case)

        return run

    found = {
        "tar": (mutated(TAR, hot=TAR_HEADERS).map(_fix_checksums), guarded(check_tar)),
        "tar-raw": (mutated(TAR, hot=TAR_HEADERS), guarded(check_tar)),
        "npy": (mutated(NPY, hot=[(0, 128)]), guarded(lambda d: check_member("tokens.npy", d))),
        "flac": (mutated(flac, hot=[(0, 64)]), guarded(lambda d: check_member("flac", d))),
        "wav": (mutated(WAV, hot=[(0, 48)]), guarded(lambda d: check_member("wav", d))),
        "manifest": (
            st.lists(manifest_line(), min_size=1, max_size=4),
            guarded(lambda lines: check_manifest(lines, tmp)),
        ),
        "state": (
            st.dictionaries(st.sampled_from(STATE_FIELDS), STATE_VALUES, max_size=2),
            guarded(lambda edits: check_state(lambda: build_loader(state_cfg), {**good_state, **edits})),
        ),
        "config": (
            st.lists(st.tuples(st.sampled_from(CONFIG_KEYS), YAML_TEXT), min_size=1, max_size=3),
            guarded(lambda kv: check_config([f"{k}={v}" for k, v in kv], config_base)),
        ),
        "inplace": (
            st.tuples(
                st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=8),
                st.sampled_from([0, 2]),
                st.booleans(),
            ),
            guarded(lambda c: check_inplace(tmp / "inplace", reference, *c)),
        ),
        "nonregular": (
            st.lists(st.sampled_from(NON_REGULAR), min_size=1, max_size=4),
            guarded(lambda kinds: check_nonregular(tmp, kinds)),
        ),
        "mixed": (
            st.tuples(
                st.lists(st.sampled_from(MEMBER_KINDS), min_size=1, max_size=6), st.booleans(), st.sampled_from([0, 2])
            ),
            guarded(lambda c: check_mixed(tmp, *c)),
        ),
    }

    def guarded_run(fn):
        return in_child(fn)

    found.update(issue34_targets(tmp, guarded, guarded_run))
    found.update(issue46_targets(tmp, guarded, guarded_run))
    if disk is not None:
        found["diskfull"] = (
            st.tuples(st.integers(0, 400), st.sampled_from(["shard", "index"])),
            guarded(lambda c: check_disk_full(disk, docs, *c)),
        )
    return found


def issue34_targets(tmp: Path, guarded, guarded_run) -> dict:
    """The checkpoint directory, pretrained directories, speech-LLM checkpoint directories (converter), the
    launcher's overrides and output-dir symlinks (issue 34), each with its base made once here."""
    import yaml

    from tests.dist.train_common import TINY_LLAMA, save_pretrained_tiny
    from tests.test_speech_checkpoints import save_qwen2_audio

    from headrace.training.__main__ import main as train_main

    run = tmp / "run"
    code, text = _entry(train_main, _trainer_args(tmp, run, "trainer.max_steps=2", "checkpoint.interval=1"))
    assert code == 0, text[-3000:]
    save_pretrained_tiny(tmp / "pretrained", dict(TINY_LLAMA, vocab_size=2048))
    config_bytes = (tmp / "pretrained" / "config.json").read_bytes()
    weights = (tmp / "pretrained" / "model.safetensors").read_bytes()
    save_qwen2_audio(tmp / "qwen2_audio")
    if not (tmp / "qwen2_audio" / "chat_template.jinja").exists():
        (tmp / "qwen2_audio" / "chat_template.jinja").write_text(
            json.loads((tmp / "qwen2_audio" / "tokenizer_config.json").read_text()).pop("chat_template", "")
        )
    speech = {name: (tmp / "qwen2_audio" / name).read_bytes() for name in SPEECH_FILES}
    job = tmp / "launch.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "model": {"config": {"model_type": "llama"}},
                "data": {"datasets": [{"path": "d"}], "seq_len": 64},
                "trainer": {"output_dir": str(tmp / "launch-run")},
            }
        )
    )
    json_texts = st.sampled_from(
        [
            b"{}",
            b"[]",
            b"null",
            b'{"step": -1}',
            b'{"step": 1e999}',
            b'"x"',
            DEEP_JSON,
            b'{"model_type": "llama", "vocab_size": 0}',
            b'{"model_type": 3}',
        ]
    )
    nested_loops = b"{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    shell_text = st.text(
        st.one_of(
            st.sampled_from(list("$`'\"\\;|&(){}[]*?!~#\n\t %=")),
            st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
        ),
        min_size=1,
        max_size=16,
    )
    return {
        "ckptdir": (
            st.lists(
                st.tuples(st.sampled_from(CKPT_FILES), st.one_of(st.none(), json_texts, st.binary(max_size=64))),
                min_size=1,
                max_size=2,
            ),
            guarded_run(lambda edits: check_checkpoint_dir(tmp, run, edits)),
        ),
        "pretrained": (
            st.tuples(
                st.one_of(st.none(), json_texts, mutated(config_bytes)),
                st.one_of(st.none(), mutated(weights, hot=[(0, 256)])),
                st.booleans(),
                st.one_of(st.none(), st.sampled_from(["config.json", "model.safetensors"])),
            ),
            guarded_run(lambda c: check_pretrained_dir(tmp, tmp / "pretrained", *c)),
        ),
        "speechckpt": (
            st.tuples(
                st.lists(
                    st.one_of(
                        st.sampled_from(SPEECH_FILES).flatmap(lambda n: mutated(speech[n]).map(lambda b: (n, b))),
                        st.tuples(st.sampled_from(["config.json", "tokenizer_config.json"]), json_texts),
                        st.just(("chat_template.jinja", nested_loops)),
                    ),
                    max_size=2,
                ),
                st.one_of(st.none(), st.sampled_from(["merges.txt", "tokenizer.json", "config.json"])),
            ),
            guarded_run(lambda c: check_speech_checkpoint(tmp, tmp / "qwen2_audio", *c)),
        ),
        "launcher": (
            st.lists(st.tuples(shell_text, st.booleans()), min_size=1, max_size=3),
            guarded(lambda v: check_launcher(tmp, job, v)),
        ),
        "links": (
            st.lists(st.tuples(st.sampled_from(OUTPUT_NAMES), st.booleans()), max_size=3),
            guarded_run(lambda links: check_output_links(tmp, links)),
        ),
    }


def _run(strategy, fn, **options) -> None:
    settings(deadline=None, database=None, suppress_health_check=list(HealthCheck), **options)(given(strategy)(fn))()


def run_fast(tmp: Path, examples: int = FAST_EXAMPLES) -> None:
    """The CI seed set: derandomized, so every run checks the same cases."""
    for name, (strategy, fn) in targets(tmp).items():
        _run(strategy, fn, max_examples=min(examples, SLOW_EXAMPLES.get(name, examples)), derandomize=True)


def run_long(tmp: Path, minutes: float, only: list[str] | None = None) -> dict:
    """Fresh random cases until ``minutes`` are up (of the targets ``only`` names; None: all); returns counts and
    the distinct failures found."""
    tests = targets(tmp)
    if only:
        if unknown := sorted(set(only) - tests.keys()):
            raise SystemExit(f"fuzz: no target {', '.join(unknown)} (targets: {', '.join(tests)})")
        tests = {name: test for name, test in tests.items() if name in only}
    start = time.monotonic()
    stop = start + minutes * 60
    found: dict[str, str] = {}
    per_target: dict[str, int] = {}
    rounds = cases = 0
    while time.monotonic() < stop:
        for name, test in tests.items():
            if time.monotonic() >= stop:
                break
            examples = 200 if name not in SLOW_EXAMPLES else 20
            try:
                _run(*test, max_examples=examples)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # hypothesis re-raises the (shrunk) failure: record it, keep fuzzing (torch's
                # CheckpointException, which can carry a case's Hang, is a BaseException)
                text = traceback.format_exception_only(type(e), e)[-1].strip()
                found.setdefault(f"{name}: {text[:300]}", "".join(traceback.format_exception(e))[-3000:])
            cases += examples
            per_target[name] = per_target.get(name, 0) + examples
        rounds += 1
    return {
        "seconds": round(time.monotonic() - start),
        "rounds": rounds,
        "cases": cases,
        "failures": found,
        "per_target": per_target,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help="random cases until --minutes are up")
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--examples", type=int, default=FAST_EXAMPLES, help="cases per target without --long")
    parser.add_argument("--only", default="", help="with --long: these targets only (comma-separated names)")
    args = parser.parse_args()
    limit_memory()
    with tempfile.TemporaryDirectory() as d:
        try:
            if not args.long:
                run_fast(Path(d), args.examples)
                print(f"fuzz: {args.examples} derandomized cases per target passed")
                return 0
            report = run_long(Path(d), args.minutes, [n for n in args.only.split(",") if n])
        finally:
            if (Path(d) / "disk").is_mount():
                subprocess.run(["umount", "-l", str(Path(d) / "disk")], check=False)
    print(
        f"fuzz --long: {report['seconds']} s, {report['rounds']} rounds, ~{report['cases']} cases, "
        f"{len(report['failures'])} distinct failures; cases per target: {report['per_target']}"
    )
    for head, detail in report["failures"].items():
        print(f"--- {head}\n{detail}")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
