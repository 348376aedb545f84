"""SALM pieces without a process group: the prompt layout, the placeholder replacement and the answer-only
loss on a bucketed batch, WER, config errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.dist.speech_common import (
    SPEECH,
    TINY_ENCODER,
    TINY_LLM,
    TINY_WHISPER,
    audio_batches,
    save_tokenizer,
    salm_job,
)

from headrace.config import ConfigError  # noqa: E402
from headrace.training.speech.eval import corpus_wer, word_errors  # noqa: E402
from headrace.training.speech.prompt import PromptTemplate, build_batch  # noqa: E402


def test_prompt_layout_answers_and_labels():
    t = PromptTemplate(prefix=[10, 11], suffix=[12], eos_id=1, pad_id=0)
    out = build_batch(t, torch.tensor([3, 1]), [[20, 21], [22, 23, 24, 25]], multiple_of=4)
    ids, labels, mask = out["input_ids"], out["labels"], out["audio_mask"]
    assert ids.shape == (2, 12)  # longest row 2 + 1 + 1 + 5 = 9 -> 12
    assert ids[0, :9].tolist() == [10, 11, 0, 0, 0, 12, 20, 21, 1]
    assert ids[1, :10].tolist() == [10, 11, 0, 12, 22, 23, 24, 25, 1, 0][:10]
    assert mask[0].nonzero().flatten().tolist() == [2, 3, 4] and mask[1].nonzero().flatten().tolist() == [2]
    # next-token labels on the answer and its eos only
    assert labels[0].tolist() == [-100] * 5 + [20, 21, 1] + [-100] * 4
    assert labels[1].tolist() == [-100] * 3 + [22, 23, 24, 25, 1] + [-100] * 4
    gen = build_batch(t, torch.tensor([3, 1]), left_pad=True)
    assert gen["input_ids"][1].tolist() == [0, 0, 10, 11, 0, 12] and gen["attention_mask"][1].tolist() == [
        0,
        0,
        1,
        1,
        1,
        1,
    ]
    assert gen["audio_mask"][1].tolist() == [False] * 4 + [True, False]


def _tiny_salm(tmp_path, **job):
    from headrace.training.models.build import build_hf_config
    from headrace.training.speech.job import SpeechBatches
    from headrace.training.speech.model import build_meta_salm, materialize_salm

    save_tokenizer(tmp_path / "tokenizer.json")
    cfg = salm_job(tmp_path, "unit", **job)
    torch.manual_seed(0)
    model = build_meta_salm(build_hf_config(cfg.model), cfg.model.speech)
    materialize_salm(model, torch.device("cpu"), None)
    return model, SpeechBatches([], model, cfg.model.speech, cfg.model.tokenizer)


def test_placeholder_replaced_by_frames_and_loss_on_answers_only(tmp_path):
    model, speech = _tiny_salm(tmp_path)
    raw = audio_batches(1, rows=3, seed=4)[0]
    assert len(set(raw["audio_lens"].tolist())) == 3
    batch = speech.convert(raw)
    slots = model.audio_slots(raw["audio_lens"])
    assert batch["audio_mask"].sum(1).tolist() == slots.tolist()
    frames = model.encode(batch["audio"], batch["audio_lens"])
    assert frames.shape == (int(slots.sum()), TINY_LLM["hidden_size"])
    embeds = model.llm.embed(batch["input_ids"], frames, batch["audio_mask"])
    tokens = model.llm.model.embed_tokens(batch["input_ids"])
    start = 0
    for b, n in enumerate(slots.tolist()):
        where = batch["audio_mask"][b].nonzero().flatten()
        assert torch.equal(embeds[b, where], frames[start : start + n])  # every slot holds its frame, in order
        start += n
        assert torch.equal(embeds[b, ~batch["audio_mask"][b]], tokens[b, ~batch["audio_mask"][b]])
    # the loss is the cross-entropy of the answer positions only: full logits, labels -100 elsewhere
    loss = model(**{k: batch[k] for k in ("audio", "audio_lens", "input_ids", "labels", "audio_mask", "position_ids")})
    logits = model.llm.causal_lm(inputs_embeds=embeds, position_ids=batch["position_ids"]).logits
    want = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum")
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    answers = [len(t.split()) + 1 for t in raw["text"]]  # one word = one token here, + eos
    assert (batch["labels"] != -100).sum(1).tolist() == answers
    changed = dict(batch, input_ids=batch["input_ids"].clone())
    changed["input_ids"][:, 0] = 5  # a prompt token changes the loss only through the context, labels stay
    assert torch.equal(speech.convert(raw)["labels"], changed["labels"])


def test_ctc_weight_adds_the_transcripts_ctc_loss_in_training_only(tmp_path):
    """``model.speech.ctc_weight``: in training the step's loss is the answer loss plus the weighted CTC loss of
    each transcript (its answer tokens, no eos) over that utterance's encoder frames, as ``F.ctc_loss`` gives it
    computed by hand; in eval (validation, the listening ratio) it is the answer loss alone."""
    model, speech = _tiny_salm(tmp_path, speech_extra=dict(ctc_weight=0.5))
    raw = audio_batches(1, rows=3, seed=4)[0]
    batch = speech.convert(raw)
    inputs = {k: batch[k] for k in ("audio", "audio_lens", "input_ids", "labels", "audio_mask", "position_ids")}
    head = model.ctc_head

    def without_ctc():
        model.ctc_head = None
        try:
            return model(**inputs)
        finally:
            model.ctc_head = head

    model.eval()  # (the FastConformer's batch norms differ between the modes, so each mode is compared with itself)
    torch.testing.assert_close(model(**inputs), without_ctc(), rtol=0, atol=0)
    model.train()
    loss = model(**inputs)
    answers = speech.answers(raw)
    hidden, frames = model.encoder_frames(batch["audio"], batch["audio_lens"])
    log_probs = head(hidden).log_softmax(-1)
    by_hand = sum(
        F.ctc_loss(
            log_probs[b, : frames[b]],
            torch.tensor(a),
            frames[b : b + 1],
            torch.tensor([len(a)]),
            blank=TINY_LLM["vocab_size"],
            reduction="sum",
        )
        for b, a in enumerate(answers)
    )
    assert by_hand > 0 and all(len(a) <= int(f) for a, f in zip(answers, frames))
    torch.testing.assert_close(loss, without_ctc() + 0.5 * by_hand, rtol=1e-5, atol=1e-4)
    loss.backward()  # the encoder gets the CTC gradient
    assert head.weight.grad.abs().sum() > 0


def test_a_fresh_fastconformer_passes_the_audio_through_its_subsampling():
    """From scratch (the ASR recipe's encoder: 8x conv subsampling), the subsampling stack keeps the features'
    variation: two different utterances still differ after it by >= 1e-3 of their feature difference
    (torch's conv init: ~8e-3). transformers' N(0, 0.02) conv init shrank it to ~1e-6, and within the first
    training steps the encoder's output stopped depending on the audio."""
    from headrace.training.config.load import load_job_config
    from headrace.training.models.build import build_hf_config
    from headrace.training.speech.model import build_meta_salm, materialize_salm

    cfg = load_job_config(str(Path(__file__).resolve().parent.parent / "configs" / "speech_asr_recipe.yaml"))
    torch.manual_seed(0)
    model = build_meta_salm(build_hf_config(cfg.model), cfg.model.speech)
    materialize_salm(model, torch.device("cpu"), None)
    model.eval()
    t = torch.arange(32000) / 16000
    audio = torch.stack([0.3 * torch.sin(2 * torch.pi * 300 * t), 0.3 * torch.randn(32000)])
    lens = torch.tensor([32000, 32000])
    out = {}
    model.encoder.subsampling.register_forward_hook(lambda module, args, output: out.update(frames=output))
    with torch.no_grad():
        feats, _ = model.front.features(model.encoder, audio, lens)
        model.encode(audio, lens)
    frames = out["frames"][0] if isinstance(out["frames"], tuple) else out["frames"]
    kept = (frames[0] - frames[1]).abs().mean() / (feats[0] - feats[1]).abs().mean()
    assert kept > 1e-3, kept


def _whisper_checkpoint(path: Path):
    """A tiny whole Whisper model (encoder + decoder) saved as a HF checkpoint in float16, like large-v3's."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(1)
    whisper = WhisperForConditionalGeneration(
        WhisperConfig(
            **TINY_WHISPER,
            vocab_size=64,
            decoder_layers=1,
            decoder_attention_heads=4,
            decoder_ffn_dim=64,
            max_target_positions=32,
            decoder_start_token_id=1,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=1,
        )
    ).eval()
    whisper.to(torch.float16).save_pretrained(path)
    return whisper.float()


def test_whisper_encoder_from_a_checkpoint_slots_forward_backward(tmp_path, process_group):
    """A SALM on a whole Whisper checkpoint's encoder: the weights are the checkpoint's; every utterance gets the
    adapter frames its real audio covers (the extractor's attention mask, halved by the encoder's conv, then
    stacked by the adapter); the frames written into the slots equal transformers' WhisperEncoder on
    WhisperFeatureExtractor's features of each utterance alone; backward reaches the encoder, not its fixed
    positions; the export's encoder/ loads back through load_salm."""
    from transformers import WhisperFeatureExtractor

    from headrace.training.speech.job import export_salm, load_salm

    whisper = _whisper_checkpoint(tmp_path / "whisper")
    model, speech = _tiny_salm(
        tmp_path,
        encoder="whisper",
        speech_extra=dict(encoder=dict(kind="whisper", pretrained_path=str(tmp_path / "whisper"))),
    )
    ours = dict(model.encoder.named_parameters())
    for name, value in whisper.model.encoder.named_parameters():
        assert torch.equal(ours[name], value), name
    raw = audio_batches(1, rows=3, seed=4)[0]
    batch = speech.convert(raw)
    extractor = WhisperFeatureExtractor(feature_size=TINY_WHISPER["num_mel_bins"])
    waves = [w[:n].numpy() for w, n in zip(raw["audio"], raw["audio_lens"])]
    feats = extractor(
        waves,
        sampling_rate=16000,
        max_length=2 * TINY_WHISPER["max_source_positions"] * 160,
        return_attention_mask=True,
        return_tensors="pt",
    )
    mel_frames = feats["attention_mask"].sum(1)
    encoder_frames = (mel_frames + 1) // 2  # conv2: kernel 3, stride 2, padding 1
    slots = (encoder_frames + 1) // 2  # adapter.subsampling 2
    assert len(set(slots.tolist())) == 3 and batch["audio_mask"].sum(1).tolist() == slots.tolist()
    with torch.no_grad():
        hidden = whisper.model.encoder(feats["input_features"]).last_hidden_state
        want = torch.cat([model.adapter(h[None, :n])[0, :s] for h, n, s in zip(hidden, encoder_frames, slots)])
        torch.testing.assert_close(model.encode(batch["audio"], batch["audio_lens"]), want, rtol=1e-4, atol=1e-5)
    loss = model(**{k: batch[k] for k in ("audio", "audio_lens", "input_ids", "labels", "audio_mask", "position_ids")})
    loss.backward()
    assert torch.isfinite(loss) and model.encoder.embed_positions.weight.grad is None
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0
        for n, p in model.encoder.named_parameters()
        if n != "embed_positions.weight"
    )
    cfg = salm_job(tmp_path, "unit", encoder="whisper")
    export_salm(model, cfg, tmp_path / "export")
    loaded, loaded_cfg = load_salm(tmp_path / "export")
    assert loaded_cfg.encoder.kind == "whisper" and loaded_cfg.features is None
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.encode(batch["audio"], batch["audio_lens"]), model.eval().encode(batch["audio"], batch["audio_lens"])
        )


