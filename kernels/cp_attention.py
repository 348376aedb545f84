"""Context-parallel document-masked causal attention over packed THD rows split by ``cp_split``.

Layout (``headrace.dataio.feed.cp_split``, Transformer Engine's head-tail scheme): with CP size P every segment
of the packed row (document pieces and padding alike) is padded to a multiple of 2P and cut into 2P chunks of c
tokens; rank r holds chunks r ("head") and 2P-1-r ("tail") of every segment, so its local ``cu_seqlens``
has segments of 2c. Chunk ids give the mask without any position tensor: a query chunk a attends a key
chunk b of the same segment fully when b < a, causally when b == a, and not at all when b > a. For the
head/tail pair of rank r against that of rank s the kinds are the same for every segment, so each
(rank, source) step is at most three varlen blocks over the half-layout ``cu`` (the chunk lengths c_i):

- s == r: head x head causal, tail x tail causal, tail x head full;
- s != r: tail x head full, plus head x head (s < r) or tail x tail (s > r) full.

Every rank does 2P c x c blocks' worth of work per segment: balanced. Blocks run through
``headrace.kernels.attention_lse`` (CPU flash kernel bucketed / CUDA flash varlen) and are merged by their
log-sum-exp. Two ways to get the other ranks' K/V (``mode``):

- ``allgather``: one ``all_gather`` of the local K/V per layer; local queries attend the gathered keys.
  Backward gathers K/V again (so only the local K/V are saved), computes dK/dV for every source and
  ``reduce_scatter``s them back to their owners. Per rank and layer it sends (P-1) x kv bytes forward
  and (P-1) x kv + (P-1)/P x the gathered fp32 dK/dV backward; it holds all P K/V blocks at once.
- ``ring``: K/V travel round the ring with p2p sends (``batch_isend_irecv``), each transfer overlapped
  with the blocks of the K/V already held; backward passes K/V round again with the fp32 dK/dV accumulators
  following them, and one last hop returns each accumulator to its owner. Sends (P-1) x kv forward,
  (P-1) x kv + P x fp32 dK/dV backward; holds two K/V blocks at a time.

Both modes save q, k, v, out and the fp32 lse per layer (the memory of single-device attention divided
by P). ``exchanged_bytes()`` counts the bytes this rank sent (nominal ring-algorithm volume for the
collectives) since the last ``reset_exchanged_bytes()``; the trainer logs it per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from headrace.kernels.attention_lse import block_backward, block_forward, merge_into
from headrace.kernels.collectives import all_gather_flat, reduce_scatter_flat
from headrace.kernels.varlen_attention import cached_per_batch, validate_cu_seqlens

MODES = ("allgather", "ring")
_KV_TAG, _GRAD_TAG = 1, 2
_sent = [0]


def exchanged_bytes() -> int:
    """Bytes this rank sent for CP attention since the last reset (see the module docstring)."""
    return _sent[0]


def reset_exchanged_bytes() -> None:
    _sent[0] = 0


@dataclass(frozen=True)
class HalfLayout:
    """Where the head and tail chunks of every local segment sit, for one micro-batch."""

    halves: tuple[torch.Tensor, torch.Tensor]  # local token index of each head / tail chunk token, (N,) each
    inverse: torch.Tensor  # (T,) position of each local token in cat(head, tail)
    cu: torch.Tensor  # int32 (segments + 1,): cumulative chunk lengths c_i (the layout of one half)
    max_chunk: int


def half_layout(cu_seqlens: torch.Tensor, total_tokens: int) -> HalfLayout:
    """The ``HalfLayout`` of a rank's local ``cu_seqlens`` (every segment 2 equal chunks)."""
    validate_cu_seqlens(cu_seqlens, total_tokens)
    cu = cu_seqlens.long()
    seg = cu[1:] - cu[:-1]
    if bool((seg % 2).any()):
        raise ValueError(
            "context-parallel cu_seqlens must have even segments (two chunks each; see headrace.dataio.feed.cp_split)"
        )
    chunk = seg // 2
    starts = torch.repeat_interleave(cu[:-1], chunk)
    within = torch.arange(int(chunk.sum()), device=cu.device) - torch.repeat_interleave(cu[:-1] // 2, chunk)
    head = starts + within
    tail = head + torch.repeat_interleave(chunk, chunk)
    inverse = torch.empty(total_tokens, dtype=torch.long, device=cu.device)
    inverse[torch.cat([head, tail])] = torch.arange(total_tokens, device=cu.device)
    half_cu = torch.cat([chunk.new_zeros(1), torch.cumsum(chunk, 0)]).to(torch.int32)
    return HalfLayout((head, tail), inverse, half_cu, int(chunk.max()) if chunk.numel() else 0)


def blocks(rank: int, src: int) -> list[tuple[int, int, bool]]:
    """``(query half, key half, causal)`` of rank ``rank``'s queries against rank ``src``'s keys (0 = head,
    1 = tail); see the module docstring."""
    if src == rank:
        return [(0, 0, True), (1, 1, True), (1, 0, False)]
    return [(1, 0, False), (0, 0, False) if src < rank else (1, 1, False)]


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    mode: str = "allgather",
    scale: float | None = None,
) -> torch.Tensor:
    """Causal document-masked attention of this rank's queries against the keys of the whole CP group.

    ``q`` ``(T, H, D)``, ``k``/``v`` ``(T, H_kv, D)``: this rank's tokens in ``headrace.dataio.feed.cp_split`` order,
    ``cu_seqlens`` its local boundaries (segments of two equal chunks, the same on every rank). Returns
    ``(T, H, D_v)``; differentiable in q, k, v.
    """
    if mode not in MODES:
        raise ValueError(f"cp attention mode must be one of {MODES}, got {mode!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    layout = cached_per_batch("cp_halves", cu_seqlens, q.shape[0], lambda: half_layout(cu_seqlens, q.shape[0]))
    return _CPAttention.apply(q, k, v, layout, group, mode, scale)


# --- K/V exchange -----------------------------------------------------------------------------------


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)], 1).contiguous()


