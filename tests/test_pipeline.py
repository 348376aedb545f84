"""Pipeline parallelism in one process: schedule names, the stage split, stage placement, the validation
messages, the Automodel ``pipeline:`` block; then the gloo runs of tests/dist/pp_checks.py (every schedule
at pp 2, pp 4, pp x dp FSDP2, pp x tp+SP, checkpoint resharding across pp) against one process."""

from __future__ import annotations

import itertools

import pytest
import yaml

from headrace.config import ConfigError
from headrace.training.config.load import load_job_config
from headrace.training.distributed.pipeline import (
    bubble_theory,
    local_stage_ids,
    microbatch_count,
    split_layers,
    stage_count,
)
from headrace.training.config.pipeline_schedules import schedule_class_name

from tests.dist.train_common import TINY_LLAMA, save_pretrained_tiny
from tests.helpers import torchrun

AUTOMODEL_BLOCK = """
model: {config: {model_type: llama}}
data: {datasets: [{path: unused}], seq_len: 32}
distributed:
  strategy: fsdp2
  dp_size: none
  pp_size: 2
  pipeline:
    pp_schedule: interleaved1f1b
    pp_microbatch_size: 4
    scale_grads_in_schedule: false
"""


def test_automodel_pipeline_block_loads_as_written():
    cfg = load_job_config(None, base=yaml.safe_load(AUTOMODEL_BLOCK))
    assert cfg.distributed.dp_size is None and cfg.distributed.pp_size == 2
    pipeline = cfg.distributed.pipeline
    assert (pipeline.pp_schedule, pipeline.pp_microbatch_size, pipeline.scale_grads_in_schedule) == (
        "interleaved1f1b",
        4,
        False,
    )
    with pytest.raises(ConfigError, match=r"pp_schedule: unknown schedule 'interleaved2f2b' \(accepted: .*1f1b"):
        load_job_config(
            None, ["distributed.pipeline.pp_schedule=interleaved2f2b"], base=yaml.safe_load(AUTOMODEL_BLOCK)
        )


@pytest.mark.parametrize(
    "names, cls",
    [
        (("1f1b", "1F1B", "Schedule1F1B"), "Schedule1F1B"),
        (("gpipe", "GPipe"), "ScheduleGPipe"),
        (("interleaved1f1b", "interleaved_1f1b", "Interleaved1F1B", "dfs"), "ScheduleInterleaved1F1B"),
        (("looped_bfs", "LoopedBFS"), "ScheduleLoopedBFS"),
        (("zero_bubble", "InterleavedZeroBubble"), "ScheduleInterleavedZeroBubble"),
        (("v_schedule", "ZBVZeroBubble", "zbv"), "ScheduleZBVZeroBubble"),
        (("DualPipeV", "dual_pipe_v"), "ScheduleDualPipeV"),
    ],
)
def test_schedule_spellings(names, cls):
    import torch.distributed.pipelining.schedules as torch_schedules

    assert {schedule_class_name(n) for n in names} == {cls}
    assert hasattr(torch_schedules, cls)


def test_split_balances_parameters_exactly():
    # brute force over every contiguous split with >= 1 block per stage: the split's max load is the minimum
    for blocks, heads, stages in [([5] * 8, (9, 7), 2), ([5] * 8, (30, 2), 4), ([3, 9, 1, 4, 4, 8, 2], (6, 6), 3)]:
        got = split_layers(blocks, heads, stages)
        assert [i for r in got for i in r] == list(range(len(blocks))) and all(len(r) for r in got)

        def load(bounds):
            ranges = list(zip((0,) + bounds, bounds + (len(blocks),)))
            return max(
                sum(blocks[lo:hi]) + (heads[0] if s == 0 else 0) + (heads[1] if s == stages - 1 else 0)
                for s, (lo, hi) in enumerate(ranges)
            )

        best = min(load(c) for c in itertools.combinations(range(1, len(blocks)), stages - 1))
        assert load(tuple(r.start for r in got[1:])) == best
    # the embedding stage gets one block; the rest spread evenly (stage loads 10/15/12, not 5/5/27)
    assert [len(r) for r in split_layers([5] * 8, (30, 2), 4)] in ([1, 2, 3, 2], [1, 3, 2, 2])