def test_parakeet_encoder_from_a_parakeet_ctc_checkpoint_matches_transformers_and_trains(tmp_path):
    """``speech.encoder: {kind: parakeet, pretrained_path: <a ParakeetForCTC checkpoint>}`` with NeMo's features
    (``features.kind: nemo``): its encoder_config (its default LayerDrop 0.1 off) and ``encoder.*`` weights, the
    CTC head not read; from the same audio, the frames of the batch equal transformers' ParakeetEncoder on
    ParakeetFeatureExtractor's features of each utterance alone; one SGD step of the SALM reaches the encoder
    and lowers the loss."""
    from transformers import ParakeetCTCConfig, ParakeetFeatureExtractor, ParakeetForCTC

    n_mels = 16
    torch.manual_seed(2)
    ctc = ParakeetForCTC(
        ParakeetCTCConfig(encoder_config=dict(TINY_ENCODER, num_mel_bins=n_mels), vocab_size=32, pad_token_id=31)
    ).eval()
    ctc.save_pretrained(tmp_path / "parakeet-ctc")
    assert ctc.config.encoder_config.layerdrop == 0.1
    model, speech = _tiny_salm(
        tmp_path,
        speech_extra=dict(
            encoder=dict(kind="parakeet", pretrained_path=str(tmp_path / "parakeet-ctc")),
            features=dict(kind="nemo", n_mels=n_mels),
        ),
    )
    assert model.encoder.config.layerdrop == 0.0
    ours = dict(model.encoder.named_parameters())
    assert ours.keys() == dict(ctc.encoder.named_parameters()).keys()
    for name, value in ctc.encoder.named_parameters():
        assert torch.equal(ours[name], value), name
    raw = audio_batches(1, rows=3, seed=4)[0]
    batch = speech.convert(raw)
    waves = [w[:n].numpy() for w, n in zip(raw["audio"], raw["audio_lens"])]
    theirs = ParakeetFeatureExtractor(feature_size=n_mels)(
        waves, sampling_rate=16000, return_attention_mask=True, return_tensors="pt"
    )
    model.eval()
    with torch.no_grad():
        feats, frames = model.front.features(model.encoder, batch["audio"], batch["audio_lens"])
        assert frames.tolist() == theirs["attention_mask"].sum(1).tolist() and len(set(frames.tolist())) == 3
        hidden = model.front.hidden(model.encoder, feats, frames)
        covered = model.front.output_frames(model.encoder, batch["audio_lens"])
        for row, (n, m) in enumerate(zip(frames.tolist(), covered.tolist())):
            alone = ctc.encoder(theirs["input_features"][row : row + 1, :n]).last_hidden_state[0]
            assert alone.shape[0] == m
            torch.testing.assert_close(hidden[row, :m], alone, rtol=1e-4, atol=1e-5)  # measured 7e-6 at most
    model.train()
    inputs = {k: batch[k] for k in ("audio", "audio_lens", "input_ids", "labels", "audio_mask", "position_ids")}
    loss = model(**inputs)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.encoder.parameters() if p.requires_grad)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 1e-2 * p.grad / (batch["labels"] != -100).sum()
        assert model(**inputs) < loss


