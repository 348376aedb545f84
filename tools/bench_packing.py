"""Packing fill fraction and speed (dataio.packing), plus the CP split's work balance (dataio.cp_split).

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench_packing.py [--sim-docs 50000] [--repeats 3] [--json]

1. Real text: the demo corpus's documents (``tools.demo_corpus.select_documents``: package READMEs
   and standard-library docstrings), tokenized with a byte-level BPE trained on them the way the demo
   corpus does. Fill at seq_len 2048 / 8192 / 32768 for none, greedy (8 open rows), best_fit
   (buffers 1,000 and 10,000).
2. Simulation: ``--sim-docs`` log-normal lengths (median 718, sigma 1.664 -> p99 ~34.5k tokens) at
   seq_len 8192, the same algorithms.
3. Speed: tokens/s of one process through push + pop (batches of 8 rows materialised as tensors),
   median of ``--repeats`` runs, on the simulated documents.
4. CP split: per-rank causal work imbalance (max/mean) of head-tail vs contiguous split of best_fit
   batches at seq_len 32768.

Fill counts every row the stream produced, the end-of-stream flush included (rows_per_batch 1, so no
empty padding rows). Each run also checks that no document that fits in a row was split.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataio.cp_split import attention_work  # noqa: E402
from dataio.packing import Packer, PackingConfig, pack  # noqa: E402

SETTINGS = [("none", 1), ("greedy", 1), ("best_fit", 1000), ("best_fit", 10000)]


def real_documents() -> list[np.ndarray]:
    from tokenizers import Tokenizer

    from tools.demo_corpus import CorpusConfig, select_documents, train_tokenizer

    cfg = CorpusConfig()
    docs = select_documents(1_000_000)  # every document the environment has
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenizer.json"
        train_tokenizer([d.text for d in docs], cfg.vocab_size, path)
        tokenizer = Tokenizer.from_file(str(path))
    return [np.asarray(e.ids, dtype=np.int32) for e in tokenizer.encode_batch([d.text for d in docs])]


def simulated_documents(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(np.log(718), 1.664, n).astype(np.int64))
    pool = rng.integers(0, 50_000, int(lengths.max()) + 1, dtype=np.int32)  # views, not 100M+ tokens
    starts = rng.integers(0, len(pool) - lengths + 1)
    return [pool[s : s + n] for s, n in zip(starts.tolist(), lengths.tolist())]


def fill(docs: list[np.ndarray], seq_len: int, algo: str, buffer: int) -> dict:
    packer = Packer(PackingConfig(seq_len=seq_len, packing=algo, packing_buffer=buffer), rows_per_batch=1)
    pieces: dict[int, int] = {}
    for batch in pack(enumerate(docs), packer):
        for ref, _, _ in batch["__docs__"][0]:
            pieces[ref] = pieces.get(ref, 0) + 1
    fitting_split = sum(1 for ref, n in pieces.items() if n > 1 and len(docs[ref]) <= seq_len)
    t = packer.totals
    return {"seq_len": seq_len, "packing": algo, "buffer": buffer if algo == "best_fit" else None,
            "fill": t.fill, "rows": t.rows, "split_docs": t.split_docs, "fitting_docs_split": fitting_split}


def speed(docs: list[np.ndarray], seq_len: int, algo: str, buffer: int, repeats: int) -> dict:
    tokens = sum(len(d) for d in docs)
    times = []
    for _ in range(repeats):
        packer = Packer(PackingConfig(seq_len=seq_len, packing=algo, packing_buffer=buffer), rows_per_batch=8)
        start = time.perf_counter()
        for _ in pack(enumerate(docs), packer):
            pass
        times.append(time.perf_counter() - start)
    return {"seq_len": seq_len, "packing": algo, "buffer": buffer if algo == "best_fit" else None,
            "tokens_per_s": tokens / statistics.median(times), "seconds": statistics.median(times)}


def cp_balance(docs: list[np.ndarray], seq_len: int = 32768, batches: int = 20) -> list[dict]:
    packer = Packer(PackingConfig(seq_len=seq_len, packing="best_fit", packing_buffer=1000), rows_per_batch=1)
    cus = [b["cu_seqlens"] for _, b in zip(range(batches), pack(enumerate(docs), packer))]
    out = []
    for cp in (2, 4, 8):
        reports = [attention_work(cu, cp) for cu in cus]
        out.append({"cp_size": cp,
                    "head_tail_imbalance_max": max(r["causal"]["imbalance"] for r in reports),
                    "contiguous_imbalance_mean": statistics.mean(r["causal_contiguous"]["imbalance"] for r in reports)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sim-docs", type=int, default=50_000, help="simulated long-tailed documents")
    p.add_argument("--repeats", type=int, default=3, help="speed runs (median)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = p.parse_args(argv)

    real = real_documents()
    sim = simulated_documents(args.sim_docs)
    lens = {name: np.array([len(d) for d in docs]) for name, docs in (("real", real), ("sim", sim))}
    result = {
        "corpora": {name: {"docs": len(v), "tokens": int(v.sum()), "median": float(np.median(v)),
                           "p99": float(np.percentile(v, 99)), "max": int(v.max())} for name, v in lens.items()},
        "real_fill": [fill(real, L, a, b) for L in (2048, 8192, 32768) for a, b in SETTINGS],
        "sim_fill": [fill(sim, 8192, a, b) for a, b in SETTINGS],
        "speed": [speed(sim, 8192, a, b, args.repeats) for a, b in SETTINGS],
        "cp_balance": cp_balance(sim),
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for name, c in result["corpora"].items():
        print(f"{name}: {c['docs']} docs, {c['tokens']} tokens, median {c['median']:.0f}, p99 {c['p99']:.0f}, max {c['max']}")
    for title in ("real_fill", "sim_fill"):
        print(f"\n{title}\n| seq_len | packing | buffer | fill | rows | split docs | fitting docs split |")
        for r in result[title]:
            print(f"| {r['seq_len']} | {r['packing']} | {r['buffer'] or '-'} | {100 * r['fill']:.3f}% | "
                  f"{r['rows']} | {r['split_docs']} | {r['fitting_docs_split']} |")
    print("\nspeed (one process, batches of 8 rows as tensors)\n| seq_len | packing | buffer | tokens/s |")
    for r in result["speed"]:
        print(f"| {r['seq_len']} | {r['packing']} | {r['buffer'] or '-'} | {r['tokens_per_s'] / 1e6:.1f}M |")
    print("\nCP split, causal work imbalance (max/mean) at seq_len 32768\n| cp_size | head-tail (worst batch) | contiguous (mean) |")
    for r in result["cp_balance"]:
        print(f"| {r['cp_size']} | {r['head_tail_imbalance_max']:.4f} | {r['contiguous_imbalance_mean']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
