"""``dataio bench``: loader throughput of headrace beside peer loaders, on the same samples.

- ``headrace.dataio.bench.session``: one session: the loaders, worker counts and repeats in their order, and
  the result.
- ``headrace.dataio.bench.data``: what is benchmarked (the shard directory of the ``data:`` section, its kind,
  sample count and bytes).
- ``headrace.dataio.bench.contract``: the output contract every loader returns per batch (flat tokens +
  lengths; padded audio + lengths; encoded bytes + lengths) and the cheapest code that builds it.
- ``headrace.dataio.bench.peers``: one adapter per loader (headrace on the contract and in its full layout,
  webdataset, energon, litdata, lhotse, plain torch, DALI), each writing its own format with its own
  writer, reading it by its documented fast path and batching by its own stage into the contract.
- ``headrace.dataio.bench.measure``: timing, batch latency percentiles, RSS and CPU summed over worker
  processes, and the simulated trainer step's data wait.
- ``headrace.dataio.bench.pagecache``: the physical read limit (the same files read into one buffer).
- ``headrace.dataio.bench.trainer``: the trainer's own data path (packing + device prefetch) against a
  simulated step.
- ``headrace.dataio.bench.report``: ``results.json``, ``results.md`` and ``throughput.png``.

Shared with the drivers under ``tools/`` (``python -m tools.bench_*``: they parse options, call these
and print; one home each, so every benchmark measures alike):

- ``headrace.dataio.bench.corpus``: seeded synthetic data (speech-like FLAC, long-tailed documents, demo-text
  tokens, indexed token shards); ``python -m headrace.dataio.bench.synth`` writes the large corpus with it.
- ``headrace.dataio.bench.documents``: real English text shipped with every install (package READMEs,
  standard-library docstrings), also the demo corpus's text.
- ``headrace.dataio.bench.timing``: interleaved repeats, best / median of them, CPU seconds.
- ``headrace.dataio.bench.processes``: whole-process timings (``dataio VERB`` of a checkout, ``energon
  prepare``) and the disk's write speed (``dd``).
- ``headrace.dataio.bench.table``: table cells and Markdown rows.
"""
