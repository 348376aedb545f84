"""The binary rows of an index's ``samples.npy`` (one a sample: its shard, byte span, member rows, tokens,
duration) and ``members.npy`` (one a member: extension id, byte span), shared by the index and its checks."""

from __future__ import annotations

import numpy as np

SAMPLE_DTYPE = np.dtype(
    [
        ("shard", "<u4"),
        ("offset", "<u8"),
        ("size", "<u8"),
        ("member_start", "<u8"),
        ("member_count", "<u2"),
        ("tokens", "<i8"),
        ("duration", "<f4"),
    ]
)
MEMBER_DTYPE = np.dtype([("ext", "<u2"), ("offset", "<u8"), ("size", "<u8")])
