"""Audio headers: sample rate and length of FLAC and WAV files from their first bytes, checked.

One parser for every side that meets encoded audio: ``dataio shard`` probing its inputs, ``dataio
index`` / ``verify`` scanning tar members (``headrace.dataio.shards.tarscan``) and the loader's decoder
(``headrace.dataio.stream.reading.decode``), so they all give the same verdict on the same bytes.

FLAC and PCM/float WAV headers are parsed here from the first 8 KiB (~5 us a file, against ~250 us for
``soundfile.info``, which opens a decoder). The parser only accepts what it fully understands (FLAC:
every metadata block header up to the first frame's sync code; WAV: ``fmt `` then a ``data`` chunk that
lies inside the file, with only ``fact``, ``PEAK``, ``LIST``, ``JUNK`` or ``bext`` chunks between, each
held to the rules under which libsndfile's parser goes on past it without complaint); anything else --
other codecs, ID3-prefixed FLAC, RF64, compressed WAV, truncation, corruption -- goes to libsndfile,
which stays the judge of what is readable and is the test oracle for the values parsed here.
"""

from __future__ import annotations

import io
import os
import stat
import struct
from typing import NamedTuple

import numpy as np
import soundfile as sf

HEADER_BYTES = 8192  # what a probe reads of each file; covers FLAC metadata and WAV chunks up to ``data``
_WAV_FORMATS = {1: (8, 16, 24, 32), 3: (32, 64)}  # PCM, IEEE float: the bit depths libsndfile reads
_MAX_CHANNELS = 1024  # libsndfile's SF_MAX_CHANNELS
MAX_SAMPLE_RATE = 655_350  # FLAC's limit; far above any real recording


def _flac_header(head: bytes) -> tuple[int, int] | None:
    """``(sample_rate, frames)`` from STREAMINFO when every metadata block up to the first frame is one
    libFLAC reads without complaint (STREAMINFO first, then padding, seek table or a well-formed
    Vorbis comment) and the first frame starts with its sync code; None otherwise."""
    pos, streaminfo = 4, None
    while True:
        if pos + 4 > len(head):
            return None
        kind, length = head[pos] & 0x7F, int.from_bytes(head[pos + 1 : pos + 4], "big")
        body = head[pos + 4 : pos + 4 + length]
        if len(body) < length or (kind == 0) != (pos == 4):  # beyond the probe, or STREAMINFO not first
            return None
        if kind == 0:
            if length != 34:
                return None
            streaminfo = int.from_bytes(body[10:18], "big")
        elif not (kind == 1 or (kind == 3 and length % 18 == 0) or (kind == 4 and _vorbis_comment_ok(body))):
            return None
        pos += 4 + length
        if head[pos - 4 - length] & 0x80:  # last-metadata-block flag
            break
    # rate (20 bits), channels - 1 (3), bits per sample - 1 (5), total frames (36)
    rate, bits, frames = streaminfo >> 44, ((streaminfo >> 36) & 31) + 1, streaminfo & ((1 << 36) - 1)
    if not (0 < rate <= MAX_SAMPLE_RATE and bits in (8, 16, 24) and 0 < frames < 1 << 31):
        return None
    if pos + 2 > len(head) or head[pos] != 0xFF or head[pos + 1] & 0xFE != 0xF8:  # frame sync 0xFFF8/9
        return None
    return rate, frames


def _vorbis_comment_ok(body: bytes) -> bool:
    """Every length field of a FLAC Vorbis comment block stays inside the block."""
    pos = 4 + int.from_bytes(body[0:4], "little")  # vendor string
    if pos + 4 > len(body):
        return False
    count, pos = int.from_bytes(body[pos : pos + 4], "little"), pos + 4
    for _ in range(count):
        if pos + 4 > len(body):
            return False
        pos += 4 + int.from_bytes(body[pos : pos + 4], "little")
    return pos == len(body)


class WavFormat(NamedTuple):
    """A PCM / float WAV's layout: the ``data`` chunk's samples start at ``data_offset``, interleaved."""

    rate: int
    frames: int
    channels: int
    tag: int  # 1: integer PCM, 3: IEEE float (the sub-format of WAVE_FORMAT_EXTENSIBLE)
    bits: int
    data_offset: int


