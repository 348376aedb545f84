"""Chat data: ``dataio shard`` of conversations against transformers' ``apply_chat_template`` in a loop, and the
packed fill of conversations at 4k (docs/sft-data.md; figures in BENCHMARKS.md).

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench_chat [--conversations 100000] [--workers 2] [--json]

1. Corpus: ``--conversations`` long-tailed conversations (``headrace.dataio.bench.chat_corpus``: 1 + geometric
   turns, log-normal words per message) as ``messages`` JSONL, and a tokenizer directory (byte-level BPE of
   2,000 tokens trained on the same words, ChatML template with ``{% generation %}`` markers), made here.
2. Rendering + tokenizing, side by side in one run on the same conversations: transformers'
   ``apply_chat_template(c, tokenize=True)`` in a loop over conversations already parsed in memory (the baseline,
   one process), the same with ``return_dict=True, return_assistant_tokens_mask=True`` (what the shards hold),
   and the whole ``dataio shard --tokenizer DIR --workers N`` command (reading the JSONL, rendering, batch
   tokenization, masks, tar writing and the index included; a subprocess, its start-up included).
3. Packing: the shards through the loader (best_fit, seq_len 4096, packing_buffer 1000 and 10000): fill over
   every row emitted, conversations skipped as longer than 4096 (``long_conversations: skip``), and loader
   tokens/s against the same token documents stored as plain text (the rendered texts sharded with the same
   tokenizer), both in one process (num_workers 0).
4. Fill on a larger set (``--fill-conversations``, default 30,000, a different seed): the exact token lengths of the
   rendered conversations (``encode_batch``) through the loader's ``Packer`` (best_fit, seq_len 4096, buffers 1000
   and 10000, conversations over 4096 skipped as ``long_conversations: skip`` does): fill of every row, and of the
   rows closed before the end-of-stream flush (what an endless training stream sees).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from headrace.dataio.bench.chat_corpus import long_tailed_conversations, make_tokenizer_dir, write_jsonl


def baseline(tokdir: Path, convs: list, with_mask: bool) -> float:
    """Conversations per second of ``apply_chat_template(tokenize=True)`` in a loop (one process)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokdir))
    kwargs = {"return_dict": True, "return_assistant_tokens_mask": True} if with_mask else {}
    start = time.perf_counter()
    for c in convs:
        tok.apply_chat_template(c, tokenize=True, **kwargs)
    return len(convs) / (time.perf_counter() - start)


def shard(src: Path, out: Path, tokdir: Path, workers: int) -> float:
    """Seconds of the whole ``dataio shard`` command."""
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "headrace.dataio", "shard", str(src), "--output", str(out), "--tokenizer", str(tokdir),
         "--workers", str(workers), "--samples-per-shard", "5000", "--quiet"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return time.perf_counter() - start


def loader_pass(root: Path, buffer: int) -> dict:
    from headrace.config import from_dict
    from headrace.dataio import build_loader
    from headrace.dataio.config import DataConfig

    cfg = {"datasets": [{"path": str(root)}], "shuffle": False, "num_workers": 0, "epochs": 1, "batch_size": 8}
    cfg |= {"packing": "best_fit", "seq_len": 4096, "packing_buffer": buffer}
    loader = build_loader(from_dict(DataConfig, cfg), dp_rank=0, dp_size=1)
    tokens = capacity = skipped = 0
    start = time.perf_counter()
    for batch in loader:
        real = int((batch["position_ids"].numel()) * batch["fill"])
        tokens, capacity = tokens + real, capacity + batch["input_ids"].numel()
        skipped = batch.get("skipped_conversations", 0)
    seconds = time.perf_counter() - start
    return {"fill": tokens / capacity, "skipped": skipped, "tokens_per_s": tokens / seconds}


def packer_fill(lengths: list[int], buffer: int, seq_len: int = 4096) -> dict:
    import numpy as np

    from headrace.dataio.batching.packing import Packer
    from headrace.dataio.config import PackingConfig

    packer = Packer(PackingConfig(seq_len=seq_len, packing="best_fit", packing_buffer=buffer), rows_per_batch=1)
    kept = [n for n in lengths if n <= seq_len]
    for ref, n in enumerate(kept):
        packer.push(ref, np.zeros(n, dtype=np.int64))
        while packer.pop() is not None:
            pass
    before = packer.totals.fill
    packer.flush()
    while packer.pop() is not None:
        pass
    return {"fill": packer.totals.fill, "fill_before_flush": before, "skipped": len(lengths) - len(kept)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=100_000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--fill-conversations", type=int, default=30_000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-chat-") as tmp:
        tmp = Path(tmp)
        tokdir = make_tokenizer_dir(tmp / "tok", vocab_size=2000)
        convs = long_tailed_conversations(args.conversations, seed=0)
        src = write_jsonl(tmp / "chat.jsonl", [{"messages": c} for c in convs])
        results: dict = {"conversations": len(convs), "workers": args.workers}
        results["apply_chat_template_per_s"] = baseline(tokdir, convs, with_mask=False)
        results["apply_chat_template_mask_per_s"] = baseline(tokdir, convs, with_mask=True)
        seconds = shard(src, tmp / "shards", tokdir, args.workers)
        results["dataio_shard_per_s"] = len(convs) / seconds
        results["speedup_vs_tokenize"] = results["dataio_shard_per_s"] / results["apply_chat_template_per_s"]
        results["speedup_vs_mask"] = results["dataio_shard_per_s"] / results["apply_chat_template_mask_per_s"]

        from headrace.dataio.prepare.chat_template import load_chat_template

        template = load_chat_template(str(tokdir))
        write_jsonl(tmp / "text.jsonl", [{"text": template.render(c)[0]} for c in convs])
        shard(tmp / "text.jsonl", tmp / "text", tokdir, args.workers)
        for buffer in (1000, 10000):
            results[f"chat_buffer_{buffer}"] = loader_pass(tmp / "shards", buffer)
        results["text_buffer_1000"] = loader_pass(tmp / "text", 1000)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokdir / "tokenizer.json"))
        texts = [template.render(c)[0] for c in long_tailed_conversations(args.fill_conversations, seed=1)]
        lengths = [len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)]
        for buffer in (1000, 10000):
            results[f"fill_{buffer}"] = packer_fill(lengths, buffer)
    if args.json:
        print(json.dumps(results))
        return
    print(f"{len(convs):,} conversations, dataio shard --workers {args.workers}, {os.cpu_count()} cores")
    print(f"  apply_chat_template(tokenize=True) loop:        {results['apply_chat_template_per_s']:8.0f} conv/s")
    print(f"  ... + return_assistant_tokens_mask:             {results['apply_chat_template_mask_per_s']:8.0f} conv/s")
    print(
        f"  dataio shard (ids + masks + tars + index):     {results['dataio_shard_per_s']:8.0f} conv/s  "
        f"({results['speedup_vs_tokenize']:.2f}x / {results['speedup_vs_mask']:.2f}x)"
    )
    for name in ("chat_buffer_1000", "chat_buffer_10000", "text_buffer_1000"):
        r = results[name]
        print(
            f"  {name}: fill {r['fill']:.4f}, skipped {r['skipped']}, loader {r['tokens_per_s'] / 1e6:.2f} M tokens/s"
        )


if __name__ == "__main__":
    main()
