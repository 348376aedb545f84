"""torchrun script: every parallel layout trains like one process; checkpoints resume and reshard.

``torchrun --nproc-per-node 4 -m tests.dist.train_layouts WORKDIR layouts`` (WORKDIR holds ``pretrained/``):
first, one micro-batch per rank through the FSDP2 model's chunked loss gives the full-logits loss and
gradients (fp32, and bf16 MixedPrecisionPolicy within bf16 rounding). Then FSDP2, HSDP(+activation
checkpointing), DDP, TP+SP, FSDP2+TP+SP and FSDP2 with CPU offload each train STEPS steps on the same global batches from the
same weights; losses, gradient norms and final weights (read back from the ``hf/`` export) must match an
independent single-process reference computed on every rank; FSDP2 in bf16 must stay within bf16
rounding of its losses. Then a run stopped at step 2 and resumed must reproduce the uninterrupted
losses, also when resumed as HSDP and as dp=2 x tp=2, and the exported model's logits must equal the
checkpointed sharded model's.

``torchrun --nproc-per-node 2 -m tests.dist.train_layouts WORKDIR reshard``: the 4-rank FSDP2 checkpoint
at step 2 loads into 2 ranks (FSDP2 dp=2, then TP=2) and continues with the uninterrupted losses; float8
linears under FSDP2 train like one process converting the same weights with torchao; then
one step with every block compiled (``distributed.compile``) gives the eager loss.
Prints ``OK <check>`` per passed check; any mismatch raises.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.dist.train_common import ListLoader, copy_checkpoint, full_logits_loss_sum, packed_batches

from headrace.training.checkpoint import layout, restore  # noqa: E402
from headrace.training.config.load import load_job_config  # noqa: E402
from headrace.training.components.optim import build_optimizer, lr_at, set_lr  # noqa: E402
from headrace.training.distributed.parallel_dims import ParallelDims  # noqa: E402
from headrace.training.model_kinds import build_model  # noqa: E402
from headrace.training.train import train  # noqa: E402
from headrace.training.step import forward_loss_sum  # noqa: E402

STEPS, GLOBAL_MICRO = 4, 4  # 4 micro-batches of 2 x 32 tokens per step
OPTIM = dict(lr=3e-3, warmup_steps=1, decay_steps=4, max_grad_norm=1.0, weight_decay=0.1)


def job(workdir: Path, name: str, distributed: dict, grad_accum: int, max_steps: int = STEPS, quantize=None,
        **trainer):
    return load_job_config(None, base=dict(
        model=dict(pretrained_path=str(workdir / "pretrained"), attn_implementation="headrace_varlen"),
        data=dict(datasets=[dict(path="unused")], seq_len=32, batch_size=2, packing="greedy"),
        distributed=distributed, optim=OPTIM, quantize=quantize or {},
        trainer=dict(max_steps=max_steps, grad_accum=grad_accum, output_dir=str(workdir / name), **trainer),
        checkpoint=dict(interval=2, export_hf=True), logging=dict(console=False, tensorboard=False)))


def loaders(batches, grad_accum):
    return lambda dp_rank, dp_size: ListLoader(batches, dp_rank, dp_size, grad_accum)


def pretrained_hf_model(workdir: Path):
    """The starting weights as a plain transformers model with document-masked attention (the reference)."""
    from transformers import AutoModelForCausalLM

    from headrace.kernels.hf_attention import register_varlen_attention

    return AutoModelForCausalLM.from_pretrained(workdir / "pretrained", attn_implementation=register_varlen_attention())


def reference(workdir: Path, batches, convert=None) -> tuple[list[float], list[float], dict]:
    """Plain single-process training: HF model (``convert(model)`` first, if given), summed CE / tokens, torch's
    clip, AdamW, same schedule."""
    from headrace.training.config.job_config import OptimConfig

    model = pretrained_hf_model(workdir)
    if convert is not None:
        convert(model)
    cfg = OptimConfig(**OPTIM)
    opt = build_optimizer(model, cfg)
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        micro = batches[(step - 1) * GLOBAL_MICRO: step * GLOBAL_MICRO]
        tokens = sum(int((mb["labels"] != -100).sum()) for mb in micro)
        total = sum(full_logits_loss_sum(model, mb) for mb in micro) / tokens
        total.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)))
        set_lr(opt, lr_at(step, cfg, STEPS))
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def exported_params(out_dir: Path) -> dict:
    """Every tensor of the sharded ``hf/`` export, read through its index (each file exactly once)."""
    from safetensors.torch import load_file

    index = json.loads((out_dir / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    params = {}
    for name in sorted(set(index.values())):
        params |= load_file(out_dir / "hf" / name)
    assert params.keys() == index.keys(), sorted(params.keys() ^ index.keys())
    return params


def check_exported_params(workdir: Path, name: str, ref_params: dict) -> None:
    """Rank 0: run ``name``'s ``hf/`` export holds the reference's keys and weights (within 5e-5)."""
    if dist.get_rank() != 0:
        return
    params = exported_params(workdir / name)
    assert params.keys() == ref_params.keys(), sorted(params.keys() ^ ref_params.keys())
    for key, value in params.items():
        check_close(f"{name} param {key}", value, ref_params[key], 5e-5)


def check_close(name: str, got, want, tol: float) -> None:
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    diff = (got - want).abs().max().item()
    if not diff <= tol:
        raise AssertionError(f"{name}: max diff {diff:.3g} > {tol:g}\n got {got.tolist()}\nwant {want.tolist()}"
                             if got.numel() < 10 else f"{name}: max diff {diff:.3g} > {tol:g}")


def check_matches_reference(workdir: Path, name: str, history: list[dict], want: tuple) -> None:
    """The run ``name``'s losses and gradient norms, and the weights of its ``hf/`` export, equal ``want``
    (the output of ``reference``)."""
    ref_losses, ref_norms, ref_params = want
    check_close(f"{name} losses", [r["loss"] for r in history], ref_losses, 2e-5)
    check_close(f"{name} grad norms", [r["grad_norm"] for r in history], ref_norms, 1e-4)
    check_exported_params(workdir, name, ref_params)


def check_first_gradients(workdir: Path, batches) -> None:
    """One micro-batch per rank through the trainer's FSDP2 ``CausalLMLoss`` (chunked loss, 13-token chunks)
    must give the loss and gradients of HF's full logits on all four micro-batches in one process.
    fp32: float tolerance. bf16 (MixedPrecisionPolicy: bf16 compute, fp32 sharded params and reduction):
    activations must really be bf16, gradients fp32, and both within bf16 rounding of the reference."""
    world = dist.get_world_size()
    reference_model = pretrained_hf_model(workdir)
    want = sum(full_logits_loss_sum(reference_model, mb) for mb in batches[:world])
    want.backward()
    want_grads = dict(reference_model.named_parameters())
    for precision in ("fp32", "bf16"):
        cfg = job(workdir, f"grads_{precision}", dict(strategy="fsdp2"), 1, precision=precision)
        dims = ParallelDims.from_config(cfg.distributed, world)
        model, _ = build_model(cfg, dims.build_meshes("cpu"), torch.device("cpu"))
        model.chunk_size = 13
        dtypes = []
        model.model.norm.register_forward_hook(lambda mod, args, out: dtypes.append(out.dtype))
        loss = forward_loss_sum(model, batches[dist.get_rank()], autocast=False)
        (loss * world).backward()  # FSDP2 averages gradients over ranks: make that a sum
        dist.all_reduce(loss := loss.detach())
        compute_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        assert dtypes == [compute_dtype], dtypes
        if precision == "fp32":
            check_close("fsdp2 chunked loss", loss, want.detach(), 1e-6 * float(want))
        else:
            # bf16 keeps 8 significant bits (unit roundoff u = 2^-9 ~ 2e-3). The loss sums ~500 token losses
            # whose rounding errors are independent, so its relative error is far below u: require < u/2
            # (measured 2e-6). A gradient goes back through every layer's bf16 matmuls; measured <= 1.0e-2
            # relative (L2, per parameter): require < 3e-2. A wrong cast, a bf16 reduction of the wrong
            # scale or a missed all-reduce gives errors of order 1, far outside both.
            check_close("fsdp2 bf16 loss", loss / want.detach(), 1.0, 1e-3)
        worst = 0.0
        for name, param in model.named_parameters():
            grad = param.grad.full_tensor()
            assert param.dtype == grad.dtype == torch.float32, (name, param.dtype, grad.dtype)
            ref_grad = want_grads[name].grad
            if precision == "fp32":
                check_close(f"fsdp2 grad {name}", grad, ref_grad, 1e-5 + 1e-5 * ref_grad.abs().max().item())
            else:
                relative = ((grad - ref_grad).norm() / ref_grad.norm()).item()
                assert relative < 3e-2, f"bf16 grad {name}: relative error {relative:.3g}"
                worst = max(worst, relative)
    print(f"OK chunked loss under fsdp2 gives the full-logits loss and gradients (fp32; bf16: loss "
          f"{abs(float(loss / want) - 1):.2e} relative, gradients <= {worst:.2e})", flush=True)


def run_layouts(workdir: Path, batches) -> None:
    check_first_gradients(workdir, batches)
    ref_losses, ref_norms, ref_params = reference(workdir, batches)
    layouts = {
        "fsdp2": (dict(strategy="fsdp2"), 1),
        "hsdp_ac": (dict(strategy="fsdp2", dp_replicate_size=2, activation_checkpointing=True,
                         activation_checkpointing_every=2), 1),
        "ddp": (dict(strategy="ddp"), 1),
        "tp_sp": (dict(strategy="fsdp2", tp_size=4, sequence_parallel=True), 4),
        "fsdp2_tp_sp": (dict(strategy="fsdp2", tp_size=2, sequence_parallel=True), 2),
        "fsdp2_offload": (dict(strategy="fsdp2", offload_policy="cpu"), 1),  # FSDP2's CPUOffloadPolicy
    }
    results = {}
    for name, (distributed, k) in layouts.items():
        history = train(job(workdir, name, distributed, k), loaders(batches, k))
        check_matches_reference(workdir, name, history, (ref_losses, ref_norms, ref_params))
        results[name] = history
        print(f"OK {name} matches the single-process reference", flush=True)

    # bf16 FSDP2 (bf16 compute, fp32 master weights and reduction) over the same steps: each loss stays
    # within half a bf16 unit roundoff (1e-3 relative) of the fp32 reference, as in check_first_gradients;
    # measured ~5e-5 after 4 AdamW steps.
    history = train(job(workdir, "fsdp2_bf16", dict(strategy="fsdp2"), 1, precision="bf16"), loaders(batches, 1))
    relative = [r["loss"] / want - 1 for r, want in zip(history, ref_losses)]
    check_close("fsdp2_bf16 relative losses", relative, [0.0] * len(relative), 1e-3)
    print(f"OK fsdp2_bf16 losses within {max(map(abs, relative)):.2e} of the fp32 reference", flush=True)

    # Resume: stop at step 2 (the run's final checkpoint), start again with max_steps=4.
    resumed = workdir / "resumed"
    train(job(workdir, "resumed", dict(strategy="fsdp2"), 1, max_steps=2), loaders(batches, 1))
    history = train(job(workdir, "resumed", dict(strategy="fsdp2"), 1), loaders(batches, 1))
    assert [r["step"] for r in history] == [3, 4], history
    check_close("resumed losses", [r["loss"] for r in history], [r["loss"] for r in results["fsdp2"][2:]], 1e-6)
    assert layout.latest(resumed / "checkpoints").name == "step-00000004"
    print("OK resume reproduces the uninterrupted losses", flush=True)

    # Resume across layouts on the same 4 ranks: the FSDP2 dp=4 run's step-2 checkpoint continues as HSDP
    # (2 replicas x 2 shards) and as dp=2 x tp=2 (+SP) with the uninterrupted losses.
    expected = [r["loss"] for r in results["fsdp2"]]
    for name, layout_name in (("hsdp", "hsdp_ac"), ("dp2_tp2", "fsdp2_tp_sp")):
        resume_step2(workdir, "fsdp2", f"from_fsdp2_{name}", *layouts[layout_name], batches, expected)
        print(f"OK fsdp2 dp=4 checkpoint resumes as {name}", flush=True)

    # Export == trained model: reload the final checkpoint into a sharded model and compare logits.
    cfg = job(workdir, "fsdp2", dict(strategy="fsdp2"), 1)
    dims = ParallelDims.from_config(cfg.distributed, dist.get_world_size())
    model, _ = build_model(cfg, dims.build_meshes("cpu"), torch.device("cpu"))
    path = workdir / "fsdp2" / "checkpoints" / "step-00000004"
    restore.load(path, model, build_optimizer(model, cfg.optim), restore.sealed_state(path))
    batch = batches[0]
    with torch.no_grad():
        sharded = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])  # no labels: logits
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(workdir / "fsdp2" / "hf")
        with torch.no_grad():
            exported = hf(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        check_close("exported logits", exported, sharded, 1e-5)
    print("OK hf export logits equal the trained model's", flush=True)
    if dist.get_rank() == 0:
        (workdir / "expected.json").write_text(json.dumps([r["loss"] for r in results["fsdp2"]]))


def resume_step2(workdir: Path, source: str, name: str, distributed: dict, grad_accum: int, batches,
                 expected: list[float]) -> None:
    """Copy run ``source``'s step-2 checkpoint into run ``name``, train it (other layout) to STEPS: steps 3..
    must give ``expected``'s losses."""
    if dist.get_rank() == 0:
        copy_checkpoint(workdir / source / "checkpoints" / "step-00000002",
                        workdir / name / "checkpoints" / "step-00000002")
    dist.barrier()
    history = train(job(workdir, name, distributed, grad_accum), loaders(batches, grad_accum))
    assert [r["step"] for r in history] == [3, 4], history
    check_close(f"{name} losses", [r["loss"] for r in history], expected[2:], 2e-5)


