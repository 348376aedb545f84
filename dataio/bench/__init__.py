"""``dataio bench``: loader throughput of headrace beside peer loaders, on the same samples.

- ``dataio.bench.data``: what is benchmarked (the shard directory of the ``data:`` section, its kind,
  sample count and bytes) and the per-field decode work every loader does alike.
- ``dataio.bench.peers``: one adapter per loader (headrace, webdataset, energon, litdata, lhotse, plain
  torch), each writing its own format with its own writer and reading it by its documented fast path.
- ``dataio.bench.measure``: timing, batch latency percentiles, RSS and CPU summed over worker
  processes, and the simulated trainer step's data wait.
- ``dataio.bench.pagecache``: the physical read limit (the same files read into one buffer).
- ``dataio.bench.trainer``: the trainer's own data path (packing + device prefetch) against a
  simulated step.
- ``dataio.bench.report``: ``results.json``, ``results.md`` and ``throughput.png``.
"""
