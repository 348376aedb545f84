"""The on-disk shard format, the contract between preparation and streaming: tar members and their
naming (``formats``), writing and scanning tar blocks (``tarwriter``, ``tarscan``), the headrace index
(``index``) and the Megatron-Energon ``.nv-meta`` metadata (``metadata``)."""
