"""soundfile audio decoded per batch straight into the batch tensor (``decode.audio: soundfile``).

``decode_sample(..., defer_audio=True)`` leaves each FLAC / WAV member whose header parses as a checked
``PendingAudio`` (rate and frame count known, ``check_declared`` applied). ``decode_pending`` then
makes one batch's audio, per member extension:

1. one flat tensor from the batch's allocator (in a worker process: its shared-memory ring)
   with room for every member at the target rate (``out_frames``: the file's frames, or soxr's output
   length rounded up);
2. each member decoded in batch order straight into its place:
   - 16-bit PCM / float32 mono WAV at the target rate: no decoder at all; the ``data`` chunk is read in
     place and scaled by 2**-15 into the batch (``np.multiply(..., out=)``): what libsndfile computes,
     bit for bit, at ~1/10 of its cost (libsndfile's own int16 -> float loop and its open through
     soundfile's Python I/O callbacks are most of a WAV's decode);
   - mono at the target rate: ``soundfile``'s ``read(out=)`` into the batch's view;
   - several channels or another rate: read into this process's scratch buffer (reused, grown on
     demand), downmixed (``np.mean``, as ``decode_audio``) into the batch, or resampled by soxr and
     copied in;
   a member that fails is dropped (its ``SampleDecodeError`` returned, counted as a bad sample like any
   other) and the next takes its place, as does a member that decodes to fewer frames than its header
   declares: the batch stays dense;
3. each sample's member becomes ``Audio`` over its slice, which ``headrace.dataio.stream.reading.collate`` recognises as
   one run of memory and hands on as the batch tensor without a copy.

So a decoded waveform is written once, into the memory the trainer reads, with no per-sample array
(today's per-sample path allocated the waveform, sometimes a downmix / resample, then copied it into the
batch). Values equal ``decode_audio``'s bit for bit (tests/test_audio_batch.py).
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import soundfile
import torch

from headrace.dataio import libsndfile
from headrace.dataio.stream.reading.collate import Allocator
from headrace.dataio.usererror import SampleDecodeError
from headrace.dataio.stream.reading.decode import (
    Audio,
    PendingAudio,
    downmixed_and_resampled,
    member_error,
)
from headrace.dataio.config import DecodeConfig

PCM16_SCALE = np.float32(1.0 / 0x8000)  # libsndfile's short -> float factor (a power of two: exact)
_TORCH = {"float32": torch.float32, "int16": torch.int16}
_scratch = np.empty(0, dtype=np.uint8)  # this process's buffer for members that cannot go straight in


def scratch(frames: int, channels: int, dtype: str) -> np.ndarray:
    """A ``[frames, channels]`` array over this process's reusable scratch buffer."""
    global _scratch
    nbytes = frames * channels * np.dtype(dtype).itemsize
    if _scratch.nbytes < nbytes:
        _scratch = np.empty(max(nbytes, 2 * _scratch.nbytes), dtype=np.uint8)
    return _scratch[:nbytes].view(dtype).reshape(frames, channels)


def _wav_samples(p: PendingAudio) -> np.ndarray:
    """The interleaved samples of a WAV's ``data`` chunk, viewed in place."""
    wav = p.wav
    dtype = "<i2" if wav.tag == 1 else "<f4"
    return np.frombuffer(p.buf, dtype=dtype, count=p.frames * wav.channels, offset=wav.data_offset)


def _at_target_rate(p: PendingAudio, cfg: DecodeConfig) -> bool:
    """Whether ``p`` needs no resampling: told by its rate, not by ``out_frames == frames``, which a file
    of a few frames also meets when resampled down (3 at 22.05 kHz -> room for 3 at 16 kHz, rounded up)."""
    return cfg.sample_rate in (None, p.rate)


def _direct_wav(p: PendingAudio, cfg: DecodeConfig) -> bool:
    """Whether ``p`` is a mono 16-bit PCM (or, to float32, IEEE float) WAV at the target rate."""
    wav = p.wav
    return (
        wav is not None
        and wav.channels == 1
        and _at_target_rate(p, cfg)
        and ((wav.tag, wav.bits) == (1, 16) or (wav.tag, wav.bits, cfg.dtype) == (3, 32, "float32"))
    )


