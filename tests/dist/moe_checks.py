"""torchrun script: MoE expert parallelism on gloo against one process (``torchrun --nproc-per-node 4
-m tests.dist.moe_checks WORKDIR``; WORKDIR holds ``pretrained/``, a tiny Qwen3-MoE as ``save_pretrained`` writes it:
the hub's per-expert layout, which every rank reads into its own experts).

1. The experts forward alone, over the 4-rank ep group with hand-made routing (top-3; expert 5 and all of
   rank 3's experts receive no token): outputs, input and weight gradients equal transformers' own experts
   module in one process, for grouped GEMM and the per-expert loop.
2. Layouts ep2 (dp2 x ep2 FSDP2), ep4 (ep = dp) with the loop kernel, ep2 x tp2+SP with activation
   checkpointing that keeps router outputs, and two with a capacity factor (ep2: 1.0, drop by router weight;
   ep4: 1.25, drop by position, padded to capacity): the first step's loss (cross-entropy + the model's router
   aux loss) and the full gradients of the routers and experts equal the single-process HF reference (for the
   capacity layouts: HF's model running headrace's experts forward with the same capacity in one process,
   which test_moe.py checks against a loop oracle); then STEPS optimizer steps give the reference's losses and
   weights (read from the per-expert ``hf/`` export, named and split as transformers' own
   ``revert_weight_conversion`` of the reference); MoE metrics are logged (``moe_dropped`` > 0 only with a
   capacity factor).
3. The ep2 run's step-2 checkpoint resumes at ep4 with the uninterrupted losses; the exported ``hf/`` (per
   expert) and a fused export of the same sharded model reload with ``from_pretrained`` and give its logits.
Prints ``OK <check>`` per passed check; any mismatch raises.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.dist.train_common import ListLoader, copy_checkpoint, packed_batches
from tests.dist.train_layouts import check_close, check_exported_params, job, loaders

from headrace.kernels.hf_attention import packed_attention_kwargs, register_varlen_attention  # noqa: E402
from headrace.training.checkpoint import export, restore  # noqa: E402
from headrace.training.config.job_config import OptimConfig  # noqa: E402
from headrace.training.distributed.expert_parallel import install_experts_forward, routed_experts_forward  # noqa: E402
from headrace.training.distributed.moe import sparse_blocks  # noqa: E402
from headrace.training.distributed.moe_routing import Capacity  # noqa: E402
from headrace.training.components.optim import build_optimizer, lr_at, set_lr  # noqa: E402
from headrace.training.distributed.parallel_dims import ParallelDims  # noqa: E402
from headrace.training.model_kinds import build_model  # noqa: E402
from headrace.training.train import train  # noqa: E402
from headrace.training.step import forward_loss_sum  # noqa: E402

STEPS, GLOBAL_MICRO = 4, 4
OPTIM = dict(lr=3e-3, warmup_steps=1, decay_steps=4, max_grad_norm=1.0, weight_decay=0.1)
LAYOUTS = {
    "ep2": (dict(strategy="fsdp2", ep_size=2), 1),
    "ep4_loop": (dict(strategy="fsdp2", ep_size=4, moe=dict(experts_implementation="loop")), 1),
    "ep2_tp2": (dict(strategy="fsdp2", ep_size=2, tp_size=2, sequence_parallel=True, activation_checkpointing=True,
                     moe=dict(ignore_router_for_ac=True)), 2),
    "ep2_cap": (dict(strategy="fsdp2", ep_size=2, moe=dict(capacity_factor=1.0, token_drop_policy="probs")), 1),
    "ep4_cap_pad": (dict(strategy="fsdp2", ep_size=4, moe=dict(capacity_factor=1.25, token_drop_policy="position",
                                                               pad_to_capacity=True)), 1),
}


def capacity_of(distributed: dict) -> Capacity | None:
    moe = distributed.get("moe", {})
    if moe.get("capacity_factor") is None:
        return None
    return Capacity(factor=moe["capacity_factor"], policy=moe["token_drop_policy"],
                    pad=moe.get("pad_to_capacity", False))


def hf_model(workdir: Path, capacity: Capacity | None = None):
    """The pretrained model as transformers runs it; with a capacity, its experts run headrace's forward (one
    process, no EP) with that capacity."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(workdir / "pretrained",
                                                 attn_implementation=register_varlen_attention())
    if capacity is not None:
        for layer, mlp in sparse_blocks(model):
            install_experts_forward(mlp.experts, layer=layer, num_experts=model.config.num_experts, ep_group=None,
                                    ep=1, impl="grouped_mm", stats=None, capacity=capacity)
    return model


