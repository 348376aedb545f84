"""``dataio shard INPUT... --output DIR``: corpora in, indexed WebDataset shards out.

Plan once (prepare/plan.py: splits, shard boundaries, node ownership, all independent of worker count),
claim the output directory with the job's fingerprint, write this node's missing shards with
``--workers`` forked processes (prepare/writer.py: atomic tar + index part per shard), and, once every
shard of the plan exists, merge the parts into the dataset index and Megatron-Energon metadata.
Re-running the same command resumes: complete shards are kept, the rest are written again.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from pathlib import Path

from dataio.cli import CommandError

_JOB = None  # (ShardJob, [PlannedShard], shared count of samples done) for forked workers


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="NeMo audio manifests / text JSONL (.jsonl[.gz]), .txt, lhotse cuts (.jsonl[.gz]), .parquet")
    p.add_argument("--output", "-o", required=True, help="output directory")
    p.add_argument("--kind", choices=["auto", "text", "audio"], default="auto",
                   help="auto: per input, from its suffix and first record")
    p.add_argument("--tokenizer", help="Hugging Face tokenizer.json; adds token ids as .npy")
    p.add_argument("--shard-size", default=None, help="target shard size (e.g. 512MB, 1GiB); default 512MB "
                   "unless --samples-per-shard is given")
    p.add_argument("--samples-per-shard", type=int, default=None)
    p.add_argument("--workers", type=int, default=1, help="writer processes on this node")
    p.add_argument("--num-nodes", type=int, default=None, help="default: SLURM array/task variables, else 1")
    p.add_argument("--node-rank", type=int, default=None)
    p.add_argument("--split", default=None, help="e.g. train=0.98,val=0.02 (by key hash); default: all train")
    p.add_argument("--text-field", default="text", help="JSONL/parquet field holding the text")
    p.add_argument("--audio-format", choices=["flac", "wav", "opus"], default=None,
                   help="re-encode audio to this codec (default: keep bytes as given)")
    p.add_argument("--skip-errors", type=int, default=0, metavar="N",
                   help="skip up to N bad samples (listed in DIR/skipped.jsonl); fail beyond N")
    p.add_argument("--checksum", action="store_true",
                   help="record each shard's sha256 in the index (hashed on a background thread while writing; "
                        "costs ~1 s of CPU per 0.1-0.5 GB)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _fail(e: Exception) -> CommandError:
    return CommandError(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)


def _refuse_other_job(root: Path, job: dict) -> None:
    """CommandError when ``root`` holds the output of another job (different inputs or options)."""
    from dataio.shards.index import META_DIR
    from dataio.prepare.writer import STATE_DIR

    path = root / STATE_DIR / "job.json"
    if path.exists():
        with open(path) as f:
            previous = json.load(f)
        if previous.get("id") != job["id"]:
            changed = [k for k in ("inputs", "options", "tokenizer") if previous.get(k) != job.get(k)]
            raise CommandError(f"{root} holds shards of a different job (its {', '.join(changed) or 'fingerprint'} "
                               f"differ from this command's); use a new --output or delete {root}")
    elif root.exists() and (any(root.glob("*.tar")) or (root / META_DIR).exists()):
        raise CommandError(f"{root} already holds shards not written by this `dataio shard` job; "
                           "use a new --output or delete it")


def _record_job(root: Path, job: dict) -> None:
    from dataio.prepare.writer import STATE_DIR
    from dataio.shards.tarwriter import write_atomically

    path = root / STATE_DIR / "job.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(job, indent=1).encode())


def _remove_stale_temps(root: Path, shards) -> None:
    """Temp files a killed run left for the shards still to write: the tar, its skip report, its index part."""
    from dataio.shards.index import PARTS_DIR
    from dataio.prepare.writer import SKIPPED_DIR

    for shard in shards:
        stale = [*root.glob(f"{shard.name}.tmp-*"), *(root / SKIPPED_DIR).glob(f"{shard.name}*.tmp-*"),
                 *(root / PARTS_DIR).glob(f".{shard.name}.npz.tmp-*")]
        for tmp in stale:
            tmp.unlink(missing_ok=True)


def _write_in_worker(i: int):
    from dataio.prepare.writer import write_shard

    job, shards, done = _JOB

    def count(n: int) -> None:
        with done.get_lock():
            done.value += n

    return write_shard(job, shards[i], progress=count)


def _write_shards(job, todo, workers: int, advance=lambda n: None):
    """Yield a ShardResult per shard as shards finish (in-process for one worker); ``advance(n)`` is
    called as chunks of ``n`` samples are done (written or skipped), also from forked workers."""
    global _JOB
    if workers <= 1 or len(todo) <= 1:
        from dataio.prepare.writer import write_shard

        for shard in todo:
            yield write_shard(job, shard, progress=advance)
        return
    context = multiprocessing.get_context("fork")  # workers inherit the plan and the opened readers
    done = context.Value("q", 0)
    _JOB = (job, todo, done)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # N processes already fill the cores
    shown = 0
    with context.Pool(min(workers, len(todo))) as pool:
        results = pool.imap_unordered(_write_in_worker, range(len(todo)))
        while True:
            try:
                result = results.next(timeout=0.5)
            except multiprocessing.TimeoutError:
                result = None
            except StopIteration:
                break
            advance(done.value - shown)
            shown = done.value
            if result is not None:
                yield result
    advance(done.value - shown)


def _skip_reports(root: Path, names) -> list[dict]:
    from dataio.prepare.writer import SKIPPED_DIR

    rows = []
    for name in names:
        path = root / SKIPPED_DIR / f"{name}.jsonl"
        if path.exists():
            rows += [json.loads(line) for line in path.read_text().splitlines() if line]
    return rows


def _finalize(root: Path, plan, job: dict, skipped: list[dict], workers: int) -> int:
    """Merge every shard's part into the index and write the dataset metadata; returns the sample count."""
    from dataio.shards.index import PARTS_DIR, ShardPart, merge_parts
    from dataio.shards.metadata import write_dataset_metadata
    from dataio.shards.tarwriter import write_atomically

    report = root / "skipped.jsonl"
    if skipped:
        write_atomically(report, "".join(json.dumps(r) + "\n" for r in skipped).encode())
    else:
        report.unlink(missing_ok=True)
    parts = [ShardPart.load(root / PARTS_DIR / f"{s.name}.npz") for s in plan.shards]
    index = merge_parts([p for p in parts if p.info.samples], job=job)
    write_dataset_metadata(root, index, workers=workers)
    return len(index)


