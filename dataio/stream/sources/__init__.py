"""The source stage of the stream: the datasets of ``data:`` opened as random-access sources of samples (local or
remote shards, their disk cache and storage faults, foreign formats, Energon metadatasets)."""
