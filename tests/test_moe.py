"""MoE in one process: the grouped-experts kernel against its loop oracle, capacity-factor dropping against a
per-assignment loop oracle, the three MoE families through the trainer's model (chunked loss + router aux loss)
against transformers' own forward, the hf/ export against save_pretrained's layout, the debug recipes, and the
one-line configuration errors. Expert parallelism over gloo is in test_moe_dist.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.loader_util import make_text_dataset
from tests.dist.train_common import TINY_LLAMA, VOCAB, packed_batches

from headrace.kernels.grouped_experts import grouped_experts  # noqa: E402
from headrace.training.config.load import load_job_config  # noqa: E402
from headrace.training.distributed.parallel_dims import ParallelDims  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RECIPES = ("debug_qwen3_moe", "debug_mixtral", "debug_olmoe")


def recipe_fields(recipe: str) -> dict:
    fields = dict(load_job_config(str(REPO / "configs" / f"{recipe}.yaml")).model.config)
    return fields | dict(vocab_size=VOCAB, max_position_embeddings=256)


def save_fused(path: Path, fields: dict, seed: int = 0):
    """A random checkpoint in transformers' fused in-memory layout (``experts.gate_up_proj`` (E, 2I, H))."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    path.mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config.save_pretrained(path)


# -- kernel ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_equals_the_per_expert_loop(dtype):
    """Forward and backward, with an empty expert, and with ``y.sum()`` (an expanded gradient, which
    ``_grouped_mm``'s CPU backward rejects unless made contiguous)."""
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 9, 2])
    x = torch.randn(int(counts.sum()), 16, dtype=dtype)
    gate_up, down = torch.randn(4, 32, 16, dtype=dtype), torch.randn(4, 16, 16, dtype=dtype)
    results = []
    for impl in ("grouped_mm", "loop"):
        leaves = [t.clone().requires_grad_() for t in (x, gate_up, down)]
        y = grouped_experts(*leaves, counts, F.silu, impl)
        y.sum().backward()
        results.append([y.detach(), *(t.grad for t in leaves)])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **tol)
    assert results[0][2][1].abs().sum() == 0  # the empty expert's gradient exists and is zero


def test_unaligned_widths_fall_back_to_the_loop():
    torch.manual_seed(0)
    counts = torch.tensor([3, 4])
    x, gate_up, down = torch.randn(7, 8, dtype=torch.bfloat16), torch.randn(2, 12, 8), torch.randn(2, 8, 6)
    gate_up, down = gate_up.bfloat16(), down.bfloat16()  # 6 bf16 = 12 bytes per row: _grouped_mm refuses
    torch.testing.assert_close(
        grouped_experts(x, gate_up, down, counts, F.silu, "grouped_mm"),
        grouped_experts(x, gate_up, down, counts, F.silu, "loop"),
        rtol=0,
        atol=0,
    )


def test_no_rows_still_reaches_inputs_and_weights():
    x = torch.zeros(0, 8, requires_grad=True)
    gate_up, down = torch.randn(2, 6, 8, requires_grad=True), torch.randn(2, 8, 3, requires_grad=True)
    grouped_experts(x, gate_up, down, torch.zeros(2, dtype=torch.long), F.silu).sum().backward()
    assert x.grad.shape == (0, 8) and gate_up.grad.abs().sum() == 0 and down.grad.abs().sum() == 0


# -- capacity factor (token dropping) -------------------------------------------------------------------


def dropping_oracle(experts, x, index, weights, capacity):
    """Loop reference of Megatron's token dropping: per expert, its (token, slot) assignments in token order
    (``position``) or by router weight, highest first (``probs``); the first C are computed, the rest add
    nothing. Returns (output, dropped assignments)."""
    tokens, k = index.shape
    num_experts = experts.gate_up_proj.shape[0]
    limit = capacity.per_expert(tokens, k, num_experts)
    parts, dropped = [[] for _ in range(tokens)], 0
    for e in range(num_experts):
        pairs = [(t, j) for t in range(tokens) for j in range(k) if index[t, j] == e]
        if capacity.policy == "probs":
            pairs.sort(key=lambda pair: -float(weights[pair].detach()))
        dropped += max(0, len(pairs) - limit)
        for t, j in pairs[:limit]:
            gate, up = F.linear(x[t], experts.gate_up_proj[e]).chunk(2)
            parts[t].append(weights[t, j] * F.linear(experts.act_fn(gate) * up, experts.down_proj[e]))
    return torch.stack([sum(p, torch.zeros_like(x[0])) for p in parts]), dropped


