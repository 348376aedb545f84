"""Streaming samples out of shards, one stage a folder, each importing only the stages below it:
``sources`` (random access to the samples of each dataset, local or remote, foreign formats), ``ordering``
(epoch order, blend, the rank/worker split and elastic re-layout, seeds: pure functions of the config) and
``reading`` (a batch's samples read, decoded and collated, in forked workers). ``datasets`` opens the
``data:`` datasets as sources plus their blend schedule; ``rank`` is one DP rank's position in the global stream
and its plain batches. ``headrace.dataio.loader`` composes them with a batching stage."""
