"""Fuzzing harness (issue 16): random mutations of every untrusted input, one property for all.

Targets: tar shards (header bytes, size fields, PAX records, names, truncation), ``.npy`` members,
FLAC/WAV headers, NeMo manifest lines, loader states and trainer configs. The property is the same
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
import resource
import signal
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

sys.path.insert(0, str(Path(__file__).parent / "dist"))  # loader_util, train_common
from tests.hostile import flac_bytes, make_tar  # noqa: E402

CASE_SECONDS = 20  # generous: a loaded 2-core CI machine runs a normal case 10x slower than idle
MEMORY_CEILING = 6 << 30  # RLIMIT_DATA of a fuzz process (torch and numpy included)
FAST_EXAMPLES = 60


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
    resource.setrlimit(resource.RLIMIT_DATA, (min(ceiling, hard) if hard != resource.RLIM_INFINITY else ceiling,
                                              hard))


# --- mutations ---------------------------------------------------------------------------------------

@st.composite
def mutated(draw, base: bytes, *, hot: list[tuple[int, int]] | None = None):
    """``base`` with a few byte edits (biased to the ``hot`` ranges: headers), insertions, or a cut."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["byte", "field", "cut", "insert"]))
        if kind == "cut":
            del data[draw(st.integers(0, len(data))):]
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
    return out[: -1024] + extra.getvalue()  # one archive: drop the first end-of-archive blocks


TAR = _tar_base()
TAR_HEADERS = [(p, p + 512) for p in range(0, len(TAR), 512)][:12]


def check_tar(data: bytes) -> None:
    from dataio.shards.tarscan import TarFormatError, scan_buffer

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
    from dataio.stream.decode import Audio, DecodeConfig, SampleDecodeError, decode_sample
    from dataio.shards.tarscan import decode_check

    verdict = decode_check(ext, data)
    try:
        out = decode_sample({ext: data}, DecodeConfig(sample_rate=None), key="k", shard="s.tar")[ext]
    except SampleDecodeError as e:
        assert e.key == "k" and e.member == ext
        return
    if isinstance(out, Audio):
        from dataio.prepare.audio import MAX_FRAMES_PER_BYTE

        assert out.waveform.shape[-1] <= len(data) * MAX_FRAMES_PER_BYTE
        assert verdict is None or "no samples" in verdict or "header" in verdict, verdict
    else:
        assert out.numel() * out.element_size() <= len(data)
        assert verdict is None, verdict  # decodes in the loader <=> verify says OK


def _wav() -> bytes:
    import io

    import soundfile as sf

    out = io.BytesIO()
    sf.write(out, np.zeros(800, np.int16), 8000, format="WAV", subtype="PCM_16")
    return out.getvalue()


# --- manifests --------------------------------------------------------------------------------------

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                         st.text(max_size=20))


def check_manifest(lines: list[dict], root: Path) -> None:
    from dataio.prepare.readers import BadRecord, ReadOptions, open_input
    from dataio.prepare.plan import PlanError, plan_job

    path = root / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    try:
        plan = plan_job([open_input(str(path), ReadOptions(kind="audio"))], splits=[("train", 1.0)],
                        shard_bytes=1 << 20, samples_per_shard=None, skip_errors=len(lines))
    except PlanError as e:  # only beyond the budget, which is every line here
        raise AssertionError(f"plan failed within the budget: {e}") from None
    assert plan.samples + len(plan.bad) == len(lines)
    for b in plan.bad:
        assert isinstance(b, BadRecord) and b.path.endswith("m.jsonl") and 1 <= b.line <= len(lines)
    for shard in plan.shards:
        assert all(isinstance(e.est_bytes, int) and e.est_bytes >= 0 for e in shard.entries)


def manifest_line():
    return st.fixed_dictionaries({"audio_filepath": st.sampled_from(["a.flac", "b.wav", "missing.flac", "x.mp4", 7]),
                                  "text": st.one_of(st.text(max_size=10), JSON_SCALARS)},
                                 optional={"duration": JSON_SCALARS, "offset": JSON_SCALARS})


# --- loader states ----------------------------------------------------------------------------------

STATE_FIELDS = ["version", "fingerprint", "seed", "dp_rank", "dp_size", "consumed", "bad_samples", "layout"]
STATE_VALUES = st.one_of(JSON_SCALARS, st.lists(st.integers(-3, 5), max_size=3),
                         st.fixed_dictionaries({"start": st.integers(-5, 50), "dp_size": st.integers(-1, 3)},
                                               optional={"skips": st.lists(st.dictionaries(
                                                   st.sampled_from(["start", "dp_size", "consumed"]),
                                                   st.one_of(st.integers(-2, 4), st.lists(st.integers(-2, 4),
                                                                                          max_size=3))), max_size=2)}))


def check_state(loader_factory, state: dict) -> None:
    from dataio.loader_state import StateError

    loader = loader_factory()
    try:
        loader.load_state_dict(state)
    except StateError:
        return
    batch = next(iter(loader), None)  # an accepted state must serve batches
    assert batch is None or len(batch["__key__"]) > 0


# --- trainer configs --------------------------------------------------------------------------------

