"""Supervised fine-tuning on conversations: the packed loss against transformers on each conversation alone,
dp=2 with uneven assistant lengths against one process (one torchrun launch), and the SFT recipes through the
trainer's command line (full and ``peft:``)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from headrace.config import from_dict
from headrace.dataio import build_loader
from headrace.dataio.cli import main as dataio_main
from headrace.dataio.config import DataConfig
from headrace.dataio.bench.chat_corpus import conversations, make_tokenizer_dir, write_jsonl
from tests.dist.train_common import TINY_LLAMA, save_pretrained_tiny
from tests.helpers import REPO, child_env, torchrun

VOCAB = 512  # above the test tokenizer's 300


def shard_chat(tmp_path, name: str, convs: list[list[dict]], tokdir) -> str:
    src = write_jsonl(tmp_path / f"{name}.jsonl", [{"messages": c, "id": f"{name}{i}"} for i, c in enumerate(convs)])
    out = tmp_path / name
    assert dataio_main(["shard", str(src), "--output", str(out), "--tokenizer", str(tokdir), "--quiet"]) == 0
    return str(out)


def packed(root: str, seq_len: int, batch_size: int = 2) -> list[dict]:
    cfg = {"datasets": [{"path": root}], "shuffle": False, "num_workers": 0, "epochs": 1}
    cfg |= {"packing": "best_fit", "seq_len": seq_len, "batch_size": batch_size, "packing_buffer": 16}
    return list(build_loader(from_dict(DataConfig, cfg), dp_rank=0, dp_size=1))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft")
    save_pretrained_tiny(path / "pretrained", dict(TINY_LLAMA, vocab_size=VOCAB))
    make_tokenizer_dir(path / "tok")
    return path


def test_packed_loss_equals_transformers_per_conversation(workdir):
    """Sum of the packed rows' cross-entropy over trained tokens / their count, through the trainer's loss module
    (document-masked varlen attention, chunked loss), equals transformers' model on each conversation alone
    (labels: the ids where ``apply_chat_template``'s assistant mask is 1), in float64, to 1e-6."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from headrace.kernels.hf_attention import register_varlen_attention
    from headrace.training.models.loss import CausalLMLoss
    from headrace.training.step import forward_loss_sum

    convs = conversations(24, seed=7, max_turns=3)
    root = shard_chat(workdir, "loss", convs, workdir / "tok")
    hf_tok = AutoTokenizer.from_pretrained(str(workdir / "tok"))
    ref_model = AutoModelForCausalLM.from_pretrained(workdir / "pretrained", attn_implementation="eager").double()
    ref_sum, ref_count = 0.0, 0
    with torch.no_grad():
        for conv in convs:
            enc = hf_tok.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            ids = torch.tensor([enc["input_ids"]])
            labels = torch.where(torch.tensor([enc["assistant_masks"]]) == 1, ids, -100)
            logits = ref_model(input_ids=ids).logits
            ref_sum += F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum").item()
            ref_count += int((labels[0, 1:] != -100).sum())
    model = CausalLMLoss(
        AutoModelForCausalLM.from_pretrained(workdir / "pretrained", attn_implementation=register_varlen_attention())
    ).double()
    batches = packed(root, seq_len=256)
    got_sum, got_count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            got_sum += forward_loss_sum(model, batch, autocast=False).item()
            got_count += int((batch["labels"] != -100).sum())
    assert got_count == ref_count
    assert sum(b["num_docs"] for b in batches) == len(convs)
    assert abs(got_sum / got_count - ref_sum / ref_count) < 1e-6, (got_sum / got_count, ref_sum / ref_count)


def test_dp2_uneven_assistant_lengths_equal_one_process(workdir):
    """Rank 0's rows hold long answers, rank 1's short ones: dp=2 (FSDP2, and with grad accumulation) trains like
    one process on the same global batches (tests/dist/sft_checks.py)."""
    # the same prompts' length, answers of ~25 words against ~1: rows of similar fill, uneven trained tokens
    rng_long = conversations(40, seed=8, max_turns=1, words=(10, 14), answer_words=(20, 30))
    rng_short = conversations(40, seed=9, max_turns=1, words=(30, 40), answer_words=(1, 2))
    tok = workdir / "tok"
    batches = {
        "long": packed(shard_chat(workdir, "long", rng_long, tok), seq_len=256),
        "short": packed(shard_chat(workdir, "short", rng_short, tok), seq_len=256),
    }
    global_batches = []
    for a, b in zip(batches["long"][:4], batches["short"][:4]):  # rank 0 <- long, rank 1 <- short (dp=2, k=1)
        global_batches += [a, b]
    trained = [int((b["labels"] != -100).sum()) for b in global_batches]
    assert min(trained[0::2]) > 3 * max(trained[1::2]), trained  # deliberately uneven
    torch.save(
        [
            {k: b[k] for k in ("input_ids", "labels", "position_ids", "cu_seqlens", "max_seqlen")}
            for b in global_batches
        ],
        workdir / "batches.pt",
    )
    out = torchrun(2, "tests.dist.sft_checks", workdir).stdout
    for check in ("fsdp2 dp=2", "ddp dp=2 grad_accum=2", "mean of per-rank means differs"):
        assert out.count(f"OK {check}") == 2, out[-3000:]


def _train(config: str, root: str, out, *extra: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "headrace.training", "--config", config, f"data.datasets=[{{path: {root}}}]",
         "trainer.max_steps=3", f"trainer.output_dir={out}", *extra],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("config", ["configs/debug_llama_sft.yaml", "configs/debug_llama_sft_lora.yaml"])
def test_sft_recipes_train_through_the_cli(workdir, config):
    name = config.rsplit("/", 1)[1].removesuffix(".yaml")
    root = shard_chat(workdir, name, conversations(64, seed=10, max_turns=2), workdir / "tok")
    out = workdir / f"run-{name}"
    records = [r for r in _train(config, root, out) if "loss" in r]
    assert len(records) == 3 and all(np.isfinite(r["loss"]) for r in records)
    # tokens: the trained (assistant) tokens of the step's rows (2 x 512 tokens, pack_fill of them real)
    assert all(0 < r["tokens"] < 0.6 * r["pack_fill"] * 2 * 512 for r in records)
    assert records[-1]["skipped_conversations"] == 0  # every conversation fits 512 tokens