def run(args: argparse.Namespace) -> int:
    from dataio.commands.progress import progress_bar
    from dataio.prepare.readers import ReadOptions, SampleError, open_input
    from dataio.prepare.writer import ShardJob, is_complete
    from dataio.prepare.plan import PlanError, job_fingerprint, parse_size, parse_splits, plan_job, resolve_node

    started = time.perf_counter()
    try:
        splits = parse_splits(args.split)
        shard_bytes = None if args.samples_per_shard and not args.shard_size else parse_size(args.shard_size or "512MB")
        if args.samples_per_shard is not None and args.samples_per_shard < 1:
            raise ValueError(f"--samples-per-shard must be >= 1, got {args.samples_per_shard}")
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
        num_nodes, node_rank = resolve_node(args.num_nodes, args.node_rank)
        if args.tokenizer:
            if not os.path.isfile(args.tokenizer):
                raise ValueError(f"tokenizer not found: {args.tokenizer}")
            from dataio.prepare.writer import load_tokenizer

            try:
                load_tokenizer(args.tokenizer)
            except Exception as e:  # tokenizers raises a bare Exception for malformed files
                raise ValueError(f"{args.tokenizer}: not a Hugging Face tokenizer.json ({e})") from None
        options = ReadOptions(kind=args.kind, text_field=args.text_field, audio_format=args.audio_format)
        inputs = [open_input(p, options) for p in args.inputs]
    except (ValueError, FileNotFoundError) as e:
        raise _fail(e) from None

    root = Path(args.output)
    job = job_fingerprint(args.inputs, {"kind": args.kind, "text_field": args.text_field,
                                        "audio_format": args.audio_format, "shard_bytes": shard_bytes,
                                        "samples_per_shard": args.samples_per_shard, "split": splits,
                                        "checksum": args.checksum},
                          args.tokenizer)
    _refuse_other_job(root, job)  # before the (possibly long) scan
    try:
        plan = plan_job(inputs, splits=splits, shard_bytes=shard_bytes, samples_per_shard=args.samples_per_shard,
                        skip_errors=args.skip_errors)
    except PlanError as e:
        raise _fail(e) from None
    if not plan.shards:
        raise CommandError(f"no samples in {', '.join(args.inputs)}")
    _record_job(root, job)

    mine = plan.for_node(num_nodes, node_rank)
    todo = [s for s in mine if not is_complete(root, s.name)]
    done_names = sorted({s.name for s in mine} - {s.name for s in todo})
    _remove_stale_temps(root, todo)
    skipped = [{"source": b.path, "line": b.line, "reason": b.reason} for b in plan.bad]
    skipped_count = len(skipped) + len(_skip_reports(root, done_names))
    shard_job = ShardJob(root=root, inputs=inputs, tokenizer_path=args.tokenizer, skip_errors=args.skip_errors,
                         sha256=args.checksum)

    written_samples = written_bytes = 0
    try:
        with progress_bar("shard", total=sum(len(s.entries) for s in todo), unit="samples",
                          quiet=args.quiet) as advance:
            for result in _write_shards(shard_job, todo, args.workers, advance):
                written_samples += result.samples
                written_bytes += result.bytes
                skipped_count += len(result.skipped)
                if skipped_count > args.skip_errors:
                    raise SampleError(f"{result.skipped[-1]['reason']} ({skipped_count} bad samples exceed "
                                      f"--skip-errors {args.skip_errors})")
    except SampleError as e:
        _remove_stale_temps(root, todo)
        raise _fail(e) from None
    except BaseException:
        _remove_stale_temps(root, todo)
        raise

    elapsed = time.perf_counter() - started
    who = f"node {node_rank}/{num_nodes}: " if num_nodes > 1 else ""
    line = (f"{who}wrote {len(todo)} shards, {written_samples:,} samples, {written_bytes / 1e6:,.1f} MB "
            f"in {elapsed:.1f} s ({written_bytes / 1e6 / max(elapsed, 1e-9):,.1f} MB/s)")
    if done_names:
        line += f"; {len(done_names)} shards were already complete"
    print(line)

    pending = [s.name for s in plan.shards if not is_complete(root, s.name)]
    if pending:
        print(f"{len(pending)} shards of other nodes are still missing; the last node to finish "
              f"(or `dataio index {root}`) writes the dataset metadata")
        return 0
    skipped += _skip_reports(root, [s.name for s in plan.shards])
    if len(skipped) > args.skip_errors:  # nodes each within budget, together over it
        raise CommandError(f"{len(skipped)} bad samples across all nodes exceed --skip-errors {args.skip_errors}; "
                           f"see {root / 'skipped.jsonl'}")
    try:
        total = _finalize(root, plan, job, skipped, args.workers)
    except ValueError as e:
        raise _fail(e) from None
    per_split = {}
    for s in plan.shards:
        per_split[s.split] = per_split.get(s.split, 0) + 1
    print(f"dataset {root}: {total:,} samples in {len(plan.shards)} shards "
          f"({', '.join(f'{k} {v}' for k, v in per_split.items())})"
          + (f"; skipped {len(skipped)} bad samples, listed in {root / 'skipped.jsonl'}" if skipped else ""))
    return 0
