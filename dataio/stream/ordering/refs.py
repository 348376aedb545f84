"""Sample references (``__ref__``, packing's ``ref``): ``dataset << REF_BITS | global sample index``,
one int64 naming a sample of a blend (up to 2**23 datasets of up to 2**40 samples each)."""

from __future__ import annotations

import numpy as np

REF_BITS = 40
REF_MASK = (1 << REF_BITS) - 1


def make_ref(dataset: int | np.ndarray, index: int | np.ndarray):
    """The int64 reference of sample ``index`` of dataset ``dataset`` (vectorised)."""
    return (np.asarray(dataset, dtype=np.int64) << REF_BITS) | np.asarray(index, dtype=np.int64)


def split_ref(ref: int) -> tuple[int, int]:
    return int(ref) >> REF_BITS, int(ref) & REF_MASK


__all__ = ["REF_BITS", "REF_MASK", "make_ref", "split_ref"]
