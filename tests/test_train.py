"""The trainer in one process (``headrace.training.train``): config, schedule, throughput window, and end-to-end
runs on the real loader (CLI run, exact resume, every debug recipe). The step (packed-batch loss, gradient
accumulation) is in test_step.py, checkpoint bookkeeping in test_checkpoint.py, the multi-rank layouts in
test_train_dist.py."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.loader_util import make_text_dataset
from tests.dist.train_common import TINY_LLAMA, copy_checkpoint, save_pretrained_tiny

from headrace.config import ConfigError  # noqa: E402
from headrace.training.config.job_config import OptimConfig  # noqa: E402
from headrace.training.config.load import load_job_config  # noqa: E402
from tests.helpers import child_env

REPO = Path(__file__).resolve().parent.parent


def base_job(tmp_path, **sections) -> dict:
    job = dict(
        model=dict(config=dict(TINY_LLAMA), attn_implementation="headrace_varlen"),
        data=dict(datasets=[dict(path=str(tmp_path / "data"))], seq_len=32, batch_size=2, num_workers=0),
        logging=dict(console=False, tensorboard=False),
    )
    for key, value in sections.items():
        job.setdefault(key, {}).update(value)
    return job


# -- config --------------------------------------------------------------------------------------------


def test_config_errors_name_the_dotted_path(tmp_path):
    job = base_job(tmp_path)
    with pytest.raises(ConfigError, match=r"JobConfig\.optim\.lrr: unknown key"):
        load_job_config(None, ["optim.lrr=1"], base=job)
    with pytest.raises(ConfigError, match=r"JobConfig\.trainer\.max_steps: expected int, got 'many'"):
        load_job_config(None, ["trainer.max_steps=many"], base=job)
    with pytest.raises(ConfigError, match=r"JobConfig\.distributed\.strategy: expected one of"):
        load_job_config(None, ["distributed.strategy=zero3"], base=job)
    with pytest.raises(ConfigError, match="set exactly one of config / config_path / pretrained_path"):
        load_job_config(None, ["model.pretrained_path=/x"], base=job)
    with pytest.raises(ConfigError, match="data.seq_len is required for training"):
        load_job_config(None, ["data.seq_len=null"], base=job)
    cfg = load_job_config(None, ["optim.lr=0.001", "distributed.tp_size=2"], base=job)
    assert cfg.optim.lr == 0.001 and cfg.distributed.tp_size == 2 and cfg.data.seq_len == 32


@pytest.mark.parametrize("name", ["debug_llama", "debug_qwen2", "debug_qwen3", "demo", "llama_1b"])
def test_recipes_load(name):
    cfg = load_job_config(str(REPO / "configs" / f"{name}.yaml"))
    assert cfg.model.config["model_type"] in ("llama", "qwen2", "qwen3")


def test_llama_1b_recipe_is_a_1b_llama_in_bf16_on_packed_8k_rows():
    from headrace.training.models.build import build_hf_config, count_params

    cfg = load_job_config(str(REPO / "configs" / "llama_1b.yaml"))
    total, _ = count_params(build_hf_config(cfg.model))  # on the meta device: no memory
    assert 1.0e9 < total < 1.5e9, total
    assert (cfg.trainer.precision, cfg.distributed.strategy, cfg.data.seq_len) == ("bf16", "fsdp2", 8192)
    assert cfg.model.attn_implementation == "headrace_varlen" and cfg.data.packing == "best_fit"


def test_unsupported_layouts_fail_before_building():
    from transformers import AutoConfig

    from headrace.training.config.job_config import DistributedConfig
    from headrace.training.distributed.parallel_dims import ParallelDims
    from headrace.training.distributed.parallelize import check_supported

    fields = dict(TINY_LLAMA)
    hf = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with pytest.raises(ValueError, match="tp_size 8 must divide .* num_key_value_heads 4"):
        check_supported(ParallelDims.from_config(DistributedConfig(tp_size=8), 8), hf)
    # Families without a hand-written plan: TP from their own plan, without SP; none without a plan.
    mistral, stablelm = AutoConfig.for_model("mistral", **fields), AutoConfig.for_model("stablelm", **fields)
    check_supported(ParallelDims.from_config(DistributedConfig(tp_size=2), 2), mistral)
    with pytest.raises(ValueError, match="sequence_parallel: model_type 'mistral' has no sequence-parallel plan"):
        check_supported(ParallelDims.from_config(DistributedConfig(tp_size=2, sequence_parallel=True), 2), mistral)
    with pytest.raises(ValueError, match="'stablelm' has no base_model_tp_plan"):
        check_supported(ParallelDims.from_config(DistributedConfig(tp_size=2), 2), stablelm)
    # a style the trainer does not translate (EXAONE 4's per-head q/k norms) is refused naming module and style
    exaone4 = AutoConfig.for_model("exaone4", **fields)
    with pytest.raises(
        ValueError,
        match=r"'exaone4' uses TP styles \{'layers\.\*\.self_attn\.q_norm': "
        r"'replicated_with_grad_allreduce'.* that the trainer does not translate",
    ):
        check_supported(ParallelDims.from_config(DistributedConfig(tp_size=2), 2), exaone4)


def test_warmup_then_cosine():
    from headrace.training.components.optim import lr_at

    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_at(s, cfg, 104) for s in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert lr_at(54, cfg, 104) == pytest.approx(0.55)  # half way down the cosine
    assert lr_at(104, cfg, 104) == pytest.approx(0.1) and lr_at(500, cfg, 104) == pytest.approx(0.1)


def test_throughput_window_leaves_out_paused_time_and_earlier_waits(monkeypatch):
    """Figures over the steps since the window (re)started, on a fake clock: a paused span (validation,
    checkpoint) is not elapsed time, data waits of batches before the window do not count, pack fill comes
    from packed batches' ``fill`` only (None for batches that are not packed rows: bucketed audio). Two FLOP counts:
    full row (``flops_per_token``) and document-masked (matmuls per token + attention per (query, key) pair, the
    pairs summed over dp). Loader stage fractions: the stage seconds of the batches taken in the window."""
    from headrace.training.components import metrics

    now = [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    waits = [7.0]  # a batch handed out before the window
    window = metrics.ThroughputWindow(
        waits, 4, flops_per_token=10.0, peak=160.0, world=2, matmul_flops_per_token=4.0, flops_per_pair=0.5
    )
    waits.append(1.0)
    window.add(
        [{"input_ids": torch.zeros(2, 8), "labels": torch.zeros(2, 8), "fill": 0.75, "attention_pairs": 40}],
        token_ranks=2,
    )
    now[0] = 3.0
    with window.paused():
        now[0] = 103.0
    waits.append(1.0)
    labels = torch.tensor([[0] * 8, [-100] * 8])
    window.add([{"input_ids": torch.zeros(2, 8), "labels": labels, "attention_pairs": 24}], token_ranks=2)
    list(window.stages.watch([{"__times__": {"read": 1.0, "pack": 0.4}}, {"__times__": {"read": 1.0}}]))
    now[0] = 104.0  # 4 s of training in the window
    assert window.attention_pairs == 64
    figures, step_time = window.figures(6, attention_pairs=128)  # both dp ranks' pairs
    # document-masked: (64 tokens x 4 + 128 pairs x 0.5) / 4 s / 2 devices = 40; full row: 16 tok/s x 10 / 2 = 80
    assert figures == {
        "tokens_per_s": 16.0,
        "tokens_per_s_per_device": 8.0,
        "flops_per_s": 40.0,
        "mfu": 0.25,
        "flops_per_s_full_row": 80.0,
        "mfu_full_row": 0.5,
        "data_wait_frac": 0.5,
        "pack_fill": 0.75,
        # the loader stages of the batches taken in the window (headrace.dataio.stagetimes), over its 4 s
        **{"data_read_frac": 0.5, "data_decode_frac": 0.0, "data_pack_frac": 0.1, "data_collate_frac": 0.0},
        "data_h2d_frac": 0.0,
    }
    assert step_time == 1.0  # (4 s - 2 s of data wait) / 2 steps
    window.restart(6)
    waits.append(2.0)
    window.add([{"input_ids": torch.zeros(1, 8), "labels": torch.zeros(1, 8)}], token_ranks=1)
    now[0] = 108.0
    figures, step_time = window.figures(7)
    assert (figures["tokens_per_s"], figures["data_wait_frac"], figures["pack_fill"], step_time) == (
        2.0,
        0.5,
        None,
        2.0,
    )


# -- end to end, with a one-rank process group ----------------------------------------------------------------


def run_cli(*args) -> subprocess.CompletedProcess:
    env = child_env()
    return subprocess.run(
        [sys.executable, "-m", "headrace.training", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def losses(out_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())}


def test_cli_trains_exports_and_resumes_exactly_on_the_real_loader(tmp_path, process_group, capsys):
    """`python -m headrace.training` on packed shards: outputs, HF export, and stop-at-3 + resume == 6 straight steps
    (so the loader continued with exactly the batches the uninterrupted run saw next), the resume with
    `num_workers: auto` (whatever count it picks, the stream is the one the written count gave)."""
    from transformers import AutoModelForCausalLM

    from headrace.training.train import train

    make_text_dataset(tmp_path / "data", [60, 60])
    overrides = [
        f"data.datasets=[{{path: {tmp_path / 'data'}}}]",
        "data.seq_len=64",
        "data.packing_buffer=16",
        "trainer.max_steps=6",
        "optim.decay_steps=6",
        "checkpoint.interval=3",
        "logging.console=false",
    ]
    straight = tmp_path / "straight"
    proc = run_cli(
        "--config", "configs/debug_llama.yaml", f"trainer.output_dir={straight}", *overrides, "logging.console=true"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # A first run's stderr is the console's own lines: no third-party import noise (torchao, which transformers
    # imports whenever it is installed, logs failed CUDA-kernel loads and deprecations; headrace.training drops them).
    console = re.compile(r"step +\d+  loss |─+ summary ─+$|\d+ steps, loss ")
    assert proc.stderr and all(console.match(line) for line in proc.stderr.splitlines()), proc.stderr
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "loss", "lr", "tokens_per_s", "mfu", "data_wait_frac", "pack_fill", "max_mem"} <= records[0].keys()
    assert [r["step"] for r in records] == list(range(1, 7)) and records[0]["mfu"] is None
    assert 0.5 < records[0]["pack_fill"] <= 1.0
    assert (straight / "config.yaml").is_file() and (straight / "summary.json").is_file()
    assert sorted(p.name for p in (straight / "checkpoints").glob("step-*")) == ["step-00000003", "step-00000006"]
    hf = AutoModelForCausalLM.from_pretrained(straight / "hf")
    assert hf.config.model_type == "llama" and hf.config.hidden_size == TINY_LLAMA["hidden_size"]

    resumed = tmp_path / "resumed"
    copy_checkpoint(straight / "checkpoints" / "step-00000003", resumed / "checkpoints" / "step-00000003")
    cfg = load_job_config(
        str(REPO / "configs" / "debug_llama.yaml"),
        [f"trainer.output_dir={resumed}", *overrides, "data.num_workers=auto"],
    )
    capsys.readouterr()
    history = train(cfg)
    assert capsys.readouterr().out.count("data.num_workers: auto -> ") == 1  # rank 0's one line
    assert [r["step"] for r in history] == [4, 5, 6]
    want = losses(straight)
    assert [r["loss"] for r in history] == pytest.approx([want[s] for s in (4, 5, 6)], rel=1e-6)


@pytest.mark.parametrize("recipe, precision", [("debug_qwen2", "bf16"), ("debug_qwen3", "fp32")])
def test_qwen_recipes_train(tmp_path, process_group, recipe, precision):
    """Each recipe learns; bf16 on one rank runs through FSDP2's MixedPrecisionPolicy (no autocast), here with
    the tied embedding + lm_head weight the chunked loss reads."""
    from headrace.training.train import train

    make_text_dataset(tmp_path / "data", [40])
    cfg = load_job_config(
        str(REPO / "configs" / f"{recipe}.yaml"),
        [
            f"data.datasets=[{{path: {tmp_path / 'data'}}}]",
            "data.seq_len=64",
            "trainer.max_steps=8",
            f"trainer.precision={precision}",
            f"trainer.output_dir={tmp_path / 'out'}",
            "optim.lr=0.01",
            "logging.console=false",
            "checkpoint.interval=0",
            "data.packing_buffer=8",
        ],
    )
    history = train(cfg)
    assert history[-1]["loss"] < history[0]["loss"]
    assert (tmp_path / "out" / "hf" / "model-00001-of-00001.safetensors").is_file()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_train_reports_mfu_on_cuda(tmp_path):
    """The GPU recipe end to end through `python -m tools.bench_train` (few steps, 2k rows): figures come out, MFU
    is a fraction. The figures themselves are for BENCHMARKS.md, not asserted."""
    make_text_dataset(tmp_path / "data", [400, 400])
    env = child_env()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.bench_train",
            "--config",
            "configs/llama_1b.yaml",
            "--device",
            "cuda",
            "--sources",
            "headrace",
            "--steps",
            "6",
            "--warmup",
            "2",
            "--data",
            str(tmp_path / "data"),
            "--out",
            str(tmp_path / "out"),
            "data.seq_len=2048",
            "data.packing_buffer=64",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])["headrace"]
    assert result["tokens_per_s"] > 0 and 0 < result["mfu"] < 1 and 0 <= result["data_wait_frac"] < 1


def test_model_without_attention_interface_trains_one_document_per_row(tmp_path, process_group):
    """StableLM does not route attention through transformers' AttentionInterface: the trainer switches to
    sdpa with one document per row (padding after it), and its first loss is the HF model's own loss on
    that batch, computed document by document."""
    from headrace.dataio import build_loader
    from headrace.training.models.build import one_document_per_row
    from headrace.training.train import train

    make_text_dataset(tmp_path / "data", [24])
    save_pretrained_tiny(tmp_path / "m", {**TINY_LLAMA, "model_type": "stablelm", "vocab_size": 1024})
    cfg = load_job_config(
        None,
        base=base_job(
            tmp_path,
            model=dict(config=None, pretrained_path=str(tmp_path / "m")),
            data=dict(packing="best_fit"),
            trainer=dict(max_steps=2, output_dir=str(tmp_path / "out")),
            optim=dict(max_grad_norm=None),
            checkpoint=dict(interval=0, save_final=False, export_hf=False),
        ),
    )
    rows = one_document_per_row(cfg)
    assert (rows.model.attn_implementation, rows.data.packing) == ("sdpa", "none")
    batch = next(iter(build_loader(rows.data, 0, 1)))
    starts = (batch["position_ids"] == 0).sum(dim=1)
    assert (starts <= 2).all(), starts  # each row: one document, then at most one padding segment

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="sdpa")
    want = 0.0
    for ids, labels in zip(batch["input_ids"], batch["labels"]):
        keep = labels != -100
        logits = hf(input_ids=ids[keep][None]).logits[0]
        want += torch.nn.functional.cross_entropy(logits, labels[keep], reduction="sum").item()
    history = train(cfg)
    assert history[0]["loss"] == pytest.approx(want / int((batch["labels"] != -100).sum()), rel=1e-5)


AUTOMODEL_DISTRIBUTED = """
distributed:
  strategy: fsdp2 # fsdp2 | megatron_fsdp | ddp
  dp_size: none # auto-calculated from world_size / (tp * pp * cp)
  dp_replicate_size: none # FSDP2-only, for HSDP
  tp_size: 1
  pp_size: 1
  cp_size: 1
  ep_size: 1
  sequence_parallel: false
  activation_checkpointing: full
  defer_fsdp_grad_sync: true # FSDP2 only
  reshard_after_forward: null
  patch_is_packed_sequence: false
  offload_policy: null
  enable_compile: false
  pipeline:
    pp_schedule: 1f1b
    pp_microbatch_size: 1
