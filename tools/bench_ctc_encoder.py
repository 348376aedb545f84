"""The CTC stage's step cost by encoder: the recipe's FastConformer (``configs/speech_ctc.yaml``'s, through the
CTC kind's own model) beside the issue's reference, two stride-2 convolutions + a 3-layer bidirectional GRU
(~3.3M parameters, built here only as the yardstick), on the same batch of log-mel features at 4x time
subsampling and the same CTC loss over characters. Rounds interleave A B A B; per step it reports wall and this
process's CPU seconds (on a shared machine the CPU seconds are the comparable figure).

    OMP_NUM_THREADS=2 python -m tools.bench_ctc_encoder --rounds 4 --seconds 60
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from headrace.kernels.log_mel import LogMelConfig, nemo_log_mel
from headrace.training.config.load import load_job_config
from headrace.training.speech.ctc import CHARS, CTCModel
from headrace.training.speech.encoders import front_end
from headrace.training.speech.model import ctc_targets_loss_sum


class ConvBiGRU(nn.Module):
    """The issue's reference: 2 x (Conv2d 3x3 stride 2, GELU) over [mels, time], then 3 BiGRU layers, a Linear."""

    def __init__(self, n_mels: int, units: int, channels: int = 32, hidden: int = 224):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, channels, 3, 2, 1), nn.GELU(), nn.Conv2d(channels, channels, 3, 2, 1), nn.GELU()
        )
        self.gru = nn.GRU(channels * ((n_mels + 3) // 4), hidden, num_layers=3, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * hidden, units + 1)

    def forward(self, feats: torch.Tensor, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.conv(feats[:, None])  # [B, C, mels/4, T/4]
        x = x.permute(0, 3, 1, 2).flatten(2)
        out, _ = self.gru(x)
        return self.head(out), (frames + 3) // 4


def batch(seconds: float, rows: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = int(seconds / rows * 16000)
    audio = 0.1 * torch.randn(rows, n, generator=g)
    labels = torch.randint(0, len(CHARS), (rows, int(seconds / rows * 14)), generator=g)
    return {"audio": audio, "audio_lens": torch.full((rows,), n), "labels": labels}


def fastconformer(config: str) -> CTCModel:
    cfg = load_job_config(config, [])
    speech = cfg.model.speech
    front = front_end(speech.encoder.kind, speech.features)
    enc_config = front.config(speech.encoder)
    model = CTCModel(front.build(enc_config), nn.Linear(enc_config.hidden_size, len(CHARS) + 1), speech, front)
    front.initialize(model.encoder)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench_ctc_encoder",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", default="configs/speech_ctc.yaml")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="steps per model per round")
    parser.add_argument("--seconds", type=float, default=60.0, help="audio per batch")
    parser.add_argument("--rows", type=int, default=6)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    conformer = fastconformer(args.config)
    gru = ConvBiGRU(80, len(CHARS))
    b = batch(args.seconds, args.rows)
    feats, frames = nemo_log_mel(b["audio"], b["audio_lens"], LogMelConfig(kind="nemo"))
    lengths = torch.full((args.rows,), b["labels"].shape[1])

    def conformer_loss():
        return conformer(b["audio"], b["audio_lens"], b["labels"])

    def gru_loss():
        logits, out_frames = gru(feats, frames)
        return ctc_targets_loss_sum(logits, out_frames, b["labels"], lengths)

    models = {"fastconformer": (conformer, conformer_loss), "conv_bigru": (gru, gru_loss)}
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, (m, _) in models.items()}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in models}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, (_, loss_fn) in models.items():
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                loss = loss_fn()
                loss.backward()
                optims[name].step()
                optims[name].zero_grad()
            if round_:
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                times[name].append((wall / args.steps, cpu / args.steps))
    out = {}
    for name, (model, _) in models.items():
        walls, cpus = zip(*times[name])
        out[name] = {
            "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
            "wall_s_per_step": round(sorted(walls)[len(walls) // 2], 2),
            "cpu_s_per_step": round(sorted(cpus)[len(cpus) // 2], 2),
        }
    out["cpu_ratio_fastconformer_over_bigru"] = round(
        out["fastconformer"]["cpu_s_per_step"] / out["conv_bigru"]["cpu_s_per_step"], 2
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