def _unpack(buf: torch.Tensor, k_shape, v_shape) -> tuple[torch.Tensor, torch.Tensor]:
    split = k_shape[1] * k_shape[2]
    return buf[:, :split].view(k_shape), buf[:, split:].view(v_shape)


def _all_gather(buf: torch.Tensor, group) -> list[torch.Tensor]:
    size = dist.get_world_size(group)
    out = buf.new_empty(size * buf.shape[0], *buf.shape[1:])  # gloo wants a flat (P*T, ...) output
    all_gather_flat(out, buf, group=group)
    _sent[0] += (size - 1) * buf.numel() * buf.element_size()
    return list(out.chunk(size))


class _Ring:
    """Asynchronous send to rank+1 / receive from rank-1 of same-shaped tensors within ``group``."""

    def __init__(self, group):
        self.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def start(self, tensor: torch.Tensor, tag: int):
        """``tag`` keeps K/V and dK/dV messages apart (both may be in flight between the same two ranks)."""
        recv = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        _sent[0] += tensor.numel() * tensor.element_size()
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(pending) -> torch.Tensor:
        recv, works = pending
        for w in works:
            w.wait()
        return recv


# --- forward / backward -----------------------------------------------------------------------------


def _attend(q_halves, k, v, layout, rank, src, acc, scale):
    """Merge the blocks of ``rank``'s query halves against source ``src``'s K/V into ``acc`` (per half)."""
    for qa, kb, causal in blocks(rank, src):
        ks, vs = (x.index_select(0, layout.halves[kb]) for x in (k, v))
        out, lse = block_forward(q_halves[qa], ks, vs, layout.cu, layout.max_chunk, causal=causal, scale=scale)
        acc[qa] = merge_into(acc[qa], out, lse)


