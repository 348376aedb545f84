"""Member decoding: turn a sample's raw tar members into tensors and Python values, by extension.

``decode_sample(members, cfg, key=..., shard=...)`` is the per-sample hot path the loader calls. Each
member is routed by the last dot-part of its extension (``tokens.npy`` -> ``npy``) through one
module-level table, built once at import:

- ``npy``: token arrays -> ``torch.Tensor`` sharing memory with the member buffer (zero copies). The
  header is parsed by one strict regex for the canonical form numpy writes (~6 us a member in all;
  numpy's own safe reader spends ~20 us in ``ast.literal_eval``) and falls back to numpy's reader for
  anything else; ``allow_pickle`` is never on, so object arrays are refused. With ``defer_npy`` (the
  loader's plain batches) a 1-D native-order array is only checked and stays an ``NpyView``:
  ``headrace.dataio.stream.reading.collate`` then copies the whole batch's payloads into one tensor, so no per-sample tensor
  is made (~9 us a sample for read + check + copy, against ~14 us through per-sample tensors).
- ``json`` -> ``json.loads``; ``txt`` -> ``str`` (UTF-8); ``cls``/``cls2``/``class``/``index``/``id``
  /``count`` -> ``int``.
- audio (``flac wav ogg opus mp3``, what libsndfile decodes) -> ``Audio(waveform, sample_rate)``
  through soundfile (the libsndfile build ``decode.libsndfile`` picks, ``headrace.dataio.libsndfile``),
  downmixed to mono and resampled with soxr to ``cfg.sample_rate``. With ``defer_audio`` (the loader's
  plain batches) a FLAC / WAV member only has its header parsed and checked here (``PendingAudio``) and
  is decoded with the rest of its batch straight into the batch tensor (``headrace.dataio.stream.reading.audio_batch``). With
  ``cfg.audio == "dali"`` audio members pass through as raw buffers for the loader to decode per
  batch with ``headrace.dataio.stream.reading.dali.decode_audio_members``; with ``"raw"`` they stay encoded (collated as
  ``uint8`` bytes + lengths) for a decoder downstream, e.g. on the GPU in the training step.
- ``pyd pickle pkl pth pt``: refused with ``UnsafeMemberError``; nothing here ever unpickles.
- anything else: passed through as ``bytes``.

Every failure raises ``SampleDecodeError`` (shard, key, member in the message and as attributes), the
one exception the loader counts against ``max_bad_samples``.

Read-only buffers: a ``bytes`` member yields a tensor over immutable memory. We keep it zero-copy (the
tensor holds a reference to the buffer, so lifetime is safe) and document that token tensors are to be
read, not written in place; the packer copies them into its batch buffer anyway. The loader should
hand in memoryviews of a block it does not reuse while samples are alive.
"""

from __future__ import annotations

import io
import json
import math
import re
import sys
import warnings
from typing import Any, Callable, NamedTuple

import numpy as np
import soundfile
import soxr
import torch

from headrace.dataio.shards.audioheader import (
    HEADER_BYTES,
    UNKNOWN_FRAMES,
    WavFormat,
    check_declared,
    parse_header,
    read_unknown_length,
    wav_format,
)
from headrace.dataio import libsndfile
from headrace.dataio.config import DecodeConfig
from headrace.dataio.shards.formats import AUDIO_EXTENSIONS, npy_header
from headrace.dataio.usererror import SampleDecodeError

Buffer = bytes | bytearray | memoryview

PICKLE_EXTENSIONS = frozenset({"pyd", "pickle", "pkl", "pth", "pt"})
NATIVE_LITTLE = sys.byteorder == "little"


class Audio(NamedTuple):
    """A decoded audio member: ``waveform`` is ``[T]`` when mono, else ``[C, T]``."""

    waveform: torch.Tensor
    sample_rate: int


