"""tools.bench_train's pieces on CPU: the plain transformers loop (its figures and FLOP counts) and the trainer's
steady-state figures. The throughput figures themselves are for BENCHMARKS.md, not asserted."""

import pytest
import torch

from tests.dist.train_common import TINY_LLAMA
from tools.bench_train import SOURCES, figures_line, trainer_figures
from tools.plain_loop import run_plain_loop
from headrace.training.config.load import load_job_config
from headrace.training.components.metrics import attention_flops_per_pair, flops_per_token, matmul_flops_per_token
from headrace.training.models.build import build_hf_config


def test_sources_default_to_all_three():
    assert SOURCES == ("headrace", "webdataset", "plain")


def test_plain_loop_trains_and_counts_causal_rows(tmp_path):
    seq, rows = 32, 2
    cfg = load_job_config(
        None,
        base=dict(
            model=dict(config=dict(TINY_LLAMA)),
            data=dict(datasets=[dict(path="unused")], seq_len=seq, batch_size=rows),
            optim=dict(lr=1e-2, warmup_steps=0),
        ),
    )
    g = torch.Generator().manual_seed(0)
    fixed = torch.randint(0, TINY_LLAMA["vocab_size"], (rows, seq + 1), generator=g)
    batches = ({"input_ids": fixed[:, :-1], "labels": fixed[:, 1:]} for _ in range(8))  # one batch, learnable
    result = run_plain_loop(cfg, batches, torch.device("cpu"), steps=8, warmup=2)
    assert result["mfu"] is None and result["mfu_full_row"] is None  # no peak on CPU
    assert result["tokens_per_s"] > 0 and result["loss"] < 8.0  # ln(4096) = 8.3 at the start
    hf = build_hf_config(cfg.model)
    tokens, pairs = rows * seq, rows * seq * (seq + 1) // 2  # per step: causal over each whole row
    expected = (tokens * matmul_flops_per_token(hf) + pairs * attention_flops_per_pair(hf)) / (
        tokens * flops_per_token(hf, seq)
    )
    assert result["flops_per_s"] / result["flops_per_s_full_row"] == pytest.approx(expected, rel=1e-9)


def test_trainer_figures_weight_windows_by_steps():
    history = [
        dict(
            step=s,
            loss=5.0 - s / 10,
            tokens_per_s=t,
            data_wait_frac=0.0,
            pack_fill=1.0,
            max_mem=m,
            mfu=None,
            mfu_full_row=None,
            flops_per_s=f,
            flops_per_s_full_row=2 * f,
        )
        for s, t, m, f in [(5, 1.0, 1.0, 10.0), (10, 100.0, 2.0, 20.0), (12, 400.0, 3.0, 30.0)]
    ]
    got = trainer_figures(history, warmup=5)
    assert got["tokens_per_s"] == pytest.approx((100 * 5 + 400 * 2) / 7)  # the warm-up window left out
    assert got["flops_per_s_full_row"] == pytest.approx(2 * (20 * 5 + 30 * 2) / 7) and got["max_mem_gib"] == 3.0
    assert got["last_loss"] == pytest.approx(3.8)  # the last logged step's (tools.loss_gap compares it)


def test_rows_without_packing_report_no_fill_and_still_print():
    """The webdataset source's rows carry no packing metadata, so the trainer logs pack_fill None."""
    history = [
        dict(
            step=s,
            loss=1.0,
            tokens_per_s=10.0,
            data_wait_frac=0.0,
            pack_fill=None,
            max_mem=1.0,
            mfu=0.3,
            mfu_full_row=0.4,
            flops_per_s=1.0,
            flops_per_s_full_row=2.0,
        )
        for s in (5, 10)
    ]
    got = trainer_figures(history, warmup=5)
    assert got["pack_fill"] is None and got["mfu"] == pytest.approx(0.3)
    assert "fill" not in figures_line(got) and "MFU 30.00%" in figures_line(got)
