"""FP8 linears (``quantize.linear.float8``, headrace.training.models.float8) on CPU: the trainer's converted model
equals torchao's own conversion of the same weights, the layers it must skip are skipped with a reason, a few
training steps stay within float8 rounding of fp32, and every refused combination is one line through the CLI.
FSDP2 with float8 all-gather against one process: tests/dist/train_layouts.py (reshard)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import yaml

from tests.dist.train_common import TINY_LLAMA, packed_batches, save_pretrained_tiny
from tests.test_train import base_job

from headrace.training.config.load import load_job_config

torchao_float8 = pytest.importorskip("torchao.float8")

# intermediate 72: the MLP's 64x72 / 72x64 matmuls miss _scaled_mm's 16-alignment and must stay plain
ODD_MLP = dict(TINY_LLAMA, intermediate_size=72)


def float8_job(tmp_path, **float8) -> dict:
    job = base_job(tmp_path, model=dict(config=None, pretrained_path=str(tmp_path / "m")))
    job["quantize"] = dict(linear=dict(float8=float8))
    return job


def built(cfg):
    from headrace.training.distributed.parallel_dims import ParallelDims
    from headrace.training.model_kinds import build_model

    dims = ParallelDims.from_config(cfg.distributed, 1)
    return build_model(cfg, dims.build_meshes("cpu"), torch.device("cpu"))[0]


# The CLI closes the process group it ran in: these run before the tests that share the module's group.
@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["quantize.linear.float8.recipe_name=rowwise", "quantize.linear.float8.enable_fsdp_float8_all_gather=true"],
            "enable_fsdp_float8_all_gather needs recipe_name: tensorwise",
        ),
        (
            ["quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp=true"],
            "precompute_float8_dynamic_scale_for_fsdp needs enable_fsdp_float8_all_gather",
        ),
        (["quantize.linear.float8.recipe_name=tensorwise", "distributed.tp_size=2"], "with distributed.tp_size=2"),
        (["quantize.linear.float8.recipe=rowwise"], "float8.recipe: unknown key"),
        (["fp8.enabled=true", "fp8.use_te=true"], "fp8.use_te: unknown key"),
        (["distributed.offload_policy=cpu", "distributed.strategy=ddp"], "needs strategy: fsdp2"),
        (["distributed.offload_policy=disk"], "offload_policy='disk' is not supported"),
    ],
)
def test_refused_float8_and_offload_settings_are_one_line_from_the_cli(tmp_path, capsys, overrides, message):
    from headrace.training.__main__ import main

    job_yaml = tmp_path / "job.yaml"
    job_yaml.write_text(yaml.safe_dump(base_job(tmp_path)))
    assert main(["--config", str(job_yaml), *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err


def test_trainer_float8_model_equals_torchao_conversion_of_the_same_weights(tmp_path, process_group, capsys):
    from transformers import AutoModelForCausalLM

    from headrace.kernels.hf_attention import register_varlen_attention
    from headrace.training.models.loss import CausalLMLoss
    from headrace.training.step import forward_loss_sum

    save_pretrained_tiny(tmp_path / "m", ODD_MLP)
    batch = packed_batches(1)[0]
    model = built(load_job_config(None, base=float8_job(tmp_path, emulate=True)))
    printed = capsys.readouterr().out
    assert "8 linears in float8" in printed and "not a multiple of 16" in printed and "lm_head" in printed
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds["model.layers.0.self_attn.q_proj"] == "Float8Linear"
    assert kinds["model.layers.1.mlp.down_proj"] == kinds["lm_head"] == "Linear"

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation=register_varlen_attention())
    plain = CausalLMLoss(copy.deepcopy(hf))
    config = dataclasses.replace(torchao_float8.Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True)
    torchao_float8.convert_to_float8_training(hf, config=config, module_filter_fn=lambda m, name: "self_attn" in name)
    reference = CausalLMLoss(hf)
    got = forward_loss_sum(model, batch, autocast=False)
    want = forward_loss_sum(reference, batch, autocast=False)
    assert got.item() == want.item()
    got.backward(), want.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    full_precision = float(forward_loss_sum(plain, batch, autocast=False))
    assert want.item() != full_precision and abs(want.item() / full_precision - 1) < 1e-2  # float8 did run


def test_float8_training_stays_within_float8_rounding_of_fp32(tmp_path, process_group):
    """torch's own CPU ``_scaled_mm`` (no emulation) through train(): 4 steps, each loss within 2% of fp32's."""
    from tests.loader_util import make_text_dataset

    from headrace.training.train import train

    make_text_dataset(tmp_path / "data", [40])
    save_pretrained_tiny(tmp_path / "m", dict(TINY_LLAMA, vocab_size=1024))  # the dataset's ids reach ~1000
    runs = {}
    for name, float8 in (("fp32", None), ("float8", dict(recipe_name="rowwise"))):
        job = base_job(
            tmp_path,
            model=dict(config=None, pretrained_path=str(tmp_path / "m")),
            trainer=dict(max_steps=4, output_dir=str(tmp_path / name)),
            checkpoint=dict(interval=0, export_hf=False),
        )
        job["quantize"] = dict(linear=dict(float8=float8))
        runs[name] = [r["loss"] for r in train(load_job_config(None, base=job))]
    relative = [f / b - 1 for f, b in zip(runs["float8"], runs["fp32"])]
    assert all(abs(r) < 2e-2 for r in relative) and any(r != 0 for r in relative), relative


def test_automodel_fp8_block_and_offload_policy_load_as_written(tmp_path):
    job = base_job(
        tmp_path,
        distributed=dict(offload_policy=dict(_target_="torch.distributed.fsdp.CPUOffloadPolicy", pin_memory=False)),
    )
    job["fp8"] = dict(
        enabled=True,
        recipe_name="tensorwise",
        enable_fsdp_float8_all_gather=True,
        precompute_float8_dynamic_scale_for_fsdp=True,
        filter_fqns=["lm_head"],
        emulate=False,
    )
    cfg = load_job_config(None, base=job)
    float8 = cfg.quantize.linear.float8
    assert (float8.recipe_name, float8.enable_fsdp_float8_all_gather, float8.filter_fqns) == (
        "tensorwise",
        True,
        ["lm_head"],
    )
    assert (cfg.distributed.offload_policy, cfg.distributed.offload_pin_memory) == ("cpu", False)
    job["fp8"]["enabled"] = False
    assert load_job_config(None, base=job).quantize.linear.float8 is None