def decode_into(p: PendingAudio, cfg: DecodeConfig, out: np.ndarray) -> int:
    """Decode ``p`` into ``out`` (``p.out_frames`` long, of ``cfg.dtype``); returns the frames written."""
    if _direct_wav(p, cfg):
        samples = _wav_samples(p)
        if samples.dtype == out.dtype.newbyteorder("<"):
            out[:] = samples
        else:
            np.multiply(samples, PCM16_SCALE, out=out)
        return p.frames
    with soundfile.SoundFile(io.BytesIO(p.buf)) as f:
        if (f.samplerate, f.frames) != (p.rate, p.frames):
            raise ValueError(
                f"libsndfile reads {f.frames} frames at {f.samplerate} Hz where the header "
                f"declares {p.frames} at {p.rate} Hz"
            )
        if f.channels == 1 and _at_target_rate(p, cfg):
            return len(f.read(p.frames, dtype=cfg.dtype, out=out))
        audio = f.read(p.frames, dtype=cfg.dtype, always_2d=True, out=scratch(p.frames, f.channels, cfg.dtype))
    if audio.shape[1] > 1 and cfg.dtype == "float32" and _at_target_rate(p, cfg):
        np.mean(audio, axis=1, dtype=np.float32, out=out[: len(audio)])  # the downmix, with no temporary
        return len(audio)
    audio = downmixed_and_resampled(audio, p.rate, cfg)  # to one channel: cfg.mono holds for every pending member
    if len(audio) > len(out):
        raise AssertionError(f"{len(audio)} decoded frames exceed the {len(out)} reserved")  # a bug, not bad data
    out[: len(audio)] = audio
    return len(audio)


def decode_pending(
    samples: list[dict], keys: Sequence[str], shards: Sequence[str], cfg: DecodeConfig, alloc: Allocator
) -> dict[int, SampleDecodeError]:
    """Decode every ``PendingAudio`` of ``samples`` into one tensor per member extension from ``alloc``,
    replacing each by ``Audio`` over its slice (in place); returns sample position -> error of the
    samples to drop."""
    libsndfile.use(cfg.libsndfile)
    failed: dict[int, SampleDecodeError] = {}
    exts = dict.fromkeys(ext for s in samples for ext, v in s.items() if isinstance(v, PendingAudio))
    for ext in exts:
        todo = [(i, s[ext]) for i, s in enumerate(samples) if isinstance(s.get(ext), PendingAudio)]
        flat = alloc((sum(p.out_frames for _, p in todo),), _TORCH[cfg.dtype])
        array, pos = flat.numpy(), 0
        for i, p in todo:
            if i in failed:  # another member of this sample failed: leave it pending, it is dropped
                continue
            try:
                n = decode_into(p, cfg, array[pos : pos + p.out_frames])
            except (MemoryError, AssertionError):
                raise
            except Exception as e:
                failed[i] = member_error(e, shard=shards[i], key=keys[i], member=ext)
                continue
            samples[i][ext] = Audio(flat[pos : pos + n], cfg.sample_rate or p.rate)
            pos += n
    return failed


def mean_decoded_bytes(durations: np.ndarray, cfg: DecodeConfig) -> float:
    """Mean bytes of a sample's audio once decoded here, from the index's ``duration`` column (seconds;
    NaN where unknown); 0 when it is not decoded here or the rate is unknown. The worker rings are
    sized from it (``headrace.dataio.stream.rank``): decoded 16 kHz float32 is ~3x the FLAC it came from."""
    if cfg.audio != "soundfile" or cfg.sample_rate is None or not len(durations):
        return 0.0
    known = durations[np.isfinite(durations)]
    return float(known.mean()) * cfg.sample_rate * np.dtype(cfg.dtype).itemsize if len(known) else 0.0


__all__ = ["PCM16_SCALE", "decode_into", "decode_pending", "mean_decoded_bytes", "scratch"]