def reference_loss(model, micro) -> torch.Tensor:
    """Summed CE + coef * HF's own aux_loss * labelled tokens, per micro-batch (the trainer's definition)."""
    import torch.nn.functional as F

    total = 0
    for mb in micro:
        out = model(input_ids=mb["input_ids"], output_router_logits=True, use_cache=False,
                    **packed_attention_kwargs(mb))
        tokens = (mb["labels"] != -100).sum()
        ce = F.cross_entropy(out.logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=-100, reduction="sum")
        total = total + ce + model.config.router_aux_loss_coef * out.aux_loss * tokens
    return total


def reference(workdir: Path, batches, capacity: Capacity | None):
    """(losses, first-step mlp gradients, final weights in the hub layout, first-step loss sum) of plain
    single-process training, computed on rank 0 and broadcast (every rank would compute the same, on 2 shared
    cores)."""
    result = [_reference(workdir, batches, capacity) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(result, src=0)
    return result[0]


def _reference(workdir: Path, batches, capacity: Capacity | None):
    from transformers.core_model_loading import revert_weight_conversion

    model = hf_model(workdir, capacity)
    cfg = OptimConfig(**OPTIM)
    opt = build_optimizer(model, cfg)
    losses, first_grads = [], None
    for step in range(1, STEPS + 1):
        micro = batches[(step - 1) * GLOBAL_MICRO: step * GLOBAL_MICRO]
        tokens = sum(int((mb["labels"] != -100).sum()) for mb in micro)
        total = reference_loss(model, micro) / tokens
        total.backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters() if "mlp" in n}
            first_loss_sum = float(total) * tokens
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        set_lr(opt, lr_at(step, cfg, STEPS))
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
    hub = revert_weight_conversion(model, {k: v.detach().clone() for k, v in model.state_dict().items()})
    return losses, first_grads, hub, first_loss_sum


def check_experts_forward() -> None:
    """Hand-made routing through the 4-rank EP exchange vs transformers' experts module in one process."""
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    rank, world = dist.get_rank(), dist.get_world_size()
    config = AutoConfig.for_model("qwen3_moe", hidden_size=16, moe_intermediate_size=8, num_experts=8,
                                  num_experts_per_tok=3)
    torch.manual_seed(0)
    full = Qwen3MoeExperts(config)
    for p in full.parameters():
        torch.nn.init.normal_(p, std=0.3)
    tokens = 6
    x = torch.randn(world * tokens, 16, requires_grad=True)
    allowed = torch.tensor([0, 1, 2, 3, 4])  # experts 5, 6, 7 never chosen: rank 3 (experts 6, 7) gets nothing
    gen = torch.Generator().manual_seed(1)
    index = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:3]] for _ in range(world * tokens)])
    weights = torch.rand(world * tokens, 3, generator=gen)
    want = full(x, index, weights)
    (want * torch.linspace(-1, 1, 16)).sum().backward()
    local = slice(rank * tokens, (rank + 1) * tokens)
    group = dist.new_group(list(range(world)))
    for impl in ("grouped_mm", "loop"):
        mine = Qwen3MoeExperts(config)
        experts_per_rank = 8 // world
        mine_experts = slice(rank * experts_per_rank, (rank + 1) * experts_per_rank)
        with torch.no_grad():
            mine.gate_up_proj = torch.nn.Parameter(full.gate_up_proj[mine_experts].clone())
            mine.down_proj = torch.nn.Parameter(full.down_proj[mine_experts].clone())
        x_local = x[local].detach().requires_grad_()
        out = routed_experts_forward(mine, x_local, index[local], weights[local], layer=0, num_experts=8,
                                     ep_group=group, ep=world, impl=impl, stats=None)
        (out * torch.linspace(-1, 1, 16)).sum().backward()
        check_close(f"ep experts {impl} out", out.detach(), want[local].detach(), 1e-6)
        check_close(f"ep experts {impl} dx", x_local.grad, x.grad[local], 1e-6)
        for name in ("gate_up_proj", "down_proj"):
            grad = getattr(mine, name).grad * world  # _local's 1/ep correction (the trainer's loss scale undoes it)
            check_close(f"ep experts {impl} d{name}", grad, getattr(full, name).grad[mine_experts], 1e-5)
        if rank == world - 1:
            assert float(mine.gate_up_proj.grad.abs().sum()) == 0.0  # no token reached this rank
    print("OK ep experts forward/backward equal transformers' experts (top-3, empty experts and rank)", flush=True)


