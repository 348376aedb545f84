"""The two torchao import warnings ``headrace.training`` drops (training/import_noise.py), and only those: other
records of the same loggers still print. The end-to-end check (a trainer run's stderr) is in test_train.py."""

from __future__ import annotations

import enum
import logging

import torch

import headrace.training  # noqa: F401  (installs the filters)


def _kept(logger: str, msg: str, *args) -> bool:
    record = logging.LogRecord(logger, logging.WARNING, __file__, 1, msg, args, None)
    return bool(logging.getLogger(logger).filter(record))


class _Ours(enum.Enum):
    A = 1


def test_torchao_noise_is_dropped_and_nothing_else():
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    so = "/venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so"
    assert _kept("torchao", f"Failed to load {so}: Could not load this library: {so}") == torch.cuda.is_available()
    assert _kept("torchao", "Skipping import of cpp extensions due to incompatible torch version.")
    assert _kept("torchao", "Failed to load /elsewhere/libfoo.so: missing")
    deprecation = "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type."
    assert not _kept("torch.utils._pytree", deprecation, ScaleCalculationMode)
    assert _kept("torch.utils._pytree", deprecation, _Ours)  # someone else's enum: their warning to read
    assert _kept("torch.utils._pytree", "another warning %s", ScaleCalculationMode)
