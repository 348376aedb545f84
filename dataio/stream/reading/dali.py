"""NVIDIA DALI audio decoding of whole batches of raw members (``decode.audio: dali``, the ``dali`` extra).

The loader leaves audio members raw (``headrace.dataio.stream.reading.decode`` passes them through when ``decode.audio`` is
``dali``) and hands each batch's buffers to ``DaliAudioDecoder``, one DALI pipeline built once:

    external_source (uint8 buffers, zero-copy numpy views)
      -> decoders.audio                      CPU only in DALI; downmix, and on CPU also the resample
      -> [gpu: .gpu() -> audio_resample]     resampling on the GPU                       (GPU-only)
      -> [log_mel: spectrogram -> mel_filter_bank -> to_decibels]   on the pipeline's device
      -> pad along time                      one dense [B, ...] tensor plus per-sample lengths

``dali.device: cpu`` (``device_id=None``) needs no GPU and is what the tests and benchmark run;
``dali.device: gpu`` moves resampling and the features to the GPU and returns CUDA tensors (GPU-only,
tested on the lent GPU machine when there is one). The same graph on CPU is the fallback.

Cost and trade-off: DALI decodes a batch with ``num_threads`` C++ threads and no Python per sample,
but a DALI pipeline is dead after any operator error, so a batch with a corrupt member is re-decoded
sample by sample (a fresh pipeline, ~12 ms, after each failure) to name the bad ones; the good samples
are kept and the bad ones come back as ``SampleDecodeError`` for the loader's ``max_bad_samples``.
Outputs are copied once out of DALI's buffers (which it reuses on the next run).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from headrace.dataio.stream.reading.decode import Audio, Buffer

from headrace.dataio.usererror import SampleDecodeError
from headrace.dataio.config import DecodeConfig
from headrace.dataio.shards.formats import is_audio_member


def import_dali():
    """``nvidia.dali`` (with ``fn`` and ``types``), or an ImportError that names the extra to install."""
    try:
        import nvidia.dali.fn as fn
        import nvidia.dali.types as types
        from nvidia.dali import pipeline_def
    except ImportError as e:
        raise ImportError(
            "decode.audio: dali needs NVIDIA DALI: pip install 'headrace[dali]' (nvidia-dali-cuda130)"
        ) from e
    return fn, types, pipeline_def


class DaliAudioBatch(NamedTuple):
    """A decoded batch. ``data``: ``[B, T]`` waveforms (``[B, C, T]`` without downmix) or ``[B, n_mels,
    frames]`` log-mels, zero-padded; ``lengths``: valid samples/frames of each; ``index``: position of
    each kept sample in the input batch; ``errors``: input position -> ``SampleDecodeError`` of each
    dropped sample."""

    data: torch.Tensor
    lengths: torch.Tensor
    sample_rate: torch.Tensor  # Hz of each output row
    index: list[int]
    errors: dict[int, SampleDecodeError]


_TORCH_DTYPES = {"float32": torch.float32, "int16": torch.int16}


class DaliAudioDecoder:
    """Decodes batches of encoded audio (WAV, FLAC, OGG Vorbis/Opus) with one reusable DALI pipeline."""

    def __init__(self, cfg: DecodeConfig):
        self.cfg = cfg
        dali = cfg.dali
        if dali.features == "log_mel" and (cfg.sample_rate is None or not cfg.mono):
            raise ValueError("decode.dali.features: log_mel needs decode.sample_rate set and decode.mono: true")
        if dali.device == "gpu" and not torch.cuda.is_available():
            raise ValueError("decode.dali.device: gpu needs CUDA; use decode.dali.device: cpu on this machine")
        if dali.features == "log_mel" and cfg.dtype != "float32":
            raise ValueError("decode.dali.features: log_mel produces float32; set decode.dtype: float32")
        self._time_axis = 1 if dali.features == "log_mel" or not cfg.mono else 0
        self._pipe = self._build()

    def _build(self):
        fn, types, pipeline_def = import_dali()
        cfg, dali = self.cfg, self.cfg.dali
        gpu = dali.device == "gpu"
        dtype = {"float32": types.FLOAT, "int16": types.INT16}[cfg.dtype]

        @pipeline_def(
            batch_size=dali.max_batch_size,
            num_threads=dali.num_threads,
            device_id=torch.cuda.current_device() if gpu else None,
            prefetch_queue_depth=1,  # we feed and run one batch at a time
            exec_dynamic=True,
        )
        def pipeline():
            # no_copy: DALI reads our numpy views directly; they outlive the synchronous run.
            encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1, device="cpu", no_copy=True)
            # Resample inside the decoder on CPU. Passing sample_rate=0 would make the rate output 0,
            # so the argument is left out when the native rate is kept.
            resample = {} if gpu or cfg.sample_rate is None else {"sample_rate": float(cfg.sample_rate)}
            audio, rate = fn.decoders.audio(encoded, downmix=cfg.mono, dtype=dtype, quality=dali.quality, **resample)
            if gpu:
                audio = audio.gpu()
                if cfg.sample_rate is not None:
                    audio = fn.audio_resample(
                        audio, in_rate=rate, out_rate=float(cfg.sample_rate), quality=dali.quality
                    )
            if not cfg.mono:
                audio = fn.transpose(audio, perm=[1, 0])  # [T, C] -> [C, T], as reading.decode returns
            if dali.features == "log_mel":
                spectrum = fn.spectrogram(
                    audio, nfft=dali.n_fft, window_length=dali.win_length, window_step=dali.hop_length, power=2
                )  # [freq, time]
                mel = fn.mel_filter_bank(spectrum, sample_rate=float(cfg.sample_rate), nfilter=dali.n_mels)
                # dB relative to each utterance's peak, floored 80 dB below it (Whisper's dynamic range).
                audio = fn.to_decibels(mel, multiplier=10.0, cutoff_db=-80.0)
            return fn.pad(audio, axes=(self._time_axis,)), audio, rate

        pipe = pipeline()
        pipe.build()
        return pipe

    def __call__(self, buffers: Sequence[Buffer], *, keys: Sequence[str] | None = None, shard: str | None = None):
        """Decode ``buffers`` (at most ``max_batch_size``); ``keys``/``shard`` label errors. -> DaliAudioBatch."""
        limit = self.cfg.dali.max_batch_size
        if len(buffers) > limit:
            raise ValueError(f"batch of {len(buffers)} exceeds decode.dali.max_batch_size={limit}")

        def error(i: int, reason: str) -> SampleDecodeError:
            return SampleDecodeError(reason, shard=shard, key=keys[i] if keys else None, member="audio")

        arrays = [np.frombuffer(b, dtype=np.uint8) for b in buffers]
        index, errors = list(range(len(arrays))), {}
        try:
            data, lengths, rates = self._run(arrays)
        except RuntimeError:
            self._pipe = self._build()  # a failed DALI pipeline is unusable: find the bad samples one by one
            index = []
            for i, array in enumerate(arrays):
                try:
                    self._run([array])
                    index.append(i)
                except RuntimeError as e:
                    self._pipe = self._build()
                    errors[i] = error(i, "DALI: " + str(e).split("encountered:")[-1].strip().splitlines()[0])
            if not index:
                empty = torch.empty(0, dtype=torch.int64)
                return DaliAudioBatch(torch.empty(0), empty, empty, [], errors)
            data, lengths, rates = self._run([arrays[i] for i in index])
        if self.cfg.max_duration is not None:
            hop = self.cfg.dali.hop_length if self.cfg.dali.features == "log_mel" else 1
            seconds = lengths.double() * hop / rates.double()
            keep = seconds <= self.cfg.max_duration
            if not bool(keep.all()):
                for i, s, k in zip(index, seconds.tolist(), keep.tolist()):
                    if not k:
                        errors[i] = error(i, f"audio lasts {s:.1f} s, over decode.max_duration={self.cfg.max_duration}")
                index = [i for i, k in zip(index, keep.tolist()) if k]
                lengths, rates = lengths[keep], rates[keep]
                longest = int(lengths.max()) if len(lengths) else 0  # drop padding only the dropped ones needed
                data = data[keep.to(data.device)].narrow(self._time_axis + 1, 0, longest)
        return DaliAudioBatch(data, lengths, rates, index, errors)

    def _run(self, arrays: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self._pipe.feed_input("encoded", arrays)
        padded, unpadded, rate = self._pipe.run()  # RuntimeError here: a member DALI could not decode
        if not padded.is_dense_tensor():  # only padding time, so channel counts must agree
            channels = sorted({shape[0] for shape in unpadded.shape()})
            raise ValueError(f"decode.mono: false needs one channel count per batch, got {channels}")
        lengths = torch.tensor([shape[self._time_axis] for shape in unpadded.shape()], dtype=torch.int64)
        if self.cfg.dali.device == "gpu" and self.cfg.sample_rate is not None:
            rates = torch.full_like(lengths, self.cfg.sample_rate)  # decoders.audio reports the native rate
        else:
            rates = torch.from_numpy(np.array(rate.as_tensor()).reshape(-1).astype(np.int64))
        return self._to_torch(padded.as_tensor()), lengths, rates

    def _to_torch(self, tensor) -> torch.Tensor:
        from nvidia.dali.plugin.pytorch import feed_ndarray

        device = "cuda" if self.cfg.dali.device == "gpu" else "cpu"
        dtype = torch.float32 if self.cfg.dali.features == "log_mel" else _TORCH_DTYPES[self.cfg.dtype]
        out = torch.empty(tensor.shape(), dtype=dtype, device=device)
        stream = torch.cuda.current_stream() if device == "cuda" else None
        return feed_ndarray(tensor, out, cuda_stream=stream)


def decode_audio_members(
    decoder: DaliAudioDecoder, samples: list[dict], keys: Sequence[str], shards: Sequence[str]
) -> dict[int, SampleDecodeError]:
    """The loader's hook for ``decode.audio: dali``: after ``decode_sample`` left audio members raw,
    decode all of them in DALI batches and replace each, in place, by ``Audio(waveform, sample_rate)``
    (``waveform`` is a view of its row of the padded batch, trimmed to its length; the log-mel
    ``[n_mels, frames]`` with ``features: log_mel``). Returns sample position -> error for the samples
    to drop (count them against ``max_bad_samples``)."""
    todo = [
        (s, ext)
        for s, sample in enumerate(samples)
        for ext in sample
        if is_audio_member(ext) and not isinstance(sample[ext], Audio)
    ]
    failed: dict[int, SampleDecodeError] = {}
    step = decoder.cfg.dali.max_batch_size
    for start in range(0, len(todo), step):
        chunk = todo[start : start + step]
        batch = decoder([samples[s][ext] for s, ext in chunk])
        for row, i in enumerate(batch.index):
            s, ext = chunk[i]
            length = int(batch.lengths[row])
            samples[s][ext] = Audio(batch.data[row].narrow(-1, 0, length), int(batch.sample_rate[row]))
        for i, e in batch.errors.items():
            s, ext = chunk[i]
            failed.setdefault(s, SampleDecodeError(e.reason, shard=shards[s], key=keys[s], member=ext))
    return failed


class BatchAudio:
    """The reader's per-batch audio hook for ``decode.audio: dali``: ``decode_audio_members`` with this
    process's ``DaliAudioDecoder``, built on first use. A DALI pipeline and its threads do not survive
    a fork and are never pickled, so each worker builds its own and the loader must not make a batch
    in the main process before forking workers (``fork_safe``)."""

    fork_safe = False

    def __init__(self, cfg: DecodeConfig):
        self.cfg = cfg
        self._decoder, self._pid = None, None

    def __call__(self, samples: list[dict], keys: Sequence[str], shards: Sequence[str]) -> dict[int, SampleDecodeError]:
        if self._pid != os.getpid():
            self._decoder, self._pid = DaliAudioDecoder(self.cfg), os.getpid()
        return decode_audio_members(self._decoder, samples, keys, shards)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_decoder": None, "_pid": None}
