"""Optional Weights & Biases sink for rank 0's metrics (``logging.wandb``; the ``wandb`` extra).

One run per job: the resolved job config is the run's config, every logged record goes to ``train/<key>``
at its step (the same numbers as ``metrics.jsonl``), and the end-of-run summary becomes the run summary.
``mode: offline`` (or ``WANDB_MODE=offline``) writes the run under ``output_dir/wandb`` with no network;
``wandb sync output_dir/wandb/offline-run-*`` uploads it later.
"""

from __future__ import annotations

from pathlib import Path

from headrace.training.config.job_config import WandbConfig


def open_run(cfg: WandbConfig, output_dir: Path, run_config: dict):
    """Start the run (rank 0 only); an ImportError says which extra to install."""
    try:
        import wandb
    except ImportError as e:
        raise ImportError("logging.wandb needs the wandb package: pip install 'headrace[wandb]'") from e
    return wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        name=cfg.name,
        group=cfg.group,
        tags=cfg.tags or None,
        mode=cfg.mode,
        dir=str(output_dir),
        config=run_config,
    )


def log(run, record: dict) -> None:
    run.log(
        {f"train/{k}": v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}, step=record["step"]
    )


def finish(run) -> None:
    """End the run and stop wandb's service process: ``finish`` alone returns before the service has
    written the last records to the offline run file (seen here: a logged step absent when read right after)."""
    import wandb

    run.finish()
    wandb.teardown()


__all__ = ["finish", "log", "open_run"]
