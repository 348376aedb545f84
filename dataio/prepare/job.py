"""The shard job behind ``dataio shard``: corpora in, indexed WebDataset shards out.

Plan once (``headrace.dataio.prepare.plan``: splits, shard boundaries, node ownership, all independent of worker
count), claim the output directory with the job's fingerprint, remove the temp files a killed run left,
write this node's missing shards with ``workers`` forked processes (``headrace.dataio.prepare.writer``: atomic
tar + index part per shard), and, once every shard of the plan exists, merge the parts into the
dataset index and Megatron-Energon metadata. Running the same job again resumes: complete shards are
kept, the rest are written again.

Workers are plain forked processes that inherit the job (the plan, the opened readers) as their
arguments and claim shards from a shared counter; each sends back a small ``ShardResult`` per shard.
Failures are ``PrepareError`` (one line for the user: a bad option, input or record, another job's
directory, too many bad samples); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import queue
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager, Iterator

from headrace.dataio.prepare.chat import open_chat_input
from headrace.dataio.prepare.chat_template import tokenizer_json
from headrace.dataio.prepare.plan import PlanError, job_fingerprint, parse_splits, plan_job, resolve_node
from headrace.dataio.prepare.readers import ReadOptions, SampleError, open_input, skip_budget_error
from headrace.dataio.prepare.writer import (
    SKIPPED_DIR,
    STATE_DIR,
    ShardJob,
    ShardResult,
    is_complete,
    load_tokenizer,
    write_shard,
)
from headrace.dataio.shards.index import META_DIR, PARTS_DIR, ShardPart, merge_parts
from headrace.dataio.shards.metadata import write_dataset_metadata
from headrace.dataio.shards.outdir import lock_output
from headrace.dataio.shards.tarwriter import write_atomically
from headrace.dataio.sizes import parse_size
from headrace.dataio.interrupts import leave_interrupt_to_parent
from headrace.dataio.usererror import UserError

# progress(description, total=, unit=) -> a context yielding advance(n); the CLI passes its progress bar
Progress = Callable[..., ContextManager[Callable[[int], None]]]


class PrepareError(UserError):
    """A user-facing failure of corpus preparation: bad options, input or data; the message names it."""


def silent(description: str, *, total: int | None, unit: str = "") -> ContextManager[Callable[[int], None]]:
    """The default ``Progress``: nothing drawn."""
    return contextlib.nullcontext(lambda n: None)


@dataclass(kw_only=True)
class ShardOptions:
    """What ``dataio shard`` was asked (its command-line options, see ``dataio shard --help``)."""

    inputs: list[str]
    output: Path
    kind: str = "auto"
    tokenizer: str | None = None
    shard_size: str | None = None  # default 512MB unless samples_per_shard is given
    samples_per_shard: int | None = None
    workers: int = 1
    num_nodes: int | None = None
    node_rank: int | None = None
    split: str | None = None
    text_field: str = "text"
    audio_format: str | None = None
    skip_errors: int = 0
    checksum: bool = False


@dataclass
class ShardReport:
    """What a run did: this node's shards and, when the plan is complete, the dataset."""

    num_nodes: int
    node_rank: int
    written: int = 0  # shards written by this run
    samples: int = 0
    bytes: int = 0
    seconds: float = 0.0  # writing this node's shards (planning included, metadata not)
    already_complete: int = 0  # shards of this node found complete
    pending: int = 0  # shards of other nodes still missing (no metadata written yet)
    total_samples: int | None = None  # the dataset's, once the metadata is written
    shards_per_split: dict[str, int] = field(default_factory=dict)
    skipped: int = 0  # bad samples listed in skipped.jsonl