def run_reshard(workdir: Path, batches) -> None:
    expected = json.loads((workdir / "expected.json").read_text())
    for name, distributed, k in (("reshard_dp2", dict(strategy="fsdp2"), 2),
                                 ("reshard_tp2", dict(strategy="fsdp2", tp_size=2, sequence_parallel=True), 4)):
        resume_step2(workdir, "fsdp2", name, distributed, k, batches, expected)
        print(f"OK 4-rank checkpoint resumes on 2 ranks as {name}", flush=True)

    check_float8_fsdp2(workdir, batches)

    # distributed.compile: each block torch.compile'd under FSDP2, one step from the pretrained weights. The
    # aot_eager backend traces forward and backward like inductor (dynamo graphs through the HF block and
    # FSDP2's hooks, AOT autograd) without code generation, which takes ~75 s cold on 2 CPU cores.
    cfg = job(workdir, "compiled", dict(strategy="fsdp2", compile=True, compile_backend="aot_eager"), 2,
              max_steps=1)
    history = train(cfg, loaders(batches, 2))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    check_close("compiled loss", history[0]["loss"], expected[0], 2e-5)
    print("OK per-block compile under fsdp2 gives the eager loss", flush=True)


def check_float8_fsdp2(workdir: Path, batches) -> None:
    """float8 linears (tensorwise, FSDP2 all-gathering float8 weights with scales precomputed after each
    optimizer step) on 2 ranks train like one process converting the same weights with torchao. Measured
    3.7e-5 relative: only the order of the fp32 gradient reduction differs, but float8 rounding turns such a
    difference into whole float8 steps of a few elements; the bound is 5e-4. A wrong scale (per shard instead
    of per tensor) or a missed all-reduce moves the loss by percents."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    float8 = dict(recipe_name="tensorwise", enable_fsdp_float8_all_gather=True,
                  precompute_float8_dynamic_scale_for_fsdp=True, emulate=True)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True)
    want, _, _ = reference(workdir, batches, lambda model: convert_to_float8_training(
        model, config=config, module_filter_fn=lambda module, name: name != "lm_head"))
    history = train(job(workdir, "float8_dp2", dict(strategy="fsdp2"), 2, quantize=dict(linear=dict(float8=float8))),
                    loaders(batches, 2))
    relative = [r["loss"] / w - 1 for r, w in zip(history, want)]
    check_close("float8 fsdp2 relative losses", relative, [0.0] * len(relative), 5e-4)
    print(f"OK float8 under fsdp2 (float8 all-gather) matches one process within {max(map(abs, relative)):.1e}",
          flush=True)


def main() -> None:
    workdir, mode = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    batches = packed_batches(STEPS * GLOBAL_MICRO)
    {"layouts": run_layouts, "reshard": run_reshard}[mode](workdir, batches)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
