"""Training metrics: throughput, MFU, data wait, pack fill, memory; to metrics.jsonl, the console, TensorBoard
and, when ``logging.wandb`` is set, Weights & Biases (``headrace.training.components.wandb_run``).

Loader stages (``data_read_frac`` .. ``data_h2d_frac``, ``headrace.dataio.stagetimes``): the seconds the window's
batches spent in each stage over the window's time.

Throughput figures cover a window: the steps since the last logged one (``ThroughputWindow``), less the
time spent validating or checkpointing in it, which is not training.

Model FLOPs, two counts, both logged:

- ``mfu`` / ``flops_per_s`` (document-masked, the honest one): ``6 * N`` per token for the matmuls of
  forward + backward over the non-embedding parameters (lm_head included), plus ``12 * layers * hidden``
  per (query, key) pair that the batch's document masks require: sum over documents of n(n+1)/2
  (``headrace.kernels.packed_layout.causal_pairs``, from each batch's ``cu_seqlens`` on the host, summed over the
  dp ranks). A row of short documents does far less attention work than a full causal row.
- ``mfu_full_row`` / ``flops_per_s_full_row``: the PaLM/torchtitan count ``6 * N + 12 * layers * hidden *
  seq_len`` per token, i.e. non-causal attention over the whole row: what the logs showed before, and
  what most trainers print, so it compares with them; an upper bound that overstates packed batches.

MFU divides achieved FLOP/s per device by the device's dense bf16 peak from ``PEAK_FLOPS``; on CPU there
is no meaningful peak, so both MFUs are null and the FLOP/s are reported instead.
Only rank 0 writes; every figure it logs is already reduced over ranks where that matters.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
from pathlib import Path

import torch

from headrace.config import to_dict
from headrace.dataio.stagetimes import StageTotals
from headrace.training.components import wandb_run
from headrace.training.errors import named_write
from headrace.training.models.build import count_params

# Dense bf16 tensor-core peak per device (FLOP/s), from the vendors' data sheets (no sparsity).
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe card is 756e12
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "B200": 2250e12,
    "GB200": 2500e12,
}


def matmul_flops_per_token(hf_config) -> float:
    """FLOPs of the parameter matmuls, forward + backward, per trained token: ``6 * N``."""
    _, non_embedding = count_params(hf_config)
    if getattr(hf_config, "tie_word_embeddings", False):
        non_embedding += hf_config.vocab_size * hf_config.hidden_size  # lm_head matmul still runs
    return 6.0 * non_embedding


def attention_flops_per_pair(hf_config) -> float:
    """FLOPs of attention scores and values, forward + backward, per (query, key) pair: ``12 * layers * hidden``."""
    return 12.0 * hf_config.num_hidden_layers * hf_config.hidden_size


def flops_per_token(hf_config, seq_len: int) -> float:
    """Full-row model FLOPs of forward + backward per trained token (``mfu_full_row``, module docstring)."""
    return matmul_flops_per_token(hf_config) + attention_flops_per_pair(hf_config) * seq_len


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of ``device`` when it is a known accelerator, else None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_FLOPS[key]
    return None


def max_memory_gib(device: torch.device) -> float:
    """Peak accelerator memory allocated, or this process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20  # bytes on macOS, KiB on Linux


