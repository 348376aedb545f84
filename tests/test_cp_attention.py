"""Context parallelism: LSE attention blocks, the head-tail block rule (ranks simulated in one process),
the trainer's config rules and host-side split, and the real gloo launch (tests/dist/cp_checks.py)."""

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headrace.dataio.feed.cp_split import cp_shard
from headrace.dataio.feed.prefetch import DevicePrefetcher
from headrace.kernels.attention_lse import block_backward, block_forward, merge_into
from headrace.kernels.cp_attention import _attend, _grad_blocks, blocks, half_layout
from headrace.kernels.varlen_attention import varlen_attention_reference
from headrace.training.config.load import load_job_config
from headrace.training.distributed.context_parallel import cp_batch_transform
from headrace.training.distributed.parallel_dims import ParallelDims

from tests.dist.train_common import packed_batches, save_pretrained_tiny
from tests.helpers import torchrun


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)


def _random(shape, seed, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lengths, heads, kv_heads", [([5, 17, 1, 33, 8], 4, 2), ([16, 16], 2, 2), ([3], 8, 1)])
def test_block_matches_reference(lengths, heads, kv_heads, causal):
    """One block (out, lse, and the backward given them) against an explicit fp64 per-document softmax."""
    cu, total, dim = _cu(lengths), sum(lengths), 8
    q, k, v = (
        _random((total, h, dim), s, torch.float64).requires_grad_() for s, h in enumerate((heads, kv_heads, kv_heads))
    )
    outs, lses = [], []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qd, kd, vd = (x[s:e].transpose(0, 1).repeat_interleave(heads // x.shape[1], 0) for x in (q, k, v))
        scores = qd @ kd.transpose(1, 2) * dim**-0.5
        if causal:
            scores = scores.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(1), float("-inf"))
        outs.append((scores.softmax(-1) @ vd).transpose(0, 1))
        lses.append(scores.logsumexp(-1).transpose(0, 1))
    ref = torch.cat(outs)
    dout = _random(ref.shape, 9, torch.float64)
    ref.backward(dout)
    q32, k32, v32 = (x.detach().float() for x in (q, k, v))
    out, lse = block_forward(q32, k32, v32, cu, max(lengths), causal=causal, scale=dim**-0.5)
    torch.testing.assert_close(out, ref.float(), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse, torch.cat(lses).float(), atol=2e-6, rtol=1e-5)
    grads = block_backward(dout.float(), q32, k32, v32, out, lse, cu, max(lengths), causal=causal, scale=dim**-0.5)
    for name, got, want in zip("qkv", grads, (q, k, v)):
        torch.testing.assert_close(got, want.grad.float(), atol=5e-6, rtol=1e-5, msg=lambda m: f"d{name}: {m}")


def test_merge_weights_blocks_by_their_lse():
    """Two blocks over the same keys: the softmax over [k, k] equals the one over k, with lse + log 2; a block
    whose lse is far lower leaves the other's output unchanged."""
    cu = _cu([6, 11, 2])
    q, k, v = (_random((19, 2, 8), s) for s in range(3))
    out, lse = block_forward(q, k, v, cu, 11, causal=False, scale=0.3)
    merged, merged_lse = merge_into(merge_into(None, out, lse), out, lse)
    torch.testing.assert_close(merged, out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(merged_lse, lse + torch.log(torch.tensor(2.0)), atol=1e-6, rtol=1e-6)
    merged, _ = merge_into(merge_into(None, out, lse), torch.full_like(out, 1e3), lse - 60)
    torch.testing.assert_close(merged, out, atol=1e-20 * 1e3 + 1e-6, rtol=1e-6)


def test_blocks_cover_each_key_chunk_once():
    """Over all sources, rank r's query chunk a meets every key chunk b <= a exactly once (b == a causally)."""
    for size in range(1, 6):
        for rank in range(size):
            seen = []
            for src in range(size):
                for qa, kb, causal in blocks(rank, src):
                    q_chunk = (rank, 2 * size - 1 - rank)[qa]
                    k_chunk = (src, 2 * size - 1 - src)[kb]
                    assert causal == (q_chunk == k_chunk) and k_chunk <= q_chunk
                    seen.append((q_chunk, k_chunk))
            want = [(a, b) for a in (rank, 2 * size - 1 - rank) for b in range(a + 1)]
            assert sorted(seen) == sorted(want)


def simulate_cp(q, k, v, cu, size, dout):
    """All ``size`` CP ranks in one process (no communication): per rank, its blocks against every source's
    K/V, merged; backward with every rank's dK/dV contributions summed at their owner. Returns outputs
    and gradients on the padded full layout, plus that layout."""
    dummy = {f: torch.zeros(1, int(cu[-1]), dtype=torch.long) for f in ("input_ids", "labels", "position_ids")}
    shards = [cp_shard(dict(dummy, cu_seqlens=cu), size, r) for r in range(size)]
    padded_cu, n = shards[0]["cu_seqlens_padded"], int(shards[0]["cu_seqlens_padded"][-1])
    layout = half_layout(shards[0]["cu_seqlens"], shards[0]["input_ids"].shape[1])
    local = [[x[s["padded_index"]] for x in (q, k, v)] for s in shards]
    out = torch.empty(n, q.shape[1], v.shape[2])
    dq, dk, dv = (torch.zeros_like(x) for x in (q, k, v))
    for r, s in enumerate(shards):
        q_halves = [local[r][0].index_select(0, h) for h in layout.halves]
        acc = [None, None]
        for src in range(size):
            _attend(q_halves, local[src][1], local[src][2], layout, r, src, acc, q.shape[-1] ** -0.5)
        out_halves, lse_halves = [a[0] for a in acc], [a[1] for a in acc]
        out[s["padded_index"]] = torch.cat(out_halves)[layout.inverse]
        do = dout[s["padded_index"]]
        saved = (q_halves, out_halves, lse_halves, [do.index_select(0, h) for h in layout.halves], q.shape[-1] ** -0.5)
        dq_halves = [torch.zeros_like(h) for h in q_halves]
        for src in range(size):
            dkv = [torch.zeros_like(local[src][1]), torch.zeros_like(local[src][2])]
            _grad_blocks(saved, local[src][1], local[src][2], layout, r, src, dq_halves, dkv)
            dk[shards[src]["padded_index"]] += dkv[0]
            dv[shards[src]["padded_index"]] += dkv[1]
        dq[s["padded_index"]] = torch.cat(dq_halves)[layout.inverse]
    return out, (dq, dk, dv), padded_cu


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=6).filter(lambda ls: sum(ls) > 0),
    size=st.integers(1, 4),
    kv_heads=st.sampled_from([1, 2, 4]),
)
def test_simulated_cp_matches_reference_random_layouts(lengths, size, kv_heads):
    """Forward and backward of the head-tail CP decomposition = per-document attention on the unsplit row."""
    cu = _cu(lengths)
    padded = sum(-(-n // (2 * size)) * 2 * size for n in lengths)
    q, k, v = (_random((padded, h, 8), s) for s, h in enumerate((4, kv_heads, kv_heads)))
    dout = _random((padded, 4, 8), 7)
    out, grads, padded_cu = simulate_cp(q, k, v, cu, size, dout)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = varlen_attention_reference(*full, padded_cu)
    ref.backward(dout)
    torch.testing.assert_close(out, ref.detach(), atol=2e-6, rtol=1e-5)
    for name, got, want in zip("qkv", grads, full):
        torch.testing.assert_close(got, want.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"d{name}: {m}")


def test_half_layout_rejects_odd_segments():
    layout = half_layout(_cu([4, 2, 0, 6]), 12)
    assert layout.halves[0].tolist() == [0, 1, 4, 6, 7, 8] and layout.halves[1].tolist() == [2, 3, 5, 9, 10, 11]
    assert torch.equal(torch.cat(layout.halves)[layout.inverse], torch.arange(12))
    with pytest.raises(ValueError, match="even segments"):
        half_layout(_cu([3, 2]), 5)


def _job(**distributed_and_data):
    data = dict(datasets=[dict(path="unused")], seq_len=32, batch_size=2, packing="greedy")
    data.update(distributed_and_data.pop("data", {}))
    return dict(
        model=dict(config=dict(model_type="llama"), attn_implementation="headrace_varlen"),
        data=data,
        distributed=distributed_and_data,
    )


@pytest.mark.parametrize(
    "raw, rule",
    [
        (_job(cp_size=4, data=dict(seq_len=36)), r"data.seq_len=36 must be divisible by 2 x distributed.cp_size = 8"),
        (_job(cp_size=2, data=dict(packing="none")), r"cp_size=2 needs packed THD rows: set data.packing"),
        (dict(_job(cp_size=2), model=dict(config=dict(model_type="llama"))), r"set model.attn_implementation=headrace"),
        (_job(cp_size=2, cp_comm="p2p"), r"distributed.cp_comm: expected one of \['allgather', 'ring'\]"),
    ],
)
def test_bad_cp_config_is_one_clear_line(raw, rule):
    from headrace.config import ConfigError

    with pytest.raises(ConfigError, match=rule) as info:
        load_job_config(None, base=raw)
    assert "\n" not in str(info.value)


def test_cp_size_must_divide_world():
    cfg = load_job_config(None, base=_job(cp_size=4)).distributed
    with pytest.raises(ValueError, match="world size 6 is not divisible by tp_size \\* pp_size \\* cp_size = 4"):
        ParallelDims.from_config(cfg, 6)


def test_prefetcher_applies_the_cp_transform_on_the_host():
    batches = packed_batches(3, seq_len=32, rows=2)
    transform = cp_batch_transform(2, 1)
    got = list(DevicePrefetcher(batches, "cpu", transform=transform))
    for batch, shard in zip(batches, got):
        want = cp_shard(batch, 2, 1)
        for key in ("input_ids", "labels", "position_ids", "cu_seqlens"):
            assert torch.equal(shard[key], want[key])
        assert shard["input_ids"].shape[1] * 2 >= batch["input_ids"].numel()
        assert shard["fill"] == batch["fill"] and shard["cp_imbalance"] >= 1.0
    with pytest.raises(ValueError, match="cp_size=2 needs packed batches with cu_seqlens"):
        transform({"input_ids": torch.zeros(2, 4), "lengths": torch.tensor([4, 4])})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_blocks_match_cpu(causal):
    cu, dim = _cu([5, 130, 1, 200, 47]), 64
    q, k, v, dout = (_random((383, h, dim), s) for s, h in enumerate((4, 2, 2, 4)))
    want = block_forward(q, k, v, cu, 200, causal=causal, scale=0.125)
    want_grads = block_backward(dout, q, k, v, *want, cu, 200, causal=causal, scale=0.125)
    gpu = [x.cuda().bfloat16() for x in (q, k, v, dout)]
    out, lse = block_forward(*gpu[:3], cu.cuda(), 200, causal=causal, scale=0.125)
    torch.testing.assert_close(out.float().cpu(), want[0], atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse.cpu(), want[1], atol=3e-2, rtol=3e-2)
    grads = block_backward(gpu[3], *gpu[:3], out, lse, cu.cuda(), 200, causal=causal, scale=0.125)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got.float().cpu(), ref, atol=5e-2, rtol=5e-2)


@pytest.mark.slow
def test_cp_training_matches_single_process(tmp_path):
    """One 4-rank gloo launch: attention (cp2, cp4, both modes), cp4 / cp2 x dp2 / cp2 x tp2+SP+AC training
    against the single-process reference, resume cp2 -> cp1 and cp4 (see tests/dist/cp_checks.py)."""
    save_pretrained_tiny(tmp_path / "pretrained")
    out = torchrun(4, "tests.dist.cp_checks", tmp_path).stdout
    for check in (
        "cp2 attention matches",
        "cp4 attention matches",
        "cp4_allgather matches",
        "cp4_ring matches",
        "cp2_dp2_allgather matches",
        "cp2_dp2_ring matches",
        "cp2_tp2_sp_ac matches",
        "cp2 checkpoint resumes as resume_cp1",
        "cp2 checkpoint resumes as resume_cp4",
    ):
        assert out.count(f"OK {check}") == 4, out[-3000:]


def test_long_context_recipe_loads():
    cfg = load_job_config(str(Path(__file__).resolve().parent.parent / "configs" / "llama_1b_long_context.yaml"))
    assert cfg.distributed.cp_size == 4 and cfg.data.seq_len == 32768 and cfg.distributed.cp_comm == "ring"
    assert cfg.model.config["max_position_embeddings"] >= cfg.data.seq_len


@pytest.mark.parametrize("causal", [True, False])
def test_bf16_blocks_within_bf16_rounding(causal):
    """bf16 activations (FSDP2 MixedPrecisionPolicy): the CPU kernel runs in bf16 with an fp32 lse; outputs
    and gradients stay within bf16 rounding of fp32 (measured <= 8e-3 relative)."""
    cu = _cu([5, 35, 1, 49])
    q, k, v, dout = (_random((90, h, 16), s) for s, h in enumerate((4, 2, 2, 4)))
    want = block_forward(q, k, v, cu, 49, causal=causal, scale=0.25)
    want_grads = block_backward(dout, q, k, v, *want, cu, 49, causal=causal, scale=0.25)
    low = [x.bfloat16() for x in (q, k, v, dout)]
    out, lse = block_forward(*low[:3], cu, 49, causal=causal, scale=0.25)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), want[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want[1], atol=2e-2, rtol=2e-2)
    grads = block_backward(low[3], *low[:3], out, lse, cu, 49, causal=causal, scale=0.25)
    for got, ref in zip(grads, want_grads):
        assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < 3e-2
