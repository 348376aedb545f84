"""Issue 42's pieces of the speech recipe: the ctc_bridge adapter, the wall-clock LR schedule, the generation
length cap and its ended flag (the not-listening rule is in tests/test_speech_ctc.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.dist.speech_common import salm_job, save_tokenizer

from headrace.config import ConfigError  # noqa: E402
from headrace.training.config.job_config import OptimConfig  # noqa: E402
from headrace.training.components.optim import lr_at  # noqa: E402
from headrace.training.speech.bridge import CTCBridge, token_embeddings  # noqa: E402
from headrace.training.speech.eval import greedy_transcripts, token_caps  # noqa: E402
from headrace.training.speech.model import Adapter, build_meta_salm, materialize_salm  # noqa: E402


def planted_bridge(vocab: int, width: int, hidden: int, subsampling: int) -> CTCBridge:
    """A bridge whose mlp outputs zeros and whose head reads unit ``i`` of a frame as token ``i``'s logit
    (the last unit: blank)."""
    mlp = Adapter(width, hidden, subsampling)
    nn.init.zeros_(mlp.proj_out.weight)
    nn.init.zeros_(mlp.proj_out.bias)
    head = nn.Linear(width, vocab + 1)
    with torch.no_grad():
        head.weight.copy_(torch.eye(vocab + 1, width) * 50.0)
        head.bias.zero_()
    return CTCBridge(mlp, head)


def test_the_bridge_writes_the_heads_tokens_as_their_embeddings():
    """Frames sure of token 2, of blank, of token 1: with subsampling 1 the positions are embed[2], zero (blank
    adds nothing), embed[1]; with subsampling 2 the first position sums embed[2] and nothing."""
    vocab, hidden = 4, 6
    table = torch.randn(vocab + 3, hidden)  # the LLM's table may be larger than the head's vocabulary
    frames = torch.zeros(1, 3, vocab + 1)
    for t, unit in enumerate((2, vocab, 1)):
        frames[0, t, unit] = 1.0
    out = planted_bridge(vocab, vocab + 1, hidden, 1)(frames)
    assert out.shape == (1, 3, hidden + vocab)
    got = token_embeddings(out[0], table)
    torch.testing.assert_close(got, torch.stack([table[2], torch.zeros(hidden), table[1]]), atol=1e-4, rtol=0)
    stacked = token_embeddings(planted_bridge(vocab, vocab + 1, hidden, 2)(frames)[0], table)
    torch.testing.assert_close(stacked, torch.stack([table[2], table[1]]), atol=1e-4, rtol=0)


def test_a_bridged_salm_builds_loads_the_ctc_head_and_trains_it(tmp_path):
    """Through the real builder: adapter kind ctc_bridge gets its head from a CTC stage's head/ file, the LLM
    reads the token mass through its embedding table, and the CTC loss (ctc_weight) reaches the head."""
    from safetensors.torch import save_file

    save_tokenizer(tmp_path / "tokenizer.json")
    head = {"weight": torch.randn(65, 32), "bias": torch.randn(65)}  # TINY_ENCODER width 32 -> 64 tokens + blank
    (tmp_path / "head").mkdir()
    save_file(head, str(tmp_path / "head" / "model.safetensors"))
    speech = dict(adapter=dict(kind="ctc_bridge", subsampling=2, head_path=str(tmp_path / "head")), ctc_weight=0.3)
    cfg = salm_job(tmp_path, "bridged", speech_extra=speech)
    from headrace.training.models.build import build_hf_config

    model = build_meta_salm(build_hf_config(cfg.model, text_model=True), cfg.model.speech)
    materialize_salm(model, torch.device("cpu"), None)
    assert isinstance(model.adapter, CTCBridge) and model.ctc_head is None and model.llm.token_mass
    torch.testing.assert_close(model.adapter.head.weight.detach(), head["weight"])
    assert not model.adapter.mlp.proj_out.weight.any()  # starts as the head's token embeddings alone
    from headrace.training.speech.job import SpeechBatches
    from tests.dist.speech_common import audio_batches

    batch = SpeechBatches([], model, cfg.model.speech, cfg.model.tokenizer).convert(audio_batches(1)[0])
    model.train()
    loss = model(**{k: batch[k] for k in ("audio", "audio_lens", "input_ids", "labels", "audio_mask", "position_ids")})
    loss.backward()
    assert torch.isfinite(loss) and model.adapter.head.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="head_path is the ctc_bridge adapter's"):
        salm_job(tmp_path, "x", speech_extra=dict(adapter=dict(head_path=str(tmp_path / "head"))))


def test_the_cosine_runs_over_the_wall_clock_budget():
    cfg = OptimConfig(lr=1.0, warmup_steps=2, min_lr_ratio=0.1, schedule="minutes")
    assert lr_at(1, cfg, 10**6, 0.9) == 0.5  # warmup is by steps either way
    assert lr_at(50, cfg, 10**6, 0.0) == pytest.approx(1.0)
    assert lr_at(50, cfg, 10**6, 0.5) == pytest.approx(0.55)  # half the budget: half way down, whatever the step
    assert lr_at(7, cfg, 10**6, 1.0) == pytest.approx(0.1)
    steps = OptimConfig(lr=1.0, warmup_steps=2, min_lr_ratio=0.1)
    assert lr_at(50, steps, 10**6, 1.0) == pytest.approx(1.0, abs=1e-3)  # by steps: the clock is not read


def test_a_minutes_schedule_without_a_budget_is_refused_and_a_budgeted_run_decays(tmp_path):
    """Through the trainer: optim.schedule minutes needs trainer.max_minutes; a run the budget stops has its LR
    fall with the clock (max_steps far away), from lr down towards the floor."""
    from headrace.config import to_dict
    from headrace.training.config.load import load_job_config
    from headrace.training.config.validate import check_job
    from headrace.training.train import train
    from tests.test_speech_ctc import write_speech_dataset

    save_tokenizer(tmp_path / "tokenizer.json")
    data = write_speech_dataset(tmp_path / "data", ["alpha", "bravo", "charlie", "delta"])
    raw = to_dict(salm_job(tmp_path, "clock", data_path=str(data), max_steps=100_000))
    raw["optim"].update(schedule="minutes", warmup_steps=0, min_lr_ratio=0.0, decay_steps=None)
    with pytest.raises(ConfigError, match="optim.schedule: minutes"):
        check_job(load_job_config(None, base=raw))
    raw["trainer"].update(max_minutes=0.15, log_every=1)
    raw["checkpoint"] = dict(interval=0, export_hf=False)
    history = train(load_job_config(None, base=raw))
    lrs = [r["lr"] for r in history]
    assert 3 <= len(lrs) < 100_000
    assert lrs == sorted(lrs, reverse=True) and lrs[0] > 0.9 * 0.05 and lrs[-1] < 0.5 * 0.05, lrs


def test_the_length_cap_follows_the_audio_and_a_run_on_is_marked_not_ended(tmp_path):
    """token_caps: ceil(seconds * rate) + 4, at most max_new_tokens; a model whose end token can never win is
    cut at each row's cap and its hypotheses are marked not ended."""
    caps = token_caps(torch.tensor([16000, 8000, 160000]), 16000, 5.0, 30)
    assert caps == [9, 7, 30]
    save_tokenizer(tmp_path / "tokenizer.json")
    cfg = salm_job(tmp_path, "caps", speech_extra=dict(max_tokens_per_second=5.0))
    from headrace.training.models.build import build_hf_config
    from headrace.training.speech.prompt import load_tokenizer, make_template

    model = build_meta_salm(build_hf_config(cfg.model, text_model=True), cfg.model.speech)
    materialize_salm(model, torch.device("cpu"), None)
    model.eval()
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    template = make_template(tokenizer, cfg.model.speech.prompt)
    alpha = tokenizer.token_to_id("alpha")
    head = nn.Linear(32, 64)  # every step's logits: 1 for "alpha", 0 for the rest (the end token never wins)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.copy_(torch.nn.functional.one_hot(torch.tensor(alpha), 64).float())
    model.llm.causal_lm.lm_head = head
    audio_lens = torch.tensor([16000, 3200])
    audio = torch.randn(2, 16000) * 0.1
    out = greedy_transcripts(model, template, tokenizer, audio, audio_lens, 64)
    assert [ended for _, ended in out] == [False, False]
    assert [text.split() for text, _ in out] == [["alpha"] * cap for cap in token_caps(audio_lens, 16000, 5.0, 64)]
