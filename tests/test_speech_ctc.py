"""The encoder-only CTC stage (``model.kind: ctc``, ``headrace.training.speech.ctc``) and the not-listening warning."""

from __future__ import annotations

import io
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.dist.speech_common import SPEECH, TINY_ENCODER, audio_batches, salm_job, save_tokenizer

from headrace.config import ConfigError  # noqa: E402
from headrace.kernels.loss import IGNORE_INDEX  # noqa: E402
from headrace.training.speech.ctc import CHARS, CTCBatches, Units, error_counts, greedy_ctc  # noqa: E402
from headrace.training.speech.listening import not_listening_warning  # noqa: E402
from headrace.training.speech.model import ctc_targets_loss_sum  # noqa: E402


def brute_force_ctc(log_probs: torch.Tensor, target: list[int], blank: int) -> float:
    """-log of the summed probability of every frame path that collapses to ``target`` (all V^T paths listed)."""
    total = 0.0
    for path in itertools.product(range(log_probs.shape[1]), repeat=log_probs.shape[0]):
        collapsed = [u for i, u in enumerate(path) if u != blank and (i == 0 or u != path[i - 1])]
        if collapsed == target:
            total += math.exp(sum(float(log_probs[t, u]) for t, u in enumerate(path)))
    return -math.log(total)