def experts_case(seed: int = 0):
    """A Qwen3-MoE experts module and a skewed top-2 routing of 24 tokens over 6 experts (expert 0 wanted by
    most tokens, expert 5 by none)."""
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = AutoConfig.for_model(
        "qwen3_moe", hidden_size=16, moe_intermediate_size=8, num_experts=6, num_experts_per_tok=2
    )
    torch.manual_seed(seed)
    experts = Qwen3MoeExperts(config)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    logits = torch.randn(24, 6) + torch.tensor([3.0, 1.0, 0.5, 0.0, 0.0, -1e9])
    weights, index = logits.softmax(-1).topk(2, dim=-1)
    return experts, torch.randn(24, 16), index, weights / weights.sum(-1, keepdim=True)


def run_experts(experts, x, index, weights, forward):
    """Output and gradients of x, the router weights and both expert weights for ``forward``."""
    experts.zero_grad()
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    out, *extra = forward(experts, x, index, weights)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return [
        out.detach(),
        x.grad,
        weights.grad,
        experts.gate_up_proj.grad.clone(),
        experts.down_proj.grad.clone(),
        *extra,
    ]


def ours(capacity, impl="grouped_mm"):
    from headrace.training.distributed.expert_parallel import MoEStats, routed_experts_forward

    def forward(experts, x, index, weights):
        stats = MoEStats()
        out = routed_experts_forward(
            experts,
            x,
            index,
            weights,
            layer=0,
            num_experts=6,
            ep_group=None,
            ep=1,
            impl=impl,
            stats=stats,
            capacity=capacity,
        )
        return out, stats.dropped

    return forward


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_capacity_drops_like_the_loop_oracle(policy, pad):
    """Grouped GEMM with dropping (and padding to capacity) = the per-assignment loop oracle: output and the
    gradients of tokens, router weights and experts; the same number of drops; the two policies differ."""
    from headrace.training.distributed.moe_routing import Capacity

    experts, x, index, weights = experts_case()
    capacity = Capacity(factor=1.0, policy=policy, pad=pad)
    *got, dropped = run_experts(experts, x, index, weights, ours(capacity))
    *want, want_dropped = run_experts(experts, x, index, weights, lambda *a: dropping_oracle(*a, capacity))
    assert dropped == want_dropped > 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    other = Capacity(factor=1.0, policy={"probs": "position", "position": "probs"}[policy], pad=pad)
    assert not torch.allclose(got[0], run_experts(experts, x, index, weights, ours(other))[0])


@pytest.mark.parametrize("policy, pad", [("position", False), ("probs", False), ("probs", True)])
def test_capacity_that_drops_nothing_equals_dropless(policy, pad):
    """factor 3 = E / k: capacity T >= any expert's load. position without padding is the dropless row order
    (bit-for-bit); probs reorders rows within an expert and padding adds zero-weight rows (within rounding)."""
    from headrace.training.distributed.moe_routing import Capacity

    experts, x, index, weights = experts_case(1)
    *dropless, _ = run_experts(experts, x, index, weights, ours(None))
    *got, dropped = run_experts(experts, x, index, weights, ours(Capacity(factor=3.0, policy=policy, pad=pad)))
    assert dropped == 0
    for g, w in zip(got, dropless):
        if policy == "position" and not pad:
            assert torch.equal(g, w)
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_padded_routes_have_static_shapes():
    """With padding the rows per expert are the capacity whatever the routing: N = E * C."""
    from headrace.training.distributed.moe_routing import Capacity, plan_routes

    capacity = Capacity(factor=1.25, pad=True)
    for seed in range(3):
        _, _, index, weights = experts_case(seed)
        routes = plan_routes(index, weights, 6, capacity)
        assert routes.counts.tolist() == [10] * 6 and routes.token_of_row.shape == (60,)  # ceil(24*2/6*1.25)
        assert int(routes.routed.sum()) == 48