class UnsafeMemberError(SampleDecodeError):
    """A pickle-based member (.pyd/.pickle/.pkl/.pth/.pt); headrace never unpickles shard data."""


# ---------------------------------------------------------------------------------------------- npy

# Read-only members (bytes) give tensors over immutable memory on purpose (see the module docstring);
# torch's "not writable" warning is silenced for calls from this module only (a per-call
# warnings.catch_warnings would cost 3 us a sample).
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", module=__name__)


def decode_npy(buf: Buffer) -> torch.Tensor:
    """An ``.npy`` member as a tensor over ``buf``'s memory (no copy unless byte order or alignment forces one)."""
    shape, fortran_order, dtype, data_offset = _npy_parts(buf)
    array = np.frombuffer(buf, dtype=dtype, count=math.prod(shape), offset=data_offset)
    if len(shape) != 1:
        array = array.reshape(shape[::-1]).T if fortran_order else array.reshape(shape)
    if not (dtype.isnative and array.flags.aligned):
        array = array.astype(dtype.newbyteorder("="))  # torch needs native order and alignment; one copy
    return torch.from_numpy(array)  # over a read-only buffer too: shared on purpose, see the module docstring


class NpyView(NamedTuple):
    """A checked 1-D native-order ``.npy`` member, not turned into a tensor: ``headrace.dataio.stream.reading.collate`` copies
    a batch of them straight into the batch tensor (one ``memcpy`` each, no per-sample tensor)."""

    buf: Buffer
    offset: int  # of the data, in bytes
    count: int
    dtype: np.dtype

    def tensor(self) -> torch.Tensor:
        return decode_npy(self.buf)


# The header np.save writes for a 1-D little-endian numeric array, the loader's hot case: one regex
# and one dict look-up (headrace.dataio.shards.formats.npy_header, the general parser, handles everything else).
_NPY_1D = re.compile(
    rb"\x93NUMPY\x01\x00..\{'descr': '(<[iuf][248]|\|[iu]1)', 'fortran_order': False, "
    rb"'shape': \(([0-9]+),\), \} *\n",
    re.DOTALL,
)
NPY_1D_DTYPES = {
    f"{order}{kind}{size}".encode(): np.dtype(f"{order}{kind}{size}")
    for kind in "iuf"
    for order, size in [("<", 2), ("<", 4), ("<", 8), ("|", 1)]
    if (kind, size) != ("f", 1)
}


def npy_view(buf: Buffer) -> NpyView | torch.Tensor:
    """``decode_npy`` deferred to the batch for 1-D native-order arrays (the header is checked now)."""
    m = _NPY_1D.match(buf) if NATIVE_LITTLE else None
    if m is not None and m.end() - 10 == buf[8] | buf[9] << 8:
        dtype, count = NPY_1D_DTYPES[m[1]], int(m[2])
        _check_payload(buf, m.end(), (count,), dtype)
        return NpyView(buf, m.end(), count, dtype)
    shape, _, dtype, data_offset = _npy_parts(buf)
    if len(shape) == 1 and dtype.isnative:
        return NpyView(buf, data_offset, shape[0], dtype)
    return decode_npy(buf)


def npy_1d_layout(buf: Buffer) -> tuple[np.dtype, int, int] | None:
    """``(dtype, where the shape's digits start, data offset)`` of a canonical 1-D native-order ``.npy``
    header (the form ``npy_view`` takes its fast path for), else None: the template
    ``headrace.dataio.stream.reading.gather`` checks a batch's other headers against byte for byte."""
    m = _NPY_1D.match(buf) if NATIVE_LITTLE else None
    if m is None or m.end() - 10 != buf[8] | buf[9] << 8:
        return None
    return NPY_1D_DTYPES[m[1]], m.start(2), m.end()


def _npy_parts(buf: Buffer) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    shape, fortran_order, dtype, data_offset = npy_header(buf)
    _check_payload(buf, data_offset, shape, dtype)
    return shape, fortran_order, dtype, data_offset


