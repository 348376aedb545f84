"""The training step (``headrace.training.step``): the packed-batch loss equals the documents run one by one,
the chunked lm_head loss equals the full-logits loss and its gradients, gradient accumulation equals one big
batch, and bf16 keeps the attention inputs bf16."""

from __future__ import annotations

import pytest
import torch

from headrace.training.config.load import load_job_config
from tests.dist.train_common import TINY_LLAMA, full_logits_loss_sum, packed_batches, save_pretrained_tiny
from tests.test_train import base_job


def test_packed_loss_equals_documents_run_one_by_one(tmp_path):
    """headrace_varlen keeps attention (and RoPE positions) inside each document of a packed row."""
    from transformers import AutoModelForCausalLM

    from headrace.kernels.hf_attention import register_varlen_attention
    from headrace.training.models.loss import CausalLMLoss
    from headrace.training.step import forward_loss_sum

    save_pretrained_tiny(tmp_path / "m")
    packed = CausalLMLoss(
        AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation=register_varlen_attention())
    )
    alone = AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="sdpa")
    batch = packed_batches(1, seq_len=64, rows=2)[0]
    with torch.no_grad():
        got = forward_loss_sum(packed, batch, autocast=False)
        want, cu = torch.zeros((), dtype=torch.float64), batch["cu_seqlens"].tolist()
        ids, labels = batch["input_ids"].view(1, -1), batch["labels"].view(-1)
        for a, b in zip(cu[:-1], cu[1:]):
            logits = alone(input_ids=ids[:, a:b]).logits[0]
            want += torch.nn.functional.cross_entropy(logits, labels[a:b], ignore_index=-100, reduction="sum")
    assert len(cu) > 3  # several documents per row
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_chunked_loss_gives_the_full_logits_loss_and_gradients(tmp_path):
    """CausalLMLoss (lm_head + cross-entropy in chunks of 13 tokens, never the full logits) == HF's forward to
    full logits + F.cross_entropy: loss and every parameter's gradient; parameter names are HF's own."""
    from transformers import AutoModelForCausalLM

    from headrace.kernels.hf_attention import packed_attention_kwargs, register_varlen_attention
    from headrace.training.models.loss import CausalLMLoss, unwrap_causal_lm
    from headrace.training.step import forward_loss_sum

    save_pretrained_tiny(tmp_path / "m")
    load = lambda: AutoModelForCausalLM.from_pretrained(
        tmp_path / "m",  # noqa: E731
        attn_implementation=register_varlen_attention(),
    )
    reference, hf = load(), load()
    model = CausalLMLoss(hf, chunk_size=13)
    assert unwrap_causal_lm(model) is hf and model.model is hf.model
    assert list(model.state_dict()) == list(reference.state_dict())
    batch = packed_batches(1, seq_len=64, rows=2)[0]
    got = forward_loss_sum(model, batch, autocast=False)
    got.backward()
    want = full_logits_loss_sum(reference, batch)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-5, msg=name)
    with torch.no_grad():  # labels=None: the logits, as HF's forward gives them
        logits = model(input_ids=batch["input_ids"], **packed_attention_kwargs(batch))
        torch.testing.assert_close(
            logits, reference(input_ids=batch["input_ids"], **packed_attention_kwargs(batch)).logits
        )


def concat(batches: list[dict]) -> dict:
    """k micro-batches as one batch of k times the rows (cu_seqlens offset into the flattened whole)."""
    cu, offset = [batches[0]["cu_seqlens"][:1]], 0
    for b in batches:
        cu.append(b["cu_seqlens"][1:] + offset)
        offset += b["input_ids"].numel()
    out = {k: torch.cat([b[k] for b in batches]) for k in ("input_ids", "labels", "position_ids")}
    return out | {"cu_seqlens": torch.cat(cu), "max_seqlen": max(b["max_seqlen"] for b in batches)}


def test_grad_accumulation_equals_one_big_batch(tmp_path, process_group):
    from headrace.training.config.job_config import DistributedConfig
    from headrace.training.components.optim import build_optimizer
    from headrace.training.distributed.parallel_dims import ParallelDims
    from headrace.training.model_kinds import build_model
    from headrace.training.step import train_step

    save_pretrained_tiny(tmp_path / "m")
    cfg = load_job_config(None, base=base_job(tmp_path, model=dict(config=None, pretrained_path=str(tmp_path / "m"))))
    dims = ParallelDims.from_config(DistributedConfig(), 1)
    dims.build_meshes("cpu")
    micro = packed_batches(8)
    results = []
    for batches in ([micro[:4], micro[4:]], [[concat(micro[:4])], [concat(micro[4:])]]):
        model, _ = build_model(cfg, dims, torch.device("cpu"))
        opt = build_optimizer(model, cfg.optim)
        losses = [
            float(
                train_step(
                    model, opt, step, dims.get_mesh("dp_cp"), max_grad_norm=1.0, defer_grad_sync=True, autocast=False
                )["loss"]
            )
            for step in batches
        ]
        results.append((losses, torch.cat([p.detach().flatten() for p in model.parameters()])))
    (acc_losses, acc_params), (big_losses, big_params) = results
    assert acc_losses == pytest.approx(big_losses, rel=1e-6)
    torch.testing.assert_close(acc_params, big_params, rtol=1e-5, atol=1e-6)


def test_bf16_on_one_rank_keeps_attention_inputs_bf16(tmp_path, process_group, monkeypatch):
    """precision=bf16 with nothing to shard still goes through FSDP2's MixedPrecisionPolicy: under autocast
    HF's RoPE would hand the attention kernel fp32 q/k beside a bf16 v."""
    import headrace.kernels.hf_attention as hf_attention
    from torch.distributed.fsdp import FSDPModule

    from headrace.training.config.job_config import DistributedConfig
    from headrace.training.distributed.parallel_dims import ParallelDims
    from headrace.training.model_kinds import build_model
    from headrace.training.step import forward_loss_sum

    cfg = load_job_config(None, base=base_job(tmp_path, trainer=dict(precision="bf16")))
    dims = ParallelDims.from_config(DistributedConfig(), 1)
    model, _ = build_model(cfg, dims.build_meshes("cpu"), torch.device("cpu"))
    assert isinstance(model, FSDPModule)
    seen, attention = [], hf_attention.varlen_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return attention(q, k, v, *args, **kwargs)

    monkeypatch.setattr(hf_attention, "varlen_attention", spy)
    forward_loss_sum(model, packed_batches(1)[0], autocast=False).backward()
    assert seen == [(torch.bfloat16,) * 3] * TINY_LLAMA["num_hidden_layers"]
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
