"""The speech recipe's one command (``tools/speech_recipe.sh``) on a tiny manifest: every stage runs a few steps and
the summary has its fields (not its quality: that is BENCHMARKS.md's "Speech LLM" section)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from tests.dist.speech_common import WORDS

from tools.speech_recipe import is_val, main  # noqa: E402


def write_manifest(root: Path, train: int = 5, val: int = 2) -> Path:
    """A NeMo manifest of tone utterances with word transcripts (relative audio paths), ``val`` of them held out
    by the recipe's key-hash rule."""
    import soundfile

    rng = np.random.default_rng(0)
    (root / "audio").mkdir(parents=True)
    lines, counts, i = [], {"train": 0, "val": 0}, 0
    while counts["train"] < train or counts["val"] < val:
        name = f"audio/u{i:03d}.flac"
        i += 1
        part = "val" if is_val(name) else "train"
        if counts[part] >= (val if part == "val" else train):
            continue
        counts[part] += 1
        n = int(rng.integers(6000, 12000))
        wave = 0.3 * np.sin(2 * np.pi * rng.uniform(200, 900) * np.arange(n) / 16000)
        soundfile.write(str(root / name), wave.astype(np.float32), 16000, format="FLAC")
        text = " ".join(rng.choice(WORDS[:16], size=int(rng.integers(1, 4))))
        lines.append({"audio_filepath": name, "duration": n / 16000, "text": text})
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return manifest


def test_recipe_smoke_run_writes_the_summary(tmp_path, capsys):
    manifest = write_manifest(tmp_path / "corpus")
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": " ".join(WORDS[i : i + 6])}) + "\n" for i in range(12)))
    out = tmp_path / "run"
    assert (
        main(
            [
                "--manifest",
                str(manifest),
                "--out",
                str(out),
                "--text",
                str(text),
                "--minutes",
                "5",
                "--size",
                "tiny",
                "--max-steps",
                "2",
            ]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    summary = json.loads((out / "summary.json").read_text())
    assert printed == summary
    assert set(summary) == {"wer", "listening_ratio", "ctc_wer", "val_utterances", "train_minutes"}
    assert summary["val_utterances"] == 2
    for key in ("wer", "listening_ratio", "ctc_wer", "train_minutes"):
        assert math.isfinite(summary[key]) and summary[key] >= 0, summary
    for stage in ("llm", "ctc", "salm"):  # each stage's own run folder, its config beside it
        assert (out / stage / "config.yaml").is_file()
    assert (out / "ctc" / "encoder" / "model.safetensors").is_file()
    evaluated = [json.loads(line) for line in (out / "salm" / "eval-val.jsonl").read_text().splitlines()]
    held_out = {json.loads(line)["audio_filepath"] for line in manifest.read_text().splitlines()}
    # keyed as the manifest's own lines (relative to its folder), never the escaped absolute path the split wrote
    assert len(evaluated) == 2 and {f"{r['key']}.flac" for r in evaluated} <= held_out, evaluated
    decoded = [json.loads(line) for line in (out / "salm" / "metrics.jsonl").read_text().splitlines()]
    assert [r["val_wer_utterances"] for r in decoded if "val_wer" in r] == [2]  # the in-training decode of val


def test_recipe_refuses_a_missing_manifest(tmp_path, capsys):
    assert main(["--manifest", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "run")]) == 2
    assert "does not exist" in capsys.readouterr().err