def shard_corpus(opts: ShardOptions, progress: Progress = silent) -> ShardReport:
    """Run the shard job of ``opts`` on this node (see the module docstring)."""
    started = time.perf_counter()
    try:
        splits = parse_splits(opts.split)
        shard_bytes = None if opts.samples_per_shard and not opts.shard_size else parse_size(opts.shard_size or "512MB")
        if opts.samples_per_shard is not None and opts.samples_per_shard < 1:
            raise ValueError(f"--samples-per-shard must be >= 1, got {opts.samples_per_shard}")
        if opts.skip_errors < 0:
            raise ValueError(f"--skip-errors must be >= 0, got {opts.skip_errors}")
        if opts.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {opts.workers}")
        num_nodes, node_rank = resolve_node(opts.num_nodes, opts.node_rank)
        if opts.tokenizer:
            _check_tokenizer(opts.tokenizer)
        options = ReadOptions(kind=opts.kind, text_field=opts.text_field, audio_format=opts.audio_format)
        inputs = [open_chat_input(p, options, opts.tokenizer) or open_input(p, options) for p in opts.inputs]
    except (ValueError, FileNotFoundError) as e:
        raise PrepareError(str(e)) from None

    root = Path(opts.output)
    if root.exists() and not root.is_dir():
        raise PrepareError(f"--output {root} is a file, not a directory")
    lock = lock_output(root, node=node_rank, command="dataio shard")  # noqa: F841 (held until we return)
    job = job_fingerprint(
        opts.inputs,
        {
            "kind": opts.kind,
            "text_field": opts.text_field,
            "audio_format": opts.audio_format,
            "shard_bytes": shard_bytes,
            "samples_per_shard": opts.samples_per_shard,
            "split": splits,
            "checksum": opts.checksum,
        },
        opts.tokenizer,
    )
    claim_output(root, job)  # before the (possibly long) scan
    try:
        plan = plan_job(
            inputs,
            splits=splits,
            shard_bytes=shard_bytes,
            samples_per_shard=opts.samples_per_shard,
            skip_errors=opts.skip_errors,
        )
    except PlanError as e:
        raise PrepareError(str(e)) from None
    if not plan.shards:
        raise PrepareError(f"no samples in {', '.join(opts.inputs)}")
    path = root / STATE_DIR / "job.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(job, indent=1).encode(), what="the job description")

    mine = plan.for_node(num_nodes, node_rank)
    todo = [s for s in mine if not is_complete(root, s.name)]
    done_names = sorted({s.name for s in mine} - {s.name for s in todo})
    remove_stale_temps(root, todo)
    skipped = [{"source": b.path, "line": b.line, "reason": b.reason} for b in plan.bad]
    skipped_count = len(skipped) + len(_skip_reports(root, done_names))
    shard_job = ShardJob(
        root=root, inputs=inputs, tokenizer_path=opts.tokenizer, skip_errors=opts.skip_errors, sha256=opts.checksum
    )

    report = ShardReport(num_nodes=num_nodes, node_rank=node_rank, written=len(todo), already_complete=len(done_names))
    try:
        with progress("shard", total=sum(len(s.entries) for s in todo), unit="samples") as advance:
            for result in write_shards(shard_job, todo, opts.workers, advance):
                report.samples += result.samples
                report.bytes += result.bytes
                skipped_count += len(result.skipped)
                if skipped_count > opts.skip_errors:
                    raise PrepareError(skip_budget_error(result.skipped[-1]["reason"], skipped_count, opts.skip_errors))
    except SampleError as e:
        remove_stale_temps(root, todo)
        raise PrepareError(str(e)) from None
    except BaseException:
        remove_stale_temps(root, todo)
        raise
    report.seconds = time.perf_counter() - started

    report.pending = sum(not is_complete(root, s.name) for s in plan.shards)
    if report.pending:
        return report
    skipped += _skip_reports(root, [s.name for s in plan.shards])
    if len(skipped) > opts.skip_errors:  # nodes each within budget, together over it
        raise PrepareError(
            f"{len(skipped)} bad samples across all nodes exceed --skip-errors {opts.skip_errors}; "
            f"see {root / 'skipped.jsonl'}"
        )
    try:
        report.total_samples = _finalize(root, plan, job, skipped, opts.workers)
    except ValueError as e:
        raise PrepareError(str(e)) from None
    for s in plan.shards:
        report.shards_per_split[s.split] = report.shards_per_split.get(s.split, 0) + 1
    report.skipped = len(skipped)
    return report


def _check_tokenizer(path: str) -> None:
    tokenizer_json(path)  # ValueError naming what is missing
    try:
        load_tokenizer(path)
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise ValueError(f"{path}: not a Hugging Face tokenizer.json ({e})") from None


