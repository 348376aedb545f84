"""Streaming samples out of shards: sources (``sources``, foreign formats in ``interop``), the epoch
order (``order``), blending (``blend``), the rank/worker split and elastic re-layout (``split``), seeds
(``seeding``), worker processes and the batch ring (``workers``), member decoding (``decode``, DALI in
``dali``) and collation into tensors (``collate``). ``headrace.dataio.loader`` composes them with a batching stage."""