def test_ctc_loss_sum_equals_the_sum_over_alignments_by_hand():
    """Two utterances of 5 and 4 frames over 2 units + blank, targets [0, 0] (a repeat: needs a blank between)
    and [1]: the summed loss equals the brute-force sum over every frame path, and F.ctc_loss row by row."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 3, dtype=torch.float64)
    frames = torch.tensor([5, 4])
    labels = torch.tensor([[0, 0], [1, IGNORE_INDEX]])
    got = ctc_targets_loss_sum(logits, frames, labels.clamp(min=0), (labels != IGNORE_INDEX).sum(1))
    log_probs = logits.log_softmax(-1)
    by_hand = brute_force_ctc(log_probs[0, :5], [0, 0], 2) + brute_force_ctc(log_probs[1, :4], [1], 2)
    assert float(got) == pytest.approx(by_hand, rel=1e-6)
    per_row = sum(
        F.ctc_loss(log_probs[b, : frames[b]], torch.tensor(t), [int(frames[b])], [len(t)], blank=2, reduction="sum")
        for b, t in enumerate(([0, 0], [1]))
    )
    assert float(got) == pytest.approx(float(per_row), rel=1e-6)  # (the loss runs in fp32)


def test_greedy_decode_of_a_planted_alignment():
    """Frames planted as 'hh_e_ll_l_oo' + frames past the row's end: 'hello' (the blank keeps the two l's apart,
    repeats merge, padding frames are not read)."""
    blank = len(CHARS)
    path = [CHARS.index(c) if c != "_" else blank for c in "hh_e_ll_l_oo"]
    logits = torch.full((2, len(path) + 3, blank + 1), -5.0)
    for t, unit in enumerate(path):
        logits[0, t, unit] = 5.0
    logits[0, len(path) :, CHARS.index("x")] = 5.0  # past the first row's frames
    logits[1, :, blank] = 5.0
    logits[1, 2, CHARS.index("a")] = 9.0
    units = Units("chars", None)
    hyps = greedy_ctc(logits, torch.tensor([len(path), len(path) + 3]))
    assert [units.decode(h) for h in hyps] == ["hello", "a"]
    # WER / CER counts of those decodes against references
    assert error_counts(units, ["Hello!", "a b"], hyps) == [0 + 1, 1 + 2, 0 + 2, 5 + 3]


def test_ctc_batches_units_and_token_counts(tmp_path):
    """Characters of the normalized transcript (lower case, punctuation gone), or the tokenizer's pieces; labels
    padded with -100 so the step's token count is the units'."""
    batch = audio_batches(1, rows=2)[0]
    batch["text"] = ["Alpha, bravo!", "kilo"]
    out = CTCBatches([batch], Units("chars", None)).convert(batch)
    assert out["labels"][0].tolist() == [CHARS.index(c) for c in "alpha bravo"]
    assert out["labels"][1].tolist() == [CHARS.index(c) for c in "kilo"] + [IGNORE_INDEX] * 7
    assert torch.equal(out["audio"], batch["audio"])
    tokens = Units("tokens", save_tokenizer(tmp_path / "tokenizer.json"))
    out = CTCBatches([batch], tokens).convert({**batch, "text": ["alpha bravo", "kilo"]})
    assert tokens.decode([u for u in out["labels"][0].tolist() if u >= 0]) == "alpha bravo"
    assert int((out["labels"] != IGNORE_INDEX).sum()) == 3


def ctc_job(workdir: Path, data: Path, **over) -> dict:
    speech = {k: v for k, v in SPEECH.items() if k != "adapter"}
    return dict(
        model=dict(
            kind="ctc",
            speech=dict(
                speech,
                encoder=dict(kind="parakeet", config=TINY_ENCODER),
                spec_augment=dict(freq_masks=1, time_masks=1),
            ),
        ),
        data=dict(
            datasets=[dict(path=str(data))],
            val=dict(datasets=[dict(path=str(data))]),
            bucketing=dict(max_duration=4.0),
            num_workers=0,  # no fork from the suite's process (its other tests leave threads, e.g. moto's server)
        ),
        optim=dict(lr=3e-3, warmup_steps=1),
        trainer=dict(max_steps=3, eval_every=3, output_dir=str(workdir / "ctc"), **over),
        checkpoint=dict(interval=0),
        logging=dict(console=False, tensorboard=False),
    )


def write_speech_dataset(root: Path, texts: list[str], same_audio: bool = False) -> Path:
    """One shard of tone utterances with ``texts`` as transcripts (``same_audio``: one waveform for all)."""
    import soundfile
    import webdataset as wds
    from tests.loader_util import index_dir

    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    with wds.TarWriter(str(root / "utt-000000.tar")) as w:
        for i, text in enumerate(texts):
            n = 8000 if same_audio else int(rng.integers(4000, 9000))
            t = np.arange(n) / 16000
            wave = 0.3 * np.sin(2 * np.pi * (300.0 if same_audio else 200.0 + 150 * i) * t)
            buf = io.BytesIO()
            soundfile.write(buf, wave.astype(np.float32), 16000, format="FLAC")
            w.write({"__key__": f"u{i:04d}", "flac": buf.getvalue(), "json": json.dumps({"text": text}).encode()})
    index_dir(root)
    return root


def test_ctc_job_trains_validates_and_starts_a_salm_encoder(tmp_path, process_group):
    """Through the trainer: the loss falls, validation logs the CTC loss with WER and CER; the export's encoder/
    loads into a SALM as model.speech.encoder.pretrained_path (the same weights)."""
    from safetensors.torch import load_file

    from headrace.training.config.load import load_job_config
    from headrace.training.speech.job import build_salm
    from headrace.training.distributed.parallel_dims import ParallelDims
    from headrace.training.train import train

    data = write_speech_dataset(tmp_path / "speech", ["alpha", "bravo charlie", "delta", "echo foxtrot golf"])
    history = train(load_job_config(None, base=ctc_job(tmp_path, data, log_every=1)))
    losses = [r["loss"] for r in history if "loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    records = [json.loads(line) for line in open(tmp_path / "ctc" / "metrics.jsonl")]
    (val,) = [r for r in records if "val_loss" in r]
    assert val["val_docs"] == 4 and val["val_tokens"] == len("alphabravo charliedeltaecho foxtrot golf")
    assert 0 <= val["val_cer"] and 0 <= val["val_wer"] and math.isfinite(val["val_loss"])
    assert json.loads((tmp_path / "ctc" / "ctc.json").read_text())["units"] == "chars"

    save_tokenizer(tmp_path / "tokenizer.json")
    salm = salm_job(tmp_path, "salm", data_path=str(data))
    encoder = salm.model.speech.encoder
    encoder.config, encoder.pretrained_path = None, str(tmp_path / "ctc" / "encoder")
    dims = ParallelDims.from_config(salm.distributed, 1).build_meshes("cpu")
    model, _ = build_salm(salm, dims, torch.device("cpu"))
    saved = load_file(str(tmp_path / "ctc" / "encoder" / "model.safetensors"))
    for name, value in model.encoder.state_dict().items():
        assert torch.equal(value, saved[name]), name


def test_ctc_config_errors(tmp_path):
    from headrace.training.config.load import load_job_config
    from headrace.training.config.validate import check_config

    job = ctc_job(tmp_path, tmp_path)
    with pytest.raises(ConfigError, match="leave model.config unset"):
        check_config(load_job_config(None, base={**job, "model": {**job["model"], "config": {"model_type": "llama"}}}))
    with pytest.raises(ConfigError, match="model.speech is required with model.kind: salm or ctc"):
        check_config(load_job_config(None, base={**job, "model": {"kind": "ctc"}}))
    speech = {**job["model"]["speech"], "encoder": {}}
    with pytest.raises(ConfigError, match="model.kind: ctc trains the encoder alone"):
        check_config(load_job_config(None, base={**job, "model": {**job["model"], "speech": speech}}))
    with pytest.raises(ConfigError, match="model.ctc is for model.kind: ctc"):
        check_config(load_job_config(None, base={**job, "model": {"config": {"model_type": "llama"}, "ctc": {}}}))
    with pytest.raises(ValueError, match="units: tokens needs model.tokenizer"):
        Units("tokens", None)


def test_not_listening_warning_rule():
    assert not_listening_warning({"step": 99, "val_listening_ratio": 1.0}, 100) is None
    assert not_listening_warning({"step": 100, "val_loss": 1.0}, 100) is None  # a text job's record
    # issue 42's run: ratio 0.951 with WER 2.6 (transcript-like text unrelated to the audio) is warned
    line = not_listening_warning({"step": 200, "val_listening_ratio": 0.951}, 200)
    assert "step 200" in line and "not listening" in line and "kind: ctc_bridge" in line
    # a model that listens (the bridge runs' ratios, BENCHMARKS.md) is not
    assert not_listening_warning({"step": 200, "val_listening_ratio": 0.45}, 200) is None
    assert not_listening_warning({"step": 200, "val_listening_ratio": 0.79}, 200) is None


def test_a_salm_that_ignores_the_audio_is_warned_once(tmp_path, process_group, capsys):
    """Through the trainer: every utterance has the same audio, so the loss with another utterance's audio is the
    loss with its own (ratio 1.0): the warning comes at the first validation at or past the set step, once."""
    from headrace.config import to_dict
    from headrace.training.config.load import load_job_config
    from headrace.training.train import train

    save_tokenizer(tmp_path / "tokenizer.json")
    data = write_speech_dataset(tmp_path / "same", ["alpha", "bravo", "charlie"], same_audio=True)
    raw = to_dict(
        salm_job(tmp_path, "deaf", data_path=str(data), max_steps=3, speech_extra=dict(warn_not_listening_after=2))
    )
    raw["trainer"]["eval_every"] = 1
    raw["data"]["val"] = dict(datasets=[dict(path=str(data))])
    raw["data"]["bucketing"]["max_duration"] = 4.0
    history = train(load_job_config(None, base=raw))
    assert len(history) == 3
    out = capsys.readouterr().out
    assert out.count("not listening to the audio") == 1, out
    assert "warning: at step 2 " in out, out


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"ctc": {"units": "tokens"}}, "error: model.ctc.units: tokens needs model.tokenizer"),
        ({"speech_config": {"subsampling_factor": 0}}, "error: model.speech.encoder.config: math domain error"),
        ({"text_data": True}, "error: data: bucketing: "),  # a text dataset for an audio job
    ],
)
def test_ctc_values_refused_after_the_process_group_starts_are_one_line(tmp_path, capsys, one_rank, edit, message):
    """Issue 46 item 10: values the model build refuses (after the process group starts) are the same one line
    and exit 2 as the config's own rules, not a ``[rank0]`` traceback; through ``python -m headrace.training``."""
    import yaml

    from headrace.training.__main__ import main

    job = ctc_job(tmp_path, write_speech_dataset(tmp_path / "speech", ["alpha", "bravo"]))
    job["model"].update({k: v for k, v in edit.items() if k == "ctc"})
    job["model"]["speech"]["encoder"]["config"] = {**TINY_ENCODER, **edit.get("speech_config", {})}
    if edit.get("text_data"):
        from tests.loader_util import make_text_dataset

        make_text_dataset(tmp_path / "text", [10])
        job["data"]["datasets"] = [{"path": str(tmp_path / "text")}]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["--config", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith(message) and "Traceback" not in err, err