def test_whisper_job_refuses_audio_it_cannot_take(tmp_path):
    from headrace.config import to_dict
    from headrace.training.config.load import load_job_config
    from headrace.training.distributed.parallel_dims import ParallelDims
    from headrace.training.speech.job import build_salm

    save_tokenizer(tmp_path / "tokenizer.json")
    raw = to_dict(salm_job(tmp_path, "x", encoder="whisper"))
    for decode, error in (
        (dict(max_duration=1.0), r"takes at most 0.8 s of audio: set data.decode.max_duration <= 0.8"),
        (dict(sample_rate=8000), r"data.decode.sample_rate 8000 != 16000 Hz, the rate the whisper"),
    ):
        raw["data"]["decode"].update(decode)
        cfg = load_job_config(None, base=raw)
        with pytest.raises(ValueError, match=error):
            build_salm(cfg, ParallelDims.from_config(cfg.distributed, 1), torch.device("cpu"))


def test_word_errors_and_wer():
    assert word_errors("a b c".split(), "a b c".split()) == 0
    assert word_errors("a b c".split(), "a x c".split()) == 1
    assert word_errors("a b c".split(), "a c".split()) == 1
    assert word_errors("a b".split(), "a b c d".split()) == 2
    assert word_errors([], "a".split()) == 1
    assert word_errors("the cat sat".split(), "cat sat on".split()) == 2
    assert corpus_wer([("Hello, world.", "hello world"), ("a b c d", "a b")]) == pytest.approx(2 / 6)