"""


def test_automodel_distributed_block_loads_as_written(tmp_path):
    """The seed's Automodel ``distributed:`` block (its ``moe:`` sub-section belongs to the MoE issue) loads;
    Automodel options this trainer does not implement fail in one line naming the key and the reason."""
    import yaml

    job = base_job(tmp_path) | yaml.safe_load(AUTOMODEL_DISTRIBUTED)
    d = load_job_config(None, base=job).distributed
    assert (d.dp_size, d.dp_replicate_size, d.activation_checkpointing, d.compile, d.reshard_after_forward) == (
        None,
        None,
        True,
        False,
        True,
    )
    for override, message in (
        ("distributed.strategy=megatron_fsdp", "distributed.strategy: megatron_fsdp is not implemented"),
        ("distributed.zero_dp_strategy=3", "distributed.zero_dp_strategy: a MegatronFSDP option"),
        ("distributed.offload_policy={pin_memory: true}", "distributed.offload_policy=.* is not supported: use cpu"),
        ("distributed.mp_policy={param_dtype: bfloat16}", "distributed.mp_policy=.* use trainer.precision"),
        ("distributed.activation_checkpointing=selective", "activation_checkpointing=selective is not supported"),
        ("distributed.enable_fsdp2_prefetch=true", "distributed.enable_fsdp2_prefetch=True is not supported"),
        ("distributed.tp_plan={a: b}", "distributed.tp_plan=.* custom TP plans are not loaded"),
    ):
        with pytest.raises(ConfigError, match=message) as err:
            load_job_config(None, [override], base=copy.deepcopy(job))
        assert "\n" not in str(err.value)


def test_wandb_offline_and_profiler_trace(tmp_path, process_group, monkeypatch):
    """``logging.wandb`` in offline mode (no network) records every logged loss in the run file;
    ``trainer.profile`` writes a Chrome trace holding exactly the chosen steps."""
    from headrace.training.train import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    make_text_dataset(tmp_path / "data", [40])
    cfg = load_job_config(
        None,
        base=base_job(
            tmp_path,
            model=dict(config=dict(TINY_LLAMA, vocab_size=1024)),
            trainer=dict(max_steps=4, output_dir=str(tmp_path / "out"), profile=dict(start=2, steps=2)),
            logging=dict(wandb=dict(project="headrace-test", mode="offline")),
            checkpoint=dict(interval=0, save_final=False, export_hf=False),
        ),
    )
    history = train(cfg)
    (run_file,) = (tmp_path / "out" / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    assert all(json.dumps(r["loss"]).encode() in data for r in history), [r["loss"] for r in history]
    trace = json.loads((tmp_path / "out" / "profile" / "rank0.pt.trace.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("train_step")}
    assert steps == {"train_step 2", "train_step 3"}, steps
    with pytest.raises(ConfigError, match=r"JobConfig\.logging\.wandb\.projekt: unknown key"):
        load_job_config(None, ["logging.wandb={projekt: x}"], base=base_job(tmp_path))
