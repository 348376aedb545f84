"""Regression tests of issue 16 (hostile input), trainer and CLI side: every config example of the
issue is a ConfigError naming the key and the rule; token ids beyond the model's vocabulary are caught
at start-up; user errors are one line from rank 0 with exit status 2 (tracebacks only on request)."""

from __future__ import annotations

import subprocess

import pytest

from headrace.config import ConfigError
from headrace.training.config.load import load_job_config
from headrace.training.config.validate import check_job, check_vocab
from headrace.training.distributed.parallel_dims import ParallelDims

from tests.dist.train_common import TINY_LLAMA, VOCAB
from tests.helpers import child_env, torchrun


def job(tmp_path) -> dict:
    return dict(
        model=dict(config=dict(TINY_LLAMA)),
        data=dict(datasets=[dict(path=str(tmp_path))], seq_len=32),
        trainer=dict(output_dir=str(tmp_path / "run")),
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.grad_accum=0", r"trainer\.grad_accum: must be >= 1, got 0"),  # was an AttributeError
        ("trainer.max_steps=-5", r"trainer\.max_steps: must be >= 1, got -5"),  # trained nothing, exit 0
        ("optim.lr=-1", r"optim\.lr: must be > 0, got -1"),  # was a long torch traceback
        ("optim.betas=[0.9, 1.5]", r"optim\.betas: must be two numbers in \[0, 1\)"),
        (
            "model.config.model_type=gpt9",
            r"model\.config\.model_type: 'gpt9' is not a causal LM model type",
        ),  # was transformers' long traceback
        (
            "model.config.model_type={a: 1}",
            r"model\.config\.model_type: \{'a': 1\} is not a causal LM model type",
        ),  # fuzz: was TypeError
        ("distributed.tp_size=3", r"world size 1 is not divisible by tp_size \* pp_size \* cp_size = 3"),
    ],
)
def test_bad_values_fail_at_start_up_naming_key_and_rule(tmp_path, override, message):
    cfg = load_job_config(None, [override], base=job(tmp_path))
    with pytest.raises(ConfigError, match=message):
        check_job(cfg)
        ParallelDims.from_config(cfg.distributed, 1)  # the degrees' rules: train() runs both before any process group


def test_good_job_passes(tmp_path):
    cfg = load_job_config(None, [], base=job(tmp_path))
    check_job(cfg)
    ParallelDims.from_config(cfg.distributed, 1)


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.datasets=[{path: x, weight: .inf}]", r"data\.datasets\[0\]\.weight: expected a finite number, got inf"),
        ("optim.lr=.nan", r"optim\.lr: expected a finite number, got nan"),
        ("optim.lr=[1, 2", r"override 'optim\.lr=\[1, 2': not valid YAML"),  # was a 50-line parser traceback
    ],
)
def test_non_finite_numbers_and_bad_overrides_are_config_errors(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        load_job_config(None, [override], base=job(tmp_path))


def test_malformed_yaml_file_is_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  config: {model_type: llama\ntrainer:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML \(line \d+, column \d+\): ") as e:
        load_job_config(str(path))
    assert "\n" not in str(e.value)


def test_tokenizer_larger_than_the_model_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    path = tmp_path / "tok.json"
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB + 10)}, unk_token="w0")).save(str(path))
    with pytest.raises(
        ConfigError,
        match=rf"model\.tokenizer: .*tok\.json has {VOCAB + 10} tokens, more than "
        rf"the model's vocab_size {VOCAB}",
    ):
        check_vocab(VOCAB, str(path), [])
    check_vocab(VOCAB + 10, str(path), [])


def test_shard_token_ids_beyond_the_vocab_are_refused_from_the_index(tmp_path):
    """The largest id is recorded per shard by `dataio index` (tarscan) and checked without reading data."""
    from tests.loader_util import make_text_dataset  # tokens 0..999 plus the sample number

    from headrace.dataio.stream.sources.shard_source import ShardSource

    make_text_dataset(tmp_path / "d", [5, 5])
    source = ShardSource(str(tmp_path / "d"))
    recorded = [s.max_token for s in source.index.shards]
    assert all(m is not None and 500 < m < 1000 for m in recorded)
    with pytest.raises(
        ConfigError,
        match=rf"d/doc-00000\d\.tar holds token id {max(recorded)}, outside the "
        r"model's vocab_size 256",
    ):
        check_vocab(VOCAB, None, [source])
    check_vocab(1000, None, [source])


def test_trainer_user_errors_are_one_line_and_bugs_keep_tracebacks(tmp_path, capsys, monkeypatch):
    from headrace.training.__main__ import main

    for key in ("RANK", "HEADRACE_DEBUG"):
        monkeypatch.delenv(key, raising=False)
    assert main(["--config", "configs/debug_llama.yaml", "trainer.grad_accum=0"]) == 2
    assert capsys.readouterr().err == "error: trainer.grad_accum: must be >= 1, got 0\n"
    monkeypatch.setenv("RANK", "1")  # another rank of the same job: the same error, silently
    assert main(["--config", "configs/debug_llama.yaml", "trainer.grad_accum=0"]) == 2
    assert capsys.readouterr().err == ""
    assert main(["--config", str(tmp_path / "nope.yaml")]) == 2  # a path: one line, from the rank that met it
    assert capsys.readouterr().err.strip() == f"error (rank 1): {tmp_path / 'nope.yaml'}: No such file or directory"
    monkeypatch.setenv("HEADRACE_DEBUG", "1")
    with pytest.raises(ConfigError, match="trainer.grad_accum"):  # asked for: the traceback
        main(["--config", "configs/debug_llama.yaml", "trainer.grad_accum=0"])
    monkeypatch.delenv("HEADRACE_DEBUG")
    with pytest.raises(ConfigError):
        main(["--debug", "--config", "configs/debug_llama.yaml", "trainer.grad_accum=0"])


def run_torchrun(nproc: int, *args) -> subprocess.CompletedProcess:
    """The trainer under torchrun, expected to fail: user errors without HEADRACE_DEBUG's tracebacks."""
    return torchrun(nproc, "headrace.training", *args, env=child_env(HEADRACE_DEBUG=None), timeout=300, check=False)


def test_torchrun_parallel_dims_error_is_one_line_from_rank_0(tmp_path):
    """Was ~68 lines for 2 processes (every rank's traceback); now one line from our processes, then
    torchrun's own summary of the non-zero exits."""
    proc = run_torchrun(
        2, "--config", "configs/debug_llama.yaml", "distributed.tp_size=3", f"trainer.output_dir={tmp_path}"
    )
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert ours == ["error: distributed: world size 2 is not divisible by tp_size * pp_size * cp_size = 3"]
    assert "training/train.py" not in proc.stderr  # no trainer traceback from any rank