def test_salm_config_errors(tmp_path):
    from headrace.config import to_dict
    from headrace.training.config.load import load_job_config

    raw = to_dict(salm_job(tmp_path, "x"))
    raw["model"]["speech"]["prompt"] = "no audio here"
    with pytest.raises(ConfigError, match=r"model.speech: .*placeholder <\|audio\|> exactly once"):
        load_job_config(None, base=raw)
    raw = to_dict(salm_job(tmp_path, "x"))
    raw["data"]["bucketing"] = None
    with pytest.raises(ConfigError, match="salm trains on bucketed audio"):
        load_job_config(None, base=raw)
    from headrace.kernels.log_mel import LogMelConfig
    from headrace.training.config.speech import EncoderConfig
    from headrace.training.speech.encoders import ParakeetFrontEnd, WhisperFrontEnd

    with pytest.raises(ValueError, match="layerdrop"):
        ParakeetFrontEnd(LogMelConfig(n_mels=16)).config(EncoderConfig(config=dict(TINY_ENCODER, layerdrop=0.1)))
    with pytest.raises(ValueError, match="encoder_layerdrop must be 0"):
        WhisperFrontEnd().config(EncoderConfig(kind="whisper", config=dict(TINY_WHISPER, encoder_layerdrop=0.1)))
    assert SPEECH["features"]["n_mels"] == 16
    raw = to_dict(salm_job(tmp_path, "x", encoder="whisper"))
    raw["model"]["speech"]["features"] = {"n_mels": 80}
    with pytest.raises(ConfigError, match=r"model.speech: features: a whisper encoder takes Whisper's own"):
        load_job_config(None, base=raw)
    raw["model"]["speech"]["encoder"]["kind"] = "wav2vec"
    with pytest.raises(
        ConfigError,
        match=r"model.speech.encoder.kind: expected one of "
        r"\['parakeet', 'whisper', 'qwen2_audio', 'voxtral'\]",
    ):
        load_job_config(None, base=raw)
    (tmp_path / "parakeet").mkdir()
    (tmp_path / "parakeet" / "config.json").write_text('{"model_type": "parakeet_encoder"}')
    with pytest.raises(ValueError, match="holds a 'parakeet_encoder' config, not one of \\['whisper'\\]"):
        WhisperFrontEnd().config(EncoderConfig(kind="whisper", config_path=str(tmp_path / "parakeet")))


