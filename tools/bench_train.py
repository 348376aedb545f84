"""Training throughput, one process: headrace's loader vs a plain torch DataLoader over webdataset.

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench_train --data demo/shards/text --steps 30     # CPU, demo model
    python -m tools.bench_train --config configs/llama_1b.yaml --device cuda --steps 50 --sources headrace

Both runs train the same model (``--config``, one process, same seed) for the same number of steps
on the same shards; only the batch source differs:

- ``headrace``: ``dataio.build_loader`` (indexed random access, best-fit packing, document-masked rows,
  worker processes) through the trainer's ``DevicePrefetcher``;
- ``webdataset``: ``wds.WebDataset`` over the same tars -> decode the ``.npy`` token member -> documents concatenated
  into rows of ``seq_len`` (the usual streaming recipe: no index, no packing metadata, so each row is one
  causal segment) -> ``torch.utils.data.DataLoader`` with the same workers and batch size.

Prints tokens/s, the data-wait fraction and the token fill for each, plus MFU (model FLOPs over the
device's dense bf16 peak from ``training.components.metrics.PEAK_FLOPS``) and peak memory on a GPU; steady state:
the first ``--warmup`` steps (allocator warm-up, compilation) are excluded.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import numpy as np
import torch


def webdataset_loader(shards: list[str], seq_len: int, batch_size: int, num_workers: int):
    import webdataset as wds

    def rows(samples):
        buffer = np.zeros(0, dtype=np.int64)
        for sample in samples:
            buffer = np.concatenate([buffer, np.asarray(sample["npy"], dtype=np.int64)])
            while len(buffer) > seq_len:
                row, buffer = buffer[: seq_len + 1], buffer[seq_len:]
                yield {"input_ids": torch.from_numpy(row[:-1].copy()), "labels": torch.from_numpy(row[1:].copy())}

    dataset = wds.WebDataset(shards, shardshuffle=False, nodesplitter=None, workersplitter=wds.split_by_worker,
                             empty_check=False).decode().compose(rows)

    class Loader:
        def __iter__(self):
            for batch in torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=num_workers):
                n, s = batch["input_ids"].shape
                yield batch | {"position_ids": torch.arange(s).expand(n, s).contiguous(),
                               "cu_seqlens": torch.arange(0, n * s + 1, s, dtype=torch.int32), "max_seqlen": s}

        def state_dict(self):
            return {}

    return Loader()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="demo/shards/text")
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--sources", nargs="+", choices=("headrace", "webdataset"), default=["headrace", "webdataset"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the figures")
    parser.add_argument("--out", default="runs/bench_train")
    parser.add_argument("overrides", nargs="*", help="extra job overrides, e.g. data.batch_size=2")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no CUDA device on this machine")

    from training.config.load import load_job_config
    from training.train import train

    results = {}
    for source in args.sources:
        cfg = load_job_config(args.config, [
            f"data.datasets=[{{path: {args.data}}}]", f"trainer.max_steps={args.steps}", "trainer.log_every=1",
            f"trainer.device={args.device}", f"trainer.output_dir={args.out}/{source}", "checkpoint.interval=0",
            "checkpoint.save_final=false", "checkpoint.export_hf=false", "checkpoint.resume=false",
            "logging.console=false", "logging.tensorboard=false", "model.tokenizer=null", *args.overrides])
        make_loader = None
        if source == "webdataset":
            shards = sorted(glob.glob(os.path.join(args.data, "train-*.tar")))
            make_loader = lambda r, n: webdataset_loader(shards[r::n], cfg.data.seq_len,  # noqa: E731
                                                         cfg.data.batch_size, cfg.data.num_workers)
        history = train(cfg, make_loader)[args.warmup:]
        mean = lambda key: sum(r[key] for r in history) / len(history)  # noqa: E731
        result = {"tokens_per_s": mean("tokens_per_s"), "data_wait_frac": mean("data_wait_frac"),
                  "pack_fill": mean("pack_fill"), "max_mem_gib": max(r["max_mem"] for r in history),
                  "mfu": mean("mfu") if history[0]["mfu"] is not None else None}
        results[source] = result
        mfu = f"  MFU {result['mfu']:6.2%}" if result["mfu"] is not None else ""
        print(f"{source:>10}: {result['tokens_per_s']:10,.0f} tok/s{mfu}  data wait {result['data_wait_frac']:6.2%}  "
              f"labelled-token fill {result['pack_fill']:6.1%}  peak mem {result['max_mem_gib']:.1f} GiB", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
