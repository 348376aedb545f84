"""One ``dataio bench`` session: every loader over the same samples, at every worker count, in
interleaved repeats, with the page-cache read limit measured in the same run.

Order of work: describe the data (``headrace.dataio.bench.data``), measure the read limit
(``headrace.dataio.bench.pagecache``), let each peer write its own format once (``headrace.dataio.bench.peers``; a peer
that is not installed or cannot write it is reported under ``skipped`` with its reason), then run
``repeats x worker counts x loaders`` with the repeats outermost, so that load from other processes
on a shared machine hits every loader alike; each (loader, workers) reports its median run by
samples/s (``headrace.dataio.bench.timing``). ``trainer`` adds the trainer's own data path
(``headrace.dataio.bench.trainer``). The result is the JSON object ``headrace.dataio.bench.report`` writes and prints.
Cost: the runs themselves; the peers' formats are written once per session.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console

from headrace.dataio.bench import report
from headrace.dataio.bench.contract import CONTRACT
from headrace.dataio.bench.data import describe
from headrace.dataio.bench.fixedcost import fixed_costs
from headrace.dataio.bench.measure import measure
from headrace.dataio.bench.pagecache import drop_page_cache, read_limit
from headrace.dataio.bench.peers import PEERS, count, prepare, skip_reason
from headrace.dataio.bench.timing import median_run
from headrace.dataio.bench.trainer import trainer_run
from headrace.dataio.config import DataConfig
from headrace.dataio.usererror import CommandError
from headrace.dataio.worker_count import AUTO

# ``progress_bar(description, total=..., unit=...)``: a context yielding ``advance(n)``
ProgressBar = Callable[..., AbstractContextManager[Callable[[int], None]]]


@dataclass(kw_only=True)
class BenchOptions:
    """What to run (the options of ``dataio bench``)."""

    compare: list[str]  # peer loaders beside headrace, names of ``headrace.dataio.bench.peers.PEERS``
    num_workers: list[int | str]  # counts, and "auto" (headrace's measured choice; peers skip it)
    batch_sizes: list[int] | None = None  # every loader at each (None: the config's); two or more: fixed cost
    formats: Path  # where peers write their formats
    seconds: float | None = None  # each run's limit (neither: one epoch)
    batches: int | None = None
    repeats: int = 1
    step_ms: float = 0.0  # simulated trainer step after each batch
    shuffle: bool = False
    cache: str = "warm"  # or "cold": drop the page cache before each run (needs root)
    audio_bytes: bool = False  # audio stays encoded in every loader (headrace: decode.audio: raw)
    trainer: bool = False
    command: str | None = None  # the command line, recorded in the result


def progress_line(done: int, total: int, name: str, workers: int, batch_size: int, what: str) -> None:
    """One line on stderr per measured configuration (kept, unlike the transient bar; shown in logs too)."""
    print(
        f"dataio bench: [{done}/{total}] {name}, {workers} workers, batch {batch_size}: {what}",
        file=sys.stderr,
        flush=True,
    )


def run_session(cfg: DataConfig, opts: BenchOptions, *, progress_bar: ProgressBar) -> dict:
    """The session's result (``headrace.dataio.bench.report``'s JSON object); CommandError for data the
    benchmark cannot run on."""
    torch.set_num_threads(1)  # loaders do I/O and decoding; intra-op threads only oversubscribe the cores
    if opts.audio_bytes:
        cfg = dataclasses.replace(cfg, decode=dataclasses.replace(cfg.decode, audio="raw"))
    batch_sizes = opts.batch_sizes or [cfg.batch_size]
    if 0 in batch_sizes:
        raise CommandError("--batch-sizes: a batch holds at least one sample")
    compare = list(opts.compare)
    try:
        data = describe(cfg, opts.formats.resolve())
    except (ValueError, OSError) as e:
        raise CommandError(str(e)) from None
    if opts.audio_bytes and data.kind != "audio":
        raise CommandError(f"--audio-bytes: {data.root} has no audio member (members: {', '.join(data.members)})")
    if "dali" in compare and data.kind == "audio" and not data.audio_bytes:
        compare.insert(compare.index("dali"), "headrace-dali")  # the loader's own DALI decode, beside DALI's reader
    console = Console(stderr=True)
    step_s = opts.step_ms / 1e3

    cold_refused = None
    if opts.cache == "cold":
        cold_refused = drop_page_cache()
        if cold_refused:
            console.print(f"[yellow]--cache cold: cannot drop the page cache ({cold_refused}); measuring warm[/]")
    limit = read_limit(data.shards, warm=opts.cache == "warm" or cold_refused is not None)
    limit["samples_per_s"] = data.samples * limit["bytes_per_s"] / data.bytes

    # headrace on the output contract (the row peers are compared with) and in its own full batch layout
    loaders, skipped, states, prepare_s = ["headrace", "headrace-full"], [], {}, {}
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
    trials: dict[tuple[str, int | str, int], list[dict]] = {}
    total = None if (opts.batches or opts.seconds) else data.samples  # None: an open-ended bar
    # Repeats outermost, so that load from other processes on a shared machine hits every loader alike.
    # ``auto`` is headrace's own setting: only the loaders with ``auto_workers`` run it
    runs_at = {w: [n for n in loaders if w != AUTO or PEERS[n].auto_workers is not None] for w in opts.num_workers}
    measured, configs = 0, max(1, opts.repeats) * len(batch_sizes) * sum(map(len, runs_at.values()))
    # Each repeat also starts one loader later in the order (a rotation), so that no loader always runs
    # right after the same other one (whose pages, allocations and CPU state it would inherit).
    for repeat in range(max(1, opts.repeats)):
        for batch_size in batch_sizes:
            sized = dataclasses.replace(data, cfg=dataclasses.replace(data.cfg, batch_size=batch_size))
            for workers in opts.num_workers:
                names = runs_at[workers]
                for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                    measured += 1
                    if (name, -1, 0) in trials:  # failed before: reported once
                        continue
                    if opts.cache == "cold" and not cold_refused:
                        drop_page_cache()
                    peer, state = PEERS[name], states.get(name)
                    try:
                        # auto: the loader's own measurement, then a run with the count it chose
                        choice = peer.auto_workers(sized, opts.shuffle) if workers == AUTO else None
                        count_used = workers if choice is None else choice.num_workers
                        with progress_bar(
                            f"{name}, {workers} workers, batch {batch_size}", total=total, unit="samples"
                        ) as advance:
                            result = measure(
                                lambda: peer.open(sized, count_used, opts.shuffle, state),
                                lambda b: count(peer, b, sized),
                                max_samples=data.samples,
                                max_batches=opts.batches,
                                max_seconds=opts.seconds,
                                step_s=step_s,
                                progress=advance,
                            )
                    except Exception as e:  # reported with its reason, never dropped silently
                        skipped.append({"loader": f"{name} ({workers} workers)", "reason": f"{type(e).__name__}: {e}"})
                        trials[(name, -1, 0)] = []
                        progress_line(measured, configs, name, workers, batch_size, f"failed: {type(e).__name__}")
                        continue
                    if choice is not None:
                        result["auto"] = choice.to_dict()
                    trials.setdefault((name, workers, batch_size), []).append(result)
                    rate = result["samples_per_s"]
                    progress_line(
                        measured,
                        configs,
                        name,
                        workers,
                        batch_size,
                        f"{result['samples']:,} samples in "
                        f"{result['seconds']:.1f} s"
                        + (f", {rate:,.0f} samples/s" if rate else "")
                        + (f"; {choice.line()}" if choice is not None else ""),
                    )
    runs = []
    for (name, workers, batch_size), results in trials.items():
        if workers == -1:
            continue
        runs.append(
            {
                "loader": name,
                "workers": workers,
                "batch_size": batch_size,
                "shuffle": opts.shuffle,
                "prepare_s": prepare_s.get(name),
                "repeats": len(results),
                **median_run(results, "samples_per_s"),
            }
        )
    report.add_ratios(runs, limit["samples_per_s"], data.bytes / data.samples)

    trainer = []
    if opts.trainer:
        for workers in opts.num_workers:
            with console.status(f"trainer path, {workers} workers"):
                trainer.append(
                    trainer_run(
                        data,
                        workers=workers,
                        step_s=step_s or 0.1,
                        max_batches=opts.batches or (None if opts.seconds else 50),
                        max_seconds=opts.seconds,
                    )
                )

    return {
        "command": opts.command,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.cuda.is_available(),
            "load_before": load_before,
        },
        "cache": opts.cache if not cold_refused else f"warm (cold refused: {cold_refused})",
        "contract": {"kind": data.contract, "batch": CONTRACT[data.contract]},
        "data": {
            "path": str(data.root),
            "split": data.split,
            "kind": data.kind,
            "field": data.field,
            "audio": "bytes" if data.audio_bytes else "decoded" if data.kind == "audio" else None,
            "members": data.members,
            "samples": data.samples,
            "bytes": data.bytes,
            "shards": len(data.shards),
            "batch_size": cfg.batch_size,
            "batch_sizes": batch_sizes,
        },
        "page_cache": limit,
        "step_ms": opts.step_ms,
        "runs": runs,
        "skipped": skipped,
        "trainer": trainer,
        "fixed_cost": fixed_costs(runs) if len(batch_sizes) > 1 else [],
    }


__all__ = ["BenchOptions", "ProgressBar", "run_session"]