def wav_format(head: bytes, file_size: int) -> WavFormat | None:
    """The layout of a PCM / float WAV whose ``data`` chunk lies inside the file; None otherwise."""
    pos, fmt = 12, None
    while pos + 8 <= len(head):
        chunk, length = head[pos : pos + 4], int.from_bytes(head[pos + 4 : pos + 8], "little")
        body = pos + 8
        if chunk == b"fmt ":
            if fmt is not None or length < 16 or body + length > len(head):
                return None
            tag, channels, rate, _, block_align, bits = struct.unpack_from("<HHIIHH", head, body)
            if tag == 0xFFFE:  # WAVE_FORMAT_EXTENSIBLE: the real tag opens the sub-format GUID
                if length < 40:
                    return None
                tag = int.from_bytes(head[body + 24 : body + 26], "little")
            if (
                bits not in _WAV_FORMATS.get(tag, ())
                or not 0 < channels <= _MAX_CHANNELS
                or not 0 < rate <= MAX_SAMPLE_RATE
                or block_align != channels * bits // 8
            ):
                return None
            fmt = (rate, channels, tag, bits)
        elif chunk == b"data":
            if fmt is None or body + length > file_size:
                return None  # libsndfile clamps a truncated data chunk; let it
            rate, channels, tag, bits = fmt
            return WavFormat(rate, length // (channels * bits // 8), channels, tag, bits, body)
        elif not _skipped_like_libsndfile(chunk, head[body : body + length], length, fmt[1] if fmt else None):
            return None  # libsndfile parses these (cue, smpl, ...), refuses them or stops at unknown ones: let it
        pos = body + length + (length & 1)
    return None


def _skipped_like_libsndfile(chunk: bytes, body: bytes, length: int, channels: int | None) -> bool:
    """Whether libsndfile's WAV parser, meeting ``chunk`` (``length`` bytes, ``body`` what of it the probe
    holds; ``channels`` once ``fmt `` was read) before ``data``, goes on from the chunk's end without an
    error, as skipping it does; False sends the file to libsndfile. Real files carry these: libsndfile
    (so soundfile) writes ``fact`` + ``PEAK`` into every float WAV, ffmpeg a ``LIST`` naming itself."""
    if chunk in (b"JUNK", b"junk", b"bext"):  # skipped, or bext's fields read inside it
        return True
    if chunk == b"fact":
        return length >= 4  # its 4-byte frame count is read even from a shorter chunk
    if chunk == b"PEAK":  # refused before ``fmt `` or unless it holds exactly one (value, position) a channel
        return channels is not None and length == 8 + 8 * channels
    if chunk == b"LIST":
        return _list_walk_ends_at_its_end(body, length)
    return False


def _list_walk_ends_at_its_end(body: bytes, length: int) -> bool:
    """Whether libsndfile's walk of a LIST chunk (``wavlike_subchunk_parse``) stops at the chunk's end:
    sure when the list type is INFO or adtl and its sub-chunks (id, size, payload padded to even) tile
    the body exactly with no ``data`` among them (libsndfile backs out there and takes it for the audio)
    nor ``exif`` (parsed by other rules). A shorter walk or an overrun is possible otherwise: not taken."""
    if length <= 8:
        return True  # an id is read, then length - 4 skipped (backwards below 4): the chunk's end
    if len(body) < length or body[:4] not in (b"INFO", b"adtl"):
        return False
    pos = 4
    while pos < length:
        sub, size = body[pos : pos + 4], int.from_bytes(body[pos + 4 : pos + 8], "little")
        if sub in (b"data", b"exif", b"INFO", b"adtl") or (sub == b"labl" and size < 4):  # labl: size - 4 wraps
            return False
        pos += 8 + size + (size & 1)
    return pos == length


def _wav_header(head: bytes, file_size: int) -> tuple[int, int] | None:
    """``(sample_rate, frames)`` of a PCM / float WAV whose ``data`` chunk lies inside the file; None otherwise."""
    layout = wav_format(head, file_size)
    return None if layout is None else (layout.rate, layout.frames)


def parse_header(head: bytes, file_size: int) -> tuple[int, int] | None:
    """``(sample_rate, frames)`` from the first bytes of a FLAC or PCM/float WAV file of ``file_size``
    bytes, or None when the header is anything this parser does not fully understand."""
    if head.startswith(b"fLaC"):
        return _flac_header(head)
    if head.startswith(b"RIFF") and head[8:12] == b"WAVE":
        return _wav_header(head, file_size)
    return None


# No codec packs more frames into a byte: FLAC's densest frame is a block of 65535 samples stored as
# CONSTANT subframes in ~11 bytes (~5,960 frames a byte); an Opus packet carries at most 5,760 frames
# (120 ms at 48 kHz). Real audio is near 1 (16-bit FLAC speech ~0.6 frames a byte).
MAX_FRAMES_PER_BYTE = 6000


def check_declared(sample_rate: int, frames: int, nbytes: int, *, max_duration: float | None = None) -> None:
    """ValueError unless a header's ``sample_rate`` and ``frames`` are possible for ``nbytes`` of
    encoded audio (and within ``max_duration`` seconds): a lying header (a FLAC STREAMINFO claiming
    2**36 samples) is refused before anything is allocated for it. One rule for ``dataio shard``,
    ``index``, ``verify`` and the loader, so they all give the same verdict."""
    if sample_rate <= 0 or frames <= 0:
        raise ValueError(f"audio has no samples (sample_rate={sample_rate}, frames={frames})")
    if frames > nbytes * MAX_FRAMES_PER_BYTE:
        raise ValueError(
            f"header claims {frames} frames ({frames / sample_rate / 3600:.1f} h) in {nbytes} bytes, "
            f"more than any codec stores (at most {MAX_FRAMES_PER_BYTE} frames a byte)"
        )
    if max_duration is not None and frames > max_duration * sample_rate:
        raise ValueError(f"audio lasts {frames / sample_rate:.1f} s, over decode.max_duration={max_duration}")


def _checked(sample_rate: int, frames: int, nbytes: int) -> tuple[int, int]:
    check_declared(sample_rate, frames, nbytes)
    return sample_rate, frames


# What libsndfile reports as the length of a stream whose header leaves it open (a FLAC STREAMINFO with
# total_samples 0, which the format allows: "unknown"); such a file's frames are counted by decoding it.
UNKNOWN_FRAMES = (1 << 63) - 1
_READF = {
    "float32": ("sf_readf_float", "float*"),
    "float64": ("sf_readf_double", "double*"),
    "int16": ("sf_readf_short", "short*"),
    "int32": ("sf_readf_int", "int*"),
}


def _decoded_blocks(f: sf.SoundFile, dtype: str, nbytes: int, *, reuse: bool = False):
    """``f``'s frames from the read position on, as ``[n, C]`` ``dtype`` blocks of up to 65536 frames
    (``reuse``: one buffer for all, for a caller that only counts); ValueError past ``nbytes *
    MAX_FRAMES_PER_BYTE`` frames. libsndfile's read function is called directly: ``SoundFile.read``
    seeks to ``tell() + read`` after each read, which fails at the end of a stream of unknown length."""
    from soundfile import _ffi, _snd

    name, ctype = _READF[dtype]
    readf, limit, total, block = getattr(_snd, name), nbytes * MAX_FRAMES_PER_BYTE, 0, None
    while True:
        if block is None or not reuse:
            block = np.empty((1 << 16, f.channels), dtype=dtype)
        n = readf(f._file, _ffi.cast(ctype, block.ctypes.data), len(block))
        if f._errorcode:  # a frame that does not decode ("flac decoder lost sync"): the file's fault
            reason = _ffi.string(_snd.sf_error_number(f._errorcode)).decode(errors="replace")
            raise ValueError(f"does not decode at frames {total}..{total + len(block)} ({reason})")
        total += n
        if total > limit:
            raise ValueError(f"decodes to more than {limit} frames in {nbytes} bytes, more than any codec stores")
        yield block[:n]
        if n < len(block):
            return


def read_unknown_length(f: sf.SoundFile, dtype: str, nbytes: int) -> np.ndarray:
    """Every frame of ``f`` (whose header leaves its length unknown) as ``[T, C]`` ``dtype``. Cost: one
    decode (as the loader's)."""
    return np.concatenate(list(_decoded_blocks(f, dtype, nbytes)))


def check_decodes(data) -> tuple[int, int]:
    """``(sample_rate, frames)`` of encoded audio after decoding every frame, as the loader will
    (``dataio verify``): ValueError naming the first frame that does not decode, or a stream that ends
    before the frames its header declares. Memory: one 65536-frame block; cost: a full decode."""
    sample_rate, declared = probe(data)
    try:
        with sf.SoundFile(io.BytesIO(bytes(data))) as f:
            decoded = sum(len(b) for b in _decoded_blocks(f, "int16", len(data), reuse=True))
    except sf.SoundFileError as e:
        raise ValueError(f"does not decode ({e})") from None
    if decoded != declared:
        raise ValueError(f"decodes to {decoded} frames, its header declares {declared} (truncated or damaged)")
    return sample_rate, decoded


def _soundfile_info(source, nbytes: int) -> tuple[int, int]:
    try:
        info = sf.info(source)
        frames = info.frames
        if frames == UNKNOWN_FRAMES:
            if isinstance(source, io.IOBase):
                source.seek(0)
            with sf.SoundFile(source) as f:
                frames = len(read_unknown_length(f, "int16", nbytes))
    except ValueError:
        raise
    except Exception as e:  # libsndfile reports corrupt input as several exception types
        raise ValueError(f"unreadable audio ({e})") from None
    return _checked(info.samplerate, frames, nbytes)


def probe(data: bytes) -> tuple[int, int]:
    """``(sample_rate, frames)`` read from the header of encoded audio; ValueError if unreadable."""
    parsed = parse_header(bytes(data[:HEADER_BYTES]), len(data))
    return _checked(*parsed, len(data)) if parsed else _soundfile_info(io.BytesIO(data), len(data))


def probe_file(path: str | os.PathLike) -> tuple[int, int, int]:
    """``(sample_rate, frames, file size)`` of an audio file, reading only its header.

    ValueError if unreadable, OSError if the file cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens without waiting for a writer...
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # ...and is refused here, never read (a read would block forever)
            raise ValueError("not a regular file (a FIFO, device or directory cannot be an input)")
        size = st.st_size
        head = os.pread(fd, HEADER_BYTES, 0)
    finally:
        os.close(fd)
    parsed = parse_header(head, size)
    return (*(_checked(*parsed, size) if parsed else _soundfile_info(os.fspath(path), size)), size)
