"""Released speech-LLM checkpoints as SALM starting points: a tiny random Qwen2-Audio and a tiny random Voxtral,
built and saved by transformers, converted (``python -m headrace.training.speech.checkpoints``) and loaded by
``load_salm``, give transformers' own logits on the same audio and text, and one fine-tuning step on both
gives the same loss."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.dist.speech_common import WORDS, audio_batches

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
                 "{% if c['type'] == 'audio' %}Audio: <|audio_bos|><|AUDIO|><|audio_eos|>{% else %}{{ c['text'] }}"
                 "{% endif %}{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
WINDOW_POSITIONS = 40  # 80 mel frames = 0.8 s (the test audio is 0.2..0.7 s)


def word_level_tokenizer(vocab: dict[str, int], eos: str, specials: list[str]):
    """A whitespace word-level transformers tokenizer over ``vocab`` (``eos`` also pads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos,
                                   additional_special_tokens=specials)


def save_qwen2_audio(path: Path):
    """A tiny random Qwen2-Audio (transformers' model, config and a chat tokenizer) saved as a checkpoint."""
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    vocab = {w: i for i, w in enumerate(["[UNK]", *SPECIAL, "system", "user", "assistant", "Audio", ":", *WORDS])}
    tokenizer = word_level_tokenizer(vocab, "<|endoftext|>", SPECIAL[1:])
    tokenizer.chat_template = CHAT_TEMPLATE
    config = Qwen2AudioConfig(
        audio_config=dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, num_mel_bins=80,
                          max_source_positions=WINDOW_POSITIONS, dropout=0.0, attention_dropout=0.0,
                          activation_dropout=0.0),
        text_config=dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False),
        audio_token_id=vocab["<|AUDIO|>"])
    torch.manual_seed(3)
    model = Qwen2AudioForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, vocab


def transformers_inputs(raw: dict, batch: dict, audio_token_id: int) -> dict:
    """The same utterances and token rows as transformers' Qwen2-Audio takes them: the slots hold its audio
    token, the features come from its extractor, the labels unshifted (it shifts them itself)."""
    from transformers import WhisperFeatureExtractor

    waves = [w[:n].numpy() for w, n in zip(raw["audio"], raw["audio_lens"])]
    feats = WhisperFeatureExtractor(feature_size=80)(waves, sampling_rate=16000, max_length=2 * WINDOW_POSITIONS * 160,
                                                     return_attention_mask=True, return_tensors="pt")
    ids = batch["input_ids"].masked_fill(batch["audio_mask"], audio_token_id)
    labels = torch.full_like(batch["labels"], -100)
    labels[:, 1:] = batch["labels"][:, :-1]
    return {"input_ids": ids, "input_features": feats["input_features"],
            "feature_attention_mask": feats["attention_mask"], "labels": labels}


def assert_sgd_steps_match(model, reference, inputs: dict, hf_inputs: dict, tokens) -> None:
    """Two plain SGD steps (lr 0.5) of each model on its own loss (ours: the summed answer cross-entropy over the
    answer tokens): the losses agree before and after the first step, and the step changed the model."""
    losses = []
    for _ in range(2):
        loss = model(**inputs) / tokens
        want = reference(**hf_inputs).loss
        losses.append((float(loss), float(want)))
        for m, value in ((model, loss), (reference, want)):
            value.backward()
            with torch.no_grad():
                for p in m.parameters():
                    if p.grad is not None:
                        p -= 0.5 * p.grad
            m.zero_grad()
    for ours_loss, theirs in losses:
        assert abs(ours_loss - theirs) < 1e-5 * theirs, losses
    assert losses[1][0] < losses[0][0] - 1e-3, losses


