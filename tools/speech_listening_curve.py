"""When does a SALM start to listen? The listening ratio (``headrace.training.speech.listening``) against the step on a
task only the audio can solve, at several learning rates; writes a JSON of the curves and a matplotlib plot.

    python -m tools.speech_listening_curve --lrs 3e-3 1e-2 --steps 150 --out docs/speech-listening-curve.png

The task: 12 utterances of one word each whose tone says which word (4 words, 4 tones), all of one length
(0.375 s), so that neither the prompt position nor the audio length gives the word away. The SALM is tiny and
from scratch (a 2-layer FastConformer of width 32, 2x frame stacking, a 2-layer Llama of width 32 over a
word-level vocabulary), trained full-batch with AdamW; every 10 steps it is evaluated (eval mode) on the
same utterances with their own audio and with ``mismatched_audio``. A model that has learned only the word
prior has loss ~log(4)/2 per answer token (word + eos) either way: ratio 1. Cost: about 0.3 s per step on
one core.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

WORDS = ["alpha", "bravo", "charlie", "delta"]
TONES = [250.0, 700.0, 1800.0, 4000.0]
LLM = dict(
    model_type="llama",
    vocab_size=16,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
ENCODER = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    subsampling_factor=4,
    subsampling_conv_channels=8,
    conv_kernel_size=3,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
)


def tone_batch(count: int = 12, samples: int = 6000) -> dict:
    from headrace.dataio.batching.bucketing import collate_audio

    rng = np.random.default_rng(0)
    t = np.arange(samples) / 16000
    rows = [
        {
            "audio": (0.3 * np.sin(2 * np.pi * TONES[i % 4] * t) + 0.02 * rng.standard_normal(samples)).astype(
                np.float32
            ),
            "text": WORDS[i % 4],
            "__key__": f"u{i}",
        }
        for i in range(count)
    ]
    return collate_audio(rows, tokens_key=None)


def curve(lr: float, steps: int, workdir: Path) -> list[dict]:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from headrace.training.config.job_config import ModelConfig
    from headrace.training.models.build import build_hf_config
    from headrace.training.config.speech import EncoderConfig, SpeechConfig
    from headrace.training.speech.job import SALM_INPUTS, SpeechBatches, salm_loss_sum
    from headrace.training.speech.listening import with_mismatched_audio
    from headrace.training.speech.model import build_meta_salm, materialize_salm

    vocab = {w: i for i, w in enumerate(["<|pad|>", "<|eos|>", "[UNK]", "transcribe", "transcript", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(workdir / "tokenizer.json"))
    speech = SpeechConfig(encoder=EncoderConfig(config=ENCODER), prompt="transcribe <|audio|> transcript")
    speech.features.n_mels, speech.features.n_fft, speech.features.win_length = 16, 256, 200
    torch.manual_seed(0)
    model = build_meta_salm(build_hf_config(ModelConfig(config=dict(LLM))), speech)
    materialize_salm(model, torch.device("cpu"), None)
    batch = SpeechBatches([], model, speech, str(workdir / "tokenizer.json")).convert(tone_batch())
    batch = {k: batch[k] for k in SALM_INPUTS}
    tokens = int((batch["labels"] != -100).sum())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    points = []
    for step in range(1, steps + 1):
        model.train()
        loss = salm_loss_sum(model, batch, False) / tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step % 10 == 0:
            model.eval()
            with torch.no_grad():
                own = float(salm_loss_sum(model, batch, False)) / tokens
                other = float(with_mismatched_audio(salm_loss_sum)(model, batch, False)) / tokens
            points.append(
                {
                    "step": step,
                    "train_loss": float(loss),
                    "loss": own,
                    "mismatched_loss": other,
                    "listening_ratio": own / other,
                }
            )
            print(f"lr {lr:g} step {step}: loss {own:.3f}, mismatched {other:.3f}, ratio {own / other:.3f}", flush=True)
    return points


def plot(curves: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for lr, points in curves.items():
        steps = [p["step"] for p in points]
        (line,) = left.plot(steps, [p["loss"] for p in points], label=f"own audio, lr {lr}")
        left.plot(
            steps,
            [p["mismatched_loss"] for p in points],
            "--",
            color=line.get_color(),
            label=f"mismatched audio, lr {lr}",
        )
        right.plot(steps, [p["listening_ratio"] for p in points], label=f"lr {lr}")
    left.set(xlabel="step", ylabel="answer loss (nats/token)", title="answer loss")
    right.set(xlabel="step", ylabel="own / mismatched", title="listening ratio", ylim=(0, 1.1))
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.speech_listening_curve", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", type=Path, default=Path("docs/speech-listening-curve.png"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        curves = {f"{lr:g}": curve(lr, args.steps, Path(tmp)) for lr in args.lrs}
    args.out.with_suffix(".json").write_text(json.dumps(curves, indent=1))
    plot(curves, args.out)
    print(f"curves -> {args.out.with_suffix('.json')}, plot -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
