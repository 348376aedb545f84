"""``dataio bench``: loader throughput of headrace beside webdataset, energon, litdata, lhotse and plain
torch, on the same samples, with the page-cache read limit measured in the same run.

For each worker count, each loader reads the ``data:`` section's dataset for one epoch (or
``--batches`` / ``--seconds``) with the same decode work, timed by ``dataio.bench.measure``; peers read
their own formats, written once by their own writers under ``OUT/formats`` (``dataio.bench.peers``).
Writes ``OUT/results.json``, ``OUT/results.md`` and ``OUT/throughput.png`` and prints the table.
``--trainer`` adds the trainer's own data path (packing + device prefetch) against a simulated step.
``--audio-bytes`` leaves audio encoded in every loader (headrace: ``decode.audio: raw``), so audio-size
samples are compared by the bytes moved; with ``dali`` in ``--compare`` (decoded audio) headrace also
runs with ``decode.audio: dali`` (row ``headrace-dali``) beside DALI's own reader.
Heavy imports (torch, the peers) happen inside ``run()`` so ``--help`` stays fast. Each run's bar is
``dataio.commands.progress.progress_bar`` (on stderr, only on a terminal), the project's one progress helper.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
from pathlib import Path

from dataio.cli import CommandError

PEER_NAMES = ("webdataset", "energon", "litdata", "lhotse", "torch", "dali")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, required=True,
                        help="YAML whose `data:` section (or top level) is the loader's data config (one dataset)")
    parser.add_argument("--compare", default=",".join(PEER_NAMES[:5]),
                        help=f"peer loaders to run beside headrace, comma-separated, from {','.join(PEER_NAMES)} "
                             "(empty: headrace only)")
    parser.add_argument("--num-workers", type=_int_list, default=[0, 2], help="worker counts, e.g. 0,2,4")
    parser.add_argument("--batch-sizes", type=_int_list,
                        help="batch sizes to run every loader at (default: the config's); two or more also report "
                             "each loader's fixed cost per batch and cost per sample (a least-squares fit)")
    limit = parser.add_mutually_exclusive_group()
    limit.add_argument("--seconds", type=float, help="stop each run after this many seconds (default: one epoch)")
    limit.add_argument("--batches", type=int, help="stop each run after this many batches (default: one epoch)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per loader and worker count, interleaved; the median run (by samples/s) is reported")
    parser.add_argument("--step-time", type=float, default=0.0,
                        help="simulated trainer step in ms after each batch (reports the data-wait fraction)")
    parser.add_argument("--shuffle", action="store_true", help="shuffled reads, each loader by its own mechanism")
    parser.add_argument("--cache", choices=["warm", "cold"], default="warm",
                        help="cold: drop the page cache before each run (needs root)")
    parser.add_argument("--audio-bytes", action="store_true",
                        help="audio data: every loader hands over the encoded audio bytes (headrace with "
                             "decode.audio: raw) instead of decoding")
    parser.add_argument("--trainer", action="store_true",
                        help="also run the trainer's data path (packing + device prefetch) at --step-time (default 100 ms)")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="results folder")
    parser.add_argument("--formats", type=Path, help="where peers write their formats (default OUT/formats)")


def _load_config(path: Path):
    import yaml

    from dataio.config import DataConfig
    from configtree import ConfigError, from_dict

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
    import torch
    from rich.console import Console

    from dataio.bench import report
    from dataio.bench.data import count, describe
    from dataio.bench.fixedcost import fixed_costs
    from dataio.bench.measure import measure
    from dataio.bench.pagecache import drop_page_cache, read_limit
    from dataio.bench.peers import PEERS, prepare, skip_reason
    from dataio.bench.timing import median_run
    from dataio.commands.progress import progress_bar

    torch.set_num_threads(1)  # loaders do I/O and decoding; intra-op threads only oversubscribe the cores
    cfg = _load_config(args.config)
    if args.audio_bytes:
        cfg = dataclasses.replace(cfg, decode=dataclasses.replace(cfg.decode, audio="raw"))
    batch_sizes = args.batch_sizes or [cfg.batch_size]
    if 0 in batch_sizes:
        raise CommandError("--batch-sizes: a batch holds at least one sample")
    compare = [n.strip() for n in args.compare.split(",") if n.strip()]
    unknown = sorted(set(compare) - set(PEER_NAMES))
    if unknown:
        raise CommandError(f"--compare: unknown loader(s) {', '.join(unknown)} (choose from {', '.join(PEER_NAMES)})")
    try:
        data = describe(cfg, (args.formats or args.out / "formats").resolve())
    except (ValueError, OSError) as e:
        raise CommandError(str(e)) from None
    if args.audio_bytes and data.kind != "audio":
        raise CommandError(f"--audio-bytes: {data.root} has no audio member (members: {', '.join(data.members)})")
    if "dali" in compare and data.kind == "audio" and not data.audio_bytes:
        compare.insert(compare.index("dali"), "headrace-dali")  # the loader's own DALI decode, beside DALI's reader
    console = Console(stderr=True)
    step_s = args.step_time / 1e3

    cold_refused = None
    if args.cache == "cold":
        cold_refused = drop_page_cache()
        if cold_refused:
            console.print(f"[yellow]--cache cold: cannot drop the page cache ({cold_refused}); measuring warm[/]")
    limit = read_limit(data.shards, warm=args.cache == "warm" or cold_refused is not None)
    limit["samples_per_s"] = data.samples * limit["bytes_per_s"] / data.bytes

    loaders, skipped, states, prepare_s = ["headrace"], [], {}, {}
    for name in compare:
        reason = skip_reason(PEERS[name], data)
        if reason:
            skipped.append({"loader": name, "reason": reason})
            continue
        with console.status(f"{name}: writing its format from the same samples"):
            try:
                states[name], prepare_s[name] = prepare(PEERS[name], data)
            except Exception as e:  # a peer that cannot write its format is reported, not hidden
                skipped.append({"loader": name, "reason": f"preparing its format failed: {type(e).__name__}: {e}"})
                continue
        loaders.append(name)

    load_before = os.getloadavg()[0]
    trials: dict[tuple[str, int, int], list[dict]] = {}
    total = None if (args.batches or args.seconds) else data.samples  # None: an open-ended bar
    # Repeats outermost, so that load from other processes on a shared machine hits every loader alike.
    for _ in range(max(1, args.repeats)):
        for batch_size in batch_sizes:
            sized = dataclasses.replace(data, cfg=dataclasses.replace(data.cfg, batch_size=batch_size))
            for workers in args.num_workers:
                for name in loaders:
                    if (name, -1, 0) in trials:  # failed before: reported once
                        continue
                    if args.cache == "cold" and not cold_refused:
                        drop_page_cache()
                    peer, state = PEERS[name], states.get(name)
                    try:
                        with progress_bar(f"{name}, {workers} workers, batch {batch_size}", total=total,
                                          unit="samples") as advance:
                            result = measure(lambda: peer.open(sized, workers, args.shuffle, state),
                                             lambda b: count(b, sized), max_samples=data.samples,
                                             max_batches=args.batches, max_seconds=args.seconds, step_s=step_s,
                                             progress=advance)
                    except Exception as e:  # reported with its reason, never dropped silently
                        skipped.append({"loader": f"{name} ({workers} workers)", "reason": f"{type(e).__name__}: {e}"})
                        trials[(name, -1, 0)] = []
                        continue
                    trials.setdefault((name, workers, batch_size), []).append(result)
    runs = []
    for (name, workers, batch_size), results in trials.items():
        if workers < 0:
            continue
        runs.append({"loader": name, "workers": workers, "batch_size": batch_size, "shuffle": args.shuffle,
                     "prepare_s": prepare_s.get(name), "repeats": len(results),
                     **median_run(results, "samples_per_s")})
    report.add_ratios(runs, limit["samples_per_s"], data.bytes / data.samples)

    trainer = []
    if args.trainer:
        from dataio.bench.trainer import trainer_run

        for workers in args.num_workers:
            with console.status(f"trainer path, {workers} workers"):
                trainer.append(trainer_run(data, workers=workers, step_s=step_s or 0.1,
                                           max_batches=args.batches or (None if args.seconds else 50),
                                           max_seconds=args.seconds))

    result = {
        "command": " ".join(["dataio", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else None,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "cuda": torch.cuda.is_available(), "load_before": load_before},
        "cache": args.cache if not cold_refused else f"warm (cold refused: {cold_refused})",
        "data": {"path": str(data.root), "split": data.split, "kind": data.kind, "field": data.field,
                 "audio": "bytes" if data.audio_bytes else "decoded" if data.kind == "audio" else None,
                 "members": data.members, "samples": data.samples, "bytes": data.bytes, "shards": len(data.shards),
                 "batch_size": cfg.batch_size, "batch_sizes": batch_sizes},
        "page_cache": limit,
        "step_ms": args.step_time,
        "runs": runs,
        "skipped": skipped,
        "trainer": trainer,
        "fixed_cost": fixed_costs(runs) if len(batch_sizes) > 1 else [],
    }
    report.write(result, args.out)
    print(report.markdown(result))
    print(f"wrote {args.out / 'results.json'}, {args.out / 'results.md'}, {args.out / 'throughput.png'}")
    return 0
