"""The plain transformers training loop that ``tools.bench_train``'s ``plain`` source runs: what a transformers
user writes without a trainer, the baseline headrace has to beat on the same device.

Same model (the job's ``model:`` config, fresh weights from the same seed), same batch shape
(``data.batch_size`` rows of ``data.seq_len`` tokens, the webdataset rows of the same shards through a
``torch.utils.data.DataLoader``), and the usual recipe: ``attn_implementation="sdpa"`` causal over each whole
row (no document masks), fp32 weights under ``torch.autocast(bfloat16)`` on CUDA (``trainer.precision: bf16``;
fp32 otherwise), ``torch.optim.AdamW`` (``fused=True`` on CUDA, ``foreach`` elsewhere) with the job's
``optim:`` settings at its peak lr, ``clip_grad_norm_``, and the loss on the full ``[tokens, vocab]`` logits
(``F.cross_entropy`` in fp32). The host never reads the device inside the loop; the device is synchronized
only at the start and the end of the timed span (after ``warmup`` steps).

Figures (as ``tools.bench_train`` prints them for every source): tokens/s, data-wait fraction, MFU counted
both ways (``headrace.training.components.metrics``: ``mfu`` from the causal (query, key) pairs of each row, ``mfu_full_row``
the full-row count) and peak memory.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F

from headrace.training.components.metrics import (
    attention_flops_per_pair,
    flops_per_token,
    matmul_flops_per_token,
    max_memory_gib,
    peak_flops,
)


def plain_model(cfg, device: torch.device):
    """The job's transformers model with sdpa attention, fp32 weights, on ``device`` (seeded like the trainer)."""
    from transformers import AutoModelForCausalLM

    from headrace.training.models.build import build_hf_config

    hf_config = build_hf_config(cfg.model)
    torch.manual_seed(cfg.trainer.seed)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa", dtype=torch.float32)
    return model.to(device), hf_config


def run_plain_loop(cfg, rows, device: torch.device, steps: int, warmup: int) -> dict:
    """Train ``steps`` steps on ``rows`` (an iterable of ``{input_ids, labels}`` batches); figures over the steps
    after ``warmup`` (see the module docstring)."""
    model, hf_config = plain_model(cfg, device)
    model.train()
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
        fused=cuda or None,
        foreach=not cuda,
    )
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if cuda and cfg.trainer.precision == "bf16"
        else contextlib.nullcontext()
    )
    batches = iter(rows)
    tokens = pairs = 0
    wait = start = 0.0
    for step in range(steps):
        if step == warmup:
            if cuda:
                torch.cuda.synchronize(device)
            start, tokens, pairs, wait = time.perf_counter(), 0, 0, 0.0
        t = time.perf_counter()
        batch = next(batches)
        input_ids = batch["input_ids"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        wait += time.perf_counter() - t
        with autocast:
            logits = model(input_ids=input_ids, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        loss.backward()
        if cfg.optim.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rows_n, seq = input_ids.shape
        tokens += rows_n * seq
        pairs += rows_n * seq * (seq + 1) // 2  # causal over each whole row
    if cuda:
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    peak = peak_flops(device)
    flops = (tokens * matmul_flops_per_token(hf_config) + pairs * attention_flops_per_pair(hf_config)) / elapsed
    full_row = tokens * flops_per_token(hf_config, cfg.data.seq_len) / elapsed
    return {
        "tokens_per_s": tokens / elapsed,
        "data_wait_frac": wait / elapsed,
        "pack_fill": 1.0,
        "max_mem_gib": max_memory_gib(device),
        "mfu": flops / peak if peak else None,
        "mfu_full_row": full_row / peak if peak else None,
        "flops_per_s": flops,
        "flops_per_s_full_row": full_row,
        "loss": float(loss.detach()),
    }


__all__ = ["plain_model", "run_plain_loop"]
