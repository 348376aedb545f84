"""LoRA against full fine-tuning of the same model, one process: step time, peak memory, checkpoint size.

    OMP_NUM_THREADS=2 python -m tools.bench_lora --mode lora            # one run; a JSON line of figures
    farm-bench -n 2 --timeout 1800 -- sh -c 'exec python -m tools.bench_lora --mode lora >>/tmp/lora.jsonl' \\
        --vs "sh -c 'exec python -m tools.bench_lora --mode full >>/tmp/full.jsonl'"   # interleaved A B A B
    python -m tools.bench_lora --mode lora --device cuda --steps 30 --seq-len 4096 --batch 4   # GPU

Each run trains the same Llama (``--hidden``, ``--layers``: about 200M parameters by default, fresh weights from
one seed) through the trainer's ``train()`` on synthetic packed rows (no data path: the loader's cost is not in
the figure), ``--steps`` steps, and prints the median step seconds after ``--warmup`` steps, tokens/s, the
peak memory (CUDA: max allocated; CPU: peak RSS of the process, the weights' own fp32 copy included), the
trainable parameters and the checkpoint's bytes on disk. ``--mode lora``: rank ``--rank`` adapters on every
``*_proj`` (attention and MLP), base frozen; ``full``: every parameter trained (AdamW state for all).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch


def synthetic_batches(count: int, seq_len: int, rows: int, vocab: int, seed: int = 0) -> list[dict]:
    """``count`` micro-batches of ``rows`` rows, each row 4 documents of seq_len / 4 random tokens (packed THD)."""
    g = torch.Generator().manual_seed(seed)
    doc = seq_len // 4
    out = []
    for _ in range(count):
        ids = torch.randint(1, vocab, (rows, seq_len + 1), generator=g)
        positions = torch.arange(seq_len).remainder(doc).expand(rows, seq_len).contiguous()
        starts = torch.arange(0, rows * seq_len + 1, doc, dtype=torch.int32)
        out.append(
            {
                "input_ids": ids[:, :-1].contiguous(),
                "labels": ids[:, 1:].contiguous(),
                "position_ids": positions,
                "cu_seqlens": starts,
                "max_seqlen": doc,
            }
        )
    return out


class Repeat:
    """The same micro-batches over and over; its state is the count served (all a resume would need)."""

    def __init__(self, batches: list[dict]):
        self.batches, self.served = batches, 0

    def __iter__(self):
        while True:
            self.served += 1
            yield self.batches[(self.served - 1) % len(self.batches)]

    def state_dict(self) -> dict:
        return {"served": self.served}

    def load_state_dict(self, states: list[dict]) -> None:
        self.served = states[0]["served"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--mode", choices=("lora", "full"), required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1, help="rows per micro-batch")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    args = parser.parse_args(argv)

    from headrace.training.config.load import load_job_config
    from headrace.training.distributed.process_group import process_group_closed
    from headrace.training.train import train

    with tempfile.TemporaryDirectory() as out:
        job = dict(
            model=dict(
                config=dict(
                    model_type="llama",
                    vocab_size=args.vocab,
                    hidden_size=args.hidden,
                    intermediate_size=args.hidden * 11 // 4,
                    num_hidden_layers=args.layers,
                    num_attention_heads=args.hidden // 64,
                    num_key_value_heads=args.hidden // 64,
                    max_position_embeddings=max(args.seq_len, 512),
                    tie_word_embeddings=False,
                ),
                attn_implementation="headrace_varlen",
            ),
            data=dict(datasets=[dict(path="unused")], seq_len=args.seq_len, batch_size=args.batch),
            optim=dict(lr=1e-4),
            checkpoint=dict(interval=0, save_final=True, export_hf=False),
            trainer=dict(max_steps=args.steps, output_dir=out, device=args.device, precision=args.precision),
            logging=dict(console=False, tensorboard=False),
        )
        if args.mode == "lora":
            job["peft"] = dict(dim=args.rank, alpha=2 * args.rank, target_modules=["*_proj"])
        batches = synthetic_batches(2, args.seq_len, args.batch, args.vocab)
        with process_group_closed():
            history = train(load_job_config(None, base=job), lambda rank, size: Repeat(batches))
        tokens = args.seq_len * args.batch
        seconds = [tokens / r["tokens_per_s"] for r in history[args.warmup :]]
        stored = sum(f.stat().st_size for f in (Path(out) / "checkpoints").rglob("*") if f.is_file())
    print(
        json.dumps(
            {
                "mode": args.mode,
                "device": args.device,
                "steps": len(seconds),
                "step_s_median": statistics.median(seconds),
                "tokens_per_s": tokens / statistics.median(seconds),
                "peak_mem_gib": history[-1]["max_mem"],
                "checkpoint_mib": stored / 2**20,
                "torch_threads": torch.get_num_threads(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
