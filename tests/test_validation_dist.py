"""Validation under pipeline and context parallelism: one 4-rank gloo launch (tests/dist/val_checks.py) compares
``headrace.training.eval`` at pp 4, pp 2 x dp 2 (two schedules), pp 2 x tp 2, cp 4, cp 2 x dp 2 and dp 4 with one process's
val loss, and the figures logged under ``trainer.eval_every`` at pp 2 x dp 2 and cp 2 x dp 2 with the checkpoint
evaluated at other layouts. Plus the config rules (no process group)."""

from __future__ import annotations

import pytest

from tests.helpers import torchrun


@pytest.mark.slow
def test_validation_under_pp_and_cp_equals_one_process(tmp_path):
    out = torchrun(4, "tests.dist.val_checks", tmp_path).stdout
    for layout in (
        "pp4_1f1b",
        "pp2_dp2_1f1b",
        "pp2_dp2_interleaved",
        "pp2_tp2",
        "cp4_allgather",
        "cp2_dp2_ring",
        "dp4",
    ):
        assert out.count(f"OK {layout} validation equals one process's") == 4, out[-3000:]
    for run in ("train_pp2_dp2", "train_cp2_dp2"):
        assert out.count(f"OK {run} validation in training equals its checkpoint") == 4, out[-3000:]


def test_validation_config_rules(tmp_path):
    from headrace.config import ConfigError
    from headrace.training.config.load import load_job_config
    from headrace.training.config.validate import check_job

    def job(**distributed):
        return load_job_config(
            None,
            base=dict(
                model=dict(config=dict(model_type="llama"), attn_implementation="headrace_varlen"),
                data=dict(
                    datasets=[dict(path="x")],
                    seq_len=32,
                    packing="greedy",
                    val=dict(datasets=[dict(path="v")], seq_len=30),
                ),
                distributed=dict(strategy="fsdp2", **distributed),
                trainer=dict(eval_every=5),
            ),
        )

    check_job(job(pp_size=2, pipeline=dict(pp_schedule="interleaved_1f1b")))
    with pytest.raises(ConfigError, match="pp_schedule DualPipeV: validation is not supported under the V"):
        check_job(job(pp_size=2, pipeline=dict(pp_schedule="DualPipeV")))
    with pytest.raises(ConfigError, match=r"data\.val\.seq_len=30 must be divisible by 2 x distributed\.cp_size = 4"):
        check_job(job(cp_size=2))


@pytest.mark.slow
def test_uneven_val_and_finite_streams_output_dir_lock_and_tp_heads_on_two_ranks(tmp_path):
    """Issue 25 (tests/dist/reliability_checks.py): an uneven val split and a finite training stream finish on both
    ranks with every val document counted once (was a deadlock), a held output_dir and tp not dividing the heads
    are refused on both ranks."""
    out = torchrun(2, "tests.dist.reliability_checks", tmp_path).stdout
    for check in (
        "uneven val stream and finite training stream finish on every rank",
        "a held output_dir is refused on every rank",
        "tp_size not dividing the heads is a ConfigError on every rank",
        "a one-document val set validates on every rank",
    ):
        assert out.count(f"OK {check}") == 2, out[-3000:]
