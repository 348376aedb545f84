"""torchrun script (2 ranks): the trainer's multi-rank reliability checks of issue 25, in one launch.

``torchrun --nproc-per-node 2 tests/dist/reliability_checks.py WORKDIR``. The dataset gives the two DP ranks
very different packed batch counts: unshuffled, rank 0 reads the even documents (31 tokens: one 32-token row
each) and rank 1 the odd ones (2 tokens: 16 per row), so with one row per batch rank 0 packs 20 batches and
rank 1 two.

1. ``train()`` with ``data.epochs: 1`` and ``trainer.eval_every: 5`` over such a val stream: used to deadlock
   (rank 1's read-ahead thread waited in the loader's tail all_reduce for rank 0's, blocked on its full queue
   while rank 0's main thread waited in FSDP's all-gather). Now both ranks train 20 steps (the longer rank's
   count; the other runs loss-free batches) and every validation counts each val document and labelled token
   exactly once (``VAL_DOCS``, ``VAL_TOKENS``, the stream read alone on one rank).
2. A second job on the same ``trainer.output_dir`` while another process holds it: ``OutputDirInUse`` on both
   ranks, naming the directory and the holder's pid.
3. ``distributed.tp_size: 2`` on a model with one KV head: a ConfigError on both ranks (no traceback).
4. A val set of one document (issue 34 item 9): rank 1 runs padding rows, the validation counts it once.
Prints ``OK <check>`` per passed check; any mismatch raises.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch.distributed as dist
import webdataset as wds

from tests.dist.train_common import TINY_LLAMA
from tests.loader_util import index_dir, npy_bytes

from headrace.config import ConfigError
from headrace.dataio import build_loader
from headrace.training.config.load import load_job_config
from headrace.training.components.run_lock import LOCK_FILE, OutputDirInUse
from headrace.training.distributed.process_group import init_distributed, process_group_closed
from headrace.training.train import train
from headrace.training.validation import documents_started
from headrace.training.config.job_config import val_data_config

DOCS = 40
VAL_DOCS = DOCS
VAL_TOKENS = (DOCS // 2) * 30 + (DOCS // 2) * 1  # next-token labels: a document of n tokens has n - 1


def uneven_dataset(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(root / "doc-000000.tar")) as w:
        for n in range(DOCS):
            tokens = np.arange(1, 32 if n % 2 == 0 else 3, dtype=np.int32) + n
            w.write({"__key__": f"doc{n:05d}", "tokens.npy": npy_bytes(tokens)})
    index_dir(root)


def job(workdir: Path, name: str, **overrides) -> object:
    data = dict(datasets=[dict(path=str(workdir / "data"))], seq_len=32, batch_size=1, packing="greedy",
                packing_buffer=4, shuffle=False, num_workers=0, epochs=1,
                val=dict(datasets=[dict(path=str(workdir / "data"))]))
    base = dict(model=dict(config=dict(TINY_LLAMA), attn_implementation="headrace_varlen"), data=data,
                distributed=dict(strategy="fsdp2"),
                trainer=dict(max_steps=100, eval_every=5, log_every=1, output_dir=str(workdir / name)),
                checkpoint=dict(interval=0, export_hf=False), logging=dict(console=False, tensorboard=False))
    return load_job_config(None, [f"{k}={v}" for k, v in overrides.items()], base=base)


def check_uneven_val_and_finite_stream(workdir: Path) -> None:
    cfg = job(workdir, "uneven")
    counted = {"docs": 0, "tokens": 0}
    for batch in build_loader(val_data_config(cfg.data), 0, 1):  # the val stream alone, on this rank
        counted["docs"] += documents_started(batch)
        counted["tokens"] += int((batch["labels"] != -100).sum())
    assert counted == {"docs": VAL_DOCS, "tokens": VAL_TOKENS}, counted
    history = train(cfg)
    assert [r["step"] for r in history] == list(range(1, 21)), [r["step"] for r in history]
    out = (workdir / "uneven" / "metrics.jsonl").read_text().splitlines() if dist.get_rank() == 0 else []
    vals = [line for line in out if '"val_loss"' in line]
    if dist.get_rank() == 0:
        assert len(vals) == 4 and all(f'"val_tokens": {VAL_TOKENS}' in v and f'"val_docs": {VAL_DOCS}' in v
                                      for v in vals), vals
    print("OK uneven val stream and finite training stream finish on every rank", flush=True)


def check_one_document_val_set(workdir: Path) -> None:
    """Issue 34 item 9: a val set of one document gives rank 1 no batch at all; validation used to die ("a DP rank
    got no batch at all") after the training work. Now rank 1 runs padding rows and the document counts once."""
    if dist.get_rank() == 0:
        (workdir / "one").mkdir()
        with wds.TarWriter(str(workdir / "one" / "doc-000000.tar")) as w:
            w.write({"__key__": "only", "tokens.npy": npy_bytes(np.arange(1, 11, dtype=np.int32))})
        index_dir(workdir / "one")
    dist.barrier()
    cfg = job(workdir, "one_val", **{"data.val": f"{{datasets: [{{path: {workdir / 'one'}}}]}}", "trainer.max_steps": 2,
                                     "trainer.eval_every": 2, "data.epochs": "null"})
    train(cfg)
    if dist.get_rank() == 0:
        vals = [line for line in (workdir / "one_val" / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
        assert len(vals) == 1 and '"val_docs": 1' in vals[0] and '"val_tokens": 9' in vals[0], vals
    print("OK a one-document val set validates on every rank", flush=True)


def check_output_dir_lock(workdir: Path) -> None:
    out_dir = workdir / "locked"
    holder = None
    if dist.get_rank() == 0:
        out_dir.mkdir()
        code = ("import sys, time; from headrace.dataio.shards.outdir import try_lock; f = try_lock(__import__('pathlib')"
                f".Path({str(out_dir / LOCK_FILE)!r})); f.write(b'host test pid %d' % __import__('os').getpid()); "
                "f.flush(); print('held', flush=True); time.sleep(120)")
        holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
    dist.barrier()
    try:
        train(job(workdir, "locked"))
    except OutputDirInUse as e:
        box = [holder.pid if holder else None]
        dist.broadcast_object_list(box, src=0)
        assert f"trainer.output_dir: {out_dir} is in use by another training job (host test pid {box[0]})" in str(e), e
    else:
        raise AssertionError("a second job on a held output_dir ran")
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    print("OK a held output_dir is refused on every rank", flush=True)


def check_tp_heads(workdir: Path) -> None:
    try:
        train(job(workdir, "tp", **{"distributed.tp_size": 2, "model.config.num_key_value_heads": 1}))
    except ConfigError as e:
        assert "tp_size 2 must divide num_attention_heads 8 and num_key_value_heads 1" in str(e), e
    else:
        raise AssertionError("tp_size 2 with one KV head trained")
    print("OK tp_size not dividing the heads is a ConfigError on every rank", flush=True)


def main(workdir: Path) -> None:
    init_distributed("cpu")
    if dist.get_rank() == 0:
        uneven_dataset(workdir / "data")
    dist.barrier()
    start = time.perf_counter()
    check_uneven_val_and_finite_stream(workdir)
    check_output_dir_lock(workdir)
    check_tp_heads(workdir)
    check_one_document_val_set(workdir)
    print(f"rank {dist.get_rank()} done in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    with process_group_closed():
        main(Path(sys.argv[1]))
