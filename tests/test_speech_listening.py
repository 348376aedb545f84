"""The listening signal (``headrace.training.speech.listening``): which audio each utterance gets in the mismatched pass,
and the ratio through the real entry points -- the trainer's validation (``val_listening_ratio`` in
metrics.jsonl) and ``python -m headrace.training.speech.eval`` -- ~1 for an untrained SALM, well below 1 for one trained
on a task only the audio can solve."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import REPO, child_env
from tests.dist.speech_common import WORDS, audio_batches, salm_job, save_tokenizer

from headrace.training.speech.listening import mismatched_audio, partner_rows, with_mismatched_audio
from tools.speech_recipe_curve import read_curve

TONES = {WORDS[0]: 250.0, WORDS[1]: 700.0, WORDS[2]: 1800.0, WORDS[3]: 4000.0}  # the word says the tone


def test_mismatched_audio_gives_each_row_another_rows_waveform_at_its_own_length():
    batch = audio_batches(1, rows=3, seed=4)[0]
    audio, lens = batch["audio"], batch["audio_lens"]
    assert len(set(lens.tolist())) == 3
    out = mismatched_audio(audio, lens)
    assert partner_rows(3).tolist() == [1, 2, 0]
    for i, j in enumerate(partner_rows(3).tolist()):
        n, m = int(lens[i]), int(lens[j])
        want = audio[j, :m].repeat(-(-n // m))[:n]  # the partner's waveform, repeated or cut to row i's length
        assert torch.equal(out[i, :n], want) and not out[i, n:].any()
        assert not torch.equal(out[i, :n], audio[i, :n])
    assert not mismatched_audio(audio[:1], lens[:1]).any()  # one utterance: silence


def test_mismatched_forward_keeps_the_token_layout(tmp_path):
    """The mismatched pass runs the same forward on the same rows: same text tokens, labels, slots and
    positions; only the audio differs."""
    from headrace.training.models.build import build_hf_config
    from headrace.training.speech.job import SpeechBatches
    from headrace.training.speech.model import build_meta_salm

    save_tokenizer(tmp_path / "tokenizer.json")
    cfg = salm_job(tmp_path, "unit")
    model = build_meta_salm(build_hf_config(cfg.model), cfg.model.speech)
    batch = SpeechBatches([], model, cfg.model.speech, cfg.model.tokenizer).convert(audio_batches(1, rows=3)[0])
    seen = []
    with_mismatched_audio(lambda model, b, autocast: seen.append(b))(None, batch, False)
    (got,) = seen
    for key in ("input_ids", "labels", "audio_mask", "position_ids", "audio_lens"):
        assert torch.equal(got[key], batch[key]), key
    assert torch.equal(got["audio"], mismatched_audio(batch["audio"], batch["audio_lens"]))


def write_tone_dataset(root: Path, count: int = 12) -> Path:
    """Utterances of one word whose tone says which word (``TONES``), all of one length: only the audio's content
    tells them apart (with lengths that differ, a model memorizes a word per length, i.e. per answer position)."""
    import soundfile
    import webdataset as wds
    from tests.loader_util import index_dir

    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    words = list(TONES)
    with wds.TarWriter(str(root / "utt-000000.tar")) as w:
        for i in range(count):
            word = words[i % len(words)]
            n = 6000
            t = np.arange(n) / 16000
            wave = 0.3 * np.sin(2 * np.pi * TONES[word] * t) + 0.02 * rng.standard_normal(n)
            buf = io.BytesIO()
            soundfile.write(buf, wave.astype(np.float32), 16000, format="FLAC")
            w.write({"__key__": f"u{i:04d}", "flac": buf.getvalue(), "json": json.dumps({"text": word}).encode()})
    index_dir(root)
    return root


def train_on_tones(tmp_path: Path, name: str, steps: int, lr: float, decode: bool = False) -> list[dict]:
    """The tiny SALM trained by the trainer on the tone dataset, validated on it at the last step (``decode``:
    also transcribed, ``model.speech.eval_every``); the records of metrics.jsonl."""
    from headrace.config import to_dict
    from headrace.training.config.load import load_job_config
    from headrace.training.train import train

    raw = to_dict(
        salm_job(
            tmp_path,
            name,
            data_path=str(tmp_path / "tones"),
            max_steps=steps,
            optim=dict(lr=lr, warmup_steps=1, weight_decay=0.0, max_grad_norm=1.0),
        )
    )
    raw["data"]["val"] = dict(datasets=[dict(path=str(tmp_path / "tones"))])
    raw["data"]["bucketing"]["max_duration"] = 8.0  # one batch of all 12
    raw["checkpoint"]["interval"] = 1000  # the export only
    raw["trainer"]["eval_every"] = steps
    if decode:
        raw["model"]["speech"] |= dict(eval_every=steps, eval_split="train")
    train(load_job_config(None, base=raw))
    return [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]


@pytest.fixture
def tone_workdir(tmp_path):
    save_tokenizer(tmp_path / "tokenizer.json")
    write_tone_dataset(tmp_path / "tones")
    return tmp_path


@pytest.mark.slow
def test_validation_listening_ratio_is_one_untrained_and_falls_when_the_model_listens(tone_workdir, process_group):
    """Through the trainer: after one step at lr 1e-9 (the random init) both passes give the same loss to ~1%;
    trained on the tones, the loss with the wrong tone is far higher. The mismatched pass counts the same
    utterances and tokens."""
    (untrained,) = [r for r in train_on_tones(tone_workdir, "untrained", 1, 1e-9) if "val_loss" in r]
    assert untrained["val_docs"] == 12 and untrained["val_tokens"] == 24  # one word + eos each
    ratio = untrained["val_loss"] / untrained["val_mismatched_loss"]
    assert untrained["val_listening_ratio"] == pytest.approx(ratio)
    assert abs(untrained["val_listening_ratio"] - 1) < 0.02, untrained
    (trained,) = [r for r in train_on_tones(tone_workdir, "trained", 150, 1e-2, decode=True) if "val_loss" in r]
    assert trained["val_listening_ratio"] < 0.5, trained
    assert trained["val_loss"] < 0.1 < 1.0 < trained["val_mismatched_loss"], trained
    # the recipe's curve tool reads the same run: one point, with the WER of the in-training decode
    (point,) = read_curve(tone_workdir / "trained" / "metrics.jsonl")
    assert point["step"] == 150 and point["val_listening_ratio"] == trained["val_listening_ratio"], point
    assert point["val_wer"] is not None and point["val_wer"] < 0.5, point

    # python -m headrace.training.speech.eval on the export prints the same figures over the same utterances
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "headrace.training.speech.eval",
            "--model",
            str(tone_workdir / "trained"),
            "--data",
            str(tone_workdir / "tones"),
            "--split",
            "train",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    assert "over 12 utterances" in line, line
    own = float(line.split("answer loss ")[1].split()[0])
    ratio = float(line.split("listening ratio ")[1].split(";")[0])
    # its own-audio loss is validation's (other batches, same utterances); the ratio is its own pairing's
    assert own == pytest.approx(trained["val_loss"], rel=1e-3) and ratio < 0.5, (line, trained)
