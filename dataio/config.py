"""The ``data:`` section: one typed config for loading everywhere (bench, training, tests).

Loaded with ``headrace.config.from_dict(DataConfig, section)`` so an unknown key or a wrong type
fails at load time with its dotted path (``data.datasets[1].weight: expected float, got 'x'``).
Runtime coordinates (DP rank and size, the process group) are arguments of ``build_loader``, never
fields here. The sub-sections of the stages live here too (decode, packing, bucketing), so the stages import
their config and the config imports no stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from headrace.dataio import libsndfile
from headrace.dataio.sizes import parse_size

PACKING_ALGORITHMS = ("none", "greedy", "best_fit")
LONG_CONVERSATION_POLICIES = ("skip", "truncate", "error")  # headrace.dataio.batching.conversations

DEFAULT_SEQ_LEN = 2048


@dataclass(kw_only=True)
class DaliConfig:
    """Options of the DALI audio path (``decode.audio: dali``, the ``dali`` extra); see ``headrace.dataio.stream.reading.dali``."""

    device: Literal["cpu", "gpu"] = "cpu"  # gpu: resample + features on the GPU (needs CUDA)
    num_threads: int = 2  # DALI CPU worker threads
    max_batch_size: int = 64  # largest batch one pipeline run accepts
    features: Literal["waveform", "log_mel"] = "waveform"  # log_mel: spectrogram -> mel bank -> dB
    n_mels: int = 80
    n_fft: int = 512
    win_length: int = 400  # samples: 25 ms at 16 kHz
    hop_length: int = 160  # samples: 10 ms at 16 kHz
    quality: float = 50.0  # DALI resampling quality 0..100 (50: 16-lobe windowed sinc)


@dataclass(kw_only=True)
class DecodeConfig:
    """The ``decode:`` options of the ``data:`` section."""

    # soundfile: per sample here; dali: left raw here, decoded per batch by headrace.dataio.stream.reading.dali; raw: never decoded
    audio: Literal["soundfile", "dali", "raw"] = "soundfile"
    sample_rate: int | None = 16000  # resample target in Hz; None keeps each file's own rate
    mono: bool = True  # downmix all channels to one (mean)
    dtype: Literal["float32", "int16"] = "float32"  # waveform dtype; int16 halves the bytes moved to the trainer
    resample_quality: Literal["QQ", "LQ", "MQ", "HQ", "VHQ"] = "HQ"  # soxr quality preset
    max_duration: float | None = None  # seconds; longer audio is a SampleDecodeError, checked before decoding
    # soundfile's libsndfile build: auto (the system's when >= 1.1.0: 2x faster FLAC), bundled, or a path
    libsndfile: str = "auto"
    dali: DaliConfig = field(default_factory=DaliConfig)

    def __post_init__(self):
        if self.sample_rate is not None and self.sample_rate <= 0:
            raise ValueError(f"decode.sample_rate must be positive or null, got {self.sample_rate}")
        if self.max_duration is not None and self.max_duration <= 0:
            raise ValueError(f"decode.max_duration must be positive or null, got {self.max_duration}")
        libsndfile.check(self.libsndfile)


@dataclass(kw_only=True)
class PackingConfig:
    """The packing fields of the ``data:`` section."""

    seq_len: int = 2048
    packing: Literal["none", "greedy", "best_fit"] = "best_fit"
    packing_buffer: int = 1000  # best_fit: look-ahead buffer, in document pieces
    open_rows: int = 8  # greedy: rows kept open for first-fit
    pad_id: int = 0

    def __post_init__(self):
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")
        if self.packing not in PACKING_ALGORITHMS:
            raise ValueError(f"packing must be one of {list(PACKING_ALGORITHMS)}, got {self.packing!r}")
        if self.packing_buffer < 1:
            raise ValueError(f"packing_buffer must be >= 1, got {self.packing_buffer}")
        if self.open_rows < 1:
            raise ValueError(f"open_rows must be >= 1, got {self.open_rows}")


@dataclass(kw_only=True)
class BucketingConfig:
    """The bucketing fields of the ``data:`` section."""

    max_duration: float | None = None  # seconds of (padded) audio per batch (unless bucket_batch_size)
    num_buckets: int = 10  # duration bins (estimated when bucket_duration_bins is not given)
    num_token_buckets: int = 1  # > 1: 2D, each duration bin split into this many token bins
    bucket_duration_bins: list[list[float]] | None = None  # 2D bins [[max_seconds, max_tokens], ...]
    bucket_batch_size: list[int] | None = None  # fixed batch size per bin (2D bins' order)
    max_tokens: int | None = None  # padded output tokens per batch (2D, without bucket_batch_size)

    def __post_init__(self):
        if self.max_duration is None and self.bucket_batch_size is None:
            raise ValueError("set max_duration (seconds of padded audio per batch) or bucket_batch_size")
        if self.max_duration is not None and not self.max_duration > 0:
            raise ValueError(f"max_duration must be > 0 seconds, got {self.max_duration}")
        if self.num_buckets < 1 or self.num_token_buckets < 1:
            raise ValueError(
                f"num_buckets and num_token_buckets must be >= 1, got {self.num_buckets}, {self.num_token_buckets}"
            )
        if self.bucket_duration_bins is not None:
            bins = self.bucket_duration_bins
            if not bins or any(len(b) != 2 or not (b[0] > 0 and b[1] > 0) for b in bins):
                raise ValueError(
                    f"bucket_duration_bins must be [[max_seconds, max_tokens], ...] with positive values, got {bins}"
                )
            if [tuple(b) for b in bins] != sorted(tuple(b) for b in bins):
                raise ValueError("bucket_duration_bins must be sorted by (seconds, tokens)")
        if self.bucket_batch_size is not None:
            want = (
                len(self.bucket_duration_bins)
                if self.bucket_duration_bins
                else (self.num_buckets * self.num_token_buckets if self.two_d else None)
            )
            if want is None:
                raise ValueError("bucket_batch_size needs 2D bins (bucket_duration_bins or num_token_buckets > 1)")
            if len(self.bucket_batch_size) != want or min(self.bucket_batch_size) < 1:
                raise ValueError(
                    f"bucket_batch_size needs {want} sizes >= 1 (one per bin), got {self.bucket_batch_size}"
                )

    @property
    def two_d(self) -> bool:
        return self.bucket_duration_bins is not None or self.num_token_buckets > 1


@dataclass(kw_only=True)
class DatasetSpec:
    path: str  # a dataset directory, an fsspec URL (s3://, gs://, http(s)://), an energon metadataset YAML
    # (headrace.dataio.stream.sources.metadataset; split picks its splits: key), or see headrace.dataio.stream.sources.interop
    weight: float = 1.0  # relative share of the blended stream
    split: str = "train"  # which shards of the directory (the manifest's split of each shard)
    # fsspec options of a URL path (s3fs: endpoint_url, key, secret, anon, client_kwargs, ...); the
    # standard environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) applies where none is given
    storage_options: dict[str, Any] | None = None

    def __post_init__(self):
        if not self.weight > 0:
            raise ValueError(f"weight must be > 0, got {self.weight}")


@dataclass(kw_only=True)
class DataConfig:
    datasets: list[DatasetSpec]
    seed: int | Literal["randomized"] = 0  # "randomized": a fresh seed, logged and kept in the state
    shuffle: bool = True
    shuffle_window: int = 8192  # samples permuted together after the shard shuffle (no buffer)
    # and at most this many shards a window (0: no limit), so a batch spans at most two windows' shards,
    # which the open-shard budget (128 at ulimit -n 1024) holds: see headrace.dataio.stream.ordering.epoch_order
    shuffle_window_shards: int = 64
    epochs: int | None = None  # None: endless; N: the stream ends after N passes (stream.ordering.blend)
    stop_on_first_exhausted: bool = False  # with epochs: end when the first dataset finishes N passes
    batch_size: int = 32
    # worker processes, or "auto": 0 or 2, whichever a ~1.5 s measurement at start finds faster (worker_count.py)
    num_workers: int | Literal["auto"] = 2
    prefetch: int = 2  # batches in flight per worker
    pin_memory: bool = False
    worker_timeout: float = 120.0  # seconds without a batch before a worker counts as hung
    max_bad_samples: int = 0  # undecodable / corrupt samples skipped (per DP rank) before it is an error
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    # Local disk cache of remote (URL) shards, shared by the workers and ranks of a node
    # (headrace.dataio.stream.sources.shardcache): each shard downloaded whole once, then memory-mapped like a local one.
    cache_dir: str | None = None  # None: remote shards are read by ranged GETs on every epoch
    cache_limit: int | str | None = (
        None  # bytes or a size ("50GB", "1.5TiB"); least recently used evicted; None: no limit
    )
    # Shards a process keeps open (mapped, or a remote file), across all datasets, least recently used
    # closed first (headrace.dataio.stream.sources.openshards); None: 1/8 of `ulimit -n`, 1/16 of vm.max_map_count, 8..4096
    max_open_shards: int | None = None
    # The batching stage (headrace.dataio.batching.packing / headrace.dataio.batching.bucketing). Token batches come in one of two layouts:
    # seq_len set (always with greedy / best_fit): THD rows of seq_len tokens from headrace.dataio.batching.packing
    # (packing: none puts one document per row, padded: the trainer's unpacked baseline);
    # packing: none without seq_len: headrace.dataio.stream.reading.collate's plain batch (flat tokens + lengths, keys).
    packing: Literal["none", "greedy", "best_fit"] = "none"
    seq_len: int | None = None  # tokens per row; greedy / best_fit without it use DEFAULT_SEQ_LEN
    packing_buffer: int = 1000
    pad_id: int = 0  # input_ids of padding (labels there are -100 whatever it is)
    # a conversation (chat shards) longer than seq_len: skip (counted) | truncate | error
    # (headrace.dataio.batching.conversations); plain documents are cut into rows as ever
    long_conversations: Literal["skip", "truncate", "error"] = "skip"
    bucketing: BucketingConfig | None = None
    # The trainer's validation stream: keys laid over this section (e.g. datasets with split: val), one
    # epoch; the loader itself never reads it (see headrace.training.validation).
    val: dict[str, Any] | None = None

    def __post_init__(self):
        if not self.datasets:
            raise ValueError("datasets: at least one dataset is needed")
        if self.seq_len is None and self.packing != "none":
            self.seq_len = DEFAULT_SEQ_LEN
        for name in ("batch_size", "shuffle_window", "prefetch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shuffle_window_shards < 0:
            raise ValueError(f"shuffle_window_shards must be >= 0 (0: no limit), got {self.shuffle_window_shards}")
        if self.thd:
            self.packing_config()  # PackingConfig checks seq_len and packing_buffer
        if self.num_workers != "auto" and (
            isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 0
        ):
            raise ValueError(f"num_workers must be an integer >= 0 or 'auto', got {self.num_workers!r}")
        if self.max_open_shards is not None and self.max_open_shards < 1:
            raise ValueError(
                f"max_open_shards must be >= 1 or null (derived from the process's limits), got {self.max_open_shards}"
            )
        if self.max_bad_samples < 0:
            raise ValueError(f"max_bad_samples must be >= 0, got {self.max_bad_samples}")
        if self.long_conversations not in LONG_CONVERSATION_POLICIES:
            raise ValueError(
                f"long_conversations must be one of {list(LONG_CONVERSATION_POLICIES)}, got {self.long_conversations!r}"
            )
        if isinstance(self.cache_limit, str):
            try:
                self.cache_limit = parse_size(self.cache_limit)
            except ValueError as e:
                raise ValueError(f"cache_limit: {e}") from None
        if self.cache_limit is not None and (self.cache_dir is None or self.cache_limit < 1):
            raise ValueError(f"cache_limit ({self.cache_limit}) needs cache_dir and must be positive")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"epochs must be >= 1 or null (endless), got {self.epochs}")

    def packing_config(self) -> PackingConfig:
        """The packing fields as ``headrace.dataio.batching.packing``'s own config (only with ``seq_len`` set)."""
        return PackingConfig(
            seq_len=self.seq_len, packing=self.packing, pad_id=self.pad_id, packing_buffer=self.packing_buffer
        )

    @property
    def thd(self) -> bool:
        """Whether token batches are THD rows (``headrace.dataio.batching.packing``) rather than the plain collate."""
        return self.seq_len is not None


__all__ = ["DEFAULT_SEQ_LEN", "DataConfig", "DatasetSpec"]
