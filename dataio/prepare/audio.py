"""Audio re-encoding for ``dataio shard``: recognise, cut and re-encode audio with soundfile.

Audio is kept as given whenever possible: no decode, one header probe to validate it and learn its
sample rate and length (``headrace.dataio.shards.audioheader``), and the payload is later copied file-to-file by
the kernel (tarwriter.py). It is decoded and re-encoded only for ``offset``/``duration`` segments and
when ``--audio-format`` asks for a different codec. Re-encoding reads integer PCM (``int32``) and writes
the source's bit depth when the target codec has it, so 16- and 24-bit sources stay lossless in FLAC.
"""

from __future__ import annotations

import io
import os
import stat

import numpy as np
import soundfile as sf

ENCODE_FORMATS = {"flac": ("FLAC", "flac"), "wav": ("WAV", "wav"), "opus": ("OGG", "opus")}
_LOSSLESS_SUBTYPES = {"PCM_16", "PCM_24"}


def sniff_ext(data: bytes) -> str | None:
    """The audio extension that matches ``data``'s magic bytes, or None."""
    head = bytes(data[:64])
    if head.startswith(b"fLaC"):
        return "flac"
    if head.startswith(b"RIFF") and head[8:12] == b"WAVE":
        return "wav"
    if head.startswith(b"OggS"):
        return "opus" if b"OpusHead" in head else "ogg"
    if head.startswith(b"ID3") or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def _target_subtype(fmt: str, source_subtype: str) -> str:
    if fmt == "opus":
        return "OPUS"
    return source_subtype if source_subtype in _LOSSLESS_SUBTYPES else "PCM_16"


def encode(samples: np.ndarray, sample_rate: int, fmt: str, *, source_subtype: str = "PCM_16") -> bytes:
    """Encode a ``(frames, channels)`` or ``(frames,)`` array as ``fmt`` (a key of ENCODE_FORMATS)."""
    container, _ = ENCODE_FORMATS[fmt]
    out = io.BytesIO()
    sf.write(out, samples, sample_rate, format=container, subtype=_target_subtype(fmt, source_subtype))
    return out.getvalue()


def cut_and_encode(source, fmt: str, *, offset: float = 0.0, duration: float | None = None) -> tuple[bytes, int, int]:
    """Decode ``[offset, offset + duration)`` seconds of ``source`` (path or bytes) and encode it.

    Returns ``(encoded bytes, sample_rate, frames)``. ValueError when the audio is unreadable or the
    segment lies outside it.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(source)
    elif not stat.S_ISREG(os.stat(source).st_mode):  # opening a FIFO would block forever
        raise ValueError("not a regular file (a FIFO, device or directory cannot be an input)")
    try:
        with sf.SoundFile(source) as f:
            start = int(round(offset * f.samplerate))
            stop = f.frames if duration is None else start + int(round(duration * f.samplerate))
            if start >= f.frames or stop <= start or stop > f.frames + f.samplerate // 100:  # tolerate 10 ms rounding
                raise ValueError(
                    f"segment [{offset}, {offset + (duration or 0)}) s lies outside the "
                    f"audio ({f.frames / f.samplerate:.3f} s)"
                )
            f.seek(start)
            samples = f.read(min(stop, f.frames) - start, dtype="int32", always_2d=True)
            sample_rate, subtype = f.samplerate, f.subtype
    except sf.SoundFileError as e:
        raise ValueError(f"unreadable audio ({e})") from None
    return encode(samples, sample_rate, fmt, source_subtype=subtype), sample_rate, len(samples)
