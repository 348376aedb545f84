"""LoRA's settings and adapter folders through ``python -m headrace.training``'s main (issue 46), in a module of
its own: ``main`` opens and closes its own process group, which test_lora.py's module-wide group must not share."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.dist.train_common import TINY_LLAMA, save_pretrained_tiny
from tests.helpers import REPO


def test_lora_settings_and_adapter_folders_are_one_line_through_the_cli(tmp_path, capsys):
    """Issue 46 items 4, 8, 10, through ``python -m headrace.training``'s main: settings that cannot train (alpha 0,
    an empty selection, a rank past a layer's, ``*`` reaching the output head) and adapter folders that are not
    what they claim (a config that is a list or nested past the parser, a broken safetensors file, one of another
    base, a weights file linked from outside the folder, whose target is never read) are one line, exit 2; the
    adapter as saved by peft trains."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.dist.lora_checks import TARGETS, make_base_and_adapter
    from tests.loader_util import make_text_dataset

    from headrace.training.__main__ import main

    make_text_dataset(tmp_path / "d", [40])
    make_base_and_adapter(tmp_path, dict(TINY_LLAMA, vocab_size=2048))
    save_pretrained_tiny(tmp_path / "other_base", dict(TINY_LLAMA, vocab_size=2048, hidden_size=32, head_dim=8))
    other = AutoModelForCausalLM.from_pretrained(tmp_path / "other_base")
    get_peft_model(other, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)).save_pretrained(tmp_path / "other")

    def adapter(name: str, edit) -> Path:
        folder = tmp_path / f"adapter-{name}"
        shutil.copytree(tmp_path / "adapter", folder)
        edit(folder)
        return folder

    def linked_out(folder: Path) -> None:
        (tmp_path / "outside.safetensors").write_bytes((folder / "adapter_model.safetensors").read_bytes())
        (folder / "adapter_model.safetensors").unlink()
        (folder / "adapter_model.safetensors").symlink_to(tmp_path / "outside.safetensors")

    def trained_from(path: Path | None, peft: str | None = None) -> list[str]:
        peft = peft or f"peft={{r: 4, lora_alpha: 8, target_modules: {TARGETS}, pretrained_path: {path}}}"
        return [
            "--config",
            str(REPO / "configs" / "debug_llama.yaml"),
            "logging.console=false",
            "checkpoint.export_hf=false",
            "data.seq_len=64",
            f"data.datasets=[{{path: {tmp_path / 'd'}}}]",
            "trainer.max_steps=1",
            "model.config=null",
            f"model.pretrained_path={tmp_path / 'pretrained'}",
            f"trainer.output_dir={tmp_path / 'out'}",
            peft,
        ]

    capsys.readouterr()
    assert main(trained_from(tmp_path / "adapter")) == 0
    cases = [
        (trained_from(None, "peft={alpha: 0}"), "peft.alpha must be a finite number > 0, got 0.0"),
        (trained_from(None, "peft={target_modules: []}"), "peft.target_modules: [] selects no module"),
        (trained_from(None, "peft={target_modules: ['*']}"), "peft: lm_head is the output head"),
        (trained_from(None, "peft={dim: 100000000}"), "peft.dim 100000000 exceeds the rank of model.layers.0"),
        (
            trained_from(adapter("list", lambda f: (f / "adapter_config.json").write_text("[]"))),
            "adapter-list/adapter_config.json: holds a JSON list, not an object",
        ),
        (
            trained_from(adapter("deep", lambda f: (f / "adapter_config.json").write_text("[" * 10**5 + "]" * 10**5))),
            "adapter-deep/adapter_config.json: not a JSON file",
        ),
        (
            trained_from(
                adapter("broken", lambda f: (f / "adapter_model.safetensors").write_bytes(b"\x10" + 15 * b"\0"))
            ),
            "adapter-broken/adapter_model.safetensors is not a readable safetensors file",
        ),
        (trained_from(tmp_path / "other"), "does not fit this model (rank 0: ValueError: Size mismatch"),
        (trained_from(adapter("link", linked_out)), "adapter-link/adapter_model.safetensors: a symbolic link to"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, message
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err, (message, err[-2000:])
