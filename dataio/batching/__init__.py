"""Turning decoded samples into the batches a trainer consumes: document packing into THD rows
(``packing``), duration bucketing (``bucketing``), the context-parallel split (``cp_split``) and device
prefetch (``prefetch``)."""
