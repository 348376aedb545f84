"""``python -m headrace.training.speech.checkpoints CKPT OUT`` on crafted or broken speech-LLM checkpoint directories
(issue 34 items 3, 4, 15): a symbolic link out of the checkpoint is never followed (its target never reaches the
export), a chat template that loops for ever is stopped, and every broken input is one line naming the file and
the rule, exit 2, with no partial ``OUT`` left behind. A Hugging Face cache snapshot (every file a link into the
entry's ``blobs/``) still converts."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from tests.test_speech_checkpoints import save_qwen2_audio, save_voxtral

from headrace.training.speech import checkpoints
from headrace.training.speech.checkpoints import main

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    save_qwen2_audio(root / "qwen2_audio")
    save_voxtral(root / "voxtral")
    return root


def _set_template(ckpt, template: str) -> None:
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    (ckpt / "chat_template.jinja").write_text(template)


def _edit_config(ckpt, edit) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(edit(config)))


def _weights(ckpt):
    return next(ckpt.glob("*.safetensors"))


def _header_too_large(ckpt):
    _weights(ckpt).write_bytes(struct.pack("<Q", 1 << 40) + b"{}")


def _truncated(ckpt):
    data = _weights(ckpt).read_bytes()
    _weights(ckpt).write_bytes(data[: len(data) // 2])


def _merges_link(ckpt):
    (ckpt.parent / "secret").write_text("host secret\n")
    (ckpt / "merges.txt").symlink_to(ckpt.parent / "secret")


def _no_tokenizer(ckpt):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (ckpt / name).unlink(missing_ok=True)


def _duplicate_tensor(ckpt):
    shutil.copy(_weights(ckpt), ckpt / "zz-copy.safetensors")


CASES = {  # name: (checkpoint, edit, what the one line says)
    "link_out": ("qwen2_audio", _merges_link, "merges.txt: a symbolic link to"),
    "nested_loops": ("qwen2_audio", lambda c: _set_template(c, NESTED_LOOPS), "chat template ran past"),
    "template_syntax": ("qwen2_audio", lambda c: _set_template(c, "{% for %}"), "chat template fails"),
    "template_undefined_call": (
        "qwen2_audio",
        lambda c: _set_template(c, "{{ nothing.here() }}"),
        "chat template fails",
    ),
    "header_too_large": ("qwen2_audio", _header_too_large, "not a readable safetensors file"),
    "truncated": ("qwen2_audio", _truncated, "not a readable safetensors file"),
    "duplicate_tensor": ("qwen2_audio", _duplicate_tensor, "is also stored in"),
    "config_list": (
        "qwen2_audio",
        lambda c: (c / "config.json").write_text("[1, 2]"),
        "config.json: holds a JSON list",
    ),
    "config_not_json": (
        "qwen2_audio",
        lambda c: (c / "config.json").write_text("{model_type: qwen2_audio"),
        "config.json: not a JSON file",
    ),
    "no_tokenizer": ("qwen2_audio", _no_tokenizer, "no tokenizer"),
    # found by the 40-minute fuzz run: json's RecursionError inside transformers' tokenizer loading
    "tokenizer_config_nested": (
        "qwen2_audio",
        lambda c: (c / "tokenizer_config.json").write_bytes(b"[" * 100_000 + b"]" * 100_000),
        "transformers cannot read its tokenizer",
    ),
    "voxtral_hidden_0": (
        "voxtral",
        lambda c: _edit_config(c, lambda d: {**d, "audio_config": {**d["audio_config"], "hidden_size": 0}}),
        "audio_config: hidden_size is 0",
    ),
    "voxtral_no_audio_config": (
        "voxtral",
        lambda c: _edit_config(c, lambda d: {k: v for k, v in d.items() if k != "audio_config"}),
        "config.json: audio_config is missing",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_broken_checkpoint_is_one_line_and_leaves_nothing(saved, tmp_path, capsys, monkeypatch, case):
    kind, edit, message = CASES[case]
    monkeypatch.setattr(checkpoints, "TEMPLATE_SECONDS", 1.0)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / kind, ckpt)
    edit(ckpt)
    code = main([str(ckpt), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", *(["secret"] if case == "link_out" else [])])


def test_hub_cache_snapshot_links_convert(saved, tmp_path, capsys):
    """The hub's own layout: models--ORG--NAME/snapshots/REV/<file> -> ../../blobs/<file>."""
    entry = tmp_path / "models--org--tiny"
    shutil.copytree(saved / "qwen2_audio", entry / "blobs")
    (entry / "snapshots" / "rev").mkdir(parents=True)
    for blob in (entry / "blobs").iterdir():
        (entry / "snapshots" / "rev" / blob.name).symlink_to(f"../../blobs/{blob.name}")
    assert main([str(entry / "snapshots" / "rev"), str(tmp_path / "out")]) == 0, capsys.readouterr().err
    assert not (tmp_path / "out" / "hf" / "tokenizer.json").is_symlink()
    assert json.loads((tmp_path / "out" / "salm.json").read_text())["encoder"]["kind"] == "qwen2_audio"