CONFIG_KEYS = ["trainer.max_steps", "trainer.grad_accum", "trainer.log_every", "optim.lr", "optim.eps",
               "optim.betas", "optim.warmup_steps", "optim.decay_steps", "optim.min_lr_ratio", "optim.max_grad_norm",
               "checkpoint.interval", "checkpoint.keep_last", "distributed.tp_size", "distributed.dp_size",
               "distributed.cp_size", "distributed.strategy", "data.batch_size", "data.seq_len",
               "data.datasets", "model.config.model_type", "model.config", "trainer", "nope.key"]
YAML_TEXT = st.one_of(st.sampled_from([".inf", "-.inf", ".nan", "-1", "0", "1e-3", "[1, 2", "{a: 1}", "null",
                                       "'x'", "[]", "[{path: p, weight: .inf}]", "- a\n- b", ":", "2", "ddp"]),
                      st.text(max_size=12))


def check_config(overrides: list[str], base: dict) -> None:
    from configtree import ConfigError
    from training.config.load import load_job_config
    from training.config.validate import check_job

    try:
        check_job(load_job_config(None, overrides, base=base), world_size=2)
    except ConfigError as e:
        assert "\n" not in str(e).strip() or "YAML" in str(e), str(e)


# --- the runner -------------------------------------------------------------------------------------

def targets(tmp: Path) -> dict:
    """name -> (hypothesis strategy of that target's mutations, the property checked on each case)."""
    global WAV
    WAV = WAV or _wav()
    flac = flac_bytes(800, 8000)
    for name, data in (("a.flac", flac), ("b.wav", WAV)):
        (tmp / name).write_bytes(data)
    sys.path.insert(0, str(Path(__file__).parent))
    from loader_util import make_text_dataset

    from dataio import build_loader
    from tests.test_hostile_config import job

    make_text_dataset(tmp / "ds", [6, 6])
    state_cfg = {"datasets": [{"path": str(tmp / "ds")}], "batch_size": 2, "num_workers": 0, "epochs": 1}
    good_state = build_loader(state_cfg).state_dict()
    config_base = job(tmp)

    import training.models.build  # noqa: F401  (heavy imports before the per-case clock starts)

    def guarded(fn):
        def run(case):
            with time_limit():
                fn(case)
        return run

    return {
        "tar": (mutated(TAR, hot=TAR_HEADERS).map(_fix_checksums), guarded(check_tar)),
        "tar-raw": (mutated(TAR, hot=TAR_HEADERS), guarded(check_tar)),
        "npy": (mutated(NPY, hot=[(0, 128)]), guarded(lambda d: check_member("tokens.npy", d))),
        "flac": (mutated(flac, hot=[(0, 64)]), guarded(lambda d: check_member("flac", d))),
        "wav": (mutated(WAV, hot=[(0, 48)]), guarded(lambda d: check_member("wav", d))),
        "manifest": (st.lists(manifest_line(), min_size=1, max_size=4),
                     guarded(lambda lines: check_manifest(lines, tmp))),
        "state": (st.dictionaries(st.sampled_from(STATE_FIELDS), STATE_VALUES, max_size=2),
                  guarded(lambda edits: check_state(lambda: build_loader(state_cfg), {**good_state, **edits}))),
        "config": (st.lists(st.tuples(st.sampled_from(CONFIG_KEYS), YAML_TEXT), min_size=1, max_size=3),
                   guarded(lambda kv: check_config([f"{k}={v}" for k, v in kv], config_base))),
    }


def _run(strategy, fn, **options) -> None:
    settings(deadline=None, database=None, suppress_health_check=list(HealthCheck), **options)(given(strategy)(fn))()


def run_fast(tmp: Path, examples: int = FAST_EXAMPLES) -> None:
    """The CI seed set: derandomized, so every run checks the same cases."""
    for strategy, fn in targets(tmp).values():
        _run(strategy, fn, max_examples=examples, derandomize=True)


def run_long(tmp: Path, minutes: float) -> dict:
    """Fresh random cases until ``minutes`` are up; returns counts and the distinct failures found."""
    tests = targets(tmp)
    start = time.monotonic()
    stop = start + minutes * 60
    found: dict[str, str] = {}
    rounds = cases = 0
    while time.monotonic() < stop:
        for name, test in tests.items():
            if time.monotonic() >= stop:
                break
            try:
                _run(*test, max_examples=200)
            except Exception as e:  # hypothesis re-raises the (shrunk) failure: record it, keep fuzzing
                text = traceback.format_exception_only(type(e), e)[-1].strip()
                found.setdefault(f"{name}: {text[:300]}", "".join(traceback.format_exception(e))[-3000:])
            cases += 200
        rounds += 1
    return {"seconds": round(time.monotonic() - start), "rounds": rounds, "cases": cases, "failures": found}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help="random cases until --minutes are up")
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--examples", type=int, default=FAST_EXAMPLES, help="cases per target without --long")
    args = parser.parse_args()
    limit_memory()
    with tempfile.TemporaryDirectory() as d:
        if not args.long:
            run_fast(Path(d), args.examples)
            print(f"fuzz: {args.examples} derandomized cases per target passed")
            return 0
        report = run_long(Path(d), args.minutes)
    print(f"fuzz --long: {report['seconds']} s, {report['rounds']} rounds, ~{report['cases']} cases, "
          f"{len(report['failures'])} distinct failures")
    for head, detail in report["failures"].items():
        print(f"--- {head}\n{detail}")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
