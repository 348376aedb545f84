"""The speech recipe's one command (``tools/speech_recipe.sh``) on a tiny manifest: every stage runs a few steps and
the summary has its fields (not its quality: that is BENCHMARKS.md's "Speech LLM" section)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

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
    assert set(summary) == {"wer", "listening_ratio", "ctc_wer", "val_utterances", "ended", "train_minutes"}
    assert 0 <= summary["ended"] <= summary["val_utterances"]
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


def test_every_preset_builds_valid_stage_jobs(tmp_path):
    """The gpu preset (tools/gpu_check.sh's speech_recipe part) and the cpu one give typed, valid jobs for every
    stage, bridge or not, whatever the SALM stage does with its LLM (a GPU run is gpu_check's; here the configs)."""
    from headrace.training.config.load import load_job_config
    from tools.speech_recipe import Recipe, ctc_job, llm_job, salm_job

    paths = {name: tmp_path / name for name in ("train", "val", "text", "text_val", "tokenizer")}
    paths.update(val_utterances=2, tokens_per_second=12.0, vocab_size=512)
    for size in ("gpu", "cpu"):
        for llm, bridge in (("trained", True), ("lora", True), ("frozen", False)):
            recipe = Recipe(manifest=tmp_path / "m.jsonl", out=tmp_path / "run", size=size, llm=llm, bridge=bridge)
            llm_cfg = load_job_config(None, base=llm_job(recipe, paths))
            ctc_cfg = load_job_config(None, base=ctc_job(recipe, paths))
            salm_cfg = load_job_config(None, base=salm_job(recipe, paths))
            assert llm_cfg.optim.schedule == ctc_cfg.optim.schedule == salm_cfg.optim.schedule == "minutes"
            assert ctc_cfg.model.ctc.units == ("tokens" if bridge else "chars")
            assert salm_cfg.model.speech.adapter.kind == ("ctc_bridge" if bridge else "mlp")
            assert salm_cfg.model.speech.freeze_llm == (llm == "frozen")
            assert (salm_cfg.peft is not None) == (llm == "lora")
            assert salm_cfg.model.speech.max_tokens_per_second == 12.0
            assert llm_cfg.model.config["vocab_size"] == 512 and llm_cfg.data.val is not None


def _bad_line(line: str):
    def edit(root: Path, manifest: Path) -> None:
        manifest.write_text(manifest.read_text() + line + "\n")

    return edit


def _out_shards(samples: int | None):
    def edit(root: Path, manifest: Path) -> None:
        from tests.loader_util import make_text_dataset

        folder = root / "run" / "shards" / "train"
        folder.mkdir(parents=True) if samples is None else make_text_dataset(folder, [samples])

    return edit


# (edit of the corpus folder and its manifest, extra arguments, words of the one line); {m}: the manifest, {run}: --out
REFUSALS = {
    "missing_manifest": (lambda r, m: m.unlink(), [], "{m}: does not exist"),
    "manifest_is_a_folder": (lambda r, m: (m.unlink(), m.mkdir()), [], "{m}: not a file (a folder)"),
    "bad_json_line": (_bad_line('{"audio_filepath": "a.flac",'), [], "{m}: line 8 is not JSON"),
    "non_object_line": (_bad_line("[1, 2]"), [], "{m}: line 8 is a JSON list, not an object"),
    "no_audio_filepath": (_bad_line('{"text": "x"}'), [], "{m}: line 8 has no string 'audio_filepath'"),
    "no_text": (_bad_line('{"audio_filepath": "audio/x.flac"}'), [], "{m}: line 8 has no string 'text'"),
    "out_is_a_file": (lambda r, m: (r / "run").write_text("x"), [], "--out {run}: not a folder"),
    "out_is_the_manifest": (lambda r, m: None, ["--out", "{m}"], "--out {m}: is the input {m}"),
    "minutes_0": (lambda r, m: None, ["--minutes", "0"], "--minutes 0.0: must be a finite number of minutes > 0"),
    "minutes_negative": (lambda r, m: None, ["--minutes", "-5"], "--minutes -5.0: must be a finite number"),
    "minutes_nan": (lambda r, m: None, ["--minutes", "nan"], "--minutes nan: must be a finite number"),
    "minutes_inf": (lambda r, m: None, ["--minutes", "inf"], "--minutes inf: must be a finite number"),
    "max_steps_0": (lambda r, m: None, ["--max-steps", "0"], "--max-steps 0: must be >= 1"),
    "shards_cut_short": (_out_shards(None), [], "{run}/shards/train is not a complete dataset"),
    "shards_of_other_inputs": (_out_shards(3), [], "{run}/shards/train holds 3 samples, these inputs give 5"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_recipe_refuses_its_inputs_first_in_one_line_exit_2(tmp_path, capsys, case):
    """Issue 46 item 11: every input the recipe cannot use is refused before any stage runs (nothing written but
    what the case made), one line, exit 2."""
    edit, extra, words = REFUSALS[case]
    manifest = write_manifest(tmp_path / "corpus")
    edit(tmp_path, manifest)
    before = sorted(p for p in tmp_path.rglob("*"))
    names = {"m": manifest, "run": tmp_path / "run"}
    argv = ["--manifest", str(manifest), "--out", str(tmp_path / "run"), "--size", "tiny"]
    assert main(argv + [a.format(**names) for a in extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and words.format(**names) in err, (words, err)
    assert sorted(p for p in tmp_path.rglob("*")) == before


def test_the_wrapper_reads_relative_paths_from_the_callers_folder(tmp_path):
    """``tools/speech_recipe.sh`` runs in the caller's folder: a relative --manifest is theirs (it used to be taken
    from the checkout and "did not exist"); a folder given as --manifest is named as one."""
    import subprocess

    from tests.helpers import REPO

    manifest = write_manifest(tmp_path / "corpus")
    (tmp_path / "only_val.jsonl").write_text(
        "".join(line + "\n" for line in manifest.read_text().splitlines() if is_val(json.loads(line)["audio_filepath"]))
    )
    script = str(REPO / "tools" / "speech_recipe.sh")
    for given, words in (("only_val.jsonl", "0 train / 2 val utterances"), ("corpus", "not a file (a folder)")):
        run = subprocess.run(
            ["bash", script, "--manifest", given, "--out", "run"], cwd=tmp_path, capture_output=True, text=True
        )
        assert run.returncode == 2 and f"error: --manifest {given}: " in run.stderr and words in run.stderr, run.stderr
        assert not (tmp_path / "run").exists()
