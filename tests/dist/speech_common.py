"""Shared pieces of the SALM tests: a tiny word tokenizer, a tiny SALM job, audio batches from the real
bucketed collate (``headrace.dataio.batching.bucketing.collate_audio``) with different audio and transcript lengths."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from headrace.dataio.batching.bucketing import collate_audio
from headrace.training.config.load import load_job_config

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "transcribe the audio transcript").split()
TINY_LLM = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                tie_word_embeddings=False, attention_dropout=0.0)
TINY_ENCODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    subsampling_factor=4, subsampling_conv_channels=8, conv_kernel_size=3, dropout=0.0,
                    attention_dropout=0.0, activation_dropout=0.0)
# Whisper's encoder with a 0.8 s window (max_source_positions 40 -> 80 mel frames): the test audio is 0.2..0.7 s
TINY_WHISPER = dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, num_mel_bins=80,
                    max_source_positions=40, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
SPEECH = dict(prompt="transcribe the audio <|audio|> transcript", features=dict(n_mels=16, n_fft=256,
              win_length=200, hop_length=160), adapter=dict(subsampling=2))


def save_tokenizer(path: Path) -> str:
    """A word-level tokenizer over ``WORDS`` plus ``<|eos|>`` / ``<|pad|>`` (ids < 64)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<|pad|>", "<|eos|>", "[UNK]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return str(path)


def salm_job(workdir: Path, name: str, *, init: Path | None = None, distributed: dict | None = None,
             grad_accum: int = 1, max_steps: int = 3, optim: dict | None = None, data_path: str = "unused",
             speech_extra: dict | None = None, encoder: str = "parakeet", **trainer):
    """A SALM job: from the exported ``init`` (LLM + encoder + adapter) or fresh inline configs; ``encoder``:
    parakeet (with ``SPEECH``'s features) or whisper (Whisper's own features)."""
    speech = dict(SPEECH, encoder=dict(
        kind=encoder, **(dict(config=TINY_WHISPER if encoder == "whisper" else TINY_ENCODER) if init is None
                         else dict(pretrained_path=str(init / "encoder")))))
    speech.update(speech_extra or {})
    if encoder == "whisper":
        del speech["features"]
    if init is not None:
        speech["adapter"] = dict(SPEECH["adapter"], pretrained_path=str(init / "adapter"))
    model = dict(kind="salm", tokenizer=str(workdir / "tokenizer.json"), speech=speech,
                 **(dict(config=TINY_LLM) if init is None else dict(pretrained_path=str(init / "hf"))))
    return load_job_config(None, base=dict(
        model=model, data=dict(datasets=[dict(path=data_path)], bucketing=dict(max_duration=2.0),
                               # whisper: nothing longer than its 0.8 s window reaches it
                               **(dict(decode=dict(max_duration=0.8)) if encoder == "whisper" else {})),
        distributed=distributed or dict(strategy="fsdp2"),
        # eps=1: AdamW's update is ~ lr * gradient (not lr * sign), so weights compared after training compare
        # gradients; the conv bias before the encoder's BatchNorm has a ~0 gradient that plain Adam would
        # blow up to +-lr from rounding noise.
        optim=optim or dict(lr=0.05, eps=1.0, warmup_steps=1, decay_steps=3, max_grad_norm=None,
                            weight_decay=0.1),
        trainer=dict(max_steps=max_steps, grad_accum=grad_accum, output_dir=str(workdir / name), **trainer),
        checkpoint=dict(interval=2, export_hf=True), logging=dict(console=False, tensorboard=False)))


def audio_batches(count: int, *, rows: int = 2, seed: int = 0) -> list[dict]:
    """``count`` collated audio batches: tones + noise of 0.2..0.7 s, transcripts of 1..5 words."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        samples = []
        for _ in range(rows):
            n = int(rng.integers(3200, 11200))
            t = np.arange(n) / 16000
            wave = 0.3 * np.sin(2 * np.pi * rng.uniform(150, 600) * t) + 0.05 * rng.standard_normal(n)
            text = " ".join(rng.choice(WORDS[:16], size=int(rng.integers(1, 6))))
            samples.append({"audio": wave.astype(np.float32), "text": text, "__key__": f"u{len(out)}"})
        out.append(collate_audio(samples, tokens_key=None))
    return out


def write_audio_dataset(root: Path, count: int = 8, seed: int = 1) -> Path:
    """An indexed shard directory of ``count`` FLAC utterances (16 kHz) with transcripts in ``.json``."""
    import io
    import json

    import soundfile
    import webdataset as wds
    from tests.loader_util import index_dir

    root.mkdir(parents=True, exist_ok=True)
    batch = audio_batches(1, rows=count, seed=seed)[0]
    with wds.TarWriter(str(root / "utt-000000.tar")) as w:
        for i, (wave, n, text) in enumerate(zip(batch["audio"], batch["audio_lens"], batch["text"])):
            buf = io.BytesIO()
            soundfile.write(buf, wave[:n].numpy(), 16000, format="FLAC")
            w.write({"__key__": f"u{i:04d}", "flac": buf.getvalue(), "json": json.dumps({"text": text}).encode()})
    index_dir(root)
    return root
