"""On CUDA, every training step after the first under ``torch.cuda.set_sync_debug_mode("error")``: a
synchronizing call raises. The CPU-side count of host reads is ``test_step_sync``; this one needs the CUDA run's
own process group (NCCL for device tensors), so it lives in a module without that file's module-scoped gloo
group."""

from __future__ import annotations

import pytest
import torch

from tests.dist.train_common import ListLoader, packed_batches
from tests.test_step_sync import job


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_steps_do_not_synchronize(tmp_path, cuda_process_group, monkeypatch):
    """On CUDA: every step after the first runs under ``set_sync_debug_mode("error")`` (a synchronizing call
    raises). The first compiles flex attention, whose compilation may synchronize once. The lm_head loss is the
    chunked kernel's: Liger's fused kernel (the optional extra) reads its label count with ``.item()`` once per
    call, a sync the README states."""
    import headrace.kernels.fused_loss as fused_loss
    import headrace.training.train as train_mod
    from headrace.training.train import train

    monkeypatch.setattr(fused_loss, "liger_loss_class", lambda: None)
    fused_loss.linear_cross_entropy_kernel.cache_clear()

    take_step = train_mod.take_step

    def strict(trainer, *args, **kwargs):
        if trainer.step == 1:
            return take_step(trainer, *args, **kwargs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return take_step(trainer, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(train_mod, "take_step", strict)
    cfg = job(tmp_path, 4, 2, device="cuda", precision="bf16")
    batches = packed_batches(6, seq_len=256, rows=2)
    history = train(cfg, lambda rank, size: ListLoader(batches, rank, size, 1))
    assert [r["step"] for r in history] == [2, 4] and all(r["loss"] > 0 for r in history)
