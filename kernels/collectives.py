"""Flat all-gather and reduce-scatter across the supported torch range, in one place.

torch 2.13 names them ``all_gather_single`` / ``reduce_scatter_single`` and deprecates the ``*_tensor`` names (a
FutureWarning on every call); torch 2.11, the floor, has only ``all_gather_into_tensor`` /
``reduce_scatter_tensor``. Same arguments in both: ``(output, input, group=...)``, flat outputs (gloo needs them).
"""

from __future__ import annotations

import torch.distributed as dist

# A version switch, not a check. The newer names are looked up by string: the floor lacks them, and the floor
# record (tools/torch_api.py, tests/test_dependencies.py) holds the attribute paths every torch in range must have.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["all_gather_flat", "reduce_scatter_flat"]
