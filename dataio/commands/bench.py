"""``dataio bench``: loader throughput of headrace beside webdataset, energon, litdata, lhotse and plain
torch, on the same samples, with the page-cache read limit measured in the same run.

For each worker count, each loader reads the ``data:`` section's dataset for one epoch (or
``--batches`` / ``--seconds``) with the same decode work, timed by ``headrace.dataio.bench.measure``; peers read
their own formats, written once by their own writers under ``OUT/formats`` (``headrace.dataio.bench.peers``).
Writes ``OUT/results.json``, ``OUT/results.md`` and ``OUT/throughput.png`` and prints the table.
``--trainer`` adds the trainer's own data path (packing + device prefetch) against a simulated step.
``--audio-bytes`` leaves audio encoded in every loader (headrace: ``decode.audio: raw``), so audio-size
samples are compared by the bytes moved; with ``dali`` in ``--compare`` (decoded audio) headrace also
runs with ``decode.audio: dali`` (row ``headrace-dali``) beside DALI's own reader.
This module parses the options and hands them to ``headrace.dataio.bench.session`` (the order of the runs, the
result), then writes and prints the report. Heavy imports (torch, the peers) happen inside ``run()`` so
``--help`` stays fast. Each run's bar is ``headrace.dataio.commands.progress.progress_bar`` (on stderr, only on a
terminal), the project's one progress helper.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from headrace.dataio.usererror import CommandError

PEER_NAMES = ("webdataset", "energon", "litdata", "lhotse", "torch", "dali")


def _worker_counts(text: str) -> list[int | str]:
    counts = [v.strip() for v in text.split(",") if v.strip()]
    if "auto" not in counts:
        return _int_list(text)
    return [v if v == "auto" else _int_list(v)[0] for v in counts]


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        required=True,
        help="YAML whose `data:` section (or top level) is the loader's data config (one dataset)",
    )
    parser.add_argument(
        "--compare",
        default=",".join(PEER_NAMES[:5]),
        help=f"peer loaders to run beside headrace, comma-separated, from {','.join(PEER_NAMES)} "
        "(empty: headrace only)",
    )
    parser.add_argument(
        "--num-workers",
        type=_worker_counts,
        default=[0, 2],
        help="worker counts, e.g. 0,2,4; `auto`: headrace's own choice (num_workers: auto), its "
        "measurement shown, beside the counts",
    )
    parser.add_argument(
        "--batch-sizes",
        type=_int_list,
        help="batch sizes to run every loader at (default: the config's); two or more also report "
        "each loader's fixed cost per batch and cost per sample (a least-squares fit)",
    )
    limit = parser.add_mutually_exclusive_group()
    limit.add_argument("--seconds", type=float, help="stop each run after this many seconds (default: one epoch)")
    limit.add_argument("--batches", type=int, help="stop each run after this many batches (default: one epoch)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per loader and worker count, interleaved; the median run (by samples/s) is reported",
    )
    parser.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        help="simulated trainer step in ms after each batch (reports the data-wait fraction)",
    )
    parser.add_argument("--shuffle", action="store_true", help="shuffled reads, each loader by its own mechanism")
    parser.add_argument(
        "--cache",
        choices=["warm", "cold"],
        default="warm",
        help="cold: drop the page cache before each run (needs root)",
    )
    parser.add_argument(
        "--audio-bytes",
        action="store_true",
        help="audio data: every loader hands over the encoded audio bytes (headrace with "
        "decode.audio: raw) instead of decoding",
    )
    parser.add_argument(
        "--trainer",
        action="store_true",
        help="also run the trainer's data path (packing + device prefetch) at --step-time (default 100 ms)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="results folder")
    parser.add_argument("--formats", type=Path, help="where peers write their formats (default OUT/formats)")


def _load_config(path: Path):
    # imported here, not at the top: `dataio --help` imports every verb's add_arguments, not its work
    import yaml

    from headrace.dataio.config import DataConfig
    from headrace.config import ConfigError, from_dict

    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise CommandError(f"{path}: {e}") from None
    section = raw.get("data", raw) if isinstance(raw, dict) else raw
    try:
        return from_dict(DataConfig, section, "data")
    except (ConfigError, ValueError, TypeError) as e:
        raise CommandError(f"{path}: {e}") from None


def run(args: argparse.Namespace) -> int:
    # imported here, not at the top: torch and the peer loaders load only when a benchmark runs
    from headrace.dataio.bench import report
    from headrace.dataio.bench.session import BenchOptions, run_session
    from headrace.dataio.commands.progress import progress_bar

    cfg = _load_config(args.config)
    compare = [n.strip() for n in args.compare.split(",") if n.strip()]
    unknown = sorted(set(compare) - set(PEER_NAMES))
    if unknown:
        raise CommandError(f"--compare: unknown loader(s) {', '.join(unknown)} (choose from {', '.join(PEER_NAMES)})")
    opts = BenchOptions(
        compare=compare,
        num_workers=args.num_workers,
        batch_sizes=args.batch_sizes,
        formats=args.formats or args.out / "formats",
        seconds=args.seconds,
        batches=args.batches,
        repeats=args.repeats,
        step_ms=args.step_time,
        shuffle=args.shuffle,
        cache=args.cache,
        audio_bytes=args.audio_bytes,
        trainer=args.trainer,
        command=" ".join(["dataio", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else None,
    )
    result = run_session(cfg, opts, progress_bar=progress_bar)
    report.write(result, args.out)
    print(report.markdown(result))
    print(f"wrote {args.out / 'results.json'}, {args.out / 'results.md'}, {args.out / 'throughput.png'}")
    return 0
