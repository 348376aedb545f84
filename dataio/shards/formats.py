"""Member formats: which extensions are audio or tokens, and the ``.npy`` header, parsed safely.

Torch-free and cheap to import: the indexer (``dataio index`` / ``verify``), the shard writer and the
loader's decoder all share these rules, so a member is classified the same way everywhere.

``npy_header`` matches the canonical v1 header that ``np.save`` and ``dataio shard`` write with one
regex over the raw buffer (~1 us, no copy); anything else goes through numpy's own safe reader
(``ast.literal_eval``, ~20 us). Neither path can unpickle. ``npy_bytes`` writes that header for a 1-D
array (what ``dataio shard`` and the benchmarks store as ``tokens.npy``).
"""

from __future__ import annotations

import io
import re

import numpy as np
from numpy.lib import format as npy_format

# Audio files `dataio shard` takes as input (its header parser and re-encoder cover them), in the
# order its error message lists them.
SHARD_AUDIO_EXTENSIONS = ("flac", "wav", "opus", "mp3", "ogg")
# What libsndfile decodes (soundfile, DALI's decoder); members with these extensions are audio.
AUDIO_EXTENSIONS = frozenset({*SHARD_AUDIO_EXTENSIONS, "sph", "aiff", "aif"})
NPY_HEADER_MAX = 4096

_NPY_CANONICAL = re.compile(
    rb"\x93NUMPY\x01\x00(..)\{'descr': '([<>|][biuf][1248])', 'fortran_order': "
    rb"(False|True), 'shape': \(([0-9, ]*)\), \} *\n",
    re.DOTALL,
)
_NPY_READERS = {(1, 0): npy_format.read_array_header_1_0, (2, 0): npy_format.read_array_header_2_0}
_DTYPES: dict[bytes, np.dtype] = {}


def is_audio_member(ext: str) -> bool:
    """``flac``, ``audio.wav``, ...: the last dotted part names the format."""
    return ext.rpartition(".")[2].lower() in AUDIO_EXTENSIONS


# A conversation's trained-token mask (uint8, 1 on the assistant's tokens; headrace.dataio.prepare.chat): an
# .npy member beside the token ids, never a document of its own.
TRAINED_MASK_MEMBER = "trained.npy"


def is_token_member(ext: str) -> bool:
    return (ext == "npy" or ext.endswith(".npy")) and ext != TRAINED_MASK_MEMBER


def npy_header(payload) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """``(shape, fortran_order, dtype, data offset)`` of a ``.npy`` payload (bytes-like), never unpickling.

    ValueError for a payload that is not ``.npy``, runs past its end, or holds Python objects.
    """
    m = _NPY_CANONICAL.match(payload)
    if m is not None and int.from_bytes(m[1], "little") == m.end() - 10:
        descr = m[2]
        dtype = _DTYPES.get(descr) or _DTYPES.setdefault(descr, np.dtype(descr.decode()))
        return tuple(int(d) for d in m[4].split(b",") if d.strip()), m[3] == b"True", dtype, m.end()
    view = memoryview(payload)
    if len(view) < 10 or view[:6] != b"\x93NUMPY":
        raise ValueError("not an .npy payload (bad magic)")
    version = (view[6], view[7])
    if version not in _NPY_READERS:  # numpy has no public reader for v3 (UTF-8 field names)
        raise ValueError(f"unsupported .npy format version {version[0]}.{version[1]}")
    start = 10 if version == (1, 0) else 12
    data_offset = start + int.from_bytes(view[8:start], "little")
    if data_offset > len(view):
        raise ValueError(f".npy header runs past the payload ({data_offset} > {len(view)} bytes)")
    f = io.BytesIO(bytes(view[:data_offset]))
    npy_format.read_magic(f)
    shape, fortran_order, dtype = _NPY_READERS[version](f, max_header_size=NPY_HEADER_MAX)
    if dtype.hasobject:
        raise ValueError(f".npy holds Python objects (dtype {dtype}); refusing: that would need pickle")
    return shape, fortran_order, dtype, f.tell()


def npy_bytes(array: np.ndarray) -> bytes:
    """A 1-D array as ``.npy`` (format 1.0) bytes; the header is formatted directly because
    ``np.save`` costs ~100 us per call, more than the rest of a text sample's writing."""
    header = f"{{'descr': '{array.dtype.str}', 'fortran_order': False, 'shape': ({len(array)},), }}"
    header += " " * (-(len(header) + 11) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + array.tobytes()
