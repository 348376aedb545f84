"""The learning curve of a SALM run from its ``metrics.jsonl``: training loss, the val split's answer loss with
its own and with mismatched audio, the listening ratio, and the WER of the in-training decodes
(``model.speech.eval_every``), against the step; of a CTC stage (``model.kind: ctc``): its losses, WER and CER.
Prints a Markdown table (one row per validation step, the columns the run has) and writes a matplotlib plot.
Given the folder of a ``tools/speech_recipe.sh`` run, one table per speech stage (``ctc``, ``salm``) and one plot
row each.

    python -m tools.speech_recipe_curve runs/speech_asr_recipe/metrics.jsonl --out docs/speech-asr-recipe.png
    python -m tools.speech_recipe_curve runs/recipe --out docs/speech-recipe.png

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
            points.append(
                {
                    "step": r["step"],
                    "minutes": r.get("minutes"),
                    "train_loss": sum(window) / len(window) if window else None,
                    "val_loss": r["val_loss"],
                    "val_mismatched_loss": r.get("val_mismatched_loss"),
                    "val_listening_ratio": r.get("val_listening_ratio"),
                    "val_wer": wer.get(r["step"]),
                    "val_cer": r.get("val_cer"),
                }
            )
            window = []
    return points


COLUMNS = (
    ("minutes", "minutes"),  # wall time since the stage began (validation records carry it)
    ("train_loss", "train loss"),
    ("val_loss", "val loss (own audio)"),
    ("val_mismatched_loss", "val loss (mismatched audio)"),
    ("val_listening_ratio", "listening ratio"),
    ("val_wer", "WER"),
    ("val_cer", "CER"),
)


def table(points: list[dict]) -> str:
    """Markdown: the step and every column of ``COLUMNS`` some point has."""
    columns = [(key, title) for key, title in COLUMNS if any(p[key] is not None for p in points)]
    rows = ["| step | " + " | ".join(title for _, title in columns) + " |", "| ---: " * (len(columns) + 1) + "|"]
    rows += [
        f"| {p['step']} | " + " | ".join("-" if p[key] is None else f"{p[key]:.3f}" for key, _ in columns) + " |"
        for p in points
    ]
    return "\n".join(rows)


def stage_curves(path: Path) -> dict[str, list[dict]]:
    """``{name: points}``: a metrics.jsonl's own, or each speech stage's of a recipe folder."""
    if path.is_dir():
        return {
            stage: read_curve(path / stage / "metrics.jsonl")
            for stage in ("llm", "ctc", "salm")
            if (path / stage / "metrics.jsonl").is_file()
        }
    return {path.parent.name: read_curve(path)}


def plot(curves: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(curves), 3, figsize=(13, 3.6 * len(curves)), squeeze=False)
    for (name, points), row in zip(curves.items(), axes):
        plot_stage(name, points, *row)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_stage(name: str, points: list[dict], losses, ratio, wer) -> None:
    steps = [p["step"] for p in points]
    losses.plot(steps, [p["train_loss"] for p in points], label="train")
    losses.plot(steps, [p["val_loss"] for p in points], label="val, own audio")
    losses.plot(steps, [p["val_mismatched_loss"] for p in points], "--", label="val, mismatched audio")
    ratio.plot(steps, [p["val_listening_ratio"] for p in points])
    decoded = [p for p in points if p["val_wer"] is not None]
    wer.plot([p["step"] for p in decoded], [p["val_wer"] for p in decoded], "o-", label="WER")
    if any(p["val_cer"] is not None for p in points):
        wer.plot(steps, [p["val_cer"] for p in points], "s--", label="CER")
        wer.legend(fontsize=7)
    losses.set(xlabel="step", ylabel="nats per answer token / unit", title=f"{name}: loss")
    ratio.set(xlabel="step", ylabel="own / mismatched", title=f"{name}: listening ratio", ylim=(0, 1.1))
    wer.set(xlabel="step", ylabel="error rate", title=f"{name}: held-out sentences", ylim=(0, None))
    losses.legend(fontsize=7)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.speech_recipe_curve", description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", type=Path, help="a SALM or CTC run's metrics.jsonl, or a speech recipe's folder")
    parser.add_argument("--out", type=Path, default=Path("docs/speech-asr-recipe.png"))
    args = parser.parse_args(argv)
    curves = {name: points for name, points in stage_curves(args.metrics).items() if points}
    if not curves:
        parser.error(f"{args.metrics}: no validation records yet (trainer.eval_every)")
    for name, points in curves.items():
        print(f"{name}:\n{table(points)}\n")
    plot(curves, args.out)
    print(f"plot -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
