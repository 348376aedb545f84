"""The ``data:`` section: one typed config for loading everywhere (bench, training, tests).

Loaded with ``configtree.from_dict(DataConfig, section)`` so an unknown key or a wrong type
fails at load time with its dotted path (``data.datasets[1].weight: expected float, got 'x'``).
Runtime coordinates (DP rank and size, the process group) are arguments of ``build_loader``, never
fields here. The packing / bucketing fields belong to the batching stage (``dataio.batching.packing``,
``dataio.batching.bucketing``); decode options to ``dataio.stream.decode``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from dataio.batching.bucketing import BucketingConfig
from dataio.batching.packing import PackingConfig
from dataio.sizes import parse_size
from dataio.stream.decode import DecodeConfig

DEFAULT_SEQ_LEN = 2048


@dataclass(kw_only=True)
class DatasetSpec:
    path: str  # a dataset directory, an fsspec URL (s3://, gs://, http(s)://), an energon metadataset YAML
    # (dataio.stream.metadataset; split picks its splits: key), or see dataio.stream.interop
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
    epochs: int | None = None  # None: endless; N: the stream ends after N passes (see dataio.stream.blend)
    stop_on_first_exhausted: bool = False  # with epochs: end when the first dataset finishes N passes
    batch_size: int = 32
    num_workers: int = 2
    prefetch: int = 2  # batches in flight per worker
    pin_memory: bool = False
    worker_timeout: float = 120.0  # seconds without a batch before a worker counts as hung
    max_bad_samples: int = 0  # undecodable / corrupt samples skipped (per DP rank) before it is an error
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    # Local disk cache of remote (URL) shards, shared by the workers and ranks of a node
    # (dataio.stream.shardcache): each shard downloaded whole once, then memory-mapped like a local one.
    cache_dir: str | None = None  # None: remote shards are read by ranged GETs on every epoch
    cache_limit: int | str | None = None  # bytes or a size ("50GB", "1.5TiB"); least recently used evicted; None: no limit
    # The batching stage (dataio.batching.packing / dataio.batching.bucketing). Token batches come in one of two layouts:
    # seq_len set (always with greedy / best_fit): THD rows of seq_len tokens from dataio.batching.packing
    # (packing: none puts one document per row, padded: the trainer's unpacked baseline);
    # packing: none without seq_len: dataio.stream.collate's plain batch (flat tokens + lengths, keys).
    packing: Literal["none", "greedy", "best_fit"] = "none"
    seq_len: int | None = None  # tokens per row; greedy / best_fit without it use DEFAULT_SEQ_LEN
    packing_buffer: int = 1000
    pad_id: int = 0  # input_ids of padding (labels there are -100 whatever it is)
    bucketing: BucketingConfig | None = None
    # The trainer's validation stream: keys laid over this section (e.g. datasets with split: val), one
    # epoch; the loader itself never reads it (see training.validation).
    val: dict[str, Any] | None = None

    def __post_init__(self):
        if not self.datasets:
            raise ValueError("datasets: at least one dataset is needed")
        if self.seq_len is None and self.packing != "none":
            self.seq_len = DEFAULT_SEQ_LEN
        for name in ("batch_size", "shuffle_window", "prefetch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.thd:
            self.packing_config()  # PackingConfig checks seq_len and packing_buffer
        if self.num_workers < 0 or self.max_bad_samples < 0:
            raise ValueError("num_workers and max_bad_samples must be >= 0")
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
        """The packing fields as ``dataio.batching.packing``'s own config (only with ``seq_len`` set)."""
        return PackingConfig(seq_len=self.seq_len, packing=self.packing, pad_id=self.pad_id,
                             packing_buffer=self.packing_buffer)

    @property
    def thd(self) -> bool:
        """Whether token batches are THD rows (``dataio.batching.packing``) rather than the plain collate."""
        return self.seq_len is not None


__all__ = ["DEFAULT_SEQ_LEN", "DataConfig", "DatasetSpec"]