def check_first_gradients(workdir: Path, batches, refs: dict) -> None:
    """First step of each layout (no optimizer step): loss and router/expert gradients vs the reference."""
    world = dist.get_world_size()
    tokens = sum(int((mb["labels"] != -100).sum()) for mb in batches[:GLOBAL_MICRO])
    for name, (distributed, k) in LAYOUTS.items():
        _, want_grads, _, want_loss = refs[capacity_of(distributed)]
        cfg = job(workdir, f"grads_{name}", distributed, k)
        dims = ParallelDims.from_config(cfg.distributed, world)
        dims.build_meshes("cpu")
        model, _ = build_model(cfg, dims, torch.device("cpu"))
        loader = iter(ListLoader(batches, dims.get_mesh("dp").get_local_rank(), dims.dp, k))
        loss = 0.0
        for _ in range(k):
            mb_loss = forward_loss_sum(model, next(loader), autocast=False)
            (mb_loss * dims.dp / tokens).backward()
            loss += float(mb_loss)
        total = torch.tensor(loss, dtype=torch.float64)
        dist.all_reduce(total, group=dims.get_mesh("dp").get_group())
        check_close(f"{name} first loss", total, want_loss, 1e-5 * want_loss)
        checked = 0
        for pname, param in model.named_parameters():
            pname = pname.replace("_checkpoint_wrapped_module.", "")
            if pname in want_grads:
                grad = param.grad.full_tensor()
                ref = want_grads[pname]
                check_close(f"{name} grad {pname}", grad, ref, 1e-5 + 1e-4 * ref.abs().max().item())
                checked += 1
        assert checked == len(want_grads), (checked, len(want_grads))
        print(f"OK {name} first-step loss and router/expert gradients equal the reference", flush=True)


def run(workdir: Path, batches) -> None:
    check_experts_forward()
    capacities = dict.fromkeys(capacity_of(distributed) for distributed, _ in LAYOUTS.values())
    refs = {cap: reference(workdir, batches, cap) for cap in capacities}
    dropless = refs[None][1]
    for cap, (_, grads, _, _) in refs.items():  # dropping moves expert gradients far beyond the checks' tolerance
        gap = max(float((grads[n] - dropless[n]).abs().max() / dropless[n].abs().max())
                  for n in grads if "experts" in n)
        assert cap is None or gap > 1e-2, (cap, gap)
    check_first_gradients(workdir, batches, refs)
    results = {}
    for name, (distributed, k) in LAYOUTS.items():
        ref_losses, _, ref_params, _ = refs[capacity_of(distributed)]
        history = train(job(workdir, name, distributed, k), loaders(batches, k))
        check_close(f"{name} losses", [r["loss"] for r in history], ref_losses, 2e-5)
        assert all(r["moe_imbalance"] >= 1.0 and r["a2a_bytes"] > 0 and r["a2a_s"] > 0 and r["moe_aux_loss"] > 0
                   and (r["moe_dropped"] > 0) == (capacity_of(distributed) is not None) for r in history), history
        check_exported_params(workdir, name, ref_params)
        results[name] = history
        print(f"OK {name} matches the single-process reference (losses, weights, metrics)", flush=True)

    # Resume the ep2 checkpoint of step 2 at ep4.
    if dist.get_rank() == 0:
        copy_checkpoint(workdir / "ep2" / "checkpoints" / "step-00000002",
                        workdir / "resume_ep4" / "checkpoints" / "step-00000002")
    dist.barrier()
    history = train(job(workdir, "resume_ep4", dict(strategy="fsdp2", ep_size=4), 1), loaders(batches, 1))
    assert [r["step"] for r in history] == [3, 4], history
    check_close("resume_ep4 losses", [r["loss"] for r in history], [r["loss"] for r in results["ep2"][2:]], 2e-5)
    print("OK ep2 checkpoint resumes at ep4 with the uninterrupted losses", flush=True)

    # Export == trained model: the sharded ep2 model from its final checkpoint vs its hf/ export (per expert)
    # and a fused export of the same sharded model.
    cfg = job(workdir, "ep2", LAYOUTS["ep2"][0], 1)
    dims = ParallelDims.from_config(cfg.distributed, dist.get_world_size())
    model, hf_config = build_model(cfg, dims.build_meshes("cpu"), torch.device("cpu"))
    path = workdir / "ep2" / "checkpoints" / "step-00000004"
    restore.load(path, model, build_optimizer(model, cfg.optim), restore.sealed_state(path))
    export.export_hf(model, hf_config, workdir / "ep2_fused", experts_layout="fused")
    batch = batches[dist.get_rank()]
    with torch.no_grad():
        sharded = model(input_ids=batch["input_ids"], **packed_attention_kwargs(batch))  # no labels: logits
    from transformers import AutoModelForCausalLM

    for folder in (workdir / "ep2" / "hf", workdir / "ep2_fused"):
        hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=register_varlen_attention())
        with torch.no_grad():
            exported = hf(input_ids=batch["input_ids"], use_cache=False, **packed_attention_kwargs(batch)).logits
        check_close(f"{folder} logits", exported, sharded, 1e-5)
    print("OK per-expert and fused hf exports reload with the sharded model's logits", flush=True)


def main() -> None:
    workdir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    run(workdir, packed_batches(STEPS * GLOBAL_MICRO))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