def test_batch_estimator_finds_the_largest_batch_under_a_budget(tmp_path):
    import numpy as np

    from headrace.training.estimate_batch import estimate_table, largest_fitting, saved_activation_bytes, synthetic_step

    for cap in (0, 4, 7, 8, 100, 4096, 5000):
        calls = []
        got = largest_fitting(lambda b: calls.append(b) or 3 * b + 5 <= 3 * cap + 5, limit=4096)
        assert got == min(cap, 4096) and len(calls) <= 2 * 13 + 2
    model, speech = _tiny_salm(tmp_path)
    cost = {b: saved_activation_bytes(synthetic_step(model, speech, 0.5, 6, b)) for b in (5, 6)}
    assert cost[5] < cost[6]
    budget = (cost[5] + cost[6]) // 2  # a synthetic budget: saved activations of 5 fit, of 6 do not
    assert estimate_table(model, speech, np.array([[0.5, 6.0]]), budget, limit=64) == [5]


def test_speech_demo_recipe_loads():
    from headrace.training.config.load import load_job_config

    cfg = load_job_config(str(Path(__file__).resolve().parent.parent / "configs" / "speech_demo.yaml"))
    assert cfg.model.kind == "salm" and cfg.model.speech.encoder.kind == "parakeet"
    assert cfg.data.bucketing.two_d and cfg.data.seq_len is None
    whisper = load_job_config(str(Path(__file__).resolve().parent.parent / "configs" / "speech_whisper_demo.yaml"))
    assert whisper.model.speech.encoder.kind == "whisper" and whisper.model.speech.features is None
    asr = load_job_config(str(Path(__file__).resolve().parent.parent / "configs" / "speech_asr_recipe.yaml"))
    assert asr.model.speech.ctc_weight > 0 and asr.data.val is not None and asr.model.speech.eval_split == "val"


