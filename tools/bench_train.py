"""Training throughput, one process: the headrace trainer on its loader and on webdataset, and a plain
transformers loop, side by side with their ratios.

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench_train --data demo/shards/text --steps 30     # CPU, demo model
    python -m tools.bench_train --config configs/llama_1b.yaml --device cuda --steps 50     # all three sources

Every run trains the same model (``--config``, one process, same seed) for the same number of steps
on the same shards and batch shape:

- ``headrace``: ``headrace.dataio.build_loader`` (indexed random access, best-fit packing, document-masked rows,
  worker processes) through the trainer's ``DevicePrefetcher``;
- ``webdataset``: ``wds.WebDataset`` over the same tars -> decode the ``.npy`` token member -> documents concatenated
  into rows of ``seq_len`` (the usual streaming recipe: no index, no packing metadata, so each row is one
  causal segment) -> ``torch.utils.data.DataLoader`` with the same workers and batch size;
- ``plain``: no headrace trainer at all: ``tools.plain_loop``, the loop a transformers user writes (sdpa
  causal over each whole row, fp32 weights under bf16 autocast on CUDA, fused AdamW, full-logits loss) on
  the ``webdataset`` rows.

Prints tokens/s, the data-wait fraction and the token fill for each, MFU counted two ways (``mfu``: the
attention the document masks require; ``mfu_full_row``: the full-row count, ``headrace.training.components.metrics``) over
the device's dense bf16 peak from ``headrace.training.components.metrics.PEAK_FLOPS``, and peak memory; then each source's
tokens/s over the others'. Steady state: the first ``--warmup`` steps (allocator warm-up, compilation) are
excluded; the trainer logs every ``--warmup`` steps, so it reads its figures (a GPU sync) once per window.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import numpy as np
import torch


SOURCES = ("headrace", "webdataset", "plain")


def webdataset_loader(shards: list[str], seq_len: int, batch_size: int, num_workers: int):
    import webdataset as wds

    def rows(samples):
        buffer = np.zeros(0, dtype=np.int64)
        for sample in samples:
            buffer = np.concatenate([buffer, np.asarray(sample["npy"], dtype=np.int64)])
            while len(buffer) > seq_len:
                row, buffer = buffer[: seq_len + 1], buffer[seq_len:]
                yield {"input_ids": torch.from_numpy(row[:-1].copy()), "labels": torch.from_numpy(row[1:].copy())}

    dataset = (
        wds.WebDataset(
            shards, shardshuffle=False, nodesplitter=None, workersplitter=wds.split_by_worker, empty_check=False
        )
        .decode()
        .compose(rows)
    )

    class Loader:
        def __iter__(self):
            for batch in torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=num_workers):
                n, s = batch["input_ids"].shape
                yield batch | {
                    "position_ids": torch.arange(s).expand(n, s).contiguous(),
                    "cu_seqlens": torch.arange(0, n * s + 1, s, dtype=torch.int32),
                    "max_seqlen": s,
                }

        def state_dict(self):
            return {}

    return Loader()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="demo/shards/text")
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the figures")
    parser.add_argument("--out", default="runs/bench_train")
    parser.add_argument("--json-out", help="also write the figures (the last line's JSON) to this file")
    parser.add_argument("overrides", nargs="*", help="extra job overrides, e.g. data.batch_size=2")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no CUDA device on this machine")

    from headrace.training.config.load import load_job_config
    from headrace.training.train import train

    results = {}
    for source in args.sources:
        cfg = load_job_config(
            args.config,
            [
                f"data.datasets=[{{path: {args.data}}}]",
                "data.val=null",
                "trainer.eval_every=0",
                f"trainer.max_steps={args.steps}",
                f"trainer.log_every={max(args.warmup, 1)}",
                f"trainer.device={args.device}",
                f"trainer.output_dir={args.out}/{source}",
                "checkpoint.interval=0",
                "checkpoint.save_final=false",
                "checkpoint.export_hf=false",
                "checkpoint.resume=false",
                "logging.console=false",
                "logging.tensorboard=false",
                "model.tokenizer=null",
                *args.overrides,
            ],
        )
        shards = sorted(glob.glob(os.path.join(args.data, "train-*.tar")))
        if source != "headrace" and not shards:
            parser.error(f"--sources {source}: no train-*.tar shards in {args.data}")
        rows = lambda r, n: webdataset_loader(
            shards[r::n],
            cfg.data.seq_len,  # noqa: E731
            cfg.data.batch_size,
            cfg.data.num_workers,
        )
        if source == "plain":
            from tools.plain_loop import run_plain_loop

            result = run_plain_loop(cfg, rows(0, 1), torch.device(args.device), args.steps, args.warmup)
        else:
            result = trainer_figures(train(cfg, rows if source == "webdataset" else None), args.warmup)
        results[source] = result
        print(f"{source:>10}: {figures_line(result)}", flush=True)
    for source, result in results.items():
        others = [
            f"{result['tokens_per_s'] / other['tokens_per_s']:.2f}x {name}"
            for name, other in results.items()
            if name != source
        ]
        if others:
            print(f"{source:>10} tok/s vs: {', '.join(others)}", flush=True)
    print(json.dumps(results))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f)


def trainer_figures(history: list[dict], warmup: int) -> dict:
    """Steady-state figures of the trainer's records: the log windows after step ``warmup``, weighted by steps."""
    previous = {history[0]["step"]: 0} | {r["step"]: p["step"] for p, r in zip(history, history[1:])}
    steady = [r for r in history if r["step"] > warmup]
    weights = [r["step"] - previous[r["step"]] for r in steady]

    def mean(key: str) -> float | None:  # None where the trainer has no such figure (MFU on CPU, fill of unpacked rows)
        if steady[0][key] is None:
            return None
        return sum(r[key] * w for r, w in zip(steady, weights)) / sum(weights)

    return {
        "tokens_per_s": mean("tokens_per_s"),
        "data_wait_frac": mean("data_wait_frac"),
        "last_loss": history[-1]["loss"],
        "pack_fill": mean("pack_fill"),
        "max_mem_gib": max(r["max_mem"] for r in history),
        "mfu": mean("mfu"),
        "mfu_full_row": mean("mfu_full_row"),
        "flops_per_s": mean("flops_per_s"),
        "flops_per_s_full_row": mean("flops_per_s_full_row"),
    }


def figures_line(result: dict) -> str:
    mfu = (
        f"  MFU {result['mfu']:6.2%} (full row {result['mfu_full_row']:6.2%})"
        if result["mfu"] is not None
        else f"  {result['flops_per_s'] / 1e9:.2f} GFLOP/s (full row {result['flops_per_s_full_row'] / 1e9:.2f})"
    )
    fill = f"labelled-token fill {result['pack_fill']:6.1%}  " if result["pack_fill"] is not None else ""
    return (
        f"{result['tokens_per_s']:10,.0f} tok/s{mfu}  data wait {result['data_wait_frac']:6.2%}  "
        f"{fill}peak mem {result['max_mem_gib']:.1f} GiB"
    )


if __name__ == "__main__":
    main()
