"""torchtitan beside headrace on the same work: the peer a user would pick instead, training the Llama shape
of ``configs/llama_1b.yaml`` (torchtitan's ``1B`` flavour: dim 2048, 16 layers, 32/8 heads, FFN 8192, tied
128,256 vocabulary) at the recipe's sequence length and batch, bf16, compiled, on one GPU, on the same demo
text, with torchtitan's own block-causal flex attention (document-masked, as headrace's rows are).

    python -m tools.bench_torchtitan --headrace runs/gpu_check/train_headrace/result.json     # on the GPU
    OMP_NUM_THREADS=1 python -m tools.bench_torchtitan --flavor debugmodel --device cpu --steps 3 --warmup 1 \\
        --seq-len 256 --no-compile                                                            # the driver, on CPU

torchtitan reads the demo corpus (``demo/corpus/text.jsonl``, tokenized by ``demo/corpus/tokenizer.json``)
through its own ``HuggingFaceTextDataLoader``: the corpus is registered as one more entry of its
``DATASETS`` table, read from the local file into a ``datasets.Dataset`` (nothing downloaded). Each runs at its own
defaults otherwise: torchtitan on one GPU keeps fp32 weights under bf16 autocast (no FSDP with nothing to
shard), AdamW, its chunked loss; headrace runs its recipe. Figures: tokens/s over the steps after
``--warmup`` (one device sync at each end), MFU from the same FLOP count for both (headrace's
``matmul_flops_per_token`` plus document-masked attention at the mean document length of the demo corpus,
``headrace.training.components.metrics``), peak allocated memory, and with ``--headrace RESULT`` (what
``tools.bench_train --json-out`` wrote in the same call) one line with headrace's tokens/s over torchtitan's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch

DATASET = "headrace_demo"


def register_demo_text(path: str) -> None:
    """The demo corpus as a torchtitan dataset: records read once, each record's ``text``."""
    from datasets import Dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    def load(p: str) -> Dataset:
        with open(p) as f:
            return Dataset.from_list([json.loads(line) for line in f])

    DATASETS[DATASET] = DatasetConfig(path=path, loader=load, sample_processor=lambda record: record["text"])


def trainer_config(args):
    """torchtitan's ``Trainer.Config`` for this run: its Llama 3 ``flavor`` with flex attention."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    spec = model_registry(args.flavor, attn_backend="flex")
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path=str(Path(args.tokenizer).parent),
        dump_folder=args.out,
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        optimizer=default_adamw(lr=args.lr),
        training=TrainingConfig(local_batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps),
        dataloader=HuggingFaceTextDataLoader.Config(dataset=DATASET),
        metrics=MetricsProcessor.Config(log_freq=max(args.warmup, 1)),
        checkpoint=CheckpointManager.Config(enable=False),
        compile=CompileConfig(enable=args.compile),
    )


def timed_train(trainer, warmup: int, steps: int) -> float:
    """Run torchtitan's loop; seconds from the end of step ``warmup`` to the end of the last step."""
    marks = {}
    step = trainer.train_step

    def timed_step(*a, **kw):
        out = step(*a, **kw)
        if trainer.step in (warmup, steps):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            marks[trainer.step] = time.perf_counter()
        return out

    trainer.train_step = timed_step
    trainer.train()
    return marks[steps] - marks[warmup]


def flops_per_token(args) -> float:
    """The FLOPs one token costs in either trainer: the recipe's model at the demo text's mean document length."""
    from headrace.training.components.metrics import attention_flops_per_pair, matmul_flops_per_token
    from headrace.training.config.load import load_job_config
    from headrace.training.models.build import build_hf_config

    hf = build_hf_config(load_job_config(args.config).model)
    with open(args.text) as f:
        tokenizer = __import__("tokenizers").Tokenizer.from_file(args.tokenizer)
        lengths = [min(len(tokenizer.encode(json.loads(line)["text"]).ids) + 1, args.seq_len) for line in f]
    mean_pairs = sum(n * (n + 1) / 2 for n in lengths) / sum(lengths)  # causal pairs per token, within documents
    return matmul_flops_per_token(hf) + attention_flops_per_pair(hf) * mean_pairs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/llama_1b.yaml", help="the headrace recipe it mirrors")
    parser.add_argument("--flavor", default="1B", help="torchtitan's Llama 3 flavour (1B = the recipe's shape)")
    parser.add_argument("--text", default="demo/corpus/text.jsonl")
    parser.add_argument("--tokenizer", default="demo/corpus/tokenizer.json")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--out", default="runs/bench_torchtitan")
    parser.add_argument("--headrace", help="tools.bench_train's JSON result from the same call: print the ratio")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible")
    # one process: what torchrun --nproc-per-node 1 would set (torchtitan reads them to pick its device)
    for key, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(free_port())),
    ):
        os.environ.setdefault(key, value)
    register_demo_text(args.text)
    trainer = trainer_config(args).build()
    seconds = timed_train(trainer, args.warmup, args.steps)
    tokens_per_s = (args.steps - args.warmup) * args.batch_size * args.seq_len / seconds
    result = {
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token(args),
        "max_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
    }
    if args.device == "cuda":
        from headrace.training.components.metrics import peak_flops

        result["mfu"] = tokens_per_s * result["flops_per_token"] / peak_flops(torch.device("cuda"))
    trainer.close()
    print(
        f"torchtitan: {tokens_per_s:,.0f} tok/s"
        + (f"  MFU {result['mfu']:.1%}  peak mem {result['max_mem_gib']:.1f} GiB" if args.device == "cuda" else ""),
        flush=True,
    )
    if args.headrace:
        ours = json.loads(Path(args.headrace).read_text())["headrace"]
        print(
            f"headrace vs torchtitan: {ours['tokens_per_s'] / tokens_per_s:.2f}x tok/s "
            f"({ours['tokens_per_s']:,.0f} vs {tokens_per_s:,.0f}), peak mem {ours['max_mem_gib']:.1f} vs "
            f"{result['max_mem_gib']:.1f} GiB",
            flush=True,
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
