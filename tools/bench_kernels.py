"""Benchmark kernels/ fast paths against their references (CPU by default; CUDA when --device cuda).

    .venv/bin/python -m tools.bench_kernels attention [--tokens 2048 8192] [--device cpu]
    .venv/bin/python -m tools.bench_kernels loss [--vocab 32768 131072] [--tokens 2048]

attention: forward+backward time of varlen attention over one packed row whose documents follow a
long-tailed (log-normal, median ~700 tokens) length distribution, a short-document row and a
single-document row; backends ``bucketed`` and ``dense_mask`` against a per-document SDPA loop
(the obvious simple alternative) and the explicit-softmax reference.

loss: forward+backward time and peak memory of ``linear_cross_entropy`` against full-logits
``F.cross_entropy``. Each case runs in a fresh subprocess; peak memory is the rise of the process's
RSS (``headrace.dataio.bench.measure.ProcessSampler``, every 0.5 ms) above its RSS after a warm-up step (CPU), or ``torch.cuda.max_memory_allocated`` (CUDA).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys

import numpy as np

import torch
import torch.nn.functional as F

from headrace.dataio.bench.corpus import longtail_lengths
from headrace.dataio.bench.measure import ProcessSampler
from headrace.dataio.bench.timing import best_interleaved
from headrace.kernels.loss import linear_cross_entropy, linear_cross_entropy_reference
from headrace.kernels.varlen_attention import varlen_attention, varlen_attention_reference


def _time_interleaved(fns: dict, device: str, repeats: int) -> dict[str, float]:
    """Best time of each function over ``repeats`` interleaved rounds, synchronising CUDA around each call."""
    return best_interleaved(fns, repeats, sync=torch.cuda.synchronize if device == "cuda" else None)


def document_layout(kind: str, tokens: int, seed: int = 0) -> list[int]:
    """Document lengths of one packed row of ``tokens``: 'longtail', 'short' or 'single'.

    'longtail': the 4th row of a greedy packing of a log-normal document stream (median ~700
    tokens, long tail), documents crossing a row boundary split as the packer splits them.
    'short': documents of 1-128 tokens. 'single': one document filling the row.
    """
    if kind == "single":
        return [tokens]
    rng = np.random.default_rng(seed)
    # 4 rows of ``tokens`` take at most 4 * tokens documents of >= 1 token.
    lengths = iter(
        (
            rng.integers(1, 129, 4 * tokens)
            if kind == "short"
            else longtail_lengths(rng, 4 * tokens, median=700, sigma=1.2)
        ).tolist()
    )
    rows, row, pending = [], [], 0
    while len(rows) < 4:
        pending = pending or next(lengths)
        piece = min(pending, tokens - sum(row))
        row.append(piece)
        pending -= piece
        if sum(row) == tokens:
            rows.append(row)
            row = []
    return rows[-1]


def _per_document_sdpa(q, k, v, cu):
    """The obvious alternative: one SDPA call per document (4-D, so CPU SDPA uses its flash kernel)."""
    outs = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qd, kd, vd = (x[s:e].transpose(0, 1)[None] for x in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]))
    return torch.cat([o[0].transpose(0, 1) for o in outs])


def bench_attention(args) -> list[dict]:
    rows = []
    device, dtype = args.device, getattr(torch, args.dtype)
    for tokens in args.tokens:
        for layout in ("longtail", "short", "single"):
            lengths = document_layout(layout, tokens)
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
            q = torch.randn(tokens, args.heads, args.head_dim, device=device, dtype=dtype, requires_grad=True)
            k = torch.randn(tokens, args.kv_heads, args.head_dim, device=device, dtype=dtype, requires_grad=True)
            v = torch.randn_like(k, requires_grad=True)
            g = torch.randn_like(q)
            impls = {
                "per_doc_sdpa": lambda: _per_document_sdpa(q, k, v, cu),
                "bucketed": lambda: varlen_attention(q, k, v, cu, backend="bucketed"),
                "dense_mask": lambda: varlen_attention(q, k, v, cu, backend="dense_mask"),
            }
            if device == "cuda":
                impls["flex"] = lambda: varlen_attention(q, k, v, cu, backend="flex")
                impls["flash"] = lambda: varlen_attention(q, k, v, cu, backend="flash")
            if tokens <= args.reference_max_tokens:
                impls["reference"] = lambda: varlen_attention_reference(q, k, v, cu)
            row = {"tokens": tokens, "layout": layout, "docs": len(lengths), "max_doc": max(lengths)}
            steps = {name: (lambda fn=fn: torch.autograd.grad(fn(), (q, k, v), g)) for name, fn in impls.items()}
            for name, step in list(steps.items()):
                try:
                    step()  # warm-up: plans, compilation
                except (RuntimeError, ImportError) as err:  # e.g. flash-attn not installed
                    row[name] = f"n/a ({str(err).splitlines()[0][:60]})"
                    del steps[name]
            # Interleave the implementations in each round so that load from other processes hits them alike.
            for name, seconds in _time_interleaved(steps, device, args.repeats).items():
                row[name] = seconds * 1e3
            rows.append(row)
            print(json.dumps(row) if args.json else _fmt(row), flush=True)
    return rows


def _loss_case(threads, device, tokens, hidden, vocab, dtype, impl, chunk_tokens, repeats, out):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    h = torch.randn(tokens, hidden, device=device, dtype=dt, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=device, dtype=dt) * 0.02).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device=device)

    def step():
        if impl == "chunked":
            loss, _ = linear_cross_entropy(h, w, y, chunk_size=chunk_tokens)
        else:
            loss, _ = linear_cross_entropy_reference(h, w, y)
        return torch.autograd.grad(loss, (h, w))

    step()  # warm-up outside the measurement: one-off BLAS/allocator set-up is not the step's memory
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        seconds = _time_interleaved({"step": step}, device, repeats)["step"]
        peak = torch.cuda.max_memory_allocated() - base
    else:
        # This process only (no children), polled every 0.5 ms: matmuls release the GIL.
        with ProcessSampler(interval=0.0005, descendants=False) as rss:
            seconds = _time_interleaved({"step": step}, device, repeats)["step"]
        peak = rss.peak_rss - rss.start_rss
    out.put({"impl": impl, "ms": seconds * 1e3, "peak_mib": peak / 2**20})


def bench_loss(args) -> list[dict]:
    rows = []
    ctx = mp.get_context("spawn")
    for vocab in args.vocab:
        row = {
            "tokens": args.tokens_loss,
            "hidden": args.hidden,
            "vocab": vocab,
            "dtype": args.dtype,
            "chunk": args.chunk_tokens,
            "logits_fp32_mib": args.tokens_loss * vocab * 4 / 2**20,
        }
        for impl in ("reference", "chunked"):
            out = ctx.Queue()
            case = (
                args.threads,
                args.device,
                args.tokens_loss,
                args.hidden,
                vocab,
                args.dtype,
                impl,
                args.chunk_tokens,
            )
            p = ctx.Process(target=_loss_case, args=(*case, args.repeats, out))
            p.start()
            res = out.get()
            p.join()
            row[f"{impl}_ms"], row[f"{impl}_peak_mib"] = res["ms"], res["peak_mib"]
        rows.append(row)
        print(json.dumps(row) if args.json else _fmt(row), flush=True)
    return rows


def _fmt(row: dict) -> str:
    return "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("part", choices=["attention", "loss", "all"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (CPU)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions; the best is reported")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192], help="packed row length (attention)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reference-max-tokens", type=int, default=2048, help="skip the slow reference above this")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--tokens-loss", type=int, default=2048, help="tokens per loss call")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--chunk-tokens", type=int, default=None, help="loss chunk rows (default: the library's)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"# torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, dtype {args.dtype}",
        flush=True,
    )
    if args.part in ("attention", "all"):
        bench_attention(args)
    if args.part in ("loss", "all"):
        bench_loss(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
