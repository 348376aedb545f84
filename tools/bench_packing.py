"""Packing fill fraction and speed (headrace.dataio.batching.packing), plus the CP split's work balance (headrace.dataio.feed.cp_split).

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench_packing [--sim-docs 50000] [--repeats 3]
        [--speed-docs 30000] [--baseline REV] [--speed-only] [--json]

1. Real text: the demo corpus's documents (``tools.demo_corpus.select_documents``: package READMEs
   and standard-library docstrings), tokenized with a byte-level BPE trained on them the way the demo
   corpus does. Fill at seq_len 2048 / 8192 / 32768 for none, greedy (8 open rows), best_fit
   (buffers 1,000 and 10,000).
2. Simulation: ``--sim-docs`` log-normal lengths (median 718, sigma 1.664 -> p99 ~34.5k tokens;
   ``headrace.dataio.bench.corpus.simulated_token_documents``) at seq_len 8192, the same algorithms.
3. Speed, one process, median of ``--repeats`` runs: tokens/s through push + pop, and separately the
   cost per document of ``push`` (placement, the end-of-stream flush included), per batch of ``pop``
   (materialising the tensors) and of a ``state_dict()`` taken after every batch (as the CUDA
   prefetcher does). Two workloads: the trainer's shape (seq_len 2048, 16 rows) on the real documents
   repeated to ``--speed-docs`` documents (short: per-document work dominates), and seq_len 8192, 8
   rows on ``--speed-docs`` simulated documents. The same run measures ``dataio/batching/packing.py`` as of
   git revision ``--baseline`` (loaded from ``git show`` into a temporary module, never into the
   package), so before/after figures come from one machine state.
4. CP split: per-rank causal work imbalance (max/mean) of head-tail vs contiguous split of best_fit
   batches at seq_len 32768.

Fill counts every row the stream produced, the end-of-stream flush included (rows_per_batch 1, so no
empty padding rows). Each run also checks that no document that fits in a row was split.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import headrace.dataio.batching.packing
from headrace.dataio.bench.corpus import simulated_token_documents
from headrace.dataio.bench.table import cell, markdown_row
from headrace.dataio.bench.timing import median_run
from headrace.dataio.feed.cp_split import attention_work
from headrace.dataio.batching.packing import Packer, pack
from headrace.dataio.config import PackingConfig

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [("none", 1), ("greedy", 1), ("best_fit", 1000), ("best_fit", 10000)]
SPEED_SETTINGS = SETTINGS[1:]
# The last revision with the sorted-key-list best_fit buffer and per-piece row assembly.
BASELINE_REV = "d431b29"


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


def fill(docs: list[np.ndarray], seq_len: int, algo: str, buffer: int) -> dict:
    packer = Packer(PackingConfig(seq_len=seq_len, packing=algo, packing_buffer=buffer), rows_per_batch=1)
    pieces: dict[int, int] = {}
    for batch in pack(enumerate(docs), packer):
        for ref, _, _ in batch["__docs__"][0]:
            pieces[ref] = pieces.get(ref, 0) + 1
    fitting_split = sum(1 for ref, n in pieces.items() if n > 1 and len(docs[ref]) <= seq_len)
    t = packer.totals
    return {
        "seq_len": seq_len,
        "packing": algo,
        "buffer": buffer if algo == "best_fit" else None,
        "fill": t.fill,
        "rows": t.rows,
        "split_docs": t.split_docs,
        "fitting_docs_split": fitting_split,
    }


def load_baseline(rev: str):
    """The packing module as of git revision ``rev``, as a stand-alone module (None without git).
    Revisions before the subpackage layout keep it at ``dataio/packing.py``."""
    for module_path in ("dataio/batching/packing.py", "dataio/packing.py"):
        try:
            source = subprocess.run(
                ["git", "show", f"{rev}:{module_path}"], cwd=ROOT, check=True, capture_output=True, text=True
            ).stdout
            break
        except (OSError, subprocess.CalledProcessError) as e:
            error = e
    else:
        print(f"no baseline: git show {rev}:dataio/batching/packing.py failed ({error})", file=sys.stderr)
        return None
    path = Path(tempfile.mkdtemp()) / "packing_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("packing_baseline", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def speed_once(impl, docs: list[np.ndarray], seq_len: int, rows: int, algo: str, buffer: int) -> dict:
    packer = impl.Packer(impl.PackingConfig(seq_len=seq_len, packing=algo, packing_buffer=buffer), rows_per_batch=rows)
    clock = time.perf_counter
    push_s = pop_s = state_s = 0.0
    batches = 0

    def drain() -> None:
        nonlocal pop_s, state_s, batches
        while True:
            t0 = clock()
            batch = packer.pop()
            pop_s += clock() - t0
            if batch is None:
                return
            batches += 1
            t0 = clock()
            packer.state_dict()
            state_s += clock() - t0

    for ref, doc in enumerate(docs):
        t0 = clock()
        packer.push(ref, doc)
        push_s += clock() - t0
        drain()
    t0 = clock()
    packer.flush()
    push_s += clock() - t0
    drain()
    tokens = sum(len(d) for d in docs)
    return {
        "tokens_per_s": tokens / (push_s + pop_s),
        "push_us_per_doc": 1e6 * push_s / len(docs),
        "pop_us_per_batch": 1e6 * pop_s / batches,
        "state_dict_us": 1e6 * state_s / batches,
        "batches": batches,
    }


def speed(impls: dict, workloads: dict, repeats: int) -> list[dict]:
    out = []
    for name, (docs, seq_len, rows) in workloads.items():
        for algo, buffer in SPEED_SETTINGS:
            for impl_name, impl in impls.items():
                runs = [speed_once(impl, docs, seq_len, rows, algo, buffer) for _ in range(repeats)]
                out.append(
                    {
                        "workload": name,
                        "seq_len": seq_len,
                        "rows": rows,
                        "packing": algo,
                        "buffer": buffer if algo == "best_fit" else None,
                        "impl": impl_name,
                        **median_run(runs, "tokens_per_s"),
                    }
                )
    return out


def cp_balance(docs: list[np.ndarray], seq_len: int = 32768, batches: int = 20) -> list[dict]:
    packer = Packer(PackingConfig(seq_len=seq_len, packing="best_fit", packing_buffer=1000), rows_per_batch=1)
    cus = [b["cu_seqlens"] for _, b in zip(range(batches), pack(enumerate(docs), packer))]
    out = []
    for cp in (2, 4, 8):
        reports = [attention_work(cu, cp) for cu in cus]
        out.append(
            {
                "cp_size": cp,
                "head_tail_imbalance_max": max(r["causal"]["imbalance"] for r in reports),
                "contiguous_imbalance_mean": statistics.mean(r["causal_contiguous"]["imbalance"] for r in reports),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--sim-docs", type=int, default=50_000, help="simulated long-tailed documents")
    p.add_argument("--repeats", type=int, default=3, help="speed runs (median)")
    p.add_argument("--speed-docs", type=int, default=30_000, help="documents per speed workload")
    p.add_argument("--baseline", default=BASELINE_REV, help="git revision of the packing module to compare with")
    p.add_argument("--speed-only", action="store_true", help="only the speed comparison")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = p.parse_args(argv)

    real = real_documents()
    sim = simulated_token_documents(args.sim_docs)  # log-normal, median 718, sigma 1.664
    lens = {name: np.array([len(d) for d in docs]) for name, docs in (("real", real), ("sim", sim))}
    repeated_real = [real[i % len(real)] for i in range(args.speed_docs)]
    workloads = {"real x16 rows": (repeated_real, 2048, 16), "sim x8 rows": (sim[: args.speed_docs], 8192, 8)}
    impls = {"current": headrace.dataio.batching.packing}
    if (baseline := load_baseline(args.baseline)) is not None:
        impls = {f"baseline {args.baseline}": baseline, **impls}
    result = {
        "corpora": {
            name: {
                "docs": len(v),
                "tokens": int(v.sum()),
                "median": float(np.median(v)),
                "p99": float(np.percentile(v, 99)),
                "max": int(v.max()),
            }
            for name, v in lens.items()
        },
        "speed": speed(impls, workloads, args.repeats),
    }
    if not args.speed_only:
        result["real_fill"] = [fill(real, L, a, b) for L in (2048, 8192, 32768) for a, b in SETTINGS]
        result["sim_fill"] = [fill(sim, 8192, a, b) for a, b in SETTINGS]
        result["cp_balance"] = cp_balance(sim)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for name, c in result["corpora"].items():
        print(
            f"{name}: {c['docs']} docs, {c['tokens']} tokens, median {c['median']:.0f}, p99 {c['p99']:.0f}, max {c['max']}"
        )
    print(
        "\nspeed (one process; push includes the flush; state_dict after every batch, not in tokens/s)\n"
        "| workload | seq_len | packing | buffer | impl | tokens/s | push us/doc | pop us/batch | state_dict us |"
    )
    for r in result["speed"]:
        print(
            markdown_row(
                [
                    r["workload"],
                    r["seq_len"],
                    r["packing"],
                    cell(r["buffer"]),
                    r["impl"],
                    f"{r['tokens_per_s'] / 1e6:.1f}M",
                    cell(r["push_us_per_doc"], ".2f"),
                    cell(r["pop_us_per_batch"], ".0f"),
                    cell(r["state_dict_us"], ".0f"),
                ]
            )
        )
    if args.speed_only:
        return 0
    for title in ("real_fill", "sim_fill"):
        print(f"\n{title}\n| seq_len | packing | buffer | fill | rows | split docs | fitting docs split |")
        for r in result[title]:
            print(
                markdown_row(
                    [
                        r["seq_len"],
                        r["packing"],
                        cell(r["buffer"]),
                        f"{100 * r['fill']:.3f}%",
                        r["rows"],
                        r["split_docs"],
                        r["fitting_docs_split"],
                    ]
                )
            )
    print(
        "\nCP split, causal work imbalance (max/mean) at seq_len 32768\n| cp_size | head-tail (worst batch) | contiguous (mean) |"
    )
    for r in result["cp_balance"]:
        print(
            markdown_row(
                [r["cp_size"], cell(r["head_tail_imbalance_max"], ".4f"), cell(r["contiguous_imbalance_mean"], ".3f")]
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
