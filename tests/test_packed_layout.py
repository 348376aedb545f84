"""The host-made attention plan (headrace.kernels.packed_layout) against what the kernels plan from device values."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from headrace.kernels.hf_attention import packed_attention_kwargs
from headrace.kernels.packed_layout import FLEX_BLOCK, attention_plan, causal_pairs, document_block_tables
from headrace.kernels.varlen_attention import (
    _flex,
    block_mask_from_tables,
    cached_per_batch,
    document_ids,
    varlen_attention,
    varlen_attention_reference,
)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


LAYOUTS = [
    [256],  # one document, two complete blocks
    [100, 28, 128, 5, 251],  # documents across block edges, a block that is one document
    [300, 212],  # a document spanning full blocks, then a partial last block? (512 = 4 blocks)
    [3, 1, 1, 250, 1, 100],  # short documents and a 356-token tail block (partial)
]


def _dense(num, idx, n):
    """(n, n) bool block mask from ``(1, 1, n)`` counts and ``(1, 1, n, n)`` indices."""
    dense = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        dense[i, idx[0, 0, i, : num[0, 0, i]].long()] = True
    return dense


@pytest.mark.parametrize("lengths", LAYOUTS)
def test_block_tables_equal_create_block_mask(lengths):
    cu = _cu(lengths)
    total = int(cu[-1])
    doc = document_ids(cu, total)
    ref = create_block_mask(lambda b, h, q, kv: (doc[q] == doc[kv]) & (kv <= q), None, None, total, total, device="cpu")
    mine = document_block_tables(cu, total)
    n = -(-total // FLEX_BLOCK)
    assert torch.equal(
        _dense(mine["kv_num_blocks"], mine["kv_indices"], n), _dense(ref.kv_num_blocks, ref.kv_indices, n)
    )
    assert torch.equal(
        _dense(mine["full_kv_num_blocks"], mine["full_kv_indices"], n),
        _dense(ref.full_kv_num_blocks, ref.full_kv_indices, n),
    )


def test_flex_with_host_tables_matches_reference():
    """flex_attention (eager, forward: CPU has no flex backward) over the mask built from the host tables."""
    lengths = [100, 28, 128, 5, 251]
    cu = _cu(lengths)
    total = int(cu[-1])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, h, 16, generator=g) for h in (4, 2, 2))
    mask = block_mask_from_tables(document_block_tables(cu, total), total)
    out = flex_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=mask, enable_gqa=True
    )[0].transpose(0, 1)
    torch.testing.assert_close(out, varlen_attention_reference(q, k, v, cu), atol=2e-5, rtol=2e-5)


def test_host_plan_is_what_the_kernel_uses_and_it_reads_no_device_value(monkeypatch):
    """With the plan in the batch, neither packed_attention_kwargs nor the bucketed kernel reads cu_seqlens."""
    lengths = [5, 1, 17, 1, 40, 3, 61]
    cu = _cu(lengths)
    total = int(cu[-1])
    plan = attention_plan(cu, total, "cpu")
    assert plan["max_seqlen"] == 61
    batch = {
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "cu_seqlens": cu,
        "attention_plan": plan,
    }
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, h, 8, generator=g) for h in (4, 2, 2))
    reads = []
    for name in ("item", "tolist", "cpu", "__bool__", "__int__", "numpy"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _o=original, _n=name, **kw: (reads.append(_n), _o(self, *a, **kw))[1]
        )
    kwargs = packed_attention_kwargs(batch)
    out = varlen_attention(q, k, v, kwargs["cu_seq_lens_q"], kwargs["max_length_q"])
    monkeypatch.undo()
    assert reads == []
    torch.testing.assert_close(out, varlen_attention_reference(q, k, v, cu), atol=2e-5, rtol=2e-5)


def test_without_a_plan_the_kernel_still_plans_from_cu_seqlens():
    cu = _cu([3, 9])
    cached_per_batch("bucketed", torch.zeros(1), 1, lambda: None)  # an unrelated entry
    q, k, v = (torch.randn(12, 2, 8) for _ in range(3))
    torch.testing.assert_close(
        varlen_attention(q, k, v, cu), varlen_attention_reference(q, k, v, cu), atol=2e-5, rtol=2e-5
    )


def test_flex_path_uses_provided_tables(monkeypatch):
    """The flex backend's block mask comes from the host tables when provided (eager flex, forward on CPU)."""
    import headrace.kernels.varlen_attention as va

    lengths = [130, 2, 124]
    cu = _cu(lengths)
    total = int(cu[-1])
    plan = attention_plan(cu, total, "cuda")  # the CUDA plan: flex tables
    assert "flex" in plan and "bucketed" not in plan
    packed_attention_kwargs(
        {"position_ids": torch.zeros(1, total, dtype=torch.long), "cu_seqlens": cu, "attention_plan": plan}
    )
    monkeypatch.setattr(va, "_document_block_mask", lambda *a: pytest.fail("planned from device values"))
    q, k, v = (torch.randn(total, 2, 8) for _ in range(3))
    torch.testing.assert_close(
        _flex(q, k, v, cu, 8**-0.5, flex_fn=flex_attention),
        varlen_attention_reference(q, k, v, cu),
        atol=2e-5,
        rtol=2e-5,
    )


def test_malformed_cu_seqlens_fail_on_the_host():
    with pytest.raises(ValueError, match="start at 0 and end"):
        attention_plan(torch.tensor([0, 3, 5], dtype=torch.int32), 6, "cpu")


def test_causal_pairs_by_hand():
    # lengths 3, 4, 0, 3: 6 + 10 + 0 + 6 causal (query, key) pairs
    assert causal_pairs(torch.tensor([0, 3, 7, 7, 10], dtype=torch.int32)) == 22


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_flex_on_cuda_with_host_tables_matches_reference():
    """CUDA: the trainer's flex path (compiled flex_attention, block mask from the host tables copied to the
    device) gives the reference's output and gradients."""
    lengths = [700, 3, 1, 300, 1044]
    cu = _cu(lengths)
    total = int(cu[-1])
    plan = attention_plan(cu, total, "cuda")
    device_plan = {k: v.cuda() for k, v in plan["flex"].items()}
    cu_dev = cu.cuda()
    packed_attention_kwargs(
        {
            "position_ids": torch.zeros(1, total, dtype=torch.long, device="cuda"),
            "cu_seqlens": cu_dev,
            "attention_plan": {**plan, "flex": device_plan},
        }
    )
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, h, 64, generator=g).cuda().requires_grad_() for h in (8, 2, 2))
    out = varlen_attention(q, k, v, cu_dev, backend="flex")
    ref = varlen_attention_reference(q, k, v, cu_dev)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
