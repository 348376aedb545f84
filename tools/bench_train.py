"""Training throughput of the demo model on CPU: headrace's loader vs a plain torch DataLoader over webdataset.

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench_train.py --data demo/shards/text --steps 30

Both runs train the same model (configs/demo.yaml, one process, same seed) for the same number of steps
on the same shards; only the batch source differs:

- ``headrace``: ``dataio.build_loader`` (indexed random access, best-fit packing, document-masked rows,
  worker processes) through the trainer's ``DevicePrefetcher``;
- ``webdataset``: ``wds.WebDataset`` over the same tars -> decode the ``.npy`` token member -> documents concatenated
  into rows of ``seq_len`` (the usual streaming recipe: no index, no packing metadata, so each row is one
  causal segment) -> ``torch.utils.data.DataLoader`` with the same workers and batch size.

Prints tokens/s and the data-wait fraction for each (steady state: the first 5 steps are excluded).
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
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="runs/bench_train")
    args = parser.parse_args()

    from training.config import load_job_config
    from training.train import train

    results = {}
    for source in ("headrace", "webdataset"):
        cfg = load_job_config(args.config, [
            f"data.datasets=[{{path: {args.data}}}]", f"trainer.max_steps={args.steps}", "trainer.log_every=1",
            f"trainer.output_dir={args.out}/{source}", "checkpoint.interval=0", "checkpoint.save_final=false",
            "checkpoint.export_hf=false", "checkpoint.resume=false", "logging.console=false",
            "logging.tensorboard=false", "model.tokenizer=null"])
        make_loader = None
        if source == "webdataset":
            shards = sorted(glob.glob(os.path.join(args.data, "train-*.tar")))
            make_loader = lambda r, n: webdataset_loader(shards[r::n], cfg.data.seq_len,  # noqa: E731
                                                         cfg.data.batch_size, cfg.data.num_workers)
        history = train(cfg, make_loader)[5:]
        results[source] = {
            "tokens_per_s": sum(r["tokens_per_s"] for r in history) / len(history),
            "data_wait_frac": sum(r["data_wait_frac"] for r in history) / len(history),
            "pack_fill": sum(r["pack_fill"] for r in history) / len(history),
        }
        print(f"{source:>10}: {results[source]['tokens_per_s']:8,.0f} tok/s  "
              f"data wait {results[source]['data_wait_frac']:6.2%}  "
              f"labelled-token fill {results[source]['pack_fill']:6.1%}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
