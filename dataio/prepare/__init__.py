"""Corpus preparation (``dataio shard``): manifest and corpus readers (``readers``), the sharding plan
(``plan``: splits, shard boundaries, node ownership), audio re-encoding (``audio``) and the per-shard
writer (``writer``). The shard format they produce lives in ``headrace.dataio.shards``."""