class ThroughputWindow:
    """The steps since the last logged one: their tokens, attention pairs, pack fill and data wait, over wall
    time less the ``paused`` spans. ``world`` ranks share the work; ``peak`` is one device's FLOP/s (None: no
    MFU). ``flops_per_token``: the full-row count; ``matmul_flops_per_token`` + ``flops_per_pair`` x the
    dp ranks' attention pairs: the document-masked count (module docstring)."""

    def __init__(
        self,
        waits: list[float],
        step: int,
        *,
        flops_per_token: float,
        peak: float | None,
        world: int,
        matmul_flops_per_token: float = 0.0,
        flops_per_pair: float = 0.0,
    ):
        self.waits = waits  # the prefetcher's data wait per batch handed out (DevicePrefetcher.waits, appended to)
        self.flops_per_token, self.peak, self.world = flops_per_token, peak, world
        self.matmul_flops_per_token, self.flops_per_pair = matmul_flops_per_token, flops_per_pair
        # conversations longer than seq_len left out so far (data.long_conversations: skip), this rank's running
        # count from the loader; None without conversation data
        self.skipped_conversations: int | None = None
        self.stages = StageTotals()  # the loader's stage seconds of the batches taken (``stages.watch``)
        self.restart(step)

    def restart(self, step: int) -> None:
        """A new window, after ``step``."""
        self.start, self.first_batch, self.first_step = time.perf_counter(), len(self.waits), step
        self.stages_at = dict(self.stages.seconds)
        self.tokens, self.fill, self.attention_pairs = 0, [], 0

    def add(self, micro_batches: list[dict], token_ranks: int) -> None:
        """One step over ``micro_batches`` on each of ``token_ranks`` ranks holding distinct tokens (dp x cp)."""
        # labels: the rows' shape (input_ids' for text and SALM rows; a CTC batch's padded units)
        self.tokens += sum(mb["labels"].numel() for mb in micro_batches) * token_ranks
        # this rank's batches' pairs (host ints, headrace.kernels.packed_layout); summed over dp ranks in ``figures``
        self.attention_pairs += sum(mb["attention_pairs"] for mb in micro_batches if "attention_pairs" in mb)
        self.fill += [float(mb["fill"]) for mb in micro_batches if "fill" in mb]  # packed rows only (not audio)
        for mb in micro_batches:
            if "skipped_conversations" in mb:
                self.skipped_conversations = int(mb["skipped_conversations"])

    def figures(self, step: int, attention_pairs: float | None = None) -> tuple[dict, float]:
        """The window up to ``step``: its record fields (``tokens_per_s`` .. ``pack_fill``) and this rank's mean
        step time without data wait (``telemetry.rank_spread``'s). ``attention_pairs``: the window's pairs
        summed over the dp ranks (``telemetry.sum_over_dp``); None: this rank's (one dp rank)."""
        elapsed = time.perf_counter() - self.start
        tokens_per_s = self.tokens / elapsed
        full_row = tokens_per_s * self.flops_per_token / self.world
        pairs = self.attention_pairs if attention_pairs is None else attention_pairs
        flops_per_s = (self.tokens * self.matmul_flops_per_token + pairs * self.flops_per_pair) / elapsed / self.world
        wait = sum(self.waits[self.first_batch :])
        return {
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.world,
            "flops_per_s": flops_per_s,
            "mfu": flops_per_s / self.peak if self.peak else None,
            "flops_per_s_full_row": full_row,
            "mfu_full_row": full_row / self.peak if self.peak else None,
            "data_wait_frac": wait / elapsed,
            "pack_fill": sum(self.fill) / len(self.fill) if self.fill else None,
            **self.stages.fractions(self.stages_at, elapsed),
        }, (elapsed - wait) / (step - self.first_step)

    @contextlib.contextmanager
    def paused(self):
        """Leave the body's time out of the window."""
        start = time.perf_counter()
        yield
        self.start += time.perf_counter() - start


VAL_FIGURES = (("val_ppl", 2), ("val_listening_ratio", 3), ("val_wer", 3), ("val_cer", 3))  # console, beside the loss


