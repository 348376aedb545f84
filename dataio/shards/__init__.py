"""The on-disk shard format, the contract between preparation and streaming: tar members and their
naming (``formats``), audio headers (``audioheader``), writing and scanning tar blocks (``tarwriter``,
``tarscan``), the headrace index (``index``), the Megatron-Energon ``.nv-meta`` metadata (``metadata``)
and re-reading a shard directory against all of them (``verify``)."""
