"""The lm_head loss kernel choice (headrace.kernels.fused_loss): Liger on CUDA when installed, the chunked path otherwise.

Liger's Triton kernels need CUDA, so on CPU the selection logic and the wrapper's plumbing (argument order,
dtypes, summed reduction, ignored labels) are checked with a stand-in module that has Liger's interface and
computes the reference loss; the gpu-marked test runs the real kernel against the reference."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

import headrace.kernels.fused_loss as fused_loss
from headrace.kernels.loss import linear_cross_entropy, linear_cross_entropy_reference


@pytest.fixture
def fresh_choice():
    fused_loss.linear_cross_entropy_kernel.cache_clear()
    yield
    fused_loss.linear_cross_entropy_kernel.cache_clear()


class StandInLigerLoss(torch.nn.Module):
    """``LigerFusedLinearCrossEntropyLoss``'s interface: ``(lin_weight, _input, target)``, full logits inside."""

    calls = 0

    def __init__(self, ignore_index=-100, reduction="mean"):
        super().__init__()
        self.ignore_index, self.reduction = ignore_index, reduction

    def forward(self, lin_weight, _input, target, bias=None):
        StandInLigerLoss.calls += 1
        assert lin_weight.dtype == _input.dtype and _input.ndim == 2 and target.ndim == 1
        return F.cross_entropy(
            (_input @ lin_weight.T).float(), target, ignore_index=self.ignore_index, reduction=self.reduction
        )


@pytest.fixture
def stand_in_liger(monkeypatch):
    module = types.ModuleType("liger_kernel.transformers.fused_linear_cross_entropy")
    module.LigerFusedLinearCrossEntropyLoss = StandInLigerLoss
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    StandInLigerLoss.calls = 0


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 12, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (2, 12), generator=g)
    labels[0, :3] = -100
    return hidden, weight, labels


def test_cpu_uses_the_chunked_path_even_with_liger_installed(fresh_choice, stand_in_liger, capsys):
    from headrace.training.models.loss import lm_head_loss_sum

    assert fused_loss.choose_kernel("cpu")[0] == "chunked"
    hidden, weight, labels = _inputs()
    head = torch.nn.Linear(16, 50, bias=False)
    head.weight = torch.nn.Parameter(weight.detach().clone())
    got = lm_head_loss_sum(head, hidden, labels)
    want, _ = linear_cross_entropy(hidden, head.weight, labels)
    torch.testing.assert_close(got, want)
    assert StandInLigerLoss.calls == 0
    assert "lm_head loss: chunked (Liger's Triton kernels run on CUDA only (device cpu))" in capsys.readouterr().out


def test_cuda_without_liger_falls_back_to_chunked(fresh_choice, monkeypatch):
    monkeypatch.setattr(fused_loss, "liger_loss_class", lambda: None)
    kernel, reason = fused_loss.choose_kernel("cuda")
    assert kernel == "chunked" and reason.startswith("liger-kernel is not installed")
    assert fused_loss.linear_cross_entropy_kernel("cuda") is None


def test_cuda_with_liger_selects_it_and_the_wrapper_gives_the_summed_loss(fresh_choice, stand_in_liger):
    assert fused_loss.choose_kernel("cuda")[0] == "liger"
    fn = fused_loss.linear_cross_entropy_kernel("cuda")
    hidden, weight, labels = _inputs()
    got = fn(hidden, weight, labels)  # CPU tensors through the CUDA choice: the wrapper's plumbing only
    want, _ = linear_cross_entropy_reference(hidden, weight, labels)
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got, (hidden, weight))
    ref_grads = torch.autograd.grad(linear_cross_entropy_reference(hidden, weight, labels)[0], (hidden, weight))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    assert StandInLigerLoss.calls == 1


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or fused_loss.liger_loss_class() is None, reason="needs CUDA and liger-kernel"
)
def test_liger_on_cuda_matches_the_reference(fresh_choice):
    fn = fused_loss.linear_cross_entropy_kernel("cuda")
    assert fn is not None
    hidden, weight, labels = (t.cuda() for t in _inputs())
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    got = fn(hidden, weight, labels)
    want, _ = linear_cross_entropy_reference(hidden, weight, labels)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
