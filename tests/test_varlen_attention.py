"""Varlen (document-masked) attention: every backend against the per-document reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headrace.kernels.varlen_attention import (
    bucket_length,
    cu_seqlens_from_position_ids,
    document_causal_mask,
    validate_cu_seqlens,
    varlen_attention,
    varlen_attention_reference,
)

CPU_BACKENDS = ["bucketed", "dense_mask"]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _qkv(total, heads, kv_heads, dim, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(total, h, dim, generator=g, dtype=torch.float32).to(device, dtype).requires_grad_()
    return make(heads), make(kv_heads), make(kv_heads)


def _check_against_reference(lengths, heads, kv_heads, dim, backend, atol=2e-5, dtype=torch.float32, device="cpu"):
    cu = _cu(lengths).to(device)
    q, k, v = _qkv(int(cu[-1]), heads, kv_heads, dim, dtype, device)
    grad_out = torch.randn(q.shape[0], heads, dim, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    ref = varlen_attention_reference(q, k, v, cu)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    out = varlen_attention(q, k, v, cu, max(lengths), backend=backend)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    torch.testing.assert_close(out, ref, atol=atol, rtol=atol)
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got, want, atol=atol, rtol=atol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "lengths, heads, kv_heads",
    [
        ([7], 4, 4),  # one document = plain causal attention
        ([1, 1, 1], 4, 2),  # only length-1 documents
        ([5, 1, 17, 1, 40, 3], 4, 2),  # mixed, GQA 2:1
        ([33, 31, 64, 2], 8, 1),  # multi-query, lengths across bucket edges
        ([16, 16, 16], 2, 2),  # equal lengths share one bucket
    ],
)
def test_backend_matches_reference(lengths, heads, kv_heads, backend):
    _check_against_reference(lengths, heads, kv_heads, 8, backend)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=8), kv_heads=st.sampled_from([1, 2, 4]))
def test_bucketed_matches_reference_random_layouts(lengths, kv_heads):
    _check_against_reference(lengths, 4, kv_heads, 4, "bucketed")


def test_empty_segments_are_ignored():
    # Zero-length documents (cu_seqlens repeating a value) contribute nothing and break nothing.
    cu = torch.tensor([0, 3, 3, 9, 9], dtype=torch.int32)
    q, k, v = _qkv(9, 2, 2, 4)
    torch.testing.assert_close(varlen_attention(q, k, v, cu), varlen_attention_reference(q, k, v, cu))


def test_attention_never_crosses_documents():
    # Changing one document's keys/values must leave every other document's output untouched.
    cu = _cu([6, 9, 5])
    q, k, v = _qkv(20, 2, 1, 4)
    out = varlen_attention(q, k, v, cu).detach()
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[6:15] += 3.0
    v2[6:15] -= 5.0
    out2 = varlen_attention(q.detach(), k2, v2, cu)
    torch.testing.assert_close(out2[:6], out[:6])
    torch.testing.assert_close(out2[15:], out[15:])
    assert not torch.allclose(out2[6:15], out[6:15])


def test_document_mask_is_block_diagonal_causal():
    mask = document_causal_mask(_cu([2, 3]), 5)
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(mask, expected)


def test_cu_seqlens_from_position_ids_restarts_per_document_and_row():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [4, 5, 0, 1, 2, 3]])  # row 2 starts mid-document (a split piece)
    assert cu_seqlens_from_position_ids(pos).tolist() == [0, 3, 5, 6, 8, 12]


@pytest.mark.parametrize(
    "cu, total, rule",
    [
        ([0, 3, 5], 6, "end at the number of tokens"),
        ([1, 3, 6], 6, "start at 0"),
        ([0, 4, 3, 6], 6, "non-decreasing"),
        ([0], 6, "at least 2 entries"),
    ],
)
def test_bad_cu_seqlens_name_the_rule(cu, total, rule):
    with pytest.raises(ValueError, match=rule):
        validate_cu_seqlens(torch.tensor(cu, dtype=torch.int32), total)


def test_gqa_head_mismatch_raises():
    q, k, v = _qkv(4, 3, 2, 4)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        varlen_attention(q, k, v, _cu([4]))


def test_bucket_length_bounds_padding():
    for n in range(1, 5000):
        b = bucket_length(n)
        assert n <= b and b % 16 == 0 and b - n < max(16, n / 8)


def test_gpu_backends_refuse_cpu_tensors():
    q, k, v = _qkv(4, 2, 2, 4)
    for backend in ("flash", "flex"):
        with pytest.raises(RuntimeError, match="CUDA|GPU"):
            varlen_attention(q, k, v, _cu([4]), backend=backend)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)])
def test_flex_matches_reference_on_gpu(dtype, atol):
    _check_against_reference([5, 1, 130, 1, 200, 47], 4, 2, 64, "flex", atol=atol, dtype=dtype, device="cuda")


@pytest.mark.gpu
@cuda
def test_flash_matches_reference_on_gpu():
    pytest.importorskip("flash_attn")
    _check_against_reference([5, 1, 130, 1, 200, 47], 4, 2, 64, "flash", atol=3e-2, dtype=torch.bfloat16, device="cuda")


@pytest.mark.gpu
@cuda
def test_bucketed_runs_on_gpu():
    _check_against_reference([5, 1, 130, 1, 200, 47], 4, 2, 64, "bucketed", atol=2e-4, device="cuda")


def test_bf16_bucketed_close_to_reference():
    _check_against_reference([5, 1, 40, 18], 4, 2, 16, "bucketed", atol=3e-2, dtype=torch.bfloat16)


def test_plan_cache_follows_the_cu_seqlens_tensor():
    # The plan is reused for the same tensor object (all layers of a step) and never for another
    # layout, nor after an in-place edit of the same tensor.
    q, k, v = _qkv(12, 2, 2, 4)
    q, k, v = q.detach(), k.detach(), v.detach()
    first, second = _cu([5, 7]), _cu([2, 2, 8])
    for cu in (first, second, first):
        torch.testing.assert_close(varlen_attention(q, k, v, cu), varlen_attention_reference(q, k, v, cu))
    first[1] = 9
    torch.testing.assert_close(varlen_attention(q, k, v, first), varlen_attention_reference(q, k, v, first))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_and_layout_forward_on_cpu():
    # The GPU flex path's document block mask and THD <-> BHSD layout, run with eager flex_attention
    # (forward only: flex has no backward on CPU). Lengths cross flex's 128-token blocks.
    from torch.nn.attention.flex_attention import flex_attention

    from headrace.kernels.varlen_attention import _flex

    cu = _cu([5, 1, 130, 1, 60])
    q, k, v = (x.detach() for x in _qkv(197, 4, 2, 16))
    with torch.no_grad():
        out = _flex(q, k, v, cu, 16**-0.5, flex_fn=flex_attention)
    torch.testing.assert_close(out, varlen_attention_reference(q, k, v, cu), atol=2e-5, rtol=2e-5)
