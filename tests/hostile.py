"""Builders of hostile inputs shared by the regression tests and the fuzz harness: valid tars with one
header field rewritten (checksum fixed up, so the damage is the field itself), PAX headers with chosen
records, and FLAC/WAV files whose headers lie."""

from __future__ import annotations

import io
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
