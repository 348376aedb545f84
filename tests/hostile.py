"""Builders of hostile inputs shared by the regression tests and the fuzz harness: valid tars with one
header field rewritten (checksum fixed up, so the damage is the field itself), PAX headers with chosen
records, FLAC/WAV files whose headers lie, and WAV files built chunk by chunk."""

from __future__ import annotations

import io
import struct
import tarfile

import numpy as np
import soundfile as sf

SIZE, CHECKSUM, NAME = slice(124, 136), slice(148, 156), slice(0, 100)


def make_tar(members: list[tuple[str, bytes]], fmt: int = tarfile.USTAR_FORMAT) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def fix_checksum(data: bytearray, header: int) -> None:
    block = data[header : header + 512]
    block[CHECKSUM] = b" " * 8
    data[header + 148 : header + 156] = b"%06o\0 " % sum(block)


def set_field(data: bytes, header: int, field: slice, value: bytes) -> bytes:
    """``data`` with the header at byte ``header`` holding ``value`` (NUL-padded) in ``field``."""
    out = bytearray(data)
    width = field.stop - field.start
    out[header + field.start : header + field.stop] = value[:width].ljust(width, b"\0")
    fix_checksum(out, header)
    return bytes(out)


def base256(value: int, width: int = 12) -> bytes:
    """GNU base-256 encoding of ``value`` (negative: 0xFF lead byte), as tarfile.itn writes it."""
    if value < 0:
        return b"\xff" + (-value).to_bytes(width - 1, "big")
    return b"\x80" + value.to_bytes(width - 1, "big")


def pax_tar(records: dict[str, str], name: str = "k.txt", data: bytes = b"hello") -> bytes:
    """A tar whose member ``name`` carries a PAX header with exactly ``records``."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.pax_headers = records
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def flac_bytes(frames: int = 1600, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    sf.write(out, (np.sin(np.arange(frames) / 7.0) * 0.3).astype(np.float32), rate, format="FLAC")
    return out.getvalue()


def lying_flac(total_frames: int = (1 << 36) - 1, frames: int = 1600) -> bytes:
    """A real FLAC whose STREAMINFO claims ``total_frames`` samples (36-bit field)."""
    data = bytearray(flac_bytes(frames))
    body = 8  # "fLaC" + metadata block header; STREAMINFO bytes 10..18 hold rate|ch|bps|total
    packed = int.from_bytes(data[body + 10 : body + 18], "big")
    packed = (packed & ~((1 << 36) - 1)) | (total_frames & ((1 << 36) - 1))
    data[body + 10 : body + 18] = packed.to_bytes(8, "big")
    return bytes(data)


def riff(*chunks: tuple[bytes, bytes]) -> bytes:
    """A RIFF/WAVE file of ``(id, body)`` chunks in the order given (odd bodies padded)."""
    body = b"WAVE" + b"".join(cid + struct.pack("<I", len(b)) + b + b"\0" * (len(b) & 1) for cid, b in chunks)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def wav_chunks(samples: np.ndarray, rate: int) -> tuple[tuple[bytes, bytes], tuple[bytes, bytes]]:
    """The ``fmt `` and ``data`` chunks of ``[frames, channels]`` samples: 16-bit PCM for int16, IEEE float
    (format 3) for float32."""
    channels, width = samples.shape[1], samples.dtype.itemsize
    tag = 3 if samples.dtype == np.float32 else 1
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * channels * width, channels * width, 8 * width)
    return (b"fmt ", fmt), (b"data", samples.astype(samples.dtype.newbyteorder("<")).tobytes())


def peak_chunk(channels: int) -> tuple[bytes, bytes]:
    """A ``PEAK`` chunk as libsndfile writes into float WAVs: version, time stamp, (value, position) a channel."""
    return b"PEAK", struct.pack("<II", 1, 0) + b"".join(struct.pack("<fI", 0.5, 7) for _ in range(channels))


def list_info(software: bytes = b"Lavf60.16.100") -> tuple[bytes, bytes]:
    """A ``LIST`` ``INFO`` chunk naming the software, as ffmpeg writes one."""
    text = software + b"\0"
    return b"LIST", b"INFO" + b"ISFT" + struct.pack("<I", len(text)) + text + b"\0" * (len(text) & 1)