def _grad_blocks(saved, k, v, layout, rank, src, dq_halves, dkv):
    """Add the gradients of ``rank``'s blocks against source ``src`` to ``dq_halves`` and ``dkv`` (that
    source's fp32 (dk, dv) in local token order)."""
    q_halves, out_halves, lse_halves, dout_halves, scale = saved
    for qa, kb, causal in blocks(rank, src):
        idx = layout.halves[kb]
        ks, vs = k.index_select(0, idx), v.index_select(0, idx)
        dq, dk, dv = block_backward(
            dout_halves[qa],
            q_halves[qa],
            ks,
            vs,
            out_halves[qa],
            lse_halves[qa],
            layout.cu,
            layout.max_chunk,
            causal=causal,
            scale=scale,
        )
        dq_halves[qa] += dq.float()
        dkv[0].index_add_(0, idx, dk.float())
        dkv[1].index_add_(0, idx, dv.float())


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: HalfLayout, group, mode: str, scale: float):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        q_halves = [q.index_select(0, h) for h in layout.halves]
        acc = [None, None]
        if mode == "allgather":
            for src, buf in enumerate(_all_gather(_pack(k, v), group)):
                _attend(q_halves, *_unpack(buf, k.shape, v.shape), layout, rank, src, acc, scale)
        else:
            ring, buf = _Ring(group), _pack(k, v)
            for step in range(size):
                pending = ring.start(buf, _KV_TAG) if step < size - 1 else None  # overlaps this step's blocks
                _attend(q_halves, *_unpack(buf, k.shape, v.shape), layout, rank, (rank - step) % size, acc, scale)
                if pending is not None:
                    buf = ring.finish(pending)
        out = torch.cat([acc[0][0], acc[1][0]]).index_select(0, layout.inverse).to(q.dtype)
        lse = torch.cat([acc[0][1], acc[1][1]])  # (T, H) in cat(head, tail) order
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.group, ctx.mode, ctx.scale = layout, group, mode, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, group, scale = ctx.layout, ctx.group, ctx.scale
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        n = layout.halves[0].numel()
        saved = (
            [q.index_select(0, h) for h in layout.halves],
            [out.index_select(0, h) for h in layout.halves],
            [lse[:n], lse[n:]],
            [dout.index_select(0, h) for h in layout.halves],
            scale,
        )
        dq_halves = [torch.zeros(n, *q.shape[1:], dtype=torch.float32, device=q.device) for _ in range(2)]

        def zeros_kv():
            return [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (k, v)]

        if ctx.mode == "allgather":
            grads = []
            for src, buf in enumerate(_all_gather(_pack(k, v), group)):
                dkv = zeros_kv()
                _grad_blocks(saved, *_unpack(buf, k.shape, v.shape), layout, rank, src, dq_halves, dkv)
                grads.append(_pack(*dkv))
            mine = torch.empty_like(grads[0])
            reduce_scatter_flat(mine, torch.cat(grads), group=group)
            _sent[0] += (size - 1) * mine.numel() * mine.element_size()
        else:
            ring, buf, dkv_buf = _Ring(group), _pack(k, v), None
            for step in range(size):
                pending = ring.start(buf, _KV_TAG) if step < size - 1 else None
                dkv = zeros_kv() if dkv_buf is None else list(_unpack(dkv_buf, k.shape, v.shape))
                _grad_blocks(saved, *_unpack(buf, k.shape, v.shape), layout, rank, (rank - step) % size, dq_halves, dkv)
                # the accumulator follows its K/V to the next rank; after the last step it returns to its owner
                dkv_buf = ring.finish(ring.start(_pack(*dkv), _GRAD_TAG))
                if pending is not None:
                    buf = ring.finish(pending)
            mine = dkv_buf
        dk, dv = _unpack(mine, k.shape, v.shape)
        dq = torch.cat(dq_halves).index_select(0, layout.inverse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


__all__ = ["MODES", "HalfLayout", "blocks", "cp_attention", "exchanged_bytes", "half_layout", "reset_exchanged_bytes"]