class MetricsLogger:
    """Rank 0's sink for per-step metrics and the end-of-run summary."""

    def __init__(self, output_dir: str | Path, *, enabled: bool, console: bool, tensorboard: bool, wandb_run=None):
        self.enabled = enabled
        self.wandb_run = wandb_run  # a started wandb run (headrace.training.components.wandb_run) or None
        self.history: list[dict] = []
        self.val_history: list[dict] = []
        if not enabled:
            return
        self.output_dir = Path(output_dir)
        self.file = open(self.output_dir / "metrics.jsonl", "a")
        self.console = None
        if console:
            from rich.console import Console

            self.console = Console(stderr=True, highlight=False)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.output_dir / "tensorboard"))

    def log(self, record: dict) -> None:
        self.history.append(record)
        if not self.enabled:
            return
        self._write(record, lambda key: f"train/{key}")
        if self.console is not None:
            mfu = (
                f"mfu {record['mfu']:5.1%} (full row {record['mfu_full_row']:5.1%})"
                if record.get("mfu") is not None
                else f"{record['flops_per_s'] / 1e9:7.2f} GFLOP/s (full row {record['flops_per_s_full_row'] / 1e9:.2f})"
            )
            self.console.print(
                f"[bold]step {record['step']:>5}[/]  loss [cyan]{record['loss']:.4f}[/]  lr {record['lr']:.2e}  "
                f"gnorm {record['grad_norm']:.3f}  {record['tokens_per_s']:,.0f} tok/s "
                f"({record['tokens_per_s_per_device']:,.0f}/dev)  {mfu}  data wait {record['data_wait_frac']:.1%}  "
                + (f"pack fill {record['pack_fill']:.1%}  " if record["pack_fill"] is not None else "")
                + f"mem {record['max_mem']:.2f} GiB"
                + (
                    f"  pp bubble {record['pp_bubble_measured']:.2f} (theory {record['pp_bubble_theory']:.2f})"
                    if "pp_bubble_measured" in record
                    else ""
                ),
                soft_wrap=True,
            )

    def log_val(self, record: dict) -> None:
        """A validation record (``step``, ``val_*``) to metrics.jsonl, TensorBoard (``val/*``), the console."""
        self.val_history.append(record)
        if not self.enabled:
            return
        self._write(record, lambda key: f"val/{key.removeprefix('val_')}")
        if self.console is not None:
            figures = "".join(
                f"  {key.removeprefix('val_')} {record[key]:.{digits}f}" for key, digits in VAL_FIGURES if key in record
            )  # a CTC stage has no perplexity; a SALM's ratio, a CTC's WER / CER
            self.console.print(
                f"[bold]step {record['step']:>5}[/]  val loss [green]{record['val_loss']:.4f}[/]"
                f"{figures}  ({record['val_tokens']:,} tokens, {record['val_docs']:,} documents)",
                soft_wrap=True,
            )

    def log_decoded(self, step: int, result: dict) -> None:
        """A SALM's in-training decode (``headrace.training.speech.eval.decode_split``'s result) to metrics.jsonl and
        TensorBoard as ``val_wer`` and ``val_wer_utterances``: the WER curve beside the val losses."""
        if self.enabled:
            self._write(
                {"step": step, "val_wer": result["wer"], "val_wer_utterances": result["utterances"]},
                lambda key: f"val/{key.removeprefix('val_')}",
            )

    def _write(self, record: dict, tb_tag) -> None:
        """One metrics.jsonl line; every number but the step to TensorBoard under ``tb_tag(key)``."""
        with named_write(self.output_dir / "metrics.jsonl"):
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(tb_tag(key), value, record["step"])
        if self.wandb_run is not None:
            wandb_run.log(self.wandb_run, record)

    def summary(self, skip_first: int = 1, first_loss: float | None = None) -> dict:
        """Means over the logged steps after the first ``skip_first`` (warm-up), plus first/last loss
        (``first_loss``: the run's, which a resumed job did not log itself)."""
        if not self.history:
            return {}
        steady = self.history[skip_first:] or self.history
        mean = lambda key: sum(r[key] for r in steady) / len(steady)  # noqa: E731
        result = {
            "steps": self.history[-1]["step"],
            "first_loss": self.history[0]["loss"] if first_loss is None else first_loss,
            "last_loss": self.history[-1]["loss"],
            "tokens_per_s": mean("tokens_per_s"),
            "tokens_per_s_per_device": mean("tokens_per_s_per_device"),
            "data_wait_frac": mean("data_wait_frac"),
            "pack_fill": mean("pack_fill") if steady[0]["pack_fill"] is not None else None,
            "max_mem": max(r["max_mem"] for r in self.history),
            "mfu": mean("mfu") if steady[0].get("mfu") is not None else None,
            "mfu_full_row": mean("mfu_full_row") if steady[0].get("mfu_full_row") is not None else None,
            "flops_per_s": mean("flops_per_s"),
            "flops_per_s_full_row": mean("flops_per_s_full_row"),
        }
        if self.enabled:
            with named_write(self.output_dir / "summary.json"), open(self.output_dir / "summary.json", "w") as f:
                json.dump(result, f, indent=1)
            if self.wandb_run is not None:
                self.wandb_run.summary.update(result)
            if self.console is not None:
                mfu = (
                    f"MFU {result['mfu']:.1%} document-masked ({result['mfu_full_row']:.1%} full row)"
                    if result["mfu"] is not None
                    else f"{result['flops_per_s'] / 1e9:.2f} GFLOP/s document-masked "
                    f"({result['flops_per_s_full_row'] / 1e9:.2f} full row; no MFU on CPU)"
                )
                self.console.rule("summary")
                self.console.print(
                    f"{result['steps']} steps, loss {result['first_loss']:.4f} -> {result['last_loss']:.4f}; "
                    f"{result['tokens_per_s']:,.0f} tok/s ({result['tokens_per_s_per_device']:,.0f} per device), "
                    f"{mfu}, data wait {result['data_wait_frac']:.1%}, "
                    + (f"pack fill {result['pack_fill']:.1%}, " if result["pack_fill"] is not None else "")
                    + f"peak mem {result['max_mem']:.2f} GiB",
                    soft_wrap=True,
                )
        return result

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.tb is not None:
                self.tb.close()
            if self.wandb_run is not None:
                wandb_run.finish(self.wandb_run)


def build_metrics_logger(cfg, rank: int) -> MetricsLogger:
    """The job's sink (``cfg`` a JobConfig): rank 0 writes under ``trainer.output_dir`` (and opens the wandb run
    when ``logging.wandb``), the other ranks only keep the history."""
    out_dir = Path(cfg.trainer.output_dir)
    run = wandb_run.open_run(cfg.logging.wandb, out_dir, to_dict(cfg)) if cfg.logging.wandb and rank == 0 else None
    return MetricsLogger(
        out_dir, enabled=rank == 0, console=cfg.logging.console, tensorboard=cfg.logging.tensorboard, wandb_run=run
    )


__all__ = [
    "PEAK_FLOPS",
    "MetricsLogger",
    "ThroughputWindow",
    "attention_flops_per_pair",
    "build_metrics_logger",
    "flops_per_token",
    "matmul_flops_per_token",
    "max_memory_gib",
    "peak_flops",
]
