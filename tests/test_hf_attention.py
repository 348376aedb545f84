"""headrace_varlen inside transformers models: a packed batch behaves exactly like its documents run one by one."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.masking_utils import create_causal_mask

from headrace.kernels.hf_attention import ATTENTION_NAME, packed_attention_kwargs, register_varlen_attention
from headrace.kernels.loss import linear_cross_entropy

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
}
ROWS = [[7, 10, 5], [1, 15, 8]]  # document lengths per row
SEQ_LEN = 24  # row 0 ends with 2 padding tokens


def _packed_batch(seed=0):
    """A THD batch shaped like dataio packing's output, plus the documents it holds."""
    g = torch.Generator().manual_seed(seed)
    docs, ids, labels, pos, seg = [], [], [], [], []
    for row in ROWS:
        for n in row:
            doc = torch.randint(1, TINY["vocab_size"], (n,), generator=g)
            docs.append(doc)
            ids.append(doc)
            labels.append(torch.cat([doc[1:], torch.tensor([-100])]))
            pos.append(torch.arange(n))
            seg.append(n)
        pad = SEQ_LEN - sum(row)
        if pad:  # padding is its own segment, never labelled
            ids.append(torch.zeros(pad, dtype=torch.long))
            labels.append(torch.full((pad,), -100))
            pos.append(torch.arange(pad))
            seg.append(pad)
    cu = torch.tensor([0, *torch.tensor(seg).cumsum(0).tolist()], dtype=torch.int32)
    batch = {
        "input_ids": torch.cat(ids).view(len(ROWS), SEQ_LEN),
        "labels": torch.cat(labels).view(len(ROWS), SEQ_LEN),
        "position_ids": torch.cat(pos).view(len(ROWS), SEQ_LEN),
        "cu_seqlens": cu,
        "max_seqlen": max(seg),
    }
    return batch, docs


def _models(family):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    stock = model_cls(config_cls(**TINY, **extra, attn_implementation="sdpa"))
    packed = copy.deepcopy(stock)
    packed.set_attn_implementation(register_varlen_attention())
    assert packed.config._attn_implementation == ATTENTION_NAME
    return stock, packed


