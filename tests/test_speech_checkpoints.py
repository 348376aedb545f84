"""Released speech-LLM checkpoints as SALM starting points: a tiny random Qwen2-Audio and a tiny random Voxtral,
built and saved by transformers, converted (``python -m headrace.training.speech.checkpoints``) and loaded by
``load_salm``, give transformers' own logits on the same audio and text, and one fine-tuning step on both
gives the same loss; the Qwen2-Audio checkpoint directory also trains in place through the trainer (no
conversion), matching transformers' loss before and after one AdamW step, and settings that contradict it fail
in one line."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.dist.speech_common import WORDS, audio_batches, salm_job, write_audio_dataset

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
    "{% if c['type'] == 'audio' %}Audio: <|audio_bos|><|AUDIO|><|audio_eos|>{% else %}{{ c['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
WINDOW_POSITIONS = 40  # 80 mel frames = 0.8 s (the test audio is 0.2..0.7 s)


def word_level_tokenizer(vocab: dict[str, int], eos: str, specials: list[str]):
    """A whitespace word-level transformers tokenizer over ``vocab`` (``eos`` also pads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, pad_token=eos, additional_special_tokens=specials
    )


def save_qwen2_audio(path: Path):
    """A tiny random Qwen2-Audio (transformers' model, config and a chat tokenizer) saved as a checkpoint."""
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    vocab = {w: i for i, w in enumerate(["[UNK]", *SPECIAL, "system", "user", "assistant", "Audio", ":", *WORDS])}
    tokenizer = word_level_tokenizer(vocab, "<|im_end|>", SPECIAL[1:])  # a chat checkpoint: answers end its turn
    tokenizer.chat_template = CHAT_TEMPLATE
    config = Qwen2AudioConfig(
        audio_config=dict(
            d_model=32,
            encoder_layers=2,
            encoder_attention_heads=4,
            encoder_ffn_dim=64,
            num_mel_bins=80,
            max_source_positions=WINDOW_POSITIONS,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
        ),
        text_config=dict(
            model_type="qwen2",
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
        audio_token_id=vocab["<|AUDIO|>"],
    )
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
    feats = WhisperFeatureExtractor(feature_size=80)(
        waves,
        sampling_rate=16000,
        max_length=2 * WINDOW_POSITIONS * 160,
        return_attention_mask=True,
        return_tensors="pt",
    )
    ids = batch["input_ids"].masked_fill(batch["audio_mask"], audio_token_id)
    labels = torch.full_like(batch["labels"], -100)
    labels[:, 1:] = batch["labels"][:, :-1]
    return {
        "input_ids": ids,
        "input_features": feats["input_features"],
        "feature_attention_mask": feats["attention_mask"],
        "labels": labels,
    }


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
    assert speech.prompt == (
        "<|im_start|>user\nAudio: <|audio_bos|><|audio|><|audio_eos|><|im_end|>\n<|im_start|>assistant\n"
    )
    assert speech.encoder.kind == "qwen2_audio" and speech.adapter.kind == "linear"
    raw = audio_batches(1, rows=3, seed=4)[0]
    assert len(set(raw["audio_lens"].tolist())) == 3
    batch = SpeechBatches([], model, speech, str(tmp_path / "salm" / "hf")).convert(raw)
    assert batch["input_ids"][0, :5].tolist() == [
        vocab[t] for t in ("<|im_start|>", "user", "Audio", ":", "<|audio_bos|>")
    ]
    # each answer ends the assistant turn with the tokenizer's eos_token, as the chat template closes a turn
    assert speech.answer_end == "<|im_end|>"
    assert [row[row != -100][-1] for row in batch["labels"]] == [vocab["<|im_end|>"]] * 3
    hf_inputs = transformers_inputs(raw, batch, vocab["<|AUDIO|>"])
    # the slots are the frames transformers' processor would expand <|AUDIO|> into
    mel = hf_inputs["feature_attention_mask"].sum(1)
    assert batch["audio_mask"].sum(1).tolist() == (((mel - 1) // 2 + 1 - 2) // 2 + 1).tolist()

    def ours():
        embeds = model.llm.embed(
            batch["input_ids"], model.encode(batch["audio"], batch["audio_lens"]), batch["audio_mask"]
        )
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
        audio_config=dict(
            hidden_size=32,
            encoder_layers=2,
            encoder_attention_heads=4,
            intermediate_size=128,
            num_mel_bins=80,
            max_source_positions=WINDOW_POSITIONS,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
        ),
        text_config=dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
        audio_token_id=vocab["[AUDIO]"],
    )
    torch.manual_seed(5)
    model = VoxtralForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, vocab


def test_voxtral_checkpoint_loads_with_transformers_logits_and_one_step_loss(tmp_path):
    """Voxtral: its projector (4 frames stacked, Linear-GELU-Linear, no biases) becomes the mlp adapter with names
    mapped; every utterance gets the whole window's 10 slots, as Voxtral's processor gives it. Read in place
    (``load_salm`` on the checkpoint directory) it gives the same logits."""
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
    feats = WhisperFeatureExtractor(feature_size=80)(
        waves, sampling_rate=16000, max_length=2 * WINDOW_POSITIONS * 160, return_tensors="pt"
    )["input_features"]
    labels = torch.full_like(batch["labels"], -100)
    labels[:, 1:] = batch["labels"][:, :-1]
    hf_inputs = {
        "input_ids": batch["input_ids"].masked_fill(batch["audio_mask"], vocab["[AUDIO]"]),
        "input_features": feats,
        "labels": labels,
    }
    tokens = int((batch["labels"] != -100).sum())
    in_place, in_place_speech = load_salm(tmp_path / "voxtral")  # the same mapping, read from the checkpoint itself
    assert in_place_speech.adapter == dataclasses.replace(speech.adapter, pretrained_path=str(tmp_path / "voxtral"))
    model.eval()
    with torch.no_grad():
        for salm in (model, in_place):
            embeds = salm.llm.embed(
                batch["input_ids"], salm.encode(batch["audio"], batch["audio_lens"]), batch["audio_mask"]
            )
            ours = salm.llm.causal_lm(inputs_embeds=embeds, position_ids=batch["position_ids"]).logits
            torch.testing.assert_close(ours, reference(**hf_inputs).logits, rtol=1e-4, atol=1e-5)
    assert_sgd_steps_match(model, reference, {k: batch[k] for k in SALM_INPUTS}, hf_inputs, tokens)


def qwen2_audio_job(tmp_path: Path, speech: dict | None = None, **model) -> dict:
    """A SALM job (``salm_job``'s data, optimizer and trainer settings, Whisper's 0.8 s window) whose model is the
    Qwen2-Audio checkpoint directory ``tmp_path/qwen2-audio`` in place, with ``speech`` as its speech section."""
    from headrace.config import to_dict

    raw = to_dict(
        salm_job(tmp_path, "in-place", encoder="whisper", data_path=str(tmp_path / "utterances"), precision="fp32")
    )
    raw["model"] = dict(kind="salm", pretrained_path=str(tmp_path / "qwen2-audio"), speech=speech or {}, **model)
    return raw


def test_qwen2_audio_checkpoint_trains_in_place_with_transformers_losses(tmp_path, process_group):
    """``model.pretrained_path: <a Qwen2-Audio checkpoint dir>`` and an empty speech section, through the trainer on
    FLAC shards: its step-1 loss is transformers' loss on the loader's first batch, and its step-2 loss is
    transformers' loss on the second batch after the same AdamW step of transformers' model (so every part was
    read under its own name and trained alike); the SALM read in place gives transformers' logits; the export
    carries the checkpoint's prompt; the checkpoint eval of the job as written gives the val loss the trainer
    logged; the speech eval of the checkpoint as it is gives transformers' loss."""
    from headrace.dataio import build_loader
    from headrace.training.components.optim import build_optimizer
    from headrace.training.config.load import load_job_config
    from headrace.training.estimate_batch import main as estimate_batch
    from headrace.training.eval import evaluate_checkpoint
    from headrace.training.speech.eval import eval_loader, evaluate
    from headrace.training.speech.job import SpeechBatches, load_salm
    from headrace.training.train import train

    reference, vocab = save_qwen2_audio(tmp_path / "qwen2-audio")
    fresh = copy.deepcopy(reference)  # the checkpoint as saved (``reference`` takes the AdamW step)
    write_audio_dataset(tmp_path / "utterances")
    raw = qwen2_audio_job(tmp_path)
    raw["data"]["val"] = dict(datasets=[dict(path=str(tmp_path / "utterances"))])
    raw["trainer"]["eval_every"] = 3
    cfg = load_job_config(None, base=raw)
    history = train(cfg)
    assert [r["step"] for r in history] == [1, 2, 3] and all(torch.isfinite(torch.tensor(r["loss"])) for r in history)
    # python -m headrace.training.eval's path on the run's last checkpoint, from the job as written: the val loss
    # the trainer logged at that step
    (logged,) = [r for r in map(json.loads, open(tmp_path / "in-place" / "metrics.jsonl")) if "val_loss" in r]
    figures = evaluate_checkpoint(cfg, str(tmp_path / "in-place" / "checkpoints"))
    assert figures["val_loss"] == pytest.approx(logged["val_loss"], rel=1e-6) and figures["val_docs"] == 8

    model, speech = load_salm(tmp_path / "qwen2-audio")  # the same mapping, read in place for decoding
    assert speech.prompt == (
        "<|im_start|>user\nAudio: <|audio_bos|><|audio|><|audio_eos|><|im_end|>\n<|im_start|>assistant\n"
    )
    to_steps = SpeechBatches([], model, speech, str(tmp_path / "qwen2-audio"))
    raws = [raw for raw, _ in zip(build_loader(cfg.data, 0, 1), range(2))]  # what the trainer's loader gave it
    batches = [to_steps.convert(raw) for raw in raws]
    hf_inputs = [transformers_inputs(raw, batch, vocab["<|AUDIO|>"]) for raw, batch in zip(raws, batches)]
    with torch.no_grad():
        embeds = model.llm.embed(
            batches[0]["input_ids"],
            model.encode(batches[0]["audio"], batches[0]["audio_lens"]),
            batches[0]["audio_mask"],
        )
        ours = model.llm.causal_lm(inputs_embeds=embeds, position_ids=batches[0]["position_ids"]).logits
        torch.testing.assert_close(ours, reference(**hf_inputs[0]).logits, rtol=1e-4, atol=1e-5)
    optimizer = build_optimizer(reference, cfg.optim, announce=False)  # step 1's lr is optim.lr (one warmup step)
    loss = reference(**hf_inputs[0]).loss
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = reference(**hf_inputs[1]).loss
    assert history[0]["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert history[1]["loss"] == pytest.approx(float(after), rel=1e-5)
    assert abs(float(after) - loss.item()) > 1e-3  # the step moved the model (the second figure is not the first's)
    exported, exported_speech = load_salm(tmp_path / "in-place")
    assert exported_speech.prompt == speech.prompt and exported_speech.encoder.kind == "qwen2_audio"

    # the batch estimator on the same job (its model read in place): one bucket measured, exit 0
    job = tmp_path / "job.yaml"
    raw = qwen2_audio_job(tmp_path)
    raw["data"]["bucketing"] = dict(bucket_duration_bins=[[0.8, 8]], max_duration=2.0, max_tokens=64)
    job.write_text(yaml.safe_dump(raw))
    assert estimate_batch(["--config", str(job), "--budget-gib", "0.001", "--limit", "8"]) == 0

    # the eval CLI's evaluate() on the checkpoint as it is (a zero-shot baseline): over every utterance of the
    # shards, its answer loss is transformers' (losses are per utterance, so the batching does not matter)
    result = evaluate(
        str(tmp_path / "qwen2-audio"),
        str(tmp_path / "utterances"),
        split="train",
        batch_duration=60.0,
        out=None,
        max_new_tokens=2,
    )
    sums = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for raw in eval_loader(str(tmp_path / "utterances"), "train", 16000, 60.0):
            hf = transformers_inputs(raw, to_steps.convert(raw), vocab["<|AUDIO|>"])
            tokens = int((hf["labels"] != -100).sum())
            sums += torch.tensor([float(fresh(**hf).loss) * tokens, tokens], dtype=torch.float64)
    assert result["utterances"] == 8 and result["loss"] == pytest.approx(float(sums[0] / sums[1]), rel=1e-5)


def test_qwen2_audio_checkpoint_refuses_contradicting_settings(tmp_path):
    """The checkpoint's encoder kind, adapter, tokenizer and features are its own: another value of any is one
    ConfigError naming the key, from the trainer before anything is built; ``freeze`` stays the user's."""
    from headrace.config import ConfigError
    from headrace.training.config.load import load_job_config
    from headrace.training.speech.checkpoints import with_speech_llm
    from headrace.training.train import train

    save_qwen2_audio(tmp_path / "qwen2-audio")
    (tmp_path / "llm").mkdir()  # a plain LLM's directory: no encoder to take
    (tmp_path / "llm" / "config.json").write_text('{"model_type": "llama"}')
    for model, error in (
        (
            dict(speech=dict(encoder=dict(kind="whisper"))),
            r"^model.speech.encoder.kind: 'whisper' contradicts model.pretrained_path .*qwen2-audio, a qwen2_audio "
            r"checkpoint whose encoder has kind 'qwen2_audio'; leave it unset$",
        ),
        (dict(speech=dict(adapter=dict(subsampling=2))), r"^model.speech.adapter.subsampling: 2 contradicts"),
        (dict(speech=dict(adapter=dict(kind="mlp"))), r"^model.speech.adapter.kind: 'mlp' contradicts"),
        (
            dict(speech=dict(encoder=dict(kind="qwen2_audio", pretrained_path=str(tmp_path)))),
            r"^model.speech.encoder.pretrained_path: .* contradicts",
        ),
        (dict(speech=dict(features=dict(n_mels=80))), r"^model.speech: features: a whisper encoder takes Whisper's"),
        (dict(tokenizer=str(tmp_path / "tokenizer.json")), r"^model.tokenizer: .* contradicts model.pretrained_path"),
        (
            dict(pretrained_path=str(tmp_path / "llm")),
            r"^model.speech.encoder: set one of config / config_path / pretrained_path \(model.pretrained_path .* "
            r"is not the checkpoint",
        ),
    ):
        raw = qwen2_audio_job(tmp_path)
        raw["model"].update(model, speech=model.get("speech", {}))
        with pytest.raises(ConfigError, match=error):
            train(load_job_config(None, base=raw))
    raw = qwen2_audio_job(tmp_path)
    del raw["model"]["pretrained_path"]
    raw["model"]["config"] = {"model_type": "llama"}
    with pytest.raises(ConfigError, match=r"^model.speech.encoder: set one of .* or start from a speech LLM's"):
        load_job_config(None, base=raw)
    cfg = with_speech_llm(load_job_config(None, base=qwen2_audio_job(tmp_path, dict(encoder=dict(freeze=True)))))
    assert cfg.model.speech.encoder.freeze and cfg.model.speech.encoder.kind == "qwen2_audio"
    assert with_speech_llm(cfg) == cfg  # a filled-in job (the run's config.yaml) reads back unchanged
