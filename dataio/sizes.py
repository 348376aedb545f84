"""Byte sizes as people write them in options and configs: ``512MB``, ``1.5GiB``, ``100k``, ``4096``.

Shared by ``dataio shard --shard-size`` and the ``data:`` section's ``cache_limit``. Decimal units
(k = 1000) unless the unit has an ``i`` (KiB = 1024); the ``B`` is optional and case does not matter.
"""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``"512MB"``, ``"1.5GiB"``, ``"100k"`` or ``"4096"`` (decimal units unless ``i``)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 512MB, 1GiB, 4096)")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), bool(m.group(3))
    scale = (1024 if binary else 1000) ** "_KMGT".index(unit or "_")
    value = int(number * scale)
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return value


__all__ = ["parse_size"]
