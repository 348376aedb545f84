"""Third-party import noise a headrace job does not print: each line silenced exactly, with its reason.

transformers imports torchao whenever it is installed (``transformers.quantizers`` probes it while
``modeling_utils`` loads), so every trainer and eval process imports torchao, though only
``quantize.linear.float8`` uses it. On that import torchao

- loads its CUDA-only kernels (``_C_mxfp8``, ``_C_cutlass_90a``) and logs ``Failed to load <file>: ...`` for each
  on a machine without CUDA. headrace calls none of them (float8 training runs torch's ``_scaled_mm``), so the
  line is dropped when CUDA is not available; on a CUDA machine a failed load means a broken install and stays.
- registers its enums as pytree constants, which torch logs as deprecated (``<enum 'KernelPreference'> is an Enum
  subclass and is now natively supported ...``): torchao's to change, nothing a user can act on; dropped for
  torchao's enums only.

Both are ``logging`` records, so one filter on each emitting logger drops them; ``headrace.training``'s
``__init__`` installs the filters before any of its modules imports transformers. Cost: a prefix test per record
of those two loggers; importing this module imports nothing heavy (no torch).
"""

from __future__ import annotations

import logging

_TORCHAO_LOGGER = "torchao"  # torchao/__init__.py: logging.getLogger(__name__)
_PYTREE_LOGGER = "torch.utils._pytree"  # register_constant's deprecation warning
_ENUM_DEPRECATION = "%s is an Enum subclass and is now natively supported"


def _torchao_cuda_kernels_without_cuda(record: logging.LogRecord) -> bool:
    """False (drop) for torchao's failed load of one of its own kernel libraries on a machine without CUDA."""
    message = record.getMessage()
    if not (message.startswith("Failed to load ") and "/torchao/_C" in message):
        return True
    import torch  # already imported: torchao imports it first

    return torch.cuda.is_available()


def _torchao_enum_deprecation(record: logging.LogRecord) -> bool:
    """False (drop) for torch's deprecation of ``register_constant`` on an Enum class that torchao defines."""
    if not (isinstance(record.msg, str) and record.msg.startswith(_ENUM_DEPRECATION) and record.args):
        return True
    cls = record.args[0]
    return not (isinstance(cls, type) and cls.__module__.split(".")[0] == "torchao")


def silence_torchao_import_noise() -> None:
    """Install the two filters (idempotent: a logger holds each function once)."""
    for name, rule in (
        (_TORCHAO_LOGGER, _torchao_cuda_kernels_without_cuda),
        (_PYTREE_LOGGER, _torchao_enum_deprecation),
    ):
        logger = logging.getLogger(name)
        if rule not in logger.filters:
            logger.addFilter(rule)


__all__ = ["silence_torchao_import_noise"]
