"""Expert parallelism on real gloo process groups: one 4-rank launch runs every check of
tests/dist/moe_checks.py (EP exchange vs transformers' experts, ep2 / ep4 / ep2 x tp2 layouts and two with a
capacity factor vs the single-process reference, resume at another ep_size, per-expert and fused hf export
logits), starting from a ``save_pretrained`` (per-expert) checkpoint."""

from __future__ import annotations

import pytest
import torch

from tests.test_moe import recipe_fields
from tests.helpers import torchrun


@pytest.mark.slow
def test_expert_parallel_layouts_match_one_process(tmp_path):
    fields = recipe_fields("debug_qwen3_moe") | dict(head_dim=8, attention_dropout=0.0)
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields)).save_pretrained(
        tmp_path / "pretrained"
    )
    out = torchrun(4, "tests.dist.moe_checks", tmp_path).stdout
    for check in (
        "ep experts forward/backward equal",
        "ep2 first-step",
        "ep4_loop first-step",
        "ep2_tp2 first-step",
        "ep2_cap first-step",
        "ep4_cap_pad first-step",
        "ep2 matches",
        "ep4_loop matches",
        "ep2_tp2 matches",
        "ep2_cap matches",
        "ep4_cap_pad matches",
        "ep2 checkpoint resumes at ep4",
        "per-expert and fused hf exports reload",
    ):
        assert out.count(f"OK {check}") == 4, out[-3000:]
