"""Chunked linear cross-entropy against full-logits F.cross_entropy: values, counts and gradients."""

import pytest
import torch

from headrace.kernels.loss import linear_cross_entropy, linear_cross_entropy_reference


def _inputs(tokens=45, hidden=16, vocab=101, dtype=torch.float32, ignored=(0, 1, 2, 20), seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(3, tokens // 3, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (3, tokens // 3), generator=g)
    y.view(-1)[list(ignored)] = -100
    return h, w, y


def _loss_and_grads(fn, h, w, y, scale=1.0, **kw):
    loss, count = fn(h, w, y, **kw)
    grads = torch.autograd.grad(loss * scale, (h, w))
    return loss.detach(), count, grads


@pytest.mark.parametrize("chunk_size", [1, 7, 15, 1000, None])
def test_matches_reference_fp32(chunk_size):
    h, w, y = _inputs()
    want = _loss_and_grads(linear_cross_entropy_reference, h, w, y, scale=0.37)
    got = _loss_and_grads(linear_cross_entropy, h, w, y, scale=0.37, chunk_size=chunk_size)
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-6)
    assert got[1].item() == want[1].item() == 45 - 4
    torch.testing.assert_close(got[2][0], want[2][0], atol=1e-6, rtol=1e-5)  # d hidden
    torch.testing.assert_close(got[2][1], want[2][1], atol=1e-6, rtol=1e-5)  # d weight


def test_matches_reference_bf16():
    h, w, y = _inputs(dtype=torch.bfloat16, vocab=300)
    want = _loss_and_grads(linear_cross_entropy_reference, h, w, y)
    got = _loss_and_grads(linear_cross_entropy, h, w, y, chunk_size=8)
    assert got[2][0].dtype == got[2][1].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], atol=1e-2, rtol=1e-3)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_all_ignored_gives_zero_loss_and_grads():
    h, w, y = _inputs(ignored=range(45))
    loss, count, (dh, dw) = _loss_and_grads(linear_cross_entropy, h, w, y, chunk_size=4)
    assert loss.item() == 0.0 and count.item() == 0
    assert not dh.any() and not dw.any()


def test_only_weight_or_only_hidden_needs_grad():
    h, w, y = _inputs()
    want_dw = torch.autograd.grad(linear_cross_entropy_reference(h, w, y)[0], w)[0]
    got_dw = torch.autograd.grad(linear_cross_entropy(h.detach(), w, y, chunk_size=6)[0], w)[0]
    torch.testing.assert_close(got_dw, want_dw)
    want_dh = torch.autograd.grad(linear_cross_entropy_reference(h, w, y)[0], h)[0]
    got_dh = torch.autograd.grad(linear_cross_entropy(h, w.detach(), y, chunk_size=6)[0], h)[0]
    torch.testing.assert_close(got_dh, want_dh)


def test_no_grad_forward():
    h, w, y = _inputs()
    with torch.no_grad():
        got = linear_cross_entropy(h, w, y, chunk_size=4)[0]
        want = linear_cross_entropy_reference(h, w, y)[0]
    assert not got.requires_grad
    torch.testing.assert_close(got, want)


def test_shape_errors_name_the_rule():
    h, w, y = _inputs()
    with pytest.raises(ValueError, match="disagree on the token dims"):
        linear_cross_entropy(h, w, y[:, :-1])
    with pytest.raises(ValueError, match="weight must be"):
        linear_cross_entropy(h, w[:, :-1], y)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(h, w, y, chunk_size=0)


def test_matches_reference_under_autocast():
    # The trainer runs fp32 master weights under torch.autocast(bf16): the chunked loss must compute its
    # matmuls in bf16 like lm_head would and return gradients in the parameters' dtype.
    h, w, y = _inputs(vocab=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _loss_and_grads(linear_cross_entropy_reference, h, w, y)
        got = _loss_and_grads(linear_cross_entropy, h, w, y, chunk_size=8)
    assert got[2][0].dtype == got[2][1].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], atol=1e-2, rtol=1e-3)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
