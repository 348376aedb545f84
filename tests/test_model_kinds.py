"""The model-kind specs (headrace.training.model_kinds): one registry that the config agrees with, no branch on
the kind outside the specs' own modules, and a feature a kind does without refused naming the kind."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

from tests.dist.speech_common import salm_job

from headrace.config import ConfigError  # noqa: E402
from headrace.training.config.job_config import KIND_CONFIGS, ModelConfig  # noqa: E402
from headrace.training.distributed.parallel_dims import ParallelDims  # noqa: E402
from headrace.training.model_kinds import MODEL_KINDS, build_model_or_pipeline  # noqa: E402

TRAINING = Path(__file__).resolve().parent.parent / "training"
# a test of the job's kind (`cfg.model.kind == ...`, `model.kind in (...)`) or of any name against a registered
# kind's name (`kind != "causal_lm"`): a new kind's name is covered as soon as it is registered
KIND_BRANCH = re.compile(
    r"""\bmodel\.kind\s*(==|!=|\bin\b|\bnot\s+in\b)|(==|!=|\bin\b)\s*[(\[{]?\s*["'](%s)["']"""
    % "|".join(map(re.escape, MODEL_KINDS))
)


def test_the_config_knows_exactly_the_registered_kinds():
    literal = typing.get_args(typing.get_type_hints(ModelConfig)["kind"])
    assert set(literal) == set(KIND_CONFIGS) == set(MODEL_KINDS)
    assert all(name == kind.name for name, kind in MODEL_KINDS.items())
    # one table per fact: the spec carries the config's row itself, not fields restating it
    assert all(kind.config is KIND_CONFIGS[name] for name, kind in MODEL_KINDS.items())


def test_no_branch_on_the_kind_outside_the_specs():
    found = [
        f"{path.relative_to(TRAINING)}:{n}: {line.strip()}"
        for path in TRAINING.rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if KIND_BRANCH.search(line)
    ]
    assert found == []
    for branch in ('if cfg.model.kind == "salm":', 'elif kind != "causal_lm"', "if model.kind in KINDS:"):
        assert KIND_BRANCH.search(branch), branch  # the pattern is not blind


def test_a_kind_without_a_pipeline_rule_is_refused_naming_it(tmp_path):
    cfg = salm_job(tmp_path, "x", distributed=dict(strategy="fsdp2", pp_size=2))
    with pytest.raises(ValueError, match="model.kind 'salm' has no pipeline split rule"):
        build_model_or_pipeline(cfg, ParallelDims.from_config(cfg.distributed, 2), None)


def test_a_section_belongs_to_its_kind(tmp_path):
    from headrace.config import to_dict
    from headrace.training.config.load import load_job_config

    raw = to_dict(salm_job(tmp_path, "x"))
    raw["model"]["kind"] = "causal_lm"
    with pytest.raises(ConfigError, match="model.speech is required with model.kind: salm or ctc, and only then"):
        load_job_config(None, base=raw)
    raw = to_dict(salm_job(tmp_path, "x"))
    raw["distributed"]["cp_size"] = 2
    with pytest.raises(ConfigError, match="distributed.cp_size=2 splits packed text rows: model.kind salm"):
        load_job_config(None, base=raw)