def _doc_slices():
    start = 0
    for row in ROWS:
        for n in row:
            yield slice(start, start + n)
            start += n
        start += SEQ_LEN - sum(row)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_loss_and_grads_equal_documents_one_by_one(family):
    stock, packed = _models(family)
    batch, docs = _packed_batch()

    logits = packed(input_ids=batch["input_ids"], **packed_attention_kwargs(batch)).logits
    flat_logits = logits.reshape(-1, logits.shape[-1])
    token_loss = F.cross_entropy(flat_logits, batch["labels"].reshape(-1), ignore_index=-100, reduction="none")
    token_loss.sum().backward()

    for doc, where in zip(docs, _doc_slices(), strict=True):
        doc_logits = stock(input_ids=doc[None]).logits[0]
        torch.testing.assert_close(flat_logits[where], doc_logits, atol=2e-5, rtol=1e-5)
        doc_loss = F.cross_entropy(doc_logits[:-1], doc[1:], reduction="none")
        torch.testing.assert_close(token_loss[where][:-1], doc_loss, atol=2e-5, rtol=1e-5)
        doc_loss.sum().backward()  # accumulates: the sum over documents

    for (name, p_stock), p_packed in zip(stock.named_parameters(), packed.parameters(), strict=True):
        torch.testing.assert_close(p_packed.grad, p_stock.grad, atol=5e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_position_ids_alone_give_the_same_result():
    _, packed = _models("llama")
    batch, _ = _packed_batch()
    with torch.no_grad():
        full = packed(input_ids=batch["input_ids"], **packed_attention_kwargs(batch)).logits
        derived = packed(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        kwargs = packed_attention_kwargs({"position_ids": batch["position_ids"]})
    torch.testing.assert_close(derived, full)
    assert torch.equal(kwargs["cu_seq_lens_q"], batch["cu_seqlens"]) and kwargs["max_length_q"] == batch["max_seqlen"]


def test_hidden_states_with_chunked_loss_match_documents_one_by_one():
    """The trainer's path: model.model(...) hidden states + headrace.kernels.loss on the already-shifted labels."""
    stock, packed = _models("qwen3")
    batch, docs = _packed_batch(seed=1)
    hidden = packed.model(input_ids=batch["input_ids"], **packed_attention_kwargs(batch)).last_hidden_state
    loss_sum, num_tokens = linear_cross_entropy(hidden, packed.lm_head.weight, batch["labels"], chunk_size=5)
    want = sum(F.cross_entropy(stock(input_ids=d[None]).logits[0, :-1], d[1:], reduction="sum") for d in docs)
    assert num_tokens.item() == sum(len(d) - 1 for d in docs)
    torch.testing.assert_close(loss_sum, want, atol=1e-4, rtol=1e-5)
    loss_sum.backward()
    want.backward()
    for p_stock, p_packed in zip(stock.parameters(), packed.parameters(), strict=True):
        torch.testing.assert_close(p_packed.grad, p_stock.grad, atol=5e-5, rtol=1e-4)


def test_transformers_builds_no_mask_for_headrace_varlen():
    _, packed = _models("llama")
    batch, _ = _packed_batch()
    embeds = packed.model.embed_tokens(batch["input_ids"])
    for attention_mask in (None, torch.ones_like(batch["input_ids"])):
        mask = create_causal_mask(packed.config, embeds, attention_mask, None, position_ids=batch["position_ids"])
        assert mask is None


def test_refuses_masks_and_decoding():
    _, packed = _models("llama")
    batch, _ = _packed_batch()
    four_d = torch.ones(2, 1, SEQ_LEN, SEQ_LEN, dtype=torch.bool)
    with pytest.raises(ValueError, match="not from a mask"):
        packed(input_ids=batch["input_ids"], attention_mask=four_d, **packed_attention_kwargs(batch))
    cache = packed(input_ids=batch["input_ids"][:1], use_cache=True).past_key_values  # prefill is a full sequence
    with pytest.raises(NotImplementedError, match="use attn_implementation='sdpa' for generation"):
        packed(input_ids=batch["input_ids"][:1, :1], past_key_values=cache)


def test_mixed_dtypes_under_autocast_are_unified():
    """HF's rotary step gives fp32 q/k beside bf16 v under autocast; the function casts q/k to v's dtype."""
    from headrace.kernels.hf_attention import hf_varlen_attention

    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    v = torch.randn(1, 2, 8, 16).to(torch.bfloat16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    out, _ = hf_varlen_attention(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=cu, max_length_q=5)
    same, _ = hf_varlen_attention(
        torch.nn.Module(), q.bfloat16(), k.bfloat16(), v, None, cu_seq_lens_q=cu, max_length_q=5
    )
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, same)


def test_dataio_packer_batches_train_like_documents_one_by_one():
    """End to end with the real packer (best_fit, padding tails, several rows): loss sum is unchanged."""
    import numpy as np

    from headrace.dataio.batching.packing import Packer, pack
    from headrace.dataio.config import PackingConfig

    stock, packed = _models("llama")
    rng = np.random.default_rng(3)
    docs = {ref: rng.integers(1, TINY["vocab_size"], size=n) for ref, n in enumerate([9, 3, 20, 1, 14, 30, 6, 2, 17])}
    packer = Packer(PackingConfig(seq_len=32, packing="best_fit", packing_buffer=4), rows_per_batch=2)
    batches = list(pack(docs.items(), packer))
    assert sum(b["num_docs"] for b in batches) == len(docs)  # nothing split: every doc fits a row

    got = torch.zeros(())
    for b in batches:
        logits = packed(input_ids=b["input_ids"], **packed_attention_kwargs(b)).logits
        got = got + F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100, reduction="sum")
    want = 0.0
    for doc in (torch.as_tensor(d) for d in docs.values() if len(d) > 1):
        want = want + F.cross_entropy(stock(input_ids=doc[None]).logits[0, :-1], doc[1:], reduction="sum")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