# -- models ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
def test_moe_families_give_transformers_loss_and_gradients(tmp_path, process_group, recipe):
    """The trainer's model (meta build, fused weights loaded by DCP, chunked loss, our experts forward) equals
    transformers' model: summed CE + router_aux_loss_coef * HF's aux_loss * labelled tokens, and gradients,
    for the grouped GEMM, the loop and transformers' own experts implementation."""
    from transformers import AutoModelForCausalLM

    from headrace.kernels.hf_attention import packed_attention_kwargs, register_varlen_attention
    from headrace.training.model_kinds import build_model
    from headrace.training.step import forward_loss_sum

    save_fused(tmp_path / "m", recipe_fields(recipe))
    batch = packed_batches(1)[0]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation=register_varlen_attention())
    out = hf(input_ids=batch["input_ids"], output_router_logits=True, use_cache=False, **packed_attention_kwargs(batch))
    tokens = (batch["labels"] != -100).sum()
    ce = F.cross_entropy(out.logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum")
    want = ce + hf.config.router_aux_loss_coef * out.aux_loss * tokens
    want.backward()
    want_grads = dict(hf.named_parameters())
    for impl in ("grouped_mm", "loop", "hf"):
        cfg = load_job_config(
            None,
            base=dict(
                model=dict(pretrained_path=str(tmp_path / "m"), attn_implementation="headrace_varlen"),
                data=dict(datasets=[dict(path="unused")], seq_len=32, batch_size=2),
                distributed=dict(moe=dict(experts_implementation=impl)),
            ),
        )
        dims = ParallelDims.from_config(cfg.distributed, 1)
        model, _ = build_model(cfg, dims.build_meshes("cpu"), torch.device("cpu"))
        loss = forward_loss_sum(model, batch, autocast=False)
        loss.backward()
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
        for name, param in model.named_parameters():
            ref = want_grads[name].grad
            torch.testing.assert_close(param.grad, ref, rtol=1e-4, atol=1e-6 + 1e-4 * ref.abs().max().item())
        assert model.moe_stats.aux_losses == [pytest.approx(float(out.aux_loss.detach()), rel=1e-5)]
        if impl != "hf":  # our forward counts the routed tokens: top-k per token, every layer
            k = hf.config.num_experts_per_tok
            routed = [int(c.sum()) for c in model.moe_stats.tokens_per_expert.values()]
            assert routed == [k * batch["input_ids"].numel()] * 2


@pytest.mark.parametrize("recipe", RECIPES)
def test_moe_recipes_train_on_the_real_loader(tmp_path, process_group, recipe):
    from headrace.training.train import train

    make_text_dataset(tmp_path / "data", [40])
    cfg = load_job_config(
        str(REPO / "configs" / f"{recipe}.yaml"),
        [
            f"data.datasets=[{{path: {tmp_path / 'data'}}}]",
            "data.seq_len=64",
            "trainer.max_steps=6",
            f"trainer.output_dir={tmp_path / 'out'}",
            "optim.lr=0.01",
            "logging.console=false",
            "checkpoint.interval=0",
            "data.packing_buffer=8",
        ],
    )
    history = train(cfg)
    assert history[-1]["loss"] < history[0]["loss"]
    assert all(
        r["moe_imbalance"] >= 1.0 and r["moe_aux_loss"] > 0 and r["a2a_bytes"] == 0 and r["moe_dropped"] == 0
        for r in history
    )
    assert (tmp_path / "out" / "hf" / "model.safetensors.index.json").is_file()


# -- hf/ export layout -------------------------------------------------------------------------------------


def safetensors_dir(path: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("recipe", RECIPES)
def test_hf_export_writes_what_save_pretrained_writes(tmp_path, process_group, recipe):
    """transformers' ``save_pretrained`` of a MoE model built from its config writes the hub's per-expert
    layout (it reverts the load-time fusion; a model loaded from fused tensors would be saved fused). The
    trainer loads that layout (per-expert views through DCP's reader), and its export (DCP's HF writer) writes
    the same keys and tensors by default, the in-memory 3D tensors with ``fused``; both reload with
    from_pretrained to the same logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from headrace.training.checkpoint.export import export_hf
    from headrace.training.model_kinds import build_model

    fields = recipe_fields(recipe)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    hf.save_pretrained(tmp_path / "save_pretrained")
    want = safetensors_dir(tmp_path / "save_pretrained")
    assert any(".experts.0." in k for k in want) and not any("gate_up_proj" in k for k in want)

    cfg = load_job_config(
        None,
        base=dict(
            model=dict(pretrained_path=str(tmp_path / "save_pretrained")),
            data=dict(datasets=[dict(path="unused")], seq_len=32),
        ),
    )
    dims = ParallelDims.from_config(cfg.distributed, 1)
    model, hf_config = build_model(cfg, dims.build_meshes("cpu"), torch.device("cpu"))
    export_hf(model, hf_config, tmp_path / "per_expert")
    export_hf(model, hf_config, tmp_path / "fused", experts_layout="fused")
    got = safetensors_dir(tmp_path / "per_expert")
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert sorted(safetensors_dir(tmp_path / "fused")) == sorted(hf.state_dict())
    ids = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        logits = hf(input_ids=ids).logits
        for layout in ("per_expert", "fused"):
            reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / layout)
            assert all(torch.equal(v, hf.state_dict()[k]) for k, v in reloaded.state_dict().items())
            torch.testing.assert_close(reloaded(input_ids=ids).logits, logits, rtol=1e-6, atol=1e-6)


# -- configuration --------------------------------------------------------------------------------------


def test_automodel_moe_section_loads_as_written(tmp_path):
    """NeMo Automodel's MoE example (its seed), pasted as is."""
    job = dict(
        model=dict(config=recipe_fields("debug_qwen3_moe")),
        data=dict(datasets=[dict(path="x")], seq_len=32),
        distributed=dict(
            strategy="fsdp2",
            tp_size=1,
            cp_size=1,
            pp_size=1,
            ep_size=8,
            sequence_parallel=False,
            activation_checkpointing=True,
            moe=dict(reshard_after_forward=False, ignore_router_for_ac=False, wrap_outer_model=True),
        ),
    )
    cfg = load_job_config(None, base=job)
    assert cfg.distributed.ep_size == 8 and cfg.distributed.moe.wrap_outer_model is True


def bad_layout(model_type_fields: dict, world: int, **distributed):
    from transformers import AutoConfig

    from headrace.training.distributed.moe import check_moe
    from headrace.training.distributed.parallelize import check_supported

    fields = dict(model_type_fields)
    hf = AutoConfig.for_model(fields.pop("model_type"), **fields)
    cfg = load_job_config(
        None,
        base=dict(
            model=dict(config=dict(model_type_fields)),
            data=dict(datasets=[dict(path="x")], seq_len=32),
            distributed=distributed,
        ),
    ).distributed
    dims = ParallelDims.from_config(cfg, world)
    check_supported(dims, hf)
    check_moe(dims, cfg, hf)


@pytest.mark.parametrize(
    "world, distributed, message",
    [
        (4, dict(ep_size=3), r"ep_size 3 must divide dp_size \* cp_size = 4"),
        (8, dict(ep_size=8, tp_size=2), r"ep_size 8 must divide dp_size \* cp_size = 4"),
        (
            2,
            dict(ep_size=2, strategy="ddp"),
            r"strategy ddp replicates the whole model: it cannot combine with "
            r"\{'ep_size': 2\}",
        ),
        (6, dict(ep_size=3), r"ep_size=3 must divide the model's num_experts=8"),
        (2, dict(ep_size=2, moe=dict(experts_implementation="hf")), r"experts_implementation=hf keeps transformers'"),
        (
            2,
            dict(moe=dict(experts_implementation="fast")),
            r"experts_implementation='fast': one of grouped_mm, loop, hf",
        ),
        (2, dict(moe=dict(wrap_outer_model=False)), r"moe.wrap_outer_model=false is not supported"),
        (2, dict(moe=dict(lm_head_precision="float32")), r"moe.lm_head_precision='float32' is not supported"),
        (2, dict(moe=dict(ignore_router_for_ac=True)), r"ignore_router_for_ac=true only matters with"),
        (1, dict(moe=dict(capacity_factor=0.0)), r"moe.capacity_factor=0.0 must be > 0 \(null: dropless\)"),
        (1, dict(moe=dict(capacity_factor=1.0, experts_implementation="hf")), r"capacity_factor needs experts_impl"),
        (1, dict(moe=dict(pad_to_capacity=True)), r"pad_to_capacity=true needs distributed.moe.capacity_factor"),
    ],
)
def test_bad_moe_layouts_fail_with_one_line(world, distributed, message):
    with pytest.raises(ValueError, match=message) as err:
        bad_layout(recipe_fields("debug_qwen3_moe"), world, **distributed)
    assert "\n" not in str(err.value)


def test_ep_needs_experts_and_olmoe_refuses_tp():
    with pytest.raises(ValueError, match=r"ep_size=2 needs a mixture-of-experts model .* 'llama' has no experts"):
        bad_layout(TINY_LLAMA, 2, ep_size=2)
    with pytest.raises(ValueError, match="tp_size > 1 with olmoe is not supported"):
        bad_layout(recipe_fields("debug_olmoe"), 2, tp_size=2)


@pytest.mark.parametrize(
    "override, message",
    [
        ("distributed.moe.wrap_outer_model=false", "distributed.moe.wrap_outer_model=false is not supported"),
        ("distributed.ep_size=2", "ep_size 2 must divide dp_size * cp_size = 1"),
    ],
)
def test_cli_prints_the_moe_error_in_one_line(tmp_path, capsys, process_group, override, message):
    import torch.distributed as dist

    from headrace.training.__main__ import main
    from headrace.training.distributed.process_group import init_distributed

    saved = dict(os.environ)
    try:
        code = main(
            [
                "--config",
                str(REPO / "configs" / "debug_qwen3_moe.yaml"),
                "model.config.vocab_size=256",
                override,
                f"trainer.output_dir={tmp_path}",
            ]
        )
    finally:  # main() ends the process group it ran in; the module's fixture expects one to end itself
        os.environ.clear()
        os.environ.update({k: v for k, v in saved.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")})
        if not dist.is_initialized():
            init_distributed("cpu")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
