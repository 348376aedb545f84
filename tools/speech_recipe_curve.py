"""The learning curve of a SALM run from its ``metrics.jsonl``: training loss, the val split's answer loss with
its own and with mismatched audio, the listening ratio, and the WER of the in-training decodes
(``model.speech.eval_every``), against the step. Prints a Markdown table (one row per validation step) and
writes a matplotlib plot.

    python -m tools.speech_recipe_curve runs/speech_asr_recipe/metrics.jsonl --out docs/speech-asr-recipe.png

Training-loss values in the table are the mean of the log windows since the previous validation. Reads the
file only: the run may still be going.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_curve(metrics: Path) -> list[dict]:
    """One point per validation step: ``step``, ``train_loss`` (mean of the training records since the previous
    point), ``val_loss``, ``val_mismatched_loss``, ``val_listening_ratio``, and ``val_wer`` where that step decoded."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    wer = {r["step"]: r["val_wer"] for r in records if "val_wer" in r}
    points, window = [], []
    for r in records:
        if "loss" in r and "val_loss" not in r:
            window.append(r["loss"])
        elif "val_loss" in r:
            points.append({"step": r["step"], "train_loss": sum(window) / len(window) if window else None,
                           "val_loss": r["val_loss"], "val_mismatched_loss": r.get("val_mismatched_loss"),
                           "val_listening_ratio": r.get("val_listening_ratio"), "val_wer": wer.get(r["step"])})
            window = []
    return points


def table(points: list[dict]) -> str:
    def cell(value, fmt):
        return "-" if value is None else format(value, fmt)

    rows = ["| step | train loss | val loss (own audio) | val loss (mismatched audio) | listening ratio | WER |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    rows += [f"| {p['step']} | {cell(p['train_loss'], '.3f')} | {cell(p['val_loss'], '.3f')} | "
             f"{cell(p['val_mismatched_loss'], '.3f')} | {cell(p['val_listening_ratio'], '.3f')} | "
             f"{cell(p['val_wer'], '.3f')} |" for p in points]
    return "\n".join(rows)


def plot(points: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [p["step"] for p in points]
    fig, (losses, ratio, wer) = plt.subplots(1, 3, figsize=(13, 3.6))
    losses.plot(steps, [p["train_loss"] for p in points], label="train")
    losses.plot(steps, [p["val_loss"] for p in points], label="val, own audio")
    losses.plot(steps, [p["val_mismatched_loss"] for p in points], "--", label="val, mismatched audio")
    ratio.plot(steps, [p["val_listening_ratio"] for p in points])
    decoded = [p for p in points if p["val_wer"] is not None]
    wer.plot([p["step"] for p in decoded], [p["val_wer"] for p in decoded], "o-")
    losses.set(xlabel="step", ylabel="nats per answer token", title="loss")
    ratio.set(xlabel="step", ylabel="own / mismatched", title="listening ratio", ylim=(0, 1.1))
    wer.set(xlabel="step", ylabel="WER", title="WER, held-out sentences", ylim=(0, None))
    losses.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.speech_recipe_curve", description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", type=Path, help="a SALM run's metrics.jsonl")
    parser.add_argument("--out", type=Path, default=Path("docs/speech-asr-recipe.png"))
    args = parser.parse_args(argv)
    points = read_curve(args.metrics)
    if not points:
        parser.error(f"{args.metrics}: no validation records yet (trainer.eval_every)")
    print(table(points))
    plot(points, args.out)
    print(f"plot -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