def _check_payload(buf: Buffer, data_offset: int, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """The member holds exactly the header's array: fewer bytes is truncation, more is a member that is
    not what its header says (the verdict ``dataio verify`` gives too; tests/fuzz.py found them apart)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if data_offset + nbytes > len(buf):
        raise ValueError(f".npy payload truncated: shape {shape} needs {nbytes} bytes of data")
    if data_offset + nbytes < len(buf):
        raise ValueError(f".npy member has {len(buf) - data_offset - nbytes} bytes beyond its shape {shape}")


# -------------------------------------------------------------------------------------------- audio


def decode_audio(buf: Buffer, cfg: DecodeConfig) -> Audio:
    """Decode an audio payload with libsndfile, downmix and resample per ``cfg``."""
    libsndfile.use(cfg.libsndfile)
    with soundfile.SoundFile(io.BytesIO(buf)) as f:
        rate = f.samplerate
        if f.frames == UNKNOWN_FRAMES:  # a valid FLAC that leaves its length open: counted as decoded
            audio = read_unknown_length(f, cfg.dtype, len(buf))
            check_declared(rate, len(audio), len(buf), max_duration=cfg.max_duration)
            return _audio(downmixed_and_resampled(audio, rate, cfg), rate, cfg)
        check_declared(rate, f.frames, len(buf), max_duration=cfg.max_duration)  # before allocating for it
        try:
            audio = f.read(dtype=cfg.dtype, always_2d=True)  # [T, C]
        except MemoryError:  # the header's declared size explains it: this sample's fault, not the process's
            declared = f.frames * f.channels * np.dtype(cfg.dtype).itemsize
            raise ValueError(
                f"cannot allocate the {declared / 2**30:.1f} GiB its header declares "
                f"({f.frames} frames x {f.channels} channels)"
            ) from None
    return _audio(downmixed_and_resampled(audio, rate, cfg), rate, cfg)


def _audio(audio: np.ndarray, rate: int, cfg: DecodeConfig) -> Audio:
    if audio.ndim == 2:
        audio = np.ascontiguousarray(audio.T)  # [C, T], the torch/torchaudio convention
    return Audio(torch.from_numpy(audio), cfg.sample_rate or rate)


def downmixed_and_resampled(audio: np.ndarray, rate: int, cfg: DecodeConfig) -> np.ndarray:
    """Decoded ``[T, C]`` samples at ``rate`` as ``cfg`` asks: ``[T]`` when ``cfg.mono`` (the channel
    mean, taken in float32 and cast back for int16), resampled by soxr to ``cfg.sample_rate``. Shared
    by ``decode_audio`` and the batch path (``headrace.dataio.stream.reading.audio_batch``), which give the same values."""
    if cfg.mono and audio.shape[1] > 1:
        audio = audio.mean(axis=1, dtype=np.float32)
        if cfg.dtype == "int16":
            audio = audio.astype(np.int16)
    elif cfg.mono:
        audio = audio[:, 0]
    if cfg.sample_rate not in (None, rate):
        audio = soxr.resample(audio, rate, cfg.sample_rate, quality=cfg.resample_quality)
    return audio


class PendingAudio(NamedTuple):
    """An audio member whose header was parsed and checked but not yet decoded: the loader decodes a
    batch of them straight into the batch tensor (``headrace.dataio.stream.reading.audio_batch``)."""

    buf: Buffer
    rate: int  # the file's
    frames: int  # the file's, as its header declares
    out_frames: int  # at most this many at the target rate (the room it takes in the batch)
    wav: WavFormat | None  # the layout of a WAV (read without libsndfile when it is 16-bit PCM or float)


# Decoded bytes a member may declare per encoded byte and still be decoded into the batch: real FLAC
# speech is 2-4 (float32 out), digital silence ~20; a header declaring more (up to the 6000 frames a
# byte check_declared allows) is decoded alone by decode_audio, which names it if it cannot be allocated.
MAX_DECODED_PER_ENCODED = 64


def pending_audio(buf: Buffer, cfg: DecodeConfig) -> PendingAudio | None:
    """``buf`` as a ``PendingAudio`` when its FLAC / WAV header parses (``headrace.dataio.shards.audioheader``, ~5 us)
    and it decodes to one channel at most ``MAX_DECODED_PER_ENCODED`` x its size; None when
    ``decode_audio`` should decode it now (other codecs, ``mono: false``, unusual headers)."""
    if not cfg.mono:
        return None
    head = bytes(buf[:HEADER_BYTES])
    wav = wav_format(head, len(buf)) if head.startswith(b"RIFF") and head[8:12] == b"WAVE" else None
    parsed = (wav.rate, wav.frames) if wav is not None else parse_header(head, len(buf))  # one parse per header
    if parsed is None:
        return None
    rate, frames = parsed
    check_declared(rate, frames, len(buf), max_duration=cfg.max_duration)
    target = cfg.sample_rate or rate
    out_frames = frames if target == rate else -(-frames * target // rate)  # soxr rounds the duration: <= ceil
    if out_frames * 4 > MAX_DECODED_PER_ENCODED * len(buf):
        return None
    return PendingAudio(buf, rate, frames, out_frames, wav)


# --------------------------------------------------------------------------------------------- text


def decode_json(buf: Buffer) -> Any:
    return json.loads(bytes(buf))


def decode_text(buf: Buffer) -> str:
    return str(buf, "utf-8")


def decode_int(buf: Buffer) -> int:
    return int(bytes(buf))


# -------------------------------------------------------------------------------------------- table


def _decode_npy(buf: Buffer, cfg: DecodeConfig) -> torch.Tensor:
    return decode_npy(buf)


def _decode_audio(buf: Buffer, cfg: DecodeConfig) -> Audio | memoryview:
    # With audio: dali (or raw) the buffer stays encoded, as a memoryview whether the source gave a view
    # or bytes, so that headrace.dataio.stream.reading.collate makes it a uint8 tensor (and headrace.dataio.stream.reading.dali decodes a batch at once).
    return decode_audio(buf, cfg) if cfg.audio == "soundfile" else memoryview(buf)


_DECODERS: dict[str, Callable[[Buffer, DecodeConfig], Any]] = {
    "npy": _decode_npy,
    "json": lambda buf, cfg: decode_json(buf),
    "txt": lambda buf, cfg: decode_text(buf),
    **{ext: lambda buf, cfg: decode_int(buf) for ext in ("cls", "cls2", "class", "index", "id", "count")},
    **{ext: _decode_audio for ext in AUDIO_EXTENSIONS},
}


def _refuse_pickle(buf: Buffer, cfg: DecodeConfig) -> Any:
    raise UnsafeMemberError("pickle-based members are never loaded (untrusted data); store tensors as .npy")


def _pass_bytes(buf: Buffer, cfg: DecodeConfig) -> bytes:
    return bytes(buf)  # no copy when buf is already bytes; a copy detaches views of a reusable block


# Full extension -> decoder, filled on first use, so the hot path is one dict lookup per member.
_decoder_by_ext: dict[str, Callable[[Buffer, DecodeConfig], Any]] = {}


def decoder_for(ext: str) -> Callable[[Buffer, DecodeConfig], Any]:
    """The decoder for member extension ``ext`` (``"flac"``, ``"tokens.npy"``), chosen by its last dot-part."""
    decoder = _decoder_by_ext.get(ext)
    if decoder is None:
        suffix = ext.rpartition(".")[2].lower()
        decoder = _refuse_pickle if suffix in PICKLE_EXTENSIONS else _DECODERS.get(suffix, _pass_bytes)
        _decoder_by_ext[ext] = decoder
    return decoder


def decode_sample(
    members: dict[str, Buffer],
    cfg: DecodeConfig,
    *,
    key: str | None = None,
    shard: str | None = None,
    defer_npy: bool = False,
    defer_audio: bool = False,
) -> dict[str, Any]:
    """Decode one sample's members: ``{ext: raw buffer}`` -> ``{ext: value}`` (same keys, same order).

    ``key`` and ``shard`` only label errors. ``defer_npy``: 1-D ``.npy`` members become checked
    ``NpyView``s for ``headrace.dataio.stream.reading.collate`` to copy into the batch (the loader's plain batches).
    ``defer_audio`` (with ``audio: soundfile``): FLAC / WAV members whose headers parse become checked
    ``PendingAudio`` for ``headrace.dataio.stream.reading.audio_batch`` to decode into the batch tensor. Raises
    ``SampleDecodeError`` (``UnsafeMemberError`` for pickle members) naming shard, key and member;
    the loader counts it against ``max_bad_samples``.
    Token tensors share memory with their buffers, so do not reuse a block while its samples live.
    """
    out = {}
    defer_audio = defer_audio and cfg.audio == "soundfile"
    for ext, buf in members.items():
        try:
            decoder = decoder_for(ext)
            if defer_npy and decoder is _decode_npy:
                out[ext] = npy_view(buf)
            elif defer_audio and decoder is _decode_audio:
                out[ext] = pending_audio(buf, cfg) or decode_audio(buf, cfg)
            else:
                out[ext] = decoder(buf, cfg)
        except SampleDecodeError as e:
            raise member_error(e, shard=shard, key=key, member=ext) from None
        except MemoryError:
            raise
        except Exception as e:
            raise member_error(e, shard=shard, key=key, member=ext) from e
    return out


TOKEN_ID_LIMIT = 2**63  # batches hold int64 ids: a uint64 id at or past this would wrap to a negative one


def check_token_document(value: NpyView | torch.Tensor) -> None:
    """ValueError unless a decoded ``.npy`` member can be a document of token ids for packing: 1-D,
    integer, every id in ``[0, TOKEN_ID_LIMIT)`` (values read for signed and 64-bit unsigned dtypes only: O(tokens),
    the general path's cost; uint8/16/32 ids fit by their type)."""
    if isinstance(value, NpyView):
        if value.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got {value.dtype}")
        if value.dtype.kind == "u" and value.dtype.itemsize < 8:
            return
        value = value.tensor()
    if value.ndim != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
        raise ValueError(f"token ids must be a 1-D integer array, got {value.dtype} of shape {tuple(value.shape)}")
    if not len(value):
        return
    check_fits_int64(value)
    if value.dtype.is_signed and int(value.min()) < 0:
        raise ValueError(f"negative token id {int(value.min())}")


def check_fits_int64(value: NpyView | torch.Tensor) -> None:
    """ValueError when a ``uint64`` array holds a value at or past ``TOKEN_ID_LIMIT``: batches (plain or packed) and
    the trainer hold int64 ids, where it would wrap to a negative one (values read for uint64 only)."""
    if isinstance(value, NpyView):
        if value.dtype != np.uint64:
            return
        value = value.tensor()
    if value.dtype == torch.uint64 and value.numel():  # torch has no max of uint64: numpy's, over the same memory
        if (largest := int(value.numpy().max())) >= TOKEN_ID_LIMIT:
            raise ValueError(f"token id {largest} does not fit int64 (uint64 ids must stay below 2**63)")


def member_error(e: Exception, *, shard: str | None, key: str | None, member: str) -> SampleDecodeError:
    """``e`` (from decoding ``member``) as the ``SampleDecodeError`` that names the sample: any library's
    complaint about a bad payload becomes this one error type."""
    if isinstance(e, SampleDecodeError):
        return type(e)(e.reason, shard=shard, key=key, member=member)
    return SampleDecodeError(f"{type(e).__name__}: {e}", shard=shard, key=key, member=member)