def _estimator_job(tmp_path) -> str:
    """A tiny SALM job YAML with two 2D buckets, for ``python -m headrace.training.estimate_batch``."""
    import yaml

    from headrace.config import to_dict

    save_tokenizer(tmp_path / "tokenizer.json")
    raw = to_dict(salm_job(tmp_path, "estimate"))
    raw["data"]["bucketing"] = dict(bucket_duration_bins=[[0.5, 4], [1.0, 8]], max_duration=2.0, max_tokens=64)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    return str(tmp_path / "job.yaml")


def test_batch_estimator_cli_answers_within_the_budget_with_progress(tmp_path, capsys):
    """The CLI's CPU answer per bucket is the largest batch whose saved-for-backward bytes, measured at that
    size, fit the budget (it measures batch 1 and 2 only and solves for it); one progress line per bucket."""
    import yaml

    from headrace.training.estimate_batch import main, saved_activation_bytes, synthetic_step

    job = _estimator_job(tmp_path)
    budget_gib = 0.002
    assert main(["--config", job, "--budget-gib", str(budget_gib), "--limit", "64"]) == 0
    out, err = capsys.readouterr()
    table = yaml.safe_load(out)
    assert table["bucket_duration_bins"] == [[0.5, 4], [1.0, 8]]
    progress = [line for line in err.splitlines() if line.startswith("bucket ")]
    assert [line.split(":")[0] for line in progress] == ["bucket 1/2 [0.5 s, 4 tokens]", "bucket 2/2 [1 s, 8 tokens]"]
    model, speech = _tiny_salm(tmp_path)
    budget = int(budget_gib * 2**30)
    for (seconds, tokens), size in zip(table["bucket_duration_bins"], table["bucket_batch_size"]):
        assert 1 < size < 64
        cost = {b: saved_activation_bytes(synthetic_step(model, speech, seconds, tokens, b)) for b in (size, size + 1)}
        assert cost[size] <= budget < cost[size + 1], (seconds, size, cost, budget)
    assert table["bucket_batch_size"][0] > table["bucket_batch_size"][1]


def test_batch_estimator_cli_time_limit_and_refusal(tmp_path, capsys):
    import psutil
    import yaml

    from headrace.training.estimate_batch import main

    job = _estimator_job(tmp_path)
    # past the time limit: the buckets not measured are null (cannot be pasted unnoticed), exit status 3
    assert main(["--config", job, "--budget-gib", "0.002", "--time-limit", "0"]) == 3
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["bucket_batch_size"] == [None, None]
    assert "time limit 0 s reached: 2 of 2 buckets not measured" in err
    # a budget above the machine's free memory: a one-line refusal before any model is built
    too_much = psutil.virtual_memory().total / 2**30 * 2
    assert main(["--config", job, "--budget-gib", f"{too_much:.0f}"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: --budget-gib {too_much:.0f} exceeds the free memory of cpu (")
