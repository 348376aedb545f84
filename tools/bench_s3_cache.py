"""Epoch 1 vs epoch 2 samples/s of a dataset on S3 (a moto server on loopback), with and without the
local disk cache of shards (``data.cache_dir``).

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench_s3_cache --docs 20000 --per-shard 1000 --workdir /tmp/s3cache_bench

Writes ``--docs`` byte-tokenised demo documents as indexed shards, starts ``moto.server`` in its own
process (so it does not share this process's GIL), uploads them to ``s3://bench/text``, then runs one
loader of two epochs per mode (``--modes``) and prints the samples/s of each epoch (the clock split
at the sample that starts epoch 2), the shard bytes the cache holds afterwards, and the load average.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError("moto.server did not start") from None
            time.sleep(0.2)


def upload(root: Path, endpoint: str, bucket: str, prefix: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=bucket)
    for path in sorted(root.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(root).as_posix()}")


def two_epochs(
    url: str, samples: int, *, cache_dir: str | None, batch_size: int, workers: int, window: int
) -> tuple[float, float]:
    """Samples/s of epoch 1 and of epoch 2 of one loader (``epochs: 2``)."""
    from headrace.dataio import build_loader

    config = {
        "datasets": [{"path": url}],
        "batch_size": batch_size,
        "epochs": 2,
        "num_workers": workers,
        "shuffle_window": window,
        "cache_dir": cache_dir,
    }
    seen, split = 0, None
    start = time.perf_counter()
    for batch in build_loader(config):
        seen += len(batch["__key__"])
        if split is None and seen >= samples:
            split = (time.perf_counter(), seen)
    end = time.perf_counter()
    return split[1] / (split[0] - start), (seen - split[1]) / (end - split[0])


def main(argv: list[str] | None = None) -> int:
    from headrace.dataio.bench.corpus import demo_token_documents, write_indexed_shards
    from headrace.dataio.shards.formats import npy_bytes

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--docs", type=int, default=20000)
    p.add_argument("--per-shard", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--shuffle-window", type=int, default=1024, help="data.shuffle_window (samples)")
    p.add_argument("--modes", default="ranged,cache", help="ranged: 8 MB ranged GETs (no cache); cache: cache_dir")
    p.add_argument("--workdir", default="/tmp/s3cache_bench")
    args = p.parse_args(argv)

    work = Path(args.workdir)
    root = work / "text"
    if not (root / ".nv-meta").exists():
        samples = (
            {"__key__": f"d{i:08d}", "tokens.npy": npy_bytes(doc)}
            for i, doc in enumerate(demo_token_documents(args.docs))
        )
        write_indexed_shards(root, samples, pattern="text-%06d.tar", maxcount=args.per_shard)
    shard_bytes = sum(p.stat().st_size for p in root.glob("*.tar"))
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    for name, value in {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ[name] = value
    server = start_moto(port)
    try:
        upload(root, endpoint, "bench", "text")
        url = "s3://bench/text"
        print(
            f"{args.docs} documents, {len(list(root.glob('*.tar')))} shards, {shard_bytes / 1e6:.1f} MB; "
            f"batch {args.batch_size}, {args.num_workers} workers, shuffle_window {args.shuffle_window}"
        )
        print("| mode | epoch 1 samples/s | epoch 2 samples/s | epoch 2 / epoch 1 | cached MB after | load average |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for mode in args.modes.split(","):
            cache = work / "cache"
            shutil.rmtree(cache, ignore_errors=True)
            one, two = two_epochs(
                url,
                args.docs,
                cache_dir=str(cache) if mode == "cache" else None,
                batch_size=args.batch_size,
                workers=args.num_workers,
                window=args.shuffle_window,
            )
            cached = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()) / 1e6 if cache.exists() else 0.0
            print(
                f"| {mode} | {one:,.0f} | {two:,.0f} | {two / one:.2f}x | {cached:.1f} | {os.getloadavg()[0]:.1f} |",
                flush=True,
            )
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