def claim_output(root: Path, job: dict) -> None:
    """PrepareError when ``root`` holds the output of another job (different inputs or options)."""
    path = root / STATE_DIR / "job.json"
    if path.exists():
        with open(path) as f:
            previous = json.load(f)
        if previous.get("id") != job["id"]:
            changed = [k for k in ("inputs", "options", "tokenizer") if previous.get(k) != job.get(k)]
            raise PrepareError(
                f"{root} holds shards of a different job (its {', '.join(changed) or 'fingerprint'} "
                f"differ from this command's); use a new --output or delete {root}"
            )
    elif root.exists() and (any(root.glob("*.tar")) or (root / META_DIR).exists()):
        raise PrepareError(
            f"{root} already holds shards not written by this `dataio shard` job; use a new --output or delete it"
        )


def remove_stale_temps(root: Path, shards) -> None:
    """Temp files a killed run left for the shards still to write: the tar, its skip report, its index part."""
    for shard in shards:
        stale = [
            *root.glob(f"{shard.name}.tmp-*"),
            *(root / SKIPPED_DIR).glob(f"{shard.name}*.tmp-*"),
            *(root / PARTS_DIR).glob(f".{shard.name}.npz.tmp-*"),
        ]
        for tmp in stale:
            tmp.unlink(missing_ok=True)


def write_shards(
    job: ShardJob, todo: list, workers: int, advance: Callable[[int], None] = lambda n: None
) -> Iterator[ShardResult]:
    """A ``ShardResult`` per shard as shards finish (in this process for one worker); ``advance(n)`` is
    called as chunks of ``n`` samples are done (written or skipped), also from the workers."""
    if workers <= 1 or len(todo) <= 1:
        for shard in todo:
            yield write_shard(job, shard, progress=advance)
        return
    context = multiprocessing.get_context("fork")  # workers inherit the plan and the opened readers
    done, claimed, results = context.Value("q", 0), context.Value("q", 0), context.Queue()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # N processes already fill the cores
    procs = [
        context.Process(target=_writer, args=(job, todo, claimed, done, results, os.getpid()), daemon=True)
        for _ in range(min(workers, len(todo)))
    ]
    for p in procs:
        p.start()
    shown = received = 0
    try:
        while received < len(todo):
            try:
                ok, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"shard writer process {dead[0].pid} died (exit code {dead[0].exitcode})")
                if all(p.exitcode is not None for p in procs) and results.empty():
                    raise RuntimeError(f"shard writer processes ended with {len(todo) - received} shards unreported")
                ok, value = True, None
            advance(done.value - shown)
            shown = done.value
            if not ok:
                raise value
            if value is not None:
                received += 1
                yield value
        advance(done.value - shown)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()


def _writer(job: ShardJob, todo: list, claimed, done, results, parent: int) -> None:
    """A worker: claim the next shard of ``todo`` until none is left (or the parent is gone)."""
    leave_interrupt_to_parent()

    def count(n: int) -> None:
        with done.get_lock():
            done.value += n

    while os.getppid() == parent:
        with claimed.get_lock():
            i = claimed.value
            claimed.value += 1
        if i >= len(todo):
            return
        try:
            results.put((True, write_shard(job, todo[i], progress=count)))
        except Exception as e:  # the parent raises it; the shard's temps are removed there
            results.put((False, e))
            return


def _skip_reports(root: Path, names) -> list[dict]:
    rows = []
    for name in names:
        path = root / SKIPPED_DIR / f"{name}.jsonl"
        if path.exists():
            rows += [json.loads(line) for line in path.read_text().splitlines() if line]
    return rows


def _finalize(root: Path, plan, job: dict, skipped: list[dict], workers: int) -> int:
    """Merge every shard's part into the index and write the dataset metadata; returns the sample count."""
    report = root / "skipped.jsonl"
    if skipped:
        write_atomically(
            report, "".join(json.dumps(r) + "\n" for r in skipped).encode(), what="the skipped-sample report"
        )
    else:
        report.unlink(missing_ok=True)
    parts = [ShardPart.load(root / PARTS_DIR / f"{s.name}.npz") for s in plan.shards]
    index = merge_parts([p for p in parts if p.info.samples], job=job)
    write_dataset_metadata(root, index, workers=workers)
    return len(index)


__all__ = ["PrepareError", "Progress", "ShardOptions", "ShardReport", "shard_corpus", "silent", "write_shards"]
