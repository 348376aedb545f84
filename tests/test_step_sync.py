"""The training step does not wait on the host: host reads of tensors on the training thread, counted through
the real trainer (``headrace.training.train.train``), one process, debug Llama, packed rows.

Every ``Tensor`` method that hands a value to Python (``item``, ``tolist``, ``cpu``, ``numpy``, ``__bool__``,
``__int__``, ``__float__``) is wrapped; calls from the training thread are counted, those from the optimizers'
own code (AdamW reads its host-side step counter) are left out. On a GPU each of these is a device sync.
Budget: none inside a step; per log window, the one read of the step's figures, the telemetry gather and the
dp sum of attention pairs (both on host tensors). On CUDA, ``test_step_sync_cuda`` proves the same with
``torch.cuda.set_sync_debug_mode("error")`` around every step.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter

import pytest
import torch

from tests.dist.train_common import TINY_LLAMA, ListLoader, packed_batches
from headrace.training.config.load import load_job_config

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
WINDOW_BUDGET = 3  # read_step_stats + rank_spread + sum_over_dp, once per log window


def job(tmp_path, steps: int, log_every: int, device: str = "cpu", **trainer):
    return load_job_config(
        None,
        base=dict(
            model=dict(config=dict(TINY_LLAMA), attn_implementation="headrace_varlen"),
            data=dict(datasets=[dict(path=str(tmp_path))], seq_len=32, batch_size=2, num_workers=0),
            trainer=dict(
                max_steps=steps, log_every=log_every, device=device, output_dir=str(tmp_path / "run"), **trainer
            ),
            checkpoint=dict(interval=0, save_final=False, export_hf=False, resume=False),
            logging=dict(console=False, tensorboard=False),
        ),
    )


def count_host_reads(monkeypatch) -> tuple[Counter, Counter]:
    """Patch the read methods; returns (reads inside ``take_step``, reads anywhere in ``run_steps``), by call site."""
    import headrace.training.train as train_mod

    main = threading.get_ident()
    in_step, anywhere = Counter(), Counter()
    state = {"step": False, "loop": False}

    def counted(name, original):
        def read(self, *args, **kwargs):
            if threading.get_ident() == main:
                frame = sys._getframe(1)
                site = f"{frame.f_code.co_filename}:{frame.f_lineno} {name}"
                if state["loop"] and "torch/optim/" not in frame.f_code.co_filename:
                    anywhere[site] += 1
                    if state["step"]:
                        in_step[site] += 1
            return original(self, *args, **kwargs)

        return read

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))

    def watched(name, flag):
        original = getattr(train_mod, name)

        def run(*args, **kwargs):
            state[flag] = True
            try:
                return original(*args, **kwargs)
            finally:
                state[flag] = False

        monkeypatch.setattr(train_mod, name, run)

    watched("take_step", "step")
    watched("run_steps", "loop")
    return in_step, anywhere


def test_steps_read_nothing_from_the_device_and_log_windows_stay_in_budget(tmp_path, process_group, monkeypatch):
    from headrace.training.components.metrics import attention_flops_per_pair, flops_per_token, matmul_flops_per_token
    from headrace.training.models.build import build_hf_config
    from headrace.training.train import train

    steps, log_every = 6, 3
    cfg = job(tmp_path, steps, log_every)
    batches = packed_batches(steps + 2, seq_len=32, rows=2)  # the prefetcher reads ahead
    in_step, anywhere = count_host_reads(monkeypatch)
    history = train(cfg, lambda rank, size: ListLoader(batches, rank, size, 1))
    monkeypatch.undo()
    assert [r["step"] for r in history] == [3, 6]
    assert not in_step, f"host reads inside the step: {dict(in_step)}"
    windows = steps // log_every
    assert sum(anywhere.values()) <= WINDOW_BUDGET * windows, dict(anywhere)
    # the logged figures are the step's: a finite loss and the real-token count of the last batch
    last = batches[steps - 1]
    assert history[-1]["tokens"] == int((last["labels"] != -100).sum()) and history[-1]["loss"] > 0

    # document-masked FLOPs against a hand count over the window's batches (their cu_seqlens), vs the full row
    hf = build_hf_config(cfg.model)
    for record, window in zip(history, (batches[:3], batches[3:6])):
        tokens = sum(b["input_ids"].numel() for b in window)
        pairs = 0
        for b in window:
            cu = b["cu_seqlens"].tolist()
            pairs += sum((e - s) * (e - s + 1) // 2 for s, e in zip(cu, cu[1:]))
        doc = tokens * matmul_flops_per_token(hf) + pairs * attention_flops_per_pair(hf)
        assert record["flops_per_s"] / record["flops_per_s_full_row"] == pytest.approx(
            doc / (tokens * flops_per_token(hf, 32)), rel=1e-9
        )
        assert record["flops_per_s"] < record["flops_per_s_full_row"]


def test_a_read_inside_the_step_is_caught(tmp_path, process_group, monkeypatch):
    """The counter is not blind: a step that reads its loss (what train_step did before) is reported."""
    import headrace.training.step as step_mod
    from headrace.training.train import train

    forward = step_mod.forward_loss_sum

    def reading_forward(model, batch, autocast, attention_kwargs=None):
        loss = forward(model, batch, autocast, attention_kwargs)
        loss.item()
        return loss

    monkeypatch.setattr(step_mod, "forward_loss_sum", reading_forward)
    cfg = job(tmp_path, 2, 2)
    batches = packed_batches(4, seq_len=32, rows=2)
    in_step, _ = count_host_reads(monkeypatch)
    train(cfg, lambda rank, size: ListLoader(batches, rank, size, 1))
    monkeypatch.undo()
    assert sum(count for site, count in in_step.items() if site.endswith(" item")) == 2
