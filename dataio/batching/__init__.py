"""Turning decoded samples into the batches a trainer consumes: the batching stages the loader composes
(``stage``: ``plain``, ``packed``, ``bucketed``) and their algorithms, document packing into THD rows
(``packing``) and duration bucketing (``bucketing``). What happens to a batch after it: ``headrace.dataio.feed``."""