def test_qwen2_audio_checkpoint_loads_with_transformers_logits_and_one_step_loss(tmp_path):
    from headrace.training.speech.job import SALM_INPUTS, SpeechBatches, load_salm
    from headrace.training.speech.checkpoints import main

    reference, vocab = save_qwen2_audio(tmp_path / "qwen2-audio")
    assert main([str(tmp_path / "qwen2-audio"), str(tmp_path / "salm")]) == 0
    model, speech = load_salm(tmp_path / "salm")
    # the prompt is the checkpoint's chat template around its audio markers
    assert speech.prompt == ("<|im_start|>user\nAudio: <|audio_bos|><|audio|><|audio_eos|><|im_end|>\n"
                             "<|im_start|>assistant\n")
    assert speech.encoder.kind == "qwen2_audio" and speech.adapter.kind == "linear"
    raw = audio_batches(1, rows=3, seed=4)[0]
    assert len(set(raw["audio_lens"].tolist())) == 3
    batch = SpeechBatches([], model, speech, str(tmp_path / "salm" / "hf")).convert(raw)
    assert batch["input_ids"][0, :5].tolist() == [vocab[t] for t in ("<|im_start|>", "user", "Audio", ":",
                                                                      "<|audio_bos|>")]
    hf_inputs = transformers_inputs(raw, batch, vocab["<|AUDIO|>"])
    # the slots are the frames transformers' processor would expand <|AUDIO|> into
    mel = hf_inputs["feature_attention_mask"].sum(1)
    assert batch["audio_mask"].sum(1).tolist() == (((mel - 1) // 2 + 1 - 2) // 2 + 1).tolist()

    def ours():
        embeds = model.llm.embed(batch["input_ids"], model.encode(batch["audio"], batch["audio_lens"]),
                                 batch["audio_mask"])
        return model.llm.causal_lm(inputs_embeds=embeds, position_ids=batch["position_ids"]).logits

    tokens = int((batch["labels"] != -100).sum())
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(), reference(**hf_inputs).logits, rtol=1e-4, atol=1e-5)
    # one SGD step of each on its own loss (ours: the summed answer cross-entropy over the answer tokens)
    assert_sgd_steps_match(model, reference, {k: batch[k] for k in SALM_INPUTS}, hf_inputs, tokens)


VOXTRAL_SPECIAL = ["</s>", "[INST]", "[/INST]", "[BEGIN_AUDIO]", "[AUDIO]"]


def save_voxtral(path: Path):
    """A tiny random Voxtral (transformers' model and config) with a word-level tokenizer, saved."""
    from transformers import VoxtralConfig, VoxtralForConditionalGeneration

    vocab = {w: i for i, w in enumerate(["[UNK]", *VOXTRAL_SPECIAL, *WORDS])}
    tokenizer = word_level_tokenizer(vocab, "</s>", VOXTRAL_SPECIAL[1:])
    config = VoxtralConfig(
        audio_config=dict(hidden_size=32, encoder_layers=2, encoder_attention_heads=4, intermediate_size=128,
                          num_mel_bins=80, max_source_positions=WINDOW_POSITIONS, dropout=0.0, attention_dropout=0.0,
                          activation_dropout=0.0),
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False),
        audio_token_id=vocab["[AUDIO]"])
    torch.manual_seed(5)
    model = VoxtralForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, vocab


def test_voxtral_checkpoint_loads_with_transformers_logits_and_one_step_loss(tmp_path):
    """Voxtral: its projector (4 frames stacked, Linear-GELU-Linear, no biases) becomes the mlp adapter with names
    mapped; every utterance gets the whole window's 10 slots, as Voxtral's processor gives it."""
    from transformers import WhisperFeatureExtractor

    from headrace.training.speech.checkpoints import main
    from headrace.training.speech.job import SALM_INPUTS, SpeechBatches, load_salm

    reference, vocab = save_voxtral(tmp_path / "voxtral")
    assert main([str(tmp_path / "voxtral"), str(tmp_path / "salm")]) == 0
    model, speech = load_salm(tmp_path / "salm")
    assert speech.prompt == "[INST][BEGIN_AUDIO]<|audio|>[/INST]"
    assert (speech.encoder.kind, speech.adapter.kind, speech.adapter.subsampling) == ("voxtral", "mlp", 4)
    raw = audio_batches(1, rows=3, seed=4)[0]
    batch = SpeechBatches([], model, speech, str(tmp_path / "salm" / "hf")).convert(raw)
    assert batch["audio_mask"].sum(1).tolist() == [WINDOW_POSITIONS // 4] * 3
    waves = [w[:n].numpy() for w, n in zip(raw["audio"], raw["audio_lens"])]
    feats = WhisperFeatureExtractor(feature_size=80)(waves, sampling_rate=16000, max_length=2 * WINDOW_POSITIONS * 160,
                                                     return_tensors="pt")["input_features"]
    labels = torch.full_like(batch["labels"], -100)
    labels[:, 1:] = batch["labels"][:, :-1]
    hf_inputs = {"input_ids": batch["input_ids"].masked_fill(batch["audio_mask"], vocab["[AUDIO]"]),
                 "input_features": feats, "labels": labels}
    tokens = int((batch["labels"] != -100).sum())
    model.eval()
    with torch.no_grad():
        embeds = model.llm.embed(batch["input_ids"], model.encode(batch["audio"], batch["audio_lens"]),
                                 batch["audio_mask"])
        ours = model.llm.causal_lm(inputs_embeds=embeds, position_ids=batch["position_ids"]).logits
        torch.testing.assert_close(ours, reference(**hf_inputs).logits, rtol=1e-4, atol=1e-5)
    assert_sgd_steps_match(model, reference, {k: batch[k] for k in SALM_INPUTS}, hf_inputs, tokens)
