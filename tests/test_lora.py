"""LoRA through the trainer in one process (headrace.training.models.lora, docs/lora.md): peft's own model is the
reference. The multi-rank layouts (FSDP2, TP, PP) are in test_lora_dist.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.dist.lora_checks import lora_job, make_base_and_adapter
from tests.dist.train_common import (
    TINY_LLAMA,
    ListLoader,
    copy_checkpoint,
    full_logits_loss_sum,
    packed_batches,
    save_pretrained_tiny,
)
from tests.helpers import REPO

from headrace.config import ConfigError  # noqa: E402
from headrace.training.config.load import load_job_config  # noqa: E402


def checkpoint_keys(step_dir) -> set[str]:
    """Every tensor key a checkpoint stores (its safetensors headers; nothing is unpickled)."""
    from safetensors import safe_open

    keys = set()
    for path in Path(step_dir).glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            keys |= set(f.keys())
    return keys


def peft_reference(workdir: Path, adapter: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from headrace.kernels.hf_attention import register_varlen_attention

    base = AutoModelForCausalLM.from_pretrained(workdir / "pretrained", attn_implementation=register_varlen_attention())
    return PeftModel.from_pretrained(base, adapter).eval()


def logits_of(model, batch: dict) -> torch.Tensor:
    from headrace.kernels.hf_attention import packed_attention_kwargs

    with torch.no_grad():
        return model(input_ids=batch["input_ids"], use_cache=False, **packed_attention_kwargs(batch)).logits


def test_lora_matches_peft_trains_only_adapters_exports_and_resumes(tmp_path, process_group):
    """From one saved base + peft adapter: the trainer's logits and first loss are peft's; after 4 steps the
    checkpoints hold only the adapters (+ their AdamW state), the merged hf/ export is peft's merge of the
    exported lora/ adapter with every other tensor byte-equal to the base, lora/ loads in peft and gives hf/'s
    logits; a run resumed from step 2 gives the same losses."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from headrace.training.distributed.parallel_dims import ParallelDims
    from headrace.training.model_kinds import build_model
    from headrace.training.train import train

    make_base_and_adapter(tmp_path)
    batches = packed_batches(4)
    ref = peft_reference(tmp_path, tmp_path / "adapter")
    cfg = lora_job(tmp_path, "straight", 4)
    dims = ParallelDims.from_config(cfg.distributed, 1)
    model, _ = build_model(cfg, dims.build_meshes("cpu"), torch.device("cpu"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    with torch.no_grad():
        ours = model(input_ids=batches[0]["input_ids"], labels=None, **packed_kwargs(batches[0]))
    torch.testing.assert_close(ours, logits_of(ref, batches[0]), rtol=1e-5, atol=1e-5)

    history = train(cfg, lambda r, n: ListLoader(batches, r, n, 1))
    with torch.no_grad():
        want = full_logits_loss_sum(ref, batches[0]) / (batches[0]["labels"] != -100).sum()
    assert history[0]["loss"] == pytest.approx(want.item(), rel=1e-5)

    out = tmp_path / "straight"
    stored_keys = checkpoint_keys(out / "checkpoints" / "step-00000004")
    stored = {k.split(".", 1)[1] for k in stored_keys if k.startswith("model.")}
    assert stored == {n for n in trainable}  # the adapters alone: no copy of the base
    assert {k for k in stored_keys if k.startswith("optim.state.")} and all(
        ".lora_" in k for k in stored_keys if k.startswith("optim.state.")
    )
    state = json.loads((out / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())
    assert state["model_config"]["peft"]["base"] == str(tmp_path / "pretrained")

    exported = peft_reference(tmp_path, out / "lora")  # peft loads the exported adapter
    assert json.loads((out / "lora" / "adapter_config.json").read_text())["r"] == 4
    trained = load_file(out / "lora" / "adapter_model.safetensors")
    initial = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert trained.keys() == initial.keys() and all(not torch.equal(trained[k], initial[k]) for k in trained)
    merged = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    base = load_file(tmp_path / "pretrained" / "model.safetensors")
    adapted = {f"{m.removeprefix('base_model.model.')}" for m in {k.rsplit(".lora_", 1)[0] for k in trained}}
    for name, tensor in merged.state_dict().items():
        if name.removesuffix(".weight") not in adapted:
            assert torch.equal(tensor, base[name]), name  # every base tensor untouched, byte for byte
    peft_merged = peft_reference(tmp_path, out / "lora").merge_and_unload().state_dict()
    for name in adapted:
        torch.testing.assert_close(merged.state_dict()[f"{name}.weight"], peft_merged[f"{name}.weight"])
    torch.testing.assert_close(logits_of(merged, batches[1]), logits_of(exported, batches[1]), rtol=1e-5, atol=1e-5)

    resumed = tmp_path / "resumed"
    copy_checkpoint(out / "checkpoints" / "step-00000002", resumed / "checkpoints" / "step-00000002")
    again = train(lora_job(tmp_path, "resumed", 4), lambda r, n: ListLoader(batches, r, n, 1))
    assert [r["step"] for r in again] == [3, 4]
    assert [r["loss"] for r in again] == pytest.approx([r["loss"] for r in history[2:]], rel=1e-6)


def packed_kwargs(batch: dict) -> dict:
    from headrace.kernels.hf_attention import packed_attention_kwargs

    return packed_attention_kwargs(batch)


def test_fresh_adapters_start_at_the_base_and_a_changed_base_is_refused(tmp_path, process_group):
    """Without an adapter to start from B is zero (the first loss is the base's); resuming with another base
    model is refused, naming the difference."""
    from headrace.training.errors import JobInputError
    from headrace.training.train import train

    save_pretrained_tiny(tmp_path / "pretrained")
    batches = packed_batches(2)
    cfg = lora_job(tmp_path, "fresh", 1, match_all_linear=True, target_modules=None, pretrained_path=None)
    history = train(cfg, lambda r, n: ListLoader(batches, r, n, 1))
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "pretrained", attn_implementation="sdpa")
    from headrace.kernels.hf_attention import register_varlen_attention

    base.config._attn_implementation = register_varlen_attention()
    with torch.no_grad():
        want = full_logits_loss_sum(base, batches[0]) / (batches[0]["labels"] != -100).sum()
    assert history[0]["loss"] == pytest.approx(want.item(), rel=1e-5)
    save_pretrained_tiny(tmp_path / "other", seed=3)
    cfg.model.pretrained_path, cfg.trainer.max_steps = str(tmp_path / "other"), 2
    with pytest.raises(JobInputError, match="peft"):
        train(cfg, lambda r, n: ListLoader(batches, r, n, 1))


@pytest.mark.parametrize(
    "override, message",
    [
        ("peft.use_triton=true", r"peft.use_triton=True is not supported: the Triton LoRA kernel"),
        ("peft.lora_dtype=bf16", r"peft.lora_dtype='bf16' is not supported"),
        ("peft.use_dora=true", r"peft.use_dora=True is not supported"),
        ("peft.rank_stabilized=true", r"JobConfig.peft.rank_stabilized: unknown key"),
        ("peft.dim=0", r"peft.dim \(r\) must be >= 1"),
    ],
)
def test_peft_keys_this_trainer_does_not_implement_are_refused(tmp_path, override, message):
    job = dict(
        model=dict(config=dict(TINY_LLAMA)),
        data=dict(datasets=[dict(path="x")], seq_len=32),
        peft=dict(_target_="nemo_automodel.components._peft.lora.PeftConfig", dim=8, alpha=32),
    )
    assert load_job_config(None, [], base=job).peft.scaling == 4.0  # Automodel's block as written
    with pytest.raises(ConfigError, match=message):
        load_job_config(None, [override], base=job)


def test_hf_names_translate_and_refusals_are_one_line_through_the_cli(tmp_path, capsys):
    """Hugging Face's LoraConfig names map onto the block (peft's dropout is on the input); through the CLI's
    entry point an unimplemented key, and LoRA on MoE experts, are one line and exit 2."""
    from headrace.training.__main__ import main

    cfg = load_job_config(
        str(REPO / "configs" / "debug_llama.yaml"),
        ["peft={r: 16, lora_alpha: 32, lora_dropout: 0.1, target_modules: q_proj}"],
    )
    assert (cfg.peft.dim, cfg.peft.alpha, cfg.peft.dropout, cfg.peft.dropout_position) == (16, 32, 0.1, "pre")
    assert cfg.peft.target_modules == ["q_proj"]
    out = f"trainer.output_dir={tmp_path / 'out'}"
    recipe = load_job_config(str(REPO / "configs" / "debug_lora.yaml"))  # Automodel's block, as written
    assert (recipe.peft.dim, recipe.peft.scaling, recipe.peft.target_modules) == (8, 2.0, ["*_proj"])
    for recipe, override, message in [
        ("debug_lora", "peft.use_triton=true", "peft.use_triton=True is not supported"),
        ("debug_qwen3_moe", "peft={target_modules: ['*.experts']}", "LoRA on experts is not supported"),
    ]:
        assert main(["--config", f"configs/{recipe}.yaml", out, override]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_module_selection_follows_automodel_and_peft_and_refuses_what_lora_cannot_wrap(tmp_path):
    """Wildcards over the whole name (Automodel), bare names as suffixes (peft), exclusions; MoE experts and the
    output head are refused in one line, naming the module."""
    from headrace.training.config.peft import PeftConfig
    from headrace.training.models.build import build_hf_config, build_meta_model
    from headrace.training.models.lora import selected_modules

    job = load_job_config(
        None, base=dict(model=dict(config=dict(TINY_LLAMA)), data=dict(datasets=[dict(path="x")], seq_len=32))
    )
    model = build_meta_model(build_hf_config(job.model))
    assert selected_modules(model, PeftConfig(target_modules=["*.layers.0.*.q_proj", "v_proj"])) == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.v_proj",
    ]
    assert len(selected_modules(model, PeftConfig())) == 14  # *_proj: 7 per block
    assert len(selected_modules(model, PeftConfig(match_all_linear=True, exclude_modules=["*.mlp.*"]))) == 8
    with pytest.raises(ConfigError, match="model.layers.0.mlp is a LlamaMLP, not an nn.Linear"):
        selected_modules(model, PeftConfig(target_modules=["mlp"]))
    with pytest.raises(ConfigError, match="lm_head is the output head"):
        selected_modules(model, PeftConfig(target_modules=["lm_head"]))
    moe = load_job_config(str(REPO / "configs" / "debug_qwen3_moe.yaml"))
    moe_model = build_meta_model(build_hf_config(moe.model))
    with pytest.raises(ConfigError, match=r"model.layers.0.mlp.experts holds MoE experts .* not supported"):
        selected_modules(moe_model, PeftConfig(target_modules=["*.experts"]))


def test_an_adapter_of_other_modules_or_rank_is_refused(tmp_path, process_group):
    from headrace.training.errors import JobInputError
    from headrace.training.train import train

    make_base_and_adapter(tmp_path)
    batches = packed_batches(2)
    cfg = lora_job(tmp_path, "other", 1, target_modules=["q_proj"])
    with pytest.raises(JobInputError, match=r"adapts other modules than peft selects: 8 keys not selected"):
        train(cfg, lambda r, n: ListLoader(batches, r, n, 1))
    cfg = lora_job(tmp_path, "rank", 1, r=8)
    with pytest.raises(JobInputError, match=r"has r=4, lora_alpha=8; this job's peft has dim=8"):
        train(cfg, lambda r, n: ListLoader(batches, r, n, 1))
    shutil.rmtree(tmp_path / "adapter")
    with pytest.raises(JobInputError, match="is not a peft adapter directory"):
        train(lora_job(tmp_path, "none", 1), lambda r, n: ListLoader(batches, r, n, 1))


def test_salm_lora_on_its_llm_and_encoder(tmp_path, process_group):
    """A SALM with LoRA on its LLM and its encoder (Hugging Face's names, as NeMo's SALM writes them): the frozen
    bases stay out of the checkpoint (adapters, the speech adapter, which stays trainable, and buffers); hf/ and encoder/
    hold merged weights, lora/ the LLM's adapter in peft's format."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from headrace.config import to_dict
    from headrace.training.train import train
    from tests.dist.speech_common import audio_batches, salm_job, save_tokenizer

    save_tokenizer(tmp_path / "tokenizer.json")
    raw = to_dict(salm_job(tmp_path, "salm", max_steps=2))
    raw["peft"] = dict(
        r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"], parts=["llm", "encoder"]
    )
    batches = audio_batches(2)
    history = train(load_job_config(None, base=raw), lambda r, n: ListLoader(batches, r, n, 1))
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in history)
    out = tmp_path / "salm"
    stored_keys = checkpoint_keys(out / "checkpoints" / "step-00000002")
    stored = {k.split(".", 1)[1] for k in stored_keys if k.startswith("model.")}
    assert {k for k in stored if ".lora_" in k and k.startswith("llm.")} and {
        k for k in stored if ".lora_" in k and k.startswith("encoder.")
    }
    buffers = ("running_mean", "running_var", "num_batches_tracked")  # BatchNorm's statistics move in training
    assert all(".lora_" in k or k.startswith("adapter.") or k.endswith(buffers) for k in stored), stored
    AutoModelForCausalLM.from_pretrained(out / "hf")
    targets = json.loads((out / "lora" / "adapter_config.json").read_text())["target_modules"]
    assert len(targets) == 4 and all(t.startswith("model.layers.") for t in targets)
    assert not [k for k in load_file(out / "encoder" / "model.safetensors") if ".lora_" in k]


def test_eval_of_a_lora_checkpoint_equals_eval_of_its_merged_export(tmp_path, process_group):
    """``headrace.training.eval`` on a LoRA checkpoint (trainable state only, the base rebuilt from the job) and on
    the merged hf/ export gives the same validation loss."""
    from headrace.training.eval import evaluate_checkpoint
    from headrace.training.train import train
    from tests.loader_util import make_text_dataset

    make_base_and_adapter(tmp_path, TINY_LLAMA | {"vocab_size": 1024})  # the dataset's ids reach ~1000
    make_text_dataset(tmp_path / "data", [30])
    cfg = load_job_config(
        None,
        [
            f"data.datasets=[{{path: {tmp_path / 'data'}}}]",
            "data.num_workers=0",
            f"data.val={{datasets: [{{path: {tmp_path / 'data'}}}]}}",
        ],
        base=to_dict_of(lora_job(tmp_path, "eval", 2)),
    )
    train(cfg)
    step = evaluate_checkpoint(cfg, str(tmp_path / "eval" / "checkpoints" / "step-00000002"))
    merged = evaluate_checkpoint(cfg, str(tmp_path / "eval" / "hf"))
    assert step["val_loss"] == pytest.approx(merged["val_loss"], rel=1e-5)


def to_dict_of(cfg) -> dict:
    from headrace.config import to_dict

    return to_dict(cfg)


def test_a_moe_model_trains_lora_on_its_attention(tmp_path, process_group):
    """On a MoE recipe the default selection (``*_proj``) adapts the attention projections; the experts and the
    router stay frozen and out of the checkpoint."""

    from headrace.training.train import train

    cfg = load_job_config(
        str(REPO / "configs" / "debug_qwen3_moe.yaml"),
        [
            f"trainer.output_dir={tmp_path / 'moe'}",
            "trainer.max_steps=2",
            "data.seq_len=32",
            "checkpoint.interval=0",
            "logging.tensorboard=false",
            "logging.console=false",
            "peft={r: 4, lora_alpha: 8}",
            f"model.config.vocab_size={TINY_LLAMA['vocab_size']}",
        ],
    )
    history = train(cfg, lambda r, n: ListLoader(packed_batches(4), r, n, 1))
    assert len(history) == 2
    stored_keys = checkpoint_keys(tmp_path / "moe" / "checkpoints" / "step-00000002")
    stored = {k.split(".", 1)[1] for k in stored_keys if k.startswith("model.")}
    assert stored and all(".self_attn." in k and ".lora_" in k for k in stored), stored
