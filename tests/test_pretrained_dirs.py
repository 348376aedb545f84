"""Pretrained directories and config files through the trainer (``python -m headrace.training``'s ``main``, one
process), issue 34 items 5 and 16, and the link rule of item 3: two safetensors files holding one tensor, a tensor
missing or of another shape (a smaller vocabulary), a ``config.json`` / ``model.config_path`` that is not a JSON
object with a ``model_type``, a file linked from outside the directory: each one line naming the file and the
tensor or key, exit 2, before any step."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.dist.train_common import TINY_LLAMA, save_pretrained_tiny
from tests.helpers import DEBUG_LLAMA_CLI
from tests.loader_util import make_text_dataset

from headrace.training.__main__ import main

BASE = [*DEBUG_LLAMA_CLI, "trainer.max_steps=1"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    save_pretrained_tiny(root / "tiny", dict(TINY_LLAMA, vocab_size=1024))
    make_text_dataset(root / "d", [20])
    return root


def _split_with_zero_copy(d):
    """The lm_head stored again, all zeros, in a second file (the last file used to win)."""
    weights = load_file(d / "model.safetensors")
    save_file({"lm_head.weight": torch.zeros_like(weights["lm_head.weight"])}, d / "model-zz.safetensors")


def _drop(d, key):
    weights = load_file(d / "model.safetensors")
    del weights[key]
    save_file(weights, d / "model.safetensors")


def _smaller_vocab(d):
    weights = load_file(d / "model.safetensors")
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:512].clone()
    save_file(weights, d / "model.safetensors")


def _config_link(d, tmp_path):
    (tmp_path / "elsewhere.json").write_text((d / "config.json").read_text())
    (d / "config.json").unlink()
    (d / "config.json").symlink_to(tmp_path / "elsewhere.json")


CASES = {
    "duplicate": (_split_with_zero_copy, "lm_head.weight is stored in both model-zz.safetensors and model.safetensors"),
    "missing": (lambda d: _drop(d, "model.norm.weight"), "has no tensor model.norm.weight"),
    "smaller_vocab": (_smaller_vocab, "model.embed_tokens.weight has shape [512, 64], the model's is [1024, 64]"),
    # found by the 40-minute fuzz run: a config far larger than the weights was allocated whole before the load
    "config_far_larger": (
        lambda d: (d / "config.json").write_text(
            json.dumps({**json.loads((d / "config.json").read_text()), "num_hidden_layers": 64})
        ),
        "(nothing was allocated)",
    ),
    "config_list": (lambda d: (d / "config.json").write_text("[]"), "config.json: holds a JSON list"),
    "config_not_json": (lambda d: (d / "config.json").write_text("{"), "config.json: not a JSON file"),
    "config_no_model_type": (lambda d: (d / "config.json").write_text('{"vocab_size": 8}'), "has no model_type"),
}


@pytest.mark.parametrize("case", [*CASES, "config_link"])
def test_broken_pretrained_dir_is_one_line(saved, tmp_path, capsys, one_rank, case):
    pretrained = tmp_path / "p"
    shutil.copytree(saved / "tiny", pretrained)
    if case == "config_link":
        _config_link(pretrained, tmp_path)
        message = "config.json: a symbolic link to"
    else:
        CASES[case][0](pretrained)
        message = CASES[case][1]
    code = main(
        [
            *BASE,
            f"trainer.output_dir={tmp_path / 'out'}",
            f"data.datasets=[{{path: {saved / 'd'}}}]",
            "model.config=null",
            f"model.pretrained_path={pretrained}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "content,message",
    [("[1]", "holds a JSON list"), ("{oops", "not a JSON file"), ('{"vocab_size": 8}', "has no model_type")],
)
def test_broken_config_path_is_one_line(saved, tmp_path, capsys, one_rank, content, message):
    (tmp_path / "c.json").write_text(content)
    code = main(
        [
            *BASE,
            f"trainer.output_dir={tmp_path / 'out'}",
            f"data.datasets=[{{path: {saved / 'd'}}}]",
            "model.config=null",
            f"model.config_path={tmp_path / 'c.json'}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"{tmp_path / 'c.json'}" in err and message in err, err


def test_good_pretrained_dir_still_trains(saved, tmp_path, capsys, one_rank):
    code = main(
        [
            *BASE,
            f"trainer.output_dir={tmp_path / 'out'}",
            f"data.datasets=[{{path: {saved / 'd'}}}]",
            "model.config=null",
            f"model.pretrained_path={saved / 'tiny'}",
        ]
    )
    assert code == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1


def test_hf_export_copies_no_tokenizer_file_linked_from_outside(saved, tmp_path, capsys, one_rank):
    """The trainer's hf/ export copies the tokenizer folder's files; one linked from outside (``tokenizer_config.json
    -> a secret``) is refused in one line, and its target never reaches hf/."""
    from tests.test_speech_checkpoints import word_level_tokenizer

    word_level_tokenizer({"[UNK]": 0, "a": 1, "</s>": 2}, "</s>", []).save_pretrained(tmp_path / "tok")
    (tmp_path / "secret").write_text('{"secret": "from outside"}')
    (tmp_path / "tok" / "tokenizer_config.json").unlink()
    (tmp_path / "tok" / "tokenizer_config.json").symlink_to(tmp_path / "secret")
    code = main(
        [
            *BASE,
            "checkpoint.export_hf=true",
            f"model.tokenizer={tmp_path / 'tok'}",
            f"trainer.output_dir={tmp_path / 'out'}",
            f"data.datasets=[{{path: {saved / 'd'}}}]",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "tokenizer_config.json: a symbolic link to" in err, err
    assert not any("from outside" in p.read_text(errors="replace") for p in (tmp_path / "out").rglob("*.json"))