def test_stage_counts_placement_and_errors():
    from headrace.training.config.job_config import PipelineConfig as P

    assert stage_count(P(), "Schedule1F1B", 2, 8) == 2
    assert stage_count(P(), "ScheduleInterleaved1F1B", 2, 8) == 4
    assert stage_count(P(layers_per_stage=1), "ScheduleLoopedBFS", 4, 8) == 8
    assert stage_count(P(layers_per_stage=2, round_virtual_stages_to_pp_multiple="up"), "ScheduleLoopedBFS", 4, 10) == 8
    assert (
        stage_count(P(layers_per_stage=2, round_virtual_stages_to_pp_multiple="down"), "ScheduleLoopedBFS", 4, 10) == 4
    )
    with pytest.raises(ValueError, match="layers_per_stage 3 does not divide num_hidden_layers 8"):
        stage_count(P(layers_per_stage=3), "Schedule1F1B", 2, 8)
    with pytest.raises(ValueError, match="ScheduleZBVZeroBubble runs two stages per rank .* 4 stages at pp_size 2"):
        stage_count(P(layers_per_stage=4), "ScheduleZBVZeroBubble", 2, 8)
    with pytest.raises(ValueError, match="5 stages .* not a multiple of pp_size 2; set round_virtual_stages"):
        stage_count(P(layers_per_stage=2), "ScheduleInterleaved1F1B", 2, 10)
    with pytest.raises(ValueError, match="4 stages need at least one decoder block each .* num_hidden_layers 2"):
        stage_count(P(), "ScheduleInterleaved1F1B", 2, 2)
    assert local_stage_ids("ScheduleInterleaved1F1B", 1, 2, 4) == [1, 3]
    assert local_stage_ids("ScheduleZBVZeroBubble", 0, 2, 4) == [0, 3]
    assert local_stage_ids("ScheduleDualPipeV", 1, 2, 4) == [1, 2]
    assert microbatch_count(8, 2, "Schedule1F1B", 4) == 4
    with pytest.raises(ValueError, match="pp_microbatch_size 3 must divide the rows of a step"):
        microbatch_count(8, 3, "Schedule1F1B", 2)
    with pytest.raises(ValueError, match=r"needs at least as many microbatches as stages \(4\) but gets 2"):
        microbatch_count(8, 4, "Schedule1F1B", 4)
    assert bubble_theory("Schedule1F1B", 4, 1, 8) == 3 / 8
    assert bubble_theory("ScheduleInterleaved1F1B", 4, 2, 8) == 3 / 16
    assert bubble_theory("ScheduleDualPipeV", 4, 2, 8) == 0.0


def test_pp_needs_a_split_rule_and_untied_embeddings():
    from transformers import AutoConfig

    from headrace.training.config.job_config import JobConfig  # noqa: F401  (config types for build_pipeline)
    from headrace.training.distributed.pipeline import build_pipeline

    fields = dict(TINY_LLAMA)
    hf = AutoConfig.for_model(fields.pop("model_type"), **fields)
    cfg = load_job_config(None, base=yaml.safe_load(AUTOMODEL_BLOCK))
    hf.tie_word_embeddings = True
    with pytest.raises(ValueError, match="tie_word_embeddings=true is not supported"):
        build_pipeline(cfg, None, None, hf)
    hf.model_type = "gpt2"
    with pytest.raises(ValueError, match="model_type 'gpt2' has no pipeline split rule"):
        build_pipeline(cfg, None, None, hf)


@pytest.mark.slow
def test_pipeline_schedules_and_compositions_match_one_process(tmp_path):
    save_pretrained_tiny(tmp_path / "pretrained", dict(TINY_LLAMA, num_hidden_layers=8))
    out = torchrun(2, "tests.dist.pp_checks", tmp_path, "pp2", timeout=500).stdout
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zero_bubble", "v_schedule", "DualPipeV"):
        assert out.count(f"OK pp2 {schedule} matches") == 2, out[-3000:]
    for check in (
        "scale_grads_in_schedule trains the same model",
        "bf16 with activation checkpointing within",
        "hf export logits equal",
        "checkpoint resumes as resume_pp1",
    ):
        assert out.count(f"OK pp2 {check}") == 2, out[-3000:]
    out = torchrun(4, "tests.dist.pp_checks", tmp_path, "pp4", timeout=500).stdout
    for check in (
        "pp4_1f1b matches",
        "pp4_interleaved matches",
        "pp2_dp2_fsdp2 matches",
        "pp2_tp2_sp matches",
        "pp2 checkpoint resumes as resume_pp4",
    ):
        assert out.count(f"OK {check}") == 4, out[-3000:]
